"""LoRA fine-tuning under the Hugging Face ``Trainer`` with FSDP2 and zeropp:
``peft`` adds rank-``r`` adapters to a transformers LlamaForCausalLM (its
attention and MLP projections) and freezes the rest, the Trainer shards it
(each decoder layer — base and adapters in one FSDP2 group — then the root),
and ``zeropp.torch.trainer_callback`` gives every module zeropp's
communication. The frozen base crosses the nodes once: after its first
gather only the adapters' int4 differences (and a byte per gather saying the
base is unchanged) cross; its backward gathers stay inside the node.

    torchrun --standalone --nproc-per-node 4 examples/hf_trainer_lora.py \\
        --zeropp zeropp --ranks-per-node 2

``--zeropp none`` trains with FSDP2's own collectives (the baseline),
``zero3`` gives its losses step for step through zeropp's transports.
``--cpu-fsdp`` forces the Trainer's FSDP2 path on CPU ranks (on CPU it falls
back to DDP otherwise), as the tests do; on GPUs leave it off. The summary
(``--summary-json``) holds the losses and zeropp's bytes by phase.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import Trainer

import zeropp.torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_trainer_llama import (  # noqa: E402
    Corpus,
    CpuFsdpTrainer,
    fsdp_needs_a_gpu_or_cpu_fsdp,
    recipe_llama,
    training_arguments,
)

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def with_lora(model, r):
    """``model`` under peft's LoRA: rank-``r`` adapters (alpha 2r, no
    dropout) on every attention and MLP projection, the rest frozen."""
    config = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=PROJECTIONS)
    return get_peft_model(model, config)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--zeropp", choices=["none", "zero3", "zeropp"], default="zeropp")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--ranks-per-node", type=int, default=None)
    p.add_argument("--cpu-fsdp", action="store_true", help="force the Trainer's FSDP2 on CPU")
    p.add_argument("--out", default="/tmp/zeropp-hf-lora")
    p.add_argument("--summary-json", default=None)
    args = p.parse_args()
    fsdp_needs_a_gpu_or_cpu_fsdp(p, args)
    torch.set_num_threads(1)

    torch.manual_seed(args.seed)
    model = with_lora(recipe_llama(), args.lora_rank)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    training = training_arguments(args)
    callbacks = []
    if args.zeropp != "none":
        callbacks.append(
            zeropp.torch.trainer_callback(mode=args.zeropp, ranks_per_node=args.ranks_per_node)
        )
    cls = CpuFsdpTrainer if args.cpu_fsdp else Trainer
    trainer = cls(
        model=model,
        args=training,
        train_dataset=Corpus(args.seed, 4 * 4 * args.steps),
        callbacks=callbacks,
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    summary = {
        "zeropp": args.zeropp,
        "parameters": total,
        "trainable": trainable,
        "losses": [h["loss"] for h in logs],
    }
    if args.zeropp != "none":
        t = zeropp.torch.traffic()
        phases = [k for k, v in t.items() if isinstance(v, dict) and "total" in v]
        # Bytes across nodes by phase, summed over every rank of the job.
        across = torch.tensor([t[k]["total"]["inter_node"] for k in phases], dtype=torch.int64)
        torch.distributed.all_reduce(across)
        summary["inter_node_bytes"] = dict(zip(phases, across.tolist(), strict=True))
        summary["switches"] = zeropp.torch.resolved_switches()[args.zeropp]["switches"]
    if trainer.is_world_process_zero():
        print(
            f"{args.zeropp}: {trainable} of {total} parameters train; "
            f"loss {summary['losses'][0]:.4f} -> {summary['losses'][-1]:.4f}"
        )
        if args.summary_json:
            with open(args.summary_json, "w") as f:
                json.dump(summary, f)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # gloo's teardown aborts now and then (see torch_gpt.py)
