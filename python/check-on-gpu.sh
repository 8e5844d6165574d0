#!/usr/bin/env bash
# One short run on a machine with an NVIDIA GPU, PyTorch and pytest (no Rust,
# no network needed) that proves zeropp's CUDA path:
#
#   bash python/build-gpu-check.sh           # where Rust is; fills device-bin/
#   bash python/check-on-gpu.sh device-bin   # on the GPU machine, < 10 minutes
#
# 1. the kernels (cuda/check-on-gpu.sh: compile for sm_90, every GPU test
#    against the CPU library, the kernel benchmark);
# 2. zeropp.torch on CUDA tensors inside real FSDP2 steps, 4 ranks as 2
#    logical nodes (python/gpu_tests: the CUDA path's losses equal the CPU
#    path's within 1e-3, ZeRO-3 mode equals FSDP2 over NCCL, bf16 ZeRO++
#    trains like bf16 FSDP2, a quarter of the bytes across nodes, a killed
#    rank named by the others);
# 3. step times of zeropp.torch and FSDP2 over NCCL on the same model, and
#    how much of each one's backward reduce-scatter is exposed (its backward
#    against the same run with the reduce-scatter replaced by a local copy).
#
# ZEROPP_GPU_PARTS picks parts (default "torch kernels bench": at most 7, 4
# and 5 minutes by their time limits; the usual run is well under). Where one
# call may take 10 minutes, run "torch" in one and "kernels bench" in the next.
# Writes logs and summaries to $ZEROPP_GPU_RESULTS (default: $OUT when set,
# else /tmp/zeropp-gpu-results). Exits non-zero if anything failed.
set -uo pipefail
cd "$(dirname "$0")/.."
dir=${1:-device-bin}
results=${ZEROPP_GPU_RESULTS:-${OUT:-/tmp/zeropp-gpu-results}}
mkdir -p "$results"
export ZEROPP_GPU_RESULTS=$results
export ZEROPP_CACHE_DIR=${ZEROPP_CACHE_DIR:-$(mktemp -d)}
# Ranks that share a GPU pose as separate hosts (NCCL_HOSTID, set by the
# example per rank) and reach each other through NCCL's sockets on loopback.
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}
export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-1}
export NCCL_NET_PLUGIN=${NCCL_NET_PLUGIN:-none}
python=${PYTHON:-python3}
python=$(command -v "$python") || { echo "no $python here" >&2; exit 2; }
# zeropp finds NVRTC, the CUDA headers and NCCL in that Python's nvidia wheels.
export PATH=$(dirname "$python"):$PATH
echo "$("$python" -V), $(ldd --version 2>&1 | head -1)"
"$python" -c "import torch" || { echo "$python has no torch: install it" >&2; exit 2; }
wheel=$(ls "$dir"/zeropp-*.whl 2>/dev/null | head -1)
[ -n "$wheel" ] || { echo "no zeropp wheel in $dir: run python/build-gpu-check.sh" >&2; exit 2; }
site=$(mktemp -d)
"$python" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheel" || exit 2
# numpy and pytest from the carried wheels when this Python lacks them.
for m in numpy pytest; do
  "$python" -c "import $m" 2>/dev/null && continue
  echo "$python lacks $m: installing it from $dir/wheels"
  "$python" -m pip install -q --no-index --find-links "$dir/wheels" --no-compile --target "$site" "$m" ||
    { echo "could not install $m from $dir/wheels" >&2; exit 2; }
done
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
"$python" -c "import numpy, pytest, zeropp, torch; print('zeropp', zeropp.__file__, 'torch', torch.__version__)" ||
  exit 2
summary=$results/summary.txt
: >"$summary"

step() { # name, timeout, command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  if timeout "$limit" "$@" >"$results/$name.out" 2>&1; then r=ok; else r="FAILED ($?)"; fi
  printf '%-12s %-12s %4ss\n' "$name" "$r" "$((SECONDS - t0))" >>"$summary"
  echo "== $name: $r"
  tail -n 30 "$results/$name.out"
}

parts=" ${ZEROPP_GPU_PARTS:-torch kernels bench} "
if [[ $parts == *" torch "* ]]; then
  # Compiles the kernels for this GPU once (ZEROPP_CACHE_DIR) before four
  # ranks at a time need them, and checks borrowed memory and streams.
  step warm 120 "$dir/gpu-tests" --include-ignored --exact \
    borrowed_memory_and_streams_work_like_owned_ones
  # ZEROPP_GPU_PYTEST: more pytest arguments, e.g. "-k kill" to rerun one test.
  # shellcheck disable=SC2086
  step torch 420 "$python" -m pytest -q -s python/gpu_tests ${ZEROPP_GPU_PYTEST:-}
fi
if [[ $parts == *" kernels "* ]]; then
  ZEROPP_BENCH_MIB=${ZEROPP_BENCH_MIB:-256} step kernels 240 bash cuda/check-on-gpu.sh "$dir"
fi
if [[ $parts == *" bench "* ]]; then
  # Step times on the bench model (3.76M parameters, bf16), 2 x 2 on this GPU.
  bench=(--width 384 --layers 2 --heads 6 --context 32 --batch 2 --bf16 --steps 20
    --ranks-per-node 2 --device cuda --log-every 1000)
  for mode in zeropp fsdp2; do
    for local in "" --local-reduce-scatter; do
      name=bench-$mode${local:+-local}
      step "$name" 75 "$python" -m torch.distributed.run --standalone --nproc-per-node 4 \
        examples/torch_gpt.py --mode "$mode" "${bench[@]}" ${local:+"$local"} \
        --summary-json "$results/$name.json"
    done
  done
fi

echo
echo "== GPU check summary"
cat "$summary"
"$python" - "$results" <<'PY'
import json, pathlib, sys
r = pathlib.Path(sys.argv[1])
f = r / "results.json"
if f.exists():
    print(json.dumps(json.loads(f.read_text()), indent=1))
t = {}
for m in ("zeropp", "fsdp2"):
    p, local = r / f"bench-{m}.json", r / f"bench-{m}-local.json"
    if p.exists():
        s = json.loads(p.read_text())
        t[m] = s["median_step_time_s"]
        print(f"bench {m}: median step {t[m]:.4f} s, backward {s['median_backward_s']:.4f} s")
        if local.exists():
            alone = json.loads(local.read_text())["median_backward_s"]
            exposed = s["median_backward_s"] - alone
            print(f"bench {m}: backward without the reduce-scatter {alone:.4f} s: "
                  f"{exposed:.4f} s of the reduce-scatter exposed")
if len(t) == 2:
    print(f"bench zeropp / fsdp2 step time: {t['zeropp'] / t['fsdp2']:.3f}")
PY
! grep -q FAILED "$summary"
