"""A byte-level GPT (GPT-2's architecture: learned positions, pre-norm blocks,
tanh-GELU, final layer norm) trained with PyTorch's FSDP2, its communication
either PyTorch's own or zeropp's.

    torchrun --standalone --nproc-per-node 4 examples/torch_gpt.py --mode zeropp --steps 100

Modes: ``zeropp`` (qwZ + hpZ + qgZ through zeropp), ``zero3`` (plain
communication through zeropp's transports), ``fsdp2`` (FSDP2 over gloo, or
NCCL with ``--device cuda``) and ``hsdp`` (``fsdp2`` on the ``hsdp`` mesh).
Meshes (``--mesh``): ``world`` (1-D over the job), ``hsdp`` (2-D:
replicated across nodes, sharded inside each) and ``sub`` (the 1-D
data-parallel sub-mesh of a (dp, 2) mesh, as next to tensor parallelism:
ranks r, r+2, ... shard one model, so two copies train apart).
``--device cuda`` trains on the GPUs (rank r on device LOCAL_RANK mod the
device count; ranks that share a GPU pose as separate hosts to NCCL, which
refuses two ranks on one device otherwise).
``--ranks-per-node G`` makes logical nodes of G ranks (default: the hosts).
Writes per-step metrics (``--metrics``, JSON lines) and a summary
(``--summary-json``) with the conventions of ``zeropp train``, and the
median time of the backward pass (``median_backward_s``, its collectives
finished). ``--local-reduce-scatter`` replaces the gradient reduce-scatter
of any mode by a local copy of this rank's chunk (no communication): the
difference between a run's backward and that run's is how much of the
reduce-scatter the backward's compute did not hide (python/check-on-gpu.sh
reports it for zeropp and FSDP2).
"""

import argparse
import hashlib
import json
import math
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as fsdp_fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

import zeropp
import zeropp.torch


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width, eps=1e-5)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width, eps=1e-5)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, width, layers, heads, context, vocab=256):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width, eps=1e-5)
        self.head = nn.Linear(width, vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tokens(idx) + self.positions(pos)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


class Llama(nn.Module):
    """transformers' LlamaForCausalLM built from a config (no download): the
    model users bring. Its decoder layers are the units FSDP2 shards."""

    def __init__(self, width, layers, heads, context, vocab=256, lora=0):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=vocab,
            hidden_size=width,
            intermediate_size=width * 8 // 3 // 64 * 64 or 64,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 4),
            max_position_embeddings=context,
            tie_word_embeddings=False,
        )
        self.inner = LlamaForCausalLM(config)
        self.blocks = self.inner.model.layers
        if lora:
            # peft's LoRA on every attention and MLP projection: the base
            # frozen, rank-`lora` adapters trained (examples/hf_trainer_lora.py).
            from hf_trainer_lora import with_lora

            self.inner = with_lora(self.inner, lora)

    def forward(self, idx):
        return self.inner(input_ids=idx, use_cache=False).logits


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["zeropp", "zero3", "fsdp2", "hsdp"], default="zeropp")
    p.add_argument("--mesh", choices=["world", "hsdp", "sub"], default="world")
    p.add_argument(
        "--islands",
        type=int,
        default=1,
        help="islands of consecutive ranks (zeropp modes): each shards the model over its own "
        "ranks, and zeropp.torch.OuterSync syncs them every --sync-every steps",
    )
    p.add_argument("--sync-every", type=int, default=20)
    p.add_argument("--outer-fragments", type=int, default=1, help="streamed: fragments")
    p.add_argument("--outer-delay", type=int, default=0, help="streamed: steps an exchange runs")
    p.add_argument("--outer-lr", type=float, default=0.3)
    p.add_argument("--outer-momentum", type=float, default=0.6)
    p.add_argument(
        "--outer-bits", type=int, choices=[4, 32], default=4, help="int4 or f32 outer deltas"
    )
    p.add_argument(
        "--model",
        choices=["gpt", "llama"],
        default="gpt",
        help="this file's GPT, or a transformers LlamaForCausalLM of the same width, "
        "layers and heads (a quarter as many key/value heads), built from a config",
    )
    p.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="R",
        help="--model llama only: fine-tune with peft's rank-R LoRA adapters on every "
        "attention and MLP projection, the base frozen (pip install peft)",
    )
    p.add_argument("--steps", type=int, default=100)
    p.add_argument(
        "--pace",
        type=float,
        default=0.0,
        help="seconds each step takes at least (a slower device, for fault drills)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--bf16", action="store_true", help="bf16 parameters for compute and traffic")
    p.add_argument("--ranks-per-node", type=int, default=None)
    p.add_argument("--transport", choices=["ucx", "tcp"], default=None)
    p.add_argument(
        "--switch",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a zeropp switch (qwz_bits=4, hpz=false, ...); repeatable",
    )
    p.add_argument("--metrics", default=None)
    p.add_argument("--summary-json", default=None)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--local-reduce-scatter",
        action="store_true",
        help="reduce-scatter gradients locally (no communication), to time the backward's "
        "compute alone",
    )
    return p.parse_args(argv)


