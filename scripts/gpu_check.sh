#!/usr/bin/env bash
# The GPU check, for the lent GPU machine as it is: Python 3.12 (python3) with a CUDA build of
# torch, Triton, numpy, msgpack, psutil, xxhash, pytest, hypothesis and transformers, and no
# package index. From the development machine, once per session:
#   ./scripts/gpu_wheels.sh                                   # .whl/: pyzmq for Python 3.12
#   device run: command "bash scripts/gpu_check.sh", carry [".whl"], timeout_s 540
# It installs the carried wheels into a private folder, builds hicache in place (the C
# helpers), runs the CUDA tests and the core tests, two engine processes sharing KV through one
# CUDA daemon (in tests/test_cuda.py), the transfer benchmark on the GPU, and prints a table;
# everything it prints is also in $OUT/gpu_check.txt, the table in $OUT/gpu_table.md. Each step
# has its share of BUDGET_S seconds (480 by default), so that the call ends inside its limit.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hicache-gpu-check}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.txt") 2>&1
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
start=$(date +%s)
budget=${BUDGET_S:-480}
until_s() { echo $(( start + $1 * budget / 100 - $(date +%s) )); }  # seconds to a share's end
echo "# gpu_check $(date -u +%Y-%m-%dT%H:%MZ) at $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

echo "## setup"
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/hicache-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/hicache-site${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
"$PY" - <<'PY' || exit 1
import torch, triton, zmq
import hicache._native as native
print(f"python {__import__('sys').version.split()[0]}, torch {torch.__version__} (CUDA "
      f"{torch.version.cuda}), triton {triton.__version__}, pyzmq {zmq.__version__}, "
      f"C helpers {'built' if native.USE_C else 'MISSING'}")
assert torch.cuda.is_available(), "no CUDA device visible to torch"
PY
# what that machine does not have (tests/optional.py: declared, so skipped and listed)
export HICACHE_TESTS_WITHOUT=vllm,redis-server,mooncake

status=0
echo "## CUDA tests (pools, copiers, the engine, layer-wise loads, vLLM block copies, e2e)"
timeout "$(until_s 40)" "$PY" -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py || status=1
echo "## core tests on this machine's Python"
timeout "$(until_s 65)" "$PY" -m pytest -q -p no:cacheprovider -x \
  tests/test_tree.py tests/test_allocator.py tests/test_pools.py tests/test_transfer.py \
  tests/test_copy_paths.py tests/test_kernels.py tests/test_vllm_blocks.py \
  tests/test_failed_copies.py tests/test_pitfalls.py || status=1
echo "## transfer benchmark on the GPU"
timeout "$(until_s 95)" "$PY" -m scripts.bench_transfer --gpu | tee "$OUT/bench_transfer.txt"
echo "## table (ratios to one pinned cudaMemcpyAsync of the same bytes)"
tail -n 1 "$OUT/bench_transfer.txt" | "$PY" -c "
import json, sys
line = sys.stdin.read().strip()
r = json.loads(line) if line.startswith('{') else {}
rows = ['| copy | backup | load |', '|---|---|---|']
for key in sorted(k[:-len('_backup')] for k in r if k.endswith('_backup')):
    rows.append(f'| {key[4:]} | {r[key + \"_backup\"]:.2f}x | {r[key + \"_load\"]:.2f}x |')
if 'gpu_layerwise_first_vs_whole' in r:
    rows.append(f'| layer 0 readable / whole load | {r[\"gpu_layerwise_first_vs_whole\"]:.2f} | |')
print('\n'.join(rows))
" | tee "$OUT/gpu_table.md"
echo "# gpu_check done in $(( $(date +%s) - start )) s, tests $([ $status = 0 ] && echo passed || echo FAILED)"
exit "$status"
