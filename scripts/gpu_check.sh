#!/usr/bin/env bash
# One-shot GPU check (run on a machine with CUDA): the CUDA tests, then the transfer benchmark,
# then a short table. Record what it prints in docs/performance.md with the date and the GPU.
#
# Needs a Python with a CUDA build of torch and hicache installed (./scripts/setup.sh installs
# the CUDA build when nvidia-smi sees a GPU). PYTHON overrides the interpreter.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
echo "# gpu_check $(date -u +%Y-%m-%dT%H:%MZ)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
  'available', torch.cuda.is_available())" || exit 1
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
  echo "no CUDA device visible to torch: nothing to check"; exit 1; }
echo "## CUDA tests"
"$PY" -m pytest -q -m cuda tests/test_cuda.py 2>&1 | tail -n 15
status=${PIPESTATUS[0]}
echo "## vLLM connector: block copies on the GPU, and real vLLM when its CUDA build is installed"
"$PY" -m pytest -q tests/test_vllm_blocks.py tests/test_vllm_sides.py 2>&1 | tail -n 3
"$PY" -c "import vllm" 2>/dev/null && "$PY" -m pytest -q tests/test_vllm.py 2>&1 | tail -n 5
echo "## transfer benchmark"
"$PY" -m scripts.bench_transfer 2>&1 | tee /tmp/hicache_bench_transfer.txt | grep -E "GPU|scattered/(kernel|direct)|^\{"
echo "## table (scattered pages, page_size 16, ratio to one pinned cudaMemcpyAsync)"
tail -n 1 /tmp/hicache_bench_transfer.txt | "$PY" -c "
import json, sys
r = json.loads(sys.stdin.read())
for key in sorted(k for k in r if k.startswith('gpu_')):
    print(f'{key:45s} {r[key]:6.3f}')
"
exit "$status"
