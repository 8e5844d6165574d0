//! Single-copy messages between ranks of one host. The sender copies a large
//! payload into its own shared segment (a memfd) and sends only where it lies;
//! the receiver, which mapped that segment read-only when the ranks met,
//! hands the bytes to its caller where they are, and tells the sender when
//! they are dropped so the range can be reused: straight into a ring that
//! the segment keeps for each peer at its start (the sender drains the rings
//! before it places the next message), or as a UCX message when that ring is
//! full. One copy per message, at
//! memcpy speed, where UCX's eager shared memory copies twice (into its FIFO
//! and out of it) and its CMA path runs at a third of memcpy
//! (docs/COMM.md). A full segment is no error: the message goes the eager
//! way.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::super::pool::parse_size;
use super::super::{CommError, io_err};

/// Messages this long or longer go through the segment.
pub const MIN_SHM: usize = 4 << 20;
/// The segment's default size (virtual: pages are used as messages touch
/// them, and kept for reuse).
pub const DEFAULT_SEGMENT: usize = 512 << 20;
/// Placements are whole pages, so no two messages share one.
const PAGE: usize = 4096;
/// How long `place` waits for a release, per fresh page it would touch:
/// a fraction of what faulting the page in costs (docs/BENCHMARKS.md).
const RELEASE_WAIT_PER_PAGE_NS: u64 = 500;
/// Offsets a release ring holds (one page: head, tail, slots); a receiver
/// that finds its ring full releases by UCX message instead.
const RING: usize = PAGE / 8 - 2;
/// Bytes of one peer's release ring: a page of its own, so each peer maps
/// only its own ring writable and cannot release what another holds.
const RING_BYTES: usize = PAGE;

/// Bytes at the start of a segment for `world` ranks' release rings.
fn control_bytes(world: usize) -> usize {
    world * RING_BYTES
}

/// One peer's release ring, inside a mapping: the peer (single producer,
/// under its own lock) writes offsets and advances `tail`; the segment's
/// owner (single consumer, under its ranges' lock) takes them and advances
/// `head`. Both are counts, never wrapped.
struct Ring {
    at: *mut AtomicU64,
}

impl Ring {
    /// Ring `index` of the control area that starts at `base`.
    ///
    /// # Safety
    /// `base` maps at least `(index + 1) * RING_BYTES` writable bytes,
    /// 8-byte aligned, for as long as the ring is used.
    unsafe fn of(base: *mut u8, index: usize) -> Ring {
        Ring {
            at: unsafe { base.add(index * RING_BYTES) }.cast(),
        }
    }

    fn word(&self, i: usize) -> &AtomicU64 {
        // SAFETY: within the ring (see `of`); AtomicU64 over shared memory
        // is how both processes access these words.
        unsafe { &*self.at.add(i) }
    }

    fn head(&self) -> &AtomicU64 {
        self.word(0)
    }

    fn tail(&self) -> &AtomicU64 {
        self.word(1)
    }

    fn slot(&self, n: u64) -> &AtomicU64 {
        self.word(2 + (n as usize % RING))
    }

    /// Producer side: false when full.
    fn push(&self, off: u64) -> bool {
        let tail = self.tail().load(Ordering::Relaxed);
        let head = self.head().load(Ordering::Acquire);
        if tail.wrapping_sub(head) >= RING as u64 {
            return false;
        }
        self.slot(tail).store(off, Ordering::Relaxed);
        self.tail().store(tail.wrapping_add(1), Ordering::Release);
        true
    }

    /// Consumer side: every offset pushed since the last drain.
    fn drain(&self, mut each: impl FnMut(u64)) {
        let head = self.head().load(Ordering::Relaxed);
        let tail = self.tail().load(Ordering::Acquire);
        // A peer that wrote nonsense into the counters gets at most one ring.
        let n = tail.wrapping_sub(head).min(RING as u64);
        for i in 0..n {
            each(self.slot(head.wrapping_add(i)).load(Ordering::Relaxed));
        }
        self.head().store(head.wrapping_add(n), Ordering::Release);
    }
}

