//! Who a stuck job waits for. A rank whose wait on a peer times out does
//! not know whether that peer is the one that stopped or is itself stuck
//! behind a third rank; blaming the peer it waited for names the wrong
//! rank whenever the stall spread (a rank stopped with SIGSTOP, hung in a
//! kernel or a debugger: its connections stay open, so nobody sees it
//! die). Every rank answers an inquiry (a ping) from a small responder
//! thread with the peers its own waits are on; the inquirer follows that
//! chain to the first rank that does not answer, and tells every rank (a
//! verdict, taken by each mailbox as that rank's death), so they all fail
//! at once naming the same rank.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bytes::Bytes;

use super::group::liveness_tag;
use super::{CommError, Tag, Transport};

/// How often the responder looks for inquiries.
const POLL: Duration = Duration::from_millis(25);
/// The longest an inquirer waits for an answer (a live rank's responder
/// answers within a few polls even on a loaded machine).
const INQUIRY: Duration = Duration::from_secs(2);

/// An inquiry: "whom are you waiting for?" (its payload: the answer's nonce).
pub(crate) fn ping_tag() -> Tag {
    liveness_tag(1, 0)
}

/// The answer to inquiry `nonce`: the peers the answering rank waits on.
fn pong_tag(nonce: u32) -> Tag {
    liveness_tag(2, nonce)
}

/// A verdict: rank (u32) and why, told to every rank by the one that found it.
pub(crate) fn verdict_tag() -> Tag {
    liveness_tag(3, 0)
}

/// A verdict's payload.
fn verdict(peer: usize, reason: &str) -> Bytes {
    let mut b = (peer as u32).to_le_bytes().to_vec();
    b.extend_from_slice(reason.as_bytes());
    Bytes::from(b)
}

/// The rank and reason of a verdict's payload, if it parses.
pub(crate) fn parse_verdict(data: &[u8]) -> Option<(usize, String)> {
    let peer = u32::from_le_bytes(data.get(..4)?.try_into().ok()?) as usize;
    Some((peer, String::from_utf8_lossy(&data[4..]).into_owned()))
}

/// A notice that `me` gave up the call of `tag` (a tag of that call, any
/// step: [`super::group::call_of`]) after error `e`: the rank that caused it, if one did (died, or did not
/// answer), and what happened. The members waiting on `me` in that call
/// fail at once with it ([`super::mailbox::Mailbox::take`]) instead of at
/// their timeout, and blame the rank `e` blamed, not `me`.
pub(crate) fn gave_up(me: usize, tag: Tag, e: &CommError) -> Bytes {
    let (peer, reason) = match e {
        CommError::PeerFailed { peer, reason } => (Some(*peer), reason.clone()),
        CommError::Timeout { peer, waited, .. } => (
            Some(*peer),
            format!(
                "did not answer rank {me} within {:.0} s",
                waited.as_secs_f64()
            ),
        ),
        CommError::GaveUp { reason, .. } => (None, reason.clone()),
        other => (None, other.to_string()),
    };
    let mut b = tag.to_le_bytes().to_vec();
    b.extend_from_slice(&peer.map_or(u32::MAX, |p| p as u32).to_le_bytes());
    b.extend_from_slice(reason.as_bytes());
    Bytes::from(b)
}

/// A [`gave_up`] notice read back: the call's tag, the rank blamed, and why.
pub(crate) fn parse_gave_up(data: &[u8]) -> Option<(Tag, Option<usize>, String)> {
    let call = u64::from_le_bytes(data.get(..8)?.try_into().ok()?);
    let peer = u32::from_le_bytes(data.get(8..12)?.try_into().ok()?);
    let peer = (peer != u32::MAX).then_some(peer as usize);
    Some((
        call,
        peer,
        String::from_utf8_lossy(&data[12..]).into_owned(),
    ))
}

/// One transport's waits and its responder (shared by every communicator
/// over that transport).
pub(crate) struct Liveness {
    /// The peers this rank's waits are on now (one entry per wait).
    waits: Arc<Mutex<Vec<usize>>>,
    nonce: AtomicU32,
    /// Dropped to stop the responder.
    stop: Option<mpsc::Sender<()>>,
    responder: Option<std::thread::JoinHandle<()>>,
}

type Registry = Mutex<HashMap<usize, Weak<Liveness>>>;
static REGISTRY: std::sync::OnceLock<Registry> = std::sync::OnceLock::new();

impl Liveness {
    /// The liveness of `transport`: the one its other communicators share,
    /// or a new one with its responder running.
    pub(crate) fn of(transport: &Arc<dyn Transport>) -> Arc<Liveness> {
        let key = Arc::as_ptr(transport) as *const () as usize;
        let registry = REGISTRY.get_or_init(Default::default);
        let mut map = registry.lock().unwrap_or_else(|e| e.into_inner());
        map.retain(|_, w| w.strong_count() > 0);
        if let Some(l) = map.get(&key).and_then(Weak::upgrade) {
            return l;
        }
        let l = Arc::new(Liveness::start(transport.clone()));
        map.insert(key, Arc::downgrade(&l));
        l
    }

