#!/usr/bin/env bash
# The Python side's environment: a virtual environment (reused between runs;
# ZEROPP_VENV, default ~/.cache/zeropp/venv) with PyTorch, pytest, ruff and
# transformers (for the Hugging Face export's test) from PyPI, and this
# checkout's `zeropp` package built into it (PyO3 + maturin). Sourced by
# scripts/test.sh; sets ZEROPP_PYTHON.
set -euo pipefail

zeropp_python_env() {
  local venv="${ZEROPP_VENV:-$HOME/.cache/zeropp/venv}"
  if [ ! -x "$venv/bin/python" ]; then
    echo "creating the Python environment in $venv" >&2
    python3 -m venv "$venv"
  fi
  local pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
  # torch from PyPI brings its CUDA libraries (several GB): installed once,
  # then reused.
  if ! "$venv/bin/python" -c "import torch, numpy, pytest, maturin, transformers" 2>/dev/null \
     || ! "$venv/bin/ruff" --version >/dev/null 2>&1; then
    echo "installing torch, numpy, pytest, ruff, maturin and transformers from PyPI into $venv" >&2
    "${pip[@]}" 'torch>=2.7' numpy pytest ruff 'maturin>=1.16,<2' 'transformers>=4.40'
  fi
  echo "building the zeropp Python package (python/) into $venv" >&2
  PATH="$venv/bin:$PATH" "${pip[@]}" --no-build-isolation --force-reinstall --no-deps ./python
  ZEROPP_PYTHON="$venv/bin/python"
  export ZEROPP_PYTHON
}
