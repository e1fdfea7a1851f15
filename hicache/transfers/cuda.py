"""CudaTransferEngine: copies on CUDA streams, acknowledged by polling events.

Backups run on a write stream, loads on a load stream, so a burst of backups never delays a
load that an engine waits for. Every job records a start event and a finish event (a load
also one event per layer); its index tensors stay referenced by the job until its ack, so
the caching allocator cannot hand their memory out while a copy may still read them.
``poll`` only queries events: the control loop never blocks on the GPU.

Layer progress for other processes, two ways: the per-layer events are interprocess events
whose IPC handles the daemon hands to the engine (its stream then waits on the GPU), and a
watcher thread waits on each load's layer events in turn (``Event.synchronize`` releases the
GIL) and publishes them to the shared progress table, the fallback that always works.

Cross-process rule: KV an engine wrote into the device pool must be complete (the engine
synchronized its stream) before it inserts those slots: a backup may start at once.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from hicache.memory import DevicePool, HostPool
from hicache.transfers.copiers import Copier, KernelCopier
from hicache.transfers.engine import Ack, CopyJob, Direction, TransferEngine
from hicache.transfers.progress import FAILED
from hicache.types import Ticket

POLL_SLEEP_S = 50e-6  # wait() polls events this often when it has a timeout


@dataclass
class _Flight:
    job: CopyJob  # holds the index tensors until the ack
    start: torch.cuda.Event  # recorded before the first copy
    done: torch.cuda.Event  # recorded after the last copy
    layers: list[torch.cuda.Event] = field(default_factory=list)  # loads: one per layer
    error: str = ""  # why issuing the copy raised (the ack then says not ok)


class CudaTransferEngine(TransferEngine):
    def __init__(self, device_pool: DevicePool, host_pool: HostPool, copier: Copier | None = None):
        super().__init__(device_pool, host_pool, copier or KernelCopier())
        self.device = device_pool.page_view.device
        if self.device.type != "cuda":
            raise ValueError("CudaTransferEngine needs a CUDA device pool")
        self.write_stream = torch.cuda.Stream(self.device)
        self.load_stream = torch.cuda.Stream(self.device)
        self._flights: dict[Ticket, _Flight] = {}  # submitted, ack not yet returned by poll
        self._watch: queue.SimpleQueue[_Flight | None] = queue.SimpleQueue()
        self._watcher = threading.Thread(target=self._publish_layers, daemon=True)
        self._watcher.start()

    def _enqueue(self, job: CopyJob) -> None:
        load = job.direction is Direction.LOAD
        stream = self.load_stream if load else self.write_stream
        with torch.cuda.stream(stream):
            for dep in job.after:  # e.g. a load of host pages a backup is still writing
                if dep in self._flights:
                    stream.wait_event(self._flights[dep].done)
            flight = _Flight(job, torch.cuda.Event(), torch.cuda.Event())
            flight.start.record(stream)
            try:
                self._issue(job, flight, stream)
            except Exception as exc:  # reported by the ack, never fatal
                flight.error = f"{type(exc).__name__}: {exc}"
                flight.layers.clear()
                self._publish(job.ticket, FAILED)
            flight.done.record(stream)
        self._flights[job.ticket] = flight
        if load and flight.layers:
            self._watch.put(flight)

    def _issue(self, job: CopyJob, flight: _Flight, stream: torch.cuda.Stream) -> None:
        if isinstance(self.copier, KernelCopier):  # kernels index on the device
            job.device_pages = job.device_pages.to(self.device, non_blocking=True)
            job.host_pages = job.host_pages.to(self.device, non_blocking=True)
        if job.direction is Direction.BACKUP:
            self.run_all(job)
            return
        for layer in range(self.num_layers):
            self.run_layer(job, layer)
            event = torch.cuda.Event(interprocess=True)  # engines may wait on it on their GPU
            event.record(stream)
            flight.layers.append(event)

    def _publish_layers(self) -> None:
        while (flight := self._watch.get()) is not None:
            for layer, event in enumerate(flight.layers):
                event.synchronize()
                flight.job.layers_done = layer + 1
                self._publish(flight.job.ticket, layer + 1)

    def poll(self) -> list[Ack]:
        acks = [Ack(t, not f.error, f.error) for t, f in self._flights.items() if f.done.query()]
        for ack in acks:
            del self._flights[ack.ticket]  # the index tensors may go now
        return acks

    def wait(self, tickets: Iterable[Ticket], timeout: float | None = None) -> bool:
        flights = [self._flights[t] for t in tickets if t in self._flights]
        if timeout is None:
            for f in flights:
                f.done.synchronize()
            return True
        end = time.monotonic() + timeout
        while not all(f.done.query() for f in flights):
            if time.monotonic() >= end:
                return False
            time.sleep(POLL_SLEEP_S)
        return True

    def wait_layer(self, ticket: Ticket, layer: int) -> None:
        flight = self._flights.get(ticket)
        if flight is not None and flight.layers:
            flight.layers[layer].synchronize()

    def layer_handles(self, ticket: Ticket) -> list[bytes] | None:
        """CUDA IPC handles of a load's per-layer events: an engine's stream can wait on layer i
        on the GPU (``torch.cuda.Event.from_ipc_handle``), without a CPU round trip."""
        flight = self._flights.get(ticket)
        if flight is None or not flight.layers:
            return None
        return [bytes(event.ipc_handle()) for event in flight.layers]

    def layers_done(self, ticket: Ticket) -> int:
        flight = self._flights.get(ticket)
        if flight is None or not flight.layers:
            return self.num_layers
        done = 0
        for event in flight.layers:
            if not event.query():
                break
            done += 1
        return done

    def pending(self) -> int:
        return len(self._flights)

    def close(self) -> None:
        for stream in (self.write_stream, self.load_stream):
            stream.synchronize()
        self._watch.put(None)
        self._watcher.join()
