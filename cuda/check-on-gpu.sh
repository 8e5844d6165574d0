#!/usr/bin/env bash
# Runs every GPU test and the GPU benchmark with prebuilt binaries, in well
# under 5 minutes on one GPU, and prints a short table last.
#
#   bash cuda/build-gpu-check.sh            # where Rust is; makes target/gpu-check
#   bash cuda/check-on-gpu.sh target/gpu-check   # on the GPU machine
#
# Needs an NVIDIA driver and NVRTC + CUDA headers (CUDA_HOME, /usr/local/cuda,
# or the nvidia-cuda-nvrtc / nvidia-cuda-runtime wheels of python3). A missing
# GPU fails the tests; nothing is skipped.
set -uo pipefail
dir=${1:-target/gpu-check}
mib=${ZEROPP_BENCH_MIB:-1024}
for f in zeropp gpu-tests device-tests; do
  [ -x "$dir/$f" ] || { echo "missing $dir/$f: run cuda/build-gpu-check.sh first" >&2; exit 2; }
done
export ZEROPP_CACHE_DIR=${ZEROPP_CACHE_DIR:-$(mktemp -d)}
log=$(mktemp -d)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -4

step() { # name, command...
  local name=$1; shift
  local t0=$SECONDS
  if timeout 240 "$@" >"$log/$name.out" 2>&1; then r=ok; else r="FAILED ($?)"; fi
  printf '%-14s %-12s %4ss\n' "$name" "$r" "$((SECONDS - t0))" >>"$log/summary"
  echo "== $name: $r"; tail -n 40 "$log/$name.out"
}

step compile "$dir/zeropp" cuda compile-check --arch sm_90
step gpu-tests "$dir/gpu-tests" --include-ignored --test-threads 1
step device-tests "$dir/device-tests" --include-ignored --test-threads 1
step bench "$dir/zeropp" cuda bench --mib "$mib" --reps 10

echo
echo "== GPU check summary"
cat "$log/summary"
echo
grep -E "kernel|x copy|^copy|^quantize|^dequantize|^swizzled|^fused" "$log/bench.out" || true
! grep -q FAILED "$log/summary"
