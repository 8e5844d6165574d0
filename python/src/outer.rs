//! Islands' outer sync for `zeropp.torch`: one parameter shard's outer
//! state (anchor, outer momentum, error feedback) and its outer step across
//! the islands (`zeropp_zero::outer` on host buffers, on the job's
//! communication thread).

use std::sync::{Arc, Mutex};

use bytes::Bytes;

use pyo3::prelude::*;
use zeropp_comm::Transport;
use zeropp_quant::{QuantFormat, Rounding};
use zeropp_zero::ZeroError;
use zeropp_zero::allreduce::QuantizedAllReduce;
use zeropp_zero::host::HostMover;
use zeropp_zero::islands::{self, Across, ExchangeName, Membership};
use zeropp_zero::outer::{self, OuterSettings};
use zeropp_zero::residual::Residual;

use crate::buffers::HostBuf;
use crate::collectives::{Job, Op};
use crate::{invalid, to_py};

/// The outer state of one parameter shard.
#[pyclass(frozen)]
pub struct OuterState {
    settings: OuterSettings,
    /// The exchange's format (int4 blocks, error feedback), or None: f32.
    quantized: Option<QuantizedAllReduce>,
    state: Arc<Mutex<outer::OuterState>>,
}

#[pymethods]
impl OuterState {
    /// The state of a shard whose weights are `weights` now (a float32
    /// host buffer: the anchor the island starts from). `bits=4` sends
    /// the outer deltas as int4 blocks of `block` values (rotated with
    /// `hadamard`) with error feedback; `bits=None` in f32.
    #[new]
    #[pyo3(signature = (weights, lr=0.3, momentum=0.6, nesterov=true, bits=Some(4), block=64,
                        hadamard=true))]
    fn new(
        weights: &Bound<'_, PyAny>,
        lr: f32,
        momentum: f32,
        nesterov: bool,
        bits: Option<u32>,
        block: usize,
        hadamard: bool,
    ) -> PyResult<OuterState> {
        if !(lr > 0.0 && lr.is_finite() && (0.0..1.0).contains(&momentum)) {
            return Err(invalid(format!(
                "outer lr={lr}, momentum={momentum}: the learning rate must be positive and the \
                 momentum in [0, 1)"
            )));
        }
        let quantized = match bits {
            None => None,
            Some(4) => Some(QuantizedAllReduce {
                format: QuantFormat::int4(block).map_err(|e| invalid(e.to_string()))?,
                rounding: Rounding::NearestEven,
                hadamard,
            }),
            Some(other) => {
                return Err(invalid(format!(
                    "outer bits={other}: the outer deltas travel as int4 (4) or f32 (None)"
                )));
            }
        };
        let buf = HostBuf::new(weights, false, "weights")?;
        let w = buf.typed::<f32>("weights (float32)").map_err(to_py)?;
        Ok(OuterState {
            settings: OuterSettings {
                lr,
                momentum,
                nesterov,
            },
            quantized,
            state: Arc::new(Mutex::new(outer::OuterState::new(w))),
        })
    }

    /// Bytes of outer state held (anchor, momentum, residuals).
    fn bytes(&self) -> usize {
        self.state.lock().map(|s| s.bytes()).unwrap_or(0)
    }

    /// Copies the anchor and the outer momentum into `anchor` and
    /// `momentum` (float32 host buffers of the shard's length): what a
    /// checkpoint keeps.
    fn save_into(&self, anchor: &Bound<'_, PyAny>, momentum: &Bound<'_, PyAny>) -> PyResult<()> {
        let state = self.lock()?;
        copy_out(anchor, "anchor", &state.anchor)?;
        copy_out(momentum, "momentum", &state.momentum)
    }

    /// Copies a finished exchange waiting to land (streaming) into `then`
    /// and `averaged` (float32 host buffers of the shard's length): what a
    /// checkpoint keeps of it. Whether there was one.
    fn save_flight_into(
        &self,
        then: &Bound<'_, PyAny>,
        averaged: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let state = self.lock()?;
        let Some(flight) = &state.flight else {
            return Ok(false);
        };
        copy_out(then, "then", &flight.then)?;
        copy_out(averaged, "averaged", &flight.averaged)?;
        Ok(true)
    }

    /// Restores a checkpoint's exchange waiting to land (what
    /// `save_flight_into` copied), to be landed at its step.
    fn load_flight(&self, then: &Bound<'_, PyAny>, averaged: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut state = self.lock()?;
        let len = state.anchor.len();
        state.flight = Some(outer::Flight {
            due: 0,
            then: read_in(then, "then", len)?,
            averaged: read_in(averaged, "averaged", len)?,
        });
        Ok(())
    }

    /// Replaces the anchor and the outer momentum by `anchor` and
    /// `momentum` (a checkpoint's); the exchange's error feedback starts
    /// over.
    fn load(&self, anchor: &Bound<'_, PyAny>, momentum: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut state = self.lock()?;
        let len = state.anchor.len();
        let (a, m) = (
            read_in(anchor, "anchor", len)?,
            read_in(momentum, "momentum", len)?,
        );
        *state = outer::OuterState {
            anchor: a,
            momentum: m,
            ..outer::OuterState::default()
        };
        Ok(())
    }

    /// The outer step of `weights` (this rank's shard, float32, in place)
    /// across the islands `islands` says take part (the ranks of every
    /// island holding this shard, less the islands lost). The weights
    /// become the new anchor, the same on every island taking part; an
    /// island lost during the exchange leaves it and the exchange runs
    /// again without it. `at` (the outer sync's number from
    /// [`Islands::register`], the optimizer step, the exchanges this outer
    /// sync started before, the shard's index) names the exchange, which the
    /// islands left check they agree on before they run it again. An
    /// [`Op`] to wait on.
    fn step(
        &self,
        job: &Job,
        weights: &Bound<'_, PyAny>,
        islands: &Islands,
        at: At,
    ) -> PyResult<Op> {
        let buf = HostBuf::new(weights, true, "weights")?;
        buf.typed::<f32>("weights (float32)").map_err(to_py)?;
        let (settings, state) = (self.settings, self.state.clone());
        let with = (islands.members.clone(), self.quantized);
        Ok(job.submit_alone(move |mover| {
            let w = buf.typed_mut::<f32>("weights")?;
            let mut state = state
                .lock()
                .map_err(|_| ZeroError::Poisoned("outer state"))?;
            outer::outer_step_with(settings, &mut state, w, |state, mine| {
                exchange(mover, &with, state, mine, at)
            })
        }))
    }

    /// Streaming: starts the outer step of `weights` (as [`step`]) and
    /// returns at once. The island trains on from the outer step on its
    /// own delta, written into `weights` now (the eager update), while
    /// the exchange runs on the job's communication thread; wait on the
    /// [`Op`], then [`land`] it at the step it is due. One exchange of a
    /// shard at a time.
    ///
    /// [`step`]: OuterState::step
    /// [`land`]: OuterState::land
    fn start(
        &self,
        job: &Job,
        weights: &Bound<'_, PyAny>,
        islands: &Islands,
        at: At,
    ) -> PyResult<Op> {
        let buf = HostBuf::new(weights, true, "weights")?;
        let (delta, eager) = {
            let state = self.lock()?;
            if state.flight.is_some() {
                return Err(invalid(
                    "an outer exchange of this shard has not landed yet: land it before the next \
                     one starts",
                ));
            }
            let w = buf.typed::<f32>("weights (float32)").map_err(to_py)?;
            let delta = outer::local_delta(&state, w).map_err(to_py)?;
            let eager = outer::eager(self.settings, &state, &delta);
            (delta, eager)
        };
        buf.typed_mut::<f32>("weights")
            .map_err(to_py)?
            .copy_from_slice(&eager);
        let state = self.state.clone();
        let with = (islands.members.clone(), self.quantized);
        Ok(job.submit_outer(move |mover| {
            let mut state = state
                .lock()
                .map_err(|_| ZeroError::Poisoned("outer state"))?;
            let averaged = exchange(mover, &with, &mut state, delta, at)?;
            state.flight = Some(outer::Flight {
                due: 0,
                then: eager,
                averaged,
            });
            Ok(())
        }))
    }

    /// Applies the exchange [`start`](OuterState::start) began (after its
    /// [`Op`] was waited on): the anchor moves by the averaged delta and
    /// `weights` become the new anchor plus what the island trained since
    /// the eager update. Whether there was one to land.
    fn land(&self, weights: &Bound<'_, PyAny>) -> PyResult<bool> {
        let mut state = self.lock()?;
        let Some(flight) = state.flight.take() else {
            return Ok(false);
        };
        let buf = HostBuf::new(weights, true, "weights")?;
        let w = buf.typed_mut::<f32>("weights (float32)").map_err(to_py)?;
        outer::apply(self.settings, &mut state, &flight.then, &flight.averaged, w)
            .map_err(to_py)?;
        Ok(true)
    }
}

