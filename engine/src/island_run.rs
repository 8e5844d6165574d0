//! Islands (DiLoCo over shards, `zero::outer`), what a rank holds for
//! them (its settings, `IslandConfig`, and its run, `IslandRun`); the
//! engine's steps that use them are in `islands`.
//!
//! Islands: the job cut into islands
//! of whole nodes, each training as a job of its own ranks, and every H
//! steps each rank's outer delta averaged with the ranks holding the same
//! shard on the other islands. Streaming: the units are split into
//! fragments whose exchanges start at staggered steps and run on a
//! communication thread of their own while the island trains on from the
//! outer step on its own delta (eager); each lands `delay` steps after it
//! started (the outer step on the averaged delta, plus what the island
//! trained since the eager step).

use std::sync::{Arc, Mutex};

use zeropp_comm::collectives::{CommThread, Pending};
use zeropp_comm::{Communicator, Group};
use zeropp_zero::ZeroError;
use zeropp_zero::allreduce::QuantizedAllReduce;
pub use zeropp_zero::islands::LostIsland;
use zeropp_zero::islands::Membership;
pub(crate) use zeropp_zero::islands::lock;
use zeropp_zero::outer::{OuterSettings, OuterState};
use zeropp_zero::residual::Residual;

use crate::{EngineError, IslandsError, Result};

/// How a job runs as islands.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct IslandConfig {
    /// Islands: consecutive whole nodes each.
    pub count: usize,
    /// Inner steps between two exchanges of one fragment (H).
    pub sync_every: usize,
    /// H is chosen on the way: after every fragment's first exchange, from
    /// what it took against the inner steps ([`AUTO_SYNC_SHARE`]).
    pub auto: bool,
    /// The step the schedule counts from (where an automatic H began).
    pub origin: usize,
    pub outer: OuterSettings,
    /// How the outer deltas travel: quantized with error feedback, or
    /// f32 (`None`).
    pub quantized: Option<QuantizedAllReduce>,
    /// Fragments of consecutive units (at most the units): fragment f's
    /// exchanges start f·H/F steps after fragment 0's, so the link carries
    /// a fragment at a time.
    pub fragments: usize,
    /// Steps an exchange runs while the island trains on before it is
    /// applied (below H; 0: at once, the island waits for it).
    pub delay: usize,
}

impl IslandConfig {
    /// Settings that cannot run, said with what to set.
    pub fn check(&self) -> std::result::Result<(), IslandsError> {
        if self.sync_every == 0 {
            return Err(IslandsError::SyncEveryZero);
        }
        if self.fragments == 0 {
            return Err(IslandsError::NoFragments);
        }
        if self.delay >= self.sync_every {
            return Err(IslandsError::DelayTooLong {
                delay: self.delay,
                sync_every: self.sync_every,
            });
        }
        Ok(())
    }

    /// Fragments of a model of `units` units: never more than its units.
    pub fn fragments_of(&self, units: usize) -> usize {
        self.fragments.min(units)
    }

    /// The fragment of unit `u` of `units` (consecutive units).
    pub(crate) fn fragment(&self, u: usize, units: usize) -> usize {
        u * self.fragments_of(units) / units
    }

    /// Whether fragment `f` (of `units`' fragments) starts an exchange
    /// after `steps` optimizer steps.
    pub(crate) fn starts(&self, f: usize, units: usize, steps: usize) -> bool {
        let (h, n) = (self.sync_every, self.fragments_of(units));
        steps > self.origin && (steps - self.origin) % h == (f * h / n) % h
    }