class _Done(dist.Work):
    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


class LocalReduceScatter(ReduceScatter):
    """FSDP2's gradient reduce-scatter without communication: this rank's
    chunk of its own gradient (averaged as if every rank had the same), so
    the backward runs its compute alone."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        w, r = group.size(), dist.get_rank(group)
        output_tensor.copy_(input_tensor.view(w, -1)[r].view_as(output_tensor))
        return _Done() if async_op else None


def switch_value(raw):
    low = raw.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    try:
        return int(raw)
    except ValueError:
        raise SystemExit(
            f"--switch NAME=VALUE takes true, false, none or an integer, not {raw!r}"
        ) from None


class Data:
    """zeropp train's built-in corpus: the last tenth held out, the rest cut
    into one part per rank; batches drawn with a generator seeded by (seed,
    rank, step)."""

    def __init__(self, seed, rank, world):
        corpus = torch.frombuffer(
            bytearray(zeropp.builtin_corpus(2 << 20, seed)), dtype=torch.uint8
        )
        split = len(corpus) * 9 // 10
        part = split // world
        self.train = corpus[rank * part : (rank + 1) * part].long()
        self.val = corpus[split:].long()
        self.seed, self.rank = seed, rank

    def batch(self, step, batch, context, val=False, device="cpu"):
        src = self.val if val else self.train
        g = torch.Generator().manual_seed(
            self.seed * 1_000_003 + self.rank * 7919 + step + (1 << 40 if val else 0)
        )
        starts = torch.randint(0, len(src) - context - 1, (batch,), generator=g)
        x = torch.stack([src[s : s + context] for s in starts])
        y = torch.stack([src[s + 1 : s + context + 1] for s in starts])
        return x.to(device), y.to(device)


def job_mesh(device):
    """The 1-D mesh of the whole job on `device`'s type. Without a mesh FSDP2
    puts the model on the accelerator when the machine has one, so a run
    meant for the CPU names its mesh."""
    return init_device_mesh(device.type, (dist.get_world_size(),))


def shard(model, args, world, g, device):
    """FSDP2 (or zeropp.torch) on every block and the root, on the mesh of
    ``--mesh`` (HSDP's has nodes of ``g`` ranks); zeropp's logical nodes
    only when ``--ranks-per-node`` asks (else the hosts, measured)."""
    ranks_per_node = args.ranks_per_node
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        if args.bf16
        else None
    )
    kw = {"mp_policy": mp} if mp is not None else {}
    if args.islands > 1:
        # The island's own world (zeropp.torch.init_islands).
        args.island_mesh = kw["mesh"] = job_mesh(device)
    elif args.mesh == "hsdp":
        kw["mesh"] = init_device_mesh(
            device.type,
            (world // g, g),
            mesh_dim_names=("replicate", "shard"),
        )
    elif args.mesh == "sub":
        if world % 2:
            raise SystemExit(f"--mesh sub cuts the job into pairs of ranks: {world} is odd")
        kw["mesh"] = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("dp", "other"))[
            "dp"
        ]
    else:
        kw["mesh"] = job_mesh(device)
    if args.mode in ("zeropp", "zero3"):
        switches = {}
        for s in args.switch:
            name, _, raw = s.partition("=")
            switches[name] = switch_value(raw)
        for b in model.blocks:
            zeropp.torch.fully_shard(
                b,
                mode=args.mode,
                transport=args.transport,
                ranks_per_node=ranks_per_node,
                seed=args.seed,
                **switches,
                **kw,
            )
        zeropp.torch.fully_shard(
            model,
            mode=args.mode,
            transport=args.transport,
            ranks_per_node=ranks_per_node,
            seed=args.seed,
            **switches,
            **kw,
        )
        return zeropp.torch.resolved_switches()[args.mode]["switches"]
    for b in model.blocks:
        fsdp_fully_shard(b, **kw)
    fsdp_fully_shard(model, **kw)
    return {}


def open_device(kind, islands=1):
    """This rank's device; for CUDA, the process group gets NCCL beside gloo.
    With islands, each island gets a torch.distributed world of its own."""

    def init(backend):
        if islands > 1:
            zeropp.torch.init_islands(backend, islands)
        else:
            dist.init_process_group(backend)

    if kind == "cpu":
        init("gloo")
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: PyTorch sees no CUDA device here")
    local, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    count = torch.cuda.device_count()
    if local_world > count and "NCCL_HOSTID" not in os.environ:
        # NCCL refuses two ranks of one host on one device; ranks that share
        # a GPU (a test on one GPU) pose as separate hosts, so NCCL connects
        # them through its network transport.
        os.environ["NCCL_HOSTID"] = f"{os.uname().nodename}-rank{os.environ['RANK']}"
    device = torch.device("cuda", local % count)
    torch.cuda.set_device(device)
    init("cpu:gloo,cuda:nccl")
    return device


def main(argv=None):
    args = parse_args(argv)
    if args.mode == "hsdp":
        args.mode, args.mesh = "fsdp2", "hsdp"
    if args.islands > 1 and (args.mode not in ("zeropp", "zero3") or args.mesh != "world"):
        raise SystemExit("--islands runs the zeropp modes on their own (island, shard) mesh")
    if args.lora and args.model != "llama":
        raise SystemExit("--lora fine-tunes the transformers Llama: add --model llama")
    torch.set_num_threads(args.threads)
    device = open_device(args.device, args.islands)
    # The job's rank and size (under islands, dist's are the island's).
    isl = zeropp.torch.island()
    rank, world = (isl.rank, isl.world) if isl else (dist.get_rank(), dist.get_world_size())
    g = (
        args.ranks_per_node
        or int(os.environ.get("ZEROPP_RANKS_PER_NODE", 0))
        or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    )
    lead = rank == 0
    torch.manual_seed(args.seed)
    if args.model == "gpt":
        model = GPT(args.width, args.layers, args.heads, args.context)
    else:
        model = Llama(args.width, args.layers, args.heads, args.context, lora=args.lora)
    model = model.to(device)
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    switches = shard(model, args, dist.get_world_size(), g, device)
    if args.local_reduce_scatter:
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_custom_reduce_scatter(LocalReduceScatter())
    zjob = zeropp.torch.job() if args.mode in ("zeropp", "zero3") else None
    nodes = (zjob.nodes * (args.islands if isl else 1)) if zjob else world // g
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / warmup)
            * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, args.steps)))))
        ),
    )
    outer = None
    # The step the loop starts after (a restarted island rejoins later).
    start = 0
    if args.islands > 1:
        outer = zeropp.torch.OuterSync(
            model,
            opt,
            args.island_mesh,
            sync_every=args.sync_every,
            lr=args.outer_lr,
            momentum=args.outer_momentum,
            bits=None if args.outer_bits == 32 else 4,
            fragments=args.outer_fragments,
            delay=args.outer_delay,
            # The islands' outer sync runs over TCP (the island's own
            # collectives over --transport).
            transport=None,
            ranks_per_node=args.ranks_per_node,
        )
        start = outer.steps
        if start:
            print(
                f"rank {rank}: island {isl.index} rejoined after step {start}, "
                f"{time.time() - _started():.1f} s after this rank started; "
                f"state {state_digest(model, opt, outer)}",
                flush=True,
            )
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # stepped before the optimizer, on purpose
                for _ in range(start):
                    sched.step()
    island_size = world // args.islands
    data = Data(args.seed, rank, world)
    tokens_per_step = args.batch * args.context * world
    # A restarted rank 0 (island 0 rejoined) goes on with the run's file.
    metrics = open(args.metrics, "a" if start else "w") if (lead and args.metrics) else None
    if lead:
        if args.islands > 1 and island_size == 1:
            # FSDP2 over one rank gathers and reduces nothing.
            shards = "no collective inside an island (each is one rank)"
        elif switches:
            shards = f"switches {json.dumps(switches)}"
        else:
            shards = "switches (FSDP2, PyTorch collectives)"
        print(
            f"{args.mode}: {params} parameters ({trainable} trained), {world} ranks on "
            f"{nodes} node(s), {shards} on {device.type}",
            flush=True,
        )
    losses, times, backward_times, across, inside = [], [], [], [], []
    before = zeropp.torch.traffic() if zjob else None
    loop_start = time.perf_counter()
    rejoins = len(outer.rejoined) if outer is not None else 0
    for step in range(start, args.steps):
        x, y = data.batch(step, args.batch, args.context, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))
        if device.type == "cuda":
            torch.cuda.synchronize()
        tb = time.perf_counter()
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        backward_times.append(time.perf_counter() - tb)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        (outer or opt).step()
        if outer is not None and len(outer.rejoined) > rejoins:
            # What the island that rejoined was sent: the same digest there.
            rejoins = len(outer.rejoined)
            print(
                f"rank {rank}: state after step {step + 1} sent to a rejoining island "
                f"{state_digest(model, opt, outer)}",
                flush=True,
            )
        opt.zero_grad(set_to_none=True)
        sched.step()
        mean_loss = loss.detach().clone()
        # Per-step metrics stay inside the island: no step waits on another.
        dist.all_reduce(mean_loss)
        mean_loss = mean_loss.item() / island_size
        if device.type == "cuda":
            torch.cuda.synchronize()
        if args.pace:
            time.sleep(max(0.0, args.pace - (time.perf_counter() - t0)))
        dt = time.perf_counter() - t0
        losses.append(mean_loss)
        times.append(dt)
        job_bytes = [0.0, 0.0]
        if zjob:
            now = zeropp.torch.traffic()
            mine = torch.tensor(
                [_phase_sum(now, before, "intra_node"), _phase_sum(now, before, "inter_node")],
                dtype=torch.float64,
            )
            dist.all_reduce(mine)
            # The islands' bytes are alike (the same collectives), over the
            # islands taking part.
            taking_part = len(outer.survivors()) // island_size if outer else args.islands
            job_bytes = [b * taking_part for b in mine.tolist()]
            before = now
            inside.append(job_bytes[0])
            across.append(job_bytes[1])
        if metrics:
            metrics.write(
                json.dumps(
                    {
                        "step": step + 1,
                        "loss": mean_loss,
                        "grad_norm": float(norm.full_tensor())
                        if hasattr(norm, "full_tensor")
                        else float(norm),
                        "lr": sched.get_last_lr()[0],
                        "step_time_s": dt,
                        "tokens_per_s": tokens_per_step / dt,
                        "bytes_intra_node": job_bytes[0] if zjob else None,
                        "bytes_inter_node": job_bytes[1] if zjob else None,
                    }
                )
                + "\n"
            )
            metrics.flush()  # a line a step, for whoever follows the run
        if lead and ((step + 1) % args.log_every == 0 or step == 0 or step + 1 == args.steps):
            # PyTorch's own modes count no bytes.
            crossed = (
                f"{job_bytes[1] / 1e6:>8.3f} MB across nodes/step"
                if zjob
                else "(bytes not counted in PyTorch's own modes)"
            )
            print(
                f"step {step + 1:>5}/{args.steps} loss {mean_loss:.4f} "
                f"lr {sched.get_last_lr()[0]:.2e} {tokens_per_step / dt:>8.0f} tok/s {crossed}",
                flush=True,
            )
    # The training steps' wall time (an outer step on the way included).
    loop_s = time.perf_counter() - loop_start
    # What follows runs over this island's world; its sums stand for every
    # island taking part (alike: one model, the same collectives).
    alive, taking_part = world, 1
    if outer is not None:
        # The last outer step where needed, so every island holds one model.
        outer.finish()
        alive, taking_part = island_size, len(outer.survivors()) // island_size
        # The island's weights, shard by shard (equal on every island now).
        digests = [None] * dist.get_world_size()
        dist.all_gather_object(digests, _digest(_local(p) for p in model.parameters()))
        if dist.get_rank() == 0:
            print(f"island {isl.index} weights {'-'.join(digests)}", flush=True)
            print(f"island {isl.index} longest step {max(times, default=0):.2f} s", flush=True)
    val = []
    with torch.no_grad():
        for i in range(4):
            x, y = data.batch(i, args.batch, args.context, val=True, device=device)
            logits = model(x)
            v = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))
            dist.all_reduce(v)
            val.append(v.item() / alive)
    run = None
    if zjob:
        # The whole run's bytes (training and validation) and messages, as
        # zeropp train's summary counts them.
        t = zeropp.torch.traffic()
        mine = torch.tensor(
            [sum(t[p]["total"][hop] for p in PHASES) for hop in ("intra_node", "inter_node")]
            + [t["messages"]["intra_node"], t["messages"]["inter_node"]],
            dtype=torch.float64,
        )
        dist.all_reduce(mine)
        run = [x * taking_part for x in mine.tolist()]
    # A rank restarted and taken back at the last step trained none of its
    # own: its summary says so (None) rather than fail.
    tail = losses[-10:]

    def median(xs):
        return statistics.median(xs) if xs else None

    summary = {
        "mode": args.mode,
        "mesh": args.mesh,
        "model": args.model,
        "lora": args.lora,
        "device": device.type,
        "switches": switches,
        "world_size": world,
        "nodes": nodes,
        "params": params,
        "trainable_params": trainable,
        "steps": args.steps,
        "initial_loss": losses[0] if losses else None,
        "final_loss": sum(tail) / len(tail) if tail else None,
        "val_loss": sum(val) / len(val),
        "tokens_per_s": tokens_per_step / median(times) if times else None,
        "median_step_time_s": median(times),
        "mean_step_time_s": loop_s / args.steps,
        "median_backward_s": median(backward_times),
        "local_reduce_scatter": args.local_reduce_scatter,
        "bytes_per_step": {
            "intra_node": statistics.fmean(inside) if inside else None,
            "inter_node": statistics.fmean(across) if across else None,
        },
        "losses": losses,
    }
    summary["thread_cpu_s"] = thread_cpu_s()
    if zjob:
        summary["why"] = zeropp.torch.resolved_switches()[args.mode]["why"]
        # The mesh dimensions zeropp served, and this rank's bytes by phase
        # and hop (HSDP's replicate all-reduce is its own phase).
        summary["mesh_dims"] = zeropp.torch.resolved_switches()[args.mode]["mesh"]
        summary["traffic"] = zeropp.torch.traffic()
        summary["measured"] = zeropp.torch.measured()
    if outer is not None:
        t = zeropp.torch.traffic()["outer"]["total"]["inter_node"]
        mine = torch.tensor([t], dtype=torch.float64)
        dist.all_reduce(mine)
        summary["islands"] = {
            "lost": [{"island": i, "step": at, "why": why} for i, at, why in outer.lost],
            "rejoined": [{"island": i, "step": at} for i, at in outer.rejoined],
            "count": args.islands,
            "ranks_per_island": island_size,
            "sync_every": args.sync_every,
            "outer_bits": args.outer_bits,
            "outer_bytes": mine.item() * taking_part,
            "outer_state_bytes": outer.state_bytes(),
        }
    if run is not None:
        summary["run_bytes"] = {"intra_node": run[0], "inter_node": run[1]}
        summary["run_messages"] = {"intra_node": run[2], "inter_node": run[3]}
        summary["device_calls"] = zeropp.torch.device_calls()
        summary["in_flight_peak"] = zeropp.torch.in_flight_peak()
    if lead and not losses:
        print(
            f"done: no step of this rank's own (taken back after the last step), validation "
            f"{summary['val_loss']:.4f}",
            flush=True,
        )
    elif lead:
        print(
            f"done: loss {summary['initial_loss']:.4f} -> {summary['final_loss']:.4f} "
            f"(last {'step' if len(tail) == 1 else f'{len(tail)} steps'}), "
            f"validation {summary['val_loss']:.4f}; "
            f"{summary['tokens_per_s']:.0f} tokens/s",
            flush=True,
        )
        if args.summary_json:
            with open(args.summary_json, "w") as f:
                json.dump(summary, f, indent=1)
    if metrics:
        metrics.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _digest(tensors):
    """A short digest of tensors' bits."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def state_digest(model, opt, outer):
    """A digest of this rank's training state, bit for bit: its parameter
    shards, the optimizer's per-parameter state (AdamW's moments and step)
    and the outer anchors and momenta."""
    tensors = [_local(p) for p in model.parameters()]
    for _, per in sorted(opt.state_dict()["state"].items()):
        tensors += [_local(v) for _, v in sorted(per.items()) if isinstance(v, torch.Tensor)]
    sd = outer.state_dict()
    tensors += [_local(sd[k][n]) for k in ("anchors", "momenta") for n in sorted(sd[k])]
    return _digest(tensors)


def _started():
    """When this process started (the epoch's seconds; now where unknown)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def _local(p):
    """This rank's shard of a parameter."""
    return p.to_local() if hasattr(p, "to_local") else p


PHASES = ("forward_gather", "backward_gather", "gradient", "other", "replicate", "outer", "frozen")


def thread_cpu_s():
    """CPU seconds this process's threads used so far, by thread name
    (Linux; {} elsewhere): the compute thread against zeropp's and gloo's."""
    out = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return out
    tick = os.sysconf("SC_CLK_TCK")
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _phase_sum(now, before, hop):
    return float(sum(now[p]["total"][hop] - before[p]["total"][hop] for p in PHASES))


if __name__ == "__main__":
    code = main()
    # PyTorch 2.15's gloo backend aborts at interpreter exit in about one run
    # in ten ("terminate called without an active exception"; plain FSDP2
    # without zeropp too): once everything is written, leave without the C++
    # teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
