"""What the workers share: one "ok NAME" line per passed check on rank 0,
an AssertionError naming the rank otherwise."""

import torch.distributed as dist

import zeropp.torch as zt


def check(name, cond, detail=""):
    if not cond:
        raise AssertionError(f"rank {dist.get_rank()}: {name} failed {detail}")
    if dist.get_rank() == 0:
        print("ok", name, flush=True)


def expect_error(name, fn, match):
    """`fn` raises a ZeroppError whose message contains `match`."""
    try:
        fn()
    except zt.ZeroppError as e:
        check(name, match in str(e), f"(message: {e})")
        return
    check(name, False, "(no exception)")
