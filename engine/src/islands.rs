//! The engine's islands steps (`island_run` holds their state): after
//! an optimizer step the exchanges due land and the fragments whose turn
//! it is start; a lost island is named and left; a restarted one rejoins.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use zeropp_comm::{Communicator, Group};
use zeropp_zero::ZeroError;
use zeropp_zero::islands::{self, Across, ExchangeName};
use zeropp_zero::outer::{self, Flight, OuterState};
use zeropp_zero::residual::Residual;
use zeropp_zero::traffic::Phase;

use crate::island_run::{IslandConfig, lock};
use crate::{Engine, EngineError, IslandsError, Result, UnitLayout, UnitShard};

impl Engine {
    /// The islands' work after an optimizer step (nothing without
    /// islands): the exchanges due land, then the fragments whose turn it
    /// is start theirs (and land at once without a delay).
    pub fn outer_after_step(&mut self) -> Result<()> {
        let Some(run) = self.islands.as_ref() else {
            return Ok(());
        };
        let (cfg, steps, n) = (run.cfg, self.step, self.units.len());
        let due: Vec<usize> = (0..n)
            .filter(|&u| self.due_at(u) == Some(steps as u64))
            .collect();
        for u in due {
            self.land(u)?;
        }
        let starting: Vec<usize> = (0..n)
            .filter(|&u| cfg.starts(cfg.fragment(u, n), n, steps))
            .collect();
        let joining = if starting.is_empty() {
            Vec::new()
        } else {
            self.membership_round()?
        };
        for &u in &starting {
            self.start(u, steps + cfg.delay)?;
        }
        self.count_exchanges(&starting);
        if cfg.delay == 0 {
            for u in starting {
                self.land(u)?;
            }
        }
        if !joining.is_empty() {
            self.welcome(&joining)?;
        }
        self.choose_sync_every()?;
        Ok(())
    }

    /// An automatic H, once every fragment's first exchange has landed:
    /// each rank's choice from its own measure (its exchanges of the
    /// whole model against the median inner step), the largest over the
    /// island and then over the islands, so that every rank counts the
    /// same schedule from this step on.
    fn choose_sync_every(&mut self) -> Result<()> {
        let n = self.units.len();
        let Some(run) = self.islands.as_ref() else {
            return Ok(());
        };
        let fragments = run.cfg.fragments_of(n);
        if !run.cfg.auto
            || run.chosen.is_some()
            || run.exchanges < fragments
            || run.live.iter().any(Option::is_some)
            || (0..n).any(|u| run.states[u].flight.is_some())
        {
            return Ok(());
        }
        let whole_s = self.whole_exchange_s();
        let mut times = run.step_times.clone();
        times.sort_by(f64::total_cmp);
        let inner_s = times.get(times.len() / 2).copied().unwrap_or(0.0);
        let (mine, why) = run.cfg.auto_sync_every(whole_s, inner_s);
        let across = lock(&run.members).across.clone();
        let island = self.groups.world.clone();
        let most = |group: Arc<Group>, v: usize| -> Result<usize> {
            let counter = self.counter.clone();
            let all = self
                .thread
                .submit(move |c| {
                    counter.set_phase(Phase::Other, 0.0);
                    c.all_gather_v(&group, Bytes::copy_from_slice(&(v as u64).to_le_bytes()))
                })
                .wait()?;
            Ok(all
                .iter()
                .filter_map(|b| b[..].try_into().ok().map(u64::from_le_bytes))
                .max()
                .unwrap_or(v as u64) as usize)
        };
        let h = most(island, mine)?;
        let h = if across.size() > 1 {
            most(across, h)?
        } else {
            h
        };
        let step = self.step;
        let run = self.islands.as_mut().expect("islands");
        let why = if h == mine {
            why
        } else {
            format!("{why} on this rank; H = {h}, the largest any rank of the islands asked")
        };
        run.cfg.sync_every = h;
        run.cfg.origin = step;
        tracing::info!("islands: H = {h} from step {step} ({why})");
        run.chosen = Some((h, step as u64, why));
        Ok(())
    }

