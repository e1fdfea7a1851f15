#!/usr/bin/env bash
# The type checker (mypy, configured in pyproject.toml's [tool.mypy]) over hicache with its
# daemon, client and kernels, on a temporary copy laid out as installed: hicache/ with daemon/,
# client/ and kernels/ inside it (pyproject.toml's package-dir), which mypy cannot map from the
# repository's own folders. Reports name the repository's paths (daemon/server.py, not
# hicache/daemon/server.py); exits with mypy's status.
# Usage: scripts/typecheck.sh [mypy options]   (after scripts/setup.sh; CI runs it after the demo)
#   HICACHE_VENV=DIR  the venv whose mypy runs, and whose packages it checks against (default
#                     .venv); mypy's cache is kept there (DIR/mypy-cache; MYPY_CACHE_DIR=another),
#                     so that a second run takes seconds, not a minute, and nothing is left behind
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${HICACHE_VENV:-.venv}
if [ ! -x "$venv/bin/python" ]; then
  echo "typecheck: no $venv/bin/python (run scripts/setup.sh first)" >&2
  exit 1
fi
venv=$(cd "$venv" && pwd)  # (absolute: mypy runs in the copy)
config=$PWD/pyproject.toml
work=$(mktemp -d "${TMPDIR:-/tmp}/hicache-typecheck.XXXXXX")
trap 'rm -rf "$work"' EXIT
cp -r hicache "$work/hicache"
for sub in daemon client kernels; do cp -r "$sub" "$work/hicache/$sub"; done
find "$work" -name __pycache__ -prune -exec rm -rf {} +
cd "$work"
cache=${MYPY_CACHE_DIR:-$venv/mypy-cache}
"$venv/bin/python" -m mypy --config-file "$config" --cache-dir "$cache" -p hicache "$@" \
  | sed -E 's#^hicache/(daemon|client|kernels)/#\1/#'
