#!/usr/bin/env bash
# zeropp.torch on one host against PyTorch's FSDP2 (gloo) on the same model
# (issue 29): 4 ranks under torchrun --standalone, one compute thread each,
# examples/torch_gpt.py in each mode, the modes interleaved and the whole
# round repeated (ROUNDS, default 2) so the ratios are measured in the same
# run. Two models: transformers' LlamaForCausalLM (hidden 256, 4 layers, 8
# heads, 2 key/value heads, fp32) and the GPT of docs/BENCHMARKS.md (width
# 384, 2 layers, bf16). Prints each run's median step and, per model, the
# median over rounds of each mode against FSDP2 (below 1: zeropp faster).
#
#   bash scripts/bench-torch-one-node.sh ~/.cache/zeropp/venv/bin/python
set -euo pipefail
cd "$(dirname "$0")/.."
python="${1:-${ZEROPP_PYTHON:-python3}}"
steps="${STEPS:-40}"
rounds="${ROUNDS:-2}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
"$python" -c "import torch, transformers, zeropp.torch" \
  || { echo "$python lacks torch, transformers or zeropp" >&2; exit 1; }

models=(
  "llama|--model llama --width 256 --layers 4 --heads 8 --context 32 --batch 2"
  "gpt-bf16|--model gpt --width 384 --layers 2 --heads 6 --context 32 --batch 2 --bf16"
)
for entry in "${models[@]}"; do
  name="${entry%%|*}"
  read -r -a args <<<"${entry#*|}"
  for round in $(seq "$rounds"); do
    for mode in fsdp2 zero3 zeropp; do
      OMP_NUM_THREADS=1 "$python" -m torch.distributed.run --standalone --nproc-per-node 4 \
        examples/torch_gpt.py --mode "$mode" --threads 1 --steps "$steps" --log-every 1000 \
        --summary-json "$out/$name-$mode-$round.json" "${args[@]}" >/dev/null 2>"$out/err" \
        || { cat "$out/err" >&2; exit 1; }
    done
  done
  "$python" - "$out" "$name" "$rounds" <<'PY'
import json, statistics, sys
out, name, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
t = {m: [json.load(open(f"{out}/{name}-{m}-{r}.json"))["median_step_time_s"]
         for r in range(1, rounds + 1)] for m in ("fsdp2", "zero3", "zeropp")}
ratio = {m: statistics.median(a / b for a, b in zip(t[m], t["fsdp2"])) for m in t}
zpp = json.load(open(f"{out}/{name}-zeropp-1.json"))
for m in t:
    runs = " ".join(f"{x:.3f}" for x in t[m])
    print(f"{name:>9} {m:>6}: median step {runs} s   vs FSDP2 {ratio[m]:.2f}")
print(f"{name:>9} zeropp ran with qwz_bits={zpp['switches']['qwz_bits']} qgz={zpp['switches']['qgz']}"
      f" hpz={zpp['switches']['hpz']}: {zpp['why'].get('qwz_bits', '')}")
PY
done