    /// The islands' schedule now: H, the step it counts from, and (for an
    /// automatic H once chosen) why.
    pub fn island_schedule(&self) -> Option<(usize, usize, Option<String>)> {
        let run = self.islands.as_ref()?;
        Some((
            run.cfg.sync_every,
            run.cfg.origin,
            run.chosen.as_ref().map(|c| c.2.clone()),
        ))
    }

    /// Resumes a schedule a checkpoint saved (an automatic H chosen
    /// before it): H from step `origin`.
    pub fn set_island_schedule(&mut self, sync_every: usize, origin: usize) -> Result<()> {
        let Some(run) = self.islands.as_mut() else {
            return Ok(());
        };
        let cfg = IslandConfig {
            sync_every,
            origin,
            ..run.cfg
        };
        cfg.check()
            .map_err(|e| EngineError::Checkpoint(e.to_string()))?;
        run.cfg = cfg;
        run.chosen = Some((
            sync_every,
            origin as u64,
            format!("H = {sync_every} from step {origin}, chosen before the checkpoint"),
        ));
        Ok(())
    }

    /// Before a step's exchanges: the ranks of this island agree on which
    /// islands take part and on the lost islands all of whose ranks at
    /// this island's places asked to rejoin; while an island is out, the
    /// islands taking part then agree on who comes back (the same places
    /// of every island, so that all regroup at once). Returns the islands
    /// that rejoin after this step's exchanges (streamed islands: none,
    /// a rejoin needs the blocking sync).
    fn membership_round(&mut self) -> Result<Vec<usize>> {
        let run = self.islands.as_ref().expect("islands");
        let delay = run.cfg.delay;
        let size = self.plan.layout.world();
        let asked: Vec<f32> = islands::asked_to_rejoin(&run.members, &*self.counter)
            .into_iter()
            .map(|asked| (asked && delay == 0) as u8 as f32)
            .collect();
        let asked = self.agree_on_members(&asked)?;
        let ready: Vec<f32> = asked
            .iter()
            .map(|&n| (n == size as f32) as u8 as f32)
            .collect();
        // Streamed islands rejoin no one, and their exchanges may be under
        // way on the islands' thread over the same group: no call here.
        if !lock(&run.members).missing_any() || delay > 0 {
            return Ok(Vec::new());
        }
        let (counter, members, step) = (self.counter.clone(), run.members.clone(), self.step);
        Ok(self
            .thread
            .submit(move |c| {
                counter.set_phase(Phase::Other, 0.0);
                islands::agree_ready(&members, c, &ready, step as u64)
            })
            .wait()?)
    }

    /// The ranks of this island agree on which islands take part (an
    /// island any of them lost is lost to all), summing `extra` over the
    /// island in the same call; returns its sums.
    pub(crate) fn agree_on_members(&self, extra: &[f32]) -> Result<Vec<f32>> {
        let run = self.islands.as_ref().expect("islands");
        let mut flags: Vec<f32> = lock(&run.members)
            .alive
            .iter()
            .map(|&a| a as u8 as f32)
            .collect();
        let count = flags.len();
        flags.extend_from_slice(extra);
        let sums = self.sum_over_island(&flags)?;
        let everyone = self.plan.layout.world() as f32;
        let mut m = lock(&run.members);
        for (i, &n) in sums[..count].iter().enumerate() {
            if n < everyone {
                m.lose(
                    i,
                    self.step as u64,
                    "another rank of this island lost it".into(),
                )?;
            }
        }
        Ok(sums[count..].to_vec())
    }

    /// Islands `joining` rejoin after this step: every island taking part
    /// takes them back (and regroups with them), then the host island (the
    /// first taking part) sends each of its places' state, naming every
    /// island taking part now, to the same place of each.
    fn welcome(&mut self, joining: &[usize]) -> Result<()> {
        let step = self.step as u64;
        let run = self.islands.as_ref().expect("islands");
        let (members, island) = (run.members.clone(), run.island);
        let hosted: Vec<usize> = {
            let m = lock(&members);
            joining
                .iter()
                .copied()
                .filter(|&j| m.host_for(j) == Some(island))
                .collect()
        };
        for &j in joining {
            islands::take_back(&members, &*self.counter, j, step, self.timeout)?;
            tracing::info!("islands: island {j} rejoins after step {step}");
        }
        if !hosted.is_empty() {
            let (alive, history) = {
                let m = lock(&members);
                (m.alive.clone(), m.history())
            };
            let state = Bytes::from(encode_rejoin(step, &alive, &history, &self.shard_state()?));
            for j in hosted {
                islands::send_rejoin_state(
                    &members,
                    &*self.counter,
                    j,
                    state.clone(),
                    self.timeout,
                );
            }
        }
        Ok(())
    }

