"""zeropp under Hugging Face Accelerate's FSDP2 plugin: Accelerate shards a
transformers LlamaForCausalLM (each decoder layer, then the root) in
``accelerator.prepare``, and one line after it —
``zeropp.torch.enable(model, mode=...)`` — gives every module FSDP2 sharded
zeropp's communication. The loop is Accelerate's own (``accelerator.backward``,
``accelerator.log`` with zeropp's bytes per hop and phase).

    accelerate launch --num_processes 4 examples/accelerate_llama.py --zeropp zeropp
    torchrun --standalone --nproc-per-node 4 examples/accelerate_llama.py --zeropp zeropp

``--zeropp none`` trains with FSDP2's own collectives (the baseline);
``zero3`` gives its losses step for step through zeropp's transports;
``zeropp`` is ZeRO++ (or what the job's measured links choose on real
hosts). ``--ranks-per-node G`` makes logical nodes of G ranks.

Islands: ``--islands N --sync-every H`` has Accelerate shard over HSDP's
mesh (``ParallelismConfig(dp_replicate_size=N, dp_shard_size=WORLD/N)``)
and wraps the prepared optimizer in ``zeropp.torch.OuterSync``: each
replica trains as an island, synced every H steps and once more at the end
by zeropp's outer step:

    torchrun --standalone --nproc-per-node 4 examples/accelerate_llama.py \
        --zeropp zeropp --ranks-per-node 2 --islands 2 --sync-every 10

LoRA: ``--lora R`` fine-tunes with peft's rank-R adapters on every attention
and MLP projection, the base frozen (each decoder layer's FSDP2 group holds
both): the frozen base crosses the nodes once.

    torchrun --standalone --nproc-per-node 4 examples/accelerate_llama.py \
        --zeropp zeropp --ranks-per-node 2 --lora 8

Accelerate shards with FSDP only on accelerators (on CPU ranks it falls back
to DDP); ``--cpu-fsdp`` forces its FSDP2 path on CPU ranks, as the tests do.
On GPUs leave it off.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator, ParallelismConfig
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from hf_trainer_llama import fsdp_needs_a_gpu_or_cpu_fsdp, recipe_llama

import zeropp
import zeropp.torch


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--zeropp", choices=["none", "zero3", "zeropp"], default="zeropp")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ranks-per-node", type=int, default=None)
    p.add_argument("--cpu-fsdp", action="store_true", help="force Accelerate's FSDP2 on CPU")
    p.add_argument("--islands", type=int, default=1, help="HSDP replicas trained as islands")
    p.add_argument("--sync-every", type=int, default=20, help="inner steps between outer syncs")
    p.add_argument("--lora", type=int, default=0, metavar="R", help="peft LoRA of rank R")
    p.add_argument("--summary-json", default=None)
    args = p.parse_args()
    fsdp_needs_a_gpu_or_cpu_fsdp(p, args)
    torch.set_num_threads(1)

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        reshard_after_forward=True,
    )
    parallelism = None
    if args.islands > 1:
        world = int(os.environ["WORLD_SIZE"])
        parallelism = ParallelismConfig(
            dp_replicate_size=args.islands, dp_shard_size=world // args.islands
        )
    # Accelerate refuses a ParallelismConfig on CPU ranks: there it is given
    # after it starts.
    accelerator = Accelerator(
        fsdp_plugin=plugin,
        cpu=args.cpu_fsdp,
        parallelism_config=None if args.cpu_fsdp else parallelism,
    )
    if args.cpu_fsdp and accelerator.state.distributed_type != DistributedType.FSDP:
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
    if args.cpu_fsdp and parallelism is not None:
        accelerator.state.parallelism_config = parallelism
        accelerator.state.device_mesh = parallelism.get_device_mesh("cpu")
    rank = accelerator.process_index

    torch.manual_seed(args.seed)
    model = recipe_llama()
    if args.lora:
        from hf_trainer_lora import with_lora

        model = with_lora(model, args.lora)
    parameters = sum(p.numel() for p in model.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=3e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    # The one line: zeropp's collectives on every module Accelerate sharded.
    if args.zeropp != "none":
        zeropp.torch.enable(model, mode=args.zeropp, ranks_per_node=args.ranks_per_node)
        traffic_log = zeropp.torch.TrafficLog()
    outer = None
    if args.islands > 1:
        # Each HSDP replica an island: the optimizer wrapped in the outer
        # sync (the mesh is the parameters' own).
        outer = zeropp.torch.OuterSync(
            model, optimizer, sync_every=args.sync_every, ranks_per_node=args.ranks_per_node
        )
        optimizer = outer
        island = next(model.parameters()).device_mesh.get_group(1)

    corpus = torch.frombuffer(
        bytearray(zeropp.builtin_corpus(1 << 20, args.seed)), dtype=torch.uint8
    )
    g = torch.Generator().manual_seed(args.seed * 7919 + rank)
    losses, logged = [], {}
    for step in range(args.steps):
        starts = torch.randint(0, len(corpus) - 33, (4,), generator=g)
        x = torch.stack([corpus[s : s + 32] for s in starts]).long()
        y = torch.stack([corpus[s + 1 : s + 33] for s in starts]).long()
        loss = model(input_ids=x, labels=y, use_cache=False).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if outer is None:
            mean = accelerator.reduce(loss.detach(), reduction="mean")
        else:
            # Per-step metrics stay inside the island: none waits on another.
            mean = loss.detach().clone()
            dist.all_reduce(mean, group=island)
            mean /= dist.get_world_size(island)
        losses.append(mean.item())
        logged = {"loss": losses[-1]}
        if args.zeropp != "none":
            logged.update(traffic_log())
        accelerator.log(logged, step=step)
    summary = {
        "zeropp": args.zeropp,
        "losses": losses,
        "last_log": logged,
        "parameters": parameters,
        "trainable": sum(p.numel() for p in trainable),
    }
    if outer is not None:
        outer.finish()
        mine = torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])
        theirs = [torch.empty_like(mine) for _ in range(args.islands)]
        dist.all_gather(theirs, mine, group=next(model.parameters()).device_mesh.get_group(0))
        summary["islands"] = {
            "identical": all(torch.equal(theirs[0], t) for t in theirs),
            "outer_syncs": outer.syncs,
            "outer": zeropp.torch.traffic()["outer"]["total"],
            "inter_node_besides_outer": besides_outer(),
        }
    if args.zeropp != "none":
        summary["switches"] = zeropp.torch.resolved_switches()[args.zeropp]["switches"]
        t = zeropp.torch.traffic()
        phases = [k for k, v in t.items() if isinstance(v, dict) and "total" in v]
        # Bytes across nodes by phase, summed over every rank of the job.
        across = torch.tensor([t[k]["total"]["inter_node"] for k in phases], dtype=torch.int64)
        dist.all_reduce(across)
        summary["inter_node_bytes"] = dict(zip(phases, across.tolist(), strict=True))
    if rank == 0:
        print(f"{args.zeropp}: loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
        if args.summary_json:
            with open(args.summary_json, "w") as f:
                json.dump(summary, f)
    dist.barrier()
    accelerator.end_training()


def besides_outer():
    """Bytes that crossed nodes in anything but the outer syncs."""
    t = zeropp.torch.traffic()
    return sum(
        v["total"]["inter_node"]
        for k, v in t.items()
        if k != "outer" and isinstance(v, dict) and "total" in v
    )


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # gloo's teardown aborts now and then (see torch_gpt.py)
