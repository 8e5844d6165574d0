//! Where received messages wait for their receiver: one queue per (source
//! rank, tag), a condition variable, and the reason each dead peer died, so a
//! receive from a dead peer fails at once instead of at its timeout.

use std::collections::{HashMap, VecDeque};
use std::ops::Range;
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
    /// Islands: only the deaths of these ranks (this rank's island) break
    /// every wait; another's fails the waits on it alone, at once.
    fatal_only: Option<Range<usize>>,
    /// Islands: restarted ranks of a lost island, reconnected but not yet
    /// taken back by this rank's islands ([`Mailbox::readmit`]): only
    /// their rejoin messages are theirs; a wait for anything else fails at
    /// once, as on the dead rank they replace.
    returned: std::collections::HashSet<usize>,
    /// Calls a peer gave up ([`super::liveness::gave_up`]), by (peer,
    /// group id): each call's number, the rank it blamed, if any, and why.
    gave_up: HashMap<(usize, u32), Vec<GaveUp>>,
    closed: bool,
}

/// A call a peer gave up.
struct GaveUp {
    call: u32,
    blamed: Option<usize>,
    reason: String,
}

impl State {
    /// The error of a wait on `source` for `tag`, if `source` gave that
    /// call up — or an earlier call of the group because a rank failed: a
    /// peer that did makes no later call of the group (its job ends, or
    /// its islands regroup without that rank's island), and a member that
    /// completed the call it gave up waits on it in the next one.
    fn gave_up(&self, source: usize, tag: Tag) -> Option<CommError> {
        if super::group::is_rejoin(tag) {
            return None;
        }
        let (group, call) = super::group::call_of(tag);
        let notices = self.gave_up.get(&(source, group))?;
        let this = notices.iter().find(|n| n.call == call);
        let earlier = || {
            notices
                .iter()
                .find(|n| n.blamed.is_some() && super::group::is_after(call, n.call))
        };
        let n = this.or_else(earlier)?;
        let which = if n.call == call {
            "the call"
        } else {
            "a call of this group"
        };
        Some(match n.blamed {
            Some(peer) => CommError::PeerFailed {
                peer,
                reason: format!("{} (rank {source} gave up {which} for it)", n.reason),
            },
            None => CommError::GaveUp {
                by: source,
                reason: n.reason.clone(),
            },
        })
    }

    /// Whether `peer` is gone from another island (its death contained).
    fn contained(&self, peer: usize) -> bool {
        self.dead.contains_key(&peer)
            && self.fatal_only.as_ref().is_some_and(|r| !r.contains(&peer))
    }
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

