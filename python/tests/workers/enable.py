"""Worker (4 ranks, logical nodes of 2): zeropp.torch.enable on models that
plain FSDP2 sharded — idempotent, hpZ installed where FSDP2 reshards, and
what it cannot serve refused by name. Prints one "ok NAME" line per check
on rank 0."""

import torch
import torch.distributed as dist
import torch.nn as nn
from checks import check, expect_error
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import zeropp.torch as zt


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


def groups(m):
    return [
        g
        for s in m.modules()
        if hasattr(s, "_get_fsdp_state")
        for g in s._get_fsdp_state()._fsdp_param_groups
    ]


def post_forward_sizes(m):
    return [
        g.post_forward_mesh_info.shard_mesh_size if g.post_forward_mesh_info else None
        for g in groups(m)
    ]


def main():
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    zt.job(ranks_per_node=2)
    mesh = init_device_mesh("cpu", (world,))

    expect_error(
        "a model FSDP2 never sharded is refused", lambda: zt.enable(model()), "fully_shard"
    )

    m = model()
    fully_shard(m[0], mesh=mesh)
    fully_shard(m[2], mesh=mesh)
    fully_shard(m, mesh=mesh)
    zt.enable(m, mode="zeropp", qgz_intra_bits=4)
    comms = [(g._all_gather_comm, g._reduce_scatter_comm) for g in groups(m)]
    check(
        "every FSDP2 module gets zeropp's collectives",
        all(
            isinstance(a, zt.ZeroppAllGather) and isinstance(r, zt.ZeroppReduceScatter)
            for a, r in comms
        ),
    )
    # hpZ with the mode's weight differences: qwZ's references are the
    # secondary shard, so FSDP2 keeps no second copy after forward (the
    # blocks reshard to the whole mesh; the root stays unsharded).
    sizes = post_forward_sizes(m)
    check("hpZ keeps no second copy beside the references", sizes.count(2) == 0, f"{sizes}")
    # Without weight differences (DeepSpeed's ZeRO++) the blocks reshard
    # after forward to the node (2 ranks).
    int8 = model()
    for b in (int8[0], int8[2], int8):
        fully_shard(b, mesh=mesh)
    zt.enable(int8, mode="zeropp", qwz_delta=False, qwz_bits=8)
    sizes = post_forward_sizes(int8)
    check("hpZ reshards the blocks to the node", sizes.count(2) == 2, f"{sizes}")
    zt.enable(m, mode="zeropp", qgz_intra_bits=4)
    again = [(g._all_gather_comm, g._reduce_scatter_comm) for g in groups(m)]
    check(
        "enable twice with the same settings changes nothing (error feedback kept)",
        all(a is b for x, y in zip(comms, again, strict=True) for a, b in zip(x, y, strict=True)),
    )
    zt.enable(m, mode="zero3")
    other = [g._reduce_scatter_comm for g in groups(m)]
    check(
        "other settings are installed",
        all(o is not c[1] for o, c in zip(other, comms, strict=True)),
    )
    x = torch.randn(8, 16)
    m(x).square().mean().backward()
    check("the enabled model trains a step", all(p.grad is not None for p in m.parameters()))

    # What the frameworks log: bytes since the previous entry, per hop and
    # phase; the Trainer callback adds the same to a log entry.
    log = zt.TrafficLog()
    first = log()
    m(x).square().mean().backward()
    step = log()
    idle = log()
    phases = ("forward_gather", "backward_gather", "gradient")
    check(
        "the traffic log counts a step's bytes since the previous entry, by phase",
        # (in a ring some ranks send only inside their node)
        all(
            step[f"zeropp/{p}/intra_node_bytes"] + step[f"zeropp/{p}/inter_node_bytes"] > 0
            for p in phases
        )
        and step["zeropp/intra_node_bytes"] <= first["zeropp/intra_node_bytes"]
        and set(idle.values()) == {0},
        f"{first} then {step} then {idle}",
    )
    callback = zt.trainer_callback()
    logs = {"loss": 1.0}
    callback.on_log(None, None, None, logs=logs)
    check(
        "the Trainer callback adds zeropp's bytes to a log entry",
        logs["loss"] == 1.0 and "zeropp/inter_node_bytes" in logs,
        f"{logs}",
    )

    expect_error("unknown switches are refused", lambda: zt.enable(m, qwz=8), "qwz_bits")
    # fully_shard's own keywords: a misspelled switch is named (not FSDP2's
    # TypeError), a sharded model points to enable, and what FSDP2 would
    # gather or reduce in a dtype zeropp does not move is refused up front.
    expect_error(
        "fully_shard names a misspelled switch",
        lambda: zt.fully_shard(model(), mesh=mesh, qwz_bit=4),
        "did you mean 'qwz_bits'",
    )
    expect_error(
        "fully_shard of a model FSDP2 sharded points to enable",
        lambda: zt.fully_shard(m, mesh=mesh),
        "zeropp.torch.enable",
    )
    twice = model()
    zt.fully_shard(twice, mesh=mesh)
    expect_error(
        "fully_shard twice names the module's own class and says to shard once",
        lambda: zt.fully_shard(twice, mesh=mesh),
        "this Sequential is sharded by zeropp.torch.fully_shard already",
    )
    ddp = torch.nn.parallel.DistributedDataParallel(model())
    expect_error(
        "enable on a DDP model (a framework's fallback on CPU ranks) says so",
        lambda: zt.enable(ddp),
        "wrapped in DistributedDataParallel",
    )
    expect_error(
        "fully_shard of what is not a module says what it takes",
        lambda: zt.fully_shard("model", mesh=mesh),
        "takes a torch.nn.Module, not str",
    )
    half = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    expect_error(
        "float64 parameters cast to bf16 still need a reduce dtype zeropp moves",
        lambda: zt.fully_shard(model().double(), mesh=mesh, mp_policy=half),
        "reduce_dtype=torch.float32",
    )
    counted = model()
    counted.register_parameter("count", nn.Parameter(torch.zeros(2, dtype=torch.int64), False))
    expect_error(
        "an integer parameter is refused, pointing to a buffer",
        lambda: zt.fully_shard(counted, mesh=mesh, mp_policy=half),
        "register_buffer",
    )
    # HSDP's mesh: enable serves it, the replicate all-reduce included, and
    # gives the gradients of plain HSDP (zero3: the same sums).
    plain, served = model(), model()
    mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    for net in (plain, served):
        fully_shard(net[0], mesh=mesh2)
        fully_shard(net, mesh=mesh2)
    zt.enable(served, mode="zero3")
    before = zt.traffic()["replicate"]["total"]["inter_node"]
    torch.manual_seed(1 + dist.get_rank())
    x = torch.randn(8, 16)
    for net in (plain, served):
        net(x).square().mean().backward()
    grads = [
        (a.grad.to_local() - b.grad.to_local()).abs().max().item()
        for a, b in zip(plain.parameters(), served.parameters(), strict=True)
    ]
    check(
        "enable serves HSDP's mesh: its all-reduce across nodes through zeropp, HSDP's gradients",
        max(grads) <= 1e-6 and zt.traffic()["replicate"]["total"]["inter_node"] > before,
        f"{grads}",
    )
    # The collectives reuse their buffers: after the first steps a gather
    # or a reduce-scatter takes every buffer from the pool (a per-call
    # allocation would show once per call: dozens a step).
    torch.manual_seed(2)
    net = nn.Sequential(*[nn.Linear(128, 128) for _ in range(4)])
    for layer in net:
        zt.fully_shard(layer, ranks_per_node=2)
    zt.fully_shard(net, ranks_per_node=2)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    x = torch.randn(8, 128)
    stats = []
    for _ in range(12):
        net(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        stats.append(zt.scratch_stats())
    taken = stats[-1]["taken"] - stats[3]["taken"]
    allocated = stats[-1]["allocated"] - stats[3]["allocated"]
    check(
        "after the first steps the collectives allocate no buffer",
        taken >= 80 and allocated < 8 and zt.kept_bytes(net)["scratch"] > 0,
        f"(steps 4-12 took {taken} buffers and allocated {allocated}: {stats[3]} -> {stats[-1]})",
    )
    hsdp = model()
    mesh2 = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    fully_shard(hsdp, mesh=mesh2)
    expect_error("an HSDP mesh that shards nothing is refused", lambda: zt.enable(hsdp), "1 rank")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
