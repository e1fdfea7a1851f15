#!/usr/bin/env bash
# The C helpers built once with AddressSanitizer and UndefinedBehaviorSanitizer, and the C-path
# tests plus a short wire fuzz run against them. Any report aborts the run (exit != 0).
# Usage: scripts/sanitize.sh   (after scripts/setup.sh; CI runs it after the tests)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$PWD/.venv/bin/python
out=$(mktemp -d /tmp/hicache-sanitize-XXXXXX)
trap 'rm -rf "$out"' EXIT
# the installed layout (hicache/ with daemon/, client/, kernels/ inside it) and the tests, run
# from there: the working directory comes first on sys.path, so this copy is what imports
cp -r hicache "$out/hicache"  # (every subpackage; its built helpers replaced below)
rm -f "$out"/hicache/_*.so
for sub in daemon client kernels; do cp -r "$sub" "$out/hicache/$sub"; done
find "$out" -name __pycache__ -prune -exec rm -rf {} +
cp -r tests pyproject.toml "$out/"
inc=$($PY -c "import sysconfig; print(sysconfig.get_paths()['include'])")
suffix=$($PY -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
flags="-O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined"
for m in _fast _tree _copy; do
  gcc $flags -shared -fPIC -I"$inc" "$PWD/hicache/$m.c" -o "$out/hicache/$m$suffix" -lpthread
done
if [[ "$(gcc -print-file-name=libasan.so)" != /* ]]; then  # the runtimes come with gcc's dev libs
  apt-get update -qq && apt-get install -y -qq "libgcc-$(gcc -dumpversion | cut -d. -f1)-dev"
fi
preload="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
export LD_PRELOAD="$preload" ASAN_OPTIONS="detect_leaks=0:abort_on_error=1" \
  UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" PYTHONMALLOC=malloc \
  PYTHONPATH="$out" TRITON_INTERPRET=1
cd "$out"
$PY -c "import hicache._native as n, hicache.transfers.cpu_copy as c, sys; \
import hicache.daemon.server as d; \
mine = all(m.__file__.startswith('$out') for m in (n, c, d, n._fast, n._tree, c._copy)); \
sys.exit(0 if n.USE_C and c.USE_C and mine else 'no sanitized C, or not this copy')"
$PY -m pytest -q -p no:cacheprovider --capture=sys tests/test_c_hostile.py tests/test_fastpath.py \
  tests/test_copy_paths.py tests/test_handlers_fuzz.py tests/test_protocol.py \
  "tests/test_guards.py::test_a_peer_that_never_reads_cannot_stall_the_daemon" \
  "tests/test_guards.py::test_alloc_decode_and_extend_never_grant_another_sessions_or_the_trees_page" \
  tests/test_client_threads.py::test_an_amplified_match_is_refused_at_once
echo "sanitizers: clean"
