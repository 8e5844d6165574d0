"""Worker (4 ranks, logical nodes of 2: two islands of one node each):
zeropp.torch.OuterSync, DiLoCo's outer step over shards. With zeropp's ZeRO-3
inside each island and f32 outer deltas it trains as FSDP2 per island plus
the same outer step written in torch; with int4 outer deltas the islands
stay identical. Prints one "ok NAME" line per check on rank 0."""

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from checks import check, expect_error
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import zeropp.torch as zt

H, ROUNDS = 4, 3


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))


def shard(net, mesh, zeropp):
    for m in (net[0], net[2], net):
        if zeropp:
            zt.fully_shard(m, mode="zero3", mesh=mesh["shard"])
        else:
            fully_shard(m, mesh=mesh["shard"])


def f32_sync(net, mesh):
    """OuterSync with f32 deltas and DiLoCo's outer optimizer (the torch
    reference's) around AdamW."""
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    return zt.OuterSync(net, opt, mesh, sync_every=H, lr=0.7, momentum=0.9, bits=None)


def batches(island):
    g = torch.Generator().manual_seed(100 + island)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)) for _ in range(H)]


def local(p):
    return p.to_local().data


def train(net, opt, island, outer):
    losses = []
    for _ in range(ROUNDS):
        for x, y in batches(island):
            loss = (net(x) - y).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        outer()
    return losses


def step(net, opt, x, y):
    loss = (net(x) - y).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


