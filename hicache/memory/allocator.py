"""PagedAllocator: the free list of one pool, for the device and the host pool alike.

Memory is handed out in whole pages (page_size 1 is a page of one token). Each page carries a
state byte in ``state``; the allocator owns FREE vs not-FREE, and the cache refines not-FREE into
OWNED (held by a caller) and TREE (referenced by a tree node). Pages a transfer reads or writes
stay TREE until its acknowledgement, so they can never be freed early. One array is the single
source of truth that ``check_integrity`` cross-checks against the tree.

Why a numpy stack and not a torch tensor or a Python list: pops and pushes of many pages are
one slice each, state checks are vectorised, and nothing here ever synchronises a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum

import numpy as np
import torch

import hicache._native as _native
from hicache.errors import DoubleFreeError, IntegrityError, InvalidIndicesError


class PageState(IntEnum):
    FREE = 0
    OWNED = 1  # allocated, held by a caller, not in the tree
    TREE = 2  # referenced by exactly one tree node (possibly read or written by a transfer)
    RESERVED = 3  # the device padding page: never allocated, never freed


FREE, OWNED, TREE, RESERVED = PageState.FREE, PageState.OWNED, PageState.TREE, PageState.RESERVED
_whole_pages = _native._fast.whole_pages if _native._fast is not None else None  # (claim)
_CLAIMABLE = frozenset((OWNED, TREE))  # the states claim moves pages between

IntArrayLike = torch.Tensor | np.ndarray | Sequence[int]


def as_int64(values: IntArrayLike, name: str) -> np.ndarray:
    """A 1-D int64 numpy array from a tensor, array or sequence; raises on anything else."""
    if type(values) is np.ndarray and values.dtype == np.int64 and values.ndim == 1:
        return values  # the wire form
    if isinstance(values, torch.Tensor):
        if values.dtype is torch.int64 and values.is_cpu and not values.requires_grad:
            if values.dim() == 1:
                return values.numpy()
        if values.dtype.is_floating_point or values.dtype == torch.bool:
            raise InvalidIndicesError(f"{name}: expected integers, got {values.dtype}")
        if values.device.type != "cpu" or values.requires_grad:
            values = values.detach().cpu()
        values = values.numpy()
    arr = np.asarray(values)
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    if arr.dtype.kind not in "iu" or arr.ndim != 1:
        raise InvalidIndicesError(f"{name}: expected a 1-D array of integers, got {arr.dtype}")
    return arr.astype(np.int64, copy=False)


class PagedAllocator:
    """Free-page stack plus per-page state for one pool of ``num_pages`` pages.

    Not thread-safe: the cache calls it from one thread. ``alloc*`` returns None when short and
    changes nothing; ``free*`` raises InvalidIndicesError / DoubleFreeError and changes nothing.
    """

    def __init__(self, num_pages: int, page_size: int, reserved_pages: int = 0):
        if num_pages <= reserved_pages:
            raise ValueError("a pool needs at least one allocatable page")
        self.num_pages = num_pages  # including reserved pages
        self.page_size = page_size
        self.reserved_pages = reserved_pages  # pages [0, reserved) are never handed out
        self.state = np.zeros(num_pages, dtype=np.int8)  # PageState per page
        self.state[:reserved_pages] = PageState.RESERVED
        # Stack of free pages; the top is at the end. Low page ids are handed out first.
        self._stack = np.arange(num_pages - 1, reserved_pages - 1, -1, dtype=np.int64)
        self._top = len(self._stack)
        self._group: list[np.ndarray] | None = None  # pages freed inside free_group_begin/end
        self._scratch = np.zeros(num_pages, dtype=np.int64)  # for has_duplicates
        self._order = np.arange(num_pages, dtype=np.int64)
        self._offsets = np.arange(page_size, dtype=np.int64)  # slot offsets within a page
        # pages freed since watch_frees() (a snapshot summing pages off-thread checks that
        # none of its pages was reused meanwhile); None when nobody watches
        self.freed: np.ndarray | None = None

    # ---- queries ------------------------------------------------------------------------
    @property
    def capacity_pages(self) -> int:
        return self.num_pages - self.reserved_pages

    @property
    def free_pages(self) -> int:
        return self._top + sum(len(g) for g in self._group or ())

    def count(self, state: PageState) -> int:
        return int(np.count_nonzero(self.state == state))

    # ---- pages --------------------------------------------------------------------------
    def alloc_pages(self, n: int, state: PageState = PageState.OWNED) -> np.ndarray | None:
        """Take ``n`` pages (marked ``state``), or None if fewer are free. Mutates the stack."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self._top:
            self._flush_group()
            if n > self._top:
                return None
        pages = self._stack[self._top - n : self._top][::-1].copy()
        self._top -= n
        self.state[pages] = state
        return pages

    def take_pages(self, pages: np.ndarray, state: PageState) -> None:
        """Claim these particular free pages (a restart adopting what a snapshot names).
        ValueError, changing nothing, unless they are distinct, in range and free. O(pool)."""
        pages = np.asarray(pages, dtype=np.int64)
        if pages.size == 0:
            return
        self._flush_group()
        if (
            int(pages.min()) < self.reserved_pages
            or int(pages.max()) >= self.num_pages
            or self.has_duplicates(pages)
            or (self.state[pages] != PageState.FREE).any()
        ):
            raise ValueError("take_pages: pages must be distinct, in range and free")
        free = self._stack[: self._top]
        keep = free[~np.isin(free, pages)]
        self._stack[: len(keep)] = keep
        self._top = len(keep)
        self.state[pages] = state

    def settle_pages(self, pages: np.ndarray, state: PageState) -> None:
        """Mutates: a caller's OWNED pages (distinct, in range) become ``state`` (TREE when
        they join the tree). Raises, changing nothing, for a page that is not OWNED."""
        self.check_owned(pages)
        self.state[pages] = state

    def check_pages(self, pages: np.ndarray, expected: PageState | None = None) -> None:
        """Raise unless ``pages`` are distinct, in range, allocated (and in ``expected``)."""
        if pages.size == 0:
            return
        lo, hi = int(pages.min()), int(pages.max())
        if lo < 0 or hi >= self.num_pages:
            raise InvalidIndicesError(f"page {lo if lo < 0 else hi} is outside the pool")
        states = self.state[pages]
        if (states == PageState.RESERVED).any():
            raise InvalidIndicesError("the padding slot cannot be freed or inserted")
        if (states == PageState.FREE).any():
            raise DoubleFreeError("page is already free (double free or never allocated)")
        if expected is not None and (states != expected).any():
            raise InvalidIndicesError(f"pages are not {expected.name.lower()}")
        if self.has_duplicates(pages):
            raise DoubleFreeError("the same page is freed twice in one call")

    def whole_pages(self, slots: np.ndarray) -> np.ndarray:
        """Page ids of ``slots``, which must fill whole pages of this pool in order.

        At page_size 4, slots [8, 9, 10, 11, 20, 21, 22, 23] are pages [2, 5]; [8, 9, 11, 10]
        and [9, 10, 11, 12] are rejected. Four numpy calls whatever the length: numpy's
        per-call cost, not the data, dominates these checks.
        """
        ps = self.page_size
        if len(slots) % ps:
            raise InvalidIndicesError(f"device_indices: {len(slots)} slots are not whole pages")
        rows = slots.reshape(-1, ps)
        pages = rows[:, 0] // ps
        if len(pages) and int(pages.view(np.uint64).max()) >= self.num_pages:
            raise InvalidIndicesError("device_indices: slot outside the pool")
        if ps > 1 and (pages[:, None] * ps + self._offsets).tobytes() != rows.tobytes():
            raise InvalidIndicesError(
                f"device_indices: each run of {ps} tokens must fill one page in order"
            )
        return pages

    def check_owned(self, pages: np.ndarray, state: PageState = PageState.OWNED) -> None:
        """Fast path of check_pages for in-range pages: all in ``state`` and distinct."""
        if self.state[pages].tobytes() != bytes([state]) * len(pages):  # no ufunc needed
            self.check_pages(pages, state)  # raises with the precise reason
        if self.has_duplicates(pages):
            raise DoubleFreeError("the same page is passed twice")

    def has_duplicates(self, pages: np.ndarray) -> bool:
        """Whether ``pages`` (in range) repeats a page. O(n), no sort: each position writes its
        own index into a scratch array; a repeated page keeps only its last writer's."""
        if len(pages) < 64:  # a set beats three numpy calls on small inputs
            return len(set(pages.tolist())) != len(pages)
        order = self._order[: len(pages)]
        self._scratch[pages] = order
        return not np.array_equal(self._scratch[pages], order)

    def free_pages_checked(self, pages: np.ndarray, expected: PageState | None = None) -> None:
        """Return pages to the free list after check_pages. Mutates state and stack."""
        self.check_pages(pages, expected)
        self.release(pages)

    def watch_frees(self) -> None:
        """Start marking freed pages in ``freed`` (anew: earlier marks are cleared)."""
        self.freed = np.zeros(self.num_pages, dtype=bool)

    def unwatch_frees(self) -> None:
        self.freed = None

    def claim(
        self, raw: bytes, expected: PageState, state: PageState, free_tail: bool = False
    ) -> bytes:
        """Move a caller's pages from ``expected`` to ``state`` (OWNED or TREE: ValueError for
        another); returns their ids (int64 bytes).

        ``raw`` holds the slots (int64 bytes). They must fill whole pages in order, except that
        the last run may be a partial page (its first slots); every page must be in range, in
        state ``expected`` and appear once. Otherwise raises InvalidIndicesError
        (DoubleFreeError for a repeated page) and changes nothing. With ``free_tail`` a partial
        last page is checked like the rest, then freed and left out of the ids (an insert's
        tail). One C pass when built (it pushes the tail page on the free stack itself, unless
        frees are watched or grouped); the numpy twin otherwise, and for the precise error.
        """
        if expected not in _CLAIMABLE or state not in _CLAIMABLE:
            raise ValueError("claim: pages move between OWNED and TREE only")
        ps = self.page_size
        tail = free_tail and len(raw) // 8 % ps != 0
        if _native.USE_C:
            assert _whole_pages is not None  # (USE_C: the C helpers are built)
            top = self._top  # (a full stack: no page is out to be freed)
            if tail and self.freed is None and self._group is None and top < len(self._stack):
                # the same pass writes the tail page at stack[top], with state FREE
                out = _whole_pages(
                    self.state, raw, ps, self.num_pages, expected, state, self._stack, top, FREE
                )
                if type(out) is bytes:
                    self._top = top + 1
                    return out
            else:
                out = _whole_pages(self.state, raw, ps, self.num_pages, expected, state)
                if type(out) is bytes:
                    if tail:
                        self.release_page(int.from_bytes(out[-8:], "little"))
                        return out[:-8]
                    return out
        pages = self._caller_pages(np.frombuffer(raw, dtype=np.int64), expected)
        if _native.USE_C:  # numpy accepted what C refused: never silently
            raise InvalidIndicesError(f"device_indices: rejected (code {out})")
        self.state[pages] = state
        if tail:
            self.release_page(int(pages[-1]))
            pages = pages[:-1]
        return pages.tobytes()

    def _caller_pages(self, slots: np.ndarray, expected: PageState) -> np.ndarray:
        """claim's checks in numpy: the page ids of ``slots``, or the precise error."""
        ps = self.page_size
        whole = len(slots) // ps * ps
        pages = self.whole_pages(slots[:whole])
        tail = slots[whole:]
        if len(tail):
            first = int(tail[0])
            if first < 0 or first // ps >= self.num_pages:
                raise InvalidIndicesError("device_indices: slot outside the pool")
            if first % ps or tail.tolist() != list(range(first, first + len(tail))):
                raise InvalidIndicesError("device_indices: a partial page must be its first slots")
            pages = np.append(pages, first // ps)
        if len(pages):
            self.check_pages(pages, expected)
        if self.has_duplicates(pages):
            raise DoubleFreeError("the same page is passed twice")
        return pages

    def release_page(self, page: int) -> None:
        """``release`` of one page (an insert's partial tail page: no array on the way)."""
        if self.freed is not None:
            self.freed[page] = True
        if self._group is not None:
            self.release(np.array([page], dtype=np.int64))
            return
        self.state[page] = FREE
        self._stack[self._top] = page
        self._top += 1

    def release(self, pages: np.ndarray) -> None:
        """Return pages known to be allocated (internal fast path, no checks)."""
        if self.freed is not None:
            self.freed[pages] = True
        if len(pages) == 1 and self._group is None:  # the usual partial tail page
            page = int(pages[0])
            self.state[page] = FREE
            self._stack[self._top] = page
            self._top += 1
            return
        if pages.size == 0:
            return
        self.state[pages] = PageState.FREE
        if self._group is not None:
            self._group.append(pages)
            return
        self._push(pages)

    def _push(self, pages: np.ndarray) -> None:
        n = len(pages)
        if n <= 4:  # scalar stores beat slicing for the usual single tail page
            for page in pages.tolist()[::-1]:
                self._stack[self._top] = page
                self._top += 1
            return
        self._stack[self._top : self._top + n] = pages[::-1]
        self._top += n

    def _flush_group(self) -> None:
        if self._group:
            self._push(np.concatenate(self._group))
            self._group = []

    def free_group_begin(self) -> None:
        """Batch the following frees; they become allocatable at free_group_end()."""
        self._group = []

    def free_group_end(self) -> None:
        self._flush_group()
        self._group = None

    # ---- slots --------------------------------------------------------------------------
    def check_slot_range(self, slots: np.ndarray) -> None:
        """Raise unless every slot is in [0, pool size). One reduction: negatives wrap around
        to huge unsigned values."""
        limit = self.num_pages * self.page_size
        if slots.size and int(slots.view(np.uint64).max()) >= limit:
            raise InvalidIndicesError(f"slot outside the pool [0, {limit})")

    def pages_of_slots(self, slots: np.ndarray) -> np.ndarray:
        """Distinct pages touched by ``slots`` (range-checked), in first-seen order."""
        self.check_slot_range(slots)
        pages = slots // self.page_size
        if self.page_size == 1:
            return pages
        _, first = np.unique(pages, return_index=True)
        return pages[np.sort(first)]

    def slots_of_pages(self, pages: np.ndarray, n_tokens: int | None = None) -> np.ndarray:
        """Slot ids of ``pages`` in order, cut to ``n_tokens``."""
        ps = self.page_size
        slots = pages if ps == 1 else (pages[:, None] * ps + np.arange(ps)).reshape(-1)
        return slots if n_tokens is None else slots[:n_tokens]

    def check_integrity(self) -> None:
        """The stack holds exactly the FREE pages, each once."""
        stack = np.concatenate([self._stack[: self._top], *(self._group or ())])
        free = np.flatnonzero(self.state == PageState.FREE)
        if len(stack) != len(free) or not np.array_equal(np.sort(stack), free):
            raise IntegrityError("allocator: free stack and FREE states disagree")
        if (self.state[: self.reserved_pages] != PageState.RESERVED).any():
            raise IntegrityError("allocator: a reserved page changed state")

    # ---- SGLang's batched forms (device pool) --------------------------------------------
    def extend_pages_needed(self, prefix_lens: np.ndarray, seq_lens: np.ndarray) -> int:
        """New pages alloc_extend would take for these requests (pure)."""
        ps = self.page_size
        return int(((seq_lens + ps - 1) // ps - (prefix_lens + ps - 1) // ps).sum())

    def alloc_extend(
        self, prefix_lens: np.ndarray, seq_lens: np.ndarray, last_loc: np.ndarray
    ) -> np.ndarray | None:
        """Slots for tokens [prefix_len, seq_len) of each request, concatenated.

        Per request, the tokens fill three regions (SGLang's semantics)::

            | prefix ... last_loc | part 1: rest of the last  | part 2: whole new | part 3: new |
            |                     | partial page (last_loc+1..)| pages             | partial page|

        ``last_loc`` is the slot of the last prefix token (-1 when the prefix is empty).
        Returns None (and allocates nothing) when the pool has too few free pages.
        """
        ps = self.page_size
        pages = self.alloc_pages(self.extend_pages_needed(prefix_lens, seq_lens))
        if pages is None:
            return None
        out, used = [], 0
        rows = zip(prefix_lens.tolist(), seq_lens.tolist(), last_loc.tolist(), strict=True)
        for p, s, last in rows:
            part1 = min(s, -(-p // ps) * ps) - p
            if part1:
                out.append(np.arange(last + 1, last + 1 + part1, dtype=np.int64))
            rest = s - p - part1
            n_new = -(-rest // ps)
            if rest:
                out.append(self.slots_of_pages(pages[used : used + n_new], rest))
            used += n_new
        return np.concatenate(out) if out else np.empty(0, dtype=np.int64)

    def alloc_decode(self, seq_lens: np.ndarray, last_loc: np.ndarray) -> np.ndarray | None:
        """One slot per request for token seq_len-1: last_loc+1, or a new page's first slot."""
        new_page = (seq_lens - 1) % self.page_size == 0
        pages = self.alloc_pages(int(new_page.sum()))
        if pages is None:
            return None
        out = last_loc + 1
        out[new_page] = pages * self.page_size
        return out
