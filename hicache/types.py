"""Named identifiers and results shared across the core.

Ids get their own types so that a page id is never passed where a token slot is expected: at
page_size 16, page 3 holds slots 48..63, and mixing the two is the classic paged-allocator bug.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, NewType

import torch

if TYPE_CHECKING:
    from hicache.node import TreeNode

PageId = NewType("PageId", int)  # index of a page in a pool (device page 0 is the padding page)
Slot = NewType("Slot", int)  # index of a token row in a pool: page * page_size + offset
Ticket = NewType("Ticket", int)  # id of one asynchronous transfer, unique per TransferEngine
NodeId = NewType("NodeId", int)  # id of a tree node, unique per cache


class MatchResult:
    """What match_prefix found. The indices are only safe to use while the node is locked.

    The slots are kept as the nodes' immutable byte chunks and turned into a tensor only when
    ``device_indices`` is read: a daemon sends the chunks as they are, with no copy.
    """

    __slots__ = (
        "slot_chunks",
        "device_hit_length",
        "last_device_node",
        "host_hit_length",
        "last_host_node",
        "loading",
        "_indices",
    )

    def __init__(
        self,
        slot_chunks: list[bytes],
        device_hit_length: int,
        last_device_node: TreeNode,
        host_hit_length: int,
        last_host_node: TreeNode,
        loading: bool,
    ):
        self.slot_chunks = slot_chunks  # int64 LE slots of the device prefix, node by node
        self.device_hit_length = device_hit_length  # tokens in those chunks
        self.last_device_node = last_device_node  # deepest node of that prefix (or a root)
        self.host_hit_length = host_hit_length  # tokens after it that are on the host only
        self.last_host_node = last_host_node  # deepest node of the host part
        self.loading = loading  # a node of the prefix is still being loaded: wait_load() first
        self._indices: torch.Tensor | None = None

    @property
    def device_indices(self) -> torch.Tensor:
        """int64 slots of the device-resident prefix, in token order (a tensor you own)."""
        if self._indices is None:
            joined = bytearray().join(self.slot_chunks)
            self._indices = (
                torch.frombuffer(joined, dtype=torch.int64)
                if joined
                else torch.empty(0, dtype=torch.int64)
            )
        return self._indices

    def slot_bytes(self) -> bytes:
        """The slots as one immutable bytes object (zero-copy for a one-node prefix)."""
        chunks = self.slot_chunks
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def __repr__(self) -> str:
        return (
            f"MatchResult(device_hit_length={self.device_hit_length}, "
            f"host_hit_length={self.host_hit_length}, loading={self.loading})"
        )


class EvictResult(NamedTuple):
    """What one eviction pass did (tokens)."""

    freed: int  # returned to the free list now
    pending: int  # will be freed when an in-flight backup copy is acknowledged (write_back)
