"""RequestContext: what the transport says about the request being handled.

Handlers set ``may_wait`` before each request and the server sets ``others_waiting`` once; the
cache operations and the view budget read them. Control thread only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class RequestContext:
    may_wait: bool = False  # the request may wait for the third tier (a match then parks)
    # whether another request waits on the transport: a long batched match then answers what
    # it has and lets it go first, and a whole-cache view is charged its time
    others_waiting: Callable[[], bool] = bool
    match_parts: int = 0  # batched matches answered in part because others waited (stats)
