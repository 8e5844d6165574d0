#!/usr/bin/env bash
# Compute against PyTorch, measured in one run on the same GPT (issue 17):
# the median training step of `zeropp train --mode zero3` and of the same
# model in PyTorch (examples/torch_gpt.py, FSDP2 over gloo), for two
# shapes, on one rank with one compute thread each, and as 2 x 2 ranks on
# this machine (zeropp over its default transport, PyTorch FSDP2 over gloo,
# one thread per rank). Prints each pair and the ratio zeropp / PyTorch
# (below 1: zeropp is faster). Run it on an otherwise idle machine:
#
#   bash scripts/bench-compute.sh target/release/zeropp ~/.cache/zeropp/venv/bin/python
set -euo pipefail
cd "$(dirname "$0")/.."
zeropp="${1:-target/release/zeropp}"
python="${2:-${ZEROPP_PYTHON:-python3}}"
steps="${STEPS:-40}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
[ -x "$zeropp" ] || { echo "no zeropp at $zeropp: cargo build --release" >&2; exit 1; }
"$python" -c "import torch, zeropp.torch" || { echo "$python lacks torch or zeropp" >&2; exit 1; }

median() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['median_step_time_s'])" "$1"; }

run_pair() { # label, ranks per node, nodes, shape...
  local label="$1" g="$2" n="$3"; shift 3
  local w=$((g * n))
  RAYON_NUM_THREADS=1 "$zeropp" train --mode zero3 --nodes "$n" --ranks-per-node "$g" \
    --steps "$steps" --log-every 1000 --val-batches 1 --summary-json "$out/z.json" "$@" >/dev/null
  OMP_NUM_THREADS=1 "$python" -m torch.distributed.run --standalone --nproc-per-node "$w" \
    examples/torch_gpt.py --mode fsdp2 --threads 1 --steps "$steps" --log-every 1000 \
    --summary-json "$out/t.json" "$@" >/dev/null 2>"$out/t.err" || { cat "$out/t.err" >&2; exit 1; }
  local z t
  z="$(median "$out/z.json")"; t="$(median "$out/t.json")"
  python3 -c "import sys; z,t=float(sys.argv[2]),float(sys.argv[3]); print(f'{sys.argv[1]:<34} zeropp {z:.4f} s  PyTorch {t:.4f} s  zeropp/PyTorch {z/t:.2f}x')" \
    "$label" "$z" "$t"
}

small=(--width 64 --layers 2 --heads 4 --context 64 --batch 8)
wide=(--width 384 --layers 2 --heads 6 --context 32 --batch 2)
run_pair "137K params, 1 rank, 1 thread" 1 1 "${small[@]}"
run_pair "3.76M params, 1 rank, 1 thread" 1 1 "${wide[@]}"
run_pair "137K params, 2x2 ranks" 2 2 "${small[@]}"
run_pair "3.76M params, 2x2 ranks" 2 2 "${wide[@]}"
