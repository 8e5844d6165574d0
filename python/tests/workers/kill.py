"""Worker: trains the example GPT with zeropp.torch; at step 3 the rank
named by KILL_RANK dies in the middle of the forward pass (os._exit, as a
crash or an OOM kill would), or with KILL_SIGNAL=stop stops there (SIGSTOP:
alive, its connections open, silent). The others must fail with an error
naming it; with KILL_SIGNAL=stop each then tries one more step, which
must fail at once naming it too (it prints both errors). With
KILL_SIGNAL=nan it stays alive but its loss turns NaN at step 3: it raises
and lingers (as an ``except`` that saves a checkpoint would); the others
must fail at once, naming it and the NaN (each prints how long it took);
KILL_MESH=hsdp shards over HSDP's 2-D mesh.
KILL_DEVICE=cuda trains on the GPU (python/gpu_tests)."""

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
import zeropp.torch as zt  # noqa: E402
from torch_gpt import GPT, Data, job_mesh, open_device  # noqa: E402


def main():
    device = open_device(os.environ.get("KILL_DEVICE", "cpu"))
    rank, world = dist.get_rank(), dist.get_world_size()
    victim = int(os.environ["KILL_RANK"])
    torch.manual_seed(0)
    model = GPT(64, 2, 4, 32).to(device)
    mesh = job_mesh(device)
    if os.environ.get("KILL_MESH") == "hsdp":
        # HSDP: replicas of 2 ranks (the shard dimension inside a node).
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    for b in model.blocks:
        zt.fully_shard(b, ranks_per_node=2, mesh=mesh)
    zt.fully_shard(model, ranks_per_node=2, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = Data(0, rank, world)
    step = 0
    mode = os.environ.get("KILL_SIGNAL")

    def die(_module, _args):
        if step == 3 and rank == victim and mode != "nan":
            if mode == "stop":
                print(f"rank {rank} stops now", flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)
            print(f"rank {rank} exits now", flush=True)
            os._exit(17)

    model.blocks[1].register_forward_pre_hook(die)

    def train_step(step):
        x, y = data.batch(step, 4, 32, device=device)
        loss = F.cross_entropy(model(x).view(-1, 256), y.view(-1))
        if mode == "nan" and step == 3 and rank == victim:
            loss = loss * float("nan")
        loss.backward()
        opt.step()
        opt.zero_grad()

    for step in range(1000):
        if mode == "nan":
            started = time.monotonic()
            try:
                train_step(step)
            except zt.ZeroppError as e:
                took = time.monotonic() - started
                print(f"error after {took:.1f} s: {type(e).__name__}: {e}", flush=True)
                if rank == victim:
                    time.sleep(20)
                return 1
        elif mode != "stop":
            train_step(step)
        else:
            try:
                train_step(step)
            except zt.PeerError as e:
                print(f"first error: {e}", flush=True)
                started = time.monotonic()
                try:
                    train_step(step + 1)
                    print("next step: no error", flush=True)
                except zt.PeerError as e:
                    took = time.monotonic() - started
                    print(f"next error after {took:.1f} s: {e}", flush=True)
                return 1
        print(f"rank {rank} step {step} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
