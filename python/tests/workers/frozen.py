"""Worker (4 ranks, logical nodes of 2): frozen weights cross the nodes once.
A frozen base and a trainable head, each its own FSDP2 group, through
zeropp (weight differences, the default) and through zeropp's zero3 mode
(plain, exact): the base's forward gathers after the first send a byte to
the peer across and deliver exactly ZeRO-3's weights; a state-dict load
into the frozen base, and unfreezing it, are never served stale. Prints
one "ok NAME" line per check on rank 0."""

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


def forward_bytes():
    return zt.traffic()["forward_gather"]["total"]["inter_node"]


def main():
    dist.init_process_group("gloo")
    zpp, z3 = model("zeropp"), model("zero3")
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(dist.get_rank()))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (zpp, z3)]
    crossed = []
    same = []
    for _ in range(4):
        # A step through the root (FSDP2 initializes there), then the base
        # alone: what its forward gather sends across.
        for m, opt in zip((zpp, z3), opts, strict=True):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        before = forward_bytes()
        with torch.no_grad():
            base = zpp[0](x)
        crossed.append(forward_bytes() - before)
        with torch.no_grad():
            same.append(torch.equal(base, z3[0](x)))
    check("a frozen base gathers ZeRO-3's weights, bit for bit", all(same), f"{same}")
    check(
        "after its first gather a frozen base sends a byte across per gather",
        crossed == [1, 1, 1, 1],
        f"{crossed}",
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
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
