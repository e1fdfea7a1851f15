"""Named results shared across the core (a match, an eviction), and the transfer ticket id.

Page ids and token slots travel as int64 arrays (a node's pages as int64 bytes), never as
scalars to type one by one: they are told apart by name (``*_pages``, ``*_indices``/slots),
and a slot is page * page_size + offset (at page_size 16, page 3 holds slots 48..63).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, NewType

import numpy as np
import torch

from hicache.tree import page_slots

if TYPE_CHECKING:
    from hicache.tree import TreeNode

Ticket = NewType("Ticket", int)  # id of one asynchronous transfer, unique per TransferEngine


class MatchResult:
    """What match_prefix found. The indices are only safe to use while the node is locked.

    The prefix is kept as the nodes' immutable page-id chunks and turned into tensors only when
    ``device_pages`` or ``device_indices`` is read: a daemon sends the chunks as they are.
    """

    __slots__ = (
        "page_chunks",
        "page_size",
        "device_hit_length",
        "last_device_node",
        "host_hit_length",
        "last_host_node",
        "loading",
    )

    def __init__(
        self,
        page_chunks: list[bytes],
        page_size: int,
        device_hit_length: int,
        last_device_node: TreeNode,
        host_hit_length: int,
        last_host_node: TreeNode,
        loading: bool,
    ):
        self.page_chunks = page_chunks  # int64 LE page ids of the device prefix, node by node
        self.page_size = page_size  # slot = page * page_size + offset
        self.device_hit_length = device_hit_length  # tokens in those pages
        self.last_device_node = last_device_node  # deepest node of that prefix (or a root)
        self.host_hit_length = host_hit_length  # tokens after it that are on the host only
        self.last_host_node = last_host_node  # deepest node of the host part
        self.loading = loading  # a node of the prefix is still being loaded: wait_load() first

    @property
    def device_pages(self) -> torch.Tensor:
        """int64 page ids of the device-resident prefix, in order (a new tensor you own)."""
        return _int64_tensor(bytearray().join(self.page_chunks))

    @property
    def device_indices(self) -> torch.Tensor:
        """int64 slots of the device-resident prefix, in token order (a new tensor you own)."""
        return slots_of_page_ids(b"".join(self.page_chunks), self.page_size)

    def __repr__(self) -> str:
        return (
            f"MatchResult(device_hit_length={self.device_hit_length}, "
            f"host_hit_length={self.host_hit_length}, loading={self.loading})"
        )


def slots_of_page_ids(pages: bytes | np.ndarray, page_size: int) -> torch.Tensor:
    """A new int64 tensor of the slots of int64 page ids (page * page_size + offset), in order.
    The one expansion of pages into slots that match results use (the core's and the client's).
    """
    if page_size == 1:  # page ids are the slots
        return _int64_tensor(bytearray(pages))
    return _int64_tensor(page_slots(pages, page_size))  # (bytes, or client/results.py's array)


def _int64_tensor(buf: bytearray) -> torch.Tensor:
    """A tensor over a writable buffer of int64 (torch.frombuffer refuses an empty one)."""
    return torch.frombuffer(buf, dtype=torch.int64) if buf else torch.empty(0, dtype=torch.int64)


class EvictResult(NamedTuple):
    """What one eviction pass did (tokens)."""

    freed: int  # returned to the free list now
    pending: int  # will be freed when an in-flight backup copy is acknowledged (write_back)
