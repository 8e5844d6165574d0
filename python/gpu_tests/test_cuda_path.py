"""zeropp.torch's CUDA path inside real FSDP2 jobs: 4 ranks under torchrun on
this machine's GPUs as 2 logical nodes of 2 (on one GPU the ranks share it
and pose as separate hosts to NCCL), zeropp's kernels on the current stream,
its NCCL communicators for the world, each node and each local rank across
nodes.

Run by ``python/check-on-gpu.sh``; on a machine without a GPU these tests
fail, they never skip. ``ZEROPP_GPU_RESULTS`` (a folder) receives every
run's summary and ``results.json`` with the figures the assertions used.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import zeropp

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "torch_gpt.py"
KILL = ROOT / "python" / "tests" / "workers" / "kill.py"
RESULTS = Path(os.environ.get("ZEROPP_GPU_RESULTS", "/tmp/zeropp-gpu-results"))
FIGURES = {}


def env(**extra):
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # Ranks posing as separate hosts reach each other over loopback.
    e.setdefault("NCCL_SOCKET_IFNAME", "lo")
    e.setdefault("NCCL_IB_DISABLE", "1")
    e.update(extra)
    return e


def train(mode, device, *extra, steps=20, nproc=4):
    """One run of examples/torch_gpt.py (2 logical nodes); its summary."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "-".join([mode, device, *[x.lstrip("-").replace("=", "") for x in extra]])
    out = RESULTS / f"{name}.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(EXAMPLE),
        *["--mode", mode, "--device", device, "--steps", str(steps)],
        *["--ranks-per-node", "2", "--log-every", "1000", "--summary-json", str(out), *extra],
    ]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env())
    (RESULTS / f"{name}.log").write_text(p.stdout + "\n--- stderr\n" + p.stderr)
    assert p.returncode == 0, f"{' '.join(cmd)}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    s = json.loads(out.read_text())
    s["wall_s"] = time.monotonic() - t0
    return s


_runs = {}


def run(mode, device, *extra, steps=20):
    key = (mode, device, extra, steps)
    if key not in _runs:
        _runs[key] = train(mode, device, *extra, steps=steps)
    return _runs[key]


def max_rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def record(name, value):
    FIGURES[name] = value
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "results.json").write_text(json.dumps(FIGURES, indent=1))
    print(f"{name}: {value}")


def test_this_machine_has_a_gpu_and_nccl():
    status = zeropp.cuda_status()
    record("cuda_status", status)
    assert torch.cuda.is_available(), "PyTorch sees no CUDA device"
    assert status["driver"] and status["devices"] >= 1, status
    assert status["nccl"], status


def test_zero3_on_cuda_gives_fsdp2_over_nccls_losses_step_for_step():
    z3 = run("zero3", "cuda")
    fsdp = run("fsdp2", "cuda")
    rel = max_rel(z3["losses"], fsdp["losses"])
    record("zero3_vs_fsdp2_cuda_max_rel_loss_diff", rel)
    assert rel <= 1e-5, (z3["losses"], fsdp["losses"])


def test_zeropp_on_cuda_gives_the_cpu_paths_losses():
    gpu = run("zeropp", "cuda")
    cpu = run("zeropp", "cpu")
    rel = max_rel(gpu["losses"], cpu["losses"])
    record("zeropp_cuda_vs_cpu_max_rel_loss_diff", rel)
    assert gpu["switches"] == cpu["switches"]
    assert rel <= 1e-3, (gpu["losses"], cpu["losses"])
    assert gpu["final_loss"] < 0.8 * gpu["initial_loss"]