class EagerStreamed:
    """The streamed outer step written in torch (f32, 2 islands): fragment
    f of 2 starts at the steps that are f·H/2 mod H: the island's delta from
    the anchor, its weights set to the outer step on that delta alone
    (Nesterov, lr 0.7, momentum 0.9: the eager update), the delta averaged
    over the islands; a step later the outer step on the average moves the
    anchor and the weights become it plus what the island trained since
    the eager update."""

    LR, MU = 0.7, 0.9

    def __init__(self, net, inner, islands):
        self.inner, self.islands, self.steps = inner, islands, 0
        self.params = list(net.parameters())
        self.frags = [[0, 1], [2, 3]]
        self.anchors = [local(p).clone() for p in self.params]
        self.momenta = [torch.zeros_like(a) for a in self.anchors]
        self.pending = {}

    def zero_grad(self):
        self.inner.zero_grad()

    def update(self, i, g):
        return g + self.MU * (self.MU * self.momenta[i] + g)

    def start(self, f):
        flights = []
        for i in self.frags[f]:
            w = local(self.params[i])
            d = self.anchors[i] - w
            w.copy_(self.anchors[i] - self.LR * self.update(i, d))
            avg = d.clone()
            dist.all_reduce(avg, group=self.islands)
            flights.append((i, w.clone(), avg / 2))
        self.pending[f] = (self.steps + 1, flights)

    def land(self, f):
        _, flights = self.pending.pop(f)
        for i, then, avg in flights:
            self.momenta[i].mul_(self.MU).add_(avg)
            self.anchors[i].sub_(self.LR * (avg + self.MU * self.momenta[i]))
            w = local(self.params[i])
            w.copy_(self.anchors[i] + (w - then))

    def step(self):
        self.inner.step()
        self.steps += 1
        for f, (due, _) in list(self.pending.items()):
            if due == self.steps:
                self.land(f)
        for f in range(2):
            if self.steps % H == (f * H // 2) % H:
                self.start(f)

    def finish(self):
        """Lands what is under way, then one waited outer step of all."""
        for f in list(self.pending):
            self.land(f)
        for f in range(2):
            self.start(f)
            self.land(f)


def main():
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    zt.job(ranks_per_node=2)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("island", "shard"))
    island = mesh.get_local_rank(0)

    # zeropp: ZeRO-3 inside each island, f32 outer deltas.
    ours = model()
    shard(ours, mesh, zeropp=True)
    sync = f32_sync(ours, mesh)
    ran = []
    losses = train(ours, sync, island, lambda: ran.append(sync.steps % H == 0))

    # The reference: FSDP2 per island, the outer step in torch.
    ref = model()
    shard(ref, mesh, zeropp=False)
    inner = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    anchors = [local(p).clone() for p in ref.parameters()]
    momenta = [torch.zeros_like(a) for a in anchors]
    islands = mesh.get_group(0)

    def outer_step():
        for p, a, m in zip(ref.parameters(), anchors, momenta, strict=True):
            delta = a - local(p)
            dist.all_reduce(delta, group=islands)
            delta /= 2
            m.mul_(0.9).add_(delta)
            a.sub_(0.7 * (delta + 0.9 * m))
            local(p).copy_(a)

    expected = train(ref, inner, island, outer_step)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, expected, strict=True))
    check(
        "f32 outer deltas: FSDP2 per island plus DiLoCo's outer step, within 1e-5",
        worst <= 1e-5 and all(ran),
        f"(largest relative loss difference {worst:.3g})",
    )
    # HSDP's mesh, as Accelerate's ParallelismConfig and the Trainer shard
    # islands: FSDP2 (or zeropp) over the whole (islands, ranks) mesh, and
    # OuterSync (its mesh the parameters' own) turns the all-reduce across
    # the replicas off: each replica trains as an island, the reference's
    # losses.
    for inside in ("FSDP2", "zeropp zero3"):
        h = model()
        for m in (h[0], h[2], h):
            if inside == "FSDP2":
                fully_shard(m, mesh=mesh)
            else:
                zt.fully_shard(m, mode="zero3", mesh=mesh)
        hopt = torch.optim.AdamW(h.parameters(), lr=1e-2)
        hsync = zt.OuterSync(h, hopt, sync_every=H, lr=0.7, momentum=0.9, bits=None)
        hlosses = train(h, hsync, island, lambda: None)
        worst = max(abs(a - b) / abs(b) for a, b in zip(hlosses, expected, strict=True))
        check(
            f"HSDP's mesh, {inside} inside: each replica an island, the reference within 1e-5",
            worst <= 1e-5 and hsync.replicas_apart == 2 and hsync.syncs == ROUNDS,
            f"(largest relative loss difference {worst:.3g}, {hsync.replicas_apart} groups)",
        )
    weights = torch.cat([local(p).reshape(-1) for p in ours.parameters()])
    ref_weights = torch.cat([local(p).reshape(-1) for p in ref.parameters()])
    check(
        "the outer step leaves the reference's weights",
        torch.allclose(weights, ref_weights, rtol=1e-5, atol=1e-7),
    )
    check(
        "the outer state is an anchor and a momentum per shard",
        sync.state_bytes() >= 2 * 4 * weights.numel(),
        f"({sync.state_bytes()} bytes for {weights.numel()} values)",
    )

    # int4 outer deltas with error feedback: the islands stay identical.
    q = model()
    shard(q, mesh, zeropp=True)
    qsync = zt.OuterSync(q, torch.optim.AdamW(q.parameters(), lr=1e-2), mesh, sync_every=H)
    qlosses = train(q, qsync, island, lambda: None)
    mine = torch.cat([local(p).reshape(-1) for p in q.parameters()])
    theirs = [torch.empty_like(mine) for _ in range(2)]
    dist.all_gather(theirs, mine, group=islands)
    check(
        "int4 outer deltas: every island holds the same anchor",
        torch.equal(theirs[0], theirs[1]) and qlosses[-1] < qlosses[0],
        f"(losses {qlosses[0]:.4f} -> {qlosses[-1]:.4f})",
    )
    outer = zt.traffic()["outer"]["total"]
    check(
        "the outer sync's bytes are their own phase, across nodes",
        outer["inter_node"] > 0 and outer["intra_node"] == 0,
        f"{outer}",
    )
    # DCP: each island's model and inner optimizer (under its own key:
    # islands differ between syncs, and their AdamW states always) and the
    # outer state (the same on every island), loaded into a fresh copy
    # (other weights, no outer state): both train on alike (f32 deltas: no
    # error feedback to lose).
    root = sys.argv[1]
    key = f"island{sync.island}"
    msd, osd = get_state_dict(ours, sync.optimizer)
    dcp.save({key: {"model": msd, "optim": osd}, "outer": sync.state_dict()}, checkpoint_id=root)
    torch.manual_seed(1)
    fresh = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))
    shard(fresh, mesh, zeropp=True)
    fsync = f32_sync(fresh, mesh)
    msd, osd = get_state_dict(fresh, fsync.optimizer)
    state = {key: {"model": msd, "optim": osd}, "outer": fsync.state_dict()}
    dcp.load(state, checkpoint_id=root)
    mine = state[key]
    set_state_dict(
        fresh, fsync.optimizer, model_state_dict=mine["model"], optim_state_dict=mine["optim"]
    )
    fsync.load_state_dict(state["outer"])
    again = train(ours, sync, island, lambda: None)
    resumed = train(fresh, fsync, island, lambda: None)
    check(
        "OuterSync's state round-trips through torch.distributed.checkpoint",
        again == resumed and fsync.steps == sync.steps,
        f"({again[-1]:.6f} vs {resumed[-1]:.6f})",
    )
    # Streamed: 2 fragments (the first layer, the second) staggered by
    # H/2, each landing a step after it starts, the island training on from
    # the outer step on its own delta meanwhile (f32 deltas): FSDP2 per
    # island plus eager streamed DiLoCo written in torch; the islands end
    # identical; a checkpoint taken with an exchange under way resumes it.
    s_net = model()
    shard(s_net, mesh, zeropp=True)
    s_opt = torch.optim.AdamW(s_net.parameters(), lr=1e-2)
    kw = dict(sync_every=H, lr=0.7, momentum=0.9, bits=None, fragments=2, delay=1)
    ssync = zt.OuterSync(s_net, s_opt, mesh, **kw)
    r_net = model()
    shard(r_net, mesh, zeropp=False)
    reference = EagerStreamed(r_net, torch.optim.AdamW(r_net.parameters(), lr=1e-2), islands)
    data = [b for _ in range(ROUNDS) for b in batches(island)]
    got, want = [], []
    for x, y in data:
        got.append(step(s_net, ssync, x, y))
        want.append(step(r_net, reference, x, y))
    ssync.finish()
    reference.finish()
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))
    mine = torch.cat([local(p).reshape(-1) for p in s_net.parameters()])
    theirs = [torch.empty_like(mine) for _ in range(2)]
    dist.all_gather(theirs, mine, group=islands)
    ref_w = torch.cat([local(p).reshape(-1) for p in r_net.parameters()])
    check(
        "streamed (2 fragments, delay 1): eager streamed DiLoCo in torch, within 1e-5",
        worst <= 1e-5 and torch.allclose(mine, ref_w, rtol=1e-5, atol=1e-6),
        f"(largest relative loss difference {worst:.3g})",
    )
    check("streamed: every island ends with one model", torch.equal(theirs[0], theirs[1]))
    # A save right after step 2 (fragment 1's exchange under way), loaded
    # into a fresh copy: both go on alike.
    a_net, b_net = model(), model()
    for n in (a_net, b_net):
        shard(n, mesh, zeropp=True)
    a_sync = zt.OuterSync(a_net, torch.optim.AdamW(a_net.parameters(), lr=1e-2), mesh, **kw)
    b_sync = zt.OuterSync(b_net, torch.optim.AdamW(b_net.parameters(), lr=1e-2), mesh, **kw)
    check(
        "two outer syncs over the same islands name their exchanges apart",
        a_sync._islands is b_sync._islands and a_sync._name(0) != b_sync._name(0),
        f"({a_sync._name(0)} and {b_sync._name(0)})",
    )
    for x, y in data[:2]:
        step(a_net, a_sync, x, y)
    under_way = bool(a_sync._pending)
    msd, osd = get_state_dict(a_net, a_sync.optimizer)
    dcp.save(
        {key: {"model": msd, "optim": osd}, "outer": a_sync.state_dict()}, checkpoint_id=root + "-s"
    )
    msd, osd = get_state_dict(b_net, b_sync.optimizer)
    state = {key: {"model": msd, "optim": osd}, "outer": b_sync.state_dict()}
    dcp.load(state, checkpoint_id=root + "-s")
    set_state_dict(
        b_net,
        b_sync.optimizer,
        model_state_dict=state[key]["model"],
        optim_state_dict=state[key]["optim"],
    )
    b_sync.load_state_dict(state["outer"])
    a_rest = [step(a_net, a_sync, x, y) for x, y in data[2:]]
    b_rest = [step(b_net, b_sync, x, y) for x, y in data[2:]]
    check(
        "streamed: a checkpoint with an exchange under way resumes it",
        under_way and a_rest == b_rest,
        f"(under way: {under_way}; {a_rest[-1]:.6f} vs {b_rest[-1]:.6f})",
    )
    expect_error(
        "an outer state of another model is refused",
        lambda: fsync.load_state_dict({"steps": 0, "anchors": {}, "momenta": {}}),
        "another model",
    )
    expect_error(
        "a mesh that is not (islands, ranks) is refused",
        lambda: zt.OuterSync(q, qsync.optimizer, mesh["shard"]),
        "(islands, ranks)",
    )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
