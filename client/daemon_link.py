"""DaemonLink: an engine's session with hicache-daemon, and what happens when it fails.

An engine (vLLM's scheduler, SGLang's storage backend) must keep serving whatever the daemon
does, so every failure becomes a miss:
- down or too slow (no socket, a timeout, a closed client): the link stays down for
  ``retry_s`` and every lookup meanwhile is a miss, without a call (a stalled daemon costs one
  timeout per ``retry_s``, not one per request);
- restarted (EpochChanged) or lease lost: a new session at once, the layout registered again;
  everything of the old session is void (``generation`` changes);
- another layout served (LayoutMismatch): logged once, looked at again every ``retry_s``.
A daemon error on one operation (OUT_OF_MEMORY, NOT_OWNED) fails that operation only.

``call`` may run on several threads at once (SGLang's prefetch and backup threads): the
session's state changes under one lock, the calls themselves run in parallel, and a failure
seen by a call of an older session changes nothing of the newer one. The other methods are
for one thread (vLLM's scheduler).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import zmq

from hicache.client.client import HiCacheClient
from hicache.client.connection import (
    ClientClosed,
    DaemonError,
    DaemonTimeout,
    EpochChanged,
    LayoutMismatch,
    LeaseLost,
)
from hicache.memory import EngineLayout

T = TypeVar("T")
DOWN = (DaemonTimeout, ClientClosed, OSError, zmq.ZMQError, ConnectionError)


class Unavailable(Exception):
    """The daemon cannot be used now (down, restarted, another layout): treat as a miss."""


class DaemonLink:
    log = logging.getLogger("hicache.client")  # an engine's integration names its own

    def __init__(
        self,
        endpoint: str,
        name: str,
        timeout_s: float,
        retry_s: float,
        model: str,
        expect: dict[str, Any] | None = None,
        daemon_user: str | None = None,  # who else but this user or root may run the daemon
    ):
        self.endpoint = endpoint
        self.daemon_user = daemon_user
        self.name = name
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.model = model  # this engine's model identity (checked against a served layout)
        # what this side knows of its layout before the workers report it (model config): a
        # served layout is taken as this engine's only when all of it matches
        self.expect = {"model": model, **(expect or {})}
        self.layout: EngineLayout | None = None  # this engine's layout, once known
        self.client: HiCacheClient | None = None
        self.pool: Any = None  # what this session's pages are in (pool_ref), once registered
        self.generation = 0  # +1 per session: pages, slots and locks of another are void
        self.down_until = 0.0
        self.failures = 0  # times the daemon was found unusable
        self.wait_s = 0.0  # blocked on the daemon (wall minus CPU time of calls), until taken
        self._said: str | None = None  # the last problem logged (each is logged once)
        self.stopped = False  # stop() was called: no session is opened again
        self.on_draining: Callable[[], None] | None = None  # the daemon is shutting down
        self._lock = threading.RLock()  # session state changes (call() runs on many threads)

    # ---- the session ------------------------------------------------------------------------
    def ready(self) -> HiCacheClient | None:
        """The client, connected and with the layout registered; None while the daemon cannot
        be used (no call is made before ``down_until``)."""
        if self.stopped:
            return None
        if self.client is not None and self.pool is not None:
            return self.client
        if time.monotonic() < self.down_until:
            return None
        try:
            return self._connect()
        except Unavailable:
            return None

    def _connect(self) -> HiCacheClient | None:
        try:
            if self.client is None:
                self.client = HiCacheClient(
                    self.endpoint, self.name, timeout_s=self.timeout_s, daemon_user=self.daemon_user
                )
                self.generation += 1
                if self.on_draining is not None:
                    self.client.when_draining(self.on_draining)
                if self.stopped:  # stop() ran while this one was opening: end it too
                    self.stop()
                    raise Unavailable
            client = self.client
            served = client.layout
            if self.layout is None and served is not None and self._expected(served):
                self.layout = served  # (this engine's workers registered it at start)
            if self.layout is None:
                return None  # the workers' reports will bring it (the daemon restarted)
            client.register_layout(self.layout)
            info = client.info
            self.pool = self.pool_ref(client)
            if self._said is not None:  # it was down, and said so: say it is back
                self.log.info(
                    "hicache-daemon at %s usable again (boot epoch %d): lookups and stores resume",
                    self.endpoint,
                    info["boot_epoch"],
                )
            self._said = None
            return client
        except LayoutMismatch as exc:
            self._down(f"hicache: not used by this engine: {exc.message}")
        except (EpochChanged, LeaseLost):
            self._drop()
            self.down_until = 0.0  # a new session at the next call
        except (DaemonError, *DOWN) as exc:
            self._down(f"hicache-daemon at {self.endpoint} unusable, recomputing: {exc}")
        raise Unavailable

    def pool_ref(self, client: HiCacheClient) -> Any:
        """What a registered session's pages are in, as the engine needs it (``self.pool``)."""
        return dict(client.info)

    def _expected(self, served: EngineLayout) -> bool:
        facts = served.as_dict()
        return all(facts.get(k) == v for k, v in self.expect.items())

    def learn_layout(self, raw: dict[str, Any]) -> None:
        """A worker's layout (from its report): the truth. Registered when the link has none
        yet; a layout taken from the daemon that differs from it is dropped with the session
        (the next connect registers the workers' own, and a daemon serving another one
        refuses it: LAYOUT_MISMATCH)."""
        mine = EngineLayout.from_dict(raw)
        if self.layout is None:
            self.layout = mine
            self.down_until = 0.0
        elif self.layout.mismatch(mine) is not None:
            self.log.error("hicache: %s", self.layout.mismatch(mine))
            self.layout = mine
            self._drop()
            self.down_until = 0.0

    def fresh(self) -> bool:
        """Whether the session is surely alive: not lost, and heard from within half a lease.
        Pages it owns may be written only then (a session that lapsed, e.g. while this process
        was stopped, no longer owns them)."""
        client = self.client
        if client is None or self.pool is None:
            return False
        if client.lost is not None:
            self._drop()
            self.down_until = 0.0
            return False
        return time.monotonic() - client.heard < client.lease_s / 2

    # ---- calls ----------------------------------------------------------------------------
    def call(self, fn: Callable[[HiCacheClient], T], generation: int | None = None) -> T:
        """``fn(client)``; raises Unavailable (the link goes down or renews its session, or
        is no longer at ``generation``: slots and locks of another session must never be
        sent) or DaemonError for a refused operation. Any thread."""
        return self.call_at(fn, generation)[0]

    def call_at(
        self, fn: Callable[[HiCacheClient], T], generation: int | None = None
    ) -> tuple[T, int]:
        """``call``, and the generation of the session it ran in: what its result (locks,
        pages) belongs to, even when another thread renews the session meanwhile."""
        with self._lock:
            client, current = self.ready(), self.generation
        if client is None or (generation is not None and generation != current):
            raise Unavailable
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(client), current
        except (EpochChanged, LeaseLost) as exc:
            with self._lock:
                if current == self.generation:
                    self.log.warning(
                        "hicache-daemon session ended (%s): starting a new one", exc.code.name
                    )
                    self._drop()
            raise Unavailable from None
        except DOWN as exc:
            with self._lock:
                if current == self.generation:
                    self._down(f"hicache-daemon at {self.endpoint} unusable, recomputing: {exc}")
            raise Unavailable from None
        finally:
            self.wait_s += (time.perf_counter() - wall) - (time.thread_time() - cpu)

    def take_wait(self) -> float:
        waited, self.wait_s = self.wait_s, 0.0
        return waited

    def _down(self, message: str) -> None:
        self.failures += 1
        self.down_until = time.monotonic() + self.retry_s
        if message != self._said:
            self.log.warning("%s (next try in %.3g s)", message, self.retry_s)
            self._said = message
        self._drop()

    def _drop(self) -> None:
        """Forget the session (its locks and pages lapse with its lease in the daemon). The
        client is closed on a thread of its own: a goodbye to a stalled daemon must not stall
        vLLM's scheduler."""
        client, self.client, self.pool = self.client, None, None
        if client is not None:
            threading.Thread(target=_close_quietly, args=(client,), daemon=True).start()

    def close(self) -> None:
        client, self.client, self.pool = self.client, None, None
        if client is not None:
            _close_quietly(client)

    def stop(self) -> None:
        """vLLM's engine process is stopping (a signal): end the session as stopping (the
        daemon gives its pages back after quarantine: the workers may still copy) and open
        no other; lookups are misses from now on. Any thread."""
        self.stopped, self.down_until = True, float("inf")
        client, self.client, self.pool = self.client, None, None
        if client is not None:
            with contextlib.suppress(Exception):
                client.close(stopping=True)


def _close_quietly(client: HiCacheClient) -> None:
    with contextlib.suppress(Exception):
        client.close()
