#!/usr/bin/env bash
# The Python side's environment: a virtual environment (reused between runs;
# ZEROPP_VENV, default ~/.cache/zeropp/venv) with PyTorch, pytest, ruff,
# transformers, accelerate and peft (the recipes' tests) from PyPI; this
# checkout's `zeropp` wheel (PyO3 + maturin) installed into it and into a
# clean environment beside it ($venv-wheel) that the tests run in. Sourced by
# scripts/test.sh; sets ZEROPP_PYTHON (the clean one's) and ZEROPP_VENV_BIN.
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
  if ! "$venv/bin/python" -c "import torch, numpy, pytest, maturin, transformers, accelerate, peft" \
       2>/dev/null || ! "$venv/bin/ruff" --version >/dev/null 2>&1; then
    echo "installing torch, numpy, pytest, ruff, maturin, transformers, accelerate and peft from" \
      "PyPI into $venv" >&2
    "${pip[@]}" 'torch>=2.7' numpy pytest ruff 'maturin>=1.16,<2' 'transformers>=4.40' \
      'accelerate>=1.10' 'peft>=0.13'
  fi
  # The wheel a user installs: abi3 (CPython >= 3.11), manylinux, built by
  # maturin; UCX, CUDA and NCCL are loaded at run time, not linked.
  echo "building the zeropp wheel (python/, maturin) into target/wheels" >&2
  rm -f target/wheels/zeropp-*.whl
  PATH="$venv/bin:$PATH" maturin build --quiet --release -m python/Cargo.toml --out target/wheels
  local wheel
  wheel="$(ls target/wheels/zeropp-*.whl)"
  "${pip[@]}" --force-reinstall --no-deps "$wheel"
  # The tests run against that wheel in a clean environment with no source
  # tree or build behind it: its own site-packages hold zeropp alone; torch,
  # numpy and pytest come from $venv through a .pth (read after its own).
  local clean="$venv-wheel" deps
  python3 -m venv --clear "$clean"
  # The wheel first: with the .pth in place pip would find $venv's zeropp.
  "$clean/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "$wheel"
  deps="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  "$clean/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' |
    { read -r site; echo "$deps" > "$site/zeropp-deps.pth"; }
  ZEROPP_PYTHON="$clean/bin/python"
  ZEROPP_VENV_BIN="$venv/bin"
  export ZEROPP_PYTHON ZEROPP_VENV_BIN
}
