#!/usr/bin/env bash
# SGLang's served environment: the venv in which the tests (tests/test_sglang_server.py) and the
# served benchmark (scripts/bench_sglang_serve.py) start SGLang 0.5.23's own server on the CPU.
# SGLang pins torch 2.14.1 (PyPI's build, which runs on the CPU), which the main venv's vLLM does
# not take: so it is a venv of its own, at the exact versions of scripts/constraints-sglang.txt.
# Two test fixtures make SGLang's CPU engine serve with its hierarchical cache on a CPU without
# AMX (tests/sglang_server/: a plain-torch stand-in for the few sgl_kernel functions it calls,
# and two small edits to its host pool); hicache itself is installed as the main venv has it.
#   HICACHE_SGLANG_VENV=DIR    the venv to create or complete (default .venv-sglang)
#   HICACHE_SGLANG_LOCK=FILE   the constraints to install with; "none": the newest of everything
#   HICACHE_SGLANG_FREEZE=FILE write what got installed there
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${HICACHE_SGLANG_VENV:-.venv-sglang}
lock=${HICACHE_SGLANG_LOCK:-scripts/constraints-sglang.txt}
if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$venv"
fi
py=$venv/bin/python
pip() { nice -n 10 "$py" -m pip "$@" --disable-pip-version-check -q; }
quiet() { grep -v "^WARNING: Location" || true; }
step() { echo "setup (SGLang's server): $*" >&2; }
locked=()
if [ "$lock" != none ]; then
  [ -f "$lock" ] || { echo "setup: no constraints file $lock" >&2; exit 1; }
  locked=(-c "$lock")
fi
if ! "$py" -c "import torchvision, sglang.srt.server_args" 2>/dev/null; then
  step "installing torch 2.14.1, SGLang 0.5.23 and its requirements (about 7 GB)"
  pip install "${locked[@]}" torch==2.14.1 torchvision==0.29.1 setuptools wheel 2>&1 | quiet
  pip install "${locked[@]}" --no-deps sglang==0.5.23 2>&1 | quiet
  # SGLang's own requirements, less those that are for CUDA only
  mapfile -t reqs < <("$py" - <<'PY'
import importlib.metadata as md
import re
CUDA_ONLY = {"cuda-python", "flash-attn-4", "flashinfer-python", "humming-kernels",
             "nvidia-cutlass-dsl", "nvidia-mathdx", "nvshmem4py-cu13", "quack-kernels",
             "sgl-deep-ep", "sgl-deep-gemm", "sgl-flash-mla", "sglang-kernel", "tilelang",
             "torch-memory-saver", "torchaudio", "torchcodec"}
for req in md.requires("sglang"):
    if "extra ==" in req:
        continue
    name = re.match(r"[A-Za-z0-9_.-]+", req).group(0)
    if re.sub(r"[-_.]+", "-", name).lower() not in CUDA_ONLY:
        print(req.split(";")[0].strip() if ";" not in req else req)
PY
  )
  pip install "${locked[@]}" torch==2.14.1 torchvision==0.29.1 "${reqs[@]}" 2>&1 | quiet \
    | grep -vE "^ERROR: pip's dependency resolver|^sglang 0\.5\.23 requires" || true
fi
step "the CPU fixtures (tests/sglang_server/) and hicache"
pip install --no-deps --no-build-isolation --force-reinstall tests/sglang_server/sgl_kernel_cpu \
  2>&1 | quiet
"$py" tests/sglang_server/cpu_edits.py
pip install "${locked[@]}" --no-build-isolation -e . 2>&1 | quiet  # (with its requirements)
if [ -n "${HICACHE_SGLANG_FREEZE:-}" ]; then
  "$py" -m pip freeze --all --exclude-editable --disable-pip-version-check 2>/dev/null \
    | grep -vE '^(#|sgl-kernel-cpu-standin|hicache)' >"$HICACHE_SGLANG_FREEZE"
fi
# SGLang hashes a storage tier's pages with a C++ extension it compiles at its first lookup
# (11 s here, more on a loaded machine); compiled now, in the folder the tests' servers use.
# Left to the first prefetch, a /flush_cache within 10 s of it finds the prefetch thread still
# compiling and SGLang 0.5.23's scheduler dies ("Failed to stop HiCache storage threads").
step "SGLang's page hasher (a C++ extension)"
TORCH_EXTENSIONS_DIR="$venv/torch-extensions" "$py" -c "
from sglang.srt.mem_cache.cpp_utils.native_hash import _load_native_hash_module
_load_native_hash_module()" 2>&1 | grep -v "No CUDA runtime is found" || true
[ -f "$venv/torch-extensions/hicache_hash_cpp/hicache_hash_cpp.so" ] \
  || { echo "setup: SGLang's page hasher did not build (above)" >&2; exit 1; }
"$py" -c "import sglang.srt.server_args, sgl_kernel, hicache.client.sglang" \
  || { echo "setup: SGLang's server environment does not load (above)" >&2; exit 1; }