    fn start(transport: Arc<dyn Transport>) -> Liveness {
        let waits: Arc<Mutex<Vec<usize>>> = Arc::default();
        let (stop, stopped) = mpsc::channel::<()>();
        let w = waits.clone();
        let responder = (transport.world_size() > 1)
            .then(|| {
                std::thread::Builder::new()
                    .name("zeropp-liveness".into())
                    .spawn(move || respond(&*transport, &w, &stopped))
                    .ok()
            })
            .flatten();
        Liveness {
            waits,
            nonce: AtomicU32::new(1),
            stop: Some(stop),
            responder,
        }
    }

    /// Runs `f`, a wait on `peer`, counted among this rank's waits.
    pub(crate) fn waiting_on<T>(&self, peer: usize, f: impl FnOnce() -> T) -> T {
        self.lock().push(peer);
        let out = f();
        let mut w = self.lock();
        if let Some(i) = w.iter().position(|&p| p == peer) {
            w.swap_remove(i);
        }
        out
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<usize>> {
        self.waits.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// After a wait on `peer` timed out (`e`): the error that names the
    /// rank the job is stuck on. Follows the chain of waits from `peer` to
    /// the first rank that does not answer and tells every rank; a chain
    /// that ends at a live rank (one waiting on nobody new) keeps `e`.
    pub(crate) fn culprit(&self, t: &dyn Transport, peer: usize, e: CommError) -> CommError {
        let waited = match &e {
            CommError::Timeout { waited, .. } => *waited,
            _ => return e,
        };
        let me = t.rank();
        let mut asked = vec![me];
        let mut p = peer;
        loop {
            if let Some((dead, reason)) = t.first_death() {
                return CommError::PeerFailed { peer: dead, reason };
            }
            let nonce = self.nonce.fetch_add(1, Ordering::Relaxed);
            let answer = t
                .send(p, ping_tag(), Bytes::copy_from_slice(&nonce.to_le_bytes()))
                .and_then(|_| t.recv(p, pong_tag(nonce), INQUIRY));
            let waits =
                match answer {
                    Ok(b) => b
                        .chunks_exact(4)
                        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize)
                        .collect::<Vec<_>>(),
                    Err(CommError::Timeout { .. }) => {
                        let reason = format!(
                            "did not answer rank {me} for {:.0} s{} nor an inquiry within {:.0} s: \
                         stopped or hung (SIGSTOP, a debugger, a stuck kernel)",
                            waited.as_secs_f64(),
                            if p == peer {
                                String::new()
                            } else {
                                format!(" (rank {peer} and those after it waited on it)")
                            },
                            INQUIRY.as_secs_f64(),
                        );
                        tell_everyone(t, p, &reason);
                        return match p == peer {
                            true => e,
                            false => CommError::PeerFailed { peer: p, reason },
                        };
                    }
                    Err(other) if other.is_peer_failure() => {
                        return t.first_death().map_or(other, |(peer, reason)| {
                            CommError::PeerFailed { peer, reason }
                        });
                    }
                    Err(_) => return e,
                };
            // A verdict that arrived with the answer wins.
            if let Some((dead, reason)) = t.first_death() {
                return CommError::PeerFailed { peer: dead, reason };
            }
            asked.push(p);
            match waits.into_iter().find(|q| !asked.contains(q)) {
                Some(q) => p = q,
                // Alive and waiting on nobody new: slow, or the ranks called
                // different collectives; the first wait's error says so.
                None => return e,
            }
        }
    }
}

/// Takes `peer` for dead here and tells every other rank that it is stuck
/// (a failed send is a rank already gone: nothing to tell it).
fn tell_everyone(t: &dyn Transport, peer: usize, reason: &str) {
    t.declare_dead(peer, reason.to_string());
    let v = verdict(peer, reason);
    for r in (0..t.world_size()).filter(|&r| r != t.rank() && r != peer) {
        let _ = t.send(r, verdict_tag(), v.clone());
    }
}

/// The responder: answers each inquiry with this rank's waits until
/// `stopped` (its sender dropped).
fn respond(t: &dyn Transport, waits: &Mutex<Vec<usize>>, stopped: &mpsc::Receiver<()>) {
    let ping = ping_tag();
    while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(POLL) {
        for peer in t.waiting_from(ping) {
            while t.probe(peer, ping) {
                let Ok(b) = t.recv(peer, ping, Duration::ZERO) else {
                    break;
                };
                let Some(nonce) = b
                    .get(..4)
                    .map(|n| u32::from_le_bytes([n[0], n[1], n[2], n[3]]))
                else {
                    continue;
                };
                let answer: Vec<u8> = waits
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .iter()
                    .flat_map(|&p| (p as u32).to_le_bytes())
                    .collect();
                let _ = t.send(peer, pong_tag(nonce), Bytes::from(answer));
            }
        }
    }
}

impl Drop for Liveness {
    fn drop(&mut self) {
        self.stop.take();
        if let Some(r) = self.responder.take() {
            let _ = r.join();
        }
    }
}