/// The segment size `ZEROPP_SHM_SEGMENT` names (bytes or K/M/G; 0 turns
/// single-copy messages off), else [`DEFAULT_SEGMENT`].
pub fn segment_size_from(value: Option<&str>) -> Result<usize, CommError> {
    match value {
        None => Ok(DEFAULT_SEGMENT),
        Some(v) => parse_size(v).map_err(|e| CommError::Setting {
            name: "ZEROPP_SHM_SEGMENT",
            problem: format!(
                "{e}; give the size of the shared segment a rank sends node-local messages \
                     from (for example 512M, the default), or 0 to send them through UCX alone"
            ),
        }),
    }
}

/// Who holds a placed range: this rank (a staged buffer, see
/// [`Segment::stage`]) or a peer (a message it has not released yet).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Holder {
    Local,
    Peer(usize),
}

/// A placed range and its holders; it is free again when none is left.
#[derive(Debug)]
struct Placed {
    len: usize,
    local: u32,
    /// (peer, messages naming this range it has not released).
    peers: Vec<(usize, u32)>,
}

/// Free and placed ranges of a segment.
#[derive(Default)]
struct Ranges {
    /// Free ranges: offset -> length, coalesced.
    free: BTreeMap<usize, usize>,
    /// Placed ranges: offset -> length and holders.
    placed: BTreeMap<usize, Placed>,
    /// The end of the highest range ever placed: pages below it were
    /// touched and stay resident.
    high_water: usize,
}

impl Ranges {
    /// Ranges handed out of `area` only.
    fn new(area: std::ops::Range<usize>) -> Ranges {
        let mut r = Ranges::default();
        if !area.is_empty() {
            r.free.insert(area.start, area.len());
        }
        r
    }

    /// The lowest free range of `len` bytes (so the pages in use stay few),
    /// held by `holder`; with `warm`, only one whose pages were all touched
    /// before.
    fn take(&mut self, len: usize, warm: bool, holder: Holder) -> Option<usize> {
        let high_water = self.high_water;
        let (&off, &free_len) = self
            .free
            .iter()
            .find(|&(&o, &l)| l >= len && (!warm || o + len <= high_water))?;
        self.free.remove(&off);
        if free_len > len {
            self.free.insert(off + len, free_len - len);
        }
        let mut placed = Placed {
            len,
            local: 0,
            peers: Vec::new(),
        };
        placed.add(holder);
        self.placed.insert(off, placed);
        self.high_water = self.high_water.max(off + len);
        Some(off)
    }

    /// The placed range holding `[off, off + len)`, if any.
    fn containing(&self, off: usize, len: usize) -> Option<usize> {
        let (&start, p) = self.placed.range(..=off).next_back()?;
        (off + len <= start + p.len).then_some(start)
    }

    /// One more holder of the placed range at `off`.
    fn hold(&mut self, off: usize, holder: Holder) -> bool {
        self.placed.get_mut(&off).map(|p| p.add(holder)).is_some()
    }

    /// `holder` lets go of the range at `off`, which is free once nobody
    /// holds it; false if `holder` did not hold it (the range is untouched).
    fn give_back(&mut self, off: usize, holder: Holder) -> bool {
        let Some(p) = self.placed.get_mut(&off) else {
            return false;
        };
        if !p.remove(holder) {
            return false;
        }
        if p.local > 0 || !p.peers.is_empty() {
            return true;
        }
        let len = p.len;
        self.placed.remove(&off);
        let (mut start, mut end) = (off, off + len);
        if let Some((&prev, &prev_len)) = self.free.range(..off).next_back()
            && prev + prev_len == off
        {
            self.free.remove(&prev);
            start = prev;
        }
        if let Some(next_len) = self.free.remove(&end) {
            end += next_len;
        }
        self.free.insert(start, end - start);
        true
    }

