"""KeyCalls: what the two kinds of page keys (chains.py, page_keys.py) are built from: the
backend's session, pins, figures, logging and allocation lock, and (from ``bind``, at host pool
registration) the page format, SGLang's host layout and their namespace."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from hicache.client.client import HiCacheClient
from hicache.client.daemon_link import DaemonLink
from hicache.client.sglang.figures import StoreFigures
from hicache.client.sglang.pages import PageFormat
from hicache.client.sglang.pins import PinBook


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


def free_quietly(c: HiCacheClient, slots: torch.Tensor) -> None:
    """Give back slots a failed set allocated (if that fails too, they go with the session)."""
    try:
        c.free(slots)
    except Exception as exc:  # noqa: BLE001
        del exc  # the session's pages go back with it anyway
