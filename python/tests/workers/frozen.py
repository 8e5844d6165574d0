"""Worker (4 ranks, logical nodes of 2): frozen weights cross the nodes once.
A frozen base and a trainable head, each its own FSDP2 group, through
zeropp (weight differences, the default) and through zeropp's zero3 mode
(plain, exact): the base's forward gathers after the first send a byte to
the peer across and deliver exactly ZeRO-3's weights; a state-dict load
into the frozen base, and unfreezing it, are never served stale; in one
group mixing a frozen base and a trainable adapter only the adapter's
differences cross; the traffic report counts the frozen weights' bytes
apart from the trainable ones. Prints one "ok NAME" line per check on rank 0."""

import torch
import torch.distributed as dist
import torch.nn as nn
from checks import check

import zeropp.torch as zt


def model(mode):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
    m[0].requires_grad_(False)  # the frozen base
    zt.fully_shard(m[0], mode=mode, ranks_per_node=2)
    zt.fully_shard(m[2], mode=mode, ranks_per_node=2)
    zt.fully_shard(m, mode=mode, ranks_per_node=2)
    return m


class Adapted(nn.Module):
    """A frozen base with a trainable adapter beside it, in one module."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(64, 64)
        self.adapter = nn.Linear(64, 64, bias=False)
        self.base.requires_grad_(False)

    def forward(self, x):
        return self.base(x) + self.adapter(x)


def adapted(mode):
    torch.manual_seed(1)
    m = nn.Sequential(Adapted(), nn.Tanh(), nn.Linear(64, 8))
    zt.fully_shard(m[0], mode=mode, ranks_per_node=2)  # one group: base and adapter
    zt.fully_shard(m, mode=mode, ranks_per_node=2)
    return m


def across():
    """Bytes this rank's forward gathers sent across nodes: (trainable
    weights, frozen weights) as the traffic report splits them."""
    t = zt.traffic()
    return t["forward_gather"]["total"]["inter_node"], t["frozen"]["total"]["inter_node"]


def forward_bytes():
    return sum(across())


def main():
    dist.init_process_group("gloo")
    zpp, z3 = model("zeropp"), model("zero3")
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(dist.get_rank()))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (zpp, z3)]
    crossed = []
    split = []
    same = []
    for _ in range(4):
        # A step through the root (FSDP2 initializes there), then the base
        # alone: what its forward gather sends across.
        for m, opt in zip((zpp, z3), opts, strict=True):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        before = across()
        with torch.no_grad():
            base = zpp[0](x)
        split.append(tuple(b - a for a, b in zip(before, across(), strict=True)))
        crossed.append(sum(split[-1]))
        with torch.no_grad():
            same.append(torch.equal(base, z3[0](x)))
    check("a frozen base gathers ZeRO-3's weights, bit for bit", all(same), f"{same}")
    check(
        "after its first gather a frozen base sends a byte across per gather",
        crossed == [1, 1, 1, 1],
        f"{crossed}",
    )
    check(
        "the traffic report counts a frozen base's bytes as frozen",
        split == [(0, 1)] * 4,
        f"{split}",
    )

    # A load into the frozen base (every rank alike) is sent again.
    with torch.no_grad():
        for m in (zpp, z3):
            local = m[0].weight.to_local()
            local.copy_(local * 2 + 0.01)
    with torch.no_grad():
        loaded = torch.equal(zpp[0](x), z3[0](x))
        stays = torch.equal(zpp[0](x), z3[0](x))
    check("a frozen weight that was loaded is gathered anew, never stale", loaded and stays)

    # What zeropp keeps beside FSDP2: the references of each group's cross
    # group (2 nodes x a shard) — the frozen base's cache, in f32 values,
    # and the trainable head's, in int8 blocks of 64 (a byte a value, 4
    # bytes a block) — and the head's error feedback; nothing in zero3 mode.
    kept, kept3 = zt.kept_bytes(zpp), zt.kept_bytes(z3)
    base, head = (64 * 64 + 64) // 4, (8 * 64 + 8) // 4  # one rank's shards
    references = 2 * 4 * base + 2 * (head + 4 * -(-head // 64))
    check(
        "kept_bytes reports the references (the frozen cache) and the residuals",
        kept["qwz_references"] == references
        and kept["qgz_residuals"] > 0
        and kept["total"] == kept["qwz_references"] + kept["qgz_residuals"]
        and kept3["total"] == 0,
        f"{kept} {kept3}",
    )

    # Unfrozen, it trains like any weight (qwZ's differences, not exact).
    for m in (zpp, z3):
        m[0].requires_grad_(True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (zpp, z3)]
    for _ in range(3):
        for m, opt in zip((zpp, z3), opts, strict=True):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    with torch.no_grad():
        err = (zpp[0](x) - z3[0](x)).abs().max().item()
    check("an unfrozen base trains and is gathered as it moves", 0 < err < 5e-2, f"{err}")

    # One FSDP2 group mixing a frozen base and a trainable adapter (what a
    # LoRA decoder layer becomes under the Trainer's wrapping): only the
    # adapter's differences cross after the first gather.
    mixed = [adapted(mode) for mode in ("zeropp", "zero3")]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in mixed]
    crossed, split = [], []
    for _ in range(4):
        for i, (m, opt) in enumerate(zip(mixed, opts, strict=True)):
            before = across()
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if i == 0:
                split.append(tuple(b - a for a, b in zip(before, across(), strict=True)))
                crossed.append(sum(split[-1]))
    trainable = 64 * 64 // dist.get_world_size()  # the adapter's shard
    # A refresh first (the whole shard, bf16 or f32); then a byte and the
    # adapter's int4 differences (about half a byte a value).
    check(
        "a mixed group sends only its trainable part's differences after the first gather",
        crossed[0] > trainable and all(0 < c < 0.6 * trainable + 64 for c in crossed[1:]),
        f"{crossed}",
    )
    frozen_part = 64 * 64 + 64  # the base's weight and bias: a shard of them
    sent_frozen = [f for _, f in split]
    check(
        "a mixed group's frozen part is counted as frozen: one crossing, then a byte",
        sent_frozen[0] >= 2 * frozen_part // dist.get_world_size()
        and sent_frozen[1:] == [1, 1, 1]
        and all(t > 1 for t, _ in split),
        f"{split}",
    )
    full = []
    for m in mixed:
        m[0].unshard()
        full.append((m[0].base.weight.detach().clone(), m[0].adapter.weight.detach().clone()))
        m[0].reshard()
    (zb, za), (b3, a3) = full
    check(
        "the frozen part of a mixed group is gathered exactly, the trainable part closely",
        torch.equal(zb, b3) and 0 < (za - a3).abs().max().item() < 1e-2,
        f"{(za - a3).abs().max().item()}",
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
