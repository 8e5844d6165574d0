#!/usr/bin/env bash
# The main job: a small ZeRO++ training run on this machine — 2 logical
# nodes x 2 ranks over UCX (TCP if UCX is missing), built-in corpus, no download — with a summary
# and a loss plot.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
cargo build --release --bin zeropp
out="${TMPDIR:-/tmp}/zeropp-main"
mkdir -p "$out"
./target/release/zeropp train --mode zeropp --steps 200 \
  --metrics "$out/metrics.jsonl" --summary-json "$out/summary.json" --plot "$out/loss.png"
echo "metrics: $out/metrics.jsonl, summary: $out/summary.json, loss curve: $out/loss.png"
