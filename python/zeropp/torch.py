"""ZeRO++ communication under PyTorch's FSDP2: PyTorch computes, zeropp moves
the bytes.

``zeropp.torch.fully_shard`` is called exactly like FSDP2's ``fully_shard``
(on each block, then on the root), after the usual
``dist.init_process_group``::

    import torch.distributed as dist
    import zeropp.torch

    dist.init_process_group("gloo")
    for block in model.blocks:
        zeropp.torch.fully_shard(block)              # mode="zeropp"
    zeropp.torch.fully_shard(model)

Parameters stay ordinary FSDP2 DTensors (the optimizer, gradient clipping and
``torch.distributed.checkpoint`` work unchanged); zeropp replaces the
collectives through FSDP2's ``set_custom_all_gather`` /
``set_custom_reduce_scatter``:

- qwZ: the forward all-gather sends, across nodes, the int4 difference
  between this rank's shard and the reference its peers hold (refreshed
  with the weights themselves every ``qwz_refresh`` gathers), then gathers
  inside the node, into FSDP2's output buffer; with ``qwz_delta=False`` it
  quantizes the weights themselves (int8, as DeepSpeed's ZeRO++);
- hpZ: ``reshard_after_forward=<hpZ group>`` keeps a secondary shard, and the
  backward all-gather stays inside that group (the node, or an NVLink island);
- qgZ: the gradient reduce-scatter is the two-hop quantized all-to-all with
  f32 sums and the mean over all W ranks, its hop across nodes rotated
  block by block (Walsh–Hadamard) before int4, with error feedback whose
  state lives with the FSDP parameter group.

CPU tensors go through zeropp's host transports (UCX, TCP); CUDA tensors
through zeropp's CUDA kernels on the caller's current stream and NCCL
communicators of the job's groups (the world, each node, each local rank
across nodes), whose ids travel through the same store. With
``ZEROPP_DEVICE=emulated`` CPU tensors take the CUDA tensors' path on an
emulated device (the CUDA kernels' own source on the CPU, the host
transports as the byte mover): the same results as the CPU path, bit for
bit, for checking the device path without a GPU.

``mode="zero3"`` is the plain-communication baseline through zeropp's
transports. Switches carry ``zeropp train``'s names (``qwz_bits``, ``hpz``,
``hpz_group``, ``qgz``, ``error_feedback``, ``qgz_intra_bits``,
``qgz_stochastic``, ``block``, ``qgz_block``, ``fp32_comm``, ``qwz_delta``,
``qwz_refresh``, ``qgz_hadamard``, ``qgz_inter_block``); FSDP2's own keyword
arguments pass through.
"""

import datetime
import hashlib
import importlib
import io
import json
import os
import secrets

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard as _fsdp_fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from . import _zeropp
from ._buffers import dtype_name, host_bytes
from ._zeropp import PeerError, ZeroppError

__all__ = [
    "PeerError",
    "ZeroppError",
    "device_calls",
    "enable",
    "fully_shard",
    "in_flight_peak",
    "init_islands",
    "island",
    "job",
    "kept_bytes",
    "measured",
    "OuterSync",
    "resolved_switches",
    "routing",
    "scratch_stats",
    "TrafficLog",
    "trainer_callback",
    "traffic",
]

# The switches' names, as the library declares them (``zeropp train``'s
# settings and flags carry the same names).
SWITCHES = tuple(_zeropp.switch_names())

_init_process_group = dist.init_process_group
if os.environ.get("ZEROPP_REJOIN") == "1":

    def _refuse_world(*_args, **_kwargs):
        # A rank restarted to rejoin would wait in the job-wide
        # init_process_group for ranks that never start again.
        raise ZeroppError(
            "this rank was started again by `zeropp launch --restarts` to rejoin its island: "
            "initialize with zeropp.torch.init_islands(backend) instead of "
            "dist.init_process_group (each island its own torch.distributed world, which a "
            "restarted island makes anew), or launch with --restarts 0"
        )

    dist.init_process_group = _refuse_world
    # A script that imported init_process_group before zeropp.torch calls
    # torch's own: its rendezvous (env://, the default) refuses as well.
    # (init_islands passes a store, so it meets no rendezvous handler.)
    _handlers = getattr(
        importlib.import_module("torch.distributed.rendezvous"), "_rendezvous_handlers", None
    )
    if isinstance(_handlers, dict) and "env" in _handlers:
        _handlers["env"] = _refuse_world

_job = None
_job_options = None
_cuda_job = None
_emulated_job = None
# Collectives that took the device path, by device kind and collective.
_device_calls = {}
# Collectives issued and not yet waited for, by collective: [now, peak].
_in_flight = {}
_switches_used = {}
# The mesh dimensions registered with the job, by their ranks: their layout
# (nodes, ranks per node, this rank's position) and this rank's node and
# cross group in them.
_mesh_dims = {}


def _prefetch_depth():
    """How many modules ahead the host and emulated paths gather in forward
    (``ZEROPP_PREFETCH``, default 2; 0 leaves FSDP2's own order: each
    module's gather waited for before it runs)."""
    raw = os.environ.get("ZEROPP_PREFETCH", "2")
    if not raw.isdigit():
        raise ZeroppError(
            f"ZEROPP_PREFETCH={raw!r}: expected how many modules ahead to gather (0, 1, 2, ...)"
        )
    return int(raw)


def _timeout_s():
    return _zeropp.wait_limit("ZEROPP_TIMEOUT_S", os.environ.get("ZEROPP_TIMEOUT_S", "300"))


def _exchange_through(store, prefix, rank, world, timeout_s):
    """The exchange of the Rust join: this rank's bytes in, every rank's out,
    through the torch.distributed store (no second port)."""

    def exchange(mine):
        store.set(f"{prefix}/facts/{rank}", mine)
        keys = [f"{prefix}/facts/{r}" for r in range(world)]
        try:
            store.wait(keys, datetime.timedelta(seconds=timeout_s))
        except Exception as e:  # the store's own timeout or a dead store
            missing = [r for r in range(world) if not store.check([keys[r]])]
            raise ZeroppError(
                f"ranks {missing} did not publish their zeropp addresses within "
                f"{timeout_s:.0f} s ({e}); every rank must call zeropp.torch.fully_shard "
                "on the same modules in the same order"
            ) from None
        return [bytes(store.get(k)) for k in keys]

    return exchange


def job(transport=None, ranks_per_node=None):
    """This process's zeropp job, joined on first use through the store of the
    default ``torch.distributed`` process group: worker addresses, token and
    topology travel through that store. ``transport``: "ucx", "tcp" or None
    (ZEROPP_TRANSPORT, else UCX when libucp loads). ``ranks_per_node``: logical
    nodes of that many ranks (emulating several nodes on one machine); by
    default the nodes are the hosts the ranks run on."""
    global _job, _job_options
    if not dist.is_available() or not dist.is_initialized():
        raise ZeroppError(
            "torch.distributed is not initialized: call dist.init_process_group(...) "
            "(under torchrun: dist.init_process_group('gloo')) before zeropp.torch's "
            "fully_shard, enable, job, traffic or measured"
        )
    if ranks_per_node is None and os.environ.get("ZEROPP_RANKS_PER_NODE"):
        ranks_per_node = int(os.environ["ZEROPP_RANKS_PER_NODE"])
    if ranks_per_node is not None and (
        isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int)
    ):
        raise ZeroppError(
            f"ranks_per_node={ranks_per_node!r}: a whole number of ranks (or None: the hosts)"
        )
    options = (transport, ranks_per_node)
    if _job is not None:
        if options != _job_options and options != (None, None):
            raise ZeroppError(
                f"zeropp already joined this job with transport={_job_options[0]!r}, "
                f"ranks_per_node={_job_options[1]!r}; pass the same options on every call"
            )
        return _job
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    prefix = "zeropp/job0"
    exchange = _exchange_through(store, prefix, rank, world, _timeout_s())
    _job = _join(
        dist.PrefixStore(prefix, store),
        (rank, world, exchange),
        transport=transport,
        ranks_per_node=ranks_per_node,
    )
    _job_options = options
    return _job


def _join(store, rank_world_exchange, ranks_per_node=None, **options):
    """A zeropp ``Job`` of ``rank`` of ``world`` joined through ``store``:
    whichever rank comes first draws the job's token there (no given rank:
    it may have died before it drew it), every rank reads it, and
    ``exchange`` publishes each rank's address; logical nodes of
    ``ranks_per_node`` (else ZEROPP_RANKS_PER_NODE, else the hosts)."""
    rank, world, exchange = rank_world_exchange
    if ranks_per_node is None and os.environ.get("ZEROPP_RANKS_PER_NODE"):
        ranks_per_node = int(os.environ["ZEROPP_RANKS_PER_NODE"])
    timeout_s = _timeout_s()
    store.compare_set("token", "", secrets.token_hex(16))
    token = _store_get(store, "token", timeout_s, "the zeropp job's token").decode()
    port = os.environ.get("MASTER_PORT")
    return _zeropp.Job(
        rank,
        world,
        exchange,
        token,
        master_addr=os.environ.get("MASTER_ADDR"),
        master_port=int(port) if port else None,
        timeout_s=timeout_s,
        ranks_per_node=ranks_per_node,
        **options,
    )


