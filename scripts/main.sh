#!/usr/bin/env bash
# The main job: until training lands, measure what block quantization does to
# a generated GPT-shaped checkpoint, int8 and int4 (no download).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
cargo build --release --bin zeropp
out="${TMPDIR:-/tmp}/zeropp-example.safetensors"
./target/release/zeropp example-weights "$out"
./target/release/zeropp quant-error "$out" --bits 8 --block 256
./target/release/zeropp quant-error "$out" --bits 4 --block 256
