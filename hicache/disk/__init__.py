"""The disk tier's store: KV pages in fixed-size slots of a few preallocated files on the
node's drives, found again after a restart or a crash.

- ``folder.py``: a private, locked folder per drive; data files preallocated, O_DIRECT where
  the file system takes it (buffered, said once, where it does not: tmpfs);
- ``slots.py``: the slot format (a verified header naming the key, the value, its trailer) and
  the positional I/O, with a fault hook for tests;
- ``budget.py``: ``WriteBudget``, bytes written in any 24 hours, never exceeded (across
  restarts);
- ``checkpoint.py``: the index, written at every open, clean close and flush;
- ``journal.py``: every change to the index after its checkpoint (a crash loses none);
- ``recovery.py``: what the slots hold at an open, from the checkpoint and its journal or a
  time-bounded header scan, in order of use;
- ``store.py``: ``SlotStore``, values by key: a page only with its prefix, least recently used
  eviction leaves first, failures as misses or refused writes, figures.

The third tier opens it as the store ``disk:///PATH[,PATH...]?bytes=SIZE`` (``hicache.l3``).
Names are imported on first use; nothing outside this package imports its modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.lazy import lazy_exports

_EXPORTS = {
    "WriteBudget": "hicache.disk.budget",
    "ALIGN": "hicache.disk.folder",
    "aligned": "hicache.disk.folder",
    "FolderRefused": "hicache.disk.folder",
    "check_folder": "hicache.disk.folder",
    "Header": "hicache.disk.slots",
    "SlotStore": "hicache.disk.store",
}
__all__ = [
    "ALIGN",
    "FolderRefused",
    "Header",
    "SlotStore",
    "WriteBudget",
    "aligned",
    "check_folder",
]
__getattr__ = lazy_exports(__name__, _EXPORTS, globals())

if TYPE_CHECKING:
    from hicache.disk.budget import WriteBudget
    from hicache.disk.folder import ALIGN, FolderRefused, aligned, check_folder
    from hicache.disk.slots import Header
    from hicache.disk.store import SlotStore
