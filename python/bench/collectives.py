"""FSDP2's two collectives, timed as FSDP2 calls them: zeropp.torch's
all-gather and reduce-scatter (``mode`` zero3: plain; zeropp: qwZ/qgZ)
against gloo's ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` on the
same tensors, in the same run. One line per size and collective, with the
ratio zeropp / gloo (below 1: zeropp faster).

    torchrun --standalone --nproc-per-node 4 python/bench/collectives.py \\
        --ranks-per-node 4 --sizes 163840,655360 --dtype float32
"""

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

import zeropp.torch as zt


def timed(fn, reps):
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _calls(n, world, dtype, gather, scatter):
    """Each collective on shards of `n` values: (zeropp's call, gloo's), and
    the megabytes of the gathered tensor."""
    shard = torch.randn(n).to(dtype)
    full = torch.empty(world * n, dtype=dtype)
    grad = torch.randn(world * n).to(dtype)
    out = torch.empty(n, dtype=dtype)
    group, avg = dist.group.WORLD, dist.ReduceOp.AVG
    calls = {
        "all_gather": (
            lambda: gather(full, shard, group),
            lambda: dist.all_gather_into_tensor(full, shard),
        ),
        "reduce_scatter": (
            lambda: scatter(out, grad, group, avg),
            lambda: dist.reduce_scatter_tensor(out, grad, op=avg),
        ),
    }
    return calls, full.numel() * full.element_size() / 1e6


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="16384,163840,655360", help="values per shard")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--ranks-per-node", type=int, default=None)
    p.add_argument("--mode", default="zero3", choices=["zero3", "zeropp"])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None, help="write the rows here (rank 0)")
    p.add_argument(
        "--only",
        default=None,
        choices=["zeropp", "gloo"],
        help="run one side's calls only (for a profile of it: perf record -g -- torchrun ...)",
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    job = zt.job(ranks_per_node=args.ranks_per_node)
    switches = json.loads(job.resolve_switches(args.mode, "{}"))["switches"]
    gather = zt.ZeroppAllGather(job, switches)
    scatter = zt.ZeroppReduceScatter(job, switches)
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        calls, mb = _calls(n, world, dtype, gather, scatter)
        times = {}
        for name, (zpp, gloo) in calls.items():
            if args.only == "zeropp":
                gloo = zpp
            elif args.only == "gloo":
                zpp = gloo
            for _ in range(3):  # warm up both
                gloo()
                zpp()
            times[name] = (timed(zpp, args.reps), timed(gloo, args.reps))
        for name, (z, g) in times.items():
            rows.append(
                {"collective": name, "values_per_shard": n, "mb": mb, "zeropp_s": z, "gloo_s": g}
            )
            if rank == 0:
                print(
                    f"{name:>14} {n:>8} x{world} {args.dtype} ({mb:6.2f} MB): "
                    f"zeropp {z * 1e3:8.3f} ms  gloo {g * 1e3:8.3f} ms  ratio {z / g:5.2f}",
                    flush=True,
                )
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"mode": args.mode, "transport": job.transport, "rows": rows}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
