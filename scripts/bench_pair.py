"""A benchmark script run before and after a change, alternating, in one run.

    .venv/bin/python -m scripts.bench_pair BASE [--rounds 3] -- bench_rpc [ARGS ...]

Lays out two copies as installed (``hicache/`` with ``daemon/``, ``client/`` and ``kernels/``
inside, the built C helpers copied along): the revision BASE (a commit) and the working tree as
it is. Then runs ``python -m scripts.NAME ARGS`` in each, before, after, before, after ...
(``--rounds`` pairs; each run a fresh process), and keeps each run's last line, its JSON
object. Prints every run's object, then one JSON object: for each number both printed, the
median before, the median after and their ratio (after / before).

The C helpers are built once, from the working tree: BASE must have the same C sources (else
it says so and stops).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from scripts.mutations import installed_path

ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout  # fmt: skip


def lay_out(dest: Path, rev: str | None) -> None:
    """``rev``'s files (None: the working tree's tracked files) laid out as installed."""
    files = (_git("ls-tree", "-r", "--name-only", rev) if rev else _git("ls-files")).split()
    for rel in files:
        top = rel.partition("/")[0]
        if top not in ("hicache", "daemon", "client", "kernels", "scripts", "tests"):
            continue
        target = dest / installed_path(rel)
        target.parent.mkdir(parents=True, exist_ok=True)
        if rev:
            target.write_bytes(subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=ROOT,
                                              capture_output=True, check=True).stdout)  # fmt: skip
        elif (ROOT / rel).exists():
            shutil.copy2(ROOT / rel, target)
    for built in (ROOT / "hicache").glob("_*.so"):
        shutil.copy2(built, dest / "hicache" / built.name)


def last_json(output: str) -> dict:
    for line in reversed(output.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError(f"no JSON line in:\n{output[-2000:]}")


def run(copy: Path, bench: list[str]) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", f"scripts.{bench[0]}", *bench[1:]], cwd=copy,
        env={**os.environ, "PYTHONPATH": str(copy)}, capture_output=True, text=True,
        timeout=1800,
    )  # fmt: skip
    if done.returncode:
        raise SystemExit(f"{bench[0]} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return last_json(done.stdout)


def summary(before: list[dict], after: list[dict]) -> dict:
    out = {}
    for key, value in before[0].items():
        if isinstance(value, bool) or not isinstance(value, int | float) or key not in after[0]:
            continue
        b = statistics.median(r[key] for r in before)
        a = statistics.median(r[key] for r in after)
        out[key] = {"before": b, "after": a, "ratio": round(a / b, 3) if b else None}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", help="the revision before the change (a commit)")
    ap.add_argument("--rounds", type=int, default=3, help="before/after pairs")
    argv = sys.argv[1:]
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        ap.error("name a benchmark after --: ... -- NAME [ARGS] (scripts/NAME.py)")
    cut = argv.index("--")
    args, bench = ap.parse_args(argv[:cut]), argv[cut + 1 :]
    if _git("diff", "--name-only", args.base, "--", "hicache/*.c").strip():
        raise SystemExit(f"the C helpers differ from {args.base}: build that revision apart")
    work = Path(tempfile.mkdtemp(prefix="hicache-pair-"))
    try:
        lay_out(work / "before", args.base)
        lay_out(work / "after", None)
        before, after = [], []
        for i in range(args.rounds):
            for name, copy, runs in (("before", work / "before", before),
                                     ("after", work / "after", after)):  # fmt: skip
                runs.append(run(copy, bench))
                print(f"{name} {i + 1}: {json.dumps(runs[-1])}", flush=True)
        print(json.dumps({"bench": " ".join(bench), "base": args.base, "rounds": args.rounds,
                          "figures": summary(before, after)}))  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
