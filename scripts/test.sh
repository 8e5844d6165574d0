#!/usr/bin/env bash
# The whole test suite: installs what it needs, then runs every test of the
# workspace (unit, property and whole-program tests in Rust, the launcher
# tests under real mpirun, torchrun and srun), lints the
# Python side and runs its tests (pytest: zeropp.quant, topology, and
# zeropp.torch inside real FSDP2 jobs under torchrun).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
source scripts/python-env.sh
zeropp_install_cuda_wheels
zeropp_python_env
# A single-node Slurm (munged, slurmctld, slurmd) for the srun launcher
# test; quick when it already runs.
if [ "$(id -u)" -eq 0 ]; then
  SLURM_FIX_HOSTS=1 bash scripts/slurm.sh >/dev/null
else
  sudo SLURM_FIX_HOSTS=1 bash scripts/slurm.sh >/dev/null
fi
cargo test --workspace
cargo build --bin zeropp
"$(dirname "$ZEROPP_PYTHON")/ruff" check python examples
"$(dirname "$ZEROPP_PYTHON")/ruff" format --check python examples
ZEROPP_BIN="$PWD/target/debug/zeropp" "$ZEROPP_PYTHON" -m pytest -q python/tests
