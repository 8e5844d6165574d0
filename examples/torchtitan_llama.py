"""zeropp under torchtitan's FSDP2 recipe: ``apply_fsdp`` as torchtitan
writes it (torchtitan/models/llama3/infra/parallelize.py: the embeddings,
each transformer block, the final norm with the output layer as one group,
then the root), on a transformers LlamaForCausalLM built from a config, and
then one line — ``zeropp.torch.enable(model, mode=...)`` — that gives every
module FSDP2 sharded zeropp's communication.

    torchrun --standalone --nproc-per-node 4 examples/torchtitan_llama.py --zeropp zeropp

``--zeropp none`` trains with FSDP2's own collectives (the baseline);
``zero3`` gives its losses step for step through zeropp's transports;
``zeropp`` is ZeRO++ (or what the job's measured links choose on real
hosts). ``--ranks-per-node G`` makes logical nodes of G ranks. Prints the
losses; ``--summary-json`` writes them with zeropp's traffic.

``--tp T`` adds tensor parallelism as torchtitan's ``parallelize_llama``
does: a (dp, tp) mesh, ``apply_tp`` on the ``tp`` dimension (the attention
and feed-forward projections column- then row-wise), then ``apply_fsdp``
on the ``dp`` dimension; zeropp serves FSDP2's collectives on ``dp`` and
PyTorch keeps the tensor-parallel ones::

    torchrun --standalone --nproc-per-node 4 examples/torchtitan_llama.py --tp 2 --zeropp zeropp
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from hf_trainer_llama import recipe_llama
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import zeropp
import zeropp.torch


def apply_fsdp(
    model,
    dp_mesh,
    param_dtype,
    reduce_dtype,
    pp_enabled=False,
    cpu_offload=False,
    reshard_after_forward_policy="default",
):
    """torchtitan's apply_fsdp, its names mapped onto transformers' Llama
    (tok_embeddings → embed_tokens, layers, norm, output → lm_head)."""
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    fsdp_config = {"mesh": dp_mesh, "mp_policy": mp_policy}
    if cpu_offload:
        fsdp_config["offload_policy"] = CPUOffloadPolicy()
    match reshard_after_forward_policy:
        case "always":
            reshard_after_forward = True
        case "never":
            reshard_after_forward = False
        case "default":
            reshard_after_forward = not pp_enabled
        case _:
            raise ValueError(
                f"Invalid reshard_after_forward_policy: {reshard_after_forward_policy}."
            )
    inner = model.model
    fully_shard(inner.embed_tokens, **fsdp_config, reshard_after_forward=reshard_after_forward)
    for transformer_block in inner.layers:
        fully_shard(transformer_block, **fsdp_config, reshard_after_forward=reshard_after_forward)
    fully_shard(
        [inner.norm, model.lm_head],
        **fsdp_config,
        reshard_after_forward=reshard_after_forward_policy == "always",
    )
    fully_shard(model, **fsdp_config)


def apply_tp(model, tp_mesh):
    """torchtitan's apply_tp for the transformer blocks (without sequence
    parallelism), its names mapped onto transformers' Llama: wq/wk/wv →
    q_proj/k_proj/v_proj and w1/w3 → gate_proj/up_proj column-wise, wo →
    o_proj and w2 → down_proj row-wise. transformers' attention reshapes
    with -1 heads, so each rank runs its own heads."""
    for transformer_block in model.model.layers:
        layer_plan = {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }
        parallelize_module(transformer_block, tp_mesh, layer_plan)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--zeropp", choices=["none", "zero3", "zeropp"], default="zeropp")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", action="store_true", help="bf16 parameters (fp32 reductions)")
    p.add_argument("--ranks-per-node", type=int, default=None)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (dp = world / tp)")
    p.add_argument("--summary-json", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = recipe_llama()
    if world % args.tp:
        raise SystemExit(f"--tp {args.tp} does not divide the {world} ranks")
    dp = world // args.tp
    if args.tp > 1:
        world_mesh = init_device_mesh("cpu", (dp, args.tp), mesh_dim_names=("dp", "tp"))
        apply_tp(model, world_mesh["tp"])
        mesh = world_mesh["dp"]
    else:
        mesh = init_device_mesh("cpu", (world,))
    # The ranks of one tensor-parallel group train on the same batches.
    dp_rank = mesh.get_local_rank()
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    apply_fsdp(model, mesh, param_dtype=dtype, reduce_dtype=torch.float32)
    if args.zeropp != "none":
        zeropp.torch.enable(model, mode=args.zeropp, ranks_per_node=args.ranks_per_node)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    corpus = torch.frombuffer(
        bytearray(zeropp.builtin_corpus(1 << 20, args.seed)), dtype=torch.uint8
    )
    g = torch.Generator().manual_seed(args.seed * 7919 + dp_rank)
    losses = []
    for _ in range(args.steps):
        starts = torch.randint(0, len(corpus) - 33, (4,), generator=g)
        x = torch.stack([corpus[s : s + 32] for s in starts]).long()
        y = torch.stack([corpus[s + 1 : s + 33] for s in starts]).long()
        logits = model(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    summary = {"zeropp": args.zeropp, "tp": args.tp, "losses": losses}
    if args.zeropp != "none":
        summary["switches"] = zeropp.torch.resolved_switches()[args.zeropp]["switches"]
        summary["mesh_dims"] = zeropp.torch.resolved_switches()[args.zeropp]["mesh"]
        summary["traffic"] = zeropp.torch.traffic()
    if rank == 0:
        print(f"{args.zeropp}: loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
        if args.summary_json:
            with open(args.summary_json, "w") as f:
                json.dump(summary, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # gloo's teardown aborts now and then (see torch_gpt.py)