impl OuterState {
    fn lock(&self) -> PyResult<std::sync::MutexGuard<'_, outer::OuterState>> {
        self.state
            .lock()
            .map_err(|_| invalid("the outer state is poisoned (an outer step panicked)"))
    }
}

/// Averages `mine` over the islands `members` says take part (an island
/// lost meanwhile leaves and the exchange runs again without it), with
/// the error feedback `state` keeps.
fn exchange(
    mover: &HostMover<'_>,
    (members, quantized): &(Arc<Mutex<Membership>>, Option<QuantizedAllReduce>),
    state: &mut outer::OuterState,
    mine: Vec<f32>,
    at: At,
) -> Result<Vec<f32>, ZeroError> {
    let across = Across {
        members,
        counter: mover.counter,
        quantized: *quantized,
    };
    let residuals = (
        std::mem::take(&mut state.sent),
        std::mem::take(&mut state.owned),
    );
    let (averaged, sent, owned, _) = across.exchange(mover.comm, mine, residuals, name(at))?;
    (state.sent, state.owned) = (sent, owned);
    Ok(averaged)
}

/// An exchange's name from Python's (the outer sync's number over these
/// islands, optimizer step, exchanges that outer sync started before it,
/// parameter index).
type At = (u64, u64, u64, usize);

