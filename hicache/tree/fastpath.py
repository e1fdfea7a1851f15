"""The match/insert hot path's one-pass helpers: C when built (``_fast.c``: checks, packing,
page ids; ``_tree.c``: the tree walk and a match's bookkeeping), numpy or Python otherwise.

Both paths accept and reject exactly the same input and leave the same state (the tests run
both); the C one exists because numpy's per-call cost and Python's per-step cost, not the data,
dominated. Set HICACHE_NO_C=1 to use the fallback (the switch is ``hicache/_native.py``'s).
"""

from __future__ import annotations

import operator

import numpy as np

import hicache._native as _native
from hicache._native import _fast, _tree
from hicache.tree.node import TreeNode

MAX_SLOT_BYTES = 1 << 40  # the most page_slots builds (as _fast.c)


def min_token(tokens: np.ndarray | bytes | memoryview) -> int:
    """Smallest id of contiguous int32 (an array or LE bytes), or 0 when none is negative."""
    if _native.USE_C:
        return _fast.min_int32(tokens)
    arr = tokens if isinstance(tokens, np.ndarray) else np.frombuffer(tokens, dtype=np.int32)
    return min(int(arr.min()), 0) if len(arr) else 0


def page_slots(pages: bytes | np.ndarray, page_size: int) -> bytearray:
    """The int64 slots of int64 page ids, page by page (page * page_size + offset)."""
    if _native.USE_C:
        return _fast.page_slots(pages, page_size)
    nbytes = pages.nbytes if isinstance(pages, np.ndarray) else len(pages)  # (not an array's len)
    if page_size < 1 or nbytes % 8:
        raise ValueError("page_slots: need page_size >= 1 and int64 pages")
    ids = np.frombuffer(pages, dtype=np.int64)
    if len(ids) and page_size > MAX_SLOT_BYTES // 8 // len(ids):
        raise ValueError("page_slots: too many slots")
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) > (2**63 - 1 - page_size) // page_size):
        raise ValueError("page_slots: a page id outside [0, 2**63 / page_size)")
    slots = ids[:, None] * page_size + np.arange(page_size, dtype=np.int64)
    return bytearray(slots.tobytes())


