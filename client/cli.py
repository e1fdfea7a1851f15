"""hicache: command-line client of hicache-daemon.

    hicache ping                     is it there (and which life: pid, epoch)
    hicache health [--live]          readiness probe: exit 0 when ready (--live: when it
                                     answers at all, draining included), 1 otherwise
    hicache info [SECTION] [--json]  Redis-INFO style sections (`# Section`, `key:value` lines,
                                     `_human` twins for sizes; an unset setting is empty);
                                     --json: the same sections as one JSON object
    hicache top [-n COUNT]           a live view, refreshed every second (--json: one object
                                     per sample, with the interval's rates)
    hicache stats [--watch S]        every stat (--watch: again every S seconds)
    hicache capacity [--plot F.png]  estimated hit ratios at 0.25x-8x of today's tier sizes
                                     (and of the disk's, or of a disk the host pool's size)
                                     and what to buy (SHARDS sampling of the daemon's traffic)
    hicache tree [--top N]           per namespace: size, tiers and the heaviest shared
                                     prefixes (--nodes: the first --max-nodes nodes instead)
    hicache keygen --dir D --name N  CurveZMQ key pair D/N.key (public) and D/N.key_secret
    hicache evict --device-tokens N  admin: evict unlocked tokens (also --host-tokens; and
                                     --disk-tokens: the disk's least recently used pages)
    hicache flush [--disk]           admin: evict every unlocked token from both tiers
                                     (--disk: the disk tier forgets everything too)

Imports no torch: a call costs a round trip, not seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from hicache import __version__
from hicache.client import kept_view
from hicache.client.capacity_view import plot_capacity, render_capacity
from hicache.client.connection import Connection, DaemonError, DaemonTimeout, hello_fields
from hicache.client.info_view import heading, normal, sections, text
from hicache.client.top import render_shape, watch
from hicache.curve import CurveKeyError, keygen
from hicache.endpoints import env_endpoint
from hicache.protocol import EvictRequest, FlushRequest, HelloReply, Op, PingReply


def _seconds(least: float) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{raw!r} is not a number of seconds") from None
        if not least <= value < float("inf"):  # (nan fails too)
            raise argparse.ArgumentTypeError(f"{raw}: at least {least:g} seconds")
        return value

    return parse


def _count(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a count") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{raw}: at least 1")
    return value


# ---- the commands ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Command:
    """One subcommand: its arguments and what it does."""

    help: str
    arguments: Callable[[argparse.ArgumentParser], None]  # adds its own arguments
    run: Callable[[argparse.Namespace, Connection], int]  # its exit status
    refuse: Callable[[argparse.Namespace], str | None] = lambda args: None  # before connecting


@dataclass(frozen=True)
class LocalCommand:
    """A subcommand that needs no daemon."""

    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _json_flag(p: argparse.ArgumentParser, help: str = "as one JSON object") -> None:
    p.add_argument("--json", action="store_true", help=help)


def _ping(args: argparse.Namespace, conn: Connection) -> int:
    reply, _ = conn.call(Op.PING)
    pid, epoch = PingReply.read(reply.fields).pid, reply.boot_epoch
    print(
        json.dumps({"pid": pid, "epoch": epoch}) if args.json else f"PONG pid={pid} epoch={epoch}"
    )
    return 0


def _health_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--live", action="store_true", help="liveness: exit 0 if it answers")
    _json_flag(p)


def _health(args: argparse.Namespace, conn: Connection) -> int:
    try:
        reply, _ = conn.call(Op.PING)
    except DaemonTimeout:
        if args.json:  # a probe reading JSON gets JSON either way
            print(json.dumps({"status": "down", "live": 0, "ready": 0}, sort_keys=True))
        raise
    pong = PingReply.read(reply.fields)
    state = pong.state
    out = {"status": state, "live": 1, "ready": int(state == "ready"), "pid": pong.pid}
    if args.json:
        print(json.dumps(out, sort_keys=True))
    else:
        print("\n".join(f"{k}:{v}" for k, v in out.items()))
    return 0 if args.live or state == "ready" else 1


def _info_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("section", nargs="?", help="one section only (e.g. hits, DevicePool)")
    _json_flag(p, "the sections as one JSON object")


def _info(args: argparse.Namespace, conn: Connection) -> int:
    groups = sections(conn.call(Op.STATS)[0].fields)
    if args.section:
        wanted = {normal(name): name for name in groups}.get(normal(args.section))
        if wanted is None:
            print(
                f"hicache: no section {args.section!r}; sections: {', '.join(groups)}",
                file=sys.stderr,
            )
            return 2
        groups = {wanted: groups[wanted]}
    if args.json:
        print(json.dumps(groups, sort_keys=True))
        return 0
    for name, values in groups.items():
        print(f"# {heading(name)}")
        print("\n".join(f"{k}:{text(v)}" for k, v in values.items()) + "\n")
    return 0


def _stats_args(p: argparse.ArgumentParser) -> None:
    _json_flag(p)
    p.add_argument(
        "--watch", type=_seconds(0.1), metavar="S", help="print again every S (>= 0.1) seconds"
    )
    p.add_argument("-n", "--count", type=_count, help="with --watch: this many times")


def _stats(args: argparse.Namespace, conn: Connection) -> int:
    if args.watch:
        return _watch(args, conn, args.watch, stats_only=True)
    data = conn.call(Op.STATS)[0].fields
    print(json.dumps(data, indent=None if args.json else 2, sort_keys=True))
    return 0


def _top_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-i", "--interval", type=_seconds(0.1), default=1.0, help="seconds between samples"
    )
    p.add_argument("-n", "--count", type=_count, help="samples to show (default: until ^C)")
    _json_flag(p, "one JSON object per sample")


def _top(args: argparse.Namespace, conn: Connection) -> int:
    return _watch(args, conn, args.interval, stats_only=False)


def _watch(args: argparse.Namespace, conn: Connection, interval: float, stats_only: bool) -> int:
    with contextlib.suppress(KeyboardInterrupt):
        watch(
            lambda: conn.call(Op.STATS)[0].fields,
            interval,
            args.count,
            as_json=args.json,
            screen=sys.stdout.isatty(),
            stats_only=stats_only,
        )
    return 0


def _capacity_args(p: argparse.ArgumentParser) -> None:
    _json_flag(p)
    p.add_argument("--plot", metavar="FILE", help="draw the curve to a PNG (matplotlib)")


def _capacity(args: argparse.Namespace, conn: Connection) -> int:
    out = _in_session(conn, Op.CAPACITY, {})
    print(json.dumps(out, sort_keys=True) if args.json else render_capacity(out))
    if args.plot:
        plot_capacity(out, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0


def _tree_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--top", type=int, default=10, help="prefixes per namespace")
    p.add_argument("--nodes", action="store_true", help="list nodes instead (--max-nodes)")
    p.add_argument("--max-nodes", type=int, default=100)
    _json_flag(p)


def _tree(args: argparse.Namespace, conn: Connection) -> int:
    if not args.nodes:
        out = _in_session(conn, Op.TREE, {"shape": True, "top": args.top})
        print(json.dumps(out, sort_keys=True) if args.json else render_shape(out))
        return 0
    out = _in_session(conn, Op.TREE, {"max_nodes": args.max_nodes})
    if args.json:
        print(json.dumps(out, sort_keys=True))
        return 0
    print(f"# Tree\nnodes:{out['total']}\nshown:{len(out['nodes'])}")
    for n in out["nodes"]:
        where = ("D" if n["device"] else "-") + ("H" if n["host"] else "-")
        print(
            f"node_{n['id']}:parent={n['parent']},tokens={n['tokens']},at={where},"
            f"lock_ref={n['lock_ref']},hits={n['hits']},io={n['io']}"
        )
    return 0


def _evict_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device-tokens", type=int, default=0, help="tokens (unlocked, LRU)")
    p.add_argument("--host-tokens", type=int, default=0, help="tokens (unlocked, LRU)")
    p.add_argument(
        "--disk-tokens", type=int, default=0, help="tokens: the disk's least recently used pages"
    )


def _evict_refuse(args: argparse.Namespace) -> str | None:
    if args.device_tokens or args.host_tokens or args.disk_tokens:
        return None
    return "evict what? give --device-tokens N, --host-tokens N and/or --disk-tokens N"


def _evict(args: argparse.Namespace, conn: Connection) -> int:
    fields = EvictRequest(args.device_tokens, args.host_tokens, args.disk_tokens).fields()
    print("\n".join(f"{k}:{v}" for k, v in _in_session(conn, Op.EVICT, fields).items()))
    return 0


def _flush_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--disk", action="store_true", help="the disk tier forgets everything too")


def _flush(args: argparse.Namespace, conn: Connection) -> int:
    fields = FlushRequest(args.disk).fields()
    print("\n".join(f"{k}:{v}" for k, v in _in_session(conn, Op.FLUSH, fields).items()))
    return 0


def _keygen_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", required=True, help="folder for NAME.key and NAME.key_secret")
    p.add_argument("--name", required=True, help="e.g. server, or an engine's name")


def _keygen(args: argparse.Namespace) -> int:
    try:
        public, secret = keygen(args.dir, args.name)
    except (CurveKeyError, OSError) as exc:
        print(f"hicache: {exc}", file=sys.stderr)
        return 1
    print(f"public:{public}\nsecret:{secret}")
    return 0


def _none(p: argparse.ArgumentParser) -> None:
    del p  # (no arguments)


COMMANDS: dict[str, Command | LocalCommand] = {
    "ping": Command("check that the daemon answers", _json_flag, _ping),
    "health": Command(
        "readiness (exit 0 when ready, 1 when draining or not answering)", _health_args, _health
    ),
    "info": Command("human-readable stats by section", _info_args, _info),
    "stats": Command("all stats", _stats_args, _stats),
    "top": Command("live view: hit ratios, tiers, transfers, sessions", _top_args, _top),
    "capacity": Command(
        "hit ratio against tier size, and a recommendation", _capacity_args, _capacity
    ),
    "tree": Command("the tree's shape: heaviest shared prefixes per namespace", _tree_args, _tree),
    "evict": Command("admin: evict unlocked tokens", _evict_args, _evict, _evict_refuse),
    "flush": Command(
        "admin: evict every unlocked token from both tiers (--disk: and the disk's)",
        _flush_args,
        _flush,
    ),
    "kept": LocalCommand(kept_view.HELP, kept_view.add_arguments, kept_view.run),
    "keygen": LocalCommand("write a CurveZMQ key pair (for tcp endpoints)", _keygen_args, _keygen),
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="hicache", description="Command-line client of hicache-daemon (no torch import)."
    )
    ap.add_argument("--version", action="version", version=f"hicache {__version__}")
    ap.add_argument(
        "--endpoint", default=None, help="default: $HICACHE_ENDPOINT or the ipc default"
    )
    ap.add_argument(
        "--timeout", type=_seconds(0.001), default=5.0, help="seconds to wait for a reply"
    )
    sub = ap.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        command.arguments(sub.add_parser(name, help=command.help))
    return ap


def _in_session(conn: Connection, op: Op, fields: dict) -> dict:
    """One operation in an admin session of its own (the CLI is an operator's tool), ended at
    once."""
    hello = hello_fields("hicache-cli", True, conn.endpoint)
    conn.session = HelloReply.read(conn.call(Op.HELLO, hello)[0].fields).session
    try:
        return conn.call(op, fields)[0].fields
    finally:
        conn.call(Op.GOODBYE)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = COMMANDS[args.command]
    if isinstance(command, LocalCommand):  # no daemon involved
        return command.run(args)
    problem = command.refuse(args)
    if problem is not None:
        print(f"hicache: {problem}", file=sys.stderr)
        return 2
    endpoint = args.endpoint or env_endpoint()
    path = endpoint[len("ipc://") :] if endpoint.startswith("ipc://") else ""
    folder = os.path.dirname(path) or "."
    if path and not path.startswith("@") and not os.path.exists(path):
        why = (
            "no socket file"
            if os.access(folder, os.X_OK)
            else f"{folder} cannot be entered as this user: the daemon's user can"
        )
        print(
            f"hicache: no daemon at {endpoint} ({why}): start hicache-daemon, or "
            "point --endpoint / HICACHE_ENDPOINT at the one that runs",
            file=sys.stderr,
        )
        return 1
    try:
        conn = Connection(endpoint, args.timeout)
    except (CurveKeyError, PermissionError) as exc:  # (PermissionError: an untrusted daemon)
        print(f"hicache: {exc}", file=sys.stderr)
        return 1
    try:
        return command.run(args, conn)
    except (DaemonError, DaemonTimeout, PermissionError) as exc:
        print(f"hicache: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `hicache info | head`: the reader left, nothing to say
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # (no second error when Python flushes stdout)
        return 0
    finally:
        conn.close()


if __name__ == "__main__":
    sys.exit(main())
