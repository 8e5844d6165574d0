"""torchft's DiLoCo on examples/torch_gpt.py's byte-level GPT: a peer to
`zeropp train --islands N --sync-every H` for the emulated cluster.

Each island (torchft's "replica group") is one torchrun job of G ranks that
shards the model with FSDP2 (``fully_shard`` on every block and the root,
gloo on the CPU) and steps AdamW every step; every H steps torchft's
``DiLoCo`` all-reduces the pseudo-gradient (the weights at the last sync
minus the weights now, f32, each rank its own FSDP2 shard with the same rank
of the other islands) across the islands through the torchft ``Manager``'s
reconfigurable gloo group, and steps the outer optimizer (SGD, lr 0.7,
momentum 0.9, Nesterov) on it. A lighthouse (torchft's quorum server) joins
the islands.

Model, data, seed, inner optimizer and learning-rate schedule are
torch_gpt.py's (imported from it): rank r of the job (island k's local rank
j is r = k * G + j) trains on the batches rank r of a torch_gpt.py or
`zeropp train` run of N * G ranks trains on.

Set up once: torchft in a venv of its own, made with the main venv's
interpreter, that sees the main venv's torch and zeropp through a .pth file
written last (pip then warns that torchft's torch is "not installed";
harmless). torchft-nightly 2026.10.26 works with torch 2.15:

    BASE=$(readlink -f ~/.cache/zeropp/venv/bin/python3)
    "$BASE" -m venv /tmp/tft-venv
    /tmp/tft-venv/bin/pip install --no-deps torchft-nightly==2026.10.26
    /tmp/tft-venv/bin/pip install opentelemetry-api opentelemetry-sdk \
        opentelemetry-exporter-otlp-proto-http
    SITE='import site; print(site.getsitepackages()[0])'
    ~/.cache/zeropp/venv/bin/python -c "$SITE" \
        > "$(/tmp/tft-venv/bin/python -c "$SITE")/zeropp-venv.pth"

Two islands of two ranks on one machine:

    export TORCHFT_LIGHTHOUSE=http://localhost:29510
    /tmp/tft-venv/bin/torchft_lighthouse --min_replicas 2 --quorum_tick_ms 100 \
        --join_timeout_ms 10000 --bind '[::]:29510' &
    LIGHTHOUSE=$!
    PIDS=()
    for k in 0 1; do
      REPLICA_GROUP_ID=$k NUM_REPLICA_GROUPS=2 OMP_NUM_THREADS=1 \
        /tmp/tft-venv/bin/python -m torch.distributed.run \
          --nnodes 1 --nproc-per-node 2 --master-port $((29600 + k)) \
          bench-cluster/torchft_diloco.py --steps 12 --sync-every 4 \
          --width 64 --layers 1 --heads 2 --context 32 --batch 2 \
          --summary-json /tmp/tft-summary.json > /tmp/tft-island$k.log 2>&1 &
      PIDS+=($!)
    done
    wait "${PIDS[@]}"; kill $LIGHTHOUSE

(``/tmp/tft-venv/bin/torchrun`` is not installed by ``--no-deps``;
``python -m torch.distributed.run`` is torchrun.) On separate hosts or
network namespaces, start island k's torchrun on its own host with
``--advertise-host`` (or TORCHFT_ADVERTISE_HOST) set to an address the other
islands reach it at: torchft advertises ``socket.gethostname()`` otherwise
(for its manager server, the gloo group's rendezvous store and its checkpoint
server), and GLOO_SOCKET_IFNAME set to the interface gloo should use.
TORCHFT_LIGHTHOUSE then names the lighthouse's host.

What torchft does (torchft-nightly 2026.10.26, torchft/local_sgd.py):

- The sync runs inside the inner optimizer's ``step()`` (a post-step hook)
  of the H-th step after the previous sync: after steps H, 2H, ... (the
  quorum is asked for on that step too; the first quorum also builds the
  cross-island gloo group, so the first sync is the slowest).
- The pseudo-gradients are all-reduced one tensor per parameter (torchft's
  default; ``--bucket-mb`` packs them into buckets) as a SUM, then divided
  by the number of participants.
- The Manager is made with ``init_sync=False``: with torchft's default
  (True) the first quorum (manager step 0) makes every island but one
  discard its first H steps and copy the primary's whole state (model,
  AdamW and outer state) over HTTP. Every island starts from the same
  seeded weights, as torchft's docs advise for init_sync=False.
- The inner AdamW state is kept across syncs (not reset); the first sync's
  pseudo-gradient is taken against the initial weights, which DiLoCo saves
  when it is built.
- Streaming DiLoCo (fragments, ``fragment_sync_delay``,
  ``fragment_update_alpha``) is not used: one fragment, the whole model,
  applied at once (alpha 0: the model becomes the outer step's result).
- Quantized outer deltas need CUDA (Triton); this runs f32.
- When --steps is not a multiple of H, this script runs one more outer sync
  after the last step (the same calls the hook makes), so that every island
  holds the same model for the validation loss.
- Otherwise it is plain DiLoCo: a 2 x 2 run of 10 steps with H = 4 (syncs
  after steps 4 and 8, and the final one) ended with the weights (sum to 2e-8
  relative: FSDP2's reduction order), training losses and validation loss of
  a one-process simulation of the same two islands without torchft.
- Each island's rank 0 prints a checksum of the island's model after the
  final sync (sha256 over every rank's shards, and their sum; after every
  sync with --checksum-syncs): the islands' lines are equal when the sync
  left every island the same weights, bit for bit.

Summary (``--summary-json``, written by rank 0 of island 0): ``zeropp
train``'s conventions where they apply -- losses of island 0 (each step's
loss averaged over the island's ranks), ``final_loss`` the mean of the last
10, ``val_loss`` after the final sync on the held-out batches of every rank
of the N * G job (torch_gpt.py's four per rank, their mean: the model is the
same on every island, so island 0 evaluates them all), ``median_step_time_s``
(forward to the loss all-reduce, the sync inside the steps that sync),
``mean_step_time_s`` (the training loop's wall time, its syncs included
but not the extra one at the end, over --steps, as zeropp's runs count
it), ``tokens_per_s`` (job tokens per step over the median step, as
zeropp train) and ``tokens_per_s_wall`` (over the mean);
``outer_bytes_per_rank_counted``: the bytes of the tensors rank 0 handed to
the cross-island all-reduce (the payload, not the wire; see
``outer_bytes_counted`` for how).
"""

