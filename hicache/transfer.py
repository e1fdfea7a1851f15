"""TransferEngine: asynchronous page copies between the device pool and the host pool.

Ack protocol (the same for the CPU thread, a test engine driven by hand, and later CUDA
streams with events):

1. ``submit`` enqueues a copy and returns a Ticket at once. Nothing about the copy may be
   assumed yet: the source pages must stay untouched and the destination pages unread.
2. The copy runs in the background. A load advances ``layers_done(ticket)`` layer by layer,
   so a reader may start on layer i while later layers are still copying.
3. ``poll`` returns an Ack for every finished copy, once, in completion order. Only after the
   cache has *seen* that ack may it free or reuse the pages the copy touched.

``after`` names tickets that must finish before this copy starts (a load reading host pages
that a pending backup is still writing). Engines that run copies in submission order satisfy
it for free; others must honour it explicitly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch

from hicache.fastpath import copy_rows
from hicache.kernels import (
    copy_pages_one_layer,
    copy_runs_one_layer,
    gather_scatter_one_layer,
    page_rows,
    page_runs,
)
from hicache.pools import DevicePool, HostPool
from hicache.types import Ticket

# Slice copies per run beat one gather + scatter when runs average this many pages or more.
RUNS_WORTH_IT = 4


class Direction(IntEnum):
    BACKUP = 0  # device -> host
    LOAD = 1  # host -> device


@dataclass(frozen=True)
class Ack:
    """A finished copy."""

    ticket: Ticket
    ok: bool  # False: the copy raised; its destination holds garbage
    error: str = ""  # the exception text when not ok


@dataclass
class CopyJob:
    """One submitted copy. Index tensors live here until the ack, as CUDA would need."""

    ticket: Ticket
    direction: Direction
    device_pages: torch.Tensor  # int64 page ids in the device pool
    host_pages: torch.Tensor  # int64 page ids in the host pool, same length
    after: tuple[Ticket, ...]  # tickets that must complete first
    # (device_start, host_start, pages) runs consecutive on both sides, when there are few
    # enough of them that slice copies beat a gather and a scatter; None otherwise
    runs: list[tuple[int, int, int]] | None = None
    layers_done: int = 0  # layers fully copied so far


class TransferEngine(ABC):
    """Copies pages between one DevicePool and one HostPool. Not reentrant: one caller thread
    submits and polls; the engine may copy on its own threads."""

    def __init__(self, device_pool: DevicePool, host_pool: HostPool):
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.num_layers = device_pool.config.num_layers
        self._next_ticket = 1

    def _new_job(
        self,
        direction: Direction,
        device_pages: np.ndarray,
        host_pages: np.ndarray,
        after: Iterable[Ticket],
    ) -> CopyJob:
        if len(device_pages) != len(host_pages):
            raise ValueError("device_pages and host_pages differ in length")
        ticket = Ticket(self._next_ticket)
        self._next_ticket += 1
        device_pages = np.ascontiguousarray(device_pages, dtype=np.int64)
        host_pages = np.ascontiguousarray(host_pages, dtype=np.int64)
        runs = page_runs(device_pages, host_pages)
        return CopyJob(
            ticket,
            direction,
            torch.from_numpy(device_pages),
            torch.from_numpy(host_pages),
            tuple(after),
            runs if len(runs) * RUNS_WORTH_IT <= len(device_pages) else None,
        )

    def run_layer(self, job: CopyJob, layer: int) -> None:
        """Copy one layer of ``job`` (the CPU path; CUDA engines override submission instead)."""
        dev, host = self.device_pool.page_view, self.host_pool.page_view
        if job.runs is not None:
            if job.direction is Direction.BACKUP:
                copy_runs_one_layer(dev, host, job.runs, layer)
            else:
                copy_runs_one_layer(host, dev, [(h, d, n) for d, h, n in job.runs], layer)
            return
        if job.direction is Direction.BACKUP:
            src, dst, src_pages, dst_pages = dev, host, job.device_pages, job.host_pages
        else:
            src, dst, src_pages, dst_pages = host, dev, job.host_pages, job.device_pages
        if self._copy_rows_c(src, dst, src_pages, dst_pages, layer):
            return
        if not gather_scatter_one_layer(src, dst, src_pages, dst_pages, layer):
            copy_pages_one_layer(src, dst, src_pages, dst_pages, layer)

    @staticmethod
    def _copy_rows_c(src, dst, src_pages, dst_pages, layer: int) -> bool:  # noqa: ANN001
        """One memcpy per page, in one pass, when pages are contiguous rows (C helpers)."""
        views = [
            (page_rows(src, kv, layer), page_rows(dst, kv, layer)) for kv in range(src.shape[0])
        ]
        if any(s is None or d is None for s, d in views):
            return False
        s_idx, d_idx = src_pages.numpy(), dst_pages.numpy()
        return all(copy_rows(s, d, s_idx, d_idx) for s, d in views)

    def submit(
        self,
        direction: Direction,
        device_pages: np.ndarray,
        host_pages: np.ndarray,
        after: Iterable[Ticket] = (),
    ) -> Ticket:
        """Enqueue a copy of ``device_pages[i] <-> host_pages[i]``; returns at once."""
        job = self._new_job(direction, device_pages, host_pages, after)
        self._enqueue(job)
        return job.ticket

    @abstractmethod
    def _enqueue(self, job: CopyJob) -> None:
        """Hand a new job to the backend (it runs later; its ack comes from poll)."""

    @abstractmethod
    def poll(self) -> list[Ack]:
        """Acks of copies finished since the last poll. Never blocks."""

    @abstractmethod
    def wait(self, tickets: Iterable[Ticket], timeout: float | None = None) -> bool:
        """Block until these copies finished (their acks still come from poll). False on
        timeout."""

    @abstractmethod
    def layers_done(self, ticket: Ticket) -> int:
        """Layers of a load already on the device (num_layers once finished or unknown)."""

    @abstractmethod
    def pending(self) -> int:
        """Copies submitted whose acks poll has not returned yet."""

    def close(self) -> None:
        """Finish queued copies and stop background work."""
