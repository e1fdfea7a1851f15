"""Transfers: how KV pages move between the cache's two pools, and how a copy is tracked.

- ``engine.py``: ``TransferEngine`` (submit a copy job, poll its ack) and its jobs' types;
  ``cpu.py`` (a copy thread, CPU pools), ``cuda.py`` (CUDA streams and events), ``manual.py``
  (jobs run only when a test says so);
- ``copiers.py``: the copy strategy chosen once from ``transfer_backend`` (CPU, direct torch
  copies, Triton kernels), over the C copies of ``cpu_copy.py`` (``hicache/_copy.c``);
- ``progress.py``: the per-layer progress table engines read during a layer-wise load;
- ``book.py``: the cache's bookkeeping of backups and loads in flight (their locks, their acks).

Names are imported on first use: ``LayerProgress`` and ``LoadFailed`` cost no torch import.
Nothing outside this package imports its modules: use the names below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.lazy import lazy_exports

_EXPORTS = {
    "Ack": "hicache.transfers.engine",
    "CopyJob": "hicache.transfers.engine",
    "CorruptPages": "hicache.transfers.engine",
    "Direction": "hicache.transfers.engine",
    "TransferEngine": "hicache.transfers.engine",
    "ThreadTransferEngine": "hicache.transfers.cpu",
    "CudaTransferEngine": "hicache.transfers.cuda",
    "ManualTransferEngine": "hicache.transfers.manual",
    "TransferBook": "hicache.transfers.book",
    "Copier": "hicache.transfers.copiers",
    "CpuCopier": "hicache.transfers.copiers",
    "DirectCopier": "hicache.transfers.copiers",
    "KernelCopier": "hicache.transfers.copiers",
    "make_copier": "hicache.transfers.copiers",
    "resolve_backend": "hicache.transfers.copiers",
    "copy_pages_c": "hicache.transfers.cpu_copy",
    "DEFAULT_CAPACITY": "hicache.transfers.progress",
    "FAILED": "hicache.transfers.progress",
    "LayerProgress": "hicache.transfers.progress",
    "LoadFailed": "hicache.transfers.progress",
}
__all__ = [
    "Ack",
    "Copier",
    "CopyJob",
    "CorruptPages",
    "CpuCopier",
    "CudaTransferEngine",
    "DEFAULT_CAPACITY",
    "DirectCopier",
    "Direction",
    "FAILED",
    "KernelCopier",
    "LayerProgress",
    "LoadFailed",
    "ManualTransferEngine",
    "ThreadTransferEngine",
    "TransferBook",
    "TransferEngine",
    "copy_pages_c",
    "make_copier",
    "resolve_backend",
]
__getattr__ = lazy_exports(__name__, _EXPORTS, globals())

if TYPE_CHECKING:
    from hicache.transfers.book import TransferBook
    from hicache.transfers.copiers import (
        Copier,
        CpuCopier,
        DirectCopier,
        KernelCopier,
        make_copier,
        resolve_backend,
    )
    from hicache.transfers.cpu import ThreadTransferEngine
    from hicache.transfers.cpu_copy import copy_pages_c
    from hicache.transfers.cuda import CudaTransferEngine
    from hicache.transfers.engine import Ack, CopyJob, CorruptPages, Direction, TransferEngine
    from hicache.transfers.manual import ManualTransferEngine
    from hicache.transfers.progress import DEFAULT_CAPACITY, FAILED, LayerProgress, LoadFailed