    fn bytes_placed(&self) -> usize {
        self.placed.values().map(|p| p.len).sum()
    }
}

impl Placed {
    fn add(&mut self, holder: Holder) {
        match holder {
            Holder::Local => self.local += 1,
            Holder::Peer(peer) => match self.peers.iter_mut().find(|(p, _)| *p == peer) {
                Some((_, n)) => *n += 1,
                None => self.peers.push((peer, 1)),
            },
        }
    }

    fn remove(&mut self, holder: Holder) -> bool {
        match holder {
            Holder::Local if self.local > 0 => self.local -= 1,
            Holder::Local => return false,
            Holder::Peer(peer) => {
                let Some(i) = self.peers.iter().position(|(p, _)| *p == peer) else {
                    return false;
                };
                self.peers[i].1 -= 1;
                if self.peers[i].1 == 0 {
                    self.peers.swap_remove(i);
                }
            }
        }
        true
    }
}

/// This rank's segment: messages to node-local peers are copied in here.
pub struct Segment {
    fd: OwnedFd,
    base: *mut u8,
    size: usize,
    world: usize,
    ranges: Mutex<Ranges>,
}

// SAFETY: the mapping is owned by the segment; writes go only to ranges
// handed out by `place` under the lock, each to one writer.
unsafe impl Send for Segment {}
unsafe impl Sync for Segment {}

fn os_error(what: &str) -> CommError {
    io_err(what)(std::io::Error::last_os_error())
}