import argparse
import hashlib
import json
import logging
import math
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

# CPU only: torchft uses accelerator streams whenever torch sees one.
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import torch_gpt  # noqa: E402  (the model, data and thread accounting)


def die(msg):
    print(f"torchft_diloco: {msg}", file=sys.stderr, flush=True)
    sys.stderr.flush()
    os._exit(2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=3e-3, help="inner AdamW peak learning rate")
    p.add_argument("--sync-every", type=int, default=20, help="H: inner steps per outer sync")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument(
        "--bucket-mb",
        type=float,
        default=None,
        help="all-reduce the pseudo-gradients in buckets of this size (torchft's "
        "use_bucketization); default: one all-reduce per parameter, torchft's default",
    )
    p.add_argument("--bf16", action="store_true", help="bf16 parameters for compute and traffic")
    p.add_argument("--metrics", default=None, help="per-step JSON lines (rank 0 of island 0)")
    p.add_argument("--summary-json", default=None)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument(
        "--replica-group-id",
        type=int,
        default=None,
        help="this island's index (default: $REPLICA_GROUP_ID)",
    )
    p.add_argument(
        "--num-replica-groups",
        type=int,
        default=None,
        help="islands in the job (default: $NUM_REPLICA_GROUPS)",
    )
    p.add_argument(
        "--advertise-host",
        default=os.environ.get("TORCHFT_ADVERTISE_HOST"),
        help="address other islands reach this one at (default: socket.gethostname())",
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=600.0,
        help="torchft's timeout for collectives and commits (the outer all-reduce "
        "on a slow link must fit in it)",
    )
    p.add_argument(
        "--quorum-timeout-s",
        type=float,
        default=1800.0,
        help="how long an island waits at a sync for the others",
    )
    p.add_argument("--checksum-syncs", action="store_true", help="a checksum after every sync")
    p.add_argument("--verbose", action="store_true", help="torchft's INFO logs")
    return p.parse_args(argv)


def env_int(value, name):
    if value is not None:
        return value
    raw = os.environ.get(name)
    if raw is None:
        die(
            f"${name} is not set (nor --{name.lower().replace('_', '-')}): launch one torchrun "
            "per island with REPLICA_GROUP_ID=k NUM_REPLICA_GROUPS=N (see the docstring)"
        )
    try:
        return int(raw)
    except ValueError:
        die(f"${name}={raw!r} is not an integer")


