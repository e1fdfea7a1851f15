"""DiskStore: the third tier's store on the node's own drives (``hicache.disk``): a value is a
host page's bytes in one slot, its trailer in the slot's header. Opened when the tier attaches
its pool (a slot's size is a page's), on the tier's IO thread; one daemon per folder."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from hicache.disk import SlotStore
from hicache.l3.pages import PageSegments
from hicache.l3.store import Check, Got, L3Store, Parents, StoreDown

log = logging.getLogger("hicache.disk")


class DiskStore(L3Store):
    keeps_prefixes = True  # (SlotStore: a page only with its prefix)
    clears = True

    def __init__(
        self,
        paths: list[str],
        capacity_bytes: int,
        budget_bytes_per_day: int | None = None,
        scan_s: float = 30.0,
        **_: object,  # (the other stores' options: segment_bytes, timeout_s ...)
    ):
        self.url = "disk://" + ",".join(paths)
        self._open = (paths, capacity_bytes, budget_bytes_per_day, scan_s)
        self.slots: SlotStore | None = None

    def attach(self, pages: PageSegments) -> None:
        self.pages = pages
        paths, capacity, budget, scan_s = self._open
        self.slots = slots = SlotStore(paths, capacity, pages.page_bytes, budget, scan_s=scan_s)
        slots.track_drops()  # (the IO thread takes them after every job: dropped())
        found = (
            f"the checkpoint and {slots.replayed} journal records after it"
            if slots.from_checkpoint
            else f"a scan of {slots.scanned} slots"
        )
        log.info(
            "disk %s: %d slots of %d bytes; %d pages found from %s in %.1f s",
            ",".join(paths), slots.files.count, slots.files.slot_bytes, slots.recovered, found,
            slots.scan_seconds,
        )  # fmt: skip

    def _store(self) -> SlotStore:
        assert self.slots is not None, "DiskStore: attach() first"
        return self.slots

    def exists(self, keys: list[str]) -> list[bool]:
        return self._store().exists(keys)

    def put(
        self, keys: list[str], pages: list[int], trailers: list[bytes], parents: Parents = None
    ) -> list[bool]:
        views = self.pages.views
        items = [(k, views(p), t) for k, p, t in zip(keys, pages, trailers, strict=True)]
        return self._store().put_many(items, parents)

    def get(
        self, keys: list[str], pages: list[int], check: Check | None = None, parents: Parents = None
    ) -> list[Got]:
        views = self.pages.views
        got = self._store().get_many([(k, views(p)) for k, p in zip(keys, pages, strict=True)])
        return list(got)

    def remove(self, keys: list[str]) -> None:
        self._store().remove(keys)

    def clear(self) -> int:
        return self._store().clear()

    def evict(self, count: int) -> int:
        return self._store().evict(count)

    def dropped(self) -> list[str]:
        return self.slots.take_dropped() if self.slots is not None else []

    def local(self, keys: list[str]) -> list[bool]:
        return self._store().exists(keys)

    def tick(self) -> None:
        if self.slots is not None:
            self.slots.tick()

    def describe(self) -> dict[str, Any]:
        slots = self.slots
        return slots.figures() if slots is not None else {}

    def close(self) -> None:
        if self.slots is not None:
            self.slots.close()
            self.slots = None


class DiskAbove(L3Store):
    """This node's disk (``disk``) with a remote store (``below``) under it, both under the
    host pool (``--disk`` with ``--l3``): a page goes to both; a read asks the disk first and
    the store for what the disk lacks, and what the store had is kept on the disk too (its
    trailer with it: verified by the tier like any value, on every read). The store down is
    the disk alone."""

    def __init__(self, disk: DiskStore, below: L3Store):
        self.disk, self.below = disk, below
        self.keeps_prefixes = True  # (the disk's rule; the store below is given no parents)
        self.clears = True  # (the disk only: the store below is shared)
        self.url = f"{disk.url} over {below.url}"
        self.read_chunk_bytes = below.read_chunk_bytes

    def attach(self, pages: PageSegments) -> None:
        self.pages = pages
        self.disk.attach(pages)
        try:
            self.below.attach(pages)
        except BaseException:
            self.disk.close()
            raise

    def exists(self, keys: list[str]) -> list[bool]:
        on_disk = self.disk.exists(keys)
        lacking = [i for i, held in enumerate(on_disk) if not held]
        if lacking:
            try:
                below = self.below.exists([keys[i] for i in lacking])
            except StoreDown:
                below = [False] * len(lacking)
            for i, held in zip(lacking, below, strict=True):
                on_disk[i] = held
        return on_disk

    def put(
        self, keys: list[str], pages: list[int], trailers: list[bytes], parents: Parents = None
    ) -> list[bool]:
        held = self.disk.put(keys, pages, trailers, parents)
        try:
            below = self.below.put(keys, pages, trailers)
        except StoreDown:
            return held
        return [a or b for a, b in zip(held, below, strict=True)]

    def get(
        self, keys: list[str], pages: list[int], check: Check | None = None, parents: Parents = None
    ) -> list[Got]:
        got: list[Got] = list(self.disk.get(keys, pages))
        lacking = [i for i, value in enumerate(got) if value is None]
        if not lacking:
            return got
        try:
            below = self.below.get([keys[i] for i in lacking], [pages[i] for i in lacking], check)
        except StoreDown:
            return got
        keep = []
        for i, value in zip(lacking, below, strict=True):
            got[i] = value
            if isinstance(value, bytes):  # (a trailer: kept on the disk; checked when read)
                keep.append(i)
        if keep:  # (with their chain parents: a page without its prefix is refused there)
            self.disk.put([keys[i] for i in keep], [pages[i] for i in keep],
                          [got[i] for i in keep],  # type: ignore[misc]
                          None if parents is None else [parents[i] for i in keep])  # fmt: skip
        return got

    def remove(self, keys: list[str]) -> None:
        self.disk.remove(keys)
        with contextlib.suppress(StoreDown):  # (best effort, as the interface says)
            self.below.remove(keys)

    def clear(self) -> int:
        return self.disk.clear()

    def evict(self, count: int) -> int:
        return self.disk.evict(count)

    def dropped(self) -> list[str]:
        return self.disk.dropped()

    def local(self, keys: list[str]) -> list[bool]:
        return self.disk.local(keys)

    def tick(self) -> None:
        self.disk.tick()
        self.below.tick()

    def describe(self) -> dict[str, Any]:
        below = {f"below_{k}": v for k, v in self.below.describe().items()}
        return {**self.disk.describe(), **below}

    def close(self) -> None:
        self.disk.close()
        self.below.close()
