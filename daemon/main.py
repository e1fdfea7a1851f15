"""hicache-daemon: command-line entry point."""

from __future__ import annotations

import json
import sys

from hicache.daemon.logs import setup_logging
from hicache.daemon.settings import build_parser, resolve


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
    from hicache.daemon.server import EndpointError, StopDuringStart, run  # (zmq, the pools)
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


if __name__ == "__main__":
    sys.exit(main())
