"""HiCacheStore: SGLang's ``HiCacheStorage`` over hicache-daemon.

SGLang calls a storage backend from three of its threads: the prefetch thread asks
``batch_exists`` (how many leading pages the tier has), the prefetch IO thread reads them into
its host pool (``batch_get_v1``, or ``batch_get`` into flat pages), the backup thread writes
finished pages (``batch_set_v1`` / ``batch_set``). Here each is one or a few daemon round
trips plus copies between SGLang's host pool and the daemon's shared pool (the C page copy,
no GIL), made by the calling thread. This class checks what SGLang passes (host indices, flat
pages), converts it to views, and hands the call to one of two kinds of keys:

- ``Chains`` (chains.py): zero-copy calls that pass ``prefix_keys``; a prompt's pages are one
  path of the daemon's tree.
- ``PageKeys`` (page_keys.py): the rest; every page is a key of its own.

What ``batch_exists`` finds stays pinned (locked) for the get that follows; pins not taken by
a get are released after ``pin_s``, at the backend's next call.

Every daemon failure is a miss (0 pages, False), never an exception in SGLang's threads
(``DaemonLink``: down for ``retry_s`` after a failure; a new session, the layout registered
again, after a restart). Keys that are not page hashes and host indices outside the pool are
logged and refused the same way, with nothing changed in the daemon.

Thread safety: the session's state changes under DaemonLink's lock, the pins under
PinBook's (pins.py), the figures under StoreFigures' (figures.py); copies and calls run in
parallel.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from hicache.client.connection import DaemonError
from hicache.client.daemon_link import DaemonLink, Unavailable
from hicache.client.sglang.chains import Chains, prefix_keys
from hicache.client.sglang.figures import StoreFigures
from hicache.client.sglang.key_mode import KeyMode, key_mode
from hicache.client.sglang.page_keys import PageKeys
from hicache.client.sglang.pages import (
    PageFormat,
    host_pages,
    host_view,
    page_bytes,
    page_format,
)
from hicache.client.sglang.pins import Pin, PinBook
from hicache.client.sglang.settings import StoreSettings

log = logging.getLogger("hicache.sglang")


WARM_WAIT_S = 10.0  # registration waits this long for the connection to the daemon (_warm)


class _Link(DaemonLink):
    log = log


class HiCacheStore(HiCacheStorage):  # type: ignore[misc]  # SGLang's base: untyped (no py.typed)
    """Built by SGLang's StorageBackendFactory as ``cls(storage_config, kwargs)``; the host
    pool arrives later through ``register_mem_pool_host``."""

    def __init__(self, storage_config: Any, kwargs: Any = None):
        self.settings = StoreSettings.from_extra(getattr(storage_config, "extra_config", None))
        self.config = storage_config
        s = self.settings
        self.tp_rank, self.tp_size = int(storage_config.tp_rank), int(storage_config.tp_size)
        self.mla = bool(storage_config.is_mla_model)
        writer = getattr(storage_config, "is_storage_writer", None)
        self.writer = (not self.mla or self.tp_rank == 0) if writer is None else bool(writer)
        self.model = str(storage_config.model_name or "")
        self.link = _Link(
            s.endpoint,
            f"sglang tp{self.tp_rank}/{self.tp_size}",
            s.timeout_s,
            s.retry_s,
            model=self.model,
            daemon_user=s.daemon_user or None,
        )
        self.format: PageFormat | None = None  # once the host pool is registered
        self._host: torch.Tensor | None = None  # SGLang's host pool as [kv, L, pages, P, W]
        self._layout = ""
        self.pins = PinBook()  # what batch_exists found, for the get that follows
        self._said: set[str] = set()  # problems logged once
        self.figures = StoreFigures()  # for SGLang's storage metrics (get_stats)
        extra = getattr(storage_config, "extra_config", None) or {}
        self.keys, self._keys_from = key_mode(extra)  # chains or one-page keys (key_mode.py)
        self.writing = threading.Lock()  # every allocation (a set's, from match to insert)
        parts = (self.link, self.pins, self.figures, self._say_once, self._note, self.writing)
        self.chains = Chains(*parts)  # zero-copy calls that pass prefix keys (chains.py)
        self.page_keys = PageKeys(*parts)  # the rest: a key per page (page_keys.py)

    # ---- registration -----------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang's host pool: its format becomes this rank's layout in the daemon (registered
        at the first call that reaches it). ValueError for a pool the daemon cannot hold."""
        super().register_mem_pool_host(mem_pool_host)
        fmt = page_format(mem_pool_host, self.model)
        self.format = fmt
        self.figures.page_bytes = page_bytes(fmt)
        self._layout = mem_pool_host.layout
        self._host = host_view(fmt, self._layout, mem_pool_host.kv_buffer)
        self.link.layout = fmt.engine_layout()
        self.link.expect = dict(self.link.expect, **fmt.engine_layout().as_dict())
        # MLA: every tensor-parallel rank holds the same KV (one writes it); MHA: each rank
        # its heads. Pipeline stages and context-parallel ranks always hold their own part;
        # data-parallel replicas hold the same KV and share it.
        cfg = self.config
        shard = "mla" if self.mla else f"tp{self.tp_rank}/{self.tp_size}"
        for name in ("pp", "attn_cp", "dcp"):
            rank, size = getattr(cfg, f"{name}_rank", 0), getattr(cfg, f"{name}_size", 1)
            if size and size > 1:
                shard += f"|{name}{rank}/{size}"
        self.page_keys.bind(
            fmt, self._layout, _namespace(self.model, shard, self.settings.namespace, "")
        )
        self.chains.bind(
            fmt, self._layout, _namespace(self.model, shard, self.settings.namespace, "chain")
        )
        log.info(
            "hicache: SGLang %s pages of %d tokens (%d bytes per rank page, host layout %s) "
            "stored in hicache-daemon at %s; keys: %s, from %s",
            "MLA" if self.mla else "MHA",
            fmt.page_size,
            page_bytes(fmt),
            self._layout,
            self.settings.endpoint,
            self.keys.value,
            self._keys_from,
        )
        warm = threading.Thread(target=self._warm, name="hicache-warm-up", daemon=True)
        warm.start()
        warm.join(WARM_WAIT_S)

    def _warm(self) -> None:
        """Connect, register this rank's layout and map the daemon's pool now, while SGLang
        starts, not in its first requests' time. Registration waits for it (up to WARM_WAIT_S:
        a daemon's first registration makes its pool, 0.8 s for 1 GiB here): left to a thread
        of its own once SGLang's scheduler loop runs, the same work took 12 s (the loop holds
        the interpreter; each of the thread's system calls waits for it again), and the first
        requests' lookups waited for it (2.2 s TTFT, twice). Failures are the link's to log;
        the first call tries again."""
        try:
            self.link.call(lambda c: c.attach())
        except (Unavailable, DaemonError):
            pass  # (the link logged it and stays down for retry_s: lookups are misses)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Sidecar pools (SWA, Mamba, DSA indexer, draft) of hybrid models: not supported.
        Raises at attach (SGLang's start), so a server never runs with half its state stored."""
        if str(host_pool_name) in ("kv", "PoolName.KV"):
            return
        raise ValueError(
            f"hicache: SGLang's {host_pool_name} pool (a hybrid model's sidecar) is not "
            "supported by the hicache storage backend; only MHA and MLA KV pools are"
        )

    # ---- lookups ------------------------------------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading pages of ``keys`` the daemon holds; they stay pinned for the get
        that follows (up to ``pin_s``). 0 for anything that goes wrong."""
        self._release_stale()
        chain = self._chain(extra_info)
        if chain is not None:
            return self.chains.exists(keys, chain) if _is_list(keys) else 0
        return self.page_keys.exists(keys)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ---- gets ---------------------------------------------------------------------------------
    def batch_get_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        """Copy the daemon's pages of ``keys`` into SGLang's host pool at ``host_indices``;
        True for the leading run copied (SGLang stops at the first False)."""
        n = _count(keys)
        if self.format is None or not n:
            return [False] * n
        assert self._host is not None  # (registered with the format)
        try:
            dst = host_pages(host_indices, n, self.format.page_size, self._host.shape[2])
        except (ValueError, TypeError, RuntimeError) as exc:
            self._say_once("get", exc)
            return [False] * n
        chain = self._chain(extra_info)
        if chain is not None:
            self._release_stale()
            done = self.chains.get(keys, chain, self._host, dst) if _is_list(keys) else 0
        else:
            self._release_stale()
            done = self.page_keys.get(keys, self._host, dst)
        return [i < done for i in range(n)]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """The generic path: each page into its flat tensor (SGLang's host layout order);
        None from the first page that could not be read."""
        n = _count(keys)
        if self.format is None or target_locations is None or len(target_locations) != n:
            return [None] * n
        try:
            views = [self._flat_view(t) for t in target_locations]
        except (ValueError, RuntimeError, TypeError) as exc:
            self._say_once("get", exc)
            return [None] * n
        self._release_stale()
        done = self.page_keys.get(keys, views, None)
        return [t if i < done else None for i, t in enumerate(target_locations)]

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.batch_get([key], [target_location])[0]

    # ---- sets ---------------------------------------------------------------------------------
    def batch_set_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        """Store the pages of ``keys`` from SGLang's host pool at ``host_indices``: those the
        daemon lacks are copied and inserted (last key first: see _match). All True or all
        False (a set that fails part-way may leave some pages stored: each is complete)."""
        n = _count(keys)
        if not self.writer:  # an MLA rank other than the writer: rank 0 stores the page
            return [True] * n
        if self.format is None or not n:
            return [False] * n
        assert self._host is not None  # (registered with the format)
        try:
            src = host_pages(host_indices, n, self.format.page_size, self._host.shape[2])
        except (ValueError, TypeError, RuntimeError) as exc:
            self._say_once("set", exc)
            return [False] * n
        chain = self._chain(extra_info)
        if chain is not None:
            self._release_stale()
            return [_is_list(keys) and self.chains.set(keys, chain, self._host, src)] * n
        self._release_stale()
        return [self.page_keys.set(keys, self._host, src)] * n

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """The generic path: each page from its flat tensor (SGLang's host layout order)."""
        if not self.writer:
            return True
        n = _count(keys)
        if (
            self.format is None
            or not n
            or not isinstance(values, (list, tuple))
            or len(values) != n
        ):
            return False
        try:
            views = [self._flat_view(v) for v in values]
        except (ValueError, RuntimeError, TypeError) as exc:
            self._say_once("set", exc)
            return False
        self._release_stale()
        return self.page_keys.set(keys, views, None)

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    # ---- housekeeping -------------------------------------------------------------------------
    def clear(self) -> None:
        """SGLang's ``clear_storage_backend``: drops this instance's pins. The daemon's pages
        are shared with every other instance and stay (an operator flushes them with
        ``hicache flush``)."""
        self._drop_pins()
        log.info("hicache: storage clear drops this instance's pins; shared pages stay")

    def close(self) -> None:
        """SGLang detaches the backend or stops: pins go, the session ends."""
        self._drop_pins()
        self.link.stopped = True
        self.link.close()

    def _drop_pins(self) -> None:
        self._release(self.pins.drain())

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics since the last call: pages per get and set, and their
        bandwidth (GB/s, copy included)."""
        return self.figures.take()

    def pinned(self) -> int:
        """Pages this backend holds pinned for gets (and pins waiting to be released)."""
        return len(self.pins)

    # ---- helpers ------------------------------------------------------------------------------
    def _chain(self, extra_info: Any) -> list[str] | None:
        """The keys before the call's (chains.py), or None: one-page keys. The mode is the
        configuration's (key_mode.py): with chains a call without a prefix starts at the
        prompt's first page; with one-page keys a prefix is never used. A prefix that is not a
        list is logged, and the call is a miss on an empty chain's keys."""
        if self.keys is not KeyMode.CHAINS:
            return None
        try:
            keys = prefix_keys(extra_info)
        except ValueError as exc:
            self._say_once("keys", exc)
            return ["not a page hash"]  # (fails key_words: the call is a miss)
        return [] if keys is None else keys

    def _flat_view(self, flat: Any) -> torch.Tensor:
        fmt = self.format
        assert fmt is not None and self._host is not None  # (callers: once registered)
        if not isinstance(flat, torch.Tensor) or flat.dtype != self._host.dtype:
            raise ValueError("a flat page must be a tensor of the host pool's dtype")
        if flat.numel() * flat.element_size() != page_bytes(fmt) or not flat.is_contiguous():
            raise ValueError(f"a flat page must be {page_bytes(fmt)} contiguous bytes")
        return host_view(fmt, self._layout, flat)

    def _release_stale(self) -> None:
        """Release pins no get took within ``pin_s`` and those beyond an exists' hit run."""
        self._release(self.pins.stale(time.monotonic() - self.settings.pin_s))

    def _release(self, pins: list[Pin]) -> None:
        """Release pins of the current session (those of an older one died with it)."""
        generation = self.link.generation
        live = [p.match for p in pins if p.generation == generation and p.match.lock_id]
        if not live:
            return
        try:
            self.link.call(lambda c: c.release(*live), generation)
        except (Unavailable, DaemonError) as exc:
            self._say_once("release", exc)

    def _note(self, queried: int = 0, hit: int = 0, loaded: int = 0) -> None:
        client = self.link.client
        if client is None:
            return
        assert self.format is not None  # (noted after a call: registered)
        page = self.format.page_size
        try:
            client.note_engine(queried * page, hit * page, loaded * page)
        except Exception as exc:  # noqa: BLE001 (a figure is never worth an exception in SGLang)
            log.debug("hicache: engine figures not noted: %s", exc)

    def _say_once(self, what: str, exc: BaseException) -> None:
        text = f"{what}: {type(exc).__name__}: {exc}"
        if isinstance(exc, Unavailable):
            return  # the link said why, once
        if text not in self._said:
            self._said.add(text)
            log.warning("hicache: SGLang storage %s (a miss)", text)


def _namespace(model: str, shard: str, tenant: str, kind: str) -> str:
    """The daemon namespace of a rank's pages: model, shard, ``hicache.namespace`` and the kind
    of keys (one-page keys "", chains "chain")."""
    text = f"{model}\0{shard}\0{tenant}" + (f"\0{kind}" if kind else "")
    return "sglang:" + hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _is_list(keys: Any) -> bool:
    return isinstance(keys, (list, tuple))


def _count(keys: Any) -> int:
    """How many keys SGLang passed: a list of them (anything else is taken as one bad key,
    so that a get or set answers one False and changes nothing)."""
    return len(keys) if isinstance(keys, (list, tuple)) else 1
