"""Matches that wait for the third tier, without stopping the control loop.

Under the ``wait_complete`` and ``timeout`` policies a match whose prefix is being fetched
from the store is not answered at once: the handler raises ``Deferred`` and the server parks
the request here with its peer's identity. When a fetch ends, the L3 IO thread wakes the loop
(``wake``: one empty message from an inproc DEALER into the daemon's own ROUTER socket, so the
loop's blocking receive returns at once); ``resume`` then runs every parked request whose
fetches ended or whose bound passed, as if it had just arrived (it now matches what arrived),
and sends its reply. Only the control thread touches the parked list.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

# the ROUTER identity of wake messages: random per daemon, so that no peer can claim it (a tcp
# peer may name its own routing id)
WAKE_ID = b"\0hicache-l3-wake-" + secrets.token_bytes(16)
MAX_PARKED = 1024  # more waiting matches than this are answered at once


class Deferred(Exception):  # noqa: N818  (control flow, not an error)
    """Raised by a match that should wait for ``fetches`` until ``deadline`` (monotonic)."""

    def __init__(self, fetches: list[Any], deadline: float):
        super().__init__("waiting for the third tier")
        self.fetches, self.deadline = fetches, deadline


@dataclass
class Parked:
    identity: bytes
    header: bytes | memoryview
    frames: list[Any]
    waiting: Deferred
    since: float = field(default_factory=time.monotonic)

    def ready(self, now: float) -> bool:
        return now >= self.waiting.deadline or all(f.done for f in self.waiting.fetches)


class L3Waits:
    def __init__(self, ctx: zmq.Context, address: str):
        self.ctx, self.address = ctx, address
        self.parked: list[Parked] = []
        self.counters: Any = None  # the tier's L3Counters (wait_timeouts), once it exists
        self._local = threading.local()
        self._sockets: list[zmq.Socket] = []
        self._lock = threading.Lock()

    def room(self) -> bool:
        return len(self.parked) < MAX_PARKED

    def park(self, identity: bytes, header: Any, frames: list[Any], waiting: Deferred) -> None:
        self.parked.append(Parked(identity, header, frames, waiting))

    def resume(
        self,
        handle: Callable[[bytes, Any, list[Any]], tuple[bytes, list[Any]]],
        send: Callable[[list[Any]], None],
    ) -> None:
        """Answer every parked match that may go on now (``handle`` runs it again, given its
        peer's routing id, header and frames)."""
        if not self.parked:
            return
        now = time.monotonic()
        still = []
        for p in self.parked:
            if not p.ready(now):
                still.append(p)
                continue
            if not all(f.done for f in p.waiting.fetches) and self.counters is not None:
                self.counters.wait_timeouts += 1  # answered at its bound
            reply, out = handle(p.identity, p.header, p.frames)
            send([p.identity, reply, *out])
        self.parked = still

    def expire_all(self) -> None:
        """Every parked match may go on now, with what has arrived (a drain)."""
        now = time.monotonic()
        for p in self.parked:
            p.waiting.deadline = min(p.waiting.deadline, now)

    def next_deadline(self) -> float | None:
        return min((p.waiting.deadline for p in self.parked), default=None)

    def wake(self) -> None:
        """Called from the L3 IO thread: make the control loop look at its parked matches."""
        sock = getattr(self._local, "sock", None)
        if sock is None:
            with self._lock:
                sock = self.ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.IDENTITY, WAKE_ID)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 4)
                sock.connect(self.address)
                self._sockets.append(sock)
            self._local.sock = sock
        try:
            sock.send(b"", zmq.NOBLOCK)
        except zmq.Again:  # wakes are queued already: the loop will look
            pass

    def close(self) -> None:
        """After the IO thread stopped: close its wake sockets (the context's term waits)."""
        with self._lock:
            for sock in self._sockets:
                sock.close(linger=0)
            self._sockets.clear()
