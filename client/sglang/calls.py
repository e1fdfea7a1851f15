"""KeyCalls: what the two kinds of page keys (chains.py, page_keys.py) are built from: the
backend's session, pins, figures, logging and allocation lock, and (from ``bind``, at host pool
registration) the page format, SGLang's host layout and their namespace."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from hicache.client.client import HiCacheClient
from hicache.client.connection import DaemonError
from hicache.client.daemon_link import DaemonLink, Unavailable
from hicache.client.sglang.figures import StoreFigures
from hicache.client.sglang.pages import PageFormat
from hicache.client.sglang.pins import PinBook
from hicache.protocol import ErrorCode

T = TypeVar("T")


class KeyCalls:
    """Before ``bind`` every call is a miss (no format)."""

    def __init__(
        self,
        link: DaemonLink,
        pins: PinBook,
        figures: StoreFigures,
        say: Callable[[str, BaseException], None],
        note: Callable[..., None],
        writing: threading.Lock,
    ):
        self.link = link  # the backend's session (one for both kinds of keys)
        self.pins = pins  # shared by both kinds (chain pins are tagged apart)
        self.figures = figures
        self.say = say  # log a problem once (a miss follows)
        self.note = note  # the engine counts (queried, hit, loaded pages)
        self.writing = writing  # held around a set's allocation and insert (see chains.py)
        self.format: PageFormat | None = None
        self.layout = ""  # SGLang's host layout
        self.namespace = ""  # each kind of keys has its own

    def bind(self, fmt: PageFormat, layout: str, namespace: str) -> None:
        self.format, self.layout, self.namespace = fmt, layout, namespace

    def lookup(self, match: Callable[[HiCacheClient, bool], T]) -> tuple[T, Any] | None:
        """Run a lookup's ``match(client, lock)`` locked: (its result, the session generation
        its pins belong to). A rank that pins its whole share already (prefetches SGLang has
        not read yet) is answered without pins: (result, None); the get pins what is still
        there then. None when the daemon cannot answer (a miss, said once)."""
        try:  # (the generation the pins belong to: another thread may renew the session)
            return self.link.call_at(lambda c: match(c, True))
        except DaemonError as exc:
            if exc.code is not ErrorCode.QUOTA_EXCEEDED:
                self.say("exists", exc)
                return None
        except Unavailable:
            return None
        try:
            return self.link.call(lambda c: match(c, False)), None
        except (Unavailable, DaemonError) as exc:
            self.say("exists", exc)
            return None

    def run_get(self, read: Callable[[HiCacheClient], int], generation: Any, start: float) -> int:
        """Run a get's ``read`` (pages copied) on the session of ``generation`` (its pins');
        a failure is a miss."""
        try:
            done = self.link.call(read, generation)
        except (Unavailable, DaemonError, IndexError) as exc:
            self.say("get", exc)
            return 0
        self.figures.sample("get", done, start)
        self.note(loaded=done)
        return done

    def run_set(self, write: Callable[[HiCacheClient], int], start: float) -> bool:
        """Run a set's ``write`` (pages stored) under the allocation lock; False when it
        failed (nothing of it is kept)."""
        try:
            with self.writing:
                stored = self.link.call(write)
        except (Unavailable, DaemonError, IndexError) as exc:
            self.say("set", exc)
            return False
        self.figures.sample("set", stored, start)
        return True


def free_quietly(c: HiCacheClient, slots: torch.Tensor) -> None:
    """Give back slots a failed set allocated (if that fails too, they go with the session)."""
    try:
        c.free(slots)
    except Exception as exc:  # noqa: BLE001
        del exc  # the session's pages go back with it anyway