/// An exchange's name from Python's [`At`].
fn name((sync, step, seq, unit): At) -> ExchangeName {
    ExchangeName {
        sync,
        step,
        unit,
        seq,
    }
}

/// Which islands of an (islands, ranks) mesh take part in the outer sync,
/// as this rank knows it, shared by the outer states of its shards. Made,
/// the job's transport contains the death of a rank of another island to
/// the waits on that rank (this island's own ranks still fail every
/// wait): an island that loses a rank leaves the outer sync, and the
/// others go on without it.
#[pyclass(frozen)]
pub struct Islands {
    members: Arc<Mutex<Membership>>,
    /// The outer syncs registered over these islands.
    syncs: std::sync::atomic::AtomicU64,
}

#[pymethods]
impl Islands {
    /// The islands of `job` whose ranks at this rank's place are `ranks`
    /// (the mesh dimension across islands, registered with
    /// `add_mesh_dim`), `size` ranks each: island i holds the job's ranks
    /// i·size to (i+1)·size − 1.
    #[new]
    fn new(job: &Job, ranks: Vec<usize>, size: usize) -> PyResult<Islands> {
        let (_, groups) = job.dim_groups(&ranks)?;
        let rank = job.layout().rank;
        let place = rank % size.max(1);
        let count = ranks.len();
        let laid_out = size > 0
            && job.layout().world() == count * size
            && ranks
                .iter()
                .enumerate()
                .all(|(i, &r)| r == i * size + place);
        if !laid_out {
            return Err(invalid(format!(
                "islands over ranks {ranks:?} of {size} ranks each on rank {rank} of a job of {}: \
                 an island is a run of consecutive ranks (the mesh of \
                 init_device_mesh(device, (islands, ranks_per_island)))",
                job.layout().world()
            )));
        }
        let island = rank / size;
        job.counter()
            .contain_deaths(island * size..(island + 1) * size);
        Ok(Islands {
            members: Arc::new(Mutex::new(Membership::new(
                count,
                size,
                island,
                place,
                groups.world.clone(),
            ))),
            syncs: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// A number for an outer sync over these islands (0, 1, ... in the
    /// order they are made, the same on every rank when each makes its
    /// outer syncs in the same order): part of each of its exchanges'
    /// names, so two outer syncs' exchanges are never taken for one.
    fn register(&self) -> u64 {
        self.syncs
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    /// The islands that left the outer sync: (island, the optimizer step
    /// after which the others went on without it, why).
    fn lost(&self) -> Vec<(usize, u64, String)> {
        islands::lock(&self.members)
            .lost
            .iter()
            .map(|l| (l.island, l.step, l.why.clone()))
            .collect()
    }

    /// Finds islands lost since the last exchange: a one-value exchange
    /// over the islands taking part (every rank of them calls it at the
    /// same point, `at` naming it), which a lost island leaves as any
    /// exchange does. An [`Op`] to wait on.
    fn probe(&self, job: &Job, at: At) -> Op {
        let members = self.members.clone();
        job.submit_alone(move |mover| {
            let across = Across {
                members: &members,
                counter: mover.counter,
                quantized: None,
            };
            let none = (Residual::none(), Residual::none());
            across.exchange(mover.comm, vec![0.0], none, name(at))?;
            Ok(())
        })
    }

    /// Island `i` leaves the outer sync after optimizer step `step` (another
    /// rank of this island found it gone: `why`); not this rank's own.
    fn lose(&self, i: usize, step: u64, why: String) -> PyResult<()> {
        islands::lock(&self.members)
            .lose(i, step, why)
            .map_err(to_py)?;
        Ok(())
    }

    /// Whether an island is out of the outer sync now.
    fn missing_any(&self) -> bool {
        islands::lock(&self.members).missing_any()
    }

    /// The islands that rejoined: (island, the optimizer step after which
    /// it trained with the others again).
    fn rejoined(&self) -> Vec<(usize, u64)> {
        islands::lock(&self.members).rejoined.clone()
    }

    /// For each island, whether it is out and its rank at this rank's
    /// place has asked this one to take it back ([`Islands::rejoin`]).
    fn asked(&self, job: &Job) -> Vec<bool> {
        islands::asked_to_rejoin(&self.members, &*job.counter())
    }

    /// The islands taking part agree which lost islands come back after
    /// optimizer step `step` ([`islands::agree_ready`]), on the job's
    /// thread after the exchanges queued: every rank of those islands calls
    /// it at the same point. `ready` (float32 host buffer, one value per
    /// island: 1 where this island found it ready) becomes 1 for each
    /// island that comes back, else 0. An [`Op`] to wait on.
    fn agree_ready(&self, job: &Job, ready: &Bound<'_, PyAny>, step: u64) -> PyResult<Op> {
        let buf = HostBuf::new(ready, true, "ready")?;
        let count = islands::lock(&self.members).alive.len();
        if buf.typed::<f32>("ready (float32)").map_err(to_py)?.len() != count {
            return Err(invalid(format!("ready: one value per island ({count})")));
        }
        let members = self.members.clone();
        Ok(job.submit_alone(move |mover| {
            let v = buf.typed_mut::<f32>("ready")?;
            let back = islands::agree_ready(&members, mover.comm, v, step)?;
            for (j, x) in v.iter_mut().enumerate() {
                *x = f32::from(u8::from(back.contains(&j)));
            }
            Ok(())
        }))
    }

    /// The island that sends island `j` its state when it rejoins (the
    /// first taking part besides it).
    fn host_for(&self, j: usize) -> Option<usize> {
        islands::lock(&self.members).host_for(j)
    }

    /// Island `j` takes part again after optimizer step `step` (every rank
    /// of the islands taking part calls it at the same point, for each
    /// island that rejoins then): its request is answered and the groups
    /// across the islands are made anew. Its state follows
    /// ([`Islands::send_state`]).
    fn welcome(&self, job: &Job, j: usize, step: u64) -> PyResult<()> {
        islands::take_back(&self.members, &*job.counter(), j, step, job.timeout()).map_err(to_py)
    }

    /// Sends `state` (bytes) to island `j`'s rank at this rank's place (on
    /// the island that hosts its rejoin) and returns while it crosses
    /// ([`islands::send_rejoin_state`]).
    fn send_state(&self, job: &Job, j: usize, state: Vec<u8>) {
        let (counter, timeout) = (job.counter(), job.timeout());
        islands::send_rejoin_state(&self.members, &*counter, j, Bytes::from(state), timeout);
    }

    /// A restarted rank of a lost island: asks the islands' ranks at its
    /// place to take it back and waits (up to ten network timeouts: the
    /// others answer at their next outer sync) for the state one sends.
    /// Returns (the rank that sent it, the state).
    fn rejoin(&self, py: Python<'_>, job: &Job) -> PyResult<(usize, Vec<u8>)> {
        let (counter, wait) = (job.counter(), job.timeout() * 10);
        py.detach(|| islands::ask_to_rejoin(&self.members, &*counter, wait))
            .map(|(from, state)| (from, state.to_vec()))
            .map_err(to_py)
    }

    /// This rank's island rejoined after optimizer step `step`, the
    /// islands taking part being `alive` and their past `history` (as the
    /// state sent said): their ranks are readmitted, and its groups across
    /// the islands are made as the others made theirs.
    fn joined(&self, job: &Job, alive: Vec<bool>, step: u64, history: Vec<u8>) -> PyResult<()> {
        let history = islands::History::from_bytes(&history).map_err(to_py)?;
        islands::lock(&self.members)
            .joined(&*job.counter(), alive, step, history)
            .map_err(to_py)
    }

    /// The islands lost and rejoined so far (bytes, sent with a rejoin
    /// state: [`Islands::joined`] takes them).
    fn history<'py>(&self, py: Python<'py>) -> Bound<'py, pyo3::types::PyBytes> {
        let history = islands::lock(&self.members).history().to_bytes();
        pyo3::types::PyBytes::new(py, &history)
    }

    /// Whether island `i` takes part.
    fn alive(&self, i: usize) -> bool {
        islands::lock(&self.members)
            .alive
            .get(i)
            .copied()
            .unwrap_or(false)
    }
}

/// Copies `from` (a shard's `what`) into the float32 host buffer `buf` of
/// the same length.
fn copy_out(buf: &Bound<'_, PyAny>, what: &str, from: &[f32]) -> PyResult<()> {
    let buf = HostBuf::new(buf, true, what)?;
    let to = buf.typed_mut::<f32>(what).map_err(to_py)?;
    if to.len() != from.len() {
        return Err(invalid(format!(
            "a {what} buffer of {} values for a shard of {}",
            to.len(),
            from.len()
        )));
    }
    to.copy_from_slice(from);
    Ok(())
}

/// A shard's `what` from a checkpoint's float32 host buffer `buf`, which
/// must hold `len` values.
fn read_in(buf: &Bound<'_, PyAny>, what: &str, len: usize) -> PyResult<Vec<f32>> {
    let buf = HostBuf::new(buf, false, what)?;
    let v = buf.typed::<f32>(what).map_err(to_py)?;
    if v.len() != len {
        return Err(invalid(format!(
            "a saved {what} of {} values for a shard of {len}: the checkpoint was cut for \
             another layout",
            v.len()
        )));
    }
    Ok(v.to_vec())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<OuterState>()?;
    m.add_class::<Islands>()
}
