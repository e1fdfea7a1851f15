"""Copiers: how a transfer engine moves one layer (or all layers) of a job's pages.

One is chosen at config time from ``transfer_backend`` (``make_copier``), never per copy:

    cpu     C page copies (hicache/_copy.c: all layers in one call, threads, consecutive pages
            merged); without C, slice copies per run or a torch gather/scatter. CPU pools only.
    direct  one slice copy per run of pages consecutive on both sides, nothing else: on a GPU
            each is one cudaMemcpyAsync, and no kernel ever touches host memory.
    kernel  the Triton page-copy kernel (kernels/triton_copy.py); on the CPU only under
            TRITON_INTERPRET=1, which is for tests.

Every copier works on the 5-D page views of the pools, so every host layout is covered.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod

import torch

from hicache.config import HiCacheConfig, TransferBackend
from hicache.kernels import (
    copy_pages_one_layer,
    copy_runs_one_layer,
    gather_scatter_one_layer,
    triton_copy,
)
from hicache.transfers import cpu_copy

Runs = list[tuple[int, int, int]]  # (src_start, dst_start, pages) consecutive on both sides
# Slice copies per run beat per-page copies when runs average this many pages or more.
RUNS_WORTH_IT = 4


class Copier(ABC):
    """Copies ``src_pages[i]`` of page view ``src`` to ``dst_pages[i]`` of ``dst``. Stateless;
    ``runs`` describe the same pages as runs consecutive on both sides."""

    name: str

    @abstractmethod
    def copy_layer(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        src_pages: torch.Tensor,
        dst_pages: torch.Tensor,
        runs: Runs,
        layer: int,
    ) -> None: ...

    def copy_all(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        src_pages: torch.Tensor,
        dst_pages: torch.Tensor,
        runs: Runs,
    ) -> None:
        for layer in range(src.shape[1]):
            self.copy_layer(src, dst, src_pages, dst_pages, runs, layer)


class CpuCopier(Copier):
    name = "cpu"

    def copy_layer(self, src, dst, src_pages, dst_pages, runs, layer) -> None:  # noqa: ANN001
        self._copy(src, dst, src_pages, dst_pages, runs, range(layer, layer + 1))

    def copy_all(self, src, dst, src_pages, dst_pages, runs) -> None:  # noqa: ANN001
        self._copy(src, dst, src_pages, dst_pages, runs, range(src.shape[1]))

    @staticmethod
    def _copy(src, dst, src_pages, dst_pages, runs, layers: range) -> None:  # noqa: ANN001
        # C merges runs of consecutive pages into single copies itself
        if cpu_copy.copy_pages_c(src, dst, src_pages.numpy(), dst_pages.numpy(), layers):
            return
        for layer in layers:
            if len(runs) * RUNS_WORTH_IT <= len(src_pages):
                copy_runs_one_layer(src, dst, runs, layer)
            elif not gather_scatter_one_layer(src, dst, src_pages, dst_pages, layer):
                copy_pages_one_layer(src, dst, src_pages, dst_pages, layer)


class DirectCopier(Copier):
    name = "direct"

    def copy_layer(self, src, dst, src_pages, dst_pages, runs, layer) -> None:  # noqa: ANN001
        copy_runs_one_layer(src, dst, runs, layer)


class KernelCopier(Copier):
    name = "kernel"

    # Page ids on a GPU were bounds-checked by the engine before they moved there: checking
    # them again would synchronize the stream on every launch.
    def copy_layer(self, src, dst, src_pages, dst_pages, runs, layer) -> None:  # noqa: ANN001
        layers = range(layer, layer + 1)
        check = src_pages.device.type == "cpu"
        triton_copy.copy_pages_triton(src, dst, src_pages, dst_pages, layers, check)

    def copy_all(self, src, dst, src_pages, dst_pages, runs) -> None:  # noqa: ANN001
        check = src_pages.device.type == "cpu"
        triton_copy.copy_pages_triton(src, dst, src_pages, dst_pages, None, check)


def resolve_backend(config: HiCacheConfig) -> TransferBackend:
    """The backend ``config`` asks for, with AUTO made concrete; raises ValueError for one that
    cannot run here."""
    backend = TransferBackend(config.transfer_backend)
    on_cpu = config.device == "cpu"
    if backend is TransferBackend.AUTO:
        return TransferBackend.CPU if on_cpu else TransferBackend.KERNEL
    if backend is TransferBackend.KERNEL:
        if not triton_copy.available():
            raise ValueError("transfer_backend: kernel needs triton installed")
        if on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("transfer_backend: kernel on the CPU needs TRITON_INTERPRET=1")
    return backend


_COPIERS: dict[TransferBackend, type[Copier]] = {
    TransferBackend.CPU: CpuCopier,
    TransferBackend.DIRECT: DirectCopier,
    TransferBackend.KERNEL: KernelCopier,
}


def make_copier(config: HiCacheConfig) -> Copier:
    return _COPIERS[resolve_backend(config)]()
