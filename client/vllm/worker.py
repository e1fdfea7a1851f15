"""WorkerSide: the connector in each vLLM worker process: the KV layout, and the block copies.

At start (``register``) it reads the layout of vLLM's KV caches from the registered tensors and
registers it with the daemon: a daemon serving another layout stops vLLM's start with an error
naming both; a daemon that is not there is a warning (vLLM serves without it, and the
scheduler registers the layout later from this side's reports). It needs no session after
that: every step's plan names the pools (mapped here by their shared-memory paths, one daemon
life each, kept while plans name them) and the pages to copy.

Loads start before the forward pass (``start_load_kv``): all layers at once, or one layer at a
time ahead of the layer that reads it (``layerwise``: CUDA caches by default; see
layer_loads.py and ``wait_layer``); stores run after it (``wait_for_save``), all layers. A
load that cannot be done (the pool gone, a bad page) is reported to vLLM as failed blocks,
never left as garbage KV; a store that cannot be done is reported to the scheduler, which then
never publishes it.

Runs on the worker's model-runner thread only.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from hicache.client.client import HiCacheClient
from hicache.client.connection import DaemonError, LayoutMismatch
from hicache.client.pools import AttachedPools, attach_pools
from hicache.client.trust import trusted_uids
from hicache.client.vllm.blocks import BlockCopier, block_format, engine_layout, ordered_layers
from hicache.client.vllm.daemon_link import DOWN
from hicache.client.vllm.layer_loads import StreamLoads, ThreadLoads
from hicache.client.vllm.meta import Copy, PoolRef, StepPlan, StepReport
from hicache.config import HiCacheConfig
from hicache.memory import EngineLayout

log = logging.getLogger("hicache.vllm")
KEEP_POOLS = 2  # daemon lives whose pools stay mapped (the current one and the one before)


class WorkerSide:
    def __init__(
        self,
        endpoint: str,
        timeout_s: float,
        rank: int,
        name: str,
        layerwise: str = "auto",
        daemon_user: str | None = None,
    ):
        self.endpoint = endpoint
        self.daemon_user = daemon_user
        self.trusted = trusted_uids(daemon_user)  # whose pools this rank maps (client/trust.py)
        self.timeout_s = timeout_s
        self.rank = rank  # tensor-parallel rank: where this rank's share of a page starts
        self.name = name
        self.layout: EngineLayout | None = None
        self.copier: BlockCopier | None = None
        self.pools: dict[int, tuple[AttachedPools, list[torch.Tensor]]] = {}  # by epoch
        self.load_errors: set[int] = set()  # block ids, until vLLM asks
        self.failed_stores: set[int] = set()  # jobs, until the step's report
        self.failed_loads = 0
        self.layout_acked = False  # a plan named a pool of this layout: no need to report it
        self.seconds = 0.0  # spent copying since the last report
        self.layerwise_setting = layerwise  # auto (CUDA caches), on, off
        self.layerwise = False  # decided at register
        self.layer_index: dict[str, int] = {}  # vLLM's layer names, in the copier's order
        self.inflight: StreamLoads | ThreadLoads | None = None  # this step's layer-wise loads

    # ---- start ------------------------------------------------------------------------------
    def register(self, kv_caches: dict[str, torch.Tensor], **facts: Any) -> EngineLayout:
        """Read the layout from vLLM's tensors (``facts``: model, heads, sizes; see
        blocks.engine_layout), and register it with the daemon. Raises RuntimeError when the
        daemon serves another layout."""
        names = ordered_layers(kv_caches)
        tensors = [kv_caches[n] for n in names]
        num_blocks = facts.pop("num_blocks")
        fmt = block_format(tensors, num_blocks)
        layout = engine_layout(fmt, num_layers=len(tensors), **facts)
        self.layout = layout
        offset = self.rank * layout.rank_elems
        self.copier = BlockCopier(tensors, fmt, offset, layout.block_size)
        self.layer_index = {name: i for i, name in enumerate(names)}
        cuda = tensors[0].is_cuda
        self.layerwise = self.layerwise_setting == "on" or (
            self.layerwise_setting == "auto" and cuda
        )
        try:
            with HiCacheClient(
                self.endpoint,
                self.name,
                timeout_s=self.timeout_s,
                heartbeat=False,
                daemon_user=self.daemon_user,
            ) as hc:
                hc.register_layout(layout)
            registered = True
        except LayoutMismatch as exc:
            raise RuntimeError(
                f"hicache: vLLM's KV layout does not fit the daemon at {self.endpoint}: "
                f"{exc.message}"
            ) from None
        except (DaemonError, *DOWN) as exc:
            registered = False
            log.warning(
                "hicache-daemon at %s not usable at start (%s): serving without it until it is "
                "(the scheduler registers this layout when it is)",
                self.endpoint,
                exc,
            )
        if registered:
            log.info(
                "hicache: rank %d registered its KV layout with the daemon (%d layers, blocks "
                "%s %s; %s); it copies through the scheduler's session from now on",
                self.rank,
                layout.num_layers,
                list(layout.block_shape),
                layout.dtype,
                {"c": "C page copies"}.get(self.copier.path, f"{self.copier.path} copies"),
            )
        return layout

    # ---- copies -----------------------------------------------------------------------------
    def load(self, plan: StepPlan) -> None:
        """Every planned load, before the forward pass (layer-wise: started, and waited for
        per layer by ``wait_layer``); failures become load errors."""
        started = time.perf_counter()
        self.finish_loads()
        jobs = []
        for copy in plan.loads:
            try:
                views = self._views(plan, copy)
                assert self.copier is not None  # (register_kv_caches came first)
                self.copier.check(copy.block_ids, copy.pages, views)
                if self.layerwise:
                    jobs.append((copy, views))
                else:
                    self.copier.load(views, copy.block_ids, copy.pages)
                    self._synchronize()
            except Exception as exc:  # never garbage KV: vLLM recomputes these blocks
                log.warning("hicache: load of %d blocks failed: %s", len(copy.block_ids), exc)
                self._failed_load(copy)
        if jobs:
            assert self.copier is not None  # (it checked them)
            cuda = self.copier.tensors[0].is_cuda
            kind = StreamLoads if cuda else ThreadLoads
            self.inflight = kind(self.copier, jobs, self._failed_load)
        self.seconds += time.perf_counter() - started

    def wait_layer(self, name: str) -> None:
        """vLLM is about to read layer ``name``: its loads must have landed."""
        if self.inflight is not None:
            started = time.perf_counter()
            self.inflight.wait(self.layer_index[name])
            self.seconds += time.perf_counter() - started

    def finish_loads(self) -> None:
        """Every layer-wise load of the step landed (before stores, errors and the report)."""
        if self.inflight is not None:
            inflight, self.inflight = self.inflight, None
            inflight.finish()

    def _failed_load(self, copy: Copy) -> None:
        self.load_errors.update(int(b) for b in copy.block_ids)
        self.failed_loads += len(copy.block_ids)

    def store(self, plan: StepPlan) -> None:
        """Every planned store, after the forward pass; failures are reported."""
        started = time.perf_counter()
        self.finish_loads()
        for copy in plan.stores:
            try:
                views = self._views(plan, copy)
                assert self.copier is not None  # (register_kv_caches came first)
                self.copier.store(views, copy.block_ids, copy.pages)
                self._synchronize()
            except Exception as exc:  # never published
                log.warning("hicache: store of %d blocks failed: %s", len(copy.block_ids), exc)
                self.failed_stores.add(copy.job)
        self.seconds += time.perf_counter() - started

    def _views(self, plan: StepPlan, copy: Copy) -> list[torch.Tensor]:
        if self.copier is None:
            raise RuntimeError("no KV caches registered")
        if not copy.epoch:
            raise RuntimeError("the scheduler withdrew this copy (its pin may have lapsed)")
        return self._pool(plan.pools[copy.epoch])

    def _synchronize(self) -> None:
        if self.copier is not None and self.copier.tensors[0].is_cuda:
            torch.cuda.current_stream().synchronize()  # done before the report says so

    def _pool(self, ref: PoolRef) -> list[torch.Tensor]:
        """The pool of one daemon life, mapped on first use (a layout unlike this rank's is
        refused: its pages would be another model's KV)."""
        mapped = self.pools.get(ref.epoch)
        if mapped is None:
            # (register_kv_caches came first)
            assert self.layout is not None and self.copier is not None
            served = EngineLayout.from_dict(ref.layout)
            mismatch = served.mismatch(self.layout)
            if mismatch:
                raise RuntimeError(mismatch)
            names = HiCacheConfig.__dataclass_fields__
            cfg = HiCacheConfig(**{k: v for k, v in ref.config.items() if k in names})
            pools = attach_pools(cfg, ref.pools, ref.daemon_uid, self.trusted)
            mapped = (pools, self.copier.pool_views(list(pools.kv_buffer)))
            self.pools[ref.epoch] = mapped
            for old in sorted(self.pools)[:-KEEP_POOLS]:
                self._unmap(old)
            self.layout_acked = True
        return mapped[1]

    def _unmap(self, epoch: int) -> None:
        pools, _ = self.pools.pop(epoch)
        try:
            pools.close()
        except Exception:  # a view still alive: the mapping goes with the process
            log.debug("hicache: pool of epoch %d left mapped", epoch)

    # ---- what vLLM asks after the step -----------------------------------------------------
    def take_load_errors(self) -> set[int]:
        self.finish_loads()
        errors, self.load_errors = self.load_errors, set()
        return errors

    def report(self, plan: StepPlan | None) -> StepReport | None:
        """This step's outcome for the scheduler (its layout too, until a plan showed that the
        scheduler registered it)."""
        self.finish_loads()
        layout = None if self.layout_acked or self.layout is None else self.layout.as_dict()
        idle = plan is None or (plan.step == 0 and not self.failed_loads)  # nothing planned
        if idle and layout is None:
            return None
        failed, self.failed_stores = self.failed_stores, set()
        failed_loads, self.failed_loads = self.failed_loads, 0
        step = -1 if plan is None else plan.step
        seconds, self.seconds = self.seconds, 0.0
        return StepReport(step, 1, failed, failed_loads, layout, seconds)

    def close(self) -> None:
        self.finish_loads()
        for epoch in list(self.pools):
            self._unmap(epoch)
