"""The L3 tier's jobs: what the control thread hands the IO thread, and what comes back.

A job is made and finished on the control thread; in between only the IO thread touches its
result fields. Nothing else is shared.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(eq=False)
class Write:
    """Host pages to put in the store, in prefix order. While it runs, each of ``nodes`` has
    ``node.l3 is self``; host pages the tree gives up meanwhile (eviction) are ``held`` here
    and freed when the write ends, so the IO thread never reads a reused page."""

    key: bytes  # int32 token ids from the namespace root to the last page written
    namespace: Any
    first: int  # chain index (page number from the root) of pages[0]
    pages: np.ndarray  # host page ids, one per page written
    nodes: list[Any]  # tree nodes whose pages these are (grows when one is split)
    held: list[np.ndarray] = field(default_factory=list)  # pages to free at the end
    evicted: bool = False  # write-back: the pages left the tree already
    # set by the IO thread
    stored: int = 0  # pages put
    present: int = 0  # pages the store had already
    failed: int = 0  # pages that could not be put
    corrupt: int = 0  # host pages that changed since written (verify_pages): not put
    no_prefix: bool = False  # not made: the store lacks the page before the first one
    error: str = ""  # why the whole write failed (store down, breaker open)
    io_s: float = 0.0


@dataclass(eq=False)
class Fetch:
    """Pages to bring from the store for the part of a prefix the tree does not hold.

    Stages: ``exists`` (IO: how many leading pages the store has) -> control: host pages for
    the hits, or the end -> ``get`` (IO: read and verify) -> control: the verified leading run
    becomes host nodes -> ``done``. ``at_once`` (a store that ``reads_at_once``, when free
    pages were there for all it wants): the pages are set aside first, and the IO thread asks
    and reads in one turn (``exists`` -> ``read``), saving a hand-off each way."""

    key: bytes  # int32 token ids from the root to the end of the wanted pages (page-aligned)
    namespace: Any
    first: int  # chain index of the first wanted page (the tree held the ones before)
    want: int  # pages wanted
    started: float  # monotonic
    deadline: float  # matches wait for it until then (policy bound)
    stage: str = "exists"
    digests: list[bytes] = field(default_factory=list)  # the chain, from the root (IO thread)
    hits: int = 0  # leading wanted pages the store has
    pages: np.ndarray | None = None  # host pages (OWNED) allocated for the hits
    arrived: int = 0  # leading pages read and verified
    corrupt: int = 0  # pages whose value did not verify
    error: str = ""
    skipped: str = ""  # why it ended early: cost, breaker, no_room
    io_s: float = 0.0  # spent in store calls
    ask_s: float = 0.0  # of which asking how many leading pages the store has (``exists``)
    done: bool = False
    adopted: int = 0  # pages that became host nodes
    at_once: bool = False  # ``pages`` were allocated for all it wants before the store was asked


@dataclass(eq=False)
class Clear:
    """An operator's flush of the store (``L3Store.clear``), or with ``evict`` an eviction of
    its least recently used values (``L3Store.evict``), run by the IO thread before any other
    job; ``done`` is set when it ran (or ended unrun: ``error``)."""

    evict: int = 0  # values to evict (0: forget everything, and drop the writes queued)
    cleared: int = 0  # values the store forgot
    error: str = ""
    io_s: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)
