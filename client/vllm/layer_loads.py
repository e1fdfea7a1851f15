"""A step's loads copied one layer at a time, so the forward pass reads layer i as soon as it
landed while later layers still copy (vLLM calls ``wait_for_layer_load`` before each layer).

- ``StreamLoads`` (CUDA caches): every layer's copies go on a side stream, which first waits
  for the current stream (vLLM's blocks may still be written by the previous step); an event
  per layer; ``wait(i)`` makes the current stream wait for layer i's event (no CPU stall).
- ``ThreadLoads`` (CPU caches): a thread copies layer after layer and sets an Event per layer;
  ``wait(i)`` blocks until it is set. Off by default on the CPU (``hicache.layerwise``): the
  copy thread competes with vLLM's own threads for the cores.

Every job was checked before any copy starts (ids in range), so a copy fails only in the
copier itself; such a failure marks that job's blocks as load errors (vLLM recomputes them).
``finish()`` returns once every layer landed; the worker calls it before stores and reports.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from hicache.client.vllm.blocks import BlockCopier

log = logging.getLogger("hicache.vllm")
Job = tuple[Any, list[torch.Tensor]]  # (Copy, the pool's per-layer views)


class StreamLoads:
    def __init__(self, copier: BlockCopier, jobs: list[Job], failed: Callable[[Any], None]):
        current = torch.cuda.current_stream()
        self.stream = torch.cuda.Stream(device=current.device)
        self.stream.wait_stream(current)
        self.events = []
        with torch.cuda.stream(self.stream):
            for layer in range(len(copier.tensors)):
                for copy, views in jobs:
                    try:
                        copier.load_layer(layer, views, copy.block_ids, copy.pages)
                    except Exception as exc:  # (launch failures only: ids were checked)
                        log.warning("hicache: layer %d of a load failed: %s", layer, exc)
                        failed(copy)
                event = torch.cuda.Event()
                event.record(self.stream)
                self.events.append(event)

    def wait(self, layer: int) -> None:
        torch.cuda.current_stream().wait_event(self.events[layer])

    def finish(self) -> None:
        self.stream.synchronize()


class ThreadLoads:
    def __init__(self, copier: BlockCopier, jobs: list[Job], failed: Callable[[Any], None]):
        self.copier, self.jobs, self.failed = copier, jobs, failed
        self.landed = [threading.Event() for _ in copier.tensors]
        self.errors: list[Any] = []  # jobs whose copy failed (reported by finish)
        self.thread = threading.Thread(target=self._run, name="hicache-layer-loads", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for layer, landed in enumerate(self.landed):
                for copy, views in self.jobs:
                    if copy in self.errors:
                        continue
                    try:
                        self.copier.load_layer(layer, views, copy.block_ids, copy.pages)
                    except Exception as exc:
                        log.warning("hicache: layer %d of a load failed: %s", layer, exc)
                        self.errors.append(copy)
                landed.set()
        finally:
            for landed in self.landed:  # (never leave a waiter hanging)
                landed.set()

    def wait(self, layer: int) -> None:
        self.landed[layer].wait()

    def finish(self) -> None:
        self.thread.join()
        for copy in self.errors:
            self.failed(copy)
        self.errors = []
