"""Worker (4 ranks, logical nodes of 2): zeropp.torch.enable on models that
plain FSDP2 sharded — idempotent, hpZ installed where FSDP2 reshards, and
what it cannot serve refused by name. Prints one "ok NAME" line per check
on rank 0."""

import torch
import torch.distributed as dist
import torch.nn as nn
from checks import check, expect_error
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

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
    # hpZ: the blocks reshard after forward to the node (2 ranks); the root
    # (FSDP2 keeps it unsharded after forward) stays as it was.
    sizes = [
        g.post_forward_mesh_info.shard_mesh_size if g.post_forward_mesh_info else None
        for g in groups(m)
    ]
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

    expect_error("unknown switches are refused", lambda: zt.enable(m, qwz=8), "qwz_bits")
    hsdp = model()
    mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    fully_shard(hsdp, mesh=mesh2)
    expect_error("an HSDP (2-D) mesh is refused", lambda: zt.enable(hsdp), "2-D mesh")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