    /// A restarted rank of a lost island: asks the islands' ranks at its
    /// place to take it back, waits for the host's state at its next
    /// outer sync (up to ten network timeouts: the live islands sync
    /// every H steps), and loads it. Returns the step it resumes after.
    pub fn rejoin(&mut self) -> Result<usize> {
        let Some(run) = self.islands.as_ref() else {
            return Err(IslandsError::NotIslands.into());
        };
        if run.cfg.delay > 0 {
            return Err(IslandsError::RejoinWithDelay.into());
        }
        let members = run.members.clone();
        let (from, state) = islands::ask_to_rejoin(&members, &*self.counter, self.timeout * 10)?;
        let (step, alive, history, shards) = decode_rejoin(&state, &self.unit_layouts())
            .map_err(|e| EngineError::Checkpoint(format!("the state rank {from} sent: {e}")))?;
        self.load_shard_state(shards, step as usize)?;
        lock(&members)
            .joined(&*self.counter, alive, step, history)
            .map_err(|e| EngineError::Checkpoint(format!("the state rank {from} sent: {e}")))?;
        tracing::info!("islands: rejoined from rank {from} after step {step}");
        Ok(step as usize)
    }

    /// The end of the run: every exchange under way lands, and every unit
    /// not synced at this very step is synced now, so that every island
    /// holds the one model the job trained.
    pub fn outer_finish(&mut self) -> Result<()> {
        let Some(run) = self.islands.as_ref() else {
            return Ok(());
        };
        let (cfg, steps, n) = (run.cfg, self.step, self.units.len());
        for u in 0..n {
            if self.due_at(u).is_some() {
                self.land(u)?;
            }
        }
        // Without a delay, the units that synced at this step hold the
        // anchor already.
        let stale: Vec<usize> = (0..n)
            .filter(|&u| cfg.delay > 0 || !cfg.starts(cfg.fragment(u, n), n, steps))
            .collect();
        for &u in &stale {
            self.start(u, steps)?;
        }
        self.count_exchanges(&stale);
        for u in stale {
            self.land(u)?;
        }
        Ok(())
    }

    /// Waits for every exchange under way (without applying it), so that
    /// the outer state is whole: before a checkpoint.
    pub fn settle_outer(&mut self) -> Result<()> {
        for u in 0..self.units.len() {
            self.settle(u)?;
        }
        Ok(())
    }

    /// Exchanges of fragments started, seconds the compute thread waited
    /// for exchanges to land, and seconds the islands' thread spent
    /// exchanging.
    pub fn outer_exchanges(&self) -> (usize, f64, f64) {
        self.islands
            .as_ref()
            .map_or((0, 0.0, 0.0), |r| (r.exchanges, r.waited_s, r.exchange_s))
    }

    /// Seconds one exchange of the whole model took on this rank: the
    /// mean over the fragments' exchanges so far (0 before any).
    pub fn whole_exchange_s(&self) -> f64 {
        let fragments = self
            .islands
            .as_ref()
            .map_or(1, |r| r.cfg.fragments_of(self.units.len()));
        let (exchanges, _, exchange_s) = self.outer_exchanges();
        exchange_s * fragments as f64 / exchanges.max(1) as f64
    }

    /// Counts the exchanges of the fragments `units` (just started) are in.
    fn count_exchanges(&mut self, units: &[usize]) {
        let n = self.units.len();
        if let Some(run) = self.islands.as_mut() {
            let mut fragments: Vec<usize> = units.iter().map(|&u| run.cfg.fragment(u, n)).collect();
            fragments.dedup();
            run.exchanges += fragments.len();
        }
    }

