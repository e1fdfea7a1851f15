"""Where a host page's bytes live, and the checksum that travels with them.

A value in the store is one full page, every layer's K and V, in the host pool's own byte
order (the host layout is part of the key's seed), followed by a 16-byte trailer:
``xxh3_64(page bytes, seed = first 8 bytes of the key's digest)`` and ``MAGIC``. The checksum
binds the bytes to their key: a value stored under another key, a torn or short write, or a
flipped bit never verifies, and a value that does not verify is a miss.
"""

from __future__ import annotations

import struct

import numpy as np
import xxhash

from hicache.memory import KVPool

MAGIC = 0x3163_6863_6968  # "hichc1" little-endian, in the trailer's second word
TRAILER = struct.Struct("<QQ")
TRAILER_BYTES = TRAILER.size


class PageSegments:
    """The byte runs of each page of ``pool``: page ``p`` is ``runs`` shifted by
    ``p * page_stride``. Read-only after construction; thread-safe."""

    def __init__(self, pool: KVPool):
        view = pool.page_view  # [kv, L, P, ps, HD], any layout
        item = view.element_size()
        kv, layers, _, ps, width = view.shape
        s_kv, s_l, s_p, s_t, s_w = view.stride()
        if s_w != 1:
            raise ValueError("host pool: a row's elements must be contiguous")
        rows = (
            np.arange(kv)[:, None, None] * s_kv
            + np.arange(layers)[None, :, None] * s_l
            + np.arange(ps)[None, None, :] * s_t
        ).reshape(-1)
        rows = np.sort(rows) * item
        row_bytes = width * item
        starts = [int(rows[0])]
        ends = [int(rows[0]) + row_bytes]
        for r in rows[1:].tolist():
            if r == ends[-1]:
                ends[-1] += row_bytes
            else:
                starts.append(r)
                ends.append(r + row_bytes)
        self.runs = [(s, e - s) for s, e in zip(starts, ends, strict=True)]
        self.page_stride = s_p * item
        self.page_bytes = pool.page_bytes
        self.base = pool.buffer.data_ptr()
        self.num_pages = pool.num_pages
        # the whole pool, bytes (numpy's stubs give ndarray __buffer__ on Python 3.12+ only)
        self.memory = memoryview(pool.buffer.numpy()).cast("B")  # type: ignore[arg-type]

    def pointers(self, page: int) -> tuple[list[int], list[int]]:
        """Absolute addresses and sizes of page ``page``'s runs, in value order."""
        at = self.base + page * self.page_stride
        return [at + off for off, _ in self.runs], [n for _, n in self.runs]

    def views(self, page: int) -> list[memoryview]:
        """The page's runs as writable views of the pool."""
        at = page * self.page_stride
        return [self.memory[at + off : at + off + n] for off, n in self.runs]

    def read(self, page: int) -> bytes:
        """The page's value bytes (one copy), without the trailer."""
        return b"".join(self.views(page))

    def write(self, page: int, data: bytes | memoryview) -> None:
        """Copy a value's page bytes (no trailer) into page ``page``."""
        src, at = memoryview(data), 0
        for view in self.views(page):
            view[:] = src[at : at + len(view)]
            at += len(view)


def checksum(views: list[memoryview] | list[bytes], digest: bytes) -> int:
    h = xxhash.xxh3_64(seed=int.from_bytes(digest[:8], "little"))
    for v in views:
        h.update(v)
    return h.intdigest()


def trailer(views: list[memoryview] | list[bytes], digest: bytes) -> bytes:
    """The 16 bytes stored after a page's bytes."""
    return TRAILER.pack(checksum(views, digest), MAGIC)


def verify(views: list[memoryview] | list[bytes], digest: bytes, tail: bytes | memoryview) -> bool:
    """Whether ``views`` (a page read back) and its trailer ``tail`` belong to ``digest``."""
    if len(tail) != TRAILER_BYTES:
        return False
    value, magic = TRAILER.unpack(tail)
    return magic == MAGIC and value == checksum(views, digest)
