//! `zeropp.torch`'s communication: a job joined through the store of the
//! user's `torch.distributed` job, and FSDP2's all-gather and
//! reduce-scatter as the ZeRO++ collectives of `zeropp-zero` (qwZ, hpZ,
//! qgZ, or ZeRO-3's plain rings). Each call is checked at once, runs on the
//! job's communication thread, and returns an [`Op`] to wait on, so
//! communication overlaps the caller's compute.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};
use zeropp_comm::collectives::{CommThread, Pending};
use zeropp_comm::exchange::{self, JoinOptions, TransportKind};
use zeropp_comm::{CommError, Communicator, Group, GroupKind};
use zeropp_zero::fsdp;
use zeropp_zero::host::{Host, HostMover};
use zeropp_zero::layout::Layout;
use zeropp_zero::measured::Measured;
use zeropp_zero::plan;
use zeropp_zero::traffic::{CountingTransport, Phase};
use zeropp_zero::{Hop, ZeroError, ZeroGroups, allreduce, delta, job, qgz};

use crate::buffers::{Dtype, HostBuf, ScratchCopy, with_dtype};
use crate::calls::{AllReduce, Gather, Scatter};
use crate::state::{AllReduceState, Plan, QgzState, QwzReference};
use crate::{invalid, to_py};

/// The transport a job asks for: `"ucx"`, `"tcp"`, or None
/// (ZEROPP_TRANSPORT, else UCX when libucp loads; rank 0 says why not).
fn transport_kind(transport: Option<&str>, rank: usize) -> PyResult<TransportKind> {
    match transport {
        Some("ucx") => Ok(TransportKind::Ucx),
        Some("tcp") => Ok(TransportKind::Tcp),
        Some(other) => Err(invalid(format!(
            "transport={other:?}: use \"ucx\", \"tcp\" or None (ZEROPP_TRANSPORT, else UCX \
             when libucp loads)"
        ))),
        None => {
            let (kind, why_not_ucx) = TransportKind::from_env().map_err(to_py)?;
            if let (Some(why), 0) = (why_not_ucx, rank) {
                eprintln!("zeropp: note: using TCP between ranks: {why}");
            }
            Ok(kind)
        }
    }
}

/// This host's address towards the job's master (`MASTER_ADDR`), or
/// loopback without one.
fn local_ip(master_addr: Option<&str>, master_port: Option<u16>) -> PyResult<std::net::IpAddr> {
    match master_addr {
        Some(host) if !host.is_empty() => {
            let master = zeropp_comm::rendezvous::resolve(host, master_port.unwrap_or(29500))
                .map_err(to_py)?;
            zeropp_comm::rendezvous::local_ip_towards(master).map_err(to_py)
        }
        _ => Ok(std::net::IpAddr::from([127, 0, 0, 1])),
    }
}

/// Joins the job, this rank's topology among its facts, every rank's
/// joining bytes through `exchange` (the torch store: a callable taking
/// this rank's bytes and returning every rank's, in rank order).
fn join_through_store(
    py: Python<'_>,
    exchange: &Py<PyAny>,
    opts: &JoinOptions,
) -> PyResult<exchange::Joined> {
    let mut call_exchange = |mine: Vec<u8>| -> Result<Vec<Vec<u8>>, CommError> {
        let store = |e: PyErr| {
            bad(format!(
                "exchanging zeropp's addresses through the torch.distributed store: {e}"
            ))
        };
        let all = exchange
            .bind(py)
            .call1((PyBytes::new(py, &mine),))
            .map_err(store)?;
        let all = all.cast::<PyList>().map_err(|e| store(e.into()))?;
        all.iter()
            .map(|b| b.extract::<Vec<u8>>().map_err(store))
            .collect()
    };
    exchange::join(opts, job::facts_to_publish(), &mut call_exchange).map_err(to_py)
}

