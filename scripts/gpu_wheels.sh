#!/usr/bin/env bash
# The wheels the lent GPU machine lacks (it has no package index; Python 3.12 there), fetched
# here into .whl/ (git-ignored), which scripts/gpu_check.sh installs there. Versions as locked.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
for pkg in pyzmq; do
  version=$(grep -i "^$pkg==" scripts/constraints.txt | head -n 1)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$version" \
    2>&1 | grep -v "^WARNING: Location" || true
done
ls -l .whl
