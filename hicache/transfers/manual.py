"""ManualTransferEngine: copies run only when told to. For tests and deterministic replays.

``complete(ticket)`` runs one queued copy (after its ``after`` dependencies), so a test can
deliver acks in any order it likes and catch every use of pages before their ack: a copy that
runs late reads whatever the pages hold *then*. ``auto=True`` runs each copy at submit time
(still acknowledged only through poll), which makes a synchronous engine for benchmarks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from hicache.memory import DevicePool, HostPool
from hicache.transfers.copiers import Copier
from hicache.transfers.engine import Ack, CopyJob, CorruptPages, TransferEngine
from hicache.transfers.progress import FAILED
from hicache.types import Ticket


class ManualTransferEngine(TransferEngine):
    def __init__(
        self,
        device_pool: DevicePool,
        host_pool: HostPool,
        copier: Copier | None = None,
        auto: bool = False,
    ):
        super().__init__(device_pool, host_pool, copier)
        self.auto = auto  # run each copy as soon as it is submitted
        self._queued: dict[Ticket, CopyJob] = {}  # submitted, not yet run
        self._unacked: set[Ticket] = set()  # run or queued, ack not yet polled
        self._acks: deque[Ack] = deque()
        self._fail: set[Ticket] = set()  # tickets whose copy will "raise"
        self.fail_new = False  # every copy submitted from now on will "raise"

    def _enqueue(self, job: CopyJob) -> None:
        if self.fail_new:
            self._fail.add(job.ticket)
        self._queued[job.ticket] = job
        self._unacked.add(job.ticket)
        if self.auto:
            self.complete(job.ticket)

    def queued(self) -> list[Ticket]:
        """Tickets submitted but not run yet, oldest first."""
        return list(self._queued)

    def fail(self, ticket: Ticket) -> None:
        """Make this queued copy fail when it runs (its destination is left untouched)."""
        self._fail.add(ticket)

    def complete(self, ticket: Ticket) -> None:
        """Run a queued copy now, after any dependency still queued. No-op if already run."""
        job = self._queued.pop(ticket, None)
        if job is None:
            return
        for dep in job.after:
            self.complete(dep)
        if ticket in self._fail:
            self._acks.append(Ack(ticket, False, "injected failure"))
            self._publish(ticket, FAILED)
            return
        try:
            self.check_source(job)
        except CorruptPages as exc:
            self._acks.append(Ack(ticket, False, str(exc), corrupt=True))
            self._publish(ticket, FAILED)
            return
        for layer in range(self.num_layers):
            self.run_layer(job, layer)
            job.layers_done = layer + 1
            self._publish(ticket, layer + 1)
        self.seal(job)
        self._acks.append(Ack(ticket, True))

    def complete_all(self) -> None:
        for ticket in list(self._queued):
            self.complete(ticket)

    def poll(self) -> list[Ack]:
        acks = list(self._acks)
        self._acks.clear()
        self._unacked.difference_update(a.ticket for a in acks)
        return acks

    def wait(self, tickets: Iterable[Ticket], timeout: float | None = None) -> bool:
        for ticket in tickets:
            self.complete(ticket)
        return True

    def layers_done(self, ticket: Ticket) -> int:
        job = self._queued.get(ticket)
        return self.num_layers if job is None else job.layers_done

    def pending(self) -> int:
        return len(self._unacked)