/// A joined job: this rank's transport, communication thread, layout and
/// routing plan.
#[pyclass(frozen)]
pub struct Job {
    /// The job's communicator, used on `thread` (and by `outer`'s
    /// exchanges, on groups of their own).
    comm: Arc<Communicator>,
    /// The islands' streamed outer exchanges, started when first needed:
    /// they run while the island's own collectives go on `job.thread`.
    outer: std::sync::OnceLock<CommThread>,
    /// The counted transport, this rank's place and groups, the routing
    /// plan, the communication thread (one ordered queue: the host path's
    /// collectives, the probe, and the emulated device's stream), and the
    /// links (`zeropp_zero::job`'s
    /// rule, as the native trainer's): measured once, when `mode="zeropp"`
    /// is first resolved (every rank does that in the same order), so a
    /// ZeRO-3 job spends nothing on it.
    job: Arc<job::Joined>,
    /// Every group this rank has made, by its ranks (one set of ranks is
    /// one group, with one sequence of calls).
    known: Mutex<HashMap<Vec<usize>, Arc<Group>>>,
    /// The mesh dimensions zeropp serves: the whole job first, then those
    /// `add_mesh_dim` registered (FSDP2's shard dimension of a sub-mesh or
    /// an HSDP mesh, HSDP's replicate dimension).
    dims: Mutex<Vec<Arc<MeshDim>>>,
    transport: &'static str,
}

fn bad(msg: String) -> CommError {
    CommError::Invalid(msg)
}

