"""Memory: where KV lives and who may use which page of it.

- ``backing.py``: the buffers under the pools (plain memory, POSIX shared memory, CUDA; pinned
  host memory), and mapping another process's safely;
- ``pools.py``: ``DevicePool`` and ``HostPool`` (three host layouts), one contiguous buffer each,
  viewed per layer and per page;
- ``allocator.py``: ``PagedAllocator``, every page's state (free, owned, in the tree, ...);
- ``engine_layout.py``: ``EngineLayout``, an engine's KV layout (engines that keep their device
  tier) and the pool it makes;
- ``page_sums.py``: page checksums (verified restores); ``kept.py``: kept pools' markers.

Names are imported on first use. Nothing outside this package imports its modules. It imports
nothing of the tree or the cache (what a host pool holds, as the tree sees it, is
``hicache/host_snapshot.py``, above both).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.lazy import lazy_exports

_EXPORTS = {
    "OWNED": "hicache.memory.allocator",
    "PageState": "hicache.memory.allocator",
    "PagedAllocator": "hicache.memory.allocator",
    "TREE": "hicache.memory.allocator",
    "as_int64": "hicache.memory.allocator",
    "AttachedCudaIPC": "hicache.memory.backing",
    "AttachedSharedMemory": "hicache.memory.backing",
    "Backing": "hicache.memory.backing",
    "CudaBacking": "hicache.memory.backing",
    "SHM_DIR": "hicache.memory.backing",
    "SharedMemoryBacking": "hicache.memory.backing",
    "attach_shared_memory": "hicache.memory.backing",
    "pinned_span": "hicache.memory.backing",
    "register_pinned": "hicache.memory.backing",
    "EngineLayout": "hicache.memory.engine_layout",
    "huge_page_bytes": "hicache.memory.huge_pages",
    "DEFAULT_GRACE_S": "hicache.memory.kept",
    "HOST": "hicache.memory.kept",
    "KEEP": "hicache.memory.kept",
    "KeptPool": "hicache.memory.kept",
    "LOCK": "hicache.memory.kept",
    "PREFIX": "hicache.memory.kept",
    "expired": "hicache.memory.kept",
    "free_kept": "hicache.memory.kept",
    "instance_alive": "hicache.memory.kept",
    "list_kept": "hicache.memory.kept",
    "names_snapshot": "hicache.memory.kept",
    "open_own": "hicache.memory.kept",
    "own_name": "hicache.memory.kept",
    "parse_name": "hicache.memory.kept",
    "read_marker": "hicache.memory.kept",
    "write_marker": "hicache.memory.kept",
    "PageSums": "hicache.memory.page_sums",
    "DevicePool": "hicache.memory.pools",
    "HostPool": "hicache.memory.pools",
    "KVPool": "hicache.memory.pools",
}
__all__ = [
    "AttachedCudaIPC",
    "AttachedSharedMemory",
    "Backing",
    "CudaBacking",
    "DEFAULT_GRACE_S",
    "DevicePool",
    "EngineLayout",
    "HOST",
    "HostPool",
    "KEEP",
    "KVPool",
    "KeptPool",
    "LOCK",
    "OWNED",
    "PREFIX",
    "PageState",
    "PageSums",
    "PagedAllocator",
    "SHM_DIR",
    "SharedMemoryBacking",
    "TREE",
    "as_int64",
    "attach_shared_memory",
    "expired",
    "free_kept",
    "huge_page_bytes",
    "instance_alive",
    "list_kept",
    "names_snapshot",
    "open_own",
    "own_name",
    "parse_name",
    "pinned_span",
    "read_marker",
    "register_pinned",
    "write_marker",
]
__getattr__ = lazy_exports(__name__, _EXPORTS, globals())

if TYPE_CHECKING:
    from hicache.memory.allocator import OWNED, TREE, PagedAllocator, PageState, as_int64
    from hicache.memory.backing import (
        SHM_DIR,
        AttachedCudaIPC,
        AttachedSharedMemory,
        Backing,
        CudaBacking,
        SharedMemoryBacking,
        attach_shared_memory,
        pinned_span,
        register_pinned,
    )
    from hicache.memory.engine_layout import EngineLayout
    from hicache.memory.huge_pages import huge_page_bytes
    from hicache.memory.kept import (
        DEFAULT_GRACE_S,
        HOST,
        KEEP,
        LOCK,
        PREFIX,
        KeptPool,
        expired,
        free_kept,
        instance_alive,
        list_kept,
        names_snapshot,
        open_own,
        own_name,
        parse_name,
        read_marker,
        write_marker,
    )
    from hicache.memory.page_sums import PageSums
    from hicache.memory.pools import DevicePool, HostPool, KVPool
