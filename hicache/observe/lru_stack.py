"""LruStack: the stack engine behind the capacity curves (``capacity.py``).

An LRU stack of 64-bit page keys that says each touched key's stack (reuse) distance: the
number of distinct other keys touched since its previous touch. A request's pages are touched
from its last page to its first, so a page's ancestors are always more recent than the page.
``as_keys`` turns page hashes into the keys it takes. No state outside an ``LruStack``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

U64 = (1 << 64) - 1  # a page key is a hash's low 64 bits


def as_keys(page_hashes: Sequence[int] | np.ndarray) -> np.ndarray:
    """The low 64 bits of each hash as a uint64 array; ValueError for anything but a 1-D
    sequence of integers (bools included). Pure."""
    arr = page_hashes
    if not isinstance(arr, np.ndarray):  # a list: checked item by item (arrays are the fast path)
        if isinstance(arr, str | bytes) or not isinstance(arr, Sequence):
            raise ValueError(f"page hashes must be a sequence of ints, got {type(arr).__name__}")
        for i, h in enumerate(arr):
            if isinstance(h, bool) or not isinstance(h, int | np.integer):
                raise ValueError(f"page hash {i} is not an integer: {h!r}")
        return np.fromiter((int(h) & U64 for h in arr), np.uint64, len(arr))
    if arr.ndim != 1:
        raise ValueError(f"page hashes must be 1-D, got shape {arr.shape}")
    kind = arr.dtype.kind
    if kind == "u":
        return arr.astype(np.uint64, copy=False)
    if kind == "i":  # two's complement: the low 64 bits
        return arr.astype(np.int64, copy=False).view(np.uint64)
    if arr.size == 0:
        return np.empty(0, np.uint64)
    raise ValueError(f"page hashes must be integers, got dtype {arr.dtype}")


class LruStack:
    """An LRU stack of 64-bit keys: touches a request's keys last-to-first and says each one's
    stack distance. Mutated only by ``touch`` and ``drop_from``.

    The keys are kept sorted with their last touch time beside them, and a sorted copy of the
    live times; a key's distance is how many live times are later than its own. One request is
    one vectorized step when its keys are distinct and their previous times decrease from first
    page to last (always so for prefix-ordered pages); anything else is touched key by key.
    """

    def __init__(self) -> None:
        self.keys = np.empty(0, np.uint64)  # every live key, ascending
        self.last = np.empty(0, np.int64)  # last touch time of keys[i]
        self.times = np.empty(0, np.int64)  # every live key's last touch time, ascending
        self.clock = 0  # the next touch's time

    def __len__(self) -> int:
        return len(self.keys)

    def nbytes(self) -> int:
        return self.keys.nbytes + self.last.nbytes + self.times.nbytes

    def touch(self, keys: np.ndarray) -> np.ndarray:
        """Touch ``keys`` (prefix order) from last to first; returns their distances in prefix
        order, -1 for a key not in the stack."""
        m = len(keys)
        n = len(self.keys)
        if m == 0:
            return np.empty(0, np.int64)
        idx = self.keys.searchsorted(keys)
        found = self.keys.take(idx, mode="clip") == keys if n else np.zeros(m, bool)
        at = idx[found]
        prev = self.last[at]
        if len(at) > 1 and not (prev[1:] < prev[:-1]).all():
            return self._one_by_one(keys)  # not prefix-ordered, or a key twice
        fresh_keys = keys[~found] if len(at) < m else None
        if fresh_keys is not None and len(fresh_keys) > 1:
            ordered = np.sort(fresh_keys)
            if (ordered[1:] == ordered[:-1]).any():
                return self._one_by_one(keys)  # a new key twice
        # distance of page i = live keys touched after its last touch + this request's pages
        # touched before it (the walk goes last page first)
        after = np.arange(m - 1, -1, -1, dtype=np.int64)
        rank = self.times.searchsorted(prev)
        new_times = after + self.clock
        self.clock += m
        keep = np.ones(n, bool)
        keep[rank] = False
        self.times = np.concatenate((self.times[keep], new_times[::-1]))
        if fresh_keys is None:
            self.last[at] = new_times
            return after + (n - 1 - rank)
        dist = np.full(m, -1, np.int64)
        dist[found] = after[found] + (n - 1 - rank)
        self.last[at] = new_times[found]
        order = np.argsort(fresh_keys)
        where = idx[~found][order]
        self.keys = np.insert(self.keys, where, fresh_keys[order])
        self.last = np.insert(self.last, where, new_times[~found][order])
        return dist

    def _one_by_one(self, keys: np.ndarray) -> np.ndarray:
        dist = np.empty(len(keys), np.int64)
        for i in range(len(keys) - 1, -1, -1):
            dist[i] = self.touch(keys[i : i + 1])[0]
        return dist

    def drop_from(self, start: int) -> None:
        """Forget ``keys[start:]`` (the largest keys)."""
        gone = self.last[start:]
        if len(gone):
            keep = np.ones(len(self.times), bool)
            keep[np.searchsorted(self.times, gone)] = False
            self.times = self.times[keep]
            self.keys = self.keys[:start].copy()
            self.last = self.last[:start].copy()
