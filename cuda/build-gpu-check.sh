#!/usr/bin/env bash
# Builds what cuda/check-on-gpu.sh runs, on a machine with Rust (the GPU
# machine may have none): the release `zeropp` binary and the GPU test
# binaries (the kernels: `gpu-tests`; the ZeRO++ collectives on the device
# against the host library: `device-tests`), copied to target/gpu-check/
# (git-ignored; pass it to the GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/gpu-check
mkdir -p "$out"
cargo build --release --bin zeropp
cp target/release/zeropp "$out/zeropp"
test_binary() { # package, test target: the path of its release test binary
  cargo test --release -p "$1" --test "$2" --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])' "$2"
}
exe=$(test_binary zeropp-cuda gpu)
[ -n "$exe" ] || { echo "could not find the GPU test binary" >&2; exit 1; }
cp "$exe" "$out/gpu-tests"
exe=$(test_binary zeropp-zero device_collectives)
[ -n "$exe" ] || { echo "could not find the device collectives test binary" >&2; exit 1; }
cp "$exe" "$out/device-tests"
ls -la "$out"