    /// The H an automatic schedule settles on, for an exchange of the
    /// whole model taking `exchange_s` and an inner step `inner_s`: the
    /// smallest at which the syncs cost at most [`AUTO_SYNC_SHARE`] of
    /// the inner steps when waited for, or hide behind them when streamed
    /// (above the delay); with why, in words.
    pub fn auto_sync_every(&self, exchange_s: f64, inner_s: f64) -> (usize, String) {
        let inner = inner_s.max(1e-9);
        if self.delay == 0 {
            let h = (exchange_s / (AUTO_SYNC_SHARE * inner)).ceil().max(1.0) as usize;
            let why = format!(
                "an exchange of the whole model took {exchange_s:.3} s and an inner step \
                 {inner_s:.3} s: H = {h} is the smallest at which the syncs, waited for, cost at \
                 most {:.0}% of the inner steps",
                AUTO_SYNC_SHARE * 100.0
            );
            (h, why)
        } else {
            let h = zeropp_zero::cost::hiding_sync_every(exchange_s, inner).max(self.delay + 1);
            let why = format!(
                "an exchange of the whole model took {exchange_s:.3} s and an inner step \
                 {inner_s:.3} s: H = {h} is the smallest whose inner steps hide the streamed \
                 exchanges (above the delay of {})",
                self.delay
            );
            (h, why)
        }
    }
}

/// What the syncs may cost an automatic H, waited for: this share of the
/// inner steps.
pub const AUTO_SYNC_SHARE: f64 = 0.15;

/// An exchange on the islands' thread: the averaged delta and the
/// residuals it used come back.
type Exchange = Pending<(Vec<f32>, Residual, Residual, f64), ZeroError>;

/// This rank's part in the islands' outer sync.
pub(crate) struct IslandRun {
    pub(crate) cfg: IslandConfig,
    /// This rank's island.
    pub(crate) island: usize,
    /// Which islands take part, and the ranks at this rank's place in
    /// them (the exchanges run over them as `Hop::World`).
    pub(crate) members: Arc<Mutex<Membership>>,
    /// The exchanges' own communication thread.
    pub(crate) thread: CommThread,
    /// Each unit's outer state (a finished exchange waiting for its step
    /// in its `flight`).
    pub(crate) states: Vec<OuterState>,
    /// Each unit's exchange under way: its due step, the weights when it
    /// started, and the exchange.
    pub(crate) live: Vec<Option<(u64, Vec<f32>, Exchange)>>,
    /// Exchanges started (of fragments), and seconds the compute thread
    /// waited for them to land.
    pub(crate) exchanges: usize,
    pub(crate) waited_s: f64,
    /// Seconds the islands' thread spent exchanging (all units).
    pub(crate) exchange_s: f64,
    /// Seconds of each inner step (an automatic H's measure).
    pub(crate) step_times: Vec<f64>,
    /// An automatic H once chosen: H, the step it counts from, and why.
    pub(crate) chosen: Option<(usize, u64, String)>,
}

impl IslandRun {
    pub(crate) fn new(
        cfg: IslandConfig,
        (island, place, size): (usize, usize, usize),
        across: Arc<Group>,
        comm: Arc<Communicator>,
        masters: &[&[f32]],
    ) -> IslandRun {
        IslandRun {
            cfg,
            island,
            members: Arc::new(Mutex::new(Membership::new(
                cfg.count, size, island, place, across,
            ))),
            thread: CommThread::new(comm),
            states: masters.iter().map(|m| OuterState::new(m)).collect(),
            live: masters.iter().map(|_| None).collect(),
            exchanges: 0,
            waited_s: 0.0,
            exchange_s: 0.0,
            step_times: Vec::new(),
            chosen: None,
        }
    }

    /// Unit `u`'s outer state as a checkpoint keeps it: an error while
    /// its exchange is under way (`Engine::settle_outer` first).
    pub(crate) fn saved(&self, u: usize) -> Result<OuterState> {
        if self.live[u].is_some() {
            return Err(EngineError::Checkpoint(
                "an outer exchange is under way: settle_outer before saving".into(),
            ));
        }
        Ok(self.states[u].clone())
    }

    /// Bytes of outer state held: every unit's, and what the exchanges
    /// under way hold (the weights when they started, the delta).
    pub(crate) fn outer_bytes(&self) -> usize {
        let live: usize = self
            .live
            .iter()
            .flatten()
            .map(|(_, then, _)| 8 * then.len())
            .sum();
        self.states.iter().map(|s| s.bytes()).sum::<usize>() + live
    }

    /// Every unit's state from a checkpoint (nothing under way).
    pub(crate) fn restore(&mut self, states: Vec<OuterState>) {
        self.live = states.iter().map(|_| None).collect();
        self.states = states;
    }
}
