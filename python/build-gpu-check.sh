#!/usr/bin/env bash
# Builds everything python/check-on-gpu.sh runs, on a machine with Rust (the
# GPU machine may have none and no network): the kernel checks' binaries
# (cuda/build-gpu-check.sh) and the zeropp wheel (release, abi3: any CPython
# >= 3.11), all in device-bin/ (git-ignored; carry it to the GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
out=device-bin
bash cuda/build-gpu-check.sh
mkdir -p "$out"
cp target/gpu-check/zeropp target/gpu-check/gpu-tests "$out/"
rm -f "$out"/zeropp-*.whl
python=${ZEROPP_PYTHON:-${ZEROPP_VENV:-$HOME/.cache/zeropp/venv}/bin/python}
"$python" -m maturin build --release --strip --manifest-path python/Cargo.toml \
  --compatibility linux --out "$out"
ls -la "$out"
du -sh "$out"
