#!/usr/bin/env bash
# Renews scripts/constraints.txt, the exact versions scripts/setup.sh installs (and
# scripts/constraints-sglang.txt, SGLang's served environment's): sets up a fresh
# venv with the newest of everything (empty pip cache), runs the demo and the tests there, and
# says which versions changed and what broke. The lock is replaced only when both pass
# (--force: replace it anyway, to commit with fixes). About 20 minutes on two cores.
set -uo pipefail
cd "$(dirname "$0")/.."
force=false
[ "${1:-}" = --force ] && force=true
lock=scripts/constraints.txt
work=$(mktemp -d "${TMPDIR:-/tmp}/hicache-refresh.XXXXXX")
trap 'rm -rf "$work"' EXIT
say() { echo "refresh: $*" >&2; }

say "installing the newest versions in $work/venv"
export HICACHE_SGLANG_VENV=$work/venv-sglang  # (SGLang's served environment: its own lock)
if ! PIP_NO_CACHE_DIR=1 HICACHE_VENV=$work/venv HICACHE_LOCK=none \
  HICACHE_FREEZE=$work/new.txt HICACHE_SGLANG_LOCK=none \
  HICACHE_SGLANG_FREEZE=$work/new-sglang.txt ./scripts/setup.sh; then
  say "setup failed with the newest versions (above); the lock is unchanged"
  exit 1
fi

say "versions that changed (locked -> newest):"
python3 - "$lock" "$work/new.txt" <<'EOF'
import re
import sys

def versions(path):
    pins = {}
    for line in open(path):
        m = re.match(r"([A-Za-z0-9_.-]+)==(\S+)", line)
        if m:
            pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    return pins

old, new = versions(sys.argv[1]), versions(sys.argv[2])
changed = [(n, old.get(n, "-"), new.get(n, "-")) for n in sorted(old.keys() | new.keys())
           if old.get(n) != new.get(n)]
for name, was, now in changed:
    print(f"  {name:40} {was:>14} -> {now}")
print(f"  ({len(changed)} of {len(new)} packages)")
EOF

failed=false
say "running the demo"
if ! "$work/venv/bin/python" -m scripts.demo >"$work/demo.log" 2>&1; then
  failed=true
  say "the demo FAILED; its last lines:"
  tail -n 20 "$work/demo.log" >&2
fi
say "running the tests"
if ! "$work/venv/bin/python" -m pytest -q -p no:cacheprovider >"$work/tests.log" 2>&1; then
  failed=true
  say "tests FAILED:"
  grep -E "^(FAILED|ERROR) " "$work/tests.log" >&2 || tail -n 30 "$work/tests.log" >&2
fi
tail -n 1 "$work/tests.log" >&2

{
  echo "# The exact set scripts/setup.sh installs (CPython 3.11, x86_64 Linux, no GPU), tested by CI."
  echo "# Written by scripts/refresh_lock.sh on $(date -u +%F); edit it only through that script."
  cat "$work/new.txt"
} >"$work/lock.txt"
if $failed && ! $force; then
  cp "$work/lock.txt" "$lock.new"
  say "kept $lock; the newest set is in $lock.new (--force to take it anyway)"
  exit 1
fi
cp "$work/lock.txt" "$lock"
rm -f "$lock.new"
{
  head -n 2 scripts/constraints-sglang.txt
  cat "$work/new-sglang.txt"
} >"$work/lock-sglang.txt"
cp "$work/lock-sglang.txt" scripts/constraints-sglang.txt
say "$lock renewed: run .ci/run on a clean clone, then commit it"
