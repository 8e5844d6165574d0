//! Byte counters: every byte this rank sends, by phase (forward gather,
//! backward gather, gradient, other, HSDP's replicate all-reduce, islands'
//! outer sync, frozen weights' crossings) and hop class (inside the node, across nodes), payload and
//! block scales separately. Counted in a transport
//! wrapper, so they are what was actually handed to the network (frame
//! headers aside).

use std::collections::HashMap;
use std::sync::Mutex;
use std::thread::ThreadId;
use std::time::Duration;

use bytes::Bytes;
use serde::Serialize;

use zeropp_comm::{CommError, SendHandle, Tag, Transport};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    ForwardGather = 0,
    BackwardGather = 1,
    Gradient = 2,
    Other = 3,
    /// HSDP's gradient all-reduce across its replicate dimension.
    Replicate = 4,
    /// Islands' outer sync: the outer deltas across islands.
    Outer = 5,
    /// A forward gather's frozen weights: the ranges of a shard that hold
    /// frozen parameters when they cross (their first gather, a refresh
    /// after one changed) and the byte a rank sends to say they did not.
    Frozen = 6,
}

impl Phase {
    /// The phase of a weight gather: the backward's, or the forward's.
    pub fn gather(backward: bool) -> Phase {
        match backward {
            true => Phase::BackwardGather,
            false => Phase::ForwardGather,
        }
    }
}

/// Bytes sent on one hop class.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct HopBytes {
    pub intra_node: u64,
    pub inter_node: u64,
}

/// Bytes sent in one phase: everything, and the part that was block scales.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct PhaseBytes {
    pub total: HopBytes,
    pub scales: HopBytes,
}

/// All counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Traffic {
    pub forward_gather: PhaseBytes,
    pub backward_gather: PhaseBytes,
    pub gradient: PhaseBytes,
    pub other: PhaseBytes,
    /// HSDP's gradient all-reduce across the replicate dimension.
    pub replicate: PhaseBytes,
    /// Islands' outer sync across islands.
    pub outer: PhaseBytes,
    /// Forward gathers' frozen weights (crossings and checks); the rest of
    /// a forward gather, its trainable weights, counts as `forward_gather`.
    pub frozen: PhaseBytes,
    /// Messages sent, by hop class (each travels with a frame header).
    pub messages: HopBytes,
}

impl Traffic {
    fn phase_mut(&mut self, p: Phase) -> &mut PhaseBytes {
        match p {
            Phase::ForwardGather => &mut self.forward_gather,
            Phase::BackwardGather => &mut self.backward_gather,
            Phase::Gradient => &mut self.gradient,
            Phase::Other => &mut self.other,
            Phase::Replicate => &mut self.replicate,
            Phase::Outer => &mut self.outer,
            Phase::Frozen => &mut self.frozen,
        }
    }

    /// Sum over phases.
    pub fn total(&self) -> HopBytes {
        let mut t = HopBytes::default();
        for p in [
            self.forward_gather,
            self.backward_gather,
            self.gradient,
            self.other,
            self.replicate,
            self.outer,
            self.frozen,
        ] {
            t.intra_node += p.total.intra_node;
            t.inter_node += p.total.inter_node;
        }
        t
    }

    /// `self − earlier`, phase by phase.
    pub fn since(&self, earlier: &Traffic) -> Traffic {
        let d = |a: HopBytes, b: HopBytes| HopBytes {
            intra_node: a.intra_node - b.intra_node,
            inter_node: a.inter_node - b.inter_node,
        };
        let p = |a: PhaseBytes, b: PhaseBytes| PhaseBytes {
            total: d(a.total, b.total),
            scales: d(a.scales, b.scales),
        };
        Traffic {
            forward_gather: p(self.forward_gather, earlier.forward_gather),
            backward_gather: p(self.backward_gather, earlier.backward_gather),
            gradient: p(self.gradient, earlier.gradient),
            other: p(self.other, earlier.other),
            replicate: p(self.replicate, earlier.replicate),
            outer: p(self.outer, earlier.outer),
            frozen: p(self.frozen, earlier.frozen),
            messages: d(self.messages, earlier.messages),
        }
    }
}

struct State {
    traffic: Traffic,
    /// Each sending thread's phase, and the fraction of each byte it sends
    /// now that is block scales: a collective sets them on the thread that
    /// then sends, so two communication threads (the engine's and the
    /// islands' outer one) count apart.
    phases: HashMap<ThreadId, (Phase, f64)>,
    /// While set, every send counts under this phase whatever the
    /// collectives set (the probe's timed routes).
    pinned: Option<Phase>,
}

