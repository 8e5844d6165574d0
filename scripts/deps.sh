#!/usr/bin/env bash
# Installs the system packages zeropp needs to build and test, on Debian or
# Ubuntu, when they are missing. Sourced by scripts/main.sh and scripts/test.sh.
set -euo pipefail

# libucx0: the UCX transport (loaded at run time; TCP works without it).
# openmpi-bin: mpirun, for the launcher tests and as the collectives peer;
# libopenmpi-dev: mpicc, to build that peer (zeropp bench collectives).
zeropp_apt_packages=(build-essential pkg-config iproute2 python3 python3-venv libucx0 openmpi-bin libopenmpi-dev)

zeropp_install_deps() {
  local missing=()
  for p in "${zeropp_apt_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -eq 0 ]; then
    return 0
  fi
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "need root or sudo to install: ${missing[*]}" >&2; exit 1; }
    sudo="sudo"
  fi
  echo "installing system packages: ${missing[*]}" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
}

# NVRTC and the CUDA headers from PyPI: the tests compile every CUDA kernel
# with them (no GPU or CUDA installation needed).
zeropp_install_cuda_wheels() {
  if python3 - 2>/dev/null <<'PY'
import os, sys, nvidia
ok = any(os.path.exists(os.path.join(p, "cu13", "lib", "libnvrtc.so.13"))
         and os.path.exists(os.path.join(p, "cu13", "include", "cuda_bf16.h"))
         for p in nvidia.__path__)
sys.exit(0 if ok else 1)
PY
  then
    return 0
  fi
  if ! python3 -m pip --version >/dev/null 2>&1; then
    zeropp_apt_packages+=(python3-pip)
    zeropp_install_deps
  fi
  echo "installing NVRTC and the CUDA headers from PyPI (to compile-check the CUDA kernels)" >&2
  local wheels=('nvidia-cuda-nvrtc==13.*' 'nvidia-cuda-runtime==13.*')
  local pip=(python3 -m pip install --quiet --disable-pip-version-check)
  "${pip[@]}" "${wheels[@]}" 2>/dev/null \
    || "${pip[@]}" --user --break-system-packages "${wheels[@]}"
}

if ! command -v cargo >/dev/null; then
  echo "cargo not found: install Rust from https://rustup.rs first" >&2
  exit 1
fi
zeropp_install_deps
