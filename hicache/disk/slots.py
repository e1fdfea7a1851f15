"""Fixed-size slots in a few large preallocated files, and what each slot says about itself.

A slot is a header block (``ALIGN`` bytes) followed by the value, padded to ``ALIGN``; the
slots are striped over the files (slot ``i`` is in file ``i % n`` at ``(i // n) *
slot_bytes``), so a tier on several drives reads and writes all of them. The header names
what the slot holds: its key, its chain parent's key (the page before it in its prompt; empty
for a prompt's first page), the value's length, the caller's trailer (the page checksum,
verified by the caller after a read), a sequence number (the newer of two slots claiming a
key wins at recovery) and a checksum of the header itself. A slot is written whole, header
and value, in one call: a torn write leaves a header that does not verify or a value whose
trailer does not, and either is a miss.

``SlotFiles`` does the I/O (positional) and holds no index: several threads may read and
write distinct slots at once. A value whose parts all start and end on ``ALIGN`` boundaries
(a pool's pages, typically) goes between its memory and the drive in one vectored call, the
header and padding from the thread's own aligned buffer (zero-copy); any other value, and any
value on a file system without direct I/O where copying costs nothing extra, through that
buffer (a bounce copy). A read straight into the caller's memory leaves it undefined when
the slot turns out not to hold the key.
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from hicache.disk.folder import ALIGN, aligned

MAGIC = b"hcdisk01"
VERSION = 2  # (1: no parent; its slots read as free)
# magic, version, key length, parent length, value length, trailer, seq
FIXED = struct.Struct("<8sHHHQ16sQ")
SUM = struct.Struct("<Q")
MAX_KEY = 1024  # bytes of a key (and of a parent's key) a header holds
TRAILER_BYTES = 16
assert FIXED.size + 2 * MAX_KEY + SUM.size <= ALIGN


@dataclass(frozen=True)
class Header:
    key: str
    value_len: int
    trailer: bytes  # the caller's (16 bytes)
    seq: int  # write order: the higher of two slots with one key is the newer
    parent: str | None = None  # the chain parent's key (None: a prompt's first page)

    def pack(self) -> bytes:
        key, parent = self.key.encode(), (self.parent or "").encode()
        fixed = FIXED.pack(
            MAGIC, VERSION, len(key), len(parent), self.value_len, self.trailer, self.seq
        )
        body = fixed + key + parent
        return body + SUM.pack(xxhash.xxh3_64_intdigest(body))

    @classmethod
    def unpack(cls, block: bytes | memoryview) -> Header | None:
        """The header in ``block``, or None where it does not verify (never written, torn,
        another format)."""
        try:
            magic, version, key_len, parent_len, value_len, trailer, seq = FIXED.unpack_from(block)
        except struct.error:
            return None
        if magic != MAGIC or version != VERSION or key_len > MAX_KEY or parent_len > MAX_KEY:
            return None
        end = FIXED.size + key_len + parent_len
        body = bytes(block[:end])
        if SUM.unpack_from(block, end)[0] != xxhash.xxh3_64_intdigest(body):
            return None
        try:
            key = body[FIXED.size : FIXED.size + key_len].decode()
            parent = body[FIXED.size + key_len :].decode()
        except UnicodeDecodeError:
            return None
        return cls(key, value_len, trailer, seq, parent or None)


Fault = Callable[[str, int], None]  # (op "read"/"write", slot): raises OSError to inject one


class SlotFiles:
    """``count`` slots of ``value_bytes`` values over the open data files ``fds``."""

    def __init__(
        self,
        fds: list[int],
        value_bytes: int,
        count: int,
        fault: Fault | None = None,
        zero_copy: bool = True,
    ):
        self.fds = fds
        self.zero_copy = zero_copy  # aligned values go straight between memory and drive
        self.value_bytes = value_bytes
        self.slot_bytes = ALIGN + -(-value_bytes // ALIGN) * ALIGN
        self.count = count
        self.fault = fault  # tests' fault layer (EIO, slowness) in front of every I/O
        self._local = threading.local()  # each thread's bounce buffer (page-aligned)
        self._buffers: list[tuple[mmap.mmap, memoryview]] = []
        self._lock = threading.Lock()

    def _buffer(self) -> memoryview:
        view = getattr(self._local, "view", None)
        if view is None:
            buf = aligned(self.slot_bytes)
            view = self._local.view = memoryview(buf)
            with self._lock:
                self._buffers.append((buf, view))
        return view

    def where(self, slot: int) -> tuple[int, int]:
        n = len(self.fds)
        return self.fds[slot % n], (slot // n) * self.slot_bytes

    def write(self, slot: int, header: Header, parts: Sequence[memoryview | bytes]) -> None:
        """Write the slot whole: header, then ``parts`` (the value), padding. OSError."""
        if self.fault is not None:
            self.fault("write", slot)
        view = self._buffer()
        head = header.pack()
        view[: len(head)] = head
        view[len(head) : ALIGN] = bytes(ALIGN - len(head))
        fd, offset = self.where(slot)
        parts = [as_bytes(p) for p in parts]
        if self.goes_direct(parts):
            size = sum(len(p) for p in parts)
            if size != header.value_len:
                raise ValueError(f"disk: a value of {size} bytes, not {header.value_len}")
            pad = view[ALIGN + size : self.slot_bytes]  # (zeros: the buffer's tail is unused)
            pad[:] = bytes(len(pad))
            iov = [view[:ALIGN], *(memoryview(p).cast("B") for p in parts)]
            _allv(os.pwritev, fd, [*iov, pad] if len(pad) else iov, offset)
            return
        at = ALIGN
        for part in parts:
            n = len(part)
            view[at : at + n] = part
            at += n
        if at != ALIGN + header.value_len:
            raise ValueError(f"disk: a value of {at - ALIGN} bytes, not {header.value_len}")
        _all(os.pwritev, fd, view[: self.slot_bytes], offset)

    def read_into(self, slot: int, key: str, into: Sequence[memoryview]) -> Header | None:
        """Read the slot's value into ``into`` (byte views summing to its length) and return
        its header, or None where the slot does not hold ``key`` whole (``into`` is then
        undefined). OSError; ValueError where the value held is not as long as ``into``."""
        size = sum(len(v) for v in into)
        if not self.goes_direct(into):
            got = self.read(slot, key)
            if got is None:
                return None
            _same_length(key, got[0], size)
            at = 0
            for view in into:
                n = len(view)
                view[:] = got[1][at : at + n]
                at += n
            return got[0]
        if self.fault is not None:
            self.fault("read", slot)
        fd, offset = self.where(slot)
        view = self._buffer()
        pad = view[ALIGN + size : self.slot_bytes]
        iov = [view[:ALIGN], *(memoryview(v).cast("B") for v in into)]
        _allv(os.preadv, fd, [*iov, pad] if len(pad) else iov, offset)
        header = Header.unpack(view[:ALIGN])
        if header is None or header.key != key:
            return None
        _same_length(key, header, size)
        return header

    def goes_direct(self, parts: Sequence[memoryview | bytes]) -> bool:
        """Whether ``parts`` go to the drive as they are: every one starts and ends on an
        ALIGN boundary (what direct I/O needs of memory), and padded they fill the slot."""
        if not self.zero_copy:
            return False
        for part in parts:
            if len(part) % ALIGN or _address(part) % ALIGN:
                return False
        return sum(len(p) for p in parts) <= self.slot_bytes - ALIGN

    def read_header(self, slot: int) -> Header | None:
        """The slot's header, or None (OSError from the drive)."""
        if self.fault is not None:
            self.fault("read", slot)
        fd, offset = self.where(slot)
        view = self._buffer()
        _all(os.preadv, fd, view[:ALIGN], offset)
        return Header.unpack(view[:ALIGN])

    def read(self, slot: int, key: str) -> tuple[Header, memoryview] | None:
        """The slot's header and value (a view of this thread's bounce buffer, valid until its
        next call), or None where the slot does not hold ``key`` whole. OSError."""
        if self.fault is not None:
            self.fault("read", slot)
        fd, offset = self.where(slot)
        view = self._buffer()
        _all(os.preadv, fd, view[: self.slot_bytes], offset)
        header = Header.unpack(view[:ALIGN])
        if header is None or header.key != key or header.value_len > self.value_bytes:
            return None
        return header, view[ALIGN : ALIGN + header.value_len]

    def sync(self) -> None:
        for fd in self.fds:
            os.fdatasync(fd)

    def close(self) -> None:
        with self._lock:
            buffers, self._buffers = self._buffers, []
        for buf, view in buffers:
            try:
                view.release()
                buf.close()
            except BufferError:  # a slice still referenced (a traceback's frame): freed with it
                pass