    /// The step unit `u`'s exchange is due after, if one is under way or
    /// finished and waiting.
    fn due_at(&self, u: usize) -> Option<u64> {
        let run = self.islands.as_ref()?;
        match &run.live[u] {
            Some((due, ..)) => Some(*due),
            None => run.states[u].flight.as_ref().map(|f| f.due),
        }
    }

    /// Starts unit `u`'s exchange on the islands' thread: its delta from
    /// the anchor, averaged over the islands taking part, due after step
    /// `due`. An island whose rank dies or does not answer is lost and the
    /// exchange runs again over the others (the residuals start over:
    /// their shape follows the members); alone, the delta is the island's
    /// own.
    fn start(&mut self, u: usize, due: usize) -> Result<()> {
        let step = self.step as u64;
        let run = self.islands.as_mut().expect("islands");
        let state = &mut run.states[u];
        let master = &self.units[u].master;
        let mine = outer::local_delta(state, master)?;
        // Streamed (landing after later steps): the island trains on from
        // the outer step on its own delta while the average travels (an
        // eager update), and the landing moves it by what the other
        // islands' deltas change. Measured against training on from its
        // weights as they were (docs/TRAINING.md, "Streaming: eager"):
        // the eager island ends far closer to the blocking sync's loss.
        if due > self.step {
            let eager = outer::eager(run.cfg.outer, state, &mine);
            let su = &mut self.units[u];
            Arc::make_mut(&mut su.master).copy_from_slice(&eager);
            su.weights_jumped();
        }
        let master = &self.units[u].master;
        let residuals = (
            std::mem::take(&mut state.sent),
            std::mem::take(&mut state.owned),
        );
        let (counter, members, quantized) =
            (self.counter.clone(), run.members.clone(), run.cfg.quantized);
        let exchange = run.thread.submit(move |c: &Communicator| {
            let with = Across {
                members: &members,
                counter: &counter,
                quantized,
            };
            with.exchange(
                c,
                mine,
                residuals,
                ExchangeName {
                    sync: 0,
                    step,
                    unit: u,
                    seq: 0,
                },
            )
        });
        run.live[u] = Some((due as u64, master.to_vec(), exchange));
        Ok(())
    }

    /// Waits for unit `u`'s exchange under way, keeping it as a finished
    /// flight.
    fn settle(&mut self, u: usize) -> Result<()> {
        let name = self.units[u].name.clone();
        let Some(run) = self.islands.as_mut() else {
            return Ok(());
        };
        let Some((due, then, exchange)) = run.live[u].take() else {
            return Ok(());
        };
        let t = Instant::now();
        let (averaged, sent, owned, took) =
            exchange.wait().map_err(|source| EngineError::Unit {
                what: "the islands' outer exchange",
                unit: name,
                source,
            })?;
        run.waited_s += t.elapsed().as_secs_f64();
        run.exchange_s += took;
        let state = &mut run.states[u];
        (state.sent, state.owned) = (sent, owned);
        state.flight = Some(Flight {
            due,
            then,
            averaged,
        });
        Ok(())
    }

    /// Applies unit `u`'s exchange (waiting for it if it is under way):
    /// the outer step moves the anchor and the shard becomes the new
    /// anchor plus what the island trained since the exchange started.
    /// The unit's qwZ references restart (its weights jumped).
    fn land(&mut self, u: usize) -> Result<()> {
        self.settle(u)?;
        let run = self.islands.as_mut().expect("islands");
        let state = &mut run.states[u];
        let Some(flight) = state.flight.take() else {
            return Ok(());
        };
        let su = &mut self.units[u];
        outer::apply(
            run.cfg.outer,
            state,
            &flight.then,
            &flight.averaged,
            Arc::make_mut(&mut su.master).as_mut_slice(),
        )?;
        su.weights_jumped();
        Ok(())
    }
}

/// The rejoin state's first bytes.
const STATE_MAGIC: &[u8; 8] = b"ZPPREJN1";