impl Segment {
    /// A segment with `size` bytes for messages (rounded up to whole
    /// pages) after the release rings of `world` ranks.
    pub fn create(size: usize, world: usize) -> Result<Segment, CommError> {
        let control = control_bytes(world);
        let size = control + size.next_multiple_of(PAGE);
        // SAFETY: plain syscalls; the name is a NUL-terminated literal.
        unsafe {
            let fd = libc::memfd_create(
                c"zeropp-shm".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            );
            if fd < 0 {
                return Err(os_error("memfd_create for the shared segment"));
            }
            let fd = OwnedFd::from_raw_fd(fd);
            if libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) != 0 {
                return Err(os_error("sizing the shared segment"));
            }
            // Its size is fixed: nobody (a peer opens it writable, for its
            // ring) can shrink it under a mapping, which would fault.
            let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
            if libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) != 0 {
                return Err(os_error("sealing the shared segment's size"));
            }
            let base = libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            );
            if base == libc::MAP_FAILED {
                return Err(os_error("mapping the shared segment"));
            }
            // The control area is never handed out.
            let ranges = Ranges::new(control..size);
            Ok(Segment {
                fd,
                base: base.cast(),
                size,
                world,
                ranges: Mutex::new(ranges),
            })
        }
    }

    /// The descriptor a peer opens through `/proc/PID/fd/N`.
    pub fn fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }

    pub fn size(&self) -> usize {
        self.size
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ranges> {
        self.ranges.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes back what the peers' rings released since the last call.
    fn drain(&self, ranges: &mut Ranges) {
        for peer in 0..self.world {
            // SAFETY: the control area holds `world` rings.
            let ring = unsafe { Ring::of(self.base, peer) };
            let mut bogus = 0;
            ring.drain(|off| {
                if !ranges.give_back(off as usize, Holder::Peer(peer)) {
                    bogus += 1;
                }
            });
            if bogus > 0 {
                tracing::warn!(
                    "rank {peer} released {bogus} range(s) of this rank's segment it was not given"
                );
            }
        }
    }

    /// Drops every hold of `peer`, which died: its mappings are gone.
    pub fn forget(&self, peer: usize) {
        let mut ranges = self.lock();
        let held: Vec<(usize, u32)> = ranges
            .placed
            .iter()
            .filter_map(|(&off, p)| {
                let n = p.peers.iter().find(|(q, _)| *q == peer)?.1;
                Some((off, n))
            })
            .collect();
        for (off, n) in held {
            for _ in 0..n {
                ranges.give_back(off, Holder::Peer(peer));
            }
        }
    }

    /// Copies `data` into a free range and returns its offset; `None` when
    /// no range is free (the caller sends another way).
    ///
    /// Pages never touched cost a fault and a zeroing each, about ten times
    /// a copy into a warm page (docs/BENCHMARKS.md has the probe), so when
    /// only fresh pages are free while receivers hold earlier messages, it
    /// first waits a while for a release (`RELEASE_WAIT_PER_PAGE_NS` a page,
    /// well under what the faults would cost), yielding the core meanwhile
    /// (to the receiver, on a busy host).
    pub fn place(&self, data: &[u8], holder: Holder) -> Option<usize> {
        let off = self.reserve(data.len(), holder, true)?;
        // SAFETY: [off, off + len) lies in the mapping and was just handed
        // out to this call alone; no receiver reads it before the message
        // naming it is sent.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.base.add(off), data.len());
        }
        Some(off)
    }

    /// A free range for `len` bytes, held by `holder`; `patient`: wait a
    /// little for a warm one (see [`Segment::place`]).
    fn reserve(&self, len: usize, holder: Holder, patient: bool) -> Option<usize> {
        let len = len.max(1).next_multiple_of(PAGE);
        let off = {
            let mut ranges = self.lock();
            self.drain(&mut ranges);
            match ranges.take(len, true, holder) {
                Some(off) => off,
                // Wait only when a fresh range would do (not when full).
                None if !patient
                    || ranges.placed.is_empty()
                    || !ranges.free.values().any(|&l| l >= len) =>
                {
                    ranges.take(len, false, holder)?
                }
                None => {
                    let fresh_pages = (len / PAGE) as u64;
                    let until = Instant::now()
                        + Duration::from_nanos(RELEASE_WAIT_PER_PAGE_NS * fresh_pages);
                    loop {
                        drop(ranges);
                        std::thread::yield_now();
                        ranges = self.lock();
                        self.drain(&mut ranges);
                        if let Some(off) = ranges.take(len, true, holder) {
                            break off;
                        }
                        if Instant::now() >= until || ranges.placed.is_empty() {
                            break ranges.take(len, false, holder)?;
                        }
                    }
                }
            }
        };
        Some(off)
    }

    /// A buffer of `len` bytes in this segment for UCX to receive a message
    /// into, so that forwarding it to a node-local peer needs no copy
    /// (never waits: it runs on the progress thread). `None` when full.
    pub fn receive_buffer(self: &Arc<Self>, len: usize) -> Option<SegmentBuf> {
        let off = self.reserve(len, Holder::Local, false)?;
        Some(SegmentBuf(Staged {
            segment: self.clone(),
            off,
            len,
        }))
    }

    /// Whether `data` lies in a placed range of this segment.
    pub fn contains(&self, data: &[u8]) -> bool {
        let at = (data.as_ptr() as usize).wrapping_sub(self.base as usize);
        at < self.size && self.lock().containing(at, data.len()).is_some()
    }

    /// `holder` is done with the range at `off`; false if it held none
    /// there (a confused or malicious peer: nothing changes).
    pub fn release(&self, off: usize, holder: Holder) -> bool {
        self.lock().give_back(off, holder)
    }

    /// A copy of `data` in this segment, which a later send to a node-local
    /// peer shares instead of copying (see [`Segment::share`]): for a buffer
    /// that is both sent and kept (a ring all-gather keeps what it forwards),
    /// so the bytes are resident once instead of in the original and the
    /// segment. `None` when no range is free.
    pub fn stage(self: &Arc<Self>, data: &[u8]) -> Option<bytes::Bytes> {
        let off = self.place(data, Holder::Local)?;
        Some(bytes::Bytes::from_owner(Staged {
            segment: self.clone(),
            off,
            len: data.len(),
        }))
    }

    /// When `data` lies in a range of this segment (staged, or a slice of
    /// it), makes `peer` one more holder of that range and returns the
    /// range's offset and `data`'s own: the message can name them.
    pub fn share(&self, data: &[u8], peer: usize) -> Option<(usize, usize)> {
        let at = (data.as_ptr() as usize).checked_sub(self.base as usize)?;
        if at >= self.size {
            return None;
        }
        let mut ranges = self.lock();
        let range = ranges.containing(at, data.len())?;
        ranges
            .hold(range, Holder::Peer(peer))
            .then_some((range, at))
    }

    /// Bytes of messages whose receivers still hold them.
    pub fn bytes_placed(&self) -> usize {
        let mut ranges = self.lock();
        self.drain(&mut ranges);
        ranges.bytes_placed()
    }
}

