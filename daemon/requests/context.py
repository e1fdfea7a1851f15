"""What the transport tells the request handlers.

``Transport``: given to Handlers at construction (the server's inbox answers it). ``Call``:
one request's own facts, passed as an argument to ``Handlers.handle`` and on to the op that
serves it. Control thread only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class Transport:
    # whether another request waits on the transport: a long batched match then answers what
    # it has and lets it go first, and a whole-cache view is charged its time
    others_waiting: Callable[[], bool] = bool
    user: Callable[[], str] = str  # the CurveZMQ client key of the request served ("": none)
    process: Callable[[], str] = str  # the process of an ipc peer ("": unknown)
    counters: Callable[[], dict[str, float]] = dict  # the transport's own counters (stats)


class Call(NamedTuple):
    peer: bytes = b""  # the connection the request came on
    may_wait: bool = False  # it may wait for the third tier (a match then parks)


NO_CALL = Call()
