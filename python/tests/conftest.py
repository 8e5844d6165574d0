"""Shared helpers: the zeropp binary, and jobs of real processes: under
torchrun (``python -m torch.distributed.run``), or started directly with the
environment torchrun gives its workers."""

import copy
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent / "workers"
EXAMPLE = ROOT / "examples" / "torch_gpt.py"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def zeropp_bin():
    """The zeropp command-line tool of this checkout (built by the Rust
    tests before the Python ones run)."""
    path = Path(os.environ.get("ZEROPP_BIN", ROOT / "target" / "debug" / "zeropp"))
    if not path.exists():
        pytest.fail(
            f"{path} does not exist: run `cargo build --bin zeropp` first "
            "(scripts/test.sh builds it with the Rust tests), or set ZEROPP_BIN"
        )
    return str(path)


def torchrun(script, args=(), nproc=4, env=None, timeout=600, check=True):
    """Runs ``script`` on ``nproc`` local ranks under torchrun; returns the
    completed process (stdout and stderr captured)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script),
        *map(str, args),
    ]
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    e.update(env or {})
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e)
    if check and p.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {p.returncode}\n--- stdout\n{p.stdout[-4000:]}"
            f"\n--- stderr\n{p.stderr[-8000:]}"
        )
    return p


def rank_env(rank, world, port, **extra):
    """Rank ``rank``'s environment as torchrun gives it to its workers (one
    node of ``world`` ranks, torch's store on ``port``), plus ``extra``."""
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    e.update(extra)
    e.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    return e


def ranks(script, args=(), nproc=4, env=None, timeout=600, check=True, grace=10):
    """Runs ``script`` on ``nproc`` local ranks started directly, each with
    the environment torchrun gives its workers (``rank_env``): rank 0 hosts
    torch's store. torchrun's agent would import torch once more per job,
    a fifth of a short job on 2 cores; the recipes' tests run under
    torchrun and ``accelerate launch`` themselves. As torchrun does, a rank
    that fails stops the others (after ``grace`` seconds, for their own
    errors). Returns a completed process: the exit code of the first rank
    that failed (0 if none), every rank's stdout with rank 0's last (its
    summary line ends it), every rank's stderr with the first failed rank's
    last."""
    cmd = [sys.executable, str(script), *map(str, args)]
    port = free_port()
    outs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in range(nproc)]
    procs, first, timed_out = [], None, False

    def failed_rank():
        return next((r for r, p in enumerate(procs) if p.poll()), None)

    try:
        for r, (o, e) in enumerate(outs):
            e_r = rank_env(r, nproc, port, **(env or {}))
            procs.append(subprocess.Popen(cmd, env=e_r, stdout=o, stderr=e, text=True))
        start = failed = time.monotonic()
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if first is None:
                first, failed = failed_rank(), now
            if first is not None and now - failed > grace:
                break
            if now - start > timeout:
                timed_out = True
                break
            time.sleep(0.05)
        first = failed_rank() if first is None else first
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    texts = []
    for o, e in outs:
        o.seek(0)
        e.seek(0)
        texts.append((o.read(), e.read()))
        o.close()
        e.close()
    stdout = "".join(t[0] for t in texts[1:]) + texts[0][0]
    last = first if first is not None else nproc - 1
    order = [r for r in range(nproc) if r != last] + [last]
    stderr = "".join(texts[r][1] for r in order)
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
    codes = [p.returncode for p in procs]
    code = codes[first] if first is not None else 0
    if check and code != 0:
        raise AssertionError(
            f"{' '.join(cmd)}: rank {first} of {nproc} exited {code} (every rank: {codes})"
            f"\n--- stdout\n{stdout[-4000:]}\n--- stderr (rank {first}'s last)\n{stderr[-8000:]}"
        )
    return subprocess.CompletedProcess(cmd, code, stdout, stderr)


# Summaries of the runs so far, by their arguments: tests that need the same
# run (the same mode, arguments, steps and environment) share it.
_runs = {}


def train(tmp_path, mode, *extra, steps=20, nproc=4, env=None):
    """One run of examples/torch_gpt.py on ``nproc`` ranks (or the same
    run's, made by another test); returns its summary."""
    key = (mode, tuple(map(str, extra)), steps, nproc, tuple(sorted((env or {}).items())))
    if key not in _runs:
        out = tmp_path / f"{mode}-{abs(hash(key)) % 10**8}.json"
        args = ["--mode", mode, "--steps", steps, "--log-every", 1000, "--summary-json", out]
        ranks(EXAMPLE, [*args, *extra], nproc=nproc, env=env)
        _runs[key] = json.loads(out.read_text())
    return copy.deepcopy(_runs[key])