/// A receive buffer in this rank's segment (see
/// [`Segment::receive_buffer`]).
pub struct SegmentBuf(Staged);

impl SegmentBuf {
    pub fn len(&self) -> usize {
        self.0.len
    }

    pub fn is_empty(&self) -> bool {
        self.0.len == 0
    }

    /// The buffer to write into.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the range was reserved for this buffer alone and nobody
        // else sees it until `into_bytes`.
        unsafe { std::slice::from_raw_parts_mut(self.0.segment.base.add(self.0.off), self.0.len) }
    }

    pub fn into_bytes(self) -> bytes::Bytes {
        bytes::Bytes::from_owner(self.0)
    }
}

impl AsRef<[u8]> for SegmentBuf {
    fn as_ref(&self) -> &[u8] {
        self.0.as_ref()
    }
}

/// A staged buffer: this rank's own view of a range of its segment.
struct Staged {
    segment: Arc<Segment>,
    off: usize,
    len: usize,
}

impl AsRef<[u8]> for Staged {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the range was placed for this view and stays placed (it
        // holds it) while the view lives; nobody writes a placed range.
        unsafe { std::slice::from_raw_parts(self.segment.base.add(self.off), self.len) }
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        self.segment.release(self.off, Holder::Local);
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        tracing::debug!(
            "shared segment: {} MiB of {} MiB ever used",
            self.lock().high_water >> 20,
            self.size >> 20
        );
        // SAFETY: our own mapping; peers keep their own mappings (and so
        // the memory) alive for as long as they hold views.
        unsafe {
            libc::munmap(self.base.cast(), self.size);
        }
    }
}

/// A peer's segment, mapped read-only, and its release ring for this rank
/// mapped writable.
pub struct PeerSegment {
    base: *const u8,
    size: usize,
    control: *mut u8,
    control_len: usize,
    /// One releasing thread at a time (the ring has a single producer).
    pushing: Mutex<()>,
}

// SAFETY: read-only mapping; the peer writes a range only before it names it
// in a message and after this rank released it.
unsafe impl Send for PeerSegment {}
unsafe impl Sync for PeerSegment {}

