"""zeropp under the Hugging Face ``Trainer`` with FSDP2: the Trainer shards a
transformers LlamaForCausalLM itself (``fsdp_config`` with ``fsdp_version:
2``, each decoder layer, then the root), and one callback —
``zeropp.torch.trainer_callback(mode=...)`` — gives every module it sharded
zeropp's communication when training begins, and adds zeropp's bytes per hop
and phase to every log entry.

    torchrun --standalone --nproc-per-node 4 examples/hf_trainer_llama.py --zeropp zeropp

``--zeropp none`` trains with FSDP2's own collectives (the baseline);
``zero3`` gives its losses step for step through zeropp's transports;
``zeropp`` is ZeRO++ (or what the job's measured links choose on real
hosts). ``--ranks-per-node G`` makes logical nodes of G ranks.

Islands: ``--islands N --sync-every H`` has the Trainer shard over HSDP's
mesh (``ParallelismConfig(dp_replicate_size=N, dp_shard_size=WORLD/N)``)
and the callback's ``outer_sync`` makes each replica an island synced
every H steps (and once more at the end) by zeropp's outer step:

    torchrun --standalone --nproc-per-node 4 examples/hf_trainer_llama.py \
        --zeropp zeropp --ranks-per-node 2 --islands 2 --sync-every 10

The Trainer shards with FSDP only on accelerators (on CPU ranks Accelerate
falls back to DDP); ``--cpu-fsdp`` forces its FSDP2 path on CPU ranks, as
the tests do. On GPUs leave it off.
"""

import argparse
import json
import os
import sys

import torch
from accelerate.utils import DistributedType
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import zeropp
import zeropp.torch


class Corpus(torch.utils.data.Dataset):
    """Windows of 32 bytes of zeropp's built-in corpus, as token ids."""

    def __init__(self, seed, n):
        data = zeropp.builtin_corpus(1 << 20, seed)
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        g = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, len(self.data) - 33, (n,), generator=g)

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        s = self.starts[i]
        x = self.data[s : s + 32]
        return {"input_ids": x, "labels": x.clone()}


class CpuFsdpTrainer(Trainer):
    """The Trainer with Accelerate's FSDP2 path forced on CPU ranks (and
    HSDP's mesh, which Accelerate refuses on CPU, given after it starts)."""

    parallelism = None

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        state = self.accelerator.state
        if state.distributed_type != DistributedType.FSDP:
            state.distributed_type = DistributedType.FSDP
            state.fsdp_plugin = self._fsdp_plugin()
        if self.parallelism is not None:
            state.parallelism_config = self.parallelism
            state.device_mesh = self.parallelism.get_device_mesh("cpu")
        self.is_fsdp_enabled = True

    def _fsdp_plugin(self):
        from accelerate.utils import FullyShardedDataParallelPlugin

        return FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
            reshard_after_forward=True,
        )


def recipe_llama():
    """The recipes' LlamaForCausalLM, built from a config (no download)."""
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def fsdp_needs_a_gpu_or_cpu_fsdp(parser, args):
    """The frameworks set FSDP up only on accelerators: on CPU ranks they
    hand the job DDP (or refuse). Without a GPU, ``--cpu-fsdp`` forces
    their FSDP2 path; say so at once instead of failing later."""
    if not args.cpu_fsdp and not torch.cuda.is_available():
        parser.error(
            "no GPU here: Accelerate and the Trainer set up FSDP only on accelerators "
            "(on CPU ranks they fall back to DDP, which zeropp does not serve); pass "
            "--cpu-fsdp to force their FSDP2 path on CPU ranks"
        )


def training_arguments(args, **more):
    """The recipes' TrainingArguments: ``args.steps`` constant-rate steps
    of 4 sequences a rank, a log entry each, FSDP2 wrapping each decoder
    layer (forced on CPU ranks with ``args.cpu_fsdp``), and ``more``."""
    return TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        data_seed=args.seed,
        use_cpu=args.cpu_fsdp,
        fsdp=True,
        fsdp_config={
            "fsdp_version": 2,
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
            "reshard_after_forward": True,
        },
        dataloader_drop_last=True,
        **more,
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--zeropp", choices=["none", "zero3", "zeropp"], default="zeropp")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ranks-per-node", type=int, default=None)
    p.add_argument("--cpu-fsdp", action="store_true", help="force the Trainer's FSDP2 on CPU")
    p.add_argument("--islands", type=int, default=1, help="HSDP replicas trained as islands")
    p.add_argument("--sync-every", type=int, default=20, help="inner steps between outer syncs")
    p.add_argument("--out", default="/tmp/zeropp-hf-trainer")
    p.add_argument("--summary-json", default=None)
    args = p.parse_args()
    fsdp_needs_a_gpu_or_cpu_fsdp(p, args)
    torch.set_num_threads(1)

    torch.manual_seed(args.seed)
    model = recipe_llama()
    parallelism = None
    if args.islands > 1:
        from accelerate import ParallelismConfig

        world = int(os.environ["WORLD_SIZE"])
        parallelism = ParallelismConfig(
            dp_replicate_size=args.islands, dp_shard_size=world // args.islands
        )
        CpuFsdpTrainer.parallelism = parallelism
    training = training_arguments(
        args,
        # Islands: no per-step count of tokens over the whole job (it would
        # cross the slow link every step); each island's own mean.
        average_tokens_across_devices=args.islands == 1,
        # On CPU ranks the mesh is given after Accelerate starts (above).
        parallelism_config=None if args.cpu_fsdp else parallelism,
    )
    # The one line: zeropp on every module the Trainer shards, and its bytes
    # in the logs.
    callbacks = []
    outer = {"sync_every": args.sync_every} if args.islands > 1 else None
    if args.zeropp != "none" or outer is not None:
        callbacks.append(
            zeropp.torch.trainer_callback(
                mode=None if args.zeropp == "none" else args.zeropp,
                outer_sync=outer,
                ranks_per_node=args.ranks_per_node,
            )
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
        "losses": [h["loss"] for h in logs],
        "last_log": logs[-1] if logs else {},
    }
    if args.zeropp != "none":
        summary["switches"] = zeropp.torch.resolved_switches()[args.zeropp]["switches"]
    if args.islands > 1:
        summary["islands"] = island_summary(trainer.model, args.islands)
    if trainer.is_world_process_zero():
        print(f"{args.zeropp}: loss {summary['losses'][0]:.4f} -> {summary['losses'][-1]:.4f}")
        if args.summary_json:
            with open(args.summary_json, "w") as f:
                json.dump(summary, f)
    torch.distributed.barrier()


def island_summary(model, islands):
    """Whether every island ended with the same weights (the last outer
    sync), and the traffic of the outer syncs."""
    mesh = next(model.parameters()).device_mesh
    mine = torch.cat([p.to_local().detach().reshape(-1).float() for p in model.parameters()])
    theirs = [torch.empty_like(mine) for _ in range(islands)]
    torch.distributed.all_gather(theirs, mine, group=mesh.get_group(0))
    return {
        "identical": all(torch.equal(theirs[0], t) for t in theirs),
        "outer": zeropp.torch.traffic()["outer"]["total"],
        "inter_node_besides_outer": besides_outer(),
    }


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
