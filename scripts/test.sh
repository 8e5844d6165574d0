#!/usr/bin/env bash
# The whole test suite: installs what it needs, then runs every test of the
# workspace (unit, property and whole-program tests in Rust), lints the
# Python side and runs its tests (pytest: zeropp.quant, topology, and
# zeropp.torch inside real FSDP2 jobs under torchrun).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
source scripts/python-env.sh
zeropp_install_cuda_wheels
zeropp_python_env
cargo test --workspace
cargo build --bin zeropp
"$(dirname "$ZEROPP_PYTHON")/ruff" check python examples
"$(dirname "$ZEROPP_PYTHON")/ruff" format --check python examples
ZEROPP_BIN="$PWD/target/debug/zeropp" "$ZEROPP_PYTHON" -m pytest -q python/tests
