"""What the client's calls return: typed results, never positional tuples."""

from __future__ import annotations

from itertools import accumulate
from typing import Any, NamedTuple

import numpy as np
import torch

from hicache.types import slots_of_page_ids


class PageFrame:
    """A match reply's page ids: every distinct node's pages once, shared by its Matches.
    Decoded on first use: a caller that only reads hit lengths never pays for it."""

    __slots__ = ("page_size", "_frame", "_counts", "_pages", "_starts")

    def __init__(self, frame: Any, counts: list[int], page_size: int):
        self.page_size = page_size  # slot = page * page_size + offset
        self._frame = frame  # the reply frame: int64 page ids of the distinct nodes
        self._counts = counts  # pages of each distinct node, in frame order
        self._pages: np.ndarray | None = None
        self._starts: list[int] = []

    def node_pages(self, ids: list[int]) -> list[np.ndarray]:
        """Views of the page ids of nodes ``ids`` (indices into this frame)."""
        if self._pages is None:
            self._pages = np.frombuffer(self._frame.buffer, dtype=np.int64)
            self._starts = list(accumulate(self._counts, initial=0))
        pages, starts = self._pages, self._starts
        return [pages[starts[i] : starts[i + 1]] for i in ids]


class Match:
    """A prefix match. The prefix's pages arrive as page ids (page_size times smaller than
    slots); ``device_pages`` and ``device_indices`` are built on first use. Read-only."""

    __slots__ = (
        "device_hit_length",
        "host_hit_length",
        "lock_id",
        "released",
        "generation",
        "l3_pending",
        "_frame",
        "_ids",
        "_pages",
    )

    def __init__(
        self,
        frame: PageFrame,
        ids: list[int],
        device: int,
        host: int,
        lock_id: int,
        generation: int = 0,
    ):
        self.device_hit_length = device  # tokens cached on the device
        self.host_hit_length = host  # tokens after those, cached on the host only (load_back)
        self.lock_id = lock_id  # the session's lock on this prefix (0: not locked)
        self.released = False  # after release its slots may hold other KV: they are refused
        self.generation = generation  # the client's session it belongs to (see reconnect)
        self.l3_pending = False  # more of the prefix is coming from the third tier (ask again)
        self._frame = frame
        self._ids = ids  # the nodes of the prefix, in order (indices into the frame)
        self._pages: np.ndarray | None = None

    def check_locked(self) -> None:
        """Raise unless the match holds a lock (what load_back works on)."""
        self.check_live()
        if not self.lock_id:
            raise ValueError("load_back needs a locked match: match_prefix(..., lock=True)")

    def check_live(self) -> None:
        """Raise unless the match's slots are still its own (not released)."""
        if self.released:
            raise RuntimeError(
                "this Match was released: its slots may already hold other KV; match again"
            )

    def relocked(self, lock_id: int) -> Match:
        """The same prefix under another lock (the reply frame is shared, read-only)."""
        return Match(
            self._frame,
            self._ids,
            self.device_hit_length,
            self.host_hit_length,
            lock_id,
            self.generation,
        )

    def mark_released(self) -> None:
        if self.lock_id:
            self.released = True

    def _page_array(self) -> np.ndarray:
        self.check_live()
        if self._pages is None:
            parts = self._frame.node_pages(self._ids)
            # a copy: the caller owns a writable array, and the reply frame can go
            self._pages = parts[0].copy() if len(parts) == 1 else np.concatenate(parts or [_NONE])
        return self._pages

    @property
    def device_pages(self) -> torch.Tensor:
        """int64 page ids of the device-resident prefix (a vLLM-style block table row)."""
        return torch.from_numpy(self._page_array())

    @property
    def device_indices(self) -> torch.Tensor:
        """int64 token slots of the device-resident prefix: page * page_size + offset."""
        return slots_of_page_ids(self._page_array(), self._frame.page_size)

    def __repr__(self) -> str:
        return (
            f"Match(device_hit_length={self.device_hit_length}, "
            f"host_hit_length={self.host_hit_length}, lock_id={self.lock_id}"
            f"{', released' if self.released else ''})"
        )


_NONE = np.empty(0, dtype=np.int64)


class LoadTicket(NamedTuple):
    """A load-back in progress (``load_back_async``): wait per layer before reading it."""

    slots: torch.Tensor  # int64 device slots of the loaded part, in token order
    ticket: int  # the daemon's transfer ticket; 0 when the KV was already complete
    num_layers: int  # layers the load copies
    events: tuple[bytes, ...] = ()  # CUDA pools: IPC handles of per-layer events (may be empty)
