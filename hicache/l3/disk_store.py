"""DiskStore: the third tier's store on the node's own drives (``hicache.disk``): a value is a
host page's bytes in one slot, its trailer in the slot's header. Opened when the tier attaches
its pool (a slot's size is a page's), on the tier's IO thread; one daemon per folder."""

from __future__ import annotations

from typing import Any

from hicache.disk import SlotStore
from hicache.l3.pages import PageSegments
from hicache.l3.store import Check, Got, L3Store


class DiskStore(L3Store):
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
        self.slots = SlotStore(paths, capacity, pages.page_bytes, budget, scan_s=scan_s)

    def _store(self) -> SlotStore:
        assert self.slots is not None, "DiskStore: attach() first"
        return self.slots

    def exists(self, keys: list[str]) -> list[bool]:
        return self._store().exists(keys)

    def put(self, keys: list[str], pages: list[int], trailers: list[bytes]) -> list[bool]:
        views = self.pages.views
        items = [(k, views(p), t) for k, p, t in zip(keys, pages, trailers, strict=True)]
        return self._store().put_many(items)

    def get(self, keys: list[str], pages: list[int], check: Check | None = None) -> list[Got]:
        views = self.pages.views
        got = self._store().get_many([(k, views(p)) for k, p in zip(keys, pages, strict=True)])
        return list(got)

    def remove(self, keys: list[str]) -> None:
        self._store().remove(keys)

    def describe(self) -> dict[str, Any]:
        slots = self.slots
        return slots.figures() if slots is not None else {}

    def close(self) -> None:
        if self.slots is not None:
            self.slots.close()
            self.slots = None