impl PeerSegment {
    /// Maps the segment that process `pid` holds open as descriptor `fd`,
    /// for rank `me` of `world`.
    pub fn open(
        pid: u32,
        fd: i32,
        size: usize,
        me: usize,
        world: usize,
    ) -> Result<PeerSegment, CommError> {
        let path = format!("/proc/{pid}/fd/{fd}");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(io_err(format!(
                "the shared segment of process {pid} ({path})"
            )))?;
        let actual = file.metadata().map_err(io_err(path.clone()))?.len() as usize;
        let control_len = control_bytes(world);
        // SAFETY: fcntl on a descriptor we own.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err(CommError::Malformed(format!(
                "{path} is not sealed against shrinking: not a zeropp segment"
            )));
        }
        if me >= world || actual < size || size <= control_len {
            return Err(CommError::Malformed(format!(
                "{path} holds {actual} bytes, the peer announced {size}"
            )));
        }
        // SAFETY: a fresh read-only shared mapping of a file we opened.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(os_error(&format!("mapping {path}")));
        }
        // SAFETY: as above, this rank's own ring only, writable.
        let control = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                RING_BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                (me * RING_BYTES) as libc::off_t,
            )
        };
        if control == libc::MAP_FAILED {
            let e = os_error(&format!("mapping the release rings of {path}"));
            // SAFETY: the mapping made just above.
            unsafe { libc::munmap(base, size) };
            return Err(e);
        }
        Ok(PeerSegment {
            base: base as *const u8,
            size,
            control: control.cast(),
            control_len,
            pushing: Mutex::new(()),
        })
    }

    /// Whether `[off, off + len)` lies inside the segment's message area.
    pub fn holds(&self, off: usize, len: usize) -> bool {
        off >= self.control_len && off.checked_add(len).is_some_and(|end| end <= self.size)
    }

    /// Tells the owner the range at `off` is free, through this rank's ring;
    /// false when the ring is full (release another way).
    pub fn release(&self, off: u64) -> bool {
        let _one = self.pushing.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the control mapping is this rank's ring.
        unsafe { Ring::of(self.control, 0) }.push(off)
    }
}

impl Drop for PeerSegment {
    fn drop(&mut self) {
        // SAFETY: our mapping; no view outlives it (each holds an Arc).
        unsafe {
            libc::munmap(self.base as *mut c_void, self.size);
            libc::munmap(self.control.cast(), RING_BYTES);
        }
    }
}

/// A message lying in a peer's segment: the bytes a receive returns. When
/// the last reference goes, `release` tells the peer the range is free.
pub struct ShmView {
    segment: Arc<PeerSegment>,
    off: usize,
    len: usize,
    release: Option<Box<dyn FnOnce() + Send>>,
}

impl ShmView {
    /// A view of `[off, off + len)`, which the caller checked with
    /// [`PeerSegment::holds`].
    pub fn new(
        segment: Arc<PeerSegment>,
        off: usize,
        len: usize,
        release: Box<dyn FnOnce() + Send>,
    ) -> ShmView {
        debug_assert!(segment.holds(off, len));
        ShmView {
            segment,
            off,
            len,
            release: Some(release),
        }
    }
}

impl AsRef<[u8]> for ShmView {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the range lies in the mapping (checked at construction),
        // which lives as long as `segment`; the peer does not write it until
        // this view is released.
        unsafe { std::slice::from_raw_parts(self.segment.base.add(self.off), self.len) }
    }
}

