//! Collectives written once over any [`Transport`], for any group of ranks
//! (a subset, in any order): ring all-gather, ring reduce-scatter with a
//! pluggable reduction, pairwise all-to-all with per-peer sizes, all-reduce,
//! broadcast and barrier. Every wait has the communicator's timeout.
//!
//! Tags: each call on a group takes the group's next sequence number, and a
//! message's tag is (group id, sequence, step) (`super::group::tag`). Every member must call the
//! group's collectives in the same order, from one thread at a time — the
//! rule of every collective library.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};

use super::group::{gave_up_tag, tag};
use super::liveness::{self, Liveness};
use super::{CommError, Group, GroupKind, SendHandle, Tag, Transport, scratch};

/// Splits `len` items into `parts` contiguous ranges whose sizes differ by
/// at most one (the first `len % parts` get one more).
pub fn balanced_bounds(len: usize, parts: usize) -> Vec<std::ops::Range<usize>> {
    let (base, extra) = (len / parts, len % parts);
    let mut start = 0;
    (0..parts)
        .map(|i| {
            let n = base + usize::from(i < extra);
            let r = start..start + n;
            start += n;
            r
        })
        .collect()
}

/// How a reduce-scatter combines: `acc` holds the partial result received
/// from the ring predecessor, `mine` this member's share of the same piece
/// (same length); the reduction adds `mine` into `acc`.
pub trait Reduce: Sync {
    fn reduce(&self, acc: &mut [u8], mine: &[u8]) -> Result<(), CommError>;

    /// The byte unit a chunk may be cut at (an element, a quantization
    /// block): the ring sends chunks in pieces of whole granules.
    fn granule(&self) -> usize;
}

/// Byte ranges of `len` f32 values cut into `parts` balanced chunks (the
/// chunks of [`Communicator::reduce_scatter_f32`]).
pub fn f32_byte_bounds(len: usize, parts: usize) -> Vec<std::ops::Range<usize>> {
    balanced_bounds(len, parts)
        .into_iter()
        .map(|r| r.start * 4..r.end * 4)
        .collect()
}

/// About how many bytes a ring reduce-scatter sends per message.
pub const SEGMENT: usize = 1 << 20;

/// `len` bytes cut into at most `parts` ranges of whole `granule`s (the last
/// may hold a partial granule), as even as the granules allow.
fn segment_bounds(len: usize, granule: usize, parts: usize) -> Vec<std::ops::Range<usize>> {
    let granules = len.div_ceil(granule);
    balanced_bounds(granules, parts)
        .into_iter()
        .map(|r| (r.start * granule).min(len)..(r.end * granule).min(len))
        .collect()
}

/// Element-wise f32 sum (little-endian f32 buffers).
pub struct SumF32;

impl Reduce for SumF32 {
    fn granule(&self) -> usize {
        4
    }

