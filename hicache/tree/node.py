"""TreeNode: one edge of the radix tree, a page-multiple run of tokens and where its KV lives.

State machine of a node (``io`` is explicit; residency follows from the two page arrays):

    DEVICE ──backup issued──▶ DEVICE+HOST, io=BACKUP ──ack──▶ DEVICE+HOST (synced)
      │                                                          │ device eviction
      │ write_back eviction: device pages move to the transfer    ▼
      └──────────────────────▶ HOST, io=BACKUP ──ack──▶ HOST (host-only)
                                                          │ load_back issued
                                                          ▼
                                   DEVICE+HOST, io=LOAD ──ack──▶ DEVICE+HOST (synced)
    HOST ──host eviction──▶ removed from the tree
    DEVICE (never backed up) ──device eviction──▶ removed from the tree

A node is always resident somewhere: ``device_pages`` or ``host_pages`` is set. Device
residency is prefix-closed (a device node's ancestors are on the device), because device
eviction only takes device leaves and load-back loads a whole host-only chain at once.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

import numpy as np

Namespace = str | int | bytes | None  # what keeps prompts apart: one root per namespace


class IOState(IntEnum):
    """The transfer a node's pages are part of right now."""

    NONE = 0
    BACKUP = 1  # device -> host copy in flight: host pages are being written
    LOAD = 2  # host -> device copy in flight: device pages are being written


# Module constants for hot paths: an enum member lookup through its class costs ~4x more.
IO_NONE, IO_BACKUP, IO_LOAD = IOState.NONE, IOState.BACKUP, IOState.LOAD


class TreeNode:
    """A node of the radix tree. Fields are mutated only by HiRadixCache and RadixTree."""

    # Every field, by what RadixTree.split does with it when it cuts off an upper half (the one
    # list ``__slots__`` is made of, so a new field is classified or does not exist):
    OWN = ("id", "key", "children", "parent", "namespace")  # the upper half gets its own
    # copied: whatever covered the node (locks, protection, hits, times, a transfer or an L3
    # write in flight, announced tiers) covers both halves
    SHARED = ("lock_ref", "host_ref", "hit_count", "last_access", "created", "io", "transfer",
              "l3", "ev")  # fmt: skip
    PAGED = {"device_pages": 8, "host_pages": 1, "ev_hashes": 1}  # cut: elements per page
    __slots__ = OWN + SHARED + tuple(PAGED)

    def __init__(self, node_id: int, key: bytes, parent: TreeNode | None, namespace: Namespace):
        self.id = node_id  # unique per cache; also the heap tie-breaker
        self.key = key  # token ids as int32 little-endian bytes; len is 4 * page-multiple
        # children by first page of tokens (bytes). A dict, not defaultdict: lookups must never
        # create nodes by accident.
        self.children: dict[bytes, TreeNode] = {}
        self.parent = parent  # None for roots and for nodes removed from the tree
        self.namespace = namespace  # the namespace of the root this node hangs under
        # device page ids, one per key page, as int64 little-endian bytes (slot = page *
        # page_size + offset): immutable, so it is compared and joined without numpy calls,
        # never aliases a caller's array, and costs page_size times less than slots
        self.device_pages: bytes | None = None
        self.host_pages: np.ndarray | None = None  # int64 host page ids, one per key page
        self.lock_ref = 0  # locks held on this node or on any descendant (device protection)
        self.host_ref = 0  # loads reading this node's host pages (host protection)
        self.hit_count = 0  # matches that covered this node (+1 at creation)
        self.last_access = 0  # logical clock of the last match or insert through it
        self.created = 0  # logical clock at creation (FIFO eviction)
        self.io = IOState.NONE  # transfer in flight over this node's pages
        # the TransferRecord behind `io`, if any (transfers/book.py: Any here, as the tree
        # sits below the transfers and only keeps the reference)
        self.transfer: Any = None
        # the third tier (l3/tier.py): None (not known to be in the store), True (stored),
        # or the write putting it now (it keeps the host pages readable until it ends)
        self.l3: Any = None  # (l3/jobs.py's Write: Any here, as for ``transfer``)
        # KV events (kv_events.py): the tiers this node's pages were last announced on (bits),
        # and its pages' block hashes once computed
        self.ev = 0
        self.ev_hashes: np.ndarray | None = None

    # ---- derived state ------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.key) >> 2

    @property
    def on_device(self) -> bool:
        return self.device_pages is not None

    @property
    def on_host(self) -> bool:
        return self.host_pages is not None

    @property
    def is_root(self) -> bool:
        return self.parent is None and self.key == b""

    def tokens(self) -> np.ndarray:
        """The node's token ids as a read-only int32 array (zero-copy view of the key)."""
        return np.frombuffer(self.key, dtype=np.int32)

    def device_page_ids(self) -> np.ndarray:
        """The device page ids as a read-only int64 array (zero-copy); a device node's only."""
        assert self.device_pages is not None
        return np.frombuffer(self.device_pages, dtype=np.int64)

    def has_device_child(self) -> bool:
        if not self.children:
            return False
        return any(c.device_pages is not None for c in self.children.values())

    def __repr__(self) -> str:
        where = ("D" if self.on_device else "") + ("H" if self.on_host else "")
        return (
            f"TreeNode(id={self.id}, tokens={self.num_tokens}, at={where or '-'}, "
            f"lock={self.lock_ref}, host_ref={self.host_ref}, io={self.io.name})"
        )
