"""BusyPoll: after a reply, watch the socket a little before sleeping on it.

A blocked recv lets the CPU idle, and work after a wake-up runs 2-5x slower on a cold core (a
match's handling: 10 us back to back, 25-60 us after a pause). An engine's next request usually
comes within a few hundred microseconds of its reply, so the control loop watches its socket
for ``busy_poll_us`` first, yielding the CPU and the GIL each turn.

It watches only while it pays: while requests came back within one watch of the reply before
them. The pace is learnt only from real waits: a message already queued behind a reply is read
at once and teaches nothing, and a watch that ran out stops the watching until a request comes
back that fast again. Watches that ran out also fill a leaky bucket (``WASTE_CAP`` seconds,
draining at ``WASTE_SHARE`` of a core): while it is full the loop does not watch, so no pattern
of requests (bursts of two or three, then a pause) makes the daemon spend more than that share
of a core on watching in vain. Heartbeats, slow peers and junk never make the daemon spin.

Used by the control thread only.
"""

from __future__ import annotations

import os
import time

import zmq

POLLIN = int(zmq.POLLIN)
WASTE_SHARE = 0.05  # of a core: the most that watches which ran out may take over time
WASTE_CAP = 0.02  # seconds of such watches allowed in a burst
yield_cpu = getattr(os, "sched_yield", lambda: None)  # (releases the GIL while it yields)


def queued(sock: zmq.Socket) -> bool:
    """Whether a message waits in ``sock`` (read without blocking)."""
    return bool(sock.getsockopt(zmq.EVENTS) & POLLIN)  # type: ignore[operator]  # an int option


def watch(sock: zmq.Socket, until: float) -> bool:
    """Spin until a message waits in ``sock`` or ``until`` (perf_counter) passes; returns
    whether a message waits."""
    while not queued(sock):
        if time.perf_counter() >= until:
            return False
        yield_cpu()
    return True


class BusyPoll:
    def __init__(self, sock: zmq.Socket, busy_poll_us: float):
        self.sock = sock
        self.spin = busy_poll_us / 1e6  # seconds watched after a reply (0: never)
        # when the last reply went out with nothing queued behind it (0: otherwise): the wait
        # for the next request then measures the peers' pace
        self.replied = 0.0
        self.worth = True  # requests came back within a spin of such a reply
        self.until = 0.0  # the watch due before the next blocking recv ends then (0: none)
        self.wasted = 0.0  # seconds of watches that ran out, leaking at WASTE_SHARE
        self.leaked = time.perf_counter()  # when ``wasted`` was last drained
        self.watches = 0  # watches run (stats: busy_poll_watches)
        self.found = 0  # of them, those a request ended (stats: busy_poll_hits)

    def request(self) -> None:
        """A request was read: learn from the wait since the reply, if it was a real one."""
        if self.replied:
            self.worth = time.perf_counter() - self.replied < self.spin

    def replied_now(self) -> None:
        """A reply went out: plan a watch, unless a message is queued (read at once)."""
        self.replied = 0.0
        if self.spin and not queued(self.sock):
            self.replied = now = time.perf_counter()
            self.wasted = max(0.0, self.wasted - (now - self.leaked) * WASTE_SHARE)
            self.leaked = now
            self.until = now + self.spin if self.worth and self.wasted < WASTE_CAP else 0.0

    def before_recv(self) -> None:
        """Run the planned watch (if any) before the loop blocks on the socket."""
        if self.until:
            self.watches += 1
            if watch(self.sock, self.until):
                self.found += 1
            else:
                self.worth = False  # a whole spin watched for nothing
                self.wasted += self.spin
            self.until = 0.0
