#!/usr/bin/env bash
# The whole test suite: installs what it needs, then runs every test of the
# workspace (unit, property and whole-program tests in Rust, the launcher
# tests under real mpirun, torchrun and srun), lints the
# Python side and runs its tests (pytest: zeropp.quant, topology, and
# zeropp.torch inside real FSDP2 jobs: ranks started as torchrun starts them,
# the recipes under torchrun and accelerate launch).
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
phase() { echo "test.sh: $* ($((SECONDS / 60)) min in)" >&2; }
phase "the Rust tests"
# They build target/debug/zeropp too (the root crate's integration tests run
# it), with the features the tests unify: building it again alone would
# rebuild every dependency for its own feature set.
cargo test --workspace
test -x target/debug/zeropp
phase "ruff"
"$ZEROPP_VENV_BIN/ruff" check python examples
"$ZEROPP_VENV_BIN/ruff" format --check python examples
# The Python tests run against the installed wheel, not the source tree.
(cd /tmp && "$ZEROPP_PYTHON" -c 'import sys, zeropp
assert zeropp.__file__.startswith(sys.prefix), f"zeropp from {zeropp.__file__}, not {sys.prefix}"
print(f"zeropp.torch tests against the wheel in {sys.prefix}")')
phase "the Python tests"
ZEROPP_BIN="$PWD/target/debug/zeropp" "$ZEROPP_PYTHON" -m pytest -q --durations=15 python/tests
phase "done"
