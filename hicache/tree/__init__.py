"""The tree: the radix tree over token ids and what walks, grows and orders it.

- ``node.py``: ``TreeNode`` (one run of whole pages; its device and host page ids, its state);
- ``radix_tree.py``: ``RadixTree`` (structure only: children by first page, a root per
  namespace); ``insert.py``: the cache's insert path; ``locks.py``: locks moved off nodes a
  failed load dropped;
- ``fastpath.py``: the C walk, claim and page checks (``hicache/_tree.c``, ``_fast.c``) and
  their numpy/Python twins, which accept and reject the same input; ``tokens.py``: token id
  checks;
- ``eviction_policy.py``: LRU, LFU and FIFO priorities and the lazy heaps of candidate leaves.

Names are imported on first use. Nothing outside this package imports its modules (the
``fastpath`` module is used whole).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.lazy import lazy_exports

_EXPORTS = {
    "LeafHeap": "hicache.tree.eviction_policy",
    "make_priority": "hicache.tree.eviction_policy",
    "load_acquire": "hicache.tree.fastpath",
    "pack_shared": "hicache.tree.fastpath",
    "page_slots": "hicache.tree.fastpath",
    "store_release": "hicache.tree.fastpath",
    "tally": "hicache.tree.fastpath",
    "unpack_shared": "hicache.tree.fastpath",
    "Inserter": "hicache.tree.insert",
    "MovedLocks": "hicache.tree.locks",
    "IOState": "hicache.tree.node",
    "IO_BACKUP": "hicache.tree.node",
    "IO_LOAD": "hicache.tree.node",
    "IO_NONE": "hicache.tree.node",
    "TreeNode": "hicache.tree.node",
    "Namespace": "hicache.tree.node",
    "RadixTree": "hicache.tree.radix_tree",
    "TokenIds": "hicache.tree.tokens",
    "as_slots": "hicache.tree.tokens",
    "as_tokens": "hicache.tree.tokens",
    "check_token_bytes": "hicache.tree.tokens",
}
__all__ = [
    "IOState",
    "IO_BACKUP",
    "IO_LOAD",
    "IO_NONE",
    "Inserter",
    "LeafHeap",
    "MovedLocks",
    "Namespace",
    "RadixTree",
    "TokenIds",
    "TreeNode",
    "as_slots",
    "as_tokens",
    "check_token_bytes",
    "load_acquire",
    "make_priority",
    "pack_shared",
    "page_slots",
    "store_release",
    "tally",
    "unpack_shared",
]
__getattr__ = lazy_exports(__name__, _EXPORTS, globals())

if TYPE_CHECKING:
    from hicache.tree.eviction_policy import LeafHeap, make_priority
    from hicache.tree.fastpath import (
        load_acquire,
        pack_shared,
        page_slots,
        store_release,
        tally,
        unpack_shared,
    )
    from hicache.tree.insert import Inserter
    from hicache.tree.locks import MovedLocks
    from hicache.tree.node import IO_BACKUP, IO_LOAD, IO_NONE, IOState, Namespace, TreeNode
    from hicache.tree.radix_tree import RadixTree
    from hicache.tree.tokens import TokenIds, as_slots, as_tokens, check_token_bytes
