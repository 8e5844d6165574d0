"""Peak resident memory per rank of a few training steps of a transformers
Llama, sharded by plain FSDP2 or by zeropp.torch (``--mode zero3`` or
``zeropp``), bf16 parameters through FSDP2's MixedPrecisionPolicy. Run it
once per mode; each run prints one JSON line on rank 0: the mode, the
parameters, and every rank's peak RSS (VmHWM) and its growth over the
process's RSS before the model was built (what training added).

    for mode in fsdp2 zero3 zeropp; do
      torchrun --standalone --nproc-per-node 4 python/bench/memory.py \\
          --mode $mode --ranks-per-node 2 --hidden 512 --layers 8
    done

``--lora R`` fine-tunes with peft's rank-R LoRA (the base frozen); each
line then also gives zeropp's kept bytes per rank (``kept_bytes``: the
frozen weights' cache among them).
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as fsdp_fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

import zeropp.torch as zt


def status_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="zeropp", choices=["fsdp2", "zero3", "zeropp"])
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, default=32)
    p.add_argument(
        "--lora", type=int, default=0, metavar="R", help="peft LoRA of rank R, the base frozen"
    )
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    before_kb = status_kb("VmRSS")
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(4, args.hidden // 64),
        num_key_value_heads=max(2, args.hidden // 128),
        max_position_embeddings=args.context,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    layers = model.model.layers
    if args.lora:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
        from hf_trainer_lora import with_lora

        model = with_lora(model, args.lora)
    params = sum(p.numel() for p in model.parameters())
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    if args.mode == "fsdp2":
        for layer in layers:
            fsdp_fully_shard(layer, mp_policy=mp)
        fsdp_fully_shard(model, mp_policy=mp)
    else:
        zt.job(ranks_per_node=args.ranks_per_node)
        for layer in layers:
            zt.fully_shard(layer, mode=args.mode, mp_policy=mp)
        zt.fully_shard(model, mode=args.mode, mp_policy=mp)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    for _ in range(args.steps):
        x = torch.randint(0, 256, (args.batch, args.context), generator=g)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    kept = 0 if args.mode == "fsdp2" else zt.kept_bytes(model)["total"]
    peak = torch.tensor([status_kb("VmHWM") * 1024, before_kb * 1024, kept], dtype=torch.int64)
    every = [torch.zeros_like(peak) for _ in range(dist.get_world_size())]
    dist.all_gather(every, peak)
    if rank == 0:
        line = {
            "mode": args.mode,
            "params": params,
            "peak_rss_bytes": [int(t[0]) for t in every],
            "growth_bytes": [int(t[0] - t[1]) for t in every],
            # zeropp.torch.kept_bytes: references (with LoRA, the frozen
            # weights' cache) and residuals, in host memory here.
            "kept_bytes": [int(t[2]) for t in every],
            "lora": args.lora,
            "loss": float(loss),
        }
        print(json.dumps(line), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