#[pymethods]
impl Job {
    /// Joins the job: publishes this rank through `exchange` (a callable
    /// taking this rank's bytes and returning every rank's, in rank order —
    /// the torch store), connects zeropp's transport (`"ucx"`, `"tcp"`, or
    /// None: ZEROPP_TRANSPORT, else UCX when libucp loads, else TCP) and
    /// lays out the nodes from the hosts the ranks run on, or in runs of
    /// `ranks_per_node` (logical nodes on one machine). `island`: the
    /// job's ranks (start, end) of this rank's island, in a job of islands
    /// whose lost islands' restarted ranks rejoin it (over TCP: the live
    /// ranks take their connections later); `rejoining`: this rank is such
    /// a restarted one.
    #[new]
    #[pyo3(signature = (rank, world_size, exchange, token, master_addr=None, master_port=None,
                        transport=None, timeout_s=300.0, ranks_per_node=None, island=None,
                        rejoining=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        rank: usize,
        world_size: usize,
        exchange: Py<PyAny>,
        token: String,
        master_addr: Option<String>,
        master_port: Option<u16>,
        transport: Option<String>,
        timeout_s: f64,
        ranks_per_node: Option<usize>,
        island: Option<(usize, usize)>,
        rejoining: bool,
    ) -> PyResult<Job> {
        let kind = transport_kind(transport.as_deref(), rank)?;
        if let Some((start, end)) = island {
            if !(start <= rank && rank < end && end <= world_size) {
                return Err(invalid(format!(
                    "island=({start}, {end}): rank {rank}'s island is a run of the job's \
                     {world_size} ranks that holds it"
                )));
            }
            if kind != TransportKind::Tcp {
                return Err(invalid(
                    "a job whose islands rejoin runs over TCP (transport=\"tcp\"): only its \
                     ranks take a restarted rank's connection",
                ));
            }
        }
        let timeout = zeropp_comm::env::wait_limit(timeout_s).ok_or_else(|| {
            invalid(format!(
                "timeout_s={timeout_s}: {}",
                zeropp_comm::env::WAIT_LIMIT
            ))
        })?;
        zeropp_comm::scratch::budget_from_env().map_err(to_py)?;
        let opts = JoinOptions {
            kind,
            rank,
            world_size,
            token,
            ip: local_ip(master_addr.as_deref(), master_port)?,
            timeout,
            ranks_per_node,
            rejoins: island.map(|(start, end)| zeropp_comm::tcp::Rejoins {
                island: start..end,
                rejoining,
            }),
        };
        let joined = join_through_store(py, &exchange, &opts)?;
        let g = joined.hosts.ranks_per_node;
        let layout = Layout {
            nodes: world_size / g,
            ranks_per_node: g,
            rank,
        };
        let transport = joined.transport.name();
        let job = job::Joined::new(joined.transport, &joined.peers, layout, timeout, rejoining)
            .map_err(to_py)?;
        let comm = Arc::new(job.communicator());
        let groups = job.groups.clone();
        let known = [&groups.world, &groups.node, &groups.cross]
            .into_iter()
            .map(|g| (g.ranks().to_vec(), g.clone()))
            .collect();
        let world = MeshDim {
            ranks: (0..layout.world()).collect(),
            layout,
            groups: groups.clone(),
            outer: false.into(),
        };
        Ok(Job {
            outer: std::sync::OnceLock::new(),
            comm,
            job: Arc::new(job),
            known: Mutex::new(known),
            dims: Mutex::new(vec![Arc::new(world)]),
            transport,
        })
    }

    #[getter]
    fn rank(&self) -> usize {
        self.job.layout.rank
    }

    #[getter]
    fn world_size(&self) -> usize {
        self.job.layout.world()
    }

    #[getter]
    fn nodes(&self) -> usize {
        self.job.layout.nodes
    }

    #[getter]
    fn ranks_per_node(&self) -> usize {
        self.job.layout.ranks_per_node
    }

    #[getter]
    fn transport(&self) -> &'static str {
        self.transport
    }

    /// The routing plan every rank derived from every node's topology, as
    /// JSON (`{"error": ...}` when there is none).
    fn routing_json(&self) -> String {
        match &self.job.routing {
            Ok(view) => serde_json::to_string(view).unwrap_or_default(),
            Err(e) => serde_json::json!({ "error": e.to_string() }).to_string(),
        }
    }

    /// The switches of `mode` ("zeropp" or "zero3") with `overrides` (JSON
    /// object, `zeropp train`'s names) applied and the rest resolved from
    /// the routing plan and, for `"zeropp"`, the links and routes this
    /// job measures (the first call measures: every rank calls it in the
    /// same order), checked: JSON `{"switches": {...}, "why": {...}}`.
    #[pyo3(signature = (mode, overrides, ranks=None))]
    fn resolve_switches(
        &self,
        py: Python<'_>,
        mode: &str,
        overrides: &str,
        ranks: Option<Vec<usize>>,
    ) -> PyResult<String> {
        let layout = match ranks {
            Some(ranks) => self.dim(&ranks)?.layout,
            None => self.job.layout,
        };
        resolve(
            mode,
            overrides,
            layout,
            &self.job.routing,
            self.measured(py, mode)?.as_ref(),
        )
    }

    /// The plan of `switches` (resolved switches, as JSON) on the mesh
    /// dimension `ranks` (registered with `add_mesh_dim`; None: the whole
    /// job): how its collectives move data, decided once, and the state
    /// each parameter group keeps for them (`Plan.qwz_reference`,
    /// `Plan.qgz_state`, `Plan.all_reduce_state`). Switches that make no
    /// plan on this layout raise a ZeroppError naming the switch.
    #[pyo3(signature = (switches, ranks=None))]
    fn plan(&self, switches: &str, ranks: Option<Vec<usize>>) -> PyResult<Plan> {
        let switches: plan::Switches = serde_json::from_str(switches)
            .map_err(|e| invalid(format!("switches are not resolved switches: {e}")))?;
        let layout = match ranks {
            Some(ranks) => self.dim(&ranks)?.layout,
            None => self.job.layout,
        };
        Plan::new(layout, switches).map_err(to_py)
    }

    /// Registers the mesh dimension over `ranks` (global ranks, ascending;
    /// this rank among them) for the collectives FSDP2 runs over it, and
    /// the runs of `hpz_group` of its ranks inside a node its backward
    /// gathers use. `agree` takes a set of ranks and returns the number
    /// every member gives that set (through the job's store). Returns the
    /// dimension's layout — (nodes, ranks per node, this rank's position) —
    /// and this rank's node and cross group in it (global ranks). `outer`:
    /// the islands' dimension of an outer sync, which a failure of FSDP's
    /// collectives does not tell (`Job::submit`).
    #[pyo3(signature = (ranks, agree, hpz_group=None, outer=false))]
    #[allow(clippy::type_complexity)]
    fn add_mesh_dim(
        &self,
        py: Python<'_>,
        ranks: Vec<usize>,
        agree: Py<PyAny>,
        hpz_group: Option<usize>,
        outer: bool,
    ) -> PyResult<((usize, usize, usize), Vec<usize>, Vec<usize>)> {
        let mut number = |set: &[usize]| -> Result<usize, CommError> {
            agree
                .bind(py)
                .call1((set.to_vec(),))
                .and_then(|n| n.extract::<usize>())
                .map_err(|e| bad(format!("agreeing on a number for the group {set:?}: {e}")))
        };
        let dim = match self.find_dim(&ranks)? {
            Some(dim) => dim,
            None => {
                let layout = self.job.layout.of_ranks(&ranks).map_err(to_py)?;
                let groups = ZeroGroups::of_ranks(&layout, &ranks, |set| {
                    self.group_of_set(set, &mut number)
                })
                .map_err(to_py)?;
                let dim = Arc::new(MeshDim {
                    ranks,
                    layout,
                    groups,
                    outer: false.into(),
                });
                self.dims
                    .lock()
                    .map_err(|_| to_py(ZeroError::Poisoned("the job's mesh dimensions")))?
                    .push(dim.clone());
                dim
            }
        };
        if outer {
            dim.outer.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        let l = dim.layout;
        if let Some(h) = hpz_group.filter(|&h| h > 1 && h < l.ranks_per_node) {
            if !l.ranks_per_node.is_multiple_of(h) {
                return Err(invalid(format!(
                    "an hpZ group of {h} ranks does not divide the {} ranks this mesh \
                     dimension holds on a node",
                    l.ranks_per_node
                )));
            }
            let first = l.rank / h * h;
            self.group_of_set(dim.ranks[first..first + h].to_vec(), &mut number)
                .map_err(to_py)?;
        }
        let (node, cross) = l.node_and_cross(&dim.ranks);
        Ok(((l.nodes, l.ranks_per_node, l.rank), node, cross))
    }

    /// What was measured, as JSON: the links and the two collectives timed
    /// by each route (`null` before `mode="zeropp"` was resolved, and for
    /// logical nodes, one rank, or ZEROPP_PROBE=0).
    fn measured_json(&self) -> String {
        let m = self.job.measured_so_far();
        serde_json::to_string(&m).unwrap_or_else(|_| "null".into())
    }

    /// Bytes this rank sent, by phase and hop (JSON).
    fn traffic_json(&self) -> String {
        serde_json::to_string(&self.job.counter.traffic()).unwrap_or_default()
    }

    /// FSDP2's all-gather: `inp` (this rank's shard, `dtype` values) into
    /// `out` (every member's shard in group order), as `plan`'s weight
    /// wire says for this call (`WeightWire::for_call`): over the world
    /// qwZ (quantized, across nodes then inside), weight differences
    /// against `delta`'s references, or one ring in `dtype`; over the
    /// sub-group `ranks` (hpZ's, inside a node), one ring there.
    #[pyo3(signature = (out, inp, dtype, ranks, plan, backward=false, delta=None))]
    #[allow(clippy::too_many_arguments)]
    fn all_gather(
        &self,
        out: &Bound<'_, PyAny>,
        inp: &Bound<'_, PyAny>,
        dtype: &str,
        ranks: Vec<usize>,
        plan: PyRef<'_, Plan>,
        backward: bool,
        delta: Option<Py<QwzReference>>,
    ) -> PyResult<Op> {
        let dtype = Dtype::parse(dtype)?;
        let (out, inp) = (
            HostBuf::new(out, true, "output")?,
            HostBuf::new(inp, false, "input")?,
        );
        let (dim, hop, group) = self.gather_group(&ranks)?;
        if out.len() != inp.len() * group.size() {
            return Err(invalid(format!(
                "all-gather of {} input bytes over {} ranks needs an output of {} bytes, not {}",
                inp.len(),
                group.size(),
                inp.len() * group.size(),
                out.len()
            )));
        }
        let with = (backward, delta.is_some());
        let call = Gather::new(dtype, ranks, hop == Hop::World, &plan, with).map_err(to_py)?;
        // A sub-group's gather runs over it as hpZ's group.
        let groups = ZeroGroups {
            hpz: group,
            ..dim.groups.clone()
        };
        let layout = dim.layout;
        let frozen = delta.as_ref().map(|d| d.get().frozen_ranges());
        Ok(self.submit(groups, move |mover| {
            let mut reference = call.reference(delta.as_ref().map(|d| &d.get().reference))?;
            let frozen = frozen.unwrap_or_default();
            let (how, phase) = (call.how, call.phase);
            with_dtype!(call.dtype, T => {
                let shard: &[T] = inp.typed("input")?;
                // FSDP2 gathers in place: read the input from a copy then,
                // so it and the output never alias.
                let copy = out.overlaps(&inp).then(|| ScratchCopy::of(shard));
                let shard = copy.as_ref().map_or(shard, ScratchCopy::values);
                let mut o: &mut [T] = out.typed_mut("output")?;
                // Host memory is where the host path keeps them anyway.
                let r = reference.as_deref_mut().map(|reference| delta::Slot {
                    reference,
                    frozen: &frozen,
                    on_host: false,
                });
                fsdp::all_gather(&Host, mover, layout, hop, how, phase, r, &shard, &mut o)?;
            });
            Ok(())
        }))
    }

    /// FSDP2's reduce-scatter over the world: `inp` (W equal chunks, rank
    /// order) into `out` (this rank's chunk of the sum, or of the mean when
    /// `mean`). With `qgz`: the two-hop quantized all-to-all with f32 sums
    /// and that state's error feedback; without: ZeRO-3's ring in `dtype`.
    #[pyo3(signature = (out, inp, dtype, ranks, mean, qgz=None))]
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter(
        &self,
        out: &Bound<'_, PyAny>,
        inp: &Bound<'_, PyAny>,
        dtype: &str,
        ranks: Vec<usize>,
        mean: bool,
        qgz: Option<Py<QgzState>>,
    ) -> PyResult<Op> {
        let call = Scatter::new(Dtype::parse(dtype)?, ranks, mean);
        let dim = self.dim(&call.ranks)?;
        let w = dim.layout.world();
        let (out, inp) = (
            HostBuf::new(out, true, "output")?,
            HostBuf::new(inp, false, "input")?,
        );
        if inp.len() != out.len() * w {
            return Err(invalid(format!(
                "reduce-scatter of {} input bytes over {w} ranks needs an output of {} bytes, \
                 not {}",
                inp.len(),
                inp.len() / w,
                out.len()
            )));
        }
        let layout = dim.layout;
        Ok(self.submit(dim.groups.clone(), move |mover| {
            let state = qgz.as_ref().map(|q| q.get());
            let mut first = state
                .map(|s| s.feedback.host[0].lock())
                .transpose()
                .map_err(|_| poisoned())?;
            let mut second = state
                .map(|s| s.feedback.host[1].lock())
                .transpose()
                .map_err(|_| poisoned())?;
            let feedback = match (state, &mut first, &mut second) {
                (Some(s), Some(first), Some(second)) => {
                    qgz::Feedback::kept(s.keeps(), first.chunks_mut(), second.chunks_mut())
                }
                _ => qgz::Feedback::none(),
            };
            let (wire, reduction) = (call.wire(state), call.reduction);
            let how = (Scatter::rounding(state, layout.rank), feedback);
            with_dtype!(call.dtype, T => {
                let x: &[T] = inp.typed("input")?;
                let mut o: &mut [T] = out.typed_mut("output")?;
                fsdp::reduce_scatter(&Host, mover, layout, wire, how, reduction, &x, &mut o)?;
            });
            Ok(())
        }))
    }

    /// HSDP's all-reduce over its replicate dimension `ranks` (registered
    /// with `add_mesh_dim`): `buf` (`dtype` values, in place) becomes the
    /// sum over the dimension, or the mean when `mean`, the same on every
    /// member. With `state`: quantized (`zeropp_zero::allreduce`: int4
    /// blocks, f32 sums, that state's error feedback); without: ZeRO-3's
    /// reduce-scatter and all-gather in `dtype`.
    #[pyo3(signature = (buf, dtype, ranks, mean, state=None))]
    fn all_reduce(
        &self,
        buf: &Bound<'_, PyAny>,
        dtype: &str,
        ranks: Vec<usize>,
        mean: bool,
        state: Option<Py<AllReduceState>>,
    ) -> PyResult<Op> {
        let call = AllReduce::new(Dtype::parse(dtype)?, ranks, mean);
        let dim = self.dim(&call.ranks)?;
        let buf = HostBuf::new(buf, true, "all-reduce buffer")?;
        let rank = self.job.layout.rank;
        let (reduction, hop) = (call.reduction, (Hop::World, Phase::Replicate));
        Ok(self.submit(dim.groups.clone(), move |mover| {
            with_dtype!(call.dtype, T => {
                let x: &mut [T] = buf.typed_mut("buffer")?;
                match &state {
                    None => mover.all_reduce_tensor(&Host, hop, x, mean)?,
                    Some(state) => {
                        let state = state.get();
                        let [sent, owned] = &state.feedback.host;
                        let mut sent = sent.lock().map_err(|_| poisoned())?;
                        let mut owned = owned.lock().map_err(|_| poisoned())?;
                        let feedback = allreduce::ReplicaFeedback {
                            sent: state.error_feedback.then(|| sent.chunks_mut()),
                            owned: state.error_feedback.then(|| owned.chunks_mut()),
                        };
                        let s = state.settings(rank);
                        // The input read from a copy: the buffer is the
                        // output too.
                        let input = ScratchCopy::of(&*x);
                        let mut o: &mut [T] = x;
                        allreduce::all_reduce(
                            &Host, mover, hop, s, reduction, feedback, &input.values(), &mut o,
                        )?;
                    }
                }
            });
            Ok(())
        }))
    }
}

