"""ThreadTransferEngine: the CPU backend. One worker thread runs copies in submission order.

Torch copies release the GIL, so copying overlaps with the control thread. Submission order
satisfies every ``after`` dependency by construction. A load publishes progress per layer (and
to the shared progress table, when the engine has one); a backup copies all layers at once.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Iterable

from hicache.memory import DevicePool, HostPool
from hicache.transfers.copiers import Copier
from hicache.transfers.engine import Ack, CopyJob, CorruptPages, Direction, TransferEngine
from hicache.transfers.progress import FAILED
from hicache.types import Ticket


class ThreadTransferEngine(TransferEngine):
    def __init__(self, device_pool: DevicePool, host_pool: HostPool, copier: Copier | None = None):
        super().__init__(device_pool, host_pool, copier)
        self._queue: queue.SimpleQueue[CopyJob | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._jobs: dict[Ticket, CopyJob] = {}  # submitted, ack not yet returned by poll
        self._unfinished: set[Ticket] = set()  # submitted, copy not yet finished
        self._acks: deque[Ack] = deque()  # finished, not yet polled
        self._thread = threading.Thread(target=self._work, name="hicache-transfer", daemon=True)
        self._thread.start()

    def _enqueue(self, job: CopyJob) -> None:
        with self._cond:
            self._jobs[job.ticket] = job
            self._unfinished.add(job.ticket)
        self._queue.put(job)

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            ack = Ack(job.ticket, True)
            try:
                if job.direction is Direction.BACKUP:
                    self.run_all(job)  # nobody waits on single layers of a backup
                    self.seal(job)
                    self._layer_done(job, self.num_layers)
                else:
                    self.check_source(job)
                    for layer in range(self.num_layers):
                        self.run_layer(job, layer)
                        self._layer_done(job, layer + 1)
            except Exception as exc:  # a failed copy is reported, never fatal
                corrupt = isinstance(exc, CorruptPages)
                ack = Ack(job.ticket, False, f"{type(exc).__name__}: {exc}", corrupt)
                if job.direction is Direction.LOAD:
                    self._publish(job.ticket, FAILED)
            with self._cond:
                self._unfinished.discard(job.ticket)
                self._acks.append(ack)
                self._cond.notify_all()

    def _layer_done(self, job: CopyJob, layers: int) -> None:
        if job.direction is Direction.LOAD:
            self._publish(job.ticket, layers)
        with self._cond:
            job.layers_done = layers
            self._cond.notify_all()

    def poll(self) -> list[Ack]:
        with self._cond:
            acks = list(self._acks)
            self._acks.clear()
            for ack in acks:
                self._jobs.pop(ack.ticket, None)
        return acks

    def wait(self, tickets: Iterable[Ticket], timeout: float | None = None) -> bool:
        wanted = set(tickets)
        with self._cond:
            return self._cond.wait_for(lambda: not (wanted & self._unfinished), timeout)

    def wait_layer(self, ticket: Ticket, layer: int, timeout: float | None = None) -> bool:
        """Block until ``layer`` of a load is on the device."""
        with self._cond:
            return self._cond.wait_for(lambda: self.layers_done(ticket) > layer, timeout)

    def layers_done(self, ticket: Ticket) -> int:
        job = self._jobs.get(ticket)
        return self.num_layers if job is None else job.layers_done

    def pending(self) -> int:
        with self._cond:
            return len(self._jobs)

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
