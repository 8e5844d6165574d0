#!/usr/bin/env bash
# Builds what cuda/check-on-gpu.sh runs, on a machine with Rust (the GPU
# machine may have none): the release `zeropp` binary and the GPU test binary,
# copied to target/gpu-check/ (git-ignored; pass it to the GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/gpu-check
mkdir -p "$out"
cargo build --release --bin zeropp
cp target/release/zeropp "$out/zeropp"
exe=$(cargo test --release -p zeropp-cuda --test gpu --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu":
        print(m["executable"])')
[ -n "$exe" ] || { echo "could not find the GPU test binary" >&2; exit 1; }
cp "$exe" "$out/gpu-tests"
ls -la "$out"
