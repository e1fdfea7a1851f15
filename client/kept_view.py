"""``hicache kept``: the host pools stopped daemons of this user kept for their successors, and
freeing them (hicache/memory/kept.py). Needs no daemon; reads /dev/shm only."""

from __future__ import annotations

import argparse
import json
import time

from hicache.memory import KeptPool, free_kept, list_kept

HELP = "host pools stopped daemons kept for the next one (no daemon needed)"


def add_arguments(kept: argparse.ArgumentParser) -> None:
    kept.add_argument(
        "--free",
        metavar="ENDPOINT",
        help="free the pools kept for ENDPOINT now ('all': every one)",
    )
    kept.add_argument("--json", action="store_true", help="as one JSON object")


def _describe(pool: KeptPool, now: float) -> dict:
    return {
        "endpoint": pool.marker.endpoint,
        "bytes": pool.nbytes,
        "age_s": round(now - pool.marker.written, 1),
        "until": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(pool.marker.until)),
        "left_s": round(max(0.0, pool.marker.until - now), 1),
        "file": pool.host,
        "snapshot": pool.marker.snapshot,
    }


def run(args: argparse.Namespace) -> int:
    now = time.time()
    pools = list_kept()
    if args.free is not None:
        chosen = [p for p in pools if args.free == "all" or p.marker.endpoint == args.free]
        for pool in chosen:
            free_kept(pool)
        out = {"freed": [_describe(p, now) for p in chosen]}
        if args.json:
            print(json.dumps(out, sort_keys=True))
        else:
            gib = sum(p.nbytes for p in chosen) / 2**30
            print(f"freed:{len(chosen)}\nfreed_gib:{gib:.2f}")
        return 0 if chosen or args.free == "all" else 1
    rows = [_describe(p, now) for p in pools]
    if args.json:
        print(json.dumps({"kept": rows}, sort_keys=True))
        return 0
    print("# Kept host pools")
    print(f"kept:{len(rows)}\nkept_gib:{sum(r['bytes'] for r in rows) / 2**30:.2f}")
    for i, r in enumerate(rows):
        print(
            f"kept_{i}:endpoint={r['endpoint']},gib={r['bytes'] / 2**30:.2f},age_s={r['age_s']},"
            f"until={r['until']},left_s={r['left_s']}"
        )
    return 0
