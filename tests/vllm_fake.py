"""vLLM's side of the connector protocol, played by hand over real tensors (no vLLM): the
connector's scheduler half and one worker half per tensor-parallel rank, with vLLM's call
order per step, a block table per request, and KV computed as a known function of the prefix.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from hicache.client.vllm.daemon_link import DaemonLink
from hicache.client.vllm.meta import StepPlan, StepReport
from hicache.client.vllm.scheduler import SchedulerSide
from hicache.client.vllm.settings import ConnectorSettings
from hicache.client.vllm.worker import WorkerSide

LAYERS, HEADS, HEAD, BS = 2, 2, 8, 4


@dataclass
class Req:
    """What the connector reads of vLLM's Request."""

    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    cache_salt: str | None = None
    lora_request: Any = None
    mm_features: list = field(default_factory=list)
    prompt_embeds: Any = None
    computed: int = 0  # tokens with KV in the engine's blocks
    blocks: list[int] = field(default_factory=list)
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def kv_of(tokens: list[int], layer: int, head: int) -> np.ndarray:
    """The KV of each position: a function of the whole prefix, the layer and the head."""
    h = np.cumsum(np.asarray(tokens, dtype=np.int64) * 7 + 1) % 65521
    return (h + 100_000 * layer + 10_000 * head).astype(np.float32)


class FakeVllm:
    def __init__(
        self,
        endpoint: str,
        ranks: int = 1,
        num_blocks: int = 64,
        layerwise: str = "off",
        **settings: Any,
    ):
        self.ranks, self.num_blocks = ranks, num_blocks
        self.settings = ConnectorSettings(endpoint, timeout_s=1.0, retry_s=0.1, **settings)
        expect = {"head_size": HEAD, "block_size": BS, "num_layers": LAYERS}
        link = DaemonLink(endpoint, "fake-vllm", 1.0, 0.1, "fake-model", expect)
        self.sched = SchedulerSide(self.settings, link, BS, ranks)
        self.sched.block_ids = lambda rid: self.reqs[rid].blocks
        self.reqs: dict[str, Req] = {}
        self.free = list(range(1, num_blocks))  # block 0 is vLLM's null block
        self.caches: list[list[torch.Tensor]] = []
        self.workers: list[WorkerSide] = []
        per_rank = HEADS // ranks
        for r in range(ranks):
            tensors = {
                f"model.layers.{i}.self_attn.attn": torch.zeros(num_blocks, per_rank, BS, 2 * HEAD)
                for i in range(LAYERS)
            }
            self.caches.append(list(tensors.values()))
            w = WorkerSide(endpoint, 1.0, r, f"fake-worker{r}", layerwise)
            w.register(
                tensors,
                model="fake-model",
                num_blocks=num_blocks,
                num_kv_heads=per_rank,
                total_kv_heads=HEADS,
                head_size=HEAD,
                block_size=BS,
                tp_size=ranks,
                backend="fake",
            )
            self.workers.append(w)
        link.ready()
        self.load_errors: set[int] = set()
        self.fail_store_rank: int | None = None  # a rank whose stores raise
        self.silent_rank: int | None = None  # a rank whose report never reaches the scheduler
        self.layers_waited: list[str] = []  # wait_for_layer_load calls, in order

    # ---- vLLM's calls ------------------------------------------------------------------------
    def add(self, rid: str, tokens: list[int], **kw: Any) -> Req:
        req = Req(rid, list(tokens), len(tokens), **kw)
        self.reqs[rid] = req
        return req

    def lookup(self, req: Req) -> int:
        """The scheduler's lookup, asked again each "step" while it answers "not yet" (None: a
        daemon with a store fetches the prompt's pages; the connector says so for at most
        ``l3_wait_s``)."""
        while (ext := self.sched.lookup(req, 0)) is None:
            time.sleep(0.001)  # (the next step)
        return ext

    def admit(self, req: Req, alloc: bool = True, own: int = 0) -> int:
        """The scheduler admits a new request: lookup, then (when ``alloc``) blocks for the
        whole prompt and update_state_after_alloc. ``own``: vLLM's own prefix-cache hit
        (whole blocks; their KV is not written here). Returns the external tokens."""
        ext = self.sched.lookup(req, own)
        if not alloc:
            return ext
        need = -(-len(req.all_token_ids) // BS)
        req.blocks = [self.free.pop(0) for _ in range(need)]
        self.sched.after_alloc(req, list(req.blocks), ext)
        req.computed = own + ext
        return ext

    def step(self, todo: dict[str, int]) -> StepPlan:
        """One step: ``todo`` maps request ids to tokens scheduled (after admission)."""
        new = [SimpleNamespace(req_id=r, num_computed_tokens=self.reqs[r].computed) for r in todo]
        out = SimpleNamespace(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
            num_scheduled_tokens=dict(todo),
            scheduled_spec_decode_tokens={},
        )
        plan = self.sched.plan(out)
        for w in self.workers:
            w.load(plan)
            for name in w.layer_index:  # vLLM's attention layers, in order, before each reads
                w.wait_layer(name)
                self.layers_waited.append(name)
            self.load_errors |= w.take_load_errors()
        for rid, n in todo.items():
            self._compute(self.reqs[rid], n)
        reports = []
        for rank, w in enumerate(self.workers):
            if rank == self.fail_store_rank and plan.stores:
                w.failed_stores.update(c.job for c in plan.stores)
            else:
                w.store(plan)
            report = w.report(plan)
            if rank != self.silent_rank:
                reports.append(report)
        self.sched.report(_aggregate(reports))
        return plan

    def decode(self, req: Req, token: int) -> None:
        """The token sampled last step joins the request (its KV is computed next step)."""
        req.all_token_ids.append(token)
        if len(req.all_token_ids) > len(req.blocks) * BS:
            req.blocks.append(self.free.pop(0))

    def finish(self, req: Req) -> None:
        self.sched.finished(req.request_id)
        self.free.extend(req.blocks)
        req.blocks = []

    # ---- KV ----------------------------------------------------------------------------------
    def _compute(self, req: Req, n: int) -> None:
        """Write the KV of tokens [computed, computed + n) into the request's blocks."""
        start, end = req.computed, req.computed + n
        per_rank = HEADS // self.ranks
        for rank, tensors in enumerate(self.caches):
            for layer, t in enumerate(tensors):
                for h in range(per_rank):
                    value = kv_of(req.all_token_ids[:end], layer, rank * per_rank + h)
                    for pos in range(start, end):
                        t[req.blocks[pos // BS], h, pos % BS, :] = float(value[pos])
        req.computed = end

    def kv_matches(self, req: Req, upto: int) -> bool:
        """Whether the blocks hold the right KV for the request's first ``upto`` tokens."""
        per_rank = HEADS // self.ranks
        for rank, tensors in enumerate(self.caches):
            for layer, t in enumerate(tensors):
                for h in range(per_rank):
                    value = kv_of(req.all_token_ids[:upto], layer, rank * per_rank + h)
                    for pos in range(upto):
                        got = t[req.blocks[pos // BS], h, pos % BS]
                        if not torch.all(got == float(value[pos])):
                            return False
        return True

    def poison_blocks(self) -> None:
        for tensors in self.caches:
            for t in tensors:
                t.fill_(-1.0)

    def close(self) -> None:
        self.sched.close()
        for w in self.workers:
            w.close()


def _aggregate(reports: list[StepReport | None]) -> StepReport | None:
    """What vLLM's KVOutputAggregator does with the workers' metadata."""
    out = None
    for rep in reports:
        if rep is None:
            continue
        out = rep if out is None else out.aggregate(rep)
    return out
