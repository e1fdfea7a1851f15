"""PageSums: a checksum per host page, so KV read back from the host tier is the KV written.

A page's checksum covers every (layer, kv) slice of it in the pool's page view
``[kv, layer, page, page_size, width]``: its bytes read as little-endian uint64 words in
(layer, kv, token, word) order, ``mix(sum_i word_i * K_i) mod 2**64`` with fixed odd
multipliers ``K_i`` (one per word of a page) and splitmix64's finalizer. Linear, so the C
helper (``_copy.page_sums``, without the GIL) and numpy compute the same value; an odd
multiplier means any change of a single word changes the sum. Not a defence against an
adversary with access to the pool (who could write any KV anyway), a guard against memory
that changed behind the daemon's back: a stray write, a bit flip, a bug.

``seal`` records the sums of pages just written (a backup, a fetch from the third tier);
``bad`` returns the pages whose bytes no longer match (before a load-back or a write to the
third tier reads them). The transfer engine's thread and the control thread both call them,
on disjoint pages (the ack protocol keeps a page out of the tree while a copy writes it).
"""

from __future__ import annotations

import numpy as np
import torch

try:
    import hicache._copy as _copy
except ImportError:  # the C helpers are optional
    _copy = None
import os

USE_C = _copy is not None and not os.environ.get("HICACHE_NO_C")
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


class PageSums:
    def __init__(self, view: torch.Tensor):
        """``view``: the host pool's page view ``[kv, layer, page, page_size, width]``."""
        kv, layers, pages, tokens, width = view.shape
        chunk = width * view.element_size()
        if chunk % 8:
            raise ValueError(
                f"verify_pages: a token's KV row is {chunk} bytes, not a multiple of 8"
            )
        self.view = view
        self.words = kv * layers * tokens * chunk // 8  # uint64 words per page
        with np.errstate(over="ignore"):
            self.table = _mix(np.arange(1, self.words + 1, dtype=np.uint64) * _GOLDEN)
        self.table |= np.uint64(1)
        self.sums = np.zeros(pages, dtype=np.uint64)  # per host page, valid once sealed
        self.checked_pages = 0  # pages verified so far
        self.bad_pages = 0  # pages that failed
        item = view.element_size()
        base = view.data_ptr()
        self._bases = np.array(  # (layer, kv) order, as the table counts words
            [
                base + (k * view.stride(0) + layer * view.stride(1)) * item
                for layer in range(layers)
                for k in range(kv)
            ],
            dtype=np.int64,
        )
        self._strides = (view.stride(2) * item, view.stride(3) * item, tokens, chunk)
        self._c = USE_C and view.device.type == "cpu" and view.stride(4) == 1

    def compute(self, pages: np.ndarray | torch.Tensor) -> np.ndarray:
        """The checksums of ``pages`` as they are now (uint64, one per page). Pure."""
        pages = np.ascontiguousarray(np.asarray(pages), dtype=np.int64)
        if len(pages) and (pages.min() < 0 or pages.max() >= len(self.sums)):
            raise IndexError("page_sums: a page outside the pool")
        out = np.empty(len(pages), dtype=np.uint64)
        if self._c:
            _copy.page_sums(self._bases, *self._strides, pages, self.table, out)
            return out
        idx = torch.from_numpy(pages)
        part = self.view.index_select(2, idx).permute(2, 1, 0, 3, 4).contiguous()
        words = part.view(torch.uint8).numpy().view(np.uint64).reshape(len(pages), -1)
        with np.errstate(over="ignore"):
            return _mix((words * self.table).sum(axis=1, dtype=np.uint64))

    def seal(self, pages: np.ndarray | torch.Tensor) -> None:
        """Record the checksums of ``pages`` (just written)."""
        pages = np.asarray(pages)
        self.sums[pages] = self.compute(pages)

    def bad(self, pages: np.ndarray | torch.Tensor) -> np.ndarray:
        """The pages of ``pages`` whose bytes differ from what ``seal`` recorded."""
        pages = np.asarray(pages)
        now = self.compute(pages)
        wrong = pages[now != self.sums[pages]]
        self.checked_pages += len(pages)
        self.bad_pages += len(wrong)
        return wrong
