#!/usr/bin/env bash
# Builds everything python/check-on-gpu.sh runs, on a machine with Rust (the
# GPU machine may have none and no network): the kernel checks' binaries
# (cuda/build-gpu-check.sh), the zeropp wheel (release, abi3: any CPython
# >= 3.11) and, for a GPU machine whose Python lacks them, numpy's and
# pytest's wheels for CPython $ZEROPP_GPU_PYTHON (default 3.12), all in
# device-bin/ (git-ignored; carry it to the GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
out=device-bin
bash cuda/build-gpu-check.sh
mkdir -p "$out"
cp target/gpu-check/zeropp target/gpu-check/gpu-tests target/gpu-check/device-tests "$out/"
rm -f "$out"/zeropp-*.whl
python=${ZEROPP_PYTHON:-${ZEROPP_VENV:-$HOME/.cache/zeropp/venv}/bin/python}
"$python" -m maturin build --release --strip --manifest-path python/Cargo.toml \
  --compatibility linux --out "$out"
rm -rf "$out/wheels"
"$python" -m pip download -q --only-binary=:all: --python-version "${ZEROPP_GPU_PYTHON:-3.12}" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$out/wheels" numpy pytest ||
  echo "warning: no numpy and pytest wheels (no package index?): the GPU machine's Python must have them" >&2
ls -la "$out" "$out/wheels"
du -sh "$out"
