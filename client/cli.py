"""hicache: command-line client. `hicache ping`, `hicache info [section]`, `hicache stats --json`.

`info` prints Redis-INFO style sections (`# Section`, then `key:value` lines, with `_human`
twins for sizes); `stats --json` prints the same facts as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys

from hicache.client.connection import Connection, DaemonError, DaemonTimeout
from hicache.endpoints import env_endpoint
from hicache.protocol import Op


def _human(tokens: int, token_bytes: int) -> str:
    size = float(tokens * token_bytes)
    for unit in ("B", "K", "M", "G", "T"):
        if size < 1024 or unit == "T":
            return f"{size:.2f}{unit}"
        size /= 1024
    return ""


def _ratio(part: int, whole: int) -> str:
    return f"{part / whole:.4f}" if whole else "0.0000"


def sections(stats: dict) -> dict[str, dict]:
    """Group the daemon's stats into INFO sections (shared by `info` and tests)."""
    requested = stats["hit_device_tokens"] + stats["hit_host_tokens"] + stats["miss_tokens"]
    tb = stats.get("token_bytes", 0)
    return {
        "server": {k: stats[k] for k in ("pid", "endpoint", "boot_epoch", "uptime_s")},
        "memory": {
            "device_capacity_tokens": stats["device_capacity_tokens"],
            "device_capacity_human": _human(stats["device_capacity_tokens"], tb),
            "host_capacity_tokens": stats["host_capacity_tokens"],
            "host_capacity_human": _human(stats["host_capacity_tokens"], tb),
            "page_size": stats["page_size"],
        },
        "device_pool": {
            k: stats[k]
            for k in (
                "device_free_tokens",
                "device_cached_tokens",
                "device_owned_tokens",
                "device_protected_tokens",
                "device_evictable_tokens",
                "evicted_device_tokens",
            )
        },
        "host_pool": {
            k: stats[k] for k in ("host_free_tokens", "host_cached_tokens", "evicted_host_tokens")
        },
        "hits": {
            "hit_device_tokens": stats["hit_device_tokens"],
            "hit_host_tokens": stats["hit_host_tokens"],
            "miss_tokens": stats["miss_tokens"],
            "hit_ratio_device": _ratio(stats["hit_device_tokens"], requested),
            "hit_ratio_host": _ratio(stats["hit_host_tokens"], requested),
            "hit_ratio": _ratio(stats["hit_device_tokens"] + stats["hit_host_tokens"], requested),
        },
        "transfers": {
            k: stats[k]
            for k in (
                "backup_tokens",
                "backup_bytes",
                "load_tokens",
                "load_bytes",
                "inflight_transfers",
                "backup_failed_tokens",
                "transfer_errors",
            )
        },
        "sessions": {"sessions": stats["sessions"]}
        | {
            f"session_{s['id']}": f"client={s['client']},pid={s['pid']},"
            f"owned_pages={s['owned_pages']},locks={s['locks']}"
            for s in stats.get("session_list", [])
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hicache", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--endpoint", default=None, help="default: $HICACHE_ENDPOINT or the ipc default"
    )
    ap.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for a reply")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("ping", help="check that the daemon answers")
    info = sub.add_parser("info", help="human-readable stats by section")
    info.add_argument("section", nargs="?", help="one section only (e.g. hits)")
    stats = sub.add_parser("stats", help="all stats")
    stats.add_argument("--json", action="store_true", help="as one JSON object")
    args = ap.parse_args(argv)
    conn = Connection(args.endpoint or env_endpoint(), args.timeout)
    try:
        if args.command == "ping":
            reply, _ = conn.call(Op.PING)
            print(f"PONG pid={reply.fields['pid']} epoch={reply.boot_epoch}")
            return 0
        data = conn.call(Op.STATS)[0].fields
    except (DaemonError, DaemonTimeout) as exc:
        print(f"hicache: {exc}", file=sys.stderr)
        return 1
    finally:
        conn.close()
    if args.command == "stats":
        print(json.dumps(data, indent=None if args.json else 2, sort_keys=True))
        return 0
    for name, values in sections(data).items():
        if args.section and args.section.replace("-", "_") != name:
            continue
        print(f"# {name.replace('_', ' ').title().replace(' ', '')}")
        print("\n".join(f"{k}:{v}" for k, v in values.items()) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