def as_bytes(part: memoryview | bytes) -> memoryview:
    """``part`` as a flat byte view (``len`` is its bytes); ValueError if it is not
    contiguous memory."""
    view = memoryview(part)
    if not view.c_contiguous:
        raise ValueError("disk: a value's parts must be contiguous memory")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _same_length(key: str, header: Header, size: int) -> None:
    if header.value_len != size:
        raise ValueError(f"disk: {key}'s value is {header.value_len} bytes, not the views' {size}")


def _address(part: memoryview | bytes) -> int:
    """Where ``part``'s bytes start in memory."""
    return int(np.frombuffer(part, np.uint8).ctypes.data) if len(part) else 0


def _allv(call: Callable[..., int], fd: int, views: list[memoryview], offset: int) -> None:
    """A whole vectored positional read or write (a short one is finished; an end of file is
    EIO)."""
    views = [v for v in views if len(v)]
    while views:
        n = call(fd, views, offset)
        if n <= 0:
            raise OSError(errno.EIO, "disk: a short read or write (the file was truncated?)")
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]


def _all(call: Callable[..., int], fd: int, view: memoryview, offset: int) -> None:
    """A whole positional read or write (a short one is finished, an end of file is EIO)."""
    done = 0
    while done < len(view):
        n = call(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "disk: a short read or write (the file was truncated?)")
        done += n