/// A rejoining rank's state: the step, which islands take part, and each
/// unit's AdamW moments, anchor, outer momentum and master weights (left
/// out when they are the anchor, as right after the unit's sync: the
/// state crosses the slow link once, 16 or 20 bytes per value).
fn encode_rejoin(
    step: u64,
    alive: &[bool],
    history: &islands::History,
    shards: &[UnitShard],
) -> Vec<u8> {
    let mut out = STATE_MAGIC.to_vec();
    out.extend_from_slice(&step.to_le_bytes());
    out.extend_from_slice(&(alive.len() as u64).to_le_bytes());
    out.extend(alive.iter().map(|&a| a as u8));
    let history = history.to_bytes();
    out.extend_from_slice(&(history.len() as u64).to_le_bytes());
    out.extend_from_slice(&history);
    // Per unit: whether its master weights are its anchor (left out).
    let anchors: Vec<(&[f32], &[f32])> = shards
        .iter()
        .map(|sh| {
            let outer = sh.outer.as_ref();
            (
                outer.map_or(&[][..], |o| &o.anchor),
                outer.map_or(&[][..], |o| &o.momentum),
            )
        })
        .collect();
    let is_anchor: Vec<bool> = shards
        .iter()
        .zip(&anchors)
        .map(|(sh, (anchor, _))| {
            sh.master.len() == anchor.len()
                && sh
                    .master
                    .iter()
                    .zip(*anchor)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
        })
        .collect();
    out.extend(is_anchor.iter().map(|&f| f as u8));
    let mut put = |p: &[f32]| {
        out.extend_from_slice(&(p.len() as u64).to_le_bytes());
        out.extend_from_slice(bytemuck::cast_slice(p));
    };
    for ((sh, (anchor, momentum)), skip) in shards.iter().zip(anchors).zip(is_anchor) {
        for p in [&sh.m[..], &sh.v, anchor, momentum] {
            put(p);
        }
        if !skip {
            put(&sh.master);
        }
    }
    out
}

