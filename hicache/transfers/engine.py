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

from hicache.kernels import page_runs
from hicache.memory import DevicePool, HostPool, PageSums
from hicache.transfers.copiers import Copier, CpuCopier, Runs
from hicache.transfers.progress import LayerProgress
from hicache.types import Ticket


class Direction(IntEnum):
    BACKUP = 0  # device -> host
    LOAD = 1  # host -> device


@dataclass(frozen=True)
class Ack:
    """A finished copy."""

    ticket: Ticket
    ok: bool  # False: the copy raised; its destination holds garbage
    error: str = ""  # the exception text when not ok
    corrupt: bool = False  # a load refused: its host pages no longer hold what was written


class CorruptPages(RuntimeError):
    """Host pages whose bytes differ from their checksum (page_sums.py)."""

    def __init__(self, pages: np.ndarray):
        super().__init__(f"host pages {pages[:8].tolist()} changed since they were written")
        self.pages = pages


@dataclass
class CopyJob:
    """One submitted copy. Index tensors live here until the ack, as CUDA would need."""

    ticket: Ticket
    direction: Direction
    device_pages: torch.Tensor  # int64 page ids in the device pool
    host_pages: torch.Tensor  # int64 page ids in the host pool, same length
    after: tuple[Ticket, ...]  # tickets that must complete first
    runs: Runs  # (device_start, host_start, pages) runs consecutive on both sides
    layers_done: int = 0  # layers fully copied so far

    def sides(self, device_view: torch.Tensor, host_view: torch.Tensor) -> tuple:
        """(src view, dst view, src pages, dst pages, runs) in this job's direction."""
        if self.direction is Direction.BACKUP:
            return device_view, host_view, self.device_pages, self.host_pages, self.runs
        runs = [(h, d, n) for d, h, n in self.runs]
        return host_view, device_view, self.host_pages, self.device_pages, runs


class TransferEngine(ABC):
    """Copies pages between one DevicePool and one HostPool. Not reentrant: one caller thread
    submits and polls; the engine may copy on its own threads."""

    def __init__(self, device_pool: DevicePool, host_pool: HostPool, copier: Copier | None = None):
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.copier = copier or CpuCopier()  # chosen once, from config.transfer_backend
        self.progress: LayerProgress | None = None  # a shared table loads publish layers to
        self.num_layers = device_pool.config.num_layers
        self.sums: PageSums | None = None  # host page checksums (config.verify_pages)
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
        for pages, pool in ((device_pages, self.device_pool), (host_pages, self.host_pool)):
            # checked once here, so copiers (and kernels on the GPU) may trust the ids
            if len(pages) and (int(pages.min()) < 0 or int(pages.max()) >= pool.num_pages):
                raise IndexError(f"page outside the pool of {pool.num_pages} pages")
        return CopyJob(
            ticket,
            direction,
            torch.from_numpy(device_pages),
            torch.from_numpy(host_pages),
            tuple(after),
            page_runs(device_pages, host_pages),
        )

    def run_layer(self, job: CopyJob, layer: int) -> None:
        """Copy one layer of ``job`` with the engine's copier (on the caller's thread)."""
        src, dst, src_pages, dst_pages, runs = job.sides(
            self.device_pool.page_view, self.host_pool.page_view
        )
        self.copier.copy_layer(src, dst, src_pages, dst_pages, runs, layer)

    def check_source(self, job: CopyJob) -> None:
        """Before a load: raise CorruptPages if a host page it reads changed since written."""
        if self.sums is not None and job.direction is Direction.LOAD:
            bad = self.sums.bad(job.host_pages.numpy())
            if len(bad):
                raise CorruptPages(bad)

    def seal(self, job: CopyJob) -> None:
        """After a backup: record the checksums of the host pages it wrote."""
        if self.sums is not None and job.direction is Direction.BACKUP:
            self.sums.seal(job.host_pages.numpy())

    def run_all(self, job: CopyJob) -> None:
        """Copy every layer of ``job`` at once (a backup: nobody waits on single layers)."""
        src, dst, src_pages, dst_pages, runs = job.sides(
            self.device_pool.page_view, self.host_pool.page_view
        )
        self.copier.copy_all(src, dst, src_pages, dst_pages, runs)

    def _publish(self, ticket: Ticket, layers: int) -> None:
        if self.progress is not None:
            self.progress.publish(ticket, layers)

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

    def layer_handles(self, ticket: Ticket) -> list[bytes] | None:
        """Handles another process can wait on per layer (CUDA IPC events); None here."""
        return None

    @abstractmethod
    def layers_done(self, ticket: Ticket) -> int:
        """Layers of a load already on the device (num_layers once finished or unknown)."""

    @abstractmethod
    def pending(self) -> int:
        """Copies submitted whose acks poll has not returned yet."""

    def close(self) -> None:
        """Finish queued copies and stop background work."""
