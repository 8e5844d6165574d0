"""Worker (4 ranks, logical nodes of 2): zeropp.torch.init_islands, each
island of 2 ranks a torch.distributed world of its own. The default group
is the island's; OuterSync over the island's 1-D mesh syncs the islands
over a zeropp job of every island's ranks; the islands end with one model;
each island's checkpoint (its own directory) round-trips through
torch.distributed.checkpoint. Prints one "ok NAME" line per check on the
island's first rank."""

import math
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from checks import check, expect_error
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

import zeropp.torch as zt

H = 4


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))


def shard(net, mesh):
    for m in (net[0], net[2], net):
        zt.fully_shard(m, mode="zeropp", mesh=mesh)
    return net


def outer(net, mesh):
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    # f32 deltas: no error feedback for a resume to lose.
    return zt.OuterSync(net, opt, mesh, sync_every=H, bits=None, ranks_per_node=2)


def train(net, opt, island, steps):
    g = torch.Generator().manual_seed(100 + island)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
        loss = (net(x) - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def weights(net):
    return torch.cat([p.to_local().detach().reshape(-1) for p in net.parameters()])


def main():
    island = zt.init_islands("gloo", islands=2)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    check(
        "each island is a world of its own",
        dist.get_world_size() == 2 and island.world == 4 and island.count == 2,
        f"({island})",
    )
    zt.job(ranks_per_node=2)
    net = shard(model(), mesh)
    sync = outer(net, mesh)
    losses = train(net, sync, island.index, 3 * H + 1)
    sync.finish()
    # The islands' weights, compared through the job-wide store.
    store = dist.PrefixStore("test/weights", island.store)
    mine = weights(net)
    store.set(f"{island.rank}", mine.numpy().tobytes())
    other = (island.rank + 2) % 4
    store.wait([f"{other}"])
    theirs = torch.frombuffer(bytearray(store.get(f"{other}")), dtype=torch.float32)
    check(
        "the islands end with one model",
        torch.equal(mine, theirs) and all(map(math.isfinite, losses)),
        f"(losses {losses[0]:.4f} -> {losses[-1]:.4f})",
    )
    outer_bytes = zt.traffic()["outer"]["total"]
    check(
        "the outer sync crosses between the islands' nodes, counted by traffic()",
        outer_bytes["inter_node"] > 0 and outer_bytes["intra_node"] == 0,
        f"({outer_bytes})",
    )
    # DCP over the island's world: each island saves into its own
    # directory; loaded into a fresh copy (other weights, no outer state),
    # both train on alike.
    root = f"{sys.argv[1]}/island{island.index}"
    msd, osd = get_state_dict(net, sync.optimizer)
    dcp.save({"model": msd, "optim": osd, "outer": sync.state_dict()}, checkpoint_id=root)
    fresh = shard(model(seed=1), mesh)
    fsync = outer(fresh, mesh)
    msd, osd = get_state_dict(fresh, fsync.optimizer)
    state = {"model": msd, "optim": osd, "outer": fsync.state_dict()}
    dcp.load(state, checkpoint_id=root)
    set_state_dict(
        fresh, fsync.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    fsync.load_state_dict(state["outer"])
    again = train(net, sync, island.index, H)
    resumed = train(fresh, fsync, island.index, H)
    check(
        "an island's checkpoint round-trips through torch.distributed.checkpoint",
        again == resumed and fsync.steps == sync.steps,
        f"({again[-1]:.6f} vs {resumed[-1]:.6f})",
    )
    sync.finish()
    fsync.finish()
    expect_error(
        "a 2-D mesh under init_islands is refused",
        lambda: zt.OuterSync(
            net, None, init_device_mesh("cpu", (1, 2), mesh_dim_names=("a", "b")), sync_every=H
        ),
        "1-D mesh",
    )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
