"""hicache-daemon: command-line entry point."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys

from hicache.daemon.config import DaemonSettings, build_parser, resolve
from hicache.daemon.logs import setup_logging

log = logging.getLogger("hicache.daemon")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = resolve(args)
    except (ValueError, OSError) as exc:
        print(f"hicache-daemon: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(settings.as_dict(), indent=2))
        return 0
    setup_logging(args.log_json, args.log_level)
    from hicache.daemon.server import EndpointError  # (zmq, the pools: not for --help)
    from hicache.errors import InsufficientMemoryError

    try:
        run(settings)
    except StopDuringStart:
        print("hicache-daemon: stopped during start-up; nothing left behind", file=sys.stderr)
        return 0
    except (EndpointError, InsufficientMemoryError, OSError) as exc:
        print(f"hicache-daemon: {exc}", file=sys.stderr)  # one line, no traceback
        return 2
    return 0


class StopDuringStart(BaseException):
    """SIGTERM or SIGINT while the daemon was starting: what it made is undone, it exits."""


def _stop_during_start(*_: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the undoing is not interrupted again
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise StopDuringStart


def run(settings: DaemonSettings) -> None:
    """Start the daemon, say where it serves, serve until stopped, undo what it made."""
    from hicache.daemon.server import Daemon  # (zmq, the pools)

    signal.signal(signal.SIGTERM, _stop_during_start)
    signal.signal(signal.SIGINT, _stop_during_start)
    daemon = Daemon(settings)  # (undoes what it made when interrupted)
    try:
        signal.signal(signal.SIGTERM, daemon.drain)
        signal.signal(signal.SIGINT, daemon.stop)
        daemon.gc.start()  # what start-up made, out of the collector's sight (gc_pauses.py)
        print(f"hicache-daemon ready on {settings.endpoint} (pid {os.getpid()})", flush=True)
        if daemon.cache is not None:  # (engine mode: said when the first engine registers)
            log.info(daemon.handlers.limits.describe(settings.max_sessions))
        if daemon.inbox.watch is not None:
            log.info(
                "tcp: at most %d connections kept, %d per local user other than this one and "
                "root (past them a new one is reset)",
                daemon.inbox.watch.max_connections,
                daemon.inbox.watch.max_per_user,
            )
        if daemon.metrics is not None:
            host = settings.metrics_host
            print(f"metrics on http://{host}:{daemon.metrics.port}/metrics", flush=True)
        if daemon.events is not None:
            replay = daemon.events.replay_endpoint
            where = f", replay on {replay}" if replay else ""
            print(f"KV events on {daemon.events.endpoint}{where}", flush=True)
        daemon.serve()
    finally:
        daemon.close()
        print("hicache-daemon stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
