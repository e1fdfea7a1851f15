"""MooncakeStore: pages in a Mooncake Store, moved straight between the host pool and the store.

The daemon is a Mooncake client: it registers the whole host pool once, so a put reads a page's
runs (and its trailer, from a small registered array) and a get writes them, with no copy in
Python (``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``). With
``segment_bytes`` > 0 the daemon also lends that much memory to the store (its share of the
distributed pool; values placed there vanish when the daemon stops, as Mooncake documents);
with 0 it is a pure client of memory lent by others (``mooncake_store_service``).

Result codes (as installed, 0.3.13): put 0 = stored (also for a key already stored); get
returns the bytes read; -704 OBJECT_NOT_FOUND; -800 TRANSFER_FAIL (a dead segment, a size
that does not match); -900 RPC_FAIL (the master is unreachable); -200 NO_AVAILABLE_HANDLE
(the store is full: not stored). Any code other than success is a miss. A call whose every key
failed with -800/-900 raises StoreDown.

The client's ``setup`` and ``close`` hold the GIL while they wait for the master (90 s and 11 s
measured with the master dead), which would freeze the daemon's control loop: both run only
after a TCP connect to the master succeeded (else setup is StoreDown at once, and close leaves
the client to the process's exit). Data calls release the GIL and fail in about 4 s.

Over TCP, the transfer engine queues at most ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` (1024 by
default) transfers per peer and rejects the rest of a call ("TCP lane queue-full", -800 for
those keys). A page is one transfer per run plus its trailer, so a call holds at most half that
many transfers: with 32 runs a page, 15 pages, not 128. A batch is split into such calls; a call
whose every key failed with -800/-900 (or that did not answer a code per key) ends the batch
there (a dead store fails each call in seconds): the pages before it are kept, the rest fail,
and only a batch in which no call got any other answer raises StoreDown.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable

import numpy as np

from hicache.l3.pages import TRAILER_BYTES, PageSegments
from hicache.l3.store import ZERO_COPY_READ_BYTES, Check, Got, L3Store, Parents, StoreDown

DOWN_CODES = (-800, -900)
MAX_BATCH = 512  # pages per call (the trailer arrays are sized for it)
CONNECT_S = 0.5  # how long the reachability check waits
TCP_QUEUE = 1024  # the engine's default MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER
TCP_QUEUE_MAX = 65535  # the largest value the engine takes (a larger one means the default)


class MooncakeStore(L3Store):
    read_chunk_bytes = ZERO_COPY_READ_BYTES  # (values land zero-copy: the worker checks them)

    def __init__(
        self,
        master: tuple[str, int],
        segment_bytes: int = 0,
        local_host: str = "",
        protocol: str = "tcp",
        metadata: str = "P2PHANDSHAKE",
        **_: object,
    ):
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        self.url = f"mooncake://{master[0]}:{master[1]}"
        self.master = master
        if not _reachable(master):
            raise StoreDown(f"{self.url}: the master does not accept connections")
        local_host = local_host or local_address(master)  # what other machines reach us by
        self.store = MooncakeDistributedStore()
        code = self.store.setup(
            local_host, metadata, segment_bytes, 16 << 20, protocol, "", f"{master[0]}:{master[1]}"
        )
        if code != 0:
            raise StoreDown(f"{self.url}: setup failed ({code})")
        self.replicate = ReplicateConfig()
        self.segment_bytes = segment_bytes
        self.hostname = self.store.get_hostname()  # (describe() must not call the client)
        # trailers: written before a put, read after a get (one thread calls a store at a time)
        self.tails = np.zeros((2, MAX_BATCH, TRAILER_BYTES), dtype=np.uint8)
        self._register(self.tails.ctypes.data, self.tails.nbytes, "trailer buffer")
        self.lock = threading.Lock()
        self.closed = False
        self.per_call = MAX_BATCH  # pages per put/get call: set by attach() to the queue's budget

    def _register(self, ptr: int, size: int, what: str) -> None:
        code = self.store.register_buffer(ptr, size)
        if code != 0:
            raise StoreDown(f"{self.url}: cannot register the {what} ({code})")

    def attach(self, pages: PageSegments) -> None:
        super().attach(pages)
        self._register(pages.base, pages.num_pages * pages.page_stride, "host pool")
        self.per_call = pages_per_call([n for _, n in pages.runs])

    def _buffers(self, pages: list[int], side: int) -> tuple[list[list[int]], list[list[int]]]:
        tails = self.tails[side].ctypes.data
        ptrs, sizes = [], []
        for i, page in enumerate(pages):
            p, s = self.pages.pointers(page)
            ptrs.append([*p, tails + i * TRAILER_BYTES])
            sizes.append([*s, TRAILER_BYTES])
        return ptrs, sizes

    def _split(
        self,
        keys: list[str],
        what: str,
        call: Callable[[slice], list[int]],
        take: Callable[[int, int], object],
        miss: object,
    ) -> list:
        """One batch as calls of at most ``per_call`` pages: ``call(part)`` (a slice) returns
        the store's codes, ``take(i, code)`` the result of the part's i-th key. A call that
        fails whole (every code -800/-900, or not a code per key: the store or the peer is
        down) ends the batch: its keys and the rest get ``miss``, and when it was the first
        call, nothing was answered: StoreDown."""
        out: list = []
        for at in range(0, len(keys), self.per_call):
            part = slice(at, at + self.per_call)
            codes = call(part)
            n = len(keys[part])
            if len(codes) != n or all(c in DOWN_CODES for c in codes):
                if at == 0:
                    why = codes[0] if len(codes) == n else f"{len(codes)} codes for {n} keys"
                    raise StoreDown(f"{self.url}: {what} failed ({why})")
                return out + [miss] * (len(keys) - len(out))
            out.extend(take(i, c) for i, c in enumerate(codes))
        return out

    def exists(self, keys: list[str]) -> list[bool]:
        out: list[bool] = []
        for at in range(0, len(keys), MAX_BATCH):
            codes = self.store.batch_is_exist(keys[at : at + MAX_BATCH])
            if codes and all(c < 0 for c in codes):
                raise StoreDown(f"{self.url}: exists failed ({codes[0]})")
            out.extend(c == 1 for c in codes)
        return out

    def put(
        self, keys: list[str], pages: list[int], trailers: list[bytes], parents: Parents = None
    ) -> list[bool]:
        def call(part: slice) -> list[int]:
            for i, tail in enumerate(trailers[part]):
                self.tails[0, i] = np.frombuffer(tail, dtype=np.uint8)
            ptrs, sizes = self._buffers(pages[part], 0)
            return self.store.batch_put_from_multi_buffers(keys[part], ptrs, sizes, self.replicate)

        return self._split(keys, "put", call, lambda i, c: c == 0, False)

    def get(
        self, keys: list[str], pages: list[int], check: Check | None = None, parents: Parents = None
    ) -> list[Got]:
        """(Trailers only: the values land in the pool, zero-copy; ``check`` is not used.)"""
        want = self.pages.page_bytes + TRAILER_BYTES

        def call(part: slice) -> list[int]:
            ptrs, sizes = self._buffers(pages[part], 1)
            return self.store.batch_get_into_multi_buffers(keys[part], ptrs, sizes)

        def take(i: int, code: int) -> bytes | None:
            return self.tails[1, i].tobytes() if code == want else None

        return self._split(keys, "get", call, take, None)

    def remove(self, keys: list[str]) -> None:
        self.store.batch_remove(keys, True)  # (force: a value read a moment ago is leased)

    def describe(self) -> dict[str, object]:
        return {"segment_bytes": self.segment_bytes, "hostname": self.hostname}

    def close(self) -> None:
        """Closes the client; a dead master makes that take many seconds, so it is waited for
        at most CLOSE_WAIT_S (a daemon that stops must not hang on its store)."""
        if not self.closed:
            self.closed = True
            if _reachable(self.master):
                self.store.close()


def pages_per_call(runs: list[int]) -> int:
    """How many pages of these run sizes one put or get may carry: half the per-peer transfer
    queue (read from the environment as the transfer engine reads it), one transfer for each
    run and one for the trailer; at least 1, at most MAX_BATCH."""
    queue = engine_setting("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", TCP_QUEUE, TCP_QUEUE_MAX)
    return max(1, min(MAX_BATCH, queue // 2 // (1 + len(runs))))


def engine_setting(name: str, default: int, most: int) -> int:
    """A transfer engine setting as the engine parses it: plain ASCII digits for a value in
    [1, most]; anything else (spaces, signs, other digits, out of range) means ``default``."""
    text = os.environ.get(name, "")
    digits = text.lstrip("0")  # (leading zeros are fine; more than 5 digits is out of range)
    if text.isascii() and text.isdigit() and len(digits) <= 5 and 1 <= int(digits or 0) <= most:
        return int(digits)
    return default


def _reachable(master: tuple[str, int]) -> bool:
    try:
        socket.create_connection(master, timeout=CONNECT_S).close()
        return True
    except OSError:
        return False


def local_address(master: tuple[str, int]) -> str:
    """The address of this machine's interface that reaches ``master`` (what the store's
    other clients connect to for this daemon's segment); 127.0.0.1 for a loopback master."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(master)  # (UDP: no packet is sent; the kernel picks the route)
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"