def slot_pages(slots: bytes, page_size: int) -> bytes:
    """For each run of ``page_size`` int64 slots: the page it is (a whole page, in order), or
    -1. A trailing partial run is left out."""
    if _native.USE_C:
        return _fast.slot_pages(slots, page_size)
    if page_size < 1:
        raise ValueError("slot_pages: need page_size >= 1")
    n = len(slots) // (8 * page_size)
    runs = np.frombuffer(slots, dtype=np.int64, count=n * page_size).reshape(n, page_size)
    first = runs[:, 0]
    whole = (first >= 0) & (first % page_size == 0)
    with np.errstate(over="ignore"):  # as the C twin: compared modulo 2**64, never an error
        offsets = runs.view(np.uint64) - first.view(np.uint64)[:, None]
    whole &= (offsets == np.arange(page_size, dtype=np.uint64)).all(axis=1)
    return np.where(whole, first // page_size, -1).astype(np.int64).tobytes()


def own_nodes(path: list[TreeNode], i: int, pos: int, slots: bytes, page_size: int):
    """From ``path[i]`` on, pass every node whose device pages the int64 ``slots`` from slot
    ``pos`` on are exactly (page * page_size + 0, 1, ... in order); stop at the first with no
    device pages or other slots. Returns (i, pos) after the passed nodes. Compared in place,
    nothing built. At page size 1 the slots are the pages, byte for byte; above it, a negative
    or overflowing page id never matches."""
    if _native.USE_C:
        return _tree.own_nodes(path, i, pos, slots, page_size)
    if type(path) is not list:
        raise TypeError(f"own_nodes: path must be a list, not {type(path).__name__}")
    i, pos, page_size = (_ssize(v) for v in (i, pos, page_size))
    view = memoryview(slots)  # (TypeError for what is not a buffer, as C's y*)
    if not view.c_contiguous:
        raise ValueError("own_nodes: the slots are not C-contiguous")
    view = view.cast("B")  # bytes, whatever the buffer's item type
    if page_size < 1 or i < 0 or pos < 0:
        raise ValueError("own_nodes: need page_size >= 1, i >= 0, pos >= 0")
    avail = len(view) // 8
    while i < len(path) and pos <= avail:
        pages = path[i].device_pages
        if pages is not None and (not isinstance(pages, bytes) or len(pages) % 8):
            raise TypeError("own_nodes: device_pages must be int64 bytes")
        if pages is None or not _slots_are_pages(view, pos, pages, page_size):
            break
        pos += len(pages) // 8 * page_size
        i += 1
    return i, pos


def _ssize(value: object) -> int:
    """``value`` as C's Py_ssize_t would take it: an int (TypeError), within 64 bits."""
    value = operator.index(value)  # type: ignore[arg-type]  # anything: TypeError, as C's
    if not -(2**63) <= value < 2**63:
        raise OverflowError("Python int too large to convert to C ssize_t")
    return value


def _slots_are_pages(view: memoryview, pos: int, pages: bytes, page_size: int) -> bool:
    n = len(pages) // 8
    if n == 0:
        return True
    if n > (len(view) // 8 - pos) // page_size:
        return False
    mine = view[8 * pos : 8 * (pos + n * page_size)]
    if page_size == 1:
        return mine == pages
    ids = np.frombuffer(pages, dtype=np.int64)
    if int(ids.min()) < 0 or int(ids.max()) > (2**63 - page_size) // page_size:
        return False  # (as C: a page whose last slot would pass 2**63 - 1 never matches)
    want = ids[:, None] * page_size + np.arange(page_size, dtype=np.int64)
    return bool((np.frombuffer(mine, dtype=np.int64) == want.ravel()).all())


def pack_shared(arrays: list[np.ndarray]) -> tuple[bytes, list[int]]:
    """Contiguous int32 sequences as one byte string, each without the leading tokens it shares
    with the previous sequence, and those counts (a batch's system prompt travels once)."""
    if _native.USE_C:
        return _fast.pack_shared(arrays)
    if not arrays:
        return b"", []
    shared = [0] + [common_tokens(a, b, 0) for a, b in zip(arrays[:-1], arrays[1:], strict=True)]
    return b"".join(a[s:].tobytes() for a, s in zip(arrays, shared, strict=True)), shared


def unpack_shared(frame: bytes | memoryview, lengths: list[int], shared: list[int]) -> list[bytes]:
    """The sequences pack_shared packed, as int32 byte strings. The caller has checked that
    ``lengths`` and ``shared`` agree with each other and with the frame."""
    if _native.USE_C:
        return _fast.unpack_shared(frame, lengths, shared)
    if len(lengths) != len(shared):
        raise ValueError("lengths and shared do not match the frame")
    out, pos, prev = [], 0, b""
    for n, s in zip(lengths, shared, strict=True):
        if n < 0 or s < 0 or s > n or n - s > (len(frame) - pos) // 4 or s > len(prev) // 4:
            raise ValueError("lengths and shared do not match the frame")
        take = 4 * (n - s)
        key = bytes(frame[pos : pos + take]) if not s else prev[: 4 * s] + frame[pos : pos + take]
        pos += take
        out.append(key)
        prev = key
    return out


def common_tokens(node_key: bytes | np.ndarray, key: bytes | np.ndarray, pos: int) -> int:
    """How many leading int32 tokens ``node_key`` and ``key[pos:]`` share (int32 arrays too,
    at ``pos`` 0: pack_shared's)."""
    if _native.USE_C:
        return _fast.common_bytes(node_key, key, pos) >> 2
    if not 0 <= pos <= len(key):
        return 0
    a = np.frombuffer(node_key, dtype=np.int32)
    b = np.frombuffer(key, dtype=np.int32, offset=pos)
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def descend_py(node: TreeNode, key: bytes, pos: int, page_bytes: int, now: int):
    """From ``node``, follow every child that ``key[pos:]`` covers whole, stamping its
    last_access with ``now``. Returns (those children, the key position after them); stops
    before a child that is missing or matched only in part. Mutates: last_access only."""
    path, end = [], len(key)
    while pos + page_bytes <= end:
        child = node.children.get(key[pos : pos + page_bytes])
        if child is None or not key.startswith(child.key, pos):
            break
        child.last_access = now
        path.append(child)
        pos += len(child.key)
        node = child
    return path, pos


def tally_py(path: list[TreeNode], io_load: object) -> tuple[list[bytes], int, bool, bool]:
    """A match's bookkeeping over its path: every node's hit_count += 1. Of the device nodes
    (they come first): (their device_pages, those bytes' total, whether one has no host copy,
    whether one's io is ``io_load``). Mutates: hit counts only."""
    chunks, nbytes, unbacked, loading = [], 0, False, False
    for node in path:
        node.hit_count += 1
        pages = node.device_pages
        if pages is not None:
            chunks.append(pages)
            nbytes += len(pages)
            unbacked = unbacked or node.host_pages is None
            loading = loading or node.io is io_load
    return chunks, nbytes, unbacked, loading


# Chosen once: these run several times per match, where a wrapper's call would cost more
# than the step itself (tests compare the C functions with the *_py twins directly).
descend = _tree.descend if _native.USE_C else descend_py
tally = _tree.tally if _native.USE_C else tally_py


def store_release(words: np.ndarray, index: int, value: int) -> None:
    """words[index] = value, ordered after every earlier write of this thread (C), or a plain
    store (numpy: enough on x86, whose stores are never reordered with each other)."""
    if _native.USE_C:
        _fast.store_release(words, index, value)
    else:
        words[_word(words, index)] = value


def load_acquire(words: np.ndarray, index: int) -> int:
    """words[index], ordered before every later read of this thread (see store_release)."""
    if _native.USE_C:
        return _fast.load_acquire(words, index)
    return int(words[_word(words, index)])


def _word(words: np.ndarray, index: int) -> int:
    """``index`` when it names a word of ``words`` (no negative indexing from the end)."""
    if not 0 <= index < len(words):
        raise IndexError("word outside the buffer")
    return index