impl Job {
    /// What `mode` resolves by: for `"zeropp"` on a job that probes, the
    /// job's links and routes, measured on its communication thread the
    /// first time (after whatever it was doing) and kept.
    fn measured(&self, py: Python<'_>, mode: &str) -> PyResult<Option<Measured>> {
        // The model is not known when the first group resolves: zeroPP's
        // default switches, units of any size.
        let zpp = plan::as_they_would_run(plan::Switches::zeropp(256), &[], self.job.layout);
        let job = &self.job;
        py.detach(|| job.measured((mode == "zeropp", 1), &zpp, None))
            .map_err(|e| {
                to_py(crate::Raised {
                    peer: e.is_peer_failure(),
                    message: format!("measuring the links for mode=\"zeropp\": {e}"),
                })
            })
    }
}

fn poisoned() -> ZeroError {
    ZeroError::Poisoned("error-feedback buffer")
}

impl Job {
    /// Runs `f` on the communication thread with a byte mover over
    /// `groups`: the collective in flight.
    pub(crate) fn submit(
        &self,
        groups: ZeroGroups,
        f: impl FnOnce(&HostMover<'_>) -> Result<(), ZeroError> + Send + 'static,
    ) -> Op {
        let told = self.fsdp_dims_besides(&groups);
        self.submit_on(&self.job.thread, (groups, Some(told)), f)
    }

    /// The groups of the mesh dimensions FSDP2's collectives run over,
    /// other than `groups` (the call's own): HSDP's shard and replicate
    /// dimensions tell each other of a failure; neither the whole job
    /// (unless the call's own) nor an outer sync's islands are told.
    fn fsdp_dims_besides(&self, groups: &ZeroGroups) -> Vec<ZeroGroups> {
        let Ok(dims) = self.dims.lock() else {
            return Vec::new();
        };
        dims.iter()
            .skip(1)
            .filter(|d| !d.outer.load(std::sync::atomic::Ordering::Relaxed))
            .filter(|d| d.groups.world.ranks() != groups.world.ranks())
            .map(|d| d.groups.clone())
            .collect()
    }

    /// Runs `f` on the communication thread with a byte mover whose calls
    /// name their groups themselves (the islands' outer exchanges: the
    /// groups of the islands taking part).
    pub(crate) fn submit_alone(
        &self,
        f: impl FnOnce(&HostMover<'_>) -> Result<(), ZeroError> + Send + 'static,
    ) -> Op {
        self.submit_on(&self.job.thread, (self.job.groups.clone(), None), f)
    }

    /// As [`Job::submit_alone`], on the thread of the islands' streamed
    /// outer exchanges.
    pub(crate) fn submit_outer(
        &self,
        f: impl FnOnce(&HostMover<'_>) -> Result<(), ZeroError> + Send + 'static,
    ) -> Op {
        let thread = self
            .outer
            .get_or_init(|| CommThread::new(self.comm.clone()));
        self.submit_on(thread, (self.job.groups.clone(), None), f)
    }

    /// Runs `f` on `thread` with a byte mover over `groups`; with `told`
    /// (FSDP's collectives), a failure tells the members of `groups` and of
    /// `told` ([`ZeroGroups::give_up`]).
    fn submit_on(
        &self,
        thread: &CommThread,
        (groups, told): (ZeroGroups, Option<Vec<ZeroGroups>>),
        f: impl FnOnce(&HostMover<'_>) -> Result<(), ZeroError> + Send + 'static,
    ) -> Op {
        let counter = self.job.counter.clone();
        Op::new(
            self.job.layout.rank,
            thread.submit(move |c: &Communicator| {
                let done = f(&HostMover {
                    comm: c,
                    counter: &counter,
                    groups: groups.clone(),
                });
                // FSDP's collectives cannot go on after a failure: the
                // ranks waiting on this one in its groups' next calls hear
                // why at once (a gradient that is not finite here, or the
                // rank a failed call blamed), not at their timeout.
                if let (Err(e), Some(told)) = (&done, &told) {
                    e.with_notice(c.rank(), |e| {
                        for g in std::iter::once(&groups).chain(told) {
                            g.give_up(c, e);
                        }
                    });
                }
                done
            }),
        )
    }

    /// The communication thread (one ordered queue: the emulated device's
    /// stream).
    pub(crate) fn comm_thread(&self) -> Arc<CommThread> {
        self.job.thread.clone()
    }

    pub(crate) fn communicator(&self) -> Arc<Communicator> {
        self.comm.clone()
    }

    pub(crate) fn groups(&self) -> &ZeroGroups {
        &self.job.groups
    }

    pub(crate) fn layout(&self) -> Layout {
        self.job.layout
    }

    pub(crate) fn counter(&self) -> Arc<CountingTransport> {
        self.job.counter.clone()
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.job.timeout
    }

    /// The group of `ranks`: the one this rank already made of them, else
    /// a new one — a run of consecutive ranks inside a node by its place,
    /// any other set by the number `agree` gives it.
    fn group_of_set(
        &self,
        ranks: Vec<usize>,
        mut agree: impl FnMut(&[usize]) -> Result<usize, CommError>,
    ) -> Result<Arc<Group>, CommError> {
        let mut known = self
            .known
            .lock()
            .map_err(|_| bad("the job's groups were poisoned by a panic".into()))?;
        if let Some(group) = known.get(&ranks) {
            return Ok(group.clone());
        }
        let kind = match self.job.layout.check_subgroup(&ranks) {
            Ok(()) => GroupKind::Run {
                first: ranks[0],
                size: ranks.len(),
            },
            Err(_) => GroupKind::Agreed(agree(&ranks)?),
        };
        let group = Arc::new(Group::new(kind, ranks.clone())?);
        known.insert(ranks, group.clone());
        Ok(group)
    }

    /// The layout and groups of the registered mesh dimension over `ranks`
    /// (the emulated device's communicators are the host job's groups).
    pub(crate) fn dim_groups(&self, ranks: &[usize]) -> PyResult<(Layout, ZeroGroups)> {
        let dim = self.dim(ranks)?;
        Ok((dim.layout, dim.groups.clone()))
    }

    /// The group this rank made of `ranks` (a mesh dimension's, or an hpZ
    /// run registered with it), or a run of consecutive ranks of this node;
    /// no other set of ranks.
    pub(crate) fn known_group(&self, ranks: &[usize]) -> PyResult<Arc<Group>> {
        self.group_of_set(ranks.to_vec(), |set| {
            Err(CommError::Group(format!(
                "no group of ranks {set:?} on rank {}: zeropp runs over the mesh dimensions \
                 it was given and runs of their ranks inside a node that include this rank",
                self.job.layout.rank
            )))
        })
        .map_err(to_py)
    }

    /// The registered mesh dimension over exactly `ranks`, if any.
    fn find_dim(&self, ranks: &[usize]) -> PyResult<Option<Arc<MeshDim>>> {
        let dims = self
            .dims
            .lock()
            .map_err(|_| to_py(ZeroError::Poisoned("the job's mesh dimensions")))?;
        Ok(dims.iter().find(|d| d.ranks == ranks).cloned())
    }

    /// The mesh dimension over `ranks`: the whole job, or one registered.
    fn dim(&self, ranks: &[usize]) -> PyResult<Arc<MeshDim>> {
        self.find_dim(ranks)?.ok_or_else(|| {
            invalid(format!(
                "a collective over ranks {ranks:?}, which is no mesh dimension zeropp was \
                 given: zeropp serves the meshes of the modules zeropp.torch.fully_shard or \
                 enable sharded (the whole job ranks 0..{}, or a dimension they registered)",
                self.job.layout.world()
            ))
        })
    }

    /// What an all-gather over `ranks` runs over: a mesh dimension (its
    /// world), or a run of its ranks inside one of its nodes (FSDP2's
    /// `reshard_after_forward=<int>` groups: hpZ's).
    fn gather_group(&self, ranks: &[usize]) -> PyResult<(Arc<MeshDim>, Hop, Arc<Group>)> {
        if let Some(dim) = self.find_dim(ranks)? {
            let world = dim.groups.world.clone();
            return Ok((dim, Hop::World, world));
        }
        let dims = self
            .dims
            .lock()
            .map_err(|_| to_py(ZeroError::Poisoned("the job's mesh dimensions")))?
            .clone();
        for dim in dims {
            let inside = ranks.iter().all(|r| dim.groups.node.ranks().contains(r));
            if !inside || !ranks.contains(&self.job.layout.rank) {
                continue;
            }
            if let Ok(group) = self.known_group(ranks) {
                return Ok((dim, Hop::Hpz, group));
            }
        }
        Err(invalid(format!(
            "an all-gather over ranks {ranks:?}: zeropp gathers over a mesh dimension it was \
             given or over a run of its ranks inside a node (FSDP2's \
             reshard_after_forward=<int> groups: pass reshard_after_forward to \
             zeropp.torch.fully_shard, or call enable after sharding)"
        )))
    }
}

/// A mesh dimension zeropp serves: its ranks, its layout (nodes, ranks per
/// node, this rank's position) and its groups.
struct MeshDim {
    ranks: Vec<usize>,
    layout: Layout,
    groups: ZeroGroups,
    /// The islands' dimension of an outer sync: its exchanges go on
    /// without a lost island, so a failure elsewhere never tells it.
    outer: std::sync::atomic::AtomicBool,
}

/// `plan::resolve_mode` of a JSON object of overrides, as JSON.
fn resolve(
    mode: &str,
    overrides: &str,
    layout: Layout,
    routing: &Result<zeropp_zero::routing::ClusterView, zeropp_zero::routing::RoutingError>,
    measured: Option<&Measured>,
) -> PyResult<String> {
    let asked: serde_json::Map<String, serde_json::Value> = serde_json::from_str(overrides)
        .map_err(|e| invalid(format!("switches are not a JSON object: {e}")))?;
    let r = plan::resolve_mode(mode, &asked, layout, routing, measured).map_err(to_py)?;
    serde_json::to_string(&r).map_err(|e| invalid(e.to_string()))
}

/// A collective in flight.
#[pyclass(frozen)]
pub struct Op {
    /// This rank (named in the collective's own errors).
    rank: usize,
    pending: Mutex<Option<Pending<(), ZeroError>>>,
    outcome: Mutex<Option<Result<(), crate::Raised>>>,
}

impl Op {
    fn new(rank: usize, p: Pending<(), ZeroError>) -> Op {
        Op {
            rank,
            pending: Mutex::new(Some(p)),
            outcome: Mutex::new(None),
        }
    }

    fn settle(&self, r: Result<(), ZeroError>) {
        // A peer's failure names the peer; any other names this rank.
        let r = r.map_err(|e| {
            let peer = e.is_peer_failure();
            crate::Raised {
                peer,
                message: match peer {
                    true => e.to_string(),
                    false => format!("rank {}: {e}", self.rank),
                },
            }
        });
        if let Ok(mut o) = self.outcome.lock() {
            *o = Some(r);
        }
    }

    fn outcome(&self) -> PyResult<bool> {
        match self
            .outcome
            .lock()
            .map_err(|_| to_py(ZeroError::Poisoned("state of this collective")))?
            .as_ref()
        {
            None => Ok(false),
            Some(Ok(())) => Ok(true),
            Some(Err(e)) => Err(to_py(e.clone())),
        }
    }
}

#[pymethods]
impl Op {
    /// Waits until the collective is done; raises its error.
    fn wait(&self, py: Python<'_>) -> PyResult<()> {
        let pending = self
            .pending
            .lock()
            .map_err(|_| to_py(ZeroError::Poisoned("state of this collective")))?
            .take();
        if let Some(p) = pending {
            let r = py.detach(move || p.wait());
            self.settle(r);
        }
        self.outcome().map(|_| ())
    }

    /// Whether the collective is done (its error, if any, is raised by `wait`).
    fn is_completed(&self) -> PyResult<bool> {
        let mut guard = self
            .pending
            .lock()
            .map_err(|_| to_py(ZeroError::Poisoned("state of this collective")))?;
        if let Some(p) = guard.as_ref()
            && let Some(r) = p.try_take()
        {
            *guard = None;
            drop(guard);
            self.settle(r);
        }
        Ok(self.outcome.lock().map(|o| o.is_some()).unwrap_or(false))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Job>()?;
    m.add_class::<Plan>()?;
    m.add_class::<QgzState>()?;
    m.add_class::<QwzReference>()?;
    m.add_class::<AllReduceState>()?;
    m.add_class::<Op>()?;
    Ok(())
}
