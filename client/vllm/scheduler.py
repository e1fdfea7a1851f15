"""SchedulerSide: the connector in vLLM's scheduler: lookups, pins, copy plans, publishing.

Per request (``Tracked``), the daemon holds a **chain**: a locked match of the request's prefix
that hicache has (whole blocks). It is taken at lookup and extended as the request's blocks are
published, and released when the request ends (finished, aborted, preempted and looked up
again), so the pages a load reads cannot be evicted before the copy and a store always extends
what is cached.

- Lookup (``get_num_new_matched_tokens``): the prompt's whole blocks, never the last token's
  block (at least one token is left to compute), matched and locked; the hit beyond vLLM's own
  (block-aligned) hit is reported, and loaded synchronously before the step's forward pass.
  The match never waits for the daemon's third tier: while more of the prefix is coming from
  it, the lookup answers "not yet" (None; vLLM skips the request this step and asks again),
  for up to ``l3_wait_s``, asking the daemon at most once per ``L3_POLL_S``.
- Stores: a block is planned once vLLM will have computed all its tokens by the end of the
  step (speculative tokens not counted); pool pages are allocated for it, every worker copies
  it after the forward pass (``wait_for_save``), and only when every rank reported the step
  done is it inserted (``insert_and_lock``, in prefix order). A failed copy is freed, never
  published, and its blocks are planned again.

Runs on vLLM's scheduler thread only; holds nothing of vLLM but the live Request objects.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hicache.client.connection import DaemonError
from hicache.client.vllm.daemon_link import DaemonLink, Unavailable
from hicache.client.vllm.meta import Copy, StepPlan, StepReport
from hicache.client.vllm.settings import ConnectorSettings, request_namespace
from hicache.client.vllm.tracking import Figures, Store, Tracked, timed

log = logging.getLogger("hicache.vllm")
L3_POLL_S = 0.002  # a request waiting for the third tier is looked up at most this often
MAX_L3_WAITING = 4096  # waiting requests tracked before stale ones are looked for


class SchedulerSide:
    def __init__(self, settings: ConnectorSettings, link: DaemonLink, block_size: int, world: int):
        self.settings = settings
        self.link = link
        self.block_size = block_size
        self.world = world  # workers that must report a step before its stores are published
        self.namespace_base = f"{link.model}\0{settings.namespace}"
        self.tracked: dict[str, Tracked] = {}
        self.retired: list[Tracked] = []  # ended requests whose stores are still pending
        self.loads: list[tuple[Copy, Tracked]] = []  # planned since the last step's plan
        self.step = 0
        self.open_steps: deque[tuple[int, list[Store]]] = deque()  # planned, not yet reported
        self.opened_at: dict[int, float] = {}  # when each open step was planned (monotonic)
        self.jobs = itertools.count(1)
        self.figures = Figures()
        self.reserve = _NO_PAGES  # ids of pages the session owns for later stores
        self.reserve_generation = 0
        self.reserve_lock = threading.Lock()  # the reserve: this thread, and a draining daemon's
        self.keep_reserve = True  # False once the daemon drains: pages are taken as needed
        link.on_draining = self._give_back_reserve
        # req_id -> block ids of group 0 (vLLM's manager; bind_kv_cache_manager sets it)
        self.block_ids: Callable[[str], list[int]] | None = None
        # requests whose prefix is coming from the third tier: (first "not yet", last ask)
        self.l3_waiting: dict[str, tuple[float, float]] = {}
        # what vLLM counts (engine_counts.py): own hit at an answered lookup, until allocated
        self.asked: dict[str, int] = {}
        self.load_steps: dict[int, int] = {}  # step -> tokens its plan loads (valid copies)

    # ---- lookup ---------------------------------------------------------------------------
    @timed
    def lookup(self, request: Any, num_computed: int) -> int | None:
        """Tokens hicache has beyond ``num_computed`` (vLLM's own block-aligned hit), whole
        blocks, never the prompt's last token; the prefix is locked until the request ends.
        None: more of it is coming from the daemon's third tier (ask again next step)."""
        waiting = self.l3_waiting.pop(request.request_id, None)
        now = time.monotonic()
        if waiting is not None and now - waiting[1] < L3_POLL_S:
            self.l3_waiting[request.request_id] = waiting  # asked a moment ago
            return None
        self._end(request.request_id)  # a lookup again (not scheduled, preempted): start over
        if len(self.asked) >= MAX_L3_WAITING:  # requests vLLM never allocated (aborted)
            self.asked.clear()
        self.asked[request.request_id] = num_computed  # (vLLM counts it once allocated)
        if not _cacheable(request):
            return 0
        bs = self.block_size
        tokens = request.all_token_ids
        limit = (len(tokens) - 1) // bs * bs
        self.figures.lookups += 1
        self.figures.queried_tokens += max(0, len(tokens) - num_computed)
        if limit < bs:
            return 0
        namespace = request_namespace(self.namespace_base, request)
        prompt = np.asarray(tokens[:limit], np.int64)
        try:
            match = self.link.call(lambda c: c.match_prefix(prompt, namespace, l3_wait=False))
        except Unavailable:
            self.figures.unavailable += 1
            self.asked.pop(request.request_id, None)  # (a lookup the daemon never saw)
            return 0
        except DaemonError as exc:
            log.warning("hicache lookup refused: %s", exc)
            return 0
        if match.l3_pending:
            since = now if waiting is None else waiting[0]
            if now - since < self.settings.l3_wait_s:
                if len(self.l3_waiting) >= MAX_L3_WAITING:  # requests vLLM dropped unsaid
                    self._forget_l3_waits(now)
                self.l3_waiting[request.request_id] = (since, now)
                self.figures.l3_not_yet += 1
                self.figures.lookups -= 1  # (counted once, when it is answered)
                self.figures.queried_tokens -= max(0, len(tokens) - num_computed)
                self.asked.pop(request.request_id, None)
                self._release_match(match)
                return None
        hit = match.device_hit_length
        self.tracked[request.request_id] = Tracked(
            request,
            namespace,
            self.link.generation,
            self.link.pool,
            time.monotonic(),
            match,
            chain_len=hit,
            planned=hit,
            local=num_computed,
        )
        external = max(0, hit - num_computed)
        self.figures.hit_tokens += external
        return external

    def _forget_l3_waits(self, now: float) -> None:
        """Drop the waits of requests not asked about for far longer than they may wait."""
        stale = now - self.settings.l3_wait_s - 60.0
        self.l3_waiting = {r: w for r, w in self.l3_waiting.items() if w[1] > stale}

    @timed
    def after_alloc(self, request: Any, block_ids: list[int], num_external: int) -> None:
        """Plan the load of the ``num_external`` tokens vLLM allocated blocks for (0: none)."""
        self._count(request, num_external)
        t = self.tracked.get(request.request_id)
        if t is None or not num_external or t.chain is None or t.pool is None:
            return
        bs = self.block_size
        first, count = t.local // bs, num_external // bs
        pages = t.chain.device_pages[first : first + count].numpy()
        blocks = np.asarray(block_ids[first : first + count], dtype=np.int64)
        epoch = t.pool.epoch
        if len(pages) != count or len(blocks) != count:  # (vLLM allocated otherwise: a bug)
            log.error("hicache: load of %d blocks does not fit its allocation", count)
            epoch, pages = 0, np.zeros(len(blocks), dtype=np.int64)  # withdrawn: recomputed
        copy = Copy(next(self.jobs), request.request_id, epoch, blocks, pages.copy())
        self.loads.append((copy, t))
        self.figures.loaded_tokens += num_external

    def _count(self, request: Any, num_external: int) -> None:
        """Tell the daemon this lookup as vLLM counts it, at the same point: once the request's
        blocks are allocated, not for a preempted one (vllm:external_prefix_cache_*)."""
        own = self.asked.pop(request.request_id, None)
        client = self.link.client
        # (ignore: mypy takes getattr's default type from the `or`, a bool)
        if own is None or client is None or getattr(request, "num_preemptions", 0):  # type: ignore[arg-type]
            return
        queried = max(0, request.num_tokens - own)
        if queried:
            client.note_engine(queried=queried, hit=min(num_external, queried))

    # ---- the step's plan --------------------------------------------------------------------
    @timed
    def plan(self, out: Any) -> StepPlan:
        """This step's copies: the loads planned since the last step, and stores of the blocks
        this step completes. A step with neither gets the shared empty plan (step 0), and the
        workers send no report for it."""
        self.step += 1  # (numbers need not be consecutive: a step without copies skips one)
        self._expire_steps()
        stores = self._plan_stores(out) if self.settings.store and self.tracked else []
        if not stores and not self.loads:
            return NO_PLAN
        plan = StepPlan(self.step)
        lease = self.link.client.lease_s if self.link.client is not None else 0.0
        loading = 0
        for copy, t in self.loads:
            # pages pinned by a session that may have lapsed since (a stalled scheduler) may be
            # someone else's now: such a load fails (vLLM recomputes), it is never copied
            if time.monotonic() - t.looked > lease / 2 or t.pool is None:
                copy = Copy(copy.job, copy.req_id, 0, copy.block_ids, copy.pages)
            elif copy.epoch:
                plan.pools[t.pool.epoch] = t.pool
                loading += len(copy.block_ids) * self.block_size
            plan.loads.append(copy)
        self.loads = []
        if loading:
            self.load_steps[self.step] = loading
        if stores:
            pool = self.link.pool
            assert pool is not None  # (_plan_stores plans only with one)
            plan.pools[pool.epoch] = pool
            plan.stores = [Copy(s.job, rid, pool.epoch, b, p) for s, rid, b, p in stores]
            self.open_steps.append((self.step, [s for s, *_ in stores]))
            self.opened_at[self.step] = time.monotonic()
        return plan

    def _expire_steps(self) -> None:
        """Steps whose report never came within half a lease (a worker that failed) count as
        failed: their pages are freed and the requests' pins released, not held for ever."""
        if not self.open_steps:
            return
        lease = self.link.client.lease_s if self.link.client is not None else 10.0
        oldest = self.open_steps[0][0]
        if time.monotonic() - self.opened_at.get(oldest, 0.0) > lease / 2:
            self.report(StepReport(self.open_steps[-1][0], 0))  # every open step failed

    def _plan_stores(self, out: Any) -> list[tuple[Store, str, np.ndarray, np.ndarray]]:
        if self.link.ready() is None or not self.link.fresh():
            return []  # down, or not surely alive: its pages may be someone else's by now
        generation = self.link.generation
        wanted: list[tuple[Tracked, int, int]] = []
        spec = out.scheduled_spec_decode_tokens or {}
        for req_id, computed in _scheduled(out):
            t = self.tracked.get(req_id)
            if t is None or t.finished:
                continue
            if t.generation != generation:
                self._void(t)  # (its computed blocks are planned again below)
            done = computed + out.num_scheduled_tokens[req_id] - len(spec.get(req_id, ()))
            request = t.request
            limit = min(len(request.all_token_ids), self._pin_cap())
            if not self.settings.store_generated:
                limit = min(limit, request.num_prompt_tokens)
            end = min(done, limit) // self.block_size * self.block_size
            if end > t.planned:
                wanted.append((t, t.planned, end))
        if not wanted:
            return []
        bs = self.block_size
        pages = self._take((sum(end - start for _, start, end in wanted)) // bs)
        if pages is None and len(wanted) > 1:  # not all fit: as many requests as fit, in order
            fit, parts = [], []
            for w in wanted:
                got = self._take((w[2] - w[1]) // bs)
                if got is not None:
                    fit.append(w)
                    parts.append(got)
            wanted, pages = fit, (torch.cat(parts) if parts else None)
        if pages is None or self.link.generation != generation or self.link.pool is None:
            return []  # (the link went down or renewed its session in between)
        assert self.block_ids is not None  # (bound before vLLM schedules)
        plans, at = [], 0
        for t, start, end in wanted:
            mine = pages[at : at + (end - start) // bs]
            at += (end - start) // bs
            rid = t.request.request_id
            ids = self.block_ids(rid)[start // bs : end // bs]
            store = Store(next(self.jobs), self.step, start, end, mine, generation)
            t.pending.append(store)
            t.planned = end
            blocks = np.asarray(ids, dtype=np.int64)
            plans.append((store, rid, blocks, mine.numpy()))
        return plans

    def _pin_cap(self) -> int:
        """Tokens one request's chain may pin: a share of the pool, whole blocks (one long
        request must not pin the whole pool and keep every other store out)."""
        pool = self.link.pool
        tokens = pool.config["device_tokens"] if pool is not None else 0
        return tokens // PIN_SHARE // self.block_size * self.block_size

    def _give_back_reserve(self) -> None:
        """The daemon is shutting down (on the heartbeat's thread): free the pages held ahead
        for later stores, and hold none from now on, so that it need not wait for them."""
        with self.reserve_lock:
            reserve, self.reserve = self.reserve, _NO_PAGES
            generation, self.keep_reserve = self.reserve_generation, False
            client = self.link.client
        if len(reserve) and client is not None and generation == self.link.generation:
            with contextlib.suppress(Exception):  # (a daemon gone already took them back)
                client.free(reserve, pages=True)

    def _take(self, pages: int) -> torch.Tensor | None:
        with self.reserve_lock:
            return self._take_locked(pages)

    def _take_locked(self, pages: int) -> torch.Tensor | None:
        """Ids of ``pages`` pages the session owns, from the reserve: one ALLOC brings
        the pages of many stores (at most 1/64 of the pool stays allocated ahead; the daemon
        takes it back with the session). None when there are none, or the session changed."""
        generation, pool = self.link.generation, self.link.pool
        if pool is None:
            return None
        if self.reserve_generation != generation:  # another session's: void
            self.reserve, self.reserve_generation = _NO_PAGES, generation
        short = pages - len(self.reserve)
        if short > 0:
            capacity = pool.config["device_tokens"] // self.block_size
            extra = min(RESERVE_PAGES, capacity // 64) if self.keep_reserve else 0
            for ask in (short + extra, short):  # (a full pool may still have the bare need)
                try:
                    # (ignore: mypy infers no lambda with a bound default)
                    got = self.link.call(lambda c, n=ask: c.alloc(n * self.block_size, pages=True))  # type: ignore[misc]
                except (Unavailable, DaemonError) as exc:  # OUT_OF_MEMORY: all pinned
                    log.debug("hicache: no pages for %d blocks this step: %s", ask, exc)
                    if self.link.generation != generation or self.link.pool is None:
                        return None  # down or a new session: not this step
                    continue
                if self.link.generation != generation:
                    return None  # (another session's pages: never mixed into the reserve)
                self.reserve = torch.cat([self.reserve, got])
                break
            else:
                return None
        first, self.reserve = self.reserve[:pages], self.reserve[pages:]
        return first

    # ---- the workers' reports ------------------------------------------------------------
    @timed
    def report(self, rep: StepReport | None) -> None:
        """A step's outcome: its stores are published when every rank copied them (and the
        steps before it, whose reports never came, count as failed)."""
        if rep is None or (rep.step == 0 and rep.layout is None):
            return
        self.figures.worker_s += rep.seconds
        self.figures.scheduler_s += self.link.take_wait()
        if rep.layout is not None:
            self.link.learn_layout(rep.layout)
        self._count_loads(rep)
        while self.open_steps and self.open_steps[0][0] <= rep.step:
            step, stores = self.open_steps.popleft()
            self.opened_at.pop(step, None)
            ok = step == rep.step and rep.ranks >= self.world
            for store in stores:
                store.ok = ok and store.job not in rep.failed
                self.figures.failed_stores += not store.ok
        self._publish()

    def _count_loads(self, rep: StepReport) -> None:
        """Tell the daemon the tokens this step's plan loaded into vLLM (blocks that failed on
        some rank, and steps whose report never came, left out)."""
        done = [step for step in self.load_steps if step <= rep.step]
        planned = sum(self.load_steps.pop(step) for step in done if step == rep.step)
        loaded = planned - min(planned, rep.failed_loads * self.block_size)
        client = self.link.client
        if loaded and client is not None and rep.ranks >= self.world:
            client.note_engine(loaded=loaded)
        for step in done:
            self.load_steps.pop(step, None)

    def _publish(self) -> None:
        """Publish settled stores in prefix order; free failed ones and re-plan their blocks."""
        for t in [*self.tracked.values(), *self.retired]:
            self._publish_one(t)
        still = []
        for t in self.retired:
            if t.pending:
                still.append(t)
            else:
                self._release(t)
        self.retired = still

    def _publish_one(self, t: Tracked) -> None:
        """One request: its run of settled good stores that extends the chain goes in one
        INSERT when it is worth a round trip (``_due``); settled stores that can no longer
        extend the chain (failed, or after a gap) are freed."""
        if t.generation != self.link.generation:
            self._void(t)  # the chain and the old session's pages are void
        run, end = [], t.chain_len
        for store in t.pending:
            if not store.ok or store.start != end:  # (None: not settled yet)
                break
            run.append(store)
            end = store.end
        if run and self._due(t, run):
            for _ in run:
                t.pending.popleft()
            self._insert(t, run)
        while t.pending and t.pending[0].ok is not None:
            head = t.pending[0]
            if head.ok and head.start == t.chain_len:
                break  # waits to be published with the next ones
            t.pending.popleft()
            self._free(head.pages, head.generation)
            t.planned = min(t.planned, t.chain_len)

    def _due(self, t: Tracked, run: list[Store]) -> bool:
        """Publish now: the request ended, the run holds prompt blocks (another request may
        want them at once), or enough generated blocks waited (one INSERT for several)."""
        if t.finished or run[0].start < t.request.num_prompt_tokens:
            return True
        return (run[-1].end - run[0].start) // self.block_size >= PUBLISH_BLOCKS

    def _insert(self, t: Tracked, run: list[Store]) -> None:
        end = run[-1].end
        tokens = np.asarray(t.request.all_token_ids[:end], dtype=np.int64)
        prefix = _NO_PAGES if t.chain is None else t.chain.device_pages
        mine = torch.cat([s.pages for s in run])
        pages = torch.cat([prefix, mine])
        # the request ended, or its chain reached the most one request may pin: publish and
        # unpin at once (a request stores nothing past that cap)
        last = (t.finished and not t.pending) or end >= self._pin_cap()
        try:  # the new chain replaces the old one in the same round trip
            inserted = self.link.call(
                lambda c: (
                    c.insert(tokens, pages, t.namespace, replaces=t.chain, pages=True)
                    if last
                    else c.insert_and_lock(tokens, pages, t.namespace, t.chain, pages=True)
                ),
                generation=t.generation,
            )
        except Unavailable:  # the session is gone, and its pages with it
            t.planned = t.chain_len
            return
        except DaemonError as exc:
            log.warning("hicache: publishing %d tokens failed: %s", end - run[0].start, exc)
            self._free(mine, t.generation)
            t.planned = t.chain_len
            return
        self.figures.stored_tokens += end - run[0].start
        if last:
            t.chain, t.chain_len = None, end
            return
        assert not isinstance(inserted, int)  # (not last: insert_and_lock's Inserted)
        t.chain = inserted.match
        t.chain_len = inserted.match.device_hit_length
        t.planned = max(t.planned, t.chain_len)

    # ---- request ends ------------------------------------------------------------------------
    @timed
    def finished(self, req_id: str) -> None:
        """The request ended (vLLM frees its blocks after this: every planned store of it was
        already copied, in the step that computed it)."""
        self._end(req_id)

    def _end(self, req_id: str) -> None:
        self.l3_waiting.pop(req_id, None)
        t = self.tracked.pop(req_id, None)
        if t is None:
            return
        t.finished = True
        self._publish_one(t)  # what waited to be merged goes now
        if t.pending:
            self.retired.append(t)  # released once its stores are settled
        else:
            self._release(t)

    def _release(self, t: Tracked) -> None:
        if t.chain is not None and t.generation == self.link.generation:
            self._release_match(t.chain, t.generation)
        t.chain = None

    def _release_match(self, match: Any, generation: int | None = None) -> None:
        try:
            self.link.call(lambda c: c.release(match), generation=generation)
        except (Unavailable, DaemonError) as exc:
            log.debug("hicache: release failed: %s", exc)

    def _free(self, pages: torch.Tensor, generation: int) -> None:
        try:
            self.link.call(lambda c: c.free(pages, pages=True), generation=generation)
        except (Unavailable, DaemonError) as exc:
            log.debug("hicache: free failed: %s", exc)

    def _void(self, t: Tracked) -> None:
        """The daemon session changed: the chain and plans of the old one are void (the old
        daemon or session took its pages back); the request's blocks are stored afresh."""
        t.chain, t.chain_len, t.planned = None, 0, 0
        t.pending = deque(s for s in t.pending if s.generation == self.link.generation)
        t.generation, t.pool = self.link.generation, self.link.pool

    def close(self) -> None:
        self.link.close()


RESERVE_PAGES = 64  # pages allocated ahead for stores (at most 1/64 of the pool)
PIN_SHARE = 4  # one request's chain pins at most 1/4 of the pool
NO_PLAN = StepPlan(0)  # a step without copies (never mutated)
PUBLISH_BLOCKS = 8  # generated blocks published together (prompt blocks go at once)
_NO_PAGES = torch.empty(0, dtype=torch.int64)


def _cacheable(request: Any) -> bool:
    """Token ids say all of a prompt's KV (no images, no prompt embeddings)."""
    if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
        return False
    return True


def _scheduled(out: Any) -> list[tuple[str, int]]:
    """(request id, tokens computed before this step) of every request scheduled this step."""
    pairs = [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs]
    cached = out.scheduled_cached_reqs
    pairs.extend(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
    return pairs
