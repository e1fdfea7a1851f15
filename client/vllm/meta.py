"""What the connector's halves tell each other every step (vLLM pickles both to other processes).

Scheduler -> every worker: ``StepPlan`` (copies to run this step: loads before the forward,
stores after it). Every worker -> scheduler: ``StepReport`` (aggregated over ranks by vLLM),
from which the scheduler learns that a store's pages hold every rank's KV and may be published.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hicache.client.vllm.compat import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass(frozen=True)
class PoolRef:
    """Which pool the pages of a plan are in (one daemon life), and how to map it."""

    epoch: int  # the daemon life that handed out the pages
    config: dict[str, Any]  # the pool's HiCacheConfig fields
    pools: dict[str, Any]  # the pools' descriptions (shared-memory paths)
    layout: dict[str, Any]  # the EngineLayout the pool was made for
    daemon_uid: int | None = None  # the daemon's user, as the scheduler verified it (trust.py)


@dataclass(frozen=True)
class Copy:
    """Whole blocks between vLLM's KV caches and a pool: block_ids[i] <-> pages[i]."""

    job: int  # unique within the scheduler's life
    req_id: str
    epoch: int  # the pool's daemon life (a key of StepPlan.pools); 0: do not copy, fail it
    block_ids: np.ndarray  # int64, vLLM block ids (KV-cache group 0)
    pages: np.ndarray  # int64, page ids in the pool


@dataclass
class StepPlan(KVConnectorMetadata):
    step: int  # the scheduler step this plan belongs to
    pools: dict[int, PoolRef] = field(default_factory=dict)  # by epoch, those copies name
    loads: list[Copy] = field(default_factory=list)  # pool -> vLLM, before the forward pass
    stores: list[Copy] = field(default_factory=list)  # vLLM -> pool, after the forward pass


@dataclass
class StepReport(KVConnectorWorkerMetadata):
    step: int  # the plan's step (-1: a step without a plan)
    ranks: int = 1  # workers that ran the plan (summed by aggregate)
    failed: set[int] = field(default_factory=set)  # store jobs that failed on some rank
    failed_loads: int = 0  # blocks that failed to load (also reported to vLLM as invalid)
    layout: dict[str, Any] | None = None  # a worker's EngineLayout, until the scheduler has one
    seconds: float = 0.0  # spent copying this step (the slowest rank: ranks copy in parallel)

    # (ignore: narrower than vLLM's base, which takes any worker metadata: vLLM folds only the
    # reports of one connector, this one's)
    def aggregate(self, other: StepReport) -> StepReport:  # type: ignore[override]
        """vLLM folds the workers' reports into one: ranks add up, failures unite."""
        same = self.step == other.step  # (ranks always run the same plan; else none counts)
        return StepReport(
            step=max(self.step, other.step),
            ranks=self.ranks + other.ranks if same else 0,
            failed=self.failed | other.failed,
            failed_loads=self.failed_loads + other.failed_loads,
            layout=self.layout or other.layout,
            seconds=max(self.seconds, other.seconds),
        )
