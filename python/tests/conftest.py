"""Shared helpers: the zeropp binary, and jobs of real processes: under
torchrun (``python -m torch.distributed.run``), or started directly with the
environment torchrun gives its workers."""

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


def ranks(script, args=(), nproc=4, env=None, timeout=600, check=True, grace=10):
    """Runs ``script`` on ``nproc`` local ranks started directly, each with
    the environment torchrun gives its workers (RANK, LOCAL_RANK,
    WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT):
    rank 0 hosts torch's store. torchrun's agent would import torch once
    more per job, a fifth of a short job on 2 cores; the recipes' tests run
    under torchrun and ``accelerate launch`` themselves. As torchrun does, a
    rank that fails stops the others (after ``grace`` seconds, for their own
    errors). Returns a completed process: the first failing rank's exit
    code (0 if none), every rank's stdout with rank 0's last (its summary
    line ends it), every rank's stderr in rank order."""
    cmd = [sys.executable, str(script), *map(str, args)]
    common = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    common.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK="0",
    )
    common.update(env or {})
    outs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in range(nproc)]
    procs = [
        subprocess.Popen(
            cmd, env=dict(common, RANK=str(r), LOCAL_RANK=str(r)), stdout=o, stderr=e, text=True
        )
        for r, (o, e) in enumerate(outs)
    ]
    start, failed = time.monotonic(), None
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed is None and any(p.poll() for p in procs):
                failed = now
            if failed is not None and now - failed > grace:
                break
            if now - start > timeout:
                raise subprocess.TimeoutExpired(cmd, timeout)
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()

    def read(f):
        f.seek(0)
        return f.read()

    codes = [p.returncode for p in procs]
    code = next((c for c in codes if c), 0)
    stdout = "".join(read(o) for o, _ in outs[1:]) + read(outs[0][0])
    stderr = "".join(read(e) for _, e in outs)
    for o, e in outs:
        o.close()
        e.close()
    if check and code != 0:
        raise AssertionError(
            f"{' '.join(cmd)} on {nproc} ranks exited {codes}\n--- stdout\n{stdout[-4000:]}"
            f"\n--- stderr\n{stderr[-8000:]}"
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
    return json.loads(json.dumps(_runs[key]))
