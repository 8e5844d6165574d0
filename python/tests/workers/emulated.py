"""Worker (4 ranks, logical nodes of 2): the emulated device's collectives
(ZEROPP_DEVICE=emulated) are asynchronous as a device's are: a call returns
while its work is still queued, its Work's wait orders what follows, the
result equals the host path's bit for bit, and an error found inside a
kernel after the call returned is raised by the wait, naming the rank.
Prints one "ok NAME" line per check on rank 0."""

import json
import os
import time

import torch
import torch.distributed as dist
from checks import check, expect_error

import zeropp.torch as zt
from zeropp._buffers import host_bytes


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    job = zt.job(ranks_per_node=2)
    zpp = json.loads(job.resolve_switches("zeropp", "{}"))["switches"]
    group = dist.group.WORLD
    shard = torch.randn(5000)
    grad = torch.randn(world * 5000)

    # The host path first, for reference.
    os.environ.pop("ZEROPP_DEVICE", None)
    host_out = torch.empty(world * 5000)
    zt.ZeroppAllGather(job, zpp)(host_out, shard, group)
    host_rs = zt.ZeroppReduceScatter(job, zpp)
    host_grad = torch.empty(5000)
    host_rs(host_grad, grad, group, dist.ReduceOp.AVG)

    os.environ["ZEROPP_DEVICE"] = "emulated"
    # Rank 0 calls at once, the others a second later: rank 0's call cannot
    # finish before they join, yet it returns.
    if rank != 0:
        time.sleep(1.0)
    out = torch.empty(world * 5000)
    t0 = time.monotonic()
    work = zt.ZeroppAllGather(job, zpp)(out, shard, group, async_op=True)
    returned = time.monotonic() - t0
    pending = not work.is_completed()
    check("the call returns before its work is done", rank != 0 or (pending and returned < 0.5))
    # A second call while the first still waits for the others: queued
    # behind it at once (nothing on the caller's side waits for the device).
    out2 = torch.empty(world * 5000)
    t0 = time.monotonic()
    work2 = zt.ZeroppAllGather(job, zpp)(out2, shard, group, async_op=True)
    returned = time.monotonic() - t0
    check("a second call is queued behind it at once", rank != 0 or returned < 0.5, returned)
    work.wait()
    work2.wait()
    check(
        "wait orders them: qwZ equals the host path's",
        torch.equal(out, host_out) and torch.equal(out2, host_out),
    )
    rs = zt.ZeroppReduceScatter(job, zpp)
    dev_grad = torch.empty(5000)
    rs(dev_grad, grad, group, dist.ReduceOp.AVG, async_op=True).wait()
    check("qgZ equals the host path's", torch.equal(dev_grad, host_grad))
    check(
        "both took their paths",
        zt.device_calls()["emulated"] == {"all_gather": 2, "reduce_scatter": 1},
    )
    # qwZ's references kept in host memory (qwz_host_references: a GPU's
    # stay off the device; in values, as resolving it keeps them): the
    # weights of references in values kept on the device.
    values = dict(zpp, qwz_int8_references=False)
    on_device = torch.empty(world * 5000)
    zt.ZeroppAllGather(job, values)(on_device, shard, group, async_op=True).wait()
    hosted = zt.ZeroppAllGather(job, dict(values, qwz_host_references=True))
    out3 = torch.empty(world * 5000)
    hosted(out3, shard, group, async_op=True).wait()
    check(
        "references kept in host memory gather the same weights",
        torch.equal(out3, on_device) and hosted.qwz_reference.reference_bytes() > 0,
    )

    # A group never joined (ranks 1 and 2 straddle the two logical nodes):
    # refused at the call, before anything is queued.
    cj = zt._cuda(shard.device)
    expect_error(
        "a gather over a group never joined is refused at the call",
        lambda: cj.all_gather(
            host_bytes(torch.empty(2 * 5000)),
            host_bytes(shard),
            5000,
            "float32",
            [1, 2],
            0,
            job.plan(json.dumps(zpp)),
        ),
        "add_group",
    )

    # A NaN in every rank's gradient: found by the quantize kernel after the
    # call returned, raised by the wait, with this rank named.
    bad = grad.clone()
    bad[7] = float("nan")
    work = rs(torch.empty(5000), bad, group, dist.ReduceOp.AVG, async_op=True)
    try:
        work.wait()
        raised = ""
    except zt.ZeroppError as e:
        raised = str(e)
    check(
        "a kernel's error surfaces at wait, naming the rank",
        f"rank {rank}" in raised and "finite" in raised,
        raised,
    )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