    fn reduce(&self, acc: &mut [u8], incoming: &[u8]) -> Result<(), CommError> {
        if acc.len() != incoming.len() || !acc.len().is_multiple_of(4) {
            return Err(CommError::Malformed(format!(
                "f32 sum of {} and {} bytes",
                acc.len(),
                incoming.len()
            )));
        }
        match bytemuck::try_cast_slice_mut::<u8, f32>(acc) {
            // The usual case: an allocator-aligned buffer, summed as f32.
            Ok(acc) => {
                for (a, b) in acc.iter_mut().zip(incoming.chunks_exact(4)) {
                    *a += f32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            Err(_) => {
                for (a, b) in acc.chunks_exact_mut(4).zip(incoming.chunks_exact(4)) {
                    let s = f32::from_ne_bytes([a[0], a[1], a[2], a[3]])
                        + f32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
                    a.copy_from_slice(&s.to_ne_bytes());
                }
            }
        }
        Ok(())
    }
}

// Buffers on the wire hold f32 in the machine's byte order: zeropp runs on
// little-endian machines only (x86-64, aarch64), checked at compile time.
const _: () = assert!(
    cfg!(target_endian = "little"),
    "zeropp's wire format is little-endian"
);

/// f32 slice to its bytes (one copy).
pub fn f32_bytes(x: &[f32]) -> Bytes {
    Bytes::copy_from_slice(bytemuck::cast_slice(x))
}

/// An f32 vector as `Bytes`, without a copy.
pub fn f32_vec_bytes(x: Vec<f32>) -> Bytes {
    Bytes::from_owner(scratch::Returned(x))
}

/// Bytes to f32 (the length must be a multiple of 4; one copy).
pub fn bytes_f32(b: &[u8]) -> Result<Vec<f32>, CommError> {
    if !b.len().is_multiple_of(4) {
        return Err(CommError::Malformed(format!(
            "{} bytes is not a whole number of f32",
            b.len()
        )));
    }
    let mut out = vec![0f32; b.len() / 4];
    bytemuck::cast_slice_mut::<f32, u8>(&mut out).copy_from_slice(b);
    Ok(out)
}

/// Runs collectives for one rank over a transport.
pub struct Communicator {
    /// This rank's waits and the answers to other ranks' inquiries (before
    /// `transport`: its responder ends before the transport is let go).
    liveness: Arc<Liveness>,
    transport: Arc<dyn Transport>,
    timeout: Duration,
}

impl Communicator {
    pub fn new(transport: Arc<dyn Transport>, timeout: Duration) -> Self {
        Communicator {
            liveness: Liveness::of(&transport),
            transport,
            timeout,
        }
    }

    pub fn rank(&self) -> usize {
        self.transport.rank()
    }

    pub fn world_size(&self) -> usize {
        self.transport.world_size()
    }

    pub fn transport(&self) -> &Arc<dyn Transport> {
        &self.transport
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The group of every rank, id 0.
    pub fn world_group(&self) -> Group {
        Group::new(GroupKind::World, (0..self.world_size()).collect())
            .expect("0..n is distinct and non-empty")
    }

    /// This rank's index in `group`.
    fn index_in(&self, group: &Group) -> Result<usize, CommError> {
        group
            .ranks()
            .iter()
            .position(|&r| r == self.rank())
            .ok_or_else(|| CommError::NotInGroup {
                rank: self.rank(),
                group: group.id(),
                ranks: group.ranks().to_vec(),
            })
    }

    fn send(&self, peer: usize, tag: Tag, data: Bytes) -> Result<SendHandle, CommError> {
        self.transport.send(peer, tag, data)
    }

    /// The next message from `peer` under `tag`; a wait that times out
    /// names the rank the job is stuck on ([`Liveness::culprit`]).
    fn recv(&self, peer: usize, tag: Tag) -> Result<Bytes, CommError> {
        let t = &*self.transport;
        // Still waiting on `peer` while finding the culprit: an inquiry
        // from another rank meanwhile is told so.
        self.liveness.waiting_on(peer, || {
            t.recv(peer, tag, self.timeout).map_err(|e| match e {
                // `peer` gave the call up blaming this rank (it took
                // this rank, slow to come, for stuck).
                CommError::PeerFailed {
                    peer: blamed,
                    reason,
                } if blamed == self.rank() => CommError::GaveUp {
                    by: peer,
                    reason: format!("it blamed this rank: {reason}"),
                },
                e => self.liveness.culprit(t, peer, e),
            })
        })
    }

    /// Runs `group`'s next call: `f` with its sequence number. If it
    /// fails, the other members hear that this rank gave it up and why
    /// ([`liveness::gave_up`]): a member waiting on this rank in it fails
    /// at once, blaming the rank this one blamed. Without it a member whose
    /// ring predecessor gave up a call because a third rank died would wait
    /// its timeout and then blame the predecessor, alive (islands: it would
    /// take a live island out).
    fn call<T>(
        &self,
        group: &Group,
        f: impl FnOnce(u32) -> Result<T, CommError>,
    ) -> Result<T, CommError> {
        let call = group.next_call();
        f(call).inspect_err(|e| self.tell_gave_up(group, call, e))
    }

    /// Tells `group`'s other members that this rank gives up its next call
    /// there after `e` — a failure of its own (a value that is not finite,
    /// bad input: `CommError::GaveUp` with the reason), or one in another
    /// group's call (the rank it blamed is blamed) — before it sent
    /// anything in it: a member waiting on it in that call fails at once
    /// with the reason instead of waiting its timeout for a rank that is
    /// alive and will never send. For jobs that cannot go on after a
    /// failure (not the islands' outer exchanges, which go on without a
    /// lost island).
    pub fn give_up_next(&self, group: &Group, e: &CommError) {
        self.tell_gave_up(group, group.next_call(), e);
    }

    /// The notice that this rank gave up `group`'s `call` after `e`, to
    /// every other member ([`liveness::gave_up`]).
    fn tell_gave_up(&self, group: &Group, call: u32, e: &CommError) {
        let notice = liveness::gave_up(self.rank(), tag(group, call, 0), e);
        for &r in group.ranks().iter().filter(|&&r| r != self.rank()) {
            // A rank gone takes no notice.
            let _ = self.transport.send(r, gave_up_tag(), notice.clone());
        }
    }

    fn wait_all(&self, sends: Vec<(usize, SendHandle)>) -> Result<(), CommError> {
        for (peer, h) in sends {
            let t = &*self.transport;
            let waited = self.liveness.waiting_on(peer, || {
                h.wait(peer, self.timeout)
                    .map_err(|e| self.liveness.culprit(t, peer, e))
            });
            if let Err(e) = waited {
                // A failed send is usually a symptom (the peer left because a
                // third rank died): give that death a moment to be reported,
                // then name it.
                let until = std::time::Instant::now() + Duration::from_secs(2);
                loop {
                    if let Some((peer, reason)) = self.transport.first_death() {
                        return Err(CommError::PeerFailed { peer, reason });
                    }
                    if std::time::Instant::now() >= until {
                        return Err(e);
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
        Ok(())
    }

    /// Ring all-gather of one block per member (blocks may differ in size):
    /// returns every member's block, in group order.
    pub fn all_gather_v(&self, group: &Group, mine: Bytes) -> Result<Vec<Bytes>, CommError> {
        let me = self.index_in(group)?;
        self.call(group, |call| {
            let p = group.size();
            let next = group.ranks()[(me + 1) % p];
            let prev = group.ranks()[(me + p - 1) % p];
            let mut blocks: Vec<Option<Bytes>> = vec![None; p];
            // Every block but the last received is both kept and sent on:
            // staged, a send to a node-local successor shares it instead of
            // copying it (`Transport::stage`).
            blocks[me] = Some(self.transport.stage(next, mine));
            let mut sends = Vec::with_capacity(p);
            for step in 0..p.saturating_sub(1) {
                let send_idx = (me + p - step) % p;
                let recv_idx = (me + p - step - 1) % p;
                let block = blocks[send_idx]
                    .clone()
                    .expect("received in the previous step");
                sends.push((next, self.send(next, tag(group, call, step), block)?));
                let got = self.recv(prev, tag(group, call, step))?;
                blocks[recv_idx] = Some(if step + 2 < p {
                    self.transport.stage(next, got)
                } else {
                    got
                });
            }
            self.wait_all(sends)?;
            Ok(blocks
                .into_iter()
                .map(|b| b.expect("all blocks arrived"))
                .collect())
        })
    }

    /// Ring all-gather of equal blocks, concatenated in group order.
    pub fn all_gather(&self, group: &Group, mine: Bytes) -> Result<Vec<u8>, CommError> {
        let len = mine.len();
        let blocks = self.all_gather_v(group, mine)?;
        let mut out = Vec::with_capacity(len * blocks.len());
        for (i, b) in blocks.iter().enumerate() {
            if b.len() != len {
                return Err(CommError::Invalid(format!(
                    "all-gather expects equal blocks: this rank has {len} bytes, member {i} \
                     (rank {}) has {}",
                    group.ranks()[i],
                    b.len()
                )));
            }
            out.extend_from_slice(b);
        }
        Ok(out)
    }

    /// Ring reduce-scatter: `data` is this member's full buffer, cut at
    /// `bounds` (one byte range per member, covering `data`); returns member
    /// `me`'s range reduced over all members with `reduce`.
    ///
    /// Each chunk travels in segments of about [`SEGMENT`] bytes (whole
    /// granules of the reduction), and a segment is forwarded as soon as it
    /// is reduced, so the reduction of one segment overlaps with the transfer
    /// of the next instead of adding to every ring step.
    pub fn reduce_scatter(
        &self,
        group: &Group,
        data: &[u8],
        bounds: &[std::ops::Range<usize>],
        reduce: &dyn Reduce,
    ) -> Result<Vec<u8>, CommError> {
        self.reduce_scatter_vec(group, data, None, bounds, reduce)
    }

    /// [`Communicator::reduce_scatter`] of a buffer the caller hands over:
    /// this member's first chunk is sent from it without a copy.
    pub fn reduce_scatter_bytes(
        &self,
        group: &Group,
        data: Bytes,
        bounds: &[std::ops::Range<usize>],
        reduce: &dyn Reduce,
    ) -> Result<Vec<u8>, CommError> {
        self.reduce_scatter_vec(group, &data, Some(&data), bounds, reduce)
    }

    /// The reduce-scatter into a new vector of this member's range.
    fn reduce_scatter_vec(
        &self,
        group: &Group,
        data: &[u8],
        owned: Option<&Bytes>,
        bounds: &[std::ops::Range<usize>],
        reduce: &dyn Reduce,
    ) -> Result<Vec<u8>, CommError> {
        let me = self.index_in(group)?;
        let mut out = scratch::take_for_overwrite(bounds.get(me).map_or(0, |r| r.len()));
        self.reduce_scatter_into(group, data, owned, bounds, reduce, &mut out)?;
        Ok(out)
    }

    /// The reduce-scatter into `out`, which must hold exactly this member's
    /// range; `owned` is `data` as `Bytes` when the caller handed it over.
    fn reduce_scatter_into(
        &self,
        group: &Group,
        data: &[u8],
        owned: Option<&Bytes>,
        bounds: &[std::ops::Range<usize>],
        reduce: &dyn Reduce,
        out: &mut [u8],
    ) -> Result<(), CommError> {
        let me = self.index_in(group)?;
        self.call(group, |call| {
            let p = group.size();
            if bounds.len() != p
                || bounds.iter().any(|r| r.end > data.len() || r.start > r.end)
                || out.len() != bounds[me].len()
            {
                return Err(CommError::Invalid(format!(
                    "reduce-scatter needs {p} ranges inside {} bytes, got {bounds:?}",
                    data.len()
                )));
            }
            if p == 1 {
                out.copy_from_slice(&data[bounds[0].clone()]);
                return Ok(());
            }
            let next = group.ranks()[(me + 1) % p];
            let prev = group.ranks()[(me + p - 1) % p];
            let granule = reduce.granule().max(1);
            let longest = bounds.iter().map(|r| r.len()).max().unwrap_or(0);
            // Every member derives the same count from the same bounds; the
            // tag's 16-bit step field holds (step, segment).
            let segments = longest
                .div_ceil(SEGMENT)
                .clamp(1, (0xffff / (p - 1)).max(1));
            let pieces = |chunk: usize| {
                let r = &bounds[chunk];
                segment_bounds(r.len(), granule, segments)
                    .into_iter()
                    .map(move |s| r.start + s.start..r.start + s.end)
            };
            let step_tag =
                |step: usize, segment: usize| tag(group, call, step * segments + segment);
            // At step s this member sends its partial of chunk (me - s - 1) and
            // receives the partial of chunk (me - s - 2), adding its own share
            // (which it then sends at step s + 1); after p - 1 steps it holds
            // chunk `me` reduced over everyone.
            let mut sends = Vec::with_capacity(p * segments);
            for (j, r) in pieces((me + p - 1) % p).enumerate() {
                let first = match owned {
                    Some(b) => b.slice(r),
                    None => Bytes::copy_from_slice(&data[r]),
                };
                sends.push((next, self.send(next, step_tag(0, j), first)?));
            }
            let mut filled = 0;
            for step in 0..p - 1 {
                let chunk = (me + 2 * p - step - 2) % p;
                for (j, r) in pieces(chunk).enumerate() {
                    let mine = &data[r];
                    let incoming = self.recv(prev, step_tag(step, j))?;
                    if incoming.len() != mine.len() {
                        return Err(CommError::Malformed(format!(
                            "reduce-scatter step {step}: rank {prev} sent {} bytes for a {}-byte \
                             piece; every member must pass the same sizes",
                            incoming.len(),
                            mine.len()
                        )));
                    }
                    let mut acc = Partial::of(incoming);
                    reduce.reduce(acc.as_mut(), mine)?;
                    if step + 2 < p {
                        sends.push((
                            next,
                            self.send(next, step_tag(step + 1, j), acc.into_bytes())?,
                        ));
                    } else {
                        let acc = acc.as_mut();
                        out[filled..filled + acc.len()].copy_from_slice(acc);
                        filled += acc.len();
                    }
                }
            }
            self.wait_all(sends)?;
            Ok(())
        })
    }

    /// Reduce-scatter of an f32 buffer cut into balanced chunks.
    pub fn reduce_scatter_f32(&self, group: &Group, data: &[f32]) -> Result<Vec<f32>, CommError> {
        self.reduce_scatter_f32_from(group, bytemuck::cast_slice(data), None)
    }

    /// [`Communicator::reduce_scatter_f32`] of a buffer the caller hands
    /// over (no copy of this member's first chunk).
    pub fn reduce_scatter_f32_vec(
        &self,
        group: &Group,
        data: Vec<f32>,
    ) -> Result<Vec<f32>, CommError> {
        let owned = f32_vec_bytes(data);
        self.reduce_scatter_f32_from(group, &owned, Some(&owned))
    }

    fn reduce_scatter_f32_from(
        &self,
        group: &Group,
        data: &[u8],
        owned: Option<&Bytes>,
    ) -> Result<Vec<f32>, CommError> {
        let bounds = f32_byte_bounds(data.len() / 4, group.size());
        let me = self.index_in(group)?;
        let mut out = scratch::take_for_overwrite(bounds[me].len() / 4);
        self.reduce_scatter_into(
            group,
            data,
            owned,
            &bounds,
            &SumF32,
            bytemuck::cast_slice_mut(&mut out),
        )?;
        Ok(out)
    }

    /// All-reduce (sum) of an f32 buffer: reduce-scatter, then all-gather.
    pub fn all_reduce_f32(&self, group: &Group, data: &[f32]) -> Result<Vec<f32>, CommError> {
        let mut out = vec![0f32; data.len()];
        self.all_reduce_f32_into(group, data, &mut out)?;
        Ok(out)
    }

    /// [`Communicator::all_reduce_f32`] into `out` (as long as `data`), as
    /// `MPI_Allreduce` writes its receive buffer: this member's reduced
    /// range lands there directly, the others' as they arrive.
    pub fn all_reduce_f32_into(
        &self,
        group: &Group,
        data: &[f32],
        out: &mut [f32],
    ) -> Result<(), CommError> {
        if out.len() != data.len() {
            return Err(CommError::Invalid(format!(
                "all-reduce of {} values into a buffer of {}",
                data.len(),
                out.len()
            )));
        }
        let me = self.index_in(group)?;
        let bounds = f32_byte_bounds(data.len(), group.size());
        let out: &mut [u8] = bytemuck::cast_slice_mut(out);
        self.reduce_scatter_into(
            group,
            bytemuck::cast_slice(data),
            None,
            &bounds,
            &SumF32,
            &mut out[bounds[me].clone()],
        )?;
        let mine = Bytes::copy_from_slice(&out[bounds[me].clone()]);
        let blocks = self.all_gather_v(group, mine)?;
        for (i, (b, r)) in blocks.iter().zip(&bounds).enumerate() {
            if b.len() != r.len() {
                return Err(CommError::Malformed(format!(
                    "all-reduce: member {i} (rank {}) gathered {} bytes for a {}-byte range; \
                     members passed different sizes",
                    group.ranks()[i],
                    b.len(),
                    r.len()
                )));
            }
            if i != me {
                out[r.clone()].copy_from_slice(b);
            }
        }
        Ok(())
    }

    /// Pairwise all-to-all: `to_each[i]` goes to member `i` (sizes may
    /// differ); returns what each member sent to this one, in group order.
    pub fn all_to_all_v(
        &self,
        group: &Group,
        to_each: Vec<Bytes>,
    ) -> Result<Vec<Bytes>, CommError> {
        let me = self.index_in(group)?;
        self.call(group, |call| {
            let p = group.size();
            if to_each.len() != p {
                return Err(CommError::Invalid(format!(
                    "all-to-all needs one buffer per member ({p}), got {}",
                    to_each.len()
                )));
            }
            let mut received: Vec<Option<Bytes>> = vec![None; p];
            let mut outgoing: Vec<Option<Bytes>> = to_each.into_iter().map(Some).collect();
            received[me] = outgoing[me].take();
            let mut sends = Vec::with_capacity(p);
            for step in 1..p {
                let dst = (me + step) % p;
                let data = outgoing[dst].take().expect("each destination once");
                sends.push((
                    group.ranks()[dst],
                    self.send(group.ranks()[dst], tag(group, call, 0), data)?,
                ));
            }
            for step in 1..p {
                let src = (me + p - step) % p;
                received[src] = Some(self.recv(group.ranks()[src], tag(group, call, 0))?);
            }
            self.wait_all(sends)?;
            Ok(received
                .into_iter()
                .map(|b| b.expect("all arrived"))
                .collect())
        })
    }

    /// Broadcast from member `root`: returns the root's buffer everywhere
    /// (`data` is ignored on the others).
    pub fn broadcast(&self, group: &Group, root: usize, data: Bytes) -> Result<Bytes, CommError> {
        let me = self.index_in(group)?;
        self.call(group, |call| {
            if root >= group.size() {
                return Err(CommError::Invalid(format!(
                    "broadcast root {root} outside a group of {}",
                    group.size()
                )));
            }
            if me == root {
                let mut sends = Vec::new();
                for (i, &r) in group.ranks().iter().enumerate() {
                    if i != root {
                        sends.push((r, self.send(r, tag(group, call, 0), data.clone())?));
                    }
                }
                self.wait_all(sends)?;
                Ok(data)
            } else {
                self.recv(group.ranks()[root], tag(group, call, 0))
            }
        })
    }

    /// Returns once every member has entered (dissemination barrier).
    pub fn barrier(&self, group: &Group) -> Result<(), CommError> {
        let me = self.index_in(group)?;
        self.call(group, |call| {
            let p = group.size();
            let mut k = 1;
            let mut step = 0;
            let mut sends = Vec::new();
            while k < p {
                let to = group.ranks()[(me + k) % p];
                let from = group.ranks()[(me + p - k) % p];
                sends.push((to, self.send(to, tag(group, call, step), Bytes::new())?));
                self.recv(from, tag(group, call, step))?;
                k *= 2;
                step += 1;
            }
            self.wait_all(sends)
        })
    }
}

/// A ring step's partial sum: the received buffer itself where it is
/// this member's alone, else a reused copy of it ([`scratch`]).
enum Partial {
    Received(BytesMut),
    Copied(scratch::Returned<u8>),
}

impl Partial {
    fn of(incoming: Bytes) -> Partial {
        match incoming.try_into_mut() {
            Ok(own) => Partial::Received(own),
            Err(shared) => Partial::Copied(scratch::copied(&shared)),
        }
    }

    fn as_mut(&mut self) -> &mut [u8] {
        match self {
            Partial::Received(b) => b,
            Partial::Copied(c) => &mut c.0,
        }
    }

    fn into_bytes(self) -> Bytes {
        match self {
            Partial::Received(b) => b.freeze(),
            Partial::Copied(c) => Bytes::from_owner(c),
        }
    }
}

/// A result that a communication thread is computing (its error: `E`).
pub struct Pending<T, E = CommError> {
    rx: mpsc::Receiver<Result<T, E>>,
}

impl<T, E: From<CommError>> Pending<T, E> {
    /// Waits for the result (the collective inside has its own timeouts).
    pub fn wait(self) -> Result<T, E> {
        self.rx.recv().unwrap_or(Err(CommError::Closed.into()))
    }

    /// The result if it is ready.
    pub fn try_take(&self) -> Option<Result<T, E>> {
        self.rx.try_recv().ok()
    }
}

/// A closure queued on a [`CommThread`].
type Task = Box<dyn FnOnce(&Communicator) + Send>;

/// A thread that runs collectives in submission order, so the caller can
/// start the next gather and compute while it runs.
pub struct CommThread {
    tasks: Option<mpsc::Sender<Task>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl CommThread {
    pub fn new(comm: Arc<Communicator>) -> Self {
        let (tasks, rx) = mpsc::channel::<Task>();
        let thread = std::thread::Builder::new()
            .name("zeropp-comm".into())
            .spawn(move || {
                for task in rx {
                    task(&comm);
                }
            })
            .expect("spawning the communication thread");
        CommThread {
            tasks: Some(tasks),
            thread: Some(thread),
        }
    }

    /// Queues `f` to run on the communication thread.
    pub fn submit<T: Send + 'static, E: Send + 'static>(
        &self,
        f: impl FnOnce(&Communicator) -> Result<T, E> + Send + 'static,
    ) -> Pending<T, E> {
        // One slot, allocated here: the communication thread's send of the
        // result allocates nothing (an unbounded channel's first send
        // allocates a block of slots on the sending thread).
        let (tx, rx) = mpsc::sync_channel(1);
        let task: Task = Box::new(move |c| {
            let _ = tx.send(f(c));
        });
        if let Some(tasks) = &self.tasks {
            // If the thread is gone the receiver reports `Closed`.
            let _ = tasks.send(task);
        }
        Pending { rx }
    }
}

impl Drop for CommThread {
    fn drop(&mut self) {
        self.tasks.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inproc::InProcess;

    /// Runs `f(comm)` on `n` in-process ranks and returns their results.
    fn on_ranks<T: Send + 'static>(
        n: usize,
        f: impl Fn(&Communicator) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let f = Arc::new(f);
        let handles: Vec<_> = InProcess::world(n)
            .into_iter()
            .map(|t| {
                let f = f.clone();
                std::thread::spawn(move || {
                    let comm = Communicator::new(Arc::new(t), Duration::from_secs(10));
                    f(&comm)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    fn block(rank: usize, len: usize) -> Vec<u8> {
        (0..len).map(|i| (rank * 31 + i * 7) as u8).collect()
    }

    #[test]
    fn all_gather_returns_every_block_in_group_order() {
        for n in [1, 2, 3, 4, 5] {
            for len in [0, 1, 1000] {
                let out = on_ranks(n, move |c| {
                    let g = c.world_group();
                    c.all_gather(&g, Bytes::from(block(c.rank(), len))).unwrap()
                });
                let expect: Vec<u8> = (0..n).flat_map(|r| block(r, len)).collect();
                assert!(out.iter().all(|o| *o == expect), "n={n} len={len}");
            }
        }
    }

    #[test]
    fn reduce_scatter_and_all_reduce_sum_exactly() {
        for n in [1, 2, 3, 4] {
            for len in [0, 1, 7, 1001] {
                // Integer-valued floats: sums are exact in any order.
                let data = move |r: usize| -> Vec<f32> {
                    (0..len).map(|i| ((r + 1) * (i % 13)) as f32).collect()
                };
                let total: Vec<f32> = (0..len)
                    .map(|i| (0..n).map(|r| ((r + 1) * (i % 13)) as f32).sum())
                    .collect();
                let out = on_ranks(n, move |c| {
                    let g = c.world_group();
                    let mine = c.reduce_scatter_f32(&g, &data(c.rank())).unwrap();
                    let all = c.all_reduce_f32(&g, &data(c.rank())).unwrap();
                    let mut into = vec![f32::NAN; len];
                    c.all_reduce_f32_into(&g, &data(c.rank()), &mut into)
                        .unwrap();
                    assert_eq!(into, all);
                    let short = c.all_reduce_f32_into(&g, &data(c.rank()), &mut [0.0; 2]);
                    assert!(
                        matches!(short, Err(CommError::Invalid(_))) == (len != 2),
                        "{short:?}"
                    );
                    (mine, all)
                });
                let bounds = balanced_bounds(len, n);
                for (r, (mine, all)) in out.iter().enumerate() {
                    assert_eq!(
                        mine[..],
                        total[bounds[r].clone()],
                        "n={n} len={len} rank {r}"
                    );
                    assert_eq!(all, &total, "n={n} len={len} rank {r}");
                }
            }
        }
    }

    /// Chunks longer than a segment travel in pieces: every piece the
    /// reduction sees is whole granules (but the chunk's tail), and the
    /// result is exact, with the caller's buffer handed over or borrowed.
    #[test]
    fn long_chunks_are_reduced_in_pieces_of_whole_granules() {
        /// Sums u32 triples (12-byte granules), checking each piece's cut.
        struct Triples;
        impl Reduce for Triples {
            fn granule(&self) -> usize {
                12
            }
            fn reduce(&self, acc: &mut [u8], mine: &[u8]) -> Result<(), CommError> {
                assert!(acc.len() <= SEGMENT + 12, "a piece of {} bytes", acc.len());
                // Whole granules, or the buffer's last piece (8-byte tail).
                assert!(
                    matches!(acc.len() % 12, 0 | 8),
                    "a cut granule: {}",
                    acc.len()
                );
                for (a, b) in acc.chunks_exact_mut(4).zip(mine.chunks_exact(4)) {
                    let s = u32::from_le_bytes(a.try_into().unwrap())
                        + u32::from_le_bytes(b.try_into().unwrap());
                    a.copy_from_slice(&s.to_le_bytes());
                }
                Ok(())
            }
        }
        let n = 3;
        let len = 3 * SEGMENT + 12 * 1001 + 8; // a partial granule at the end
        let words = move |r: usize| -> Vec<u8> {
            (0..len / 4)
                .flat_map(|i| ((r as u32 + 1) * (i as u32 % 1009)).to_le_bytes())
                .collect()
        };
        // Chunk cuts on whole granules, as a caller of a blocked format would.
        let bounds = segment_bounds(len, 12, n);
        let expect: Vec<u8> = (0..len / 4)
            .flat_map(|i| (6 * (i as u32 % 1009)).to_le_bytes())
            .collect();
        let b = bounds.clone();
        let out = on_ranks(n, move |c| {
            let g = c.world_group();
            let borrowed = c
                .reduce_scatter(&g, &words(c.rank()), &b, &Triples)
                .unwrap();
            let owned = c
                .reduce_scatter_bytes(&g, words(c.rank()).into(), &b, &Triples)
                .unwrap();
            (borrowed, owned)
        });
        for (r, (borrowed, owned)) in out.iter().enumerate() {
            assert!(
                bounds[r].len() > SEGMENT,
                "the test needs multi-piece chunks"
            );
            assert!(borrowed[..] == expect[bounds[r].clone()], "rank {r}");
            assert_eq!(borrowed, owned, "rank {r}");
        }
        // f32, handed over.
        let out = on_ranks(n, move |c| {
            let data: Vec<f32> = (0..len / 4).map(|i| (i % 5) as f32).collect();
            c.reduce_scatter_f32_vec(&c.world_group(), data).unwrap()
        });
        let f32_bounds = balanced_bounds(len / 4, n);
        for (r, mine) in out.iter().enumerate() {
            let want: Vec<f32> = f32_bounds[r]
                .clone()
                .map(|i| 3.0 * (i % 5) as f32)
                .collect();
            assert_eq!(mine, &want, "rank {r}");
        }
    }

    #[test]
    fn subgroups_in_any_order_run_side_by_side() {
        // Ranks 0..6 as two groups of three listed out of order, plus the world.
        let out = on_ranks(6, |c| {
            let a = Group::new(GroupKind::Numbered(1), vec![4, 0, 2]).unwrap();
            let b = Group::new(GroupKind::Numbered(2), vec![5, 3, 1]).unwrap();
            let g = if c.rank() % 2 == 0 { a } else { b };
            let gathered = c
                .all_gather(&g, Bytes::from(vec![c.rank() as u8; 2]))
                .unwrap();
            let world = c.world_group();
            c.barrier(&world).unwrap();
            let root_says = c
                .broadcast(&g, 1, Bytes::from(vec![c.rank() as u8]))
                .unwrap();
            (gathered, root_says.to_vec())
        });
        assert_eq!(out[0].0, vec![4, 4, 0, 0, 2, 2]);
        assert_eq!(out[3].0, vec![5, 5, 3, 3, 1, 1]);
        assert_eq!(out[4].1, vec![0]); // member 1 of group a is rank 0
        assert_eq!(out[5].1, vec![3]);
    }

    #[test]
    fn all_to_all_delivers_each_peer_its_own_sized_buffer() {
        for n in [1, 2, 3, 4] {
            let out = on_ranks(n, move |c| {
                let g = c.world_group();
                let me = c.rank();
                let to_each = (0..n)
                    .map(|d| Bytes::from(vec![(me * 10 + d) as u8; me + d]))
                    .collect();
                c.all_to_all_v(&g, to_each).unwrap()
            });
            for (me, got) in out.iter().enumerate() {
                for (src, b) in got.iter().enumerate() {
                    assert_eq!(b.to_vec(), vec![(src * 10 + me) as u8; src + me]);
                }
            }
        }
    }

    #[test]
    fn a_dead_rank_is_named_not_waited_for() {
        let out = on_ranks(3, |c| {
            if c.rank() == 2 {
                return Ok(()); // leaves without joining: its transport drops
            }
            let g = c.world_group();
            c.all_gather(&g, Bytes::from_static(b"x")).map(|_| ())
        });
        // Rank 0 waits on rank 2 and names it; rank 1 waits on rank 0, which
        // then gives up: both end with an error, neither hangs.
        let err = out[0].as_ref().unwrap_err().to_string();
        assert!(err.contains("rank 2"), "rank 0: {err}");
        assert!(out[1].is_err());
    }

    /// Rank 2 is stopped (alive, silent: its transport open, nothing
    /// running); rank 1 waits on it, rank 0 on rank 1. Both name rank 2:
    /// rank 0 follows rank 1's answer to its inquiry (or takes rank 1's
    /// verdict), it does not blame rank 1.
    #[test]
    fn a_stall_that_spread_names_the_stopped_rank_not_the_one_waited_on() {
        let mut world = InProcess::world(3);
        let stopped = world.pop().unwrap();
        let timeout = Duration::from_millis(500);
        let waiting: Vec<_> = world
            .into_iter()
            .map(|t| {
                std::thread::spawn(move || {
                    let c = Communicator::new(Arc::new(t), timeout);
                    let (ranks, n) = match c.rank() {
                        0 => (vec![0, 1], 1),
                        _ => (vec![1, 2], 2),
                    };
                    let g = Group::new(GroupKind::Numbered(n), ranks).unwrap();
                    let started = std::time::Instant::now();
                    let e = c.all_gather(&g, Bytes::from_static(b"x")).unwrap_err();
                    (e, started.elapsed())
                })
            })
            .collect();
        let out: Vec<_> = waiting.into_iter().map(|h| h.join().unwrap()).collect();
        for (rank, (e, took)) in out.iter().enumerate() {
            let named = match e {
                CommError::PeerFailed { peer, .. } | CommError::Timeout { peer, .. } => *peer,
                other => panic!("rank {rank}: {other}"),
            };
            assert_eq!(named, 2, "rank {rank}: {e}");
            assert!(*took < Duration::from_secs(8), "rank {rank} took {took:?}");
        }
        assert!(
            out[0].0.to_string().contains("stopped or hung"),
            "{}",
            out[0].0
        );
        drop(stopped);
    }

    /// Ring 0 → 1 → 2 → 0 with rank 2 dying inside an all-gather, after
    /// its first part reached rank 0: rank 0 forwards everything rank 1
    /// needs, then gives the call up at its last receive; rank 1 completes
    /// the call and waits on rank 0 in the next one. Rank 0 left the group
    /// (it gave a call up because rank 2 failed), so rank 1 fails at once
    /// naming rank 2, instead of waiting its timeout and blaming rank 0.
    #[test]
    fn a_member_that_completed_the_call_a_peer_gave_up_does_not_wait_for_it_in_the_next() {
        let mut world = InProcess::world(3);
        let dead = world.pop().unwrap();
        let group = || Group::new(GroupKind::Numbered(0), vec![0, 1, 2]).unwrap();
        // Rank 2's part of step 0 of call 0, then nothing.
        dead.send(0, tag(&group(), 0, 0), Bytes::from_static(b"2"))
            .unwrap();
        let timeout = Duration::from_secs(20);
        let out: Vec<_> = world
            .into_iter()
            .map(|t| {
                std::thread::spawn(move || {
                    t.contain_deaths(t.rank()..t.rank() + 1);
                    t.declare_dead(2, "killed".into());
                    let c = Communicator::new(Arc::new(t), timeout);
                    let g = group();
                    let started = std::time::Instant::now();
                    let first = c.all_gather_v(&g, Bytes::from_static(b"x"));
                    let next = first.is_ok().then(|| c.barrier(&g));
                    (first.map(|b| b.len()), next, started.elapsed())
                })
            })
            .map(|h| h.join().unwrap())
            .collect();
        let named = |e: &CommError| matches!(e, CommError::PeerFailed { peer: 2, .. });
        let (first, next, _) = &out[0];
        assert!(first.as_ref().is_err_and(named), "rank 0: {first:?}");
        assert!(next.is_none());
        let (first, next, took) = &out[1];
        assert_eq!(first.as_ref().ok(), Some(&3), "rank 1 completes the call");
        let next = next.as_ref().unwrap();
        assert!(next.as_ref().is_err_and(named), "rank 1: {next:?}");
        assert!(*took < timeout / 2, "rank 1 waited {took:?}");
        drop(dead);
    }

    /// Rank 0 gave a call up blaming rank 1 (it took rank 1, slow to come,
    /// for stuck): rank 1's wait on it there says rank 0 gave up, not that
    /// rank 1 itself failed.
    #[test]
    fn a_rank_blamed_by_the_peer_that_gave_up_is_told_who_gave_up() {
        let mut world = InProcess::world(2);
        let c1 = Communicator::new(Arc::new(world.pop().unwrap()), Duration::from_secs(20));
        let t0 = world.pop().unwrap();
        let g = Group::new(GroupKind::Numbered(0), vec![0, 1]).unwrap();
        let slow = CommError::Timeout {
            peer: 1,
            tag: 0,
            waited: Duration::from_secs(20),
        };
        let notice = liveness::gave_up(0, tag(&g, 0, 0), &slow);
        t0.send(1, gave_up_tag(), notice).unwrap();
        match c1.all_gather_v(&g, Bytes::from_static(b"late")) {
            Err(e @ CommError::GaveUp { by: 0, .. }) => {
                assert!(e.to_string().contains("blamed this rank"), "{e}")
            }
            other => panic!("expected rank 0's giving up, got {other:?}"),
        }
    }

    /// A live rank that is not in the collective (slow, or calling another
    /// one) answers the inquiry: the wait's own timeout names it, and no
    /// rank is told it died.
    #[test]
    fn a_live_rank_outside_the_collective_is_named_but_not_declared_dead() {
        let mut world = InProcess::world(2);
        let c1 = Communicator::new(Arc::new(world.pop().unwrap()), Duration::from_secs(5));
        let c0 = Communicator::new(Arc::new(world.pop().unwrap()), Duration::from_millis(300));
        let err = c0.barrier(&c0.world_group()).unwrap_err();
        assert!(matches!(err, CommError::Timeout { peer: 1, .. }), "{err}");
        assert!(c0.transport().first_death().is_none());
        assert!(c1.transport().first_death().is_none());
    }

    #[test]
    fn a_missing_message_times_out_with_the_peer_named() {
        let mut world = InProcess::world(2);
        let t1 = world.pop().unwrap();
        let t0 = world.pop().unwrap();
        let c0 = Communicator::new(Arc::new(t0), Duration::from_millis(100));
        let err = c0.barrier(&c0.world_group()).unwrap_err();
        assert!(matches!(err, CommError::Timeout { peer: 1, .. }), "{err}");
        drop(t1);
    }

    #[test]
    fn the_comm_thread_overlaps_with_the_caller() {
        let out = on_ranks(3, |c| {
            let comm = Arc::new(Communicator::new(c.transport().clone(), c.timeout()));
            let thread = CommThread::new(comm);
            let g = Arc::new(Group::new(GroupKind::Numbered(7), vec![0, 1, 2]).unwrap());
            let rank = c.rank();
            let gg = g.clone();
            let pending = thread.submit(move |c| c.all_gather(&gg, Bytes::from(vec![rank as u8])));
            let busy: u64 = (0..100_000u64).sum(); // the caller computes meanwhile
            (pending.wait().unwrap(), busy)
        });
        assert!(out.iter().all(|(g, _)| *g == vec![0, 1, 2]));
    }
}
