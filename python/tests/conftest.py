"""Shared helpers: the zeropp binary, and jobs of real processes under
torchrun (``python -m torch.distributed.run``)."""

import json
import os
import socket
import subprocess
import sys
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


def train(tmp_path, mode, *extra, steps=20, nproc=4, env=None):
    """One run of examples/torch_gpt.py; returns its summary."""
    out = tmp_path / f"{mode}-{abs(hash(extra)) % 10**8}.json"
    torchrun(
        EXAMPLE,
        ["--mode", mode, "--steps", steps, "--log-every", 1000, "--summary-json", out, *extra],
        nproc=nproc,
        env=env,
    )
    return json.loads(out.read_text())
