#!/usr/bin/env bash
# The whole test suite: installs what it needs, then runs every test of the
# workspace (unit, property and whole-program tests).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
zeropp_install_cuda_wheels
cargo test --workspace