/// What is wrong with a rejoin state ([`decode_rejoin`]).
#[derive(Debug, thiserror::Error)]
enum BadRejoinState {
    #[error("truncated at byte {at} of {len}")]
    Truncated { at: usize, len: usize },
    #[error("not a rejoin state")]
    NotAState,
    #[error("{0} islands")]
    Islands(usize),
    #[error(transparent)]
    History(#[from] ZeroError),
    #[error("unit {unit:?}: a flag of {flag}")]
    Flag { unit: String, flag: u8 },
    #[error("unit {unit:?}: {len} values where this rank holds {chunk}")]
    Length {
        unit: String,
        len: usize,
        chunk: usize,
    },
    #[error("{0} bytes past the end")]
    Trailing(usize),
}

/// [`encode_rejoin`] read back for units of `layouts`; what is wrong
/// with it said.
fn decode_rejoin(
    bytes: &[u8],
    layouts: &[UnitLayout],
) -> std::result::Result<(u64, Vec<bool>, islands::History, Vec<UnitShard>), BadRejoinState> {
    let mut at = 0usize;
    let mut take = |n: usize| -> std::result::Result<&[u8], BadRejoinState> {
        let piece = bytes.get(at..at + n).ok_or(BadRejoinState::Truncated {
            at,
            len: bytes.len(),
        })?;
        at += n;
        Ok(piece)
    };
    if take(8)? != STATE_MAGIC {
        return Err(BadRejoinState::NotAState);
    }
    let word = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
    let step = word(take(8)?);
    let islands = word(take(8)?) as usize;
    if islands > 1 << 16 {
        return Err(BadRejoinState::Islands(islands));
    }
    let alive = take(islands)?.iter().map(|&b| b != 0).collect();
    let told = word(take(8)?) as usize;
    let history = islands::History::from_bytes(take(told.min(bytes.len()))?)?;
    let flags = take(layouts.len())?.to_vec();
    let mut shards = Vec::with_capacity(layouts.len());
    for (layout, &flag) in layouts.iter().zip(&flags) {
        if flag > 1 {
            return Err(BadRejoinState::Flag {
                unit: layout.name.clone(),
                flag,
            });
        }
        let mut part = || -> std::result::Result<Vec<f32>, BadRejoinState> {
            let len = word(take(8)?) as usize;
            if len != layout.chunk {
                return Err(BadRejoinState::Length {
                    unit: layout.name.clone(),
                    len,
                    chunk: layout.chunk,
                });
            }
            Ok(take(4 * len)?
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect())
        };
        let (m, v, anchor, momentum) = (part()?, part()?, part()?, part()?);
        let master = if flag == 1 { anchor.clone() } else { part()? };
        shards.push(UnitShard {
            layout: layout.clone(),
            master,
            m,
            v,
            residual: Residual::none(),
            residual_inter: Residual::none(),
            reference: None,
            outer: Some(OuterState {
                anchor,
                momentum,
                ..OuterState::default()
            }),
        });
    }
    if at != bytes.len() {
        return Err(BadRejoinState::Trailing(bytes.len() - at));
    }
    Ok((step, alive, history, shards))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LostIsland;

    fn layout(name: &str, chunk: usize) -> UnitLayout {
        UnitLayout {
            name: name.into(),
            numel: chunk * 2,
            padded: chunk * 2,
            chunk,
        }
    }

    fn shard(l: &UnitLayout, base: f32) -> UnitShard {
        let v = |k: f32| {
            (0..l.chunk)
                .map(|i| base + k + i as f32)
                .collect::<Vec<f32>>()
        };
        UnitShard {
            layout: l.clone(),
            master: v(0.0),
            m: v(0.1),
            v: v(0.2),
            residual: Residual::none(),
            residual_inter: Residual::none(),
            reference: None,
            outer: Some(OuterState {
                anchor: v(0.3),
                momentum: v(0.4),
                ..OuterState::default()
            }),
        }
    }

    #[test]
    fn a_rejoining_rank_s_state_round_trips_and_damage_is_named() {
        let layouts = [layout("embed", 3), layout("head", 5)];
        let mut shards: Vec<UnitShard> = layouts.iter().map(|l| shard(l, 1.0)).collect();
        // Right after its sync a unit's weights are its anchor: not sent.
        shards[1].master = shards[1].outer.as_ref().unwrap().anchor.clone();
        let none = islands::History::default();
        let head = 8 + 8 + 8 + 1 + 8 + none.to_bytes().len();
        let whole = encode_rejoin(40, &[true], &none, &shards[..1]).len() - head;
        assert_eq!(whole, 1 + 5 * (8 + 4 * 3));
        let skipped = encode_rejoin(40, &[true], &none, &shards[1..]).len() - head;
        assert_eq!(skipped, 1 + 4 * (8 + 4 * 5));
        let alive = [true, false, true];
        // The rejoined rank learns the run's losses and rejoins.
        let history = islands::History {
            lost: vec![LostIsland {
                island: 1,
                step: 12,
                why: "rank 3 died".into(),
            }],
            rejoined: vec![(1, 40)],
        };
        let bytes = encode_rejoin(40, &alive, &history, &shards);
        let (step, back_alive, back_history, back) = decode_rejoin(&bytes, &layouts).unwrap();
        assert_eq!((step, &back_alive[..]), (40, &alive[..]));
        assert_eq!(back_history, history);
        for (a, b) in back.iter().zip(&shards) {
            assert_eq!((&a.master, &a.m, &a.v), (&b.master, &b.m, &b.v));
            let (oa, ob) = (a.outer.as_ref().unwrap(), b.outer.as_ref().unwrap());
            assert_eq!((&oa.anchor, &oa.momentum), (&ob.anchor, &ob.momentum));
        }
        let truncated = decode_rejoin(&bytes[..bytes.len() - 3], &layouts)
            .unwrap_err()
            .to_string();
        assert!(truncated.contains("truncated"), "{truncated}");
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(
            decode_rejoin(&longer, &layouts)
                .unwrap_err()
                .to_string()
                .contains("past the end")
        );
        let other = [layout("embed", 4), layout("head", 5)];
        let wrong = decode_rejoin(&bytes, &other).unwrap_err().to_string();
        assert!(
            wrong.contains("\"embed\": 3 values where this rank holds 4"),
            "{wrong}"
        );
        assert!(
            decode_rejoin(b"garbage!garbage!", &layouts)
                .unwrap_err()
                .to_string()
                .contains("not a rejoin")
        );
    }
}
