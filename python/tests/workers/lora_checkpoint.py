"""Worker (4 ranks, logical nodes of 2): a LoRA fine-tune's adapters
checkpointed with torch.distributed.checkpoint under zeropp. peft's LoRA on
a transformers Llama, each decoder layer and the root sharded with
``zeropp.torch.fully_shard`` (mode from argv). Run A trains 4 steps, saves
the adapters alone (and their optimizer state) with DCP, trains 4 more.
Run B builds the model again — the same frozen base, other adapters — loads
the checkpoint, calls ``reset_error_feedback`` and trains the same 4 steps.
Prints on rank 0 one JSON line: both runs' losses, the keys saved, and the
bytes run B's frozen base sent across nodes after its first gather.
argv: CHECKPOINT_DIR MODE(zeropp|zero3)."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from hf_trainer_llama import recipe_llama  # noqa: E402
from hf_trainer_lora import with_lora  # noqa: E402

import zeropp  # noqa: E402
import zeropp.torch as zt  # noqa: E402


def build(adapter_seed, mode):
    torch.manual_seed(0)  # the base: the same "pretrained" weights each time
    base = recipe_llama()
    torch.manual_seed(adapter_seed)
    model = with_lora(base, 8)
    # LoRA's B starts at zero: give the adapters weights that differ by seed,
    # so that a load that did not replace them would show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    for layer in model.base_model.model.model.layers:
        zt.fully_shard(layer, mode=mode, ranks_per_node=2)
    zt.fully_shard(model, mode=mode, ranks_per_node=2)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(trainable, lr=3e-3)


def steps(model, opt, corpus, first, n):
    losses = []
    for step in range(first, first + n):
        g = torch.Generator().manual_seed(step * 4 + dist.get_rank())
        starts = torch.randint(0, len(corpus) - 33, (4,), generator=g)
        x = torch.stack([corpus[s : s + 32] for s in starts]).long()
        y = torch.stack([corpus[s + 1 : s + 33] for s in starts]).long()
        loss = model(input_ids=x, labels=y, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        v = loss.detach().clone()
        dist.all_reduce(v)
        losses.append(v.item() / dist.get_world_size())
    return losses


def adapters(model, opt):
    """The adapters' state dict and their optimizer state: what a LoRA
    checkpoint holds (the base is the pretrained model's)."""
    msd, osd = get_state_dict(model, opt)
    return {k: v for k, v in msd.items() if "lora_" in k}, osd


def frozen_across():
    return zt.traffic()["frozen"]["total"]["inter_node"]


def main():
    root, mode = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    corpus = torch.frombuffer(bytearray(zeropp.builtin_corpus(1 << 18, 0)), dtype=torch.uint8)
    model, opt = build(1, mode)
    steps(model, opt, corpus, 0, 4)
    msd, osd = adapters(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=root)
    run_a = steps(model, opt, corpus, 4, 4)

    model, opt = build(2, mode)  # other adapters: the load must replace them
    msd, osd = adapters(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=root)
    set_state_dict(
        model,
        opt,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=StateDictOptions(strict=False),
    )
    reset = zt.reset_error_feedback(model)
    run_b = steps(model, opt, corpus, 4, 1)
    before = frozen_across()
    run_b += steps(model, opt, corpus, 5, 3)
    frozen_after_first = frozen_across() - before
    if dist.get_rank() == 0:
        result = {
            "a": run_a,
            "b": run_b,
            "saved": sorted(msd),
            "reset_groups": reset,
            "frozen_after_first": frozen_after_first,
        }
        print(json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # gloo's teardown aborts now and then (see checkpoint.py)
