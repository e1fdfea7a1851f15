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


class MatchResult(NamedTuple):
    """What match_prefix found. The indices are only safe to use while the node is locked."""

    device_indices: torch.Tensor  # int64 slots of the device-resident prefix, in token order
    last_device_node: TreeNode  # deepest node of that prefix (a root when nothing matched)
    host_hit_length: int  # tokens right after the device prefix that exist on the host only
    last_host_node: TreeNode  # deepest node of that host part (== last_device_node when 0)
    loading: bool  # a node of the device prefix is still being loaded: wait_load() first

    @property
    def device_hit_length(self) -> int:
        return int(self.device_indices.numel())


class EvictResult(NamedTuple):
    """What one eviction pass did (tokens)."""

    freed: int  # returned to the free list now
    pending: int  # will be freed when an in-flight backup copy is acknowledged (write_back)