impl Drop for ShmView {
    fn drop(&mut self) {
        if let Some(release) = self.release.take() {
            release();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_reused_lowest_first_and_coalesce() {
        const P: Holder = Holder::Peer(1);
        let mut r = Ranges::new(0..10 * PAGE);
        let a = r.take(2 * PAGE, false, P).unwrap();
        let b = r.take(3 * PAGE, false, P).unwrap();
        let c = r.take(5 * PAGE, false, P).unwrap();
        assert_eq!((a, b, c), (0, 2 * PAGE, 5 * PAGE));
        assert_eq!(r.take(PAGE, false, P), None, "full");
        assert!(r.give_back(b, P));
        assert!(!r.give_back(b, P), "a range is returned once");
        assert!(!r.give_back(PAGE, P), "not a placed offset");
        assert_eq!(r.take(4 * PAGE, false, P), None, "3 pages free, not 4");
        assert!(r.give_back(a, P));
        // a and b merged into one free range of 5 pages at 0.
        assert_eq!(r.take(5 * PAGE, false, P), Some(0));
        assert!(r.give_back(0, P));
        assert!(r.give_back(c, P));
        assert_eq!(r.free.len(), 1, "everything merged: {:?}", r.free);
        assert_eq!(r.take(10 * PAGE, false, P), Some(0));
        assert!(r.give_back(0, P));
        // Warm: only below the highest range ever placed (all 10 pages here).
        assert_eq!(r.take(10 * PAGE, true, P), Some(0));
        let mut r = Ranges::new(0..10 * PAGE);
        let a = r.take(2 * PAGE, false, P).unwrap();
        assert_eq!(r.take(PAGE, true, P), None, "pages 2.. were never touched");
        assert!(r.give_back(a, P));
        assert_eq!(r.take(PAGE, true, P), Some(0));
    }

    #[test]
    fn a_range_is_free_only_when_every_holder_let_go() {
        let mut r = Ranges::new(0..4 * PAGE);
        let a = r.take(2 * PAGE, false, Holder::Local).unwrap();
        assert_eq!(r.containing(a + 10, 100), Some(a));
        assert_eq!(r.containing(a + 10, 2 * PAGE), None, "runs past the range");
        assert!(r.hold(a, Holder::Peer(1)));
        assert!(r.hold(a, Holder::Peer(1)));
        assert!(r.hold(a, Holder::Peer(2)));
        assert!(!r.give_back(a, Holder::Peer(3)), "never held it");
        assert!(r.give_back(a, Holder::Local));
        assert!(r.give_back(a, Holder::Peer(1)));
        assert!(r.give_back(a, Holder::Peer(2)));
        assert!(!r.give_back(a, Holder::Peer(2)), "released once");
        assert_eq!(r.bytes_placed(), 2 * PAGE, "rank 1 still holds one");
        assert!(r.give_back(a, Holder::Peer(1)));
        assert_eq!(r.bytes_placed(), 0);
        assert!(!r.hold(a, Holder::Local), "free ranges cannot be held");
    }

    #[test]
    fn a_dead_peers_holds_are_dropped() {
        let seg = Segment::create(1 << 20, 3).unwrap();
        let a = seg.place(&[1u8; 100], Holder::Peer(1)).unwrap();
        let b = seg.place(&[2u8; 100], Holder::Peer(2)).unwrap();
        assert!(seg.lock().hold(a, Holder::Peer(1)));
        seg.forget(1);
        assert_eq!(seg.bytes_placed(), PAGE, "only rank 2's range is left");
        assert!(seg.release(b, Holder::Peer(2)));
        assert_eq!(seg.bytes_placed(), 0);
    }

    #[test]
    fn a_staged_buffer_is_shared_by_sends_and_freed_after_all_of_them() {
        let seg = Arc::new(Segment::create(1 << 20, 2).unwrap());
        let msg = vec![5u8; 3 * PAGE];
        let staged = seg.stage(&msg).unwrap();
        assert_eq!(&staged[..], &msg[..]);
        let (range, off) = seg.share(&staged, 1).unwrap();
        assert_eq!(range, off);
        let tail = staged.slice(PAGE..);
        assert_eq!(seg.share(&tail, 1), Some((range, range + PAGE)));
        assert_eq!(seg.share(&msg, 1), None, "not in the segment");
        drop(staged);
        drop(tail);
        assert_eq!(seg.bytes_placed(), 3 * PAGE, "rank 1 holds it twice");
        assert!(seg.release(range, Holder::Peer(1)));
        assert!(seg.release(range, Holder::Peer(1)));
        assert_eq!(seg.bytes_placed(), 0);
    }

    #[test]
    fn a_peer_reads_what_was_placed_until_it_releases_it() {
        let seg = Segment::create(1 << 20, 3).unwrap();
        let msg: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let off = seg.place(&msg, Holder::Peer(2)).unwrap();
        assert!(off >= control_bytes(3), "messages never overlap the rings");
        let me = std::process::id();
        let peer = Arc::new(PeerSegment::open(me, seg.fd(), seg.size(), 2, 3).unwrap());
        assert!(peer.holds(off, msg.len()));
        assert!(!peer.holds(0, 8), "the rings are not a message");
        assert!(!peer.holds(seg.size() - 10, 11));
        assert!(!peer.holds(usize::MAX, 2));
        let released = Arc::new(Mutex::new(None));
        let r = released.clone();
        let view = bytes::Bytes::from_owner(ShmView::new(
            peer.clone(),
            off,
            msg.len(),
            Box::new(move || *r.lock().unwrap() = Some(off)),
        ));
        assert_eq!(&view[..], &msg[..]);
        let part = view.slice(10..20);
        drop(view);
        assert_eq!(*released.lock().unwrap(), None, "a slice still holds it");
        assert_eq!(&part[..], &msg[10..20]);
        drop(part);
        assert_eq!(*released.lock().unwrap(), Some(off));
        assert_eq!(seg.bytes_placed(), msg.len().next_multiple_of(PAGE));
        assert!(peer.release(off as u64), "through the ring");
        assert_eq!(seg.bytes_placed(), 0, "the owner drained the ring");
        // Placed again at the same, warm, offset.
        assert_eq!(seg.place(&msg, Holder::Peer(2)), Some(off));
    }

    #[test]
    fn a_full_ring_says_so_and_bogus_releases_change_nothing() {
        let seg = Segment::create(64 * PAGE, 2).unwrap();
        let me = std::process::id();
        let peer = PeerSegment::open(me, seg.fd(), seg.size(), 1, 2).unwrap();
        let a = seg.place(&[1u8; 10], Holder::Peer(1)).unwrap();
        for _ in 0..RING {
            assert!(peer.release(12345), "room in the ring");
        }
        assert!(!peer.release(a as u64), "full: release another way");
        // Draining ignores the bogus offsets; `a` is still placed.
        assert_eq!(seg.bytes_placed(), PAGE);
        assert!(peer.release(a as u64));
        assert_eq!(seg.bytes_placed(), 0);
    }

    #[test]
    fn a_full_segment_refuses_instead_of_overwriting() {
        let seg = Segment::create(2 * PAGE, 1).unwrap();
        let a = seg.place(&[1u8; PAGE + 1], Holder::Peer(0)).unwrap();
        assert_eq!(seg.place(&[2u8; 10], Holder::Peer(0)), None);
        assert!(!seg.release(a, Holder::Local), "not its holder");
        assert!(seg.release(a, Holder::Peer(0)));
        assert!(seg.place(&[2u8; 10], Holder::Peer(0)).is_some());
    }

    #[test]
    fn a_missing_segment_or_bad_size_is_an_error_not_a_panic() {
        let seg = Segment::create(PAGE, 2).unwrap();
        let me = std::process::id();
        assert!(PeerSegment::open(me, 987_654, seg.size(), 0, 2).is_err());
        let err = PeerSegment::open(me, seg.fd(), 2 * seg.size(), 0, 2)
            .err()
            .unwrap();
        assert!(err.to_string().contains("announced"), "{err}");
        assert!(PeerSegment::open(me, seg.fd(), seg.size(), 2, 2).is_err());
        // Any other file (here an unsealed memfd) is refused.
        let other = unsafe { libc::memfd_create(c"other".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(other >= 0);
        let other = unsafe { OwnedFd::from_raw_fd(other) };
        assert_eq!(
            unsafe { libc::ftruncate(other.as_raw_fd(), seg.size() as i64) },
            0
        );
        let err = PeerSegment::open(me, other.as_raw_fd(), seg.size(), 0, 2)
            .err()
            .unwrap();
        assert!(err.to_string().contains("not sealed"), "{err}");
        // Nobody can shrink a segment under its mappings.
        assert_ne!(unsafe { libc::ftruncate(seg.fd(), 0) }, 0);
        assert!(segment_size_from(Some("lots")).is_err());
        assert_eq!(segment_size_from(Some("0")).unwrap(), 0);
        assert_eq!(segment_size_from(None).unwrap(), DEFAULT_SEGMENT);
    }
}
