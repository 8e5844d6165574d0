//! Where received messages wait for their receiver: one queue per (source
//! rank, tag), a condition variable, and the reason each dead peer died, so a
//! receive from a dead peer fails at once instead of at its timeout.

use std::collections::{HashMap, VecDeque};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::{CommError, Tag};

/// How long a wait on a peer that left cleanly lingers for news of a crash.
const LEFT_GRACE: Duration = Duration::from_secs(2);

#[derive(Default)]
struct State {
    queues: HashMap<(usize, Tag), VecDeque<Bytes>>,
    dead: HashMap<usize, String>,
    /// The first peer that died abnormally (no goodbye): the job is broken,
    /// and every wait fails naming it, whoever it waits for.
    fatal: Option<(usize, String)>,
    closed: bool,
}

/// Messages received by one rank.
#[derive(Default)]
pub struct Mailbox {
    state: Mutex<State>,
    arrived: Condvar,
}

impl Mailbox {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding this lock leaves only queues behind; keep going.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues a message from `source`.
    pub fn deliver(&self, source: usize, tag: Tag, data: Bytes) {
        self.lock()
            .queues
            .entry((source, tag))
            .or_default()
            .push_back(data);
        self.arrived.notify_all();
    }

    /// Records that `peer` left on purpose; receives from it fail once its
    /// queued messages are taken.
    pub fn peer_left(&self, peer: usize, reason: String) {
        self.lock().dead.entry(peer).or_insert(reason);
        self.arrived.notify_all();
    }

    /// Like [`Mailbox::peer_died`], but first waits up to `wait` for a
    /// goodbye from `peer` that may still be on its way (a write fails as
    /// soon as the peer closes, before its goodbye has been read).
    pub fn peer_died_unless_leaving(&self, peer: usize, reason: String, wait: Duration) {
        let deadline = Instant::now() + wait;
        let mut state = self.lock();
        while !state.dead.contains_key(&peer) && Instant::now() < deadline {
            state = self
                .arrived
                .wait_timeout(state, deadline - Instant::now())
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        drop(state);
        self.peer_died(peer, reason);
    }

    /// Records that `peer` died (crashed, killed, connection lost): every
    /// wait of this rank fails naming it, since no collective can finish.
    pub fn peer_died(&self, peer: usize, reason: String) {
        let mut state = self.lock();
        if state.dead.contains_key(&peer) {
            // It already said goodbye: its connection closing is expected.
            return;
        }
        state.dead.entry(peer).or_insert_with(|| reason.clone());
        state.fatal.get_or_insert((peer, reason));
        self.arrived.notify_all();
    }

    /// Whether `peer` left or died.
    pub fn is_gone(&self, peer: usize) -> bool {
        self.lock().dead.contains_key(&peer)
    }

    /// The first peer that died abnormally, if any, and why.
    pub fn first_death(&self) -> Option<(usize, String)> {
        self.lock().fatal.clone()
    }

    /// Fails every wait: the transport is shutting down.
    pub fn close(&self) {
        self.lock().closed = true;
        self.arrived.notify_all();
    }

    /// Takes the oldest message from `source` with `tag`, waiting up to
    /// `timeout`. Messages that arrived before the peer died are still taken.
    pub fn take(&self, source: usize, tag: Tag, timeout: Duration) -> Result<Bytes, CommError> {
        let deadline = Instant::now() + timeout;
        let mut state = self.lock();
        loop {
            if let Some(q) = state.queues.get_mut(&(source, tag))
                && let Some(data) = q.pop_front()
            {
                if q.is_empty() {
                    state.queues.remove(&(source, tag));
                }
                return Ok(data);
            }
            if let Some((peer, reason)) = &state.fatal {
                return Err(CommError::PeerFailed {
                    peer: *peer,
                    reason: reason.clone(),
                });
            }
            if let Some(reason) = state.dead.get(&source).cloned() {
                // A peer that left on purpose while we still wait for it
                // usually left because a third rank died: give that death a
                // moment to be reported so the error names the real culprit.
                let grace = Instant::now() + LEFT_GRACE;
                while state.fatal.is_none() && Instant::now() < grace {
                    state = self
                        .arrived
                        .wait_timeout(state, grace - Instant::now())
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
                if let Some((peer, reason)) = &state.fatal {
                    return Err(CommError::PeerFailed {
                        peer: *peer,
                        reason: reason.clone(),
                    });
                }
                return Err(CommError::PeerFailed {
                    peer: source,
                    reason,
                });
            }
            if state.closed {
                return Err(CommError::Closed);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(CommError::Timeout {
                    peer: source,
                    tag,
                    waited: timeout,
                });
            }
            state = self
                .arrived
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Whether a message from `source` with `tag` is waiting.
    pub fn has(&self, source: usize, tag: Tag) -> bool {
        self.lock().queues.contains_key(&(source, tag))
    }
}