impl State {
    /// The calling thread's phase and scale fraction (`Other` before it
    /// set one).
    fn current(&self) -> (Phase, f64) {
        let (phase, fraction) = self
            .phases
            .get(&std::thread::current().id())
            .copied()
            .unwrap_or((Phase::Other, 0.0));
        (self.pinned.unwrap_or(phase), fraction)
    }
}

/// A transport that counts what it sends.
pub struct CountingTransport {
    inner: Box<dyn Transport>,
    ranks_per_node: usize,
    state: Mutex<State>,
}

impl CountingTransport {
    pub fn new(inner: Box<dyn Transport>, ranks_per_node: usize) -> Self {
        CountingTransport {
            inner,
            ranks_per_node,
            state: Mutex::new(State {
                traffic: Traffic::default(),
                phases: HashMap::new(),
                pinned: None,
            }),
        }
    }

    /// Attributes the calling thread's following sends to `phase`,
    /// `scale_fraction` of each being block scales.
    pub fn set_phase(&self, phase: Phase, scale_fraction: f64) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.phases
            .insert(std::thread::current().id(), (phase, scale_fraction));
    }

    /// Runs `f` with every send counted under `phase`, whatever phases the
    /// collectives inside it set (the probe times training's collectives,
    /// whose bytes are not training's).
    pub fn pinned<R>(&self, phase: Phase, f: impl FnOnce() -> R) -> R {
        let set = |p: Option<Phase>| {
            let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
            s.pinned = p;
            s.phases.clear();
        };
        set(Some(phase));
        let r = f();
        set(None);
        r
    }

    pub fn traffic(&self) -> Traffic {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).traffic
    }

    /// Counts one message of `bytes` to `peer` that went by another path
    /// (NCCL, on device buffers) in `phase`, `scale_fraction` of it block
    /// scales, so that [`CountingTransport::traffic`] covers both paths.
    pub fn count_outside(&self, phase: Phase, scale_fraction: f64, peer: usize, bytes: u64) {
        if peer != self.rank() {
            let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
            self.add(&mut s.traffic, phase, scale_fraction, peer, bytes);
        }
    }

    fn add(&self, t: &mut Traffic, phase: Phase, scale_fraction: f64, peer: usize, n: u64) {
        let inter = peer / self.ranks_per_node != self.rank() / self.ranks_per_node;
        let scales = (n as f64 * scale_fraction).round() as u64;
        if inter {
            t.messages.inter_node += 1;
        } else {
            t.messages.intra_node += 1;
        }
        let pb = t.phase_mut(phase);
        let (total, sc) = if inter {
            (&mut pb.total.inter_node, &mut pb.scales.inter_node)
        } else {
            (&mut pb.total.intra_node, &mut pb.scales.intra_node)
        };
        *total += n;
        *sc += scales;
    }
}

impl Transport for CountingTransport {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn send(&self, peer: usize, tag: Tag, data: Bytes) -> Result<SendHandle, CommError> {
        if peer != self.rank() {
            let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
            let (phase, fraction) = s.current();
            self.add(&mut s.traffic, phase, fraction, peer, data.len() as u64);
        }
        self.inner.send(peer, tag, data)
    }

    fn recv(&self, peer: usize, tag: Tag, timeout: Duration) -> Result<Bytes, CommError> {
        self.inner.recv(peer, tag, timeout)
    }

    fn probe(&self, peer: usize, tag: Tag) -> bool {
        self.inner.probe(peer, tag)
    }

    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn first_death(&self) -> Option<(usize, String)> {
        self.inner.first_death()
    }

    fn contain_deaths(&self, fatal: std::ops::Range<usize>) {
        self.inner.contain_deaths(fatal)
    }

    fn declare_dead(&self, peer: usize, reason: String) {
        self.inner.declare_dead(peer, reason)
    }

    fn readmit(&self, peer: usize) {
        self.inner.readmit(peer)
    }

    fn waiting_from(&self, tag: Tag) -> Vec<usize> {
        self.inner.waiting_from(tag)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use zeropp_comm::inproc::InProcess;

    #[test]
    fn sends_by_another_path_count_like_the_transports_own() {
        // Rank 1 of 2 nodes x 2 ranks.
        let t = InProcess::world(4).into_iter().nth(1).unwrap();
        let c = CountingTransport::new(Box::new(t), 2);
        c.count_outside(Phase::ForwardGather, 0.25, 0, 400);
        c.count_outside(Phase::Gradient, 0.0, 3, 100);
        c.count_outside(Phase::Gradient, 0.0, 1, 999); // to itself: nothing
        let t = c.traffic();
        assert_eq!(t.forward_gather.total.intra_node, 400);
        assert_eq!(t.forward_gather.scales.intra_node, 100);
        assert_eq!(t.gradient.total.inter_node, 100);
        assert_eq!(t.messages.intra_node + t.messages.inter_node, 2);
        assert_eq!(t.total().intra_node + t.total().inter_node, 500);
    }
}