def make_counting_gloo(base):
    """A subclass of torchft's ProcessGroupGloo (imported late) that counts
    the tensors handed to its all-reduce: the cross-island one."""

    class _CountingGloo(base):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.counted_bytes = 0
            self.counted_calls = 0

        def allreduce(self, tensors, opts):
            self.counted_bytes += sum(t.numel() * t.element_size() for t in tensors)
            self.counted_calls += 1
            return super().allreduce(tensors, opts)

    return _CountingGloo


def checksum(model, group_rank, group_world):
    """(sha256 over every rank's shards in rank order, float64 sum of all
    parameters) of the island's model: equal on two islands when their
    shards are equal bit for bit."""
    h = hashlib.sha256()
    total = torch.zeros((), dtype=torch.float64)
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        local = local.detach().contiguous()
        h.update(name.encode())
        h.update(local.view(torch.uint8).numpy().tobytes() if local.numel() else b"")
        total += local.double().sum()
    digests = [None] * group_world
    dist.all_gather_object(digests, h.hexdigest())
    dist.all_reduce(total)
    return hashlib.sha256("".join(digests).encode()).hexdigest()[:16], total.item()


def main(argv=None):
    args = parse_args(argv)
    if args.sync_every < 1:
        die("--sync-every must be at least 1")
    island = env_int(args.replica_group_id, "REPLICA_GROUP_ID")
    islands = env_int(args.num_replica_groups, "NUM_REPLICA_GROUPS")
    if not 0 <= island < islands:
        die(f"REPLICA_GROUP_ID={island} is not in 0..{islands - 1} (NUM_REPLICA_GROUPS={islands})")
    if not os.environ.get("TORCHFT_LIGHTHOUSE"):
        die(
            "$TORCHFT_LIGHTHOUSE is not set: start the lighthouse first, e.g.\n"
            f"  torchft_lighthouse --min_replicas {islands} --quorum_tick_ms 100 "
            "--join_timeout_ms 10000 --bind '[::]:29510' &\n"
            "  export TORCHFT_LIGHTHOUSE=http://<its host>:29510"
        )
    if "RANK" not in os.environ or "MASTER_ADDR" not in os.environ:
        die("run under torchrun (one torchrun per island; see the docstring)")
    if args.advertise_host:
        # torchft advertises socket.gethostname() (manager server, the gloo
        # group's rendezvous store, the checkpoint server); Manager's default
        # hostname is bound when torchft is imported, so patch first.
        host = args.advertise_host
        socket.gethostname = lambda: host
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    if not args.verbose:
        # torchft's Rust side (manager server, clients) logs every quorum at INFO.
        os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft
        from torchft.local_sgd import DiLoCo
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo
    except ImportError as e:
        die(
            f"cannot import torchft ({e}): run this with a Python that has torchft-nightly "
            "(see the docstring's set-up)"
        )
    try:
        from importlib.metadata import version

        tft_version = version("torchft-nightly")
    except Exception:
        tft_version = getattr(torchft, "__version__", "unknown")

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    local, g = dist.get_rank(), dist.get_world_size()
    world = islands * g
    rank = island * g + local
    lead = island == 0 and local == 0
    say = local == 0

    torch.manual_seed(args.seed)
    model = torch_gpt.GPT(args.width, args.layers, args.heads, args.context)
    params = sum(p.numel() for p in model.parameters())
    mesh = init_device_mesh("cpu", (g,))
    kw = {"mesh": mesh}
    if args.bf16:
        kw["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16
        )
    for b in model.blocks:
        fully_shard(b, **kw)
    fully_shard(model, **kw)

    # torch_gpt.py's inner optimizer and schedule.
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / warmup)
            * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, args.steps)))))
        ),
    )
    outer = torch.optim.SGD(
        model.parameters(), lr=args.outer_lr, momentum=args.outer_momentum, nesterov=True
    )

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["inner_optim"])

    def state_dict():
        return {"model": model.state_dict(), "inner_optim": opt.state_dict()}

    timeout = timedelta(seconds=args.timeout_s)
    pg = make_counting_gloo(ProcessGroupGloo)(timeout=timeout)
    try:
        manager = Manager(
            pg=pg,
            load_state_dict=load_state_dict,
            state_dict=state_dict,
            min_replica_size=islands,
            use_async_quorum=False,  # DiLoCo requires it
            init_sync=False,  # same seed, same initial weights (see the docstring)
            replica_id=f"torchft_diloco_{island}",
            timeout=timeout,
            quorum_timeout=timedelta(seconds=args.quorum_timeout_s),
            connect_timeout=timedelta(seconds=60),
        )
    except Exception as e:
        die(
            f"island {island} rank {local}: torchft's Manager failed ({e}); is the lighthouse "
            f"running at TORCHFT_LIGHTHOUSE={os.environ['TORCHFT_LIGHTHOUSE']}?"
        )

    diloco_kw = {}
    if args.bucket_mb is not None:
        diloco_kw = {"use_bucketization": True, "bucket_cap_mb": args.bucket_mb}
    diloco = DiLoCo(
        manager,
        [model],
        opt,
        outer,
        sync_every=args.sync_every,
        backup_device=torch.device("cpu"),
        pin_memory=False,
        should_quantize=False,
        **diloco_kw,
    )

    data = torch_gpt.Data(args.seed, rank, world)
    tokens_per_step = args.batch * args.context * world
    metrics = open(args.metrics, "w") if (lead and args.metrics) else None
    if say:
        print(
            f"torchft-diloco (torchft-nightly {tft_version}): island {island} of {islands}, "
            f"{g} ranks (job ranks {island * g}..{island * g + g - 1} of {world}), "
            f"{params} parameters, outer sync every {args.sync_every} steps, "
            f"{'bf16' if args.bf16 else 'f32'} compute, f32 outer deltas",
            flush=True,
        )

    losses, times, sync_times = [], [], []
    calls_before = bytes_before = 0
    checks = []
    final_sync = False
    with diloco:
        t_loop = time.perf_counter()
        for step in range(args.steps):
            x, y = data.batch(step, args.batch, args.context)
            t0 = time.perf_counter()
            logits = model(x)
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            committed = manager.current_step()
            ts = time.perf_counter()
            opt.step()  # DiLoCo's post-step hook runs the outer sync on the H-th step
            t_opt = time.perf_counter() - ts
            opt.zero_grad(set_to_none=True)
            sched.step()
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            mean_loss = mean_loss.item() / g
            dt = time.perf_counter() - t0
            synced = manager.current_step() != committed
            attempted = pg.counted_calls != calls_before  # a sync ran, committed or not
            step_bytes = pg.counted_bytes - bytes_before
            calls_before, bytes_before = pg.counted_calls, pg.counted_bytes
            losses.append(mean_loss)
            times.append(dt)
            if attempted:
                sync_times.append(t_opt)
            if synced and args.checksum_syncs:
                digest, total = checksum(model, local, g)
                checks.append({"step": step + 1, "sha256": digest, "sum": total})
                if say:
                    print(
                        f"checksum island {island} after sync {manager.current_step()} "
                        f"(step {step + 1}): sha256 {digest} sum {total:.12e}",
                        flush=True,
                    )
            if metrics:
                metrics.write(
                    json.dumps(
                        {
                            "step": step + 1,
                            "loss": mean_loss,
                            "grad_norm": float(norm.full_tensor())
                            if hasattr(norm, "full_tensor")
                            else float(norm),
                            "lr": sched.get_last_lr()[0],
                            "step_time_s": dt,
                            "tokens_per_s": tokens_per_step / dt,
                            "outer_sync": synced,
                            "outer_bytes_rank0_counted": step_bytes,
                        }
                    )
                    + "\n"
                )
            if say and (
                (step + 1) % args.log_every == 0 or step == 0 or step + 1 == args.steps or synced
            ):
                print(
                    f"island {island} step {step + 1:>5}/{args.steps} loss {mean_loss:.4f} "
                    f"lr {sched.get_last_lr()[0]:.2e} {tokens_per_step / dt:>8.0f} tok/s"
                    + (
                        f"  outer sync {manager.current_step()} "
                        f"({'committed' if synced else 'NOT committed'}, {t_opt:.3f} s, "
                        f"{step_bytes / 1e6:.3f} MB all-reduced by this rank)"
                        if attempted
                        else ""
                    ),
                    flush=True,
                )
        # The training steps' wall time (their syncs included; the last
        # extra sync below is not, as zeropp's runs count it).
        loop_s = time.perf_counter() - t_loop
        if diloco._local_step != 0:
            # Steps since the last sync: one more, the hook's own calls.
            committed = manager.current_step()
            ts = time.perf_counter()
            manager.start_quorum()
            diloco._fragments[0].prepare_sync()
            diloco._fragments[0].perform_sync()
            diloco._local_step = 0
            sync_times.append(time.perf_counter() - ts)
            final_sync = True
            if say:
                state = "committed" if manager.current_step() != committed else "NOT committed"
                print(
                    f"island {island} final outer sync {manager.current_step()} after step "
                    f"{args.steps} ({state}, {sync_times[-1]:.3f} s)",
                    flush=True,
                )

    outer_syncs = manager.current_step()
    expected = -(-args.steps // args.sync_every)
    digest, total = checksum(model, local, g)
    if say:
        print(
            f"checksum island {island} after final sync ({outer_syncs} committed of {expected}): "
            f"sha256 {digest} sum {total:.12e}",
            flush=True,
        )

    # Validation: torch_gpt.py's held-out batches (four per rank) of every
    # rank of the N*G job; island k's rank j evaluates job ranks j, j+G, ...
    # (the model is the same on every island after the final sync).
    val = []
    with torch.no_grad():
        for r in range(local, world, g):
            data.rank = r  # Data.batch seeds by rank; the held-out text is the same
            for i in range(4):
                x, y = data.batch(i, args.batch, args.context, val=True)
                logits = model(x)
                val.append(
                    F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1)).item()
                )
        data.rank = rank
    v = torch.tensor([sum(val), len(val)], dtype=torch.float64)
    dist.all_reduce(v)
    val_loss = (v[0] / v[1]).item()

    counted = torch.tensor([pg.counted_bytes, pg.counted_calls], dtype=torch.float64)
    island_counted = counted.clone()
    dist.all_reduce(island_counted)
    tail = losses[-10:]
    median_step = statistics.median(times)
    summary = {
        "mode": "torchft-diloco",
        "torchft_version": tft_version,
        "device": "cpu",
        "world_size": world,
        "islands": islands,
        "ranks_per_island": g,
        "params": params,
        "steps": args.steps,
        "sync_every": args.sync_every,
        "outer_lr": args.outer_lr,
        "outer_momentum": args.outer_momentum,
        "outer_nesterov": True,
        "outer_bits": 32,
        "bf16": args.bf16,
        "bucket_mb": args.bucket_mb,
        "outer_syncs": outer_syncs,
        "outer_syncs_expected": expected,
        "final_extra_sync": final_sync,
        "outer_sync_s": sync_times,
        "initial_loss": losses[0],
        "final_loss": sum(tail) / len(tail),
        "val_loss": val_loss,
        "median_step_time_s": median_step,
        "mean_step_time_s": loop_s / args.steps,
        "tokens_per_s": tokens_per_step / median_step,
        "tokens_per_s_wall": tokens_per_step / (loop_s / args.steps),
        "outer_bytes_per_rank_counted": int(counted[0].item()),
        "outer_bytes_counted": {
            "rank0": int(counted[0].item()),
            "island": int(island_counted[0].item()),
            "job": int(island_counted[0].item()) * islands,
            "allreduce_calls_rank0": int(counted[1].item()),
            "ring_wire_estimate_per_rank": int(counted[0].item() * 2 * (islands - 1) / islands),
            "how": "bytes of the tensors each rank handed to torchft's cross-island gloo "
            "all-reduce (ProcessGroupGloo.allreduce, wrapped), f32 pseudo-gradient shards, "
            "summed over the run; payload, not wire: a ring all-reduce sends about "
            "2 (N-1)/N of it per rank (ring_wire_estimate_per_rank); torchft's gRPC to the "
            "lighthouse and manager (quorum, heartbeats every 100 ms, commits) and the gloo "
            "group's rendezvous are not counted. island: the island's ranks summed; job: "
            "island times the islands (every island sends the same)",
        },
        "checksum": {"sha256": digest, "sum": total, "after_syncs": checks},
        "losses": losses,
        "thread_cpu_s": torch_gpt.thread_cpu_s(),
    }
    if say:
        print(
            f"island {island} done: loss {summary['initial_loss']:.4f} -> "
            f"{summary['final_loss']:.4f} (last 10 steps), validation {val_loss:.4f}; "
            f"{summary['tokens_per_s']:.0f} tokens/s (median step), "
            f"{summary['mean_step_time_s']:.3f} s/step with syncs; {outer_syncs} outer syncs, "
            f"{summary['outer_bytes_per_rank_counted'] / 1e6:.3f} MB all-reduced by rank 0",
            flush=True,
        )
    if lead and args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=1)
    if metrics:
        metrics.close()
    dist.barrier()
    try:
        manager.shutdown(wait=False)
    except Exception:
        pass
    return 0


if __name__ == "__main__":
    code = main()
    # As torch_gpt.py: gloo's teardown sometimes aborts at exit; leave
    # without it once everything is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