    /// Queues a message from `source`; a verdict (another rank found a
    /// rank stuck: `super::liveness`) is taken as that rank's death, and
    /// a notice that `source` gave up a call fails the waits on it there.
    pub fn deliver(&self, source: usize, tag: Tag, data: Bytes) {
        if tag == super::liveness::verdict_tag() {
            if let Some((peer, reason)) = super::liveness::parse_verdict(&data) {
                self.peer_died(peer, format!("{reason} (found by rank {source})"));
            }
            return;
        }
        if tag == super::group::gave_up_tag() {
            if let Some((tag, blamed, reason)) = super::liveness::parse_gave_up(&data) {
                let (group, call) = super::group::call_of(tag);
                let notice = GaveUp {
                    call,
                    blamed,
                    reason,
                };
                let mut state = self.lock();
                state
                    .gave_up
                    .entry((source, group))
                    .or_default()
                    .push(notice);
                self.arrived.notify_all();
            }
            return;
        }
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
    /// wait of this rank fails naming it, since no collective can finish
    /// (with [`Mailbox::contain`], only for a peer of this rank's island).
    pub fn peer_died(&self, peer: usize, reason: String) {
        let mut state = self.lock();
        if state.dead.contains_key(&peer) {
            // It already said goodbye: its connection closing is expected.
            return;
        }
        state.dead.entry(peer).or_insert_with(|| reason.clone());
        if !state.contained(peer) {
            state.fatal.get_or_insert((peer, reason));
        }
        self.arrived.notify_all();
    }

    /// From now on only the death of a rank in `fatal` (this rank's
    /// island) fails every wait; another rank's death fails the waits on
    /// that rank alone (islands go on without a lost island).
    pub fn contain(&self, fatal: Range<usize>) {
        let mut state = self.lock();
        if state
            .fatal
            .as_ref()
            .is_some_and(|(peer, _)| !fatal.contains(peer))
        {
            state.fatal = None;
        }
        state.fatal_only = Some(fatal);
    }

    /// `peer` is back (a restarted rank of a lost island reconnected):
    /// waits on it work again, and anything its earlier self left queued
    /// is dropped. Call before its new connection delivers.
    pub fn revive(&self, peer: usize) {
        let mut state = self.lock();
        state.dead.remove(&peer);
        state.queues.retain(|(source, _), _| *source != peer);
        state.gave_up.retain(|(source, _), _| *source != peer);
        state.returned.insert(peer);
        self.arrived.notify_all();
    }

    /// The islands took `peer` back (its island rejoined): waits on it for
    /// collectives work again. Until then a restarted rank is not in the
    /// collectives its dead predecessor was in, and a wait on it there
    /// fails at once instead of at its timeout.
    pub fn readmit(&self, peer: usize) {
        self.lock().returned.remove(&peer);
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
            if state.returned.contains(&source) && !super::group::is_rejoin(tag) {
                return Err(CommError::PeerFailed {
                    peer: source,
                    reason: "it was restarted and its island has not rejoined yet (it died \
                             earlier)"
                        .into(),
                });
            }
            // Its messages sent before it gave up were taken above; no
            // more will come.
            if let Some(e) = state.gave_up(source, tag) {
                return Err(e);
            }
            if state.contained(source)
                && let Some(reason) = state.dead.get(&source)
            {
                return Err(CommError::PeerFailed {
                    peer: source,
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

    /// The sources with a message under `tag` waiting (one look, however
    /// many ranks the job has).
    pub fn sources_with(&self, tag: Tag) -> Vec<usize> {
        let state = self.lock();
        state
            .queues
            .keys()
            .filter(|(_, t)| *t == tag)
            .map(|(s, _)| *s)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WAIT: Duration = Duration::from_secs(5);

    #[test]
    fn a_death_breaks_every_wait_unless_contained_to_another_island() {
        // Without islands: rank 3's death fails a wait on rank 1 too.
        let m = Mailbox::default();
        m.peer_died(3, "killed".into());
        match m.take(1, 7, WAIT) {
            Err(CommError::PeerFailed { peer: 3, .. }) => {}
            other => panic!("expected rank 3 named, got {other:?}"),
        }

        // Islands of ranks 0..2 and 2..4, this rank in the first: rank 3's
        // death fails the waits on rank 3 only, at once; rank 1 still
        // delivers; a death in this island breaks everything again.
        let m = Mailbox::default();
        m.contain(0..2);
        m.peer_died(3, "killed".into());
        let t = Instant::now();
        match m.take(3, 7, WAIT) {
            Err(CommError::PeerFailed { peer: 3, reason }) => assert_eq!(reason, "killed"),
            other => panic!("expected rank 3 named, got {other:?}"),
        }
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        m.deliver(1, 7, Bytes::from_static(b"ok"));
        assert_eq!(m.take(1, 7, WAIT).unwrap(), Bytes::from_static(b"ok"));
        assert!(m.first_death().is_none());
        m.peer_died(1, "crashed".into());
        match m.take(0, 7, WAIT) {
            Err(CommError::PeerFailed { peer: 1, .. }) => {}
            other => panic!("expected rank 1 named, got {other:?}"),
        }

        // A death seen before the islands were known is contained too.
        let m = Mailbox::default();
        m.peer_died(2, "killed".into());
        m.contain(0..2);
        assert!(m.first_death().is_none());
        m.deliver(1, 7, Bytes::from_static(b"ok"));
        assert!(m.take(1, 7, WAIT).is_ok());
        assert!(m.take(2, 7, WAIT).is_err());
    }

    #[test]
    fn a_peer_that_gave_up_a_call_fails_the_waits_on_it_there_alone() {
        // Rank 1 sent step 0 of a call, then gave it up because rank 3
        // died: step 0 is still taken, a wait for step 1 fails at once
        // naming rank 3 (not rank 1), the next call and rank 2 are not
        // touched; a reason naming no rank fails as rank 1's giving up.
        let m = Mailbox::default();
        let call = |c: u64, step: u64| (7 << 40) | (c << 16) | step;
        m.deliver(1, call(5, 0), Bytes::from_static(b"part"));
        let killed = CommError::PeerFailed {
            peer: 3,
            reason: "killed".into(),
        };
        let notice = super::super::liveness::gave_up(1, call(5, 0), &killed);
        m.deliver(1, super::super::group::gave_up_tag(), notice);
        assert_eq!(m.take(1, call(5, 0), WAIT).unwrap(), "part");
        let t = Instant::now();
        match m.take(1, call(5, 1), WAIT) {
            Err(CommError::PeerFailed { peer: 3, reason }) => {
                assert!(
                    reason.contains("killed") && reason.contains("rank 1 gave up"),
                    "{reason}"
                )
            }
            other => panic!("expected rank 3 named, got {other:?}"),
        }
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        m.deliver(1, call(6, 0), Bytes::from_static(b"next"));
        m.deliver(2, call(5, 1), Bytes::from_static(b"other"));
        assert_eq!(m.take(1, call(6, 0), WAIT).unwrap(), "next");
        assert_eq!(m.take(2, call(5, 1), WAIT).unwrap(), "other");
        assert!(m.first_death().is_none());
        // Having given a call up for a failed rank, rank 1 makes no later
        // call of the group: a member that completed call 5 and waits on
        // it in call 7 fails at once too; another group's calls wait.
        match m.take(1, call(7, 2), WAIT) {
            Err(CommError::PeerFailed { peer: 3, reason }) => {
                assert!(reason.contains("gave up a call of this group"), "{reason}")
            }
            other => panic!("expected rank 3 named, got {other:?}"),
        }
        let short = Duration::from_millis(50);
        let other_group = (8 << 40) | (7 << 16);
        assert!(matches!(
            m.take(1, other_group, short),
            Err(CommError::Timeout { .. })
        ));

        let bad = CommError::Malformed("a 3-byte f32".into());
        let notice = super::super::liveness::gave_up(2, call(9, 0), &bad);
        m.deliver(2, super::super::group::gave_up_tag(), notice);
        match m.take(2, call(9, 4), WAIT) {
            Err(e @ CommError::GaveUp { by: 2, .. }) => {
                assert!(e.to_string().contains("a 3-byte f32"), "{e}");
                assert_eq!(e.failed_peer(), None);
            }
            other => panic!("expected rank 2's giving up, got {other:?}"),
        }
        // Its own error blamed no rank: its later calls of the group may
        // still come (a caller that goes on after a bad call).
        assert!(matches!(
            m.take(2, call(10, 0), short),
            Err(CommError::Timeout { .. })
        ));
        // A restarted rank 2 is a new process: its predecessor's notices go.
        m.revive(2);
        m.readmit(2);
        m.deliver(2, call(9, 4), Bytes::from_static(b"new"));
        assert_eq!(m.take(2, call(9, 4), WAIT).unwrap(), "new");
    }

    #[test]
    fn a_restarted_rank_is_out_of_the_collectives_until_readmitted() {
        // Rank 3 of the other island dies and its restarted self
        // reconnects: a collective's wait on it fails at once (it is not
        // in the collective its predecessor was in), its rejoin request
        // is taken, and once readmitted its collective messages are.
        let m = Mailbox::default();
        m.contain(0..2);
        m.peer_died(3, "killed".into());
        m.revive(3);
        let t = Instant::now();
        match m.take(3, 7, WAIT) {
            Err(CommError::PeerFailed { peer: 3, reason }) => {
                assert!(reason.contains("restarted"), "{reason}")
            }
            other => panic!("expected rank 3 named, got {other:?}"),
        }
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        let request = super::super::group::rejoin_tag(1);
        m.deliver(3, request, Bytes::from_static(b"back"));
        assert_eq!(
            m.take(3, request, WAIT).unwrap(),
            Bytes::from_static(b"back")
        );
        assert!(m.first_death().is_none());
        m.readmit(3);
        m.deliver(3, 7, Bytes::from_static(b"ok"));
        assert_eq!(m.take(3, 7, WAIT).unwrap(), Bytes::from_static(b"ok"));
    }
}