def test_islands_on_cuda_give_the_cpu_paths_losses_waited_and_streamed():
    # OuterSync with CUDA shards (staged through the host at each outer
    # exchange): 2 islands of one logical node, H = 5, the CPU path's
    # losses; streamed (2 fragments landing 2 steps later) it trains.
    islands = ("--islands", "2", "--sync-every", "5")
    gpu = run("zeropp", "cuda", *islands)
    cpu = run("zeropp", "cpu", *islands)
    rel = max_rel(gpu["losses"], cpu["losses"])
    record("islands_cuda_vs_cpu_max_rel_loss_diff", rel)
    assert rel <= 1e-3, (gpu["losses"], cpu["losses"])
    assert gpu["islands"]["outer_bytes"] > 0, gpu["islands"]
    streamed = run("zeropp", "cuda", *islands, "--outer-fragments", "2", "--outer-delay", "2")
    record("islands_cuda_streamed_final_loss", streamed["final_loss"])
    assert streamed["final_loss"] < 0.8 * streamed["initial_loss"], streamed["losses"]


def test_zeropp_on_cuda_moves_at_most_027x_of_zero3s_bytes_across_nodes():
    zpp = run("zeropp", "cuda")["bytes_per_step"]["inter_node"]
    z3 = run("zero3", "cuda")["bytes_per_step"]["inter_node"]
    record("zeropp_vs_zero3_cuda_bytes_across", zpp / z3)
    assert z3 > 0 and zpp / z3 <= 0.27, (zpp, z3)


def test_bf16_zeropp_on_cuda_trains_like_bf16_fsdp2():
    zpp = run("zeropp", "cuda", "--bf16", steps=30)
    fsdp = run("fsdp2", "cuda", "--bf16", steps=30)
    gap = zpp["final_loss"] / fsdp["final_loss"] - 1
    record("zeropp_vs_fsdp2_cuda_bf16_final_loss_gap", gap)
    assert abs(gap) <= 0.02, (zpp["final_loss"], fsdp["final_loss"])
    for s in (zpp, fsdp):
        assert s["final_loss"] < 0.8 * s["initial_loss"], s["losses"]


def test_int4_inside_the_node_keeps_error_feedback_on_the_device():
    # qgz_intra_bits=4: both hops keep error feedback (compressed on the device, as on the CPU).
    int4 = run("zeropp", "cuda", "--switch=qgz_intra_bits=4")
    int8 = run("zeropp", "cuda")
    gap = int4["final_loss"] / int8["final_loss"] - 1
    record("zeropp_cuda_int4_vs_int8_inside_final_loss_gap", gap)
    assert int4["switches"]["qgz_intra_bits"] == 4
    assert int4["final_loss"] < 0.8 * int4["initial_loss"], int4["losses"]
    assert abs(gap) <= 0.02, (int4["losses"], int8["losses"])


def test_a_rank_killed_mid_step_on_cuda_is_named_by_every_other_rank():
    world, victim, port = 4, 3, 29613
    procs = []
    for r in range(world):
        e = env(
            RANK=str(r),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(r),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            KILL_RANK=str(victim),
            KILL_DEVICE="cuda",
            ZEROPP_TIMEOUT_S="30",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(KILL)],
                env=e,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    start = time.monotonic()
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=150)
            outputs.append((p.returncode, out, err))
    finally:
        for p in procs:
            p.kill()
    took = time.monotonic() - start
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "kill.log").write_text(
        "\n".join(
            f"== rank {r} exit {c}\n{o[-1500:]}\n{e[-3000:]}" for r, (c, o, e) in enumerate(outputs)
        )
    )
    record("kill_seconds", took)
    assert outputs[victim][0] == 17, outputs[victim]
    for r, (code, out, err) in enumerate(outputs):
        if r == victim:
            continue
        assert code != 0, f"rank {r} went on without rank {victim}: {out[-2000:]}"
        assert "PeerError" in err and f"rank {victim} failed" in err, err[-3000:]
    assert took < 120


@pytest.fixture(scope="session", autouse=True)
def step_times():
    yield
    times = {f"{m}-{d}{''.join(e)}": s["median_step_time_s"] for (m, d, e, _), s in _runs.items()}
    record("median_step_time_s", times)