class IslandWorld:
    """This rank's place in a job of islands (:func:`init_islands`): island
    ``index`` of ``count``, ``size`` ranks each; ``rank`` and ``world`` are
    the job's (``dist.get_rank()`` is the rank inside the island);
    ``attempt``: how many times this island was started before (a restarted
    island rejoins the running job); ``store``: the job-wide store (the
    launcher's under ``zeropp launch --islands``, else on
    MASTER_ADDR:MASTER_PORT)."""

    def __init__(self, index, count, size, rank, world, attempt, store):
        self.index, self.count, self.size = index, count, size
        self.rank, self.world, self.attempt, self.store = rank, world, attempt, store
        self._rejoining = None

    @property
    def rejoining(self):
        """A restarted island's rank that rejoins a running job: started
        before, and a rank of another island made the islands' job already.
        Where none did, nobody has trained yet (they make it in their
        ``OuterSync``, before their first step): it starts with the others,
        as if its first start had not failed. Decided once, at the first
        ask."""
        if self._rejoining is None:
            outside = [r for r in range(self.world) if r // self.size != self.index]
            self._rejoining = self.attempt > 0 and any(
                self.job_store.check([f"built/{r}"]) for r in outside
            )
        return self._rejoining

    @property
    def job_store(self):
        """The keys of the islands' zeropp job (addresses, token, group ids)."""
        return dist.PrefixStore("zeropp/islands/job", self.store)

    def __repr__(self):
        return (
            f"IslandWorld(island {self.index} of {self.count}, {self.size} ranks each, "
            f"rank {self.rank} of {self.world}, attempt {self.attempt})"
        )


_island_world = None
_cross = None


def init_islands(backend="gloo", islands=None, **kwargs):
    """``dist.init_process_group`` for a job of islands: each island gets a
    torch.distributed world of its own (``dist.get_rank()`` and
    ``dist.get_world_size()`` are the island's; FSDP2 shards over it), and
    :class:`OuterSync` syncs the islands over a zeropp job of their own.
    A lost island leaves the other islands' worlds whole, and, launched with
    ``zeropp launch --islands N --restarts K``, its restarted ranks make
    their world anew and rejoin: :class:`OuterSync` fetches the state from
    a live island, and ``opt.steps`` is the step the loop resumes after::

        island = zeropp.torch.init_islands("gloo")       # under zeropp launch --islands 2
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            zeropp.torch.fully_shard(block, mesh=mesh)
        zeropp.torch.fully_shard(model, mesh=mesh)
        opt = zeropp.torch.OuterSync(model, torch.optim.AdamW(model.parameters()), mesh)
        for step in range(opt.steps, steps):
            ...; loss.backward(); opt.step(); opt.zero_grad()
        opt.finish()

    ``islands``: how many (default ZEROPP_ISLANDS, which ``zeropp launch
    --islands`` sets); island i holds the job's ranks i·W/N to
    (i+1)·W/N − 1 (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from the
    launcher: zeropp launch, torchrun). The job's store is the launcher's
    under ``zeropp launch --islands`` (ZEROPP_STORE), so any island rejoins,
    island 0 too; torchrun's agent's under torchrun (which restarts the whole
    job); else global rank 0's, and island 0 cannot rejoin. ``kwargs`` go to
    ``dist.init_process_group``
    (``device_id``, ``timeout``). Returns this rank's :class:`IslandWorld`
    (also :func:`island`)."""
    global _island_world
    if dist.is_initialized():
        raise ZeroppError(
            "torch.distributed is initialized already: call zeropp.torch.init_islands instead of "
            "dist.init_process_group, not after it"
        )
    needed = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    missing = [k for k in needed if k not in os.environ]
    if missing:
        raise ZeroppError(
            f"init_islands reads the launcher's {', '.join(missing)}: run under "
            "`zeropp launch --islands N` (or torchrun)"
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    launched = os.environ.get("ZEROPP_ISLANDS")
    if islands is None:
        if not launched:
            raise ZeroppError(
                "how many islands? pass init_islands(backend, islands=N) or launch with "
                "`zeropp launch --islands N`"
            )
        islands = int(launched)
    if launched and int(launched) != islands:
        raise ZeroppError(
            f"islands={islands}, but the launcher started {launched} islands "
            "(ZEROPP_ISLANDS): pass the launcher's --islands"
        )
    if not (isinstance(islands, int) and islands >= 2 and world % islands == 0):
        raise ZeroppError(
            f"islands={islands!r} over {world} ranks: 2 or more islands of equal size"
        )
    size = world // islands
    index = rank // size
    timeout = datetime.timedelta(seconds=_timeout_s())
    # zeropp launch --islands holds the job's store (ZEROPP_STORE); torchrun's
    # agent may hold it on MASTER_PORT; else global rank 0.
    held = os.environ.get("ZEROPP_STORE")
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if held:
        host, _, port = held.rpartition(":")
        host = host.removeprefix("[").removesuffix("]")  # [v6]:port
        holder = "the launcher (zeropp launch) holds it"
        if not (host and port.isdigit()):
            raise ZeroppError(f"ZEROPP_STORE={held!r}: the job's store is host:port")
    else:
        host, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
        holder = "torchrun's agent holds it" if agent else "global rank 0 holds it"
        if not port.isdigit():
            raise ZeroppError(f"MASTER_PORT={port!r}: a port number")
    try:
        store = dist.TCPStore(
            host,
            int(port),
            is_master=rank == 0 and not agent and not held,
            timeout=timeout,
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as e:  # DistNetworkError and kin
        late = (
            " (a restarted island: the job may have ended)"
            if os.environ.get("ZEROPP_REJOIN") == "1"
            else ""
        )
        raise PeerError(
            f"rank {rank}: the job's store at {host}:{port} did not answer within "
            f"{timeout.total_seconds():.0f} s{late}; {holder} ({e})"
        ) from None
    if held and os.environ.get("ZEROPP_TOKEN"):
        # Whoever reaches the launcher's port reaches its store: the job's
        # keys live under a name only the token's holders derive (the store
        # lists no keys).
        secret = hashlib.sha256(os.environ["ZEROPP_TOKEN"].encode()).hexdigest()[:16]
        store = dist.PrefixStore(f"zeropp/{secret}", store)
    if os.environ.get("ZEROPP_ATTEMPT"):
        # zeropp launch counts the island's starts.
        attempt = int(os.environ["ZEROPP_ATTEMPT"])
    else:
        # Another launcher: each rank counts its own starts (the ranks of a
        # restarted island agree), afresh for each start of the whole job.
        generation = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        attempt = store.add(f"zeropp/islands/gen{generation}/starts/{rank}", 1) - 1
    if attempt > 0 and index == 0 and not held and not agent:
        raise ZeroppError(
            "island 0 cannot rejoin: its first rank held the job's store, and the job ended "
            "with it; launch with `zeropp launch --islands N --restarts K`, whose launcher "
            "holds the store, or restart the whole job from its last checkpoint"
        )
    kwargs.setdefault("timeout", timeout)
    _init_process_group(
        backend,
        store=dist.PrefixStore(f"zeropp/island{index}/attempt{attempt}", store),
        rank=rank % size,
        world_size=size,
        **kwargs,
    )
    _island_world = IslandWorld(index, islands, size, rank, world, attempt, store)
    return _island_world


def island():
    """This rank's :class:`IslandWorld` after :func:`init_islands`, else None."""
    return _island_world


def _cross_job(transport, ranks_per_node):
    """The zeropp job of every island's ranks (global ranks), over which
    :class:`OuterSync` syncs the islands: joined through the job-wide store,
    over TCP, taking back a lost island's restarted ranks."""
    global _cross
    w = _island_world
    if _cross is not None:
        return _cross
    if transport not in (None, "tcp"):
        raise ZeroppError(
            f"transport={transport!r}: the islands' outer sync runs over TCP, which takes a "
            "restarted island's ranks back (the islands' own collectives keep their transport)"
        )
    store = w.job_store
    _cross = _join(
        store,
        (w.rank, w.world, _islands_exchange(store, w, _timeout_s())),
        transport="tcp",
        ranks_per_node=ranks_per_node,
        island=(w.index * w.size, (w.index + 1) * w.size),
        rejoining=w.rejoining,
    )
    # A restarted rank finds the job running once a rank joined
    # (IslandWorld.rejoining).
    store.set(f"built/{w.rank}", str(w.attempt))
    return _cross


def _islands_exchange(store, w, timeout_s):
    """The cross-island job's exchange: this rank's facts under its attempt;
    its island's ranks' of the same attempt, the others' latest."""

    def exchange(mine):
        store.set(f"facts/{w.rank}/{w.attempt}", mine)
        store.set(f"latest/{w.rank}", str(w.attempt))
        out = []
        for r in range(w.world):
            attempt = w.attempt
            what = f"rank {r}'s zeropp address"
            if r // w.size != w.index:
                attempt = int(_store_get(store, f"latest/{r}", timeout_s, what).decode())
            out.append(_store_get(store, f"facts/{r}/{attempt}", timeout_s, what))
        return out

    return exchange


def _agree_through(store):
    """:func:`_agree` through ``store`` (the islands' job-wide one)."""

    def agree(ranks):
        mine = store.add("groups", 1)
        key = "group/" + ",".join(str(r) for r in ranks)
        return int(store.compare_set(key, "", str(mine)))

    return agree


def _store_get(store, key, timeout_s, what):
    try:
        store.wait([key], datetime.timedelta(seconds=timeout_s))
    except Exception as e:  # the store's own timeout or a dead store
        raise PeerError(
            f"{what} did not arrive through the torch.distributed store within "
            f"{timeout_s:.0f} s ({e}); a rank died or did not reach the same collective"
        ) from None
    return bytes(store.get(key))


def _emulated():
    """Whether CPU tensors take the device path (``ZEROPP_DEVICE=emulated``)."""
    mode = os.environ.get("ZEROPP_DEVICE", "")
    if mode not in ("", "emulated"):
        raise ZeroppError(
            f"ZEROPP_DEVICE={mode!r}: use 'emulated' (CPU tensors through the device path on "
            "an emulated device) or leave it unset"
        )
    return mode == "emulated"


def _on_device(t):
    """Whether ``t``'s collectives take the device path."""
    return t.device.type == "cuda" or (t.device.type == "cpu" and _emulated())


def _count_device_call(t, collective):
    kind = "cuda" if t.device.type == "cuda" else "emulated"
    calls = _device_calls.setdefault(kind, {})
    calls[collective] = calls.get(collective, 0) + 1


def device_calls():
    """How many of FSDP2's collectives took the device path on this rank, by
    device ("cuda", or "emulated" under ``ZEROPP_DEVICE=emulated``) and
    collective: ``{"emulated": {"all_gather": 42, "reduce_scatter": 20}}``."""
    return {k: dict(v) for k, v in _device_calls.items()}


def _cuda(device):
    """The job's device half, opened on the first collective of a CUDA
    tensor: zeropp's kernels on ``device`` and the NCCL communicators of the
    world, this node and this local rank across nodes (ids through the
    store); for a CPU tensor under ``ZEROPP_DEVICE=emulated``, the emulated
    device over the host job."""
    global _cuda_job, _emulated_job
    if device.type == "cpu":
        if _emulated_job is None:
            _emulated_job = _zeropp.EmulatedJob(job())
        return _emulated_job
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _cuda_job is not None:
        if _cuda_job.device != index:
            raise ZeroppError(
                f"a tensor on cuda:{index}, but this rank's zeropp job runs on "
                f"cuda:{_cuda_job.device}: keep each rank's model on one device "
                "(torch.cuda.set_device(local_rank) before building it)"
            )
        return _cuda_job
    zjob = job()
    cj = _zeropp.CudaJob(zjob, index)
    store = dist.distributed_c10d._get_default_store()
    rank, g = zjob.rank, zjob.ranks_per_node
    timeout_s = _timeout_s()
    prefix = "zeropp/job0/nccl"
    keys = {
        "world": f"{prefix}/world",
        "node": f"{prefix}/node/{rank // g}",
        "cross": f"{prefix}/cross/{rank % g}",
    }
    # The first member of each communicator makes its id.
    makes = {"world": rank == 0, "node": rank % g == 0, "cross": rank < g}
    for name, key in keys.items():
        if makes[name]:
            store.set(key, _zeropp.nccl_unique_id())
    ids = [_store_get(store, keys[k], timeout_s, f"the NCCL id of the {k} group") for k in keys]
    cj.connect(*ids)
    _cuda_job = cj
    return cj


def _nccl_id(ranks):
    """The NCCL id of the communicator of ``ranks``: made by its first
    member, read by the others through the store."""
    store = dist.distributed_c10d._get_default_store()
    key = "zeropp/job0/nccl/set/" + ",".join(str(r) for r in ranks)
    if dist.get_rank() == ranks[0]:
        store.set(key, _zeropp.nccl_unique_id())
    return _store_get(store, key, _timeout_s(), f"the NCCL id of group {ranks}")


def _cuda_group(cj, ranks):
    """The communicators of a mesh dimension (its world, node and cross
    groups) or of an hpZ sub-group smaller than a node, joined on their
    first use (FSDP2 calls over them on every member at once)."""
    dim = _mesh_dims.get(tuple(ranks))
    if cj.has_dim(ranks) or (dim is None and cj.has_group(ranks)):
        return
    emulated = isinstance(cj, _zeropp.EmulatedJob)
    if dim is None:
        # An hpZ sub-group: the host job's group of these ranks, or NCCL's.
        if emulated:
            cj.add_group(ranks)
        else:
            cj.add_group(ranks, _nccl_id(ranks))
    elif emulated:
        cj.connect_dim(ranks)  # the host job's groups of the dimension
    else:
        layout, node, cross = dim
        cj.connect_dim(ranks, layout, *[_nccl_id(r) for r in (ranks, node, cross)])


def _device_args(cj, t, what):
    if isinstance(cj, _zeropp.EmulatedJob):
        if t.device.type != "cpu":
            raise ZeroppError(f"{what} is on {t.device}: the emulated device takes CPU tensors")
        return host_bytes(t, what)
    if t.device.type != "cuda" or t.device.index not in (None, cj.device):
        raise ZeroppError(
            f"{what} is on {t.device}, the job on cuda:{cj.device}: FSDP2's buffers of one "
            "collective live on one device"
        )
    if not t.is_contiguous():
        raise ZeroppError(f"{what} is not contiguous; call .contiguous() first")
    return t.data_ptr()


def _stream(device):
    if device.type != "cuda":
        return 0  # the emulated device's one queue
    return torch.cuda.current_stream(device).cuda_stream


def routing():
    """The routing plan every rank derived from every node's topology (dict)."""
    return json.loads(job().routing_json())


def measured():
    """What the job measured for ``mode="zeropp"`` (once, at the first
    ``fully_shard(mode="zeropp")``: the links within 1.5 s, then each route
    timed): {"links": {"node":
    {"bytes_per_s", "latency_s"} | None, "cross": ... | None, "quantize_per_s",
    "dequantize_per_s", "seconds"}, "routes": {"values", "gather_plain",
    "gather_qwz", "reduce_plain", "reduce_qgz", "seconds"}} (seconds per call on
    a unit of that many values; each "seconds" what that part of the probe
    took) — what that mode chose its switches by — or None where nothing was
    measured (no zeropp mode yet, logical nodes from
    ``ranks_per_node``, one rank, ``ZEROPP_PROBE=0``)."""
    return json.loads(job().measured_json())


def traffic():
    """Bytes this rank sent through zeropp, by phase (forward_gather,
    backward_gather, gradient, other, replicate: HSDP's all-reduce across
    its replicate dimension, outer: islands' outer sync, and frozen: the
    frozen weights' part of the forward gathers — their crossings and the
    byte that says they did not change —, so that forward_gather holds the
    trainable weights' part) and hop (intra_node, inter_node), with the
    block scales apart. Under :func:`init_islands`, the islands' outer
    sync's bytes are counted in with the island's."""
    t = json.loads(job().traffic_json())
    if _cross is not None:
        t = _summed(t, json.loads(_cross.traffic_json()))
    return t


def _summed(a, b):
    """Two traffic records' numbers added, leaf by leaf."""
    if isinstance(a, dict):
        return {k: _summed(a[k], b[k]) if k in a and k in b else a.get(k, b.get(k)) for k in a | b}
    return a + b


_PHASES = ("forward_gather", "backward_gather", "gradient", "other", "replicate", "outer", "frozen")
_HOPS = ("intra_node", "inter_node")


def _flat_traffic(t):
    """The totals, and each phase's bytes and scale bytes per hop for the
    phases the job has used (a phase that never moved a byte — HSDP's
    all-reduce, the outer sync, frozen weights where there are none — adds
    no entries to every log line)."""
    out = {}
    for hop in _HOPS:
        out[f"zeropp/{hop}_bytes"] = sum(t[p]["total"][hop] for p in _PHASES)
    for p in _PHASES:
        if not any(t[p]["total"][hop] for hop in _HOPS):
            continue
        for hop in _HOPS:
            out[f"zeropp/{p}/{hop}_bytes"] = t[p]["total"][hop]
            out[f"zeropp/{p}/{hop}_scale_bytes"] = t[p]["scales"][hop]
    return out


class TrafficLog:
    """Bytes this rank sent through zeropp since the previous call, as flat
    numbers a framework's logger takes: ``zeropp/inter_node_bytes``,
    ``zeropp/intra_node_bytes``, and ``zeropp/<phase>/<hop>_bytes`` and
    ``..._scale_bytes`` for every phase the job has used (forward_gather,
    backward_gather, gradient, other, replicate, outer, frozen) and hop
    (intra_node, inter_node). With Accelerate:
    ``accelerator.log(log(), step=step)``."""

    def __init__(self):
        self._last = None

    def __call__(self):
        now = _flat_traffic(traffic())
        last, self._last = self._last, now
        if last is None:
            return dict(now)
        # A phase used since the last call starts from 0.
        return {k: v - last.get(k, 0) for k, v in now.items()}


def trainer_callback(mode=None, outer_sync=None, **enable_kwargs):
    """A Hugging Face ``TrainerCallback``: with ``mode`` ("zeropp" or
    "zero3", and any of ``enable``'s keyword arguments) it gives the model
    the Trainer sharded with FSDP2 zeropp's communication when training
    begins (``enable``); always, it adds zeropp's bytes since the previous
    log (``TrafficLog``) to every ``Trainer`` log entry and its
    ``state.log_history``. The one line:
    ``Trainer(..., callbacks=[zeropp.torch.trainer_callback(mode="zeropp")])``
    with ``fsdp_config={"fsdp_version": 2, ...}``. The Trainer runs its
    reporters (TensorBoard, W&B, ...) before the callbacks you pass: for
    them to see the bytes too, put it first,
    ``trainer.callback_handler.callbacks.insert(0, callback)``.

    Islands: with ``outer_sync`` (a dict of :class:`OuterSync`'s keyword
    arguments, ``{}`` for its defaults) and the Trainer sharding over HSDP's
    mesh (``TrainingArguments(parallelism_config=ParallelismConfig(
    dp_replicate_size=ISLANDS, dp_shard_size=...))``), each replica trains
    as an island: an outer step every ``sync_every`` optimizer steps, one
    more at the end of training, and ``outer_syncs`` in the logs. Needs
    transformers."""
    try:
        from transformers import TrainerCallback
    except ImportError as e:
        raise ZeroppError(
            "zeropp.torch.trainer_callback() needs transformers: pip install transformers"
        ) from e

    class ZeroppCallback(TrainerCallback):
        def __init__(self):
            self.log = TrafficLog()
            self.outer = None

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if mode is None and outer_sync is None:
                return
            if model is None:
                raise ZeroppError("the Trainer passed no model to its callbacks")
            if mode is not None:
                enable(model, mode=mode, **enable_kwargs)
            if outer_sync is not None:
                # The job's own options, as enable's (whichever joins first).
                joined = {
                    k: enable_kwargs[k]
                    for k in ("transport", "ranks_per_node")
                    if k in enable_kwargs
                }
                self.outer = OuterSync(model, None, **{**joined, **outer_sync})

        def on_step_end(self, args, state, control, **kwargs):
            if self.outer is not None:
                self.outer.after_step()

        def on_train_end(self, args, state, control, **kwargs):
            if self.outer is not None:
                self.outer.finish()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs is None or _job is None:
                return
            entry = self.log()
            if self.outer is not None:
                entry["outer_syncs"] = self.outer.syncs
            logs.update(entry)
            # The Trainer keeps a copy of the entry in its history (and
            # trainer_state.json) before the callbacks run.
            if state is not None and state.log_history:
                state.log_history[-1].update(entry)

    return ZeroppCallback()


def resolved_switches():
    """The switches each mode actually ran with, after the routing plan and
    what the job measured (``measured()``) resolved the defaults: {mode:
    {"switches": ..., "why": ...}}; ``why`` names, for each switch chosen,
    the predicted time of each route and the figures behind it."""
    return dict(_switches_used)


def _is_backward():
    return torch._C._current_graph_task_id() != -1


def in_flight_peak():
    """The most collectives of each kind this rank had issued and not yet
    waited for at once: ``{"all_gather": 2, "reduce_scatter": 1}``. On the
    host and emulated paths zeropp.torch prefetches the next gathers in
    forward order (see :func:`fully_shard`), so after the first step a
    peak of 2 all-gathers says the next gather was issued while the one
    before it was still unwaited."""
    return {k: v[1] for k, v in _in_flight.items()}


class _Work(dist.Work):
    """A zeropp collective in flight, as FSDP2 expects from async_op=True; it
    keeps the tensors alive until it is waited on. On the device path
    (``device`` given) its wait makes the caller's current stream wait for
    the collective: on CUDA the host goes on."""

    def __init__(self, op, *tensors, kind="all_gather", device=None, explain=None):
        super().__init__()
        self._op = op
        self._tensors = tensors
        self._device = device
        self._kind = kind
        # Where a value that is not finite came from, said with this rank's
        # own error (a reduce-scatter's parameter group).
        self._explain = explain
        count = _in_flight.setdefault(kind, [0, 0])
        count[0] += 1
        count[1] = max(count[1], count[0])

    def wait(self, timeout=None):
        if self._kind is not None:
            _in_flight[self._kind][0] -= 1
            self._kind = None
        explain, self._explain = self._explain, None
        try:
            if self._device is None:
                self._op.wait()
            else:
                self._op.wait(_stream(self._device))
        except PeerError:
            raise
        except ZeroppError as e:
            where = explain() if explain is not None and "not finite" in str(e) else None
            if where is None:
                raise
            raise ZeroppError(f"{e}; {where}") from e
        finally:
            self._tensors = ()
        return True

    def is_completed(self):
        return self._op.is_completed()

    def is_success(self):
        return self.is_completed()


def _device_work(op, async_op, tensors, kind, explain=None):
    """The device path's answer to FSDP2: ``op`` (the device job's Work) is
    in flight on the device, launched in the order of the caller's stream
    (on the emulated device, its one queue); the Work's ``wait`` makes the
    stream current then wait for it."""
    work = _Work(op, *tensors, kind=kind, device=tensors[0].device, explain=explain)
    if async_op:
        return work
    work.wait()
    return None


class _Done(dist.Work):
    """A collective with nothing left to wait for (an island keeps its own
    gradient: nothing crosses)."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True

    def is_success(self):
        return True


class ZeroppAllGather(AllGather):
    """FSDP2's all-gather through zeropp: qwZ over the world; in backward,
    inside the node from qwZ's references (hpZ with weight differences) or
    a plain ring inside the hpZ group."""

    def __init__(self, zjob, switches, ranks=None):
        self._job = zjob
        self.settings = (zjob, dict(switches))
        # How this group's gathers move data, decided once in Rust from the
        # switches on the mesh dimension ``ranks`` (None: the whole job).
        self.plan = zjob.plan(json.dumps(switches), ranks)
        # qwZ on weight differences: this group's references of the shards
        # its cross-node peers own (held in Rust, 1/G of the group: int8
        # blocks by default, f32 with qwz_int8_references=False or with
        # frozen weights, bf16 with qwz_bf16_references); with hpZ over the
        # whole node they are its secondary shard and serve the backward
        # gather.
        self.qwz_reference = self.plan.qwz_reference()

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def watch_frozen(self, fsdp_params):
        """The FSDP2 parameters this gather serves (FSDPParam, in the group's
        order: each rank's shard is their padded shards one after the
        other). The ranges of frozen ones (``requires_grad=False``: a base
        under LoRA) cross nodes once: a forward gather checks with a byte
        from each rank that holds the same shard on the other nodes that
        none of them changed, then sends only the trainable ranges. A
        frozen weight that changes (a state-dict load, an unfrozen weight
        after its optimizer step) is sent again, never served stale."""
        self._fsdp_params = list(fsdp_params)

    def _mark_frozen(self, numel):
        # Only forward gathers cross nodes: backward ones never read these.
        if self.qwz_reference is None or _is_backward():
            return
        ranges, at = [], 0
        for p in getattr(self, "_fsdp_params", ()):
            n = p.padded_sharded_param_size.numel()
            if n and not p.sharded_param.requires_grad:
                if ranges and ranges[-1][0] + ranges[-1][1] == at:
                    ranges[-1] = (ranges[-1][0], ranges[-1][1] + n)
                else:
                    ranges.append((at, n))
            at += n
        # Another layout than FSDP2's plain one (an extension's all-gather
        # inputs): nothing is taken for frozen.
        self.qwz_reference.frozen = ranges if at == numel else []

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self._mark_frozen(input_tensor.numel())
        if _on_device(output_tensor):
            op = self._cuda(output_tensor, input_tensor, group)
            return _device_work(op, async_op, (output_tensor, input_tensor), "all_gather")
        op = self._job.all_gather(
            host_bytes(output_tensor, "all-gather output"),
            host_bytes(input_tensor, "all-gather input"),
            dtype_name(input_tensor),
            dist.get_process_group_ranks(group),
            self.plan,
            backward=_is_backward(),
            delta=self.qwz_reference,
        )
        work = _Work(op, output_tensor, input_tensor)
        if async_op:
            return work
        work.wait()
        return None

    def _cuda(self, output_tensor, input_tensor, group):
        _count_device_call(output_tensor, "all_gather")
        cj = _cuda(output_tensor.device)
        ranks = dist.get_process_group_ranks(group)
        _cuda_group(cj, ranks)
        if output_tensor.dtype != input_tensor.dtype or (
            output_tensor.numel() != input_tensor.numel() * len(ranks)
        ):
            raise ZeroppError(
                f"all-gather of {input_tensor.numel()} {input_tensor.dtype} values over "
                f"{len(ranks)} ranks needs an output of {input_tensor.numel() * len(ranks)} "
                f"such values, not {output_tensor.numel()} {output_tensor.dtype}"
            )
        return cj.all_gather(
            _device_args(cj, output_tensor, "all-gather output"),
            _device_args(cj, input_tensor, "all-gather input"),
            input_tensor.numel(),
            dtype_name(input_tensor),
            ranks,
            _stream(output_tensor.device),
            self.plan,
            backward=_is_backward(),
            delta=self.qwz_reference,
        )


def _mean(op, collective):
    """Whether FSDP2's reduce op ``op`` asks for the mean (AVG) rather than
    the sum (SUM); any other is refused."""
    if op == dist.ReduceOp.AVG:
        return True
    if op == dist.ReduceOp.SUM:
        return False
    raise ZeroppError(
        f"{collective} with {op}: zeropp sums or averages gradients (SUM or AVG); "
        "leave FSDP2's gradient_divide_factor unset"
    )


class _Replicate:
    """HSDP's gradient all-reduce across the replicate dimension ``ranks``
    for one FSDP module: quantized (int4 blocks of qgZ's hop across nodes,
    rotated with ``qgz_hadamard``, error feedback with ``error_feedback``,
    held here) where ``switches`` (resolved on that dimension's layout)
    keep qgZ, else ZeRO-3's reduce-scatter and all-gather in the gradient's
    dtype."""

    def __init__(self, zjob, ranks, switches, seed):
        self.job, self.ranks = zjob, list(ranks)
        self.settings = (tuple(ranks), json.dumps(switches, sort_keys=True), seed)
        self.state = zjob.plan(json.dumps(switches), self.ranks).all_reduce_state(seed)

    def all_reduce(self, tensor, op):
        mean = _mean(op, "all-reduce")
        if _on_device(tensor):
            _count_device_call(tensor, "all_reduce")
            cj = _cuda(tensor.device)
            _cuda_group(cj, self.ranks)
            op = cj.all_reduce(
                _device_args(cj, tensor, "all-reduce buffer"),
                tensor.numel(),
                dtype_name(tensor),
                self.ranks,
                _stream(tensor.device),
                mean,
                self.state,
            )
            return _device_work(op, True, (tensor,), "all_reduce")
        op = self.job.all_reduce(
            host_bytes(tensor, "all-reduce buffer"),
            dtype_name(tensor),
            self.ranks,
            mean,
            state=self.state,
        )
        return _Work(op, tensor, kind="all_reduce")


# The all-reduce FSDP2 issues next, across an HSDP mesh's replicate
# dimension: the reduce-scatter that precedes it (on the same thread, the
# same output tensor) names the module it belongs to.
_next_all_reduce = [None]


class _ServedReplicateGroup:
    """FSDP2's replicate process group of an HSDP mesh, with its all-reduce
    (the only collective FSDP2 runs on it once sharded) run by zeropp for
    the module whose reduce-scatter just ran; everything else is the
    group's own."""

    def __init__(self, pg):
        self._zeropp_served = pg
        # Islands (OuterSync on this mesh): each replica is an island whose
        # gradient stays its own; the islands meet only in outer syncs.
        self._zeropp_islands = False
        # torch's own questions about the group (get_backend, get_rank: the
        # c10d logger asks them when a collective raises, and otherwise
        # replaces the error with "not initialized in the world group map")
        # get the served group's answers. destroy_process_group shuts down
        # only the groups it named, and clears these maps.
        world = dist.distributed_c10d._world
        for table in (world.pg_map, world.pg_group_ranks):
            if pg in table:
                table[self] = table[pg]

    def __getattr__(self, name):
        return getattr(self._zeropp_served, name)

    def size(self):
        return self._zeropp_served.size()

    def rank(self):
        return self._zeropp_served.rank()

    def allreduce(self, tensors, opts=None):
        pending, _next_all_reduce[0] = _next_all_reduce[0], None
        tensor = tensors[0]
        if self._zeropp_islands:
            # The island's own gradient: its mean (AVG), or with a sum the
            # island's share scaled as the whole job's sum would be (FSDP2
            # divides by every rank of the mesh).
            op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
            if op == dist.ReduceOp.SUM:
                tensor.mul_(self.size())
            elif op != dist.ReduceOp.AVG:
                raise ZeroppError(
                    f"FSDP2 asked for a {op} all-reduce across the islands: OuterSync keeps "
                    "each island's gradient for AVG and SUM reductions only"
                )
            return _Done()
        if pending is None or pending[0] is not tensor:
            raise ZeroppError(
                "an all-reduce across HSDP's replicate dimension that no zeropp reduce-scatter "
                "preceded: zeropp runs the gradient all-reduce FSDP2 issues after its "
                "reduce-scatter, nothing else on that group"
            )
        replicate = pending[1]
        if replicate.state is None and _on_device(tensor) and opts is not None:
            # A plain all-reduce on a device is the group's own (NCCL's).
            return self._zeropp_served.allreduce(tensors, opts)
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
        return replicate.all_reduce(tensor, op)


def _serve_replicate(mesh_info):
    """zeropp runs the all-reduce of HSDP's ``mesh_info`` (once per mesh);
    the group that serves it."""
    pg = mesh_info.replicate_process_group
    if not isinstance(pg, _ServedReplicateGroup):
        pg = mesh_info.replicate_process_group = _ServedReplicateGroup(pg)
    return pg


def _first_non_finite(input_tensor, world, groups):
    """Which parameter's gradient holds the first value of ``input_tensor``
    (FSDP2's reduce-scatter input: ``world`` rows, each the padded shards of
    the group's gradients one after the other) that is not finite, with how
    many there are; None where there is none to name."""
    flat = input_tensor.detach().reshape(-1)
    bad = (~torch.isfinite(flat)).nonzero()
    if bad.numel() == 0 or world < 1:
        return None
    first = int(bad[0])
    value = flat[first].item()
    row = flat.numel() // world
    offset = first % row
    count = f"{bad.numel()} of the {flat.numel()} gradient values reduced here are NaN or Inf"
    # The group whose gradients fill the row (FSDP2 sends those with one).
    for g in groups:
        params = [p for p in g.fsdp_params if p.sharded_param.requires_grad]
        sizes = [p.padded_sharded_param_size.numel() for p in params]
        if sum(sizes) != row:
            continue
        for p, n in zip(params, sizes, strict=True):
            if offset < n:
                name = getattr(p, "_param_fqn", None) or p._module_info.param_name
                return f"the first ({value}) is in the gradient of parameter {name!r}; {count}"
            offset -= n
    return count


class ZeroppReduceScatter(ReduceScatter):
    """FSDP2's gradient reduce-scatter through zeropp: qgZ (two hops,
    quantized, f32 sums, error feedback held here, per parameter group) or
    ZeRO-3's ring; on HSDP's mesh, followed by zeropp's all-reduce across
    the replicate dimension (``replicate``)."""

    def __init__(self, zjob, switches, seed=0, replicate=None, ranks=None):
        self._job = zjob
        self.replicate = replicate
        self.settings = (
            zjob,
            dict(switches),
            seed,
            None if replicate is None else replicate.settings,
        )
        # qgZ's settings and error feedback (host and device), per group,
        # from the plan of the switches on the mesh dimension ``ranks``.
        self.qgz_state = zjob.plan(json.dumps(switches), ranks).qgz_state(seed)

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def watch_groups(self, groups):
        """The FSDP2 parameter groups this reduce-scatter serves
        (FSDPParamGroup): a gradient that is not finite is said with the
        parameter it belongs to."""
        self._groups = list(groups)

    def _explain(self, input_tensor, world):
        """What says, once this call failed on a value that is not finite,
        which parameter's gradient holds the first one."""
        groups = getattr(self, "_groups", ())
        return lambda: _first_non_finite(input_tensor, world, groups)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        mean = _mean(op, "reduce-scatter")
        explain = self._explain(input_tensor, group.size())
        if _on_device(output_tensor):
            op, tensors = self._cuda(output_tensor, input_tensor, group, mean)
            if self.replicate is not None:
                _next_all_reduce[0] = (output_tensor, self.replicate)
            return _device_work(op, async_op, tensors, "reduce_scatter", explain)
        work = _Work(
            self._job.reduce_scatter(
                host_bytes(output_tensor, "reduce-scatter output"),
                host_bytes(input_tensor, "reduce-scatter input"),
                dtype_name(input_tensor),
                dist.get_process_group_ranks(group),
                mean,
                qgz=self.qgz_state,
            ),
            output_tensor,
            input_tensor,
            kind="reduce_scatter",
            explain=explain,
        )
        if self.replicate is not None:
            _next_all_reduce[0] = (output_tensor, self.replicate)
        if async_op:
            return work
        work.wait()
        return None

    def _cuda(self, output_tensor, input_tensor, group, mean):
        _count_device_call(output_tensor, "reduce_scatter")
        cj = _cuda(output_tensor.device)
        ranks = dist.get_process_group_ranks(group)
        _cuda_group(cj, ranks)
        world = len(ranks)
        n = input_tensor.numel()
        if output_tensor.dtype != input_tensor.dtype or output_tensor.numel() * world != n:
            raise ZeroppError(
                f"reduce-scatter of {n} {input_tensor.dtype} values over {world} ranks needs an "
                f"output of {n // world} such values, not {output_tensor.numel()} "
                f"{output_tensor.dtype}"
            )
        # In the tensors' own dtype: qgZ sums in f32 on the device and rounds
        # to it once (the sum, or the mean over all W ranks); without qgZ the
        # communicator's own reduce-scatter.
        op = cj.reduce_scatter(
            _device_args(cj, output_tensor, "reduce-scatter output"),
            _device_args(cj, input_tensor, "reduce-scatter input"),
            n,
            dtype_name(input_tensor),
            ranks,
            _stream(output_tensor.device),
            mean,
            qgz=self.qgz_state,
        )
        return op, (output_tensor, input_tensor)


def _check_fsdp_keywords(kwargs):
    """Keywords neither a switch nor FSDP2's are refused naming both sets
    (a misspelled switch would otherwise reach FSDP2 as a TypeError)."""
    import difflib
    import inspect

    fsdp = [k for k in inspect.signature(_fsdp_fully_shard).parameters if k != "module"]
    for k in kwargs:
        if k not in fsdp:
            near = difflib.get_close_matches(k, list(SWITCHES) + fsdp, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ZeroppError(
                f"fully_shard got an unknown keyword {k!r}{hint}: it takes zeropp's switches "
                f"({', '.join(SWITCHES)}) and FSDP2's keywords ({', '.join(fsdp)})"
            )


def _check_dtypes(module, mp_policy):
    if mp_policy is not None and mp_policy.param_dtype is not None:
        dtype_name(torch.empty(0, dtype=mp_policy.param_dtype))
    moved = (torch.float32, torch.bfloat16, torch.float16)
    cast = mp_policy is not None and mp_policy.param_dtype in moved
    # FSDP2 reduce-scatters gradients in reduce_dtype, else in the
    # parameter's own dtype (not param_dtype).
    reduced = mp_policy is not None and mp_policy.reduce_dtype in moved
    for name, p in module.named_parameters():
        if not p.dtype.is_floating_point:
            raise ZeroppError(
                f"parameter {name!r} is {p.dtype}: zeropp.torch shards floating-point "
                "parameters; keep integer state as a buffer (module.register_buffer)"
            )
        if p.dtype not in moved and not (cast and reduced):
            raise ZeroppError(
                f"parameter {name!r} is {p.dtype}: zeropp moves float32, bfloat16 and "
                "float16 values; convert the module (module.float()) or pass "
                "mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
                "reduce_dtype=torch.float32) (FSDP2 gathers in param_dtype and "
                "reduce-scatters in reduce_dtype, else in the parameter's own dtype)"
            )
        if p.device.type not in ("cpu", "cuda", "meta"):
            raise ZeroppError(
                f"parameter {name!r} is on {p.device}: zeropp.torch moves CPU tensors (through "
                "its host transports) and CUDA tensors (through its CUDA kernels and NCCL)"
            )


def _agree(ranks):
    """The number every member of ``ranks`` gives that set of ranks (the
    id of its zeropp group): the first member to ask draws it from the job's
    counter in the store, the others read it."""
    store = dist.distributed_c10d._get_default_store()
    return _agree_through(dist.PrefixStore("zeropp/job0", store))(ranks)


def _add_mesh_dim(zjob, ranks, hpz_group=None, outer=False):
    """Registers the mesh dimension over ``ranks`` with the job (and the
    device path): its (nodes, ranks per node, this rank's position).
    ``outer``: an outer sync's islands, whose exchanges go on without a
    lost island."""
    layout, node, cross = zjob.add_mesh_dim(ranks, _agree, hpz_group=hpz_group, outer=outer)
    _mesh_dims[tuple(ranks)] = (layout, node, cross)
    return layout


def _mesh_groups(mesh):
    """The process groups FSDP2 reads off ``mesh``: the dimension it shards
    over (the last) and, on HSDP's 2-D mesh, the one it replicates over (the
    first). None stands for the default process group's world."""
    if mesh is None:
        return None, None
    if mesh.ndim == 1:
        return mesh.get_group(0), None
    if mesh.ndim == 2:
        return mesh.get_group(1), mesh.get_group(0)
    raise ZeroppError(
        f"a {mesh.ndim}-D mesh: FSDP2 and zeropp take a 1-D mesh or HSDP's 2-D (replicate, "
        "shard) mesh; with tensor or context parallelism pass the data-parallel sub-mesh "
        '(world_mesh["dp"], or world_mesh["dp_replicate", "dp_shard"] for HSDP)'
    )


def _group_ranks(pg):
    if pg is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(pg))


def _same_modules(a, b):
    """Whether two recorded passes ran the same modules in the same order."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


class _ForwardOrder:
    """Prefetching on the host and emulated paths. Without CUDA streams
    FSDP2 waits for each module's gather before computing it, so nothing
    would overlap; zeropp asks FSDP2 for asynchronous unshards there (its
    backward then prefetches the module before, in flight on zeropp's
    communication thread while this one computes its gradient) and, once
    two forward passes ran the served modules in the same order, has each
    module prefetch the next ``depth`` ones (``ZEROPP_PREFETCH``, default
    2: FSDP2's explicit forward prefetch): the next gathers are issued before the one before them is
    waited on, as FSDP2's own gathers on CUDA streams are. A pass in
    another order (a model whose modules run conditionally, a submodule
    run alone) turns the forward prefetch off until two passes agree
    again. One per model: FSDP2's root and the modules under it share
    their state context, which holds it."""

    def __init__(self, depth):
        self.depth = depth
        self.current = []
        self.last = []
        self.applied = []

    def seen(self, module):
        """Forward pre-hook: ``module`` runs now."""
        if any(m is module for m in self.current):
            self._pass_ended()
        self.current.append(module)

    def _pass_ended(self):
        order, self.current = self.current, []
        same = _same_modules(order, self.last)
        self.last = order
        if same and _same_modules(order, self.applied):
            return
        for m in self.applied:
            m.set_modules_to_forward_prefetch([])
        self.applied = []
        if same:
            for k, m in enumerate(order):
                m.set_modules_to_forward_prefetch(order[k + 1 : k + 1 + self.depth])
            self.applied = order

    @staticmethod
    def install(module):
        """Asynchronous unshards and forward prefetch for ``module`` (an
        FSDPModule) where its parameters live on the CPU (the host and the
        emulated paths); CUDA keeps FSDP2's own streams."""
        groups = module._get_fsdp_state()._fsdp_param_groups
        if not groups or any(g.device.type != "cpu" for g in groups) or not _prefetch_depth():
            return
        for g in groups:
            g.unshard_async_op = True
        if not getattr(module, "_zeropp_forward_order", False):
            module.register_forward_pre_hook(_ForwardOrder._runs)
            module._zeropp_forward_order = True

    @staticmethod
    def _runs(module, _args):
        # After FSDP2's own pre-forward: its lazy init gave the module its
        # root's state context.
        ctx = module._get_fsdp_state()._state_ctx
        order = getattr(ctx, "_zeropp_forward_order", None)
        if order is None:
            order = ctx._zeropp_forward_order = _ForwardOrder(_prefetch_depth())
        order.seen(module)


class _Served:
    """What zeropp serves of one FSDP2 mesh: the dimension FSDP2 shards over
    (its ranks laid out on their nodes, and the switches resolved on that
    layout) and, on HSDP's 2-D mesh, the replicate dimension (its gradient
    all-reduce, quantized with error feedback where the switches resolved
    on its own layout keep qgZ)."""

    def __init__(self, zjob, mode, switches, seed, shard_pg, replicate_pg):
        self.job, self.mode, self.seed = zjob, mode, seed
        self.shard_ranks = _group_ranks(shard_pg)
        self.replicate_ranks = None if replicate_pg is None else _group_ranks(replicate_pg)
        if self.replicate_ranks is not None and len(self.shard_ranks) == 1:
            raise ZeroppError(
                f"an HSDP mesh whose shard dimension holds 1 rank: nothing is sharded (that is "
                f"replication); shard over the ranks {self.replicate_ranks} with a 1-D mesh"
            )
        nodes, g, _ = _add_mesh_dim(zjob, self.shard_ranks)
        self.ranks_per_node = g
        resolved = json.loads(zjob.resolve_switches(mode, json.dumps(switches), self.shard_ranks))
        self.switches = resolved["switches"]
        self.plan = zjob.plan(json.dumps(self.switches), self.shard_ranks)
        mesh = {"shard": {"ranks": self.shard_ranks, "nodes": nodes, "ranks_per_node": g}}
        self.replicate = None
        if self.replicate_ranks is not None:
            rnodes, rg, _ = _add_mesh_dim(zjob, self.replicate_ranks)
            rep = json.loads(
                zjob.resolve_switches(mode, json.dumps(switches), self.replicate_ranks)
            )
            self.replicate = _Replicate(zjob, self.replicate_ranks, rep["switches"], seed)
            mesh["replicate"] = {
                "ranks": self.replicate_ranks,
                "nodes": rnodes,
                "ranks_per_node": rg,
                "quantized": self.replicate.state is not None,
                "why": rep["why"].get("qgz", "the mode's default"),
            }
        resolved["mesh"] = mesh
        _switches_used[mode] = resolved

    def hpz_group(self):
        """The ranks of the shard dimension sharing a secondary shard FSDP2
        keeps, or None (hpZ off, a group as large as the dimension, or qwZ's
        references of weight differences are the secondary shard)."""
        if self.references_serve_backward():
            return None
        s = self.switches
        h = s["hpz_group"] if s["hpz"] else None
        return h if h is not None and 1 < h < len(self.shard_ranks) else None

    def references_serve_backward(self):
        """hpZ over the whole node with qwZ on weight differences: the
        references (1/G of each group; int8 blocks by default, f32, or bf16
        with qwz_bf16_references) are the secondary shard, and the backward
        all-gather is served from them inside the node — FSDP2 keeps no
        second copy after forward."""
        return self.plan.references_serve_backward

    def keep_secondary(self, reshard_after_forward):
        """Registers the hpZ groups of FSDP2's ``reshard_after_forward=<int>``
        (runs of that many of the dimension's ranks inside a node)."""
        rafs = reshard_after_forward
        if isinstance(rafs, bool) or not isinstance(rafs, int) or rafs <= 1:
            return
        g = self.ranks_per_node
        if rafs < len(self.shard_ranks) and (rafs > g or g % rafs):
            raise ZeroppError(
                f"reshard_after_forward={rafs}: hpZ keeps its secondary shard inside a "
                f"node, which holds {g} ranks of this mesh dimension; use a divisor of {g}"
            )
        if rafs < len(self.shard_ranks):
            _add_mesh_dim(self.job, self.shard_ranks, hpz_group=rafs)

    def replicate_settings(self):
        return None if self.replicate is None else self.replicate.settings

    def collectives(self):
        return (
            ZeroppAllGather(self.job, self.switches, self.shard_ranks),
            ZeroppReduceScatter(
                self.job,
                self.switches,
                seed=self.seed,
                replicate=self.replicate,
                ranks=self.shard_ranks,
            ),
        )

    def install(self, module):
        """zeropp's collectives on ``module`` (an FSDPModule), and on HSDP's
        mesh its all-reduce across the replicate dimension."""
        ag, rs = self.collectives()
        ag.watch_frozen(
            [p for g in module._get_fsdp_state()._fsdp_param_groups for p in g.fsdp_params]
        )
        module.set_custom_all_gather(ag)
        module.set_custom_reduce_scatter(rs)
        rs.watch_groups(module._get_fsdp_state()._fsdp_param_groups)
        _ForwardOrder.install(module)
        if self.replicate is not None:
            for group in module._get_fsdp_state()._fsdp_param_groups:
                _serve_replicate(group.mesh_info)


def fully_shard(
    module,
    *,
    mode="zeropp",
    transport=None,
    ranks_per_node=None,
    seed=0,
    **kwargs,
):
    """FSDP2's ``fully_shard(module, **kwargs)`` with zeropp's communication.

    ``mode``: "zeropp" (qwZ + hpZ + qgZ, each a switch) or "zero3" (plain
    communication through zeropp's transports). The switches (``qwz_bits``,
    ``hpz``, ``hpz_group``, ``qgz``, ``error_feedback``, ``qgz_intra_bits``,
    ``qgz_stochastic``, ``block``, ``qgz_block``, ``fp32_comm``, ``qwz_delta``,
    ``qwz_refresh``, ``qgz_hadamard``, ``qgz_inter_block``,
    ``qwz_bf16_references``, ``qwz_host_references``, ``qwz_int8_references``;
    all of them: ``zeropp.torch.SWITCHES``) override the
    mode's; the rest comes from the routing plan and the links measured at
    join. ``mode="zeropp"`` sends int4 weight differences across nodes
    (``qwz_delta``, refreshed every ``qwz_refresh`` gathers) and rotates
    qgZ's hop across nodes (``qgz_hadamard``, blocks of ``qgz_inter_block``);
    ``qwz_delta=False, qgz_hadamard=False`` is DeepSpeed's ZeRO++ (qwZ
    int8). ``seed`` seeds qgZ's
    stochastic rounding. Other keyword arguments (``mesh``, ``mp_policy``,
    ``reshard_after_forward``, ...) go to FSDP2; with hpZ,
    ``reshard_after_forward`` defaults to the hpZ group. ``mesh`` is any
    mesh FSDP2 takes: the whole job, a 1-D mesh over part of it (the
    data-parallel sub-mesh next to tensor parallelism), or HSDP's 2-D
    (replicate, shard) mesh, whose all-reduce across the replicate
    dimension zeropp quantizes (int4, error feedback) where qgZ is kept
    there. Returns the module.
    """
    switches = {k: kwargs.pop(k) for k in list(kwargs) if k in SWITCHES}
    _check_fsdp_keywords(kwargs)
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, torch.nn.Module):
        raise ZeroppError(
            f"fully_shard takes a torch.nn.Module, not {type(module).__name__}: pass the model "
            "(or one of its blocks)"
        )
    if isinstance(module, FSDPModule):
        # FSDP2 renames the class (FSDPBlock): the user's name is its base.
        name = next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule)).__name__
        if getattr(module, "_zeropp_fully_sharded", False):
            raise ZeroppError(
                f"this {name} is sharded by zeropp.torch.fully_shard already: shard each "
                "module once (the blocks, then the root)"
            )
        raise ZeroppError(
            f"this {name} is sharded by FSDP2 already: call zeropp.torch.enable(model) on the "
            "sharded model instead of fully_shard again"
        )

    zjob = job(transport=transport, ranks_per_node=ranks_per_node)
    mesh = kwargs.get("mesh")
    shard_pg, replicate_pg = _mesh_groups(mesh)
    _check_dtypes(module, kwargs.get("mp_policy"))
    served = _Served(zjob, mode, switches, seed, shard_pg, replicate_pg)
    if "reshard_after_forward" not in kwargs:
        kwargs["reshard_after_forward"] = served.hpz_group() or True
    served.keep_secondary(kwargs["reshard_after_forward"])
    sharded = _fsdp_fully_shard(module, **kwargs)
    served.install(sharded)
    sharded._zeropp_fully_sharded = True
    return sharded


def enable(model, *, mode="zeropp", transport=None, ranks_per_node=None, seed=0, **switches):
    """Turns a model that FSDP2 already sharded — every ``FSDPModule`` inside
    ``model``, whoever called ``fully_shard`` (the Hugging Face Trainer,
    Accelerate, torchtitan's ``apply_fsdp``, your own loop) — into a zeropp
    one: zeropp's all-gather and reduce-scatter on each, with ``mode`` and
    the switches of :func:`fully_shard`, over whatever mesh FSDP2 was given
    (the whole job, a sub-mesh such as torchtitan's ``dp_shard`` next to
    tensor parallelism, or HSDP's 2-D mesh, whose replicate all-reduce
    zeropp then runs too). With hpZ, each module that reshards after
    forward keeps its secondary shard inside the hpZ group from here on,
    as ``fully_shard(reshard_after_forward=<hpZ group>)`` would have.

    Call it after sharding and before the next step (every rank, the same
    model). Calling it again with the same settings changes nothing (error
    feedback is kept); with other settings it installs them (error feedback
    starts over). Refuses, with a ``ZeroppError``, a model with no FSDP2
    module, a mesh zeropp cannot serve (it says why), or a module with
    several parameter groups. Returns ``model``.
    """
    from torch.distributed.fsdp import FSDPModule

    unknown = sorted(set(switches) - set(SWITCHES))
    if unknown:
        raise ZeroppError(f"unknown switches {unknown}; zeropp's switches are {sorted(SWITCHES)}")
    zjob = job(transport=transport, ranks_per_node=ranks_per_node)
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not sharded and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise ZeroppError(
            "this model is wrapped in DistributedDataParallel, not sharded by FSDP2: "
            "Accelerate and the Trainer set up FSDP only on accelerators and fall back to DDP "
            "on CPU ranks; force their FSDP2 path there (examples/accelerate_llama.py's "
            "--cpu-fsdp shows how), or shard with zeropp.torch.fully_shard"
        )
    if not sharded:
        raise ZeroppError(
            "no FSDP2-sharded module in this model: shard it first "
            "(torch.distributed.fsdp.fully_shard, or the framework's FSDP2 setting), "
            "or call zeropp.torch.fully_shard instead"
        )
    served_by_mesh = {}
    hpz_infos = {}
    for m in sharded:
        groups = m._get_fsdp_state()._fsdp_param_groups
        name = type(m).__name__
        if len(groups) > 1:
            raise ZeroppError(
                f"{name} has {len(groups)} FSDP parameter groups; zeropp.torch.enable serves "
                "modules sharded with one (fully_shard on each module, not several groups)"
            )
        for group in groups:
            info = group.mesh_info
            replicate_pg = getattr(info, "replicate_process_group", None)
            replicate_pg = getattr(replicate_pg, "_zeropp_served", replicate_pg)
            key = (tuple(_group_ranks(info.shard_process_group)), id(replicate_pg))
            if key not in served_by_mesh:
                served_by_mesh[key] = _Served(
                    zjob, mode, switches, seed, info.shard_process_group, replicate_pg
                )
            served = served_by_mesh[key]
            s = served.switches
            for p in group.fsdp_params:
                _check_param_dtype(name, p.mp_policy.param_dtype or p.sharded_param.dtype)
            rs_settings = (zjob, s, seed, served.replicate_settings())
            same = (
                isinstance(group._all_gather_comm, ZeroppAllGather)
                and group._all_gather_comm.settings == (zjob, s)
                and isinstance(group._reduce_scatter_comm, ZeroppReduceScatter)
                and group._reduce_scatter_comm.settings == rs_settings
            )
            if not same:
                served.install(m)
            hpz = served.hpz_group()
            if hpz is not None and group.post_forward_mesh_info is not None:
                served.keep_secondary(hpz)
                _keep_secondary_shard(group, hpz, hpz_infos)
    return model


def _check_param_dtype(name, dtype):
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ZeroppError(
            f"{name} communicates {dtype} parameters; zeropp moves float32, bfloat16 and "
            "float16 (cast the model, or set an FSDP2 MixedPrecisionPolicy)"
        )


def _keep_secondary_shard(group, hpz, infos):
    """hpZ on an already-sharded parameter group: after forward it reshards
    to groups of ``hpz`` consecutive ranks (what FSDP2 sets up for
    ``reshard_after_forward=hpz``), one mesh shared by every module."""
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_post_forward_mesh_info

    if group.post_forward_mesh_info is not group.mesh_info:
        return  # already a secondary shard (an int reshard_after_forward)
    key = id(group.mesh_info.mesh)
    if key not in infos:
        infos[key] = _get_post_forward_mesh_info(hpz, group.mesh_info)
    info = infos[key]
    group.post_forward_mesh_info = info
    for p in group.fsdp_params:
        p.post_forward_mesh_info = info
        p._init_sharded_post_forward_param_metadata(torch.empty(p._orig_size, device="meta"))


class OuterSync:
    """Islands' outer sync (DiLoCo's outer step, over shards), wrapping the
    user's optimizer: an island is a set of ranks FSDP2 (with zeropp's
    communication, or its own) shards the model over; every
    ``sync_every`` optimizer steps each rank's outer delta (its shard of the
    anchor minus its shard of the weights) is averaged over the ranks of
    the other islands holding the same shard — as int4 blocks with error
    feedback (``bits=4``) or in f32 (``bits=None``) — and Nesterov SGD
    (``lr``, ``momentum``) makes it the new anchor, from which every island
    continues. ``mesh`` is the job's 2-D (islands, ranks) DeviceMesh; shard
    the model over ``mesh[<its second dimension>]``::

        names = ("island", "shard")
        mesh = init_device_mesh("cpu", (islands, world // islands), mesh_dim_names=names)
        for block in model.blocks:
            zeropp.torch.fully_shard(block, mesh=mesh["shard"])
        zeropp.torch.fully_shard(model, mesh=mesh["shard"])
        opt = zeropp.torch.OuterSync(model, torch.optim.AdamW(model.parameters()), mesh)
        ...; loss.backward(); opt.step(); opt.zero_grad()

    Or shard it as HSDP does, over the whole 2-D mesh (what Accelerate's
    ``ParallelismConfig(dp_replicate_size=islands, dp_shard_size=...)``
    and the Trainer build): then ``mesh`` may be left out (the parameters'
    own), and OuterSync turns HSDP's per-step all-reduce across the
    replicas off — each replica is an island — whether FSDP2 or zeropp
    (``enable``) runs the collectives. Build it before the first backward.

    Parameters must be float32, on the CPU or CUDA (FSDP2 keeps its
    sharded parameters in their own dtype; compute dtypes come from its
    ``mp_policy``); the outer state lives on the host, and a CUDA shard is
    copied to it and back at each exchange (every H steps). ``step()``
    returns whether an outer step ran;
    ``optimizer`` may be None where the caller steps its optimizer itself
    and calls :meth:`after_step` (the Trainer callback does).

    Streaming: ``fragments=F`` splits the parameters into F runs of about
    equal size whose exchanges start staggered across the H steps, and
    ``delay=D`` (below ``sync_every``) lets each run on a thread of its own
    for D steps while the island trains on from the outer step on its own
    delta (the eager update), landing with what the other islands change.
    Call :meth:`finish` on every rank at the end.

    Islands of their own worlds: after :func:`init_islands`, pass the
    island's 1-D mesh (each island a torch.distributed world; the islands
    sync over a zeropp job of every island's ranks, over TCP).

    A lost island: a rank of another island that dies (or does not answer
    within ``ZEROPP_TIMEOUT_S``) takes its island out of the outer sync, and
    the others go on without it — launch with ``zeropp launch --islands N``,
    which stops only the failed rank's island. :attr:`lost` names the lost
    islands. Under :func:`init_islands` with ``--restarts K``, a restarted
    island's ``OuterSync`` rejoins: it waits for a live island's state at
    that island's next outer sync, and :attr:`steps` is the step to resume
    after (:attr:`rejoined` lists the islands that came back). On one world
    over every island, run what follows training over
    :meth:`survivor_group` after :meth:`finish`; a lost island cannot rejoin
    it, and island 0 must live (global rank 0 holds torch's store there).
    Under :func:`init_islands` and ``zeropp launch --islands`` any island
    rejoins, island 0 too (the launcher holds the job's store)."""

    def __init__(
        self,
        model,
        optimizer,
        mesh=None,
        *,
        sync_every=20,
        lr=0.3,
        momentum=0.6,
        bits=4,
        block=64,
        fragments=1,
        delay=0,
        transport=None,
        ranks_per_node=None,
    ):
        if mesh is None:
            mesh = _params_mesh(model)
        worlds = _island_world
        if worlds is not None and mesh.ndim != 1:
            raise ZeroppError(
                f"a {mesh.ndim}-D mesh under init_islands: pass OuterSync the 1-D mesh of the "
                "island's world that FSDP2 shards over"
            )
        if worlds is None and mesh.ndim != 2:
            raise ZeroppError(
                f"a {mesh.ndim}-D mesh: OuterSync takes the (islands, ranks) mesh whose second "
                "dimension FSDP2 shards each island over (or, after zeropp.torch.init_islands, "
                "the island's 1-D mesh)"
            )
        if worlds is not None and mesh.size() != worlds.size:
            raise ZeroppError(
                f"a mesh of {mesh.size()} ranks in an island of {worlds.size}: shard over the "
                "island's whole world"
            )
        if worlds is not None and worlds.rejoining and delay:
            raise ZeroppError(
                f"delay={delay}: a restarted island rejoins at an outer sync that waits for its "
                "exchanges (delay=0)"
            )
        if not (isinstance(sync_every, int) and sync_every >= 1):
            raise ZeroppError(f"sync_every={sync_every!r}: outer steps every 1 or more steps")
        if not (isinstance(delay, int) and 0 <= delay < sync_every):
            raise ZeroppError(
                f"delay={delay!r}: a streamed exchange lands 0 to sync_every - 1 steps after it "
                "starts (before its fragment's next one)"
            )
        self.optimizer, self.sync_every, self.steps = optimizer, sync_every, 0
        self.delay = delay
        # Exchanges started (of a fragment each when streamed).
        self.syncs = 0
        # Streamed exchanges under way: fragment -> (the step it lands
        # after, its ops; none once restored from a checkpoint).
        self._pending = {}
        # This rank's island: the key of what differs between islands (the
        # model between syncs, the inner optimizer's state) in a checkpoint.
        if worlds is None:
            self.job = job(transport=transport, ranks_per_node=ranks_per_node)
            self.ranks = _group_ranks(mesh.get_group(0))
            self.island = mesh.get_local_rank(0)
            _add_mesh_dim(self.job, self.ranks, outer=True)
            self._island_group = mesh.get_group(1)
        else:
            # Each island its own torch world; the islands sync over a
            # zeropp job of every island's ranks.
            self.job = _cross_job(transport, ranks_per_node)
            place = mesh.get_local_rank(0)
            self.ranks = [i * worlds.size + place for i in range(worlds.count)]
            self.island = worlds.index
            self.job.add_mesh_dim(self.ranks, _agree_through(worlds.job_store), outer=True)
            self._island_group = mesh.get_group(0)
        self._flags_device = mesh.device_type
        self._worlds = worlds
        self._survivors = None
        self.model = model
        named = list(model.named_parameters())
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.states = []
        # A CUDA shard's host copy: the outer step runs on the host (once
        # every H steps), its weights staged through it.
        self._staged = []
        for i, p in enumerate(self.params):
            local = _local(p)
            if local.dtype != torch.float32 or local.device.type not in ("cpu", "cuda"):
                raise ZeroppError(
                    f"parameter {i} is {local.dtype} on {local.device}: OuterSync keeps float32 "
                    "shards on the CPU or CUDA (FSDP2's sharded parameters; set compute dtypes "
                    "with mp_policy)"
                )
            self._staged.append(None if local.device.type == "cpu" else local.to("cpu"))
            state = _zeropp.OuterState(
                host_bytes(self._host(i), f"parameter {i}"),
                lr=lr,
                momentum=momentum,
                bits=bits,
                block=block,
            )
            self.states.append(state)
        if not (isinstance(fragments, int) and 1 <= fragments <= len(self.params)):
            raise ZeroppError(
                f"fragments={fragments!r}: the model's {len(self.params)} parameters are split "
                "into 1 to that many fragments"
            )
        self.fragments = _runs([p.numel() for p in self.params], fragments)
        # Last, once nothing can refuse: HSDP's replicas become islands, and
        # which islands take part is known (one that loses a rank leaves the
        # outer sync; the others go on without it).
        self.replicas_apart = _islands_on_hsdp(model)
        self._islands = _islands_of(self.job, self.ranks, mesh.size(mesh.ndim - 1))
        # This outer sync's number over these islands, in its exchanges'
        # names (another model's outer sync over them counts its own steps).
        self._sync_id = self._islands.register()
        if worlds is not None and worlds.rejoining:
            if self._sync_id > 0:
                raise ZeroppError(
                    "a restarted island rejoins through its first OuterSync only: sync every "
                    "model through one OuterSync (wrap them in one module), or launch with "
                    "--restarts 0"
                )
            self._rejoin()

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        """The optimizer's step, then every ``sync_every`` steps the outer
        step across the islands; whether an outer step ran."""
        if self.optimizer is None:
            raise ZeroppError(
                "OuterSync(model, None, ...) wraps no optimizer: step yours, then call after_step()"
            )
        if closure is None:
            self.optimizer.step()
        else:
            self.optimizer.step(closure)
        # Accelerate's optimizer skips its step between accumulated
        # micro-batches: those are no inner steps.
        accumulating = getattr(self.optimizer, "gradient_state", None)
        if accumulating is not None and not accumulating.sync_gradients:
            return False
        return self.after_step()

    def after_step(self):
        """Counts an inner step the caller's optimizer took: the streamed
        exchanges due land, then every fragment whose turn it is (fragment
        f at the steps that are f·H/F mod H) starts its exchange — waited
        for with ``delay=0``, else landing ``delay`` steps later while the
        island trains on from the outer step on its own delta. Whether an
        exchange started."""
        self.steps += 1
        due = [f for f, (at, _) in self._pending.items() if at == self.steps]
        for f in due:
            self._land(f)
        h, n = self.sync_every, len(self.fragments)
        turns = [f for f in range(n) if self.steps % h == (f * h // n) % h]
        for f in turns:
            self._start(f, self.delay)
        if due or turns:
            # A loss found in these exchanges, agreed on before the next;
            # restarted islands that asked to rejoin are taken back.
            self._agree(welcome=not self.delay)
        return bool(turns)

    def _host(self, i):
        """Parameter ``i``'s shard as the host sees it now: itself on the
        CPU; a CUDA shard copied into its host copy."""
        staged = self._staged[i]
        if staged is None:
            return _local(self.params[i])
        return staged.copy_(_local(self.params[i]))

    def _unstage(self, i):
        """A CUDA shard takes what the outer step wrote into its host copy."""
        if self._staged[i] is not None:
            _local(self.params[i]).copy_(self._staged[i])

    def _jumped(self, idx):
        """The weights of parameters ``idx`` jumped (an outer step wrote
        them): their groups' qwZ references (``qwz_delta``) refresh at the
        next gather, as the native engine's do."""
        ids = {id(self.params[i]) for i in idx}
        for m in self.model.modules():
            if not hasattr(m, "_get_fsdp_state"):
                continue
            for group in m._get_fsdp_state()._fsdp_param_groups:
                ag = group._all_gather_comm
                if not isinstance(ag, ZeroppAllGather) or ag.qwz_reference is None:
                    continue
                if any(id(fp.sharded_param) in ids for fp in group.fsdp_params):
                    ag.qwz_reference.reset()

    def _name(self, i):
        """Parameter ``i``'s exchange now, as every rank names it: this
        outer sync among those over the islands, the optimizer step, how
        many exchanges it started before, the parameter."""
        return (self._sync_id, self.steps, self.syncs, i)

    def _start(self, f, delay):
        idx = self.fragments[f]
        bufs = [host_bytes(self._host(i), "parameter") for i in idx]
        if delay == 0:
            ops = [
                self.states[i].step(self.job, b, self._islands, self._name(i))
                for i, b in zip(idx, bufs, strict=True)
            ]
            for op in ops:
                op.wait()
        else:
            # The eager update is in the weights when start returns.
            ops = [
                self.states[i].start(self.job, b, self._islands, self._name(i))
                for i, b in zip(idx, bufs, strict=True)
            ]
            self._pending[f] = (self.steps + delay, ops)
        for i in idx:
            self._unstage(i)
        self._jumped(idx)
        self.syncs += 1

    def _land(self, f):
        _, ops = self._pending.pop(f)
        for op in ops:
            op.wait()
        for i in self.fragments[f]:
            self.states[i].land(host_bytes(self._host(i), "parameter"))
            self._unstage(i)
        self._jumped(self.fragments[f])

    def sync(self):
        """The outer step of the whole model now, waited for, whatever the
        step count (every island calls it at the same point), after the
        streamed exchanges under way land: at the end of a run, so that
        every island holds one model."""
        for f in list(self._pending):
            self._land(f)
        for f in range(len(self.fragments)):
            self._start(f, 0)

    def finish(self):
        """The last outer step where the model is not synced yet (call it
        on every rank at the end of training): every island then holds the
        one model. Whether it ran."""
        whole = len(self.fragments) == 1 and not self._pending
        ran = not (self.steps == 0 or (whole and self.steps % self.sync_every == 0))
        if ran:
            self.sync()
        # An island lost after the last exchange: found by a one-value
        # exchange, then agreed on, so that every rank left names the same
        # survivors.
        self._islands.probe(self.job, self._name(len(self.params))).wait()
        self._agree()
        return ran

    def _agree(self, welcome=False):
        """The ranks of this island agree on which islands take part: an
        island one of them found lost (an exchange with its rank failed) is
        lost for all of them, so they run the same exchanges and name the
        same survivors (after every step that exchanged, and at the end).
        With ``welcome`` (islands of their own worlds, after a step's
        exchanges), a lost island every one of whose ranks asked this
        island's ranks at its place to take it back rejoins, if the islands
        taking part agree: the first of them sends each rank its state."""
        count = len(self.ranks)
        welcome = welcome and self._worlds is not None
        asked = self._islands.asked(self.job) if welcome else [False] * count
        flags = torch.tensor(
            [float(self._islands.alive(i)) for i in range(count)] + [float(a) for a in asked],
            device=self._flags_device,
        )
        dist.all_reduce(flags, group=self._island_group)
        sums = flags.tolist()
        size = dist.get_world_size(self._island_group)
        for i, n in enumerate(sums[:count]):
            if n < size and self._islands.alive(i):
                self._islands.lose(i, self.steps, "another rank of this island lost it")
        if welcome and self._islands.missing_any():
            ready = torch.tensor([float(n == size) for n in sums[count:]])
            self._islands.agree_ready(self.job, host_bytes(ready, "ready"), self.steps).wait()
            back = [j for j, n in enumerate(ready.tolist()) if n > 0]
            hosted = [j for j in back if self._islands.host_for(j) == self.island]
            for j in back:
                self._islands.welcome(self.job, j, self.steps)
            state = self._rejoin_state() if hosted else None
            for j in hosted:
                self._islands.send_state(self.job, j, state)

    def _outer_shards(self):
        """Each parameter's anchor and outer momentum, as this rank's f32
        host shards."""
        out = []
        for p, state in zip(self.params, self.states, strict=True):
            a, m = _host_like(p), _host_like(p)
            state.save_into(host_bytes(a, "anchor"), host_bytes(m, "momentum"))
            out.append((a, m))
        return out

    def _rejoin_state(self):
        """What a rejoining rank at this rank's place is sent: the step
        count, which islands take part and were lost or rejoined, this rank's parameter shards, the
        outer state and the optimizer's (its tensors as this rank's
        shards)."""
        outer = self._outer_shards()
        # The optimizer's per-parameter state (its hyperparameters, the
        # learning rate among them, are the rejoining rank's own: stepping
        # its schedule opt.steps times brings it where the others are).
        optim = None
        if self.optimizer is not None:
            optim = {
                k: {n: _plain_any(v) for n, v in per.items()}
                for k, per in self.optimizer.state_dict()["state"].items()
            }
        buf = io.BytesIO()
        torch.save(
            {
                "steps": self.steps,
                "syncs": self.syncs,
                "alive": [self._islands.alive(i) for i in range(len(self.ranks))],
                # The islands lost and rejoined so far: the rejoined rank's
                # lost and rejoined name the whole run.
                "history": bytes(self._islands.history()),
                "params": [_plain_any(p) for p in self.params],
                "outer": outer,
                "optim": optim,
            },
            buf,
        )
        return buf.getvalue()

    def _rejoin(self):
        """A restarted island's rank: asks the islands taking part to take
        it back and loads the state one sends at its next outer sync (the
        weights, the outer and the optimizer's state, the step count)."""
        sender, raw = self._islands.rejoin(self.job)
        try:
            st = torch.load(io.BytesIO(raw), weights_only=True)
            params, outer, optim = st["params"], st["outer"], st["optim"]
            if len(params) != len(self.params) or any(
                t.shape != _local(p).shape for t, p in zip(params, self.params, strict=True)
            ):
                raise ValueError("its parameter shards are not this model's")
            with torch.no_grad():
                for p, t in zip(self.params, params, strict=True):
                    _local(p).copy_(t)
            for state, (a, m) in zip(self.states, outer, strict=True):
                state.load(host_bytes(a, "anchor"), host_bytes(m, "momentum"))
            if self.optimizer is not None and optim is not None:
                order = [p for g in self.optimizer.param_groups for p in g["params"]]
                sd = self.optimizer.state_dict()
                sd["state"] = {
                    k: {
                        n: _like_param(v, order[k])
                        if isinstance(v, torch.Tensor) and v.shape == _local(order[k]).shape
                        else v
                        for n, v in per.items()
                    }
                    for k, per in optim.items()
                }
                self.optimizer.load_state_dict(sd)
        except Exception as e:  # a corrupt or foreign state
            raise ZeroppError(
                f"the state rank {sender} sent this rejoining rank does not fit it ({e}): every "
                "island must run the same script on the same model and optimizer"
            ) from None
        self.steps, self.syncs = int(st["steps"]), int(st["syncs"])
        self._islands.joined(self.job, st["alive"], self.steps, st["history"])
        self._jumped(range(len(self.params)))

    @property
    def rejoined(self):
        """The islands that rejoined after they were lost, as this rank saw
        it: ``[(island, step)]`` — the optimizer step after which each
        trained with the others again (a rejoined rank lists its own)."""
        return self._islands.rejoined()

    @property
    def lost(self):
        """The islands that left the outer sync, as this rank's island
        agreed after its last exchange: ``[(island, step, why)]`` — the optimizer
        step after which the others went on without it, and what showed it
        gone (a rank died, or did not answer within ``ZEROPP_TIMEOUT_S``)."""
        return self._islands.lost()

    def survivors(self):
        """The job's ranks of the islands that take part (all of them
        unless one was lost), as this island agreed after its last exchange
        (the same on each of its ranks between syncs) or at :meth:`finish`."""
        size = dist.get_world_size(self._island_group)
        return [
            i * size + r
            for i in range(len(self.ranks))
            if self._islands.alive(i)
            for r in range(size)
        ]

    def survivor_group(self):
        """A process group over :meth:`survivors` for what follows training
        (a validation loss, a summary, a barrier), or None while every
        island takes part (the default group serves). Made by the survivors
        alone (``use_local_synchronization``): the lost island's ranks are
        gone. Call it on every surviving rank after :meth:`finish`."""
        ranks = self.survivors()
        if self._worlds is not None or len(ranks) == dist.get_world_size():
            # Islands of their own worlds: the island's world is whole.
            return None
        if self._survivors is None or self._survivors[0] != ranks:
            group = dist.new_group(ranks, use_local_synchronization=True)
            self._survivors = (ranks, group)
        return self._survivors[1]

    def state_bytes(self):
        """Bytes of outer state this rank holds (anchors, momenta, error
        feedback): about twice its shard of the model in f32."""
        return sum(s.bytes() for s in self.states)

    def state_dict(self):
        """The outer state for a checkpoint: the step count and, per
        parameter name, its anchor and outer momentum sharded as the
        parameter is (DTensors on its mesh, the same on every island), so
        that ``torch.distributed.checkpoint`` saves and loads them beside
        the model (the inner optimizer's state is the wrapped optimizer's:
        ``get_optimizer_state_dict(model, opt.optimizer)``)::

            mine = f"island{opt.island}"   # the islands' models and AdamW states differ
            msd, osd = get_state_dict(model, opt.optimizer)
            dcp.save({mine: {"model": msd, "optim": osd}, "outer": opt.state_dict()},
                     checkpoint_id=path)
            ...
            msd, osd = get_state_dict(model, opt.optimizer)
            state = {mine: {"model": msd, "optim": osd}, "outer": opt.state_dict()}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(model, opt.optimizer, model_state_dict=state[mine]["model"],
                           optim_state_dict=state[mine]["optim"])
            opt.load_state_dict(state["outer"])

        The exchange's error feedback is not saved: it starts over. Streamed
        (``delay`` above 0), the exchanges under way are waited for and
        saved with the step each lands after (``averaged`` per parameter,
        and ``then``, where each island's exchange started, under the
        island's key; zeros where none is under way), and a resume lands
        them there."""
        # The exchanges under way finish first (each holds its shard's
        # state until it does).
        for _, ops in self._pending.values():
            for op in ops:
                op.wait()
        anchors, momenta = {}, {}
        for name, p, (a, m) in zip(self.names, self.params, self._outer_shards(), strict=True):
            anchors[name], momenta[name] = _like_param(a, p), _like_param(m, p)
        out = {"steps": self.steps, "anchors": anchors, "momenta": momenta}
        if self.delay:
            then, averaged = {}, {}
            for name, p, state in zip(self.names, self.params, self.states, strict=True):
                t, v = _host_like(p), _host_like(p)
                state.save_flight_into(host_bytes(t, "then"), host_bytes(v, "averaged"))
                then[name], averaged[name] = _like_param(t, p), _like_param(v, p)
            due = [self._pending.get(f, (-1, None))[0] for f in range(len(self.fragments))]
            # Where each island's exchange started differs by island (its
            # own eager step): under the island's key, as its model.
            out.update(then={f"island{self.island}": then}, averaged=averaged, due=due)
        return out

    def load_state_dict(self, state_dict):
        """Restores what :meth:`state_dict` gave (after a
        ``torch.distributed.checkpoint`` load filled it in)."""
        try:
            steps, anchors, momenta = (
                state_dict["steps"],
                state_dict["anchors"],
                state_dict["momenta"],
            )
        except (KeyError, TypeError) as e:
            raise ZeroppError(
                f"not an OuterSync state dict (missing {e}): pass what OuterSync.state_dict() gave"
            ) from None
        missing = [n for n in self.names if n not in anchors or n not in momenta]
        if missing:
            raise ZeroppError(
                f"the outer state has no anchor or momentum for {missing[:3]}: it was saved for "
                "another model"
            )
        for name, state in zip(self.names, self.states, strict=True):
            state.load(
                host_bytes(_plain(anchors[name]), "anchor"),
                host_bytes(_plain(momenta[name]), "momentum"),
            )
        self.steps = int(steps)
        self._pending = {}
        saved_due = state_dict.get("due")
        if not self.delay:
            if saved_due is not None and any(int(d) >= 0 for d in saved_due):
                raise ZeroppError(
                    "the outer state holds streamed exchanges under way: load it into an "
                    "OuterSync with the delay and fragments it was saved with"
                )
            return
        try:
            then, averaged, due = (
                state_dict["then"][f"island{self.island}"],
                state_dict["averaged"],
                state_dict["due"],
            )
        except KeyError as e:
            raise ZeroppError(
                f"the outer state has no streamed exchanges ({e} missing): it was saved with "
                "delay=0; load it into an OuterSync with delay=0"
            ) from None
        if len(due) != len(self.fragments):
            raise ZeroppError(
                f"the outer state was saved with {len(due)} fragments, this OuterSync has "
                f"{len(self.fragments)}: load it with the fragments it was saved with"
            )
        for f, d in enumerate(due):
            if int(d) < 0:
                continue
            for i in self.fragments[f]:
                name = self.names[i]
                self.states[i].load_flight(
                    host_bytes(_plain(then[name]), "then"),
                    host_bytes(_plain(averaged[name]), "averaged"),
                )
            self._pending[f] = (int(d), [])


def _host_like(p):
    """Zeros shaped as parameter ``p``'s shard, float32 on the CPU (where
    the outer state lives)."""
    return torch.zeros(_local(p).shape, dtype=torch.float32)


def _plain_any(v):
    """A value with its tensors as this rank's CPU shards, in their dtype
    (saved at once: no copy on the CPU)."""
    if isinstance(v, torch.Tensor):
        return _local(v).detach().to("cpu")
    return v


def _plain(t):
    """A checkpoint's tensor (or DTensor) as this rank's float32 CPU shard."""
    return _local(t).detach().to("cpu", torch.float32).contiguous()


# The islands each set of ranks across them takes part with, one per job:
# every OuterSync over the same islands shares it (their regrouped groups
# are the same groups, with one sequence of calls).
_islands_by_ranks = {}


def _islands_of(zjob, ranks, size):
    key = (tuple(ranks), size)
    if key not in _islands_by_ranks:
        _islands_by_ranks[key] = _zeropp.Islands(zjob, ranks, size)
    return _islands_by_ranks[key]


def _runs(sizes, n):
    """``n`` runs of consecutive indices of ``sizes``, each about 1/n of
    their sum, none empty."""
    total, runs, acc, f = sum(sizes), [[] for _ in range(n)], 0, 0
    for i, size in enumerate(sizes):
        # One run at a time, and enough indices left for the runs after.
        if runs[f] and min(n - 1, acc * n // max(total, 1)) > f:
            f += 1
        f = max(f, n - (len(sizes) - i))
        runs[f].append(i)
        acc += size
    return runs


def _params_mesh(model):
    """The 2-D mesh ``model``'s parameters are sharded on (HSDP's), for
    OuterSync called without one."""
    meshes = {
        id(p.device_mesh): p.device_mesh for p in model.parameters() if hasattr(p, "to_local")
    }
    if len(meshes) != 1:
        raise ZeroppError(
            f"the model's parameters are on {len(meshes)} device meshes: pass OuterSync the "
            "(islands, ranks) mesh (mesh=...)"
        )
    return next(iter(meshes.values()))


def _islands_on_hsdp(model):
    """Every FSDP2 parameter group of ``model`` sharded on an HSDP mesh
    keeps its replica's gradient (no all-reduce across the islands); how
    many groups that is."""
    n = 0
    for m in model.modules():
        if not hasattr(m, "_get_fsdp_state"):
            continue
        for group in m._get_fsdp_state()._fsdp_param_groups:
            if getattr(group.mesh_info, "replicate_process_group", None) is None:
                continue
            _serve_replicate(group.mesh_info)._zeropp_islands = True
            n += 1
    return n


def _like_param(local, p):
    """``local`` (this rank's shard) sharded as parameter ``p`` is, on its
    device."""
    local = local.to(_local(p).device)
    if not hasattr(p, "to_local"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def _local(p):
    """This rank's shard of a parameter (a DTensor's local tensor)."""
    t = p.to_local() if hasattr(p, "to_local") else p
    return t.data


def kept_bytes(module):
    """Bytes zeropp keeps between steps for the zeropp-sharded submodules of
    ``module`` on this rank, beside FSDP2's own: ``qwz_references`` (qwZ's
    references of weight differences: 1/G of each group, f32 or bf16 —
    with hpZ over the node they are also its secondary shard and the frozen
    weights' cache, in host memory for CPU tensors and on the device for
    CUDA ones), ``qgz_residuals`` (error feedback of the gradients, HSDP's
    all-reduce included) and ``total`` — as ``zeropp train``'s summary
    reports ``kept_bytes``; beside them ``scratch``, the free buffers this
    process's collectives hold for their next call (``scratch_stats``)."""
    references = residuals = 0
    for group in _zeropp_groups(module):
        rs = group._reduce_scatter_comm
        if isinstance(rs, ZeroppReduceScatter):
            if rs.qgz_state is not None:
                residuals += rs.qgz_state.residual_bytes()
            if rs.replicate is not None and rs.replicate.state is not None:
                residuals += rs.replicate.state.residual_bytes()
        ag = group._all_gather_comm
        if isinstance(ag, ZeroppAllGather) and ag.qwz_reference is not None:
            references += ag.qwz_reference.reference_bytes()
    return {
        "qwz_references": references,
        "qgz_residuals": residuals,
        "total": references + residuals,
        "scratch": scratch_stats()["held_bytes"],
    }


def scratch_stats():
    """This process's reused collective buffers: ``taken`` (buffers of 1 KiB
    or more the host collectives asked for), ``reused`` (of those, taken
    from a free buffer), ``allocated`` (the rest) and ``held_bytes`` (free
    buffers kept for the next call; ``ZEROPP_SCRATCH_POOL`` bounds them,
    ``0`` frees every buffer after use). After the first steps of a job
    ``allocated`` stops growing: the gathers and reduce-scatters reuse
    their buffers."""
    return dict(_zeropp.scratch_stats())


def _zeropp_groups(module):
    """The FSDP2 parameter groups of ``module``'s sharded submodules."""
    for m in module.modules():
        if getattr(m, "_get_fsdp_state", None) is None:
            continue
        yield from m._get_fsdp_state()._fsdp_param_groups


def reset_error_feedback(module):
    """Error feedback starts over, and the qwZ references (``qwz_delta``) are
    refreshed at the next gather, in every zeropp-sharded submodule of
    ``module``: call it on every rank after loading a checkpoint (neither is
    part of a state dict). Returns the parameter groups reset."""
    n = 0
    for group in _zeropp_groups(module):
        reset = False
        rs = group._reduce_scatter_comm
        if isinstance(rs, ZeroppReduceScatter) and rs.qgz_state is not None:
            rs.qgz_state.reset()
            reset = True
        if isinstance(rs, ZeroppReduceScatter) and rs.replicate is not None:
            if rs.replicate.state is not None:
                rs.replicate.state.reset()
                reset = True
        ag = group._all_gather_comm
        if isinstance(ag, ZeroppAllGather) and ag.qwz_reference is not None:
            ag.qwz_reference.reset()
            reset = True
        n += reset
    return n
