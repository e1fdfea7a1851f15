"""L3Tier: the store under a pool of the cache, as the cache's control thread sees it.

Composed into HiRadixCache (``cache.l3``; it sees the cache as an ``L3Host``: cache_view.py);
every method runs on the cache's one thread. The IO thread (``worker.py``) makes the store
calls. The tier sits under the host pool, or under
the cache's one pool when it has no host tier (``sides.py``: engines that own their device
tier); "the side" below is that pool. What it changes in the cache:

- ``node.l3``: None (not known to be in the store), True (stored, or came from it) or the
  ``Write`` putting it now. A node whose write runs keeps its pages on the side readable: if
  the tree gives them up (eviction), the write holds them and frees them when it ends.
- Writes (``offer``): a node and its not-yet-stored ancestors that have pages on the side, in
  prefix order, once their pages there are complete (write_through: a backup's ack on the host
  side, an insert on the only pool), once hit often enough or computed again after they left
  the side unreused (selective, adaptive: ``admission.py``; adaptive also writes every page
  at first sight while such pages come back) or when the side evicts them (write_back). A
  bounded queue: past ``queue_pages`` a write is dropped.
- Fetches (``prefetch``): the part of a prefix beyond what the tree holds; the store's leading
  run of hits gets pages on the side (OWNED by the fetch: allocated once hits are known, or,
  from a store that ``reads_at_once``, set aside from free pages before it is asked and given
  back past its hits), is read, verified, and becomes a leaf (host-only, or an ordinary
  unlocked leaf of the only pool). A value that does not verify ends the run: wrong KV is
  never inserted. The cost model skips a fetch that would be slower than recomputing.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache.l3.admission import ReuseAdmission
from hicache.l3.breaker import Breaker
from hicache.l3.config import WRITE_BACK_NEEDS_HOST, L3Config, L3WritePolicy
from hicache.l3.counters import L3Counters, ewma, keys_above, tokens_above
from hicache.l3.jobs import Clear, Fetch, Write
from hicache.l3.keys import KeyChain, identity_of
from hicache.l3.pages import PageSegments
from hicache.l3.sides import side_of
from hicache.l3.store import L3Store
from hicache.l3.worker import FLUSHED, IOWorker
from hicache.memory import PageState
from hicache.observe import page_hashes

if TYPE_CHECKING:
    from hicache.cache_view import L3Host
    from hicache.observe import StorageChange, TierEvents
    from hicache.tree import TreeNode

log = logging.getLogger("hicache.l3")
MISS_TTL_S = 1.0  # a prefix the store did not have is not asked for again this soon


class L3Tier:
    def __init__(
        self,
        cache: L3Host,
        config: L3Config,
        store: L3Store,
        notify: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        layout: dict[str, Any] | None = None,  # engines' layout identity (device_tier=engine)
    ):
        self.side = side_of(cache)  # the pool the store sits under (ValueError: none fits)
        if self.side.name == "only" and config.write_policy is L3WritePolicy.WRITE_BACK:
            raise ValueError(WRITE_BACK_NEEDS_HOST)
        self.cache, self.config, self.store, self.clock = cache, config, store, clock
        self.page_size = cache.page_size
        self.pages = PageSegments(self.side.pool)
        store.attach(self.pages)
        under_host = self.side.name == "host"
        identity = identity_of(cache.config, config.model, config.shard, layout, under_host)
        self.chain = KeyChain(identity, cache.page_size)
        self.breaker = Breaker(config.breaker_failures, config.breaker_cooldown_s)
        self.io = IOWorker(store, self.chain, self.pages, self.breaker, config.batch_pages, notify)
        sums = under_host and cache.engine is not None
        self.io.page_sums = cache.engine.sums if sums else None
        self.writes: set[Write] = set()
        self.fetches: dict[tuple[Any, bytes], Fetch] = {}
        self.misses: dict[tuple[Any, bytes], float] = {}  # prefixes the store lacked, until
        self.queued_pages = 0
        self.counters = L3Counters()
        self.read_bps = 0.0  # measured store read throughput (bytes/s, EWMA; 0: unknown)
        self.write_bps = 0.0
        self.rtt_s = 0.0  # measured time of an exists call
        self.through = config.write_policy is L3WritePolicy.WRITE_THROUGH
        adaptive = config.write_policy is L3WritePolicy.WRITE_THROUGH_ADAPTIVE
        self.selective = adaptive or config.write_policy is L3WritePolicy.WRITE_THROUGH_SELECTIVE
        self.write_back = config.write_policy is L3WritePolicy.WRITE_BACK
        self.stopping = False  # close: offers go past the queue's bound (the drain bounds them)
        # selective, adaptive: which pages earned their write beyond hits while cached
        self.admission = ReuseAdmission(adaptive)

    def announce(self, events: TierEvents) -> None:
        """Tell ``events`` (on STORAGE) what this node's disk holds from now on: the IO thread
        records the disk's changes for it. Other stores hold nothing of this node's."""
        if self.store.keeps_prefixes and self.io.storage is None:
            changes: deque[StorageChange] = deque()
            events.storage.follow(changes)
            self.io.storage = changes

    # ---- writes -------------------------------------------------------------------------------
    def after_backup(self, nodes: list[TreeNode]) -> None:
        """Their pages on the side are now complete (a backup's ack; an insert into the only
        pool)."""
        if self.through:
            for node in nodes:
                self.offer(node)
        elif self.selective:
            admission = self.admission
            for node in nodes:  # (a page that came back counts so, whatever earns its write)
                back = bool(admission.seen) and admission.back(self._page_names(node).tolist())
                if back or admission.first_sight or node.hit_count >= self.config.write_threshold:
                    self.offer(node)

    def after_hit(self, path: list[TreeNode]) -> None:
        """write_through_selective and _adaptive: a match went through ``path``."""
        pages = self.side.pages
        for node in path:
            if node.l3 is None and pages(node) is not None:
                if node.hit_count >= self.config.write_threshold:
                    self.offer(node)

    def offer(self, node: TreeNode) -> None:
        """Write ``node`` and its ancestors with pages on the side not yet in the store,
        prefix first; only pages that hold their KV (``side.ready``: not while a backup still
        copies into them). An ancestor not ready yet puts the write off (a page is written
        only with its prefix): its own ack offers it, and a later offer the rest."""
        on_side, ready = self.side.pages, self.side.ready
        if node.l3 is not None or not ready(node) or node.parent is None:
            return
        run = [node]
        up = node.parent
        while up.parent is not None and up.l3 is None and on_side(up) is not None:
            if not ready(up):
                return
            run.append(up)
            up = up.parent
        run.reverse()
        pages = np.concatenate([on_side(n) for n in run])
        if self.queued_pages + len(pages) > self.config.queue_pages and not self.stopping:
            self.counters.dropped_pages += len(pages)
            return
        before = tokens_above(run[0])
        key = b"".join([*keys_above(run[0]), *(n.key for n in run)])
        job = Write(key, node.namespace, before // self.page_size, pages, run)
        for n in run:
            n.l3 = job
        self._submit_write(job)

    def evicting(self, node: TreeNode, to_l3: bool = True) -> bool:
        """The side evicts leaf ``node`` (its last copy there). True: the tier took its pages
        (a write-back, or a write still reading them): the caller must not free them.
        ``to_l3=False`` (a flush): no write-back."""
        job = node.l3
        pages = self.side.pages(node)
        assert pages is not None  # (it leaves the side: it has pages there)
        unreused = node.hit_count < self.config.write_threshold
        if self.selective and to_l3 and (unreused or job is None):  # (unwritten: a dropped write)
            self.admission.left(self._page_names(node).tolist(), count=unreused)
        if isinstance(job, Write):
            job.held.append(pages)
            return True
        if not (self.write_back and to_l3) or job is True:
            return False
        if self.queued_pages + len(pages) > self.config.queue_pages:
            self.counters.dropped_pages += len(pages)
            return False
        key = b"".join([*keys_above(node), node.key])
        before = tokens_above(node)
        write = Write(key, node.namespace, before // self.page_size, pages, [], [pages], True)
        self.counters.write_back_pages += len(pages)
        self._submit_write(write)
        return True

    def _page_names(self, node: TreeNode) -> np.ndarray:
        """``node``'s pages' names: chained over every token before them and the namespace."""
        key = b"".join([*keys_above(node), node.key])
        names = page_hashes(
            np.frombuffer(key, np.int32), self.page_size, repr(node.namespace).encode()
        )
        return names[len(names) - node.num_tokens // self.page_size :]

    def _admitted(self, node: TreeNode) -> bool:
        """selective, adaptive: whether ``node``'s pages earned their write (hit while cached,
        left the side unreused before, or any page now: adaptive's first sight)."""
        admission = self.admission
        if node.hit_count >= self.config.write_threshold or admission.first_sight:
            return True
        return bool(admission.seen) and admission.seen_any(self._page_names(node).tolist())

    def _offer_admitted(self) -> None:
        """At a stop: offer every node whose pages on the side the policy admits (write_back:
        all of them, as the side is about to be lost) and that is not written (a write the
        queue dropped; under write_back, every one)."""
        if self.config.write_policy is L3WritePolicy.NONE:
            return
        self.stopping = True  # (offer: no queue bound now)
        on_side = self.side.pages
        for node in list(self.cache.tree.iter_nodes()):
            if node.l3 is not None or node.parent is None or on_side(node) is None:
                continue
            if self.selective and not self._admitted(node):
                continue
            self.offer(node)

    def _submit_write(self, job: Write) -> None:
        self.writes.add(job)
        self.queued_pages += len(job.pages)
        self.io.submit(job)

    def _write_done(self, job: Write) -> None:
        self.writes.discard(job)
        self.queued_pages -= len(job.pages)
        c = self.counters
        if job.error and job.error != FLUSHED:  # (a flush dropped it: no failure)
            c.errors += 1
        c.written_pages += job.stored
        c.present_pages += job.present
        c.written_bytes += job.stored * self.pages.page_bytes
        c.failed_write_pages += job.failed + (len(job.pages) if job.error else 0)
        if job.stored and job.io_s > 0:
            self.write_bps = ewma(self.write_bps, job.stored * self.pages.page_bytes / job.io_s)
        ok = not job.error and not job.failed
        if job.stored and self.misses:  # what this daemon lacked a moment ago may be there now
            self.misses = {k: t for k, t in self.misses.items() if k[0] != job.namespace}
        for node in job.nodes:
            if node.l3 is job:
                node.l3 = True if ok else None
        if job.no_prefix:  # the store let a prefix go: its next offer writes it again
            c.no_prefix_writes += 1
            for node in job.nodes:
                up = node.parent
                while up is not None and up.l3 is True:
                    up.l3 = None
                    up = up.parent
        for pages in job.held:
            self.side.alloc.release(pages)

    # ---- fetches --------------------------------------------------------------------------------
    def prefetch(self, key: bytes, namespace: Any, covered: int) -> Fetch | None:
        """Start bringing the pages of ``key`` (int32 bytes) beyond ``covered`` tokens (what
        the tree holds) from the store. The fetch, or None when there is nothing to ask for
        (too short, asked for already, the store lacked it a moment ago, the breaker is open)."""
        pb = self.chain.page_bytes
        aligned = len(key) // pb
        first = covered // self.page_size
        want = aligned - first
        if want <= 0 or want * self.page_size < self.config.min_tokens:
            return None
        k = (namespace, bytes(key[: aligned * pb]))
        fetch = self.fetches.get(k)
        if fetch is not None:
            return fetch
        now = self.clock()
        if self.misses.get(k, 0.0) > now:
            return None
        if not self.breaker.allow():
            self.counters.skipped_breaker += 1
            return None
        bound = self.config.wait_bound(want * self.page_size)
        fetch = Fetch(k[1], namespace, first, want, now, now + bound)
        if self.store.reads_at_once and not self.config.prefill_tokens_per_s:
            # (no cost model to consult between the stages) pages for all it wants, from free
            # pages while the lookups in flight hold at most half of them (with theirs):
            # nothing is evicted for a miss, and other allocations keep the other half
            aside = sum(len(f.pages) for f in self.fetches.values() if f.pages is not None)
            if self.side.alloc.free_pages >= 2 * want + aside:
                fetch.pages = self.side.room(want)
                fetch.at_once = fetch.pages is not None
        self.fetches[k] = fetch
        self.counters.lookups += 1
        self.counters.lookup_pages += want
        self.io.submit(fetch)
        return fetch

    def _fetch_step(self, fetch: Fetch) -> None:
        """A fetch's IO stage ended: go on or finish (``read``: asked and read in one turn)."""
        c = self.counters
        if fetch.stage in ("exists", "read"):  # (the store said it: counted, read or not)
            c.hit_pages += fetch.hits
            if fetch.ask_s:
                self.rtt_s = ewma(self.rtt_s, fetch.ask_s)
        if fetch.error:
            c.errors += 1
            self._end_fetch(fetch)
            return
        if fetch.stage == "exists":  # (at_once: a miss, asked only)
            if not fetch.hits:
                self.misses[(fetch.namespace, fetch.key)] = self.clock() + MISS_TTL_S
                self._end_fetch(fetch)
            elif self._too_slow(fetch.hits):
                fetch.skipped = "cost"
                c.skipped_cost += 1
                self._end_fetch(fetch)
            else:
                pages = self.side.room(fetch.hits)
                if pages is None:  # even eviction made too little room: the leading ones
                    have = self.side.alloc.free_pages
                    pages = self.side.alloc.alloc_pages(have, PageState.OWNED) if have else None
                if pages is None:
                    fetch.skipped = "no_room"
                    c.skipped_room += 1
                    self._end_fetch(fetch)
                    return
                fetch.hits = len(pages)  # (fewer when the side could not make room for all)
                fetch.pages, fetch.stage = pages, "get"
                self.io.submit(fetch)
            return
        c.read_pages += fetch.arrived
        c.read_bytes += fetch.arrived * self.pages.page_bytes
        c.corrupt_pages += fetch.corrupt
        if fetch.corrupt:  # not asked for again at once (the bad value was removed)
            self.misses[(fetch.namespace, fetch.key)] = self.clock() + MISS_TTL_S
        read_s = fetch.io_s - fetch.ask_s  # (the reads' own time, the asking apart)
        if fetch.arrived and read_s > 0:
            self.read_bps = ewma(self.read_bps, fetch.arrived * self.pages.page_bytes / read_s)
        self._adopt(fetch)
        self._end_fetch(fetch)

    def _too_slow(self, pages: int) -> bool:
        """Whether reading ``pages`` from the store takes longer than recomputing them."""
        rate = self.config.prefill_tokens_per_s
        if not rate or not self.read_bps:  # no model, or nothing measured yet: try
            return False
        load_s = pages * self.pages.page_bytes / self.read_bps + self.rtt_s
        return load_s > pages * self.page_size / rate

    def _adopt(self, fetch: Fetch) -> None:
        """The verified leading pages become a leaf on the side where the tree ends now (it may
        have changed since the fetch began); pages the tree holds by now, or that no longer
        join the tree, are freed."""
        pages = fetch.pages
        assert pages is not None
        cache, tree, pb = self.cache, self.cache.tree, self.chain.page_bytes
        m = fetch.arrived
        fetch.pages = None
        keep: tuple[int, int] | None = None
        if m:
            end = (fetch.first + m) * pb
            root = tree.root(fetch.namespace, create=True)
            path, covered = tree.walk(root, fetch.key[:end])
            have = covered // pb  # pages the tree holds now
            if fetch.first <= have < fetch.first + m:
                start = have - fetch.first
                parent = path[-1] if path else root
                leaf = self.side.add_leaf(parent, fetch.key[covered:end], pages[start:m])
                leaf.l3 = True
                keep = start, m
                fetch.adopted = m - start
                self.counters.adopted_pages += fetch.adopted
                if self.admission.seen:  # (pages that left unreused may be back now)
                    self.admission.back(self._page_names(leaf).tolist())
            elif not path:
                cache.tree.drop_if_empty(root)
        if keep:
            start, stop = keep
            rest = np.concatenate([pages[:start], pages[stop:]])
        else:
            rest = pages
        if len(rest):
            self.side.alloc.release(rest)

    def _end_fetch(self, fetch: Fetch) -> None:
        if fetch.pages is not None:  # (ended before its pages were used)
            self.side.alloc.release(fetch.pages)
            fetch.pages = None
        if fetch.skipped:  # not asked for again at once: it would end the same (a store
            # error is not remembered: the breaker decides when the store is asked again)
            self.misses[(fetch.namespace, fetch.key)] = self.clock() + MISS_TTL_S
        fetch.done = True
        fetch.stage = "done"
        self.fetches.pop((fetch.namespace, fetch.key), None)

    # ---- an operator's flush ----------------------------------------------------------------
    def clear_store(self, wait_s: float, evict: int = 0) -> Clear:
        """Have the IO thread make the store forget everything (a store that ``clears``: the
        disk), ahead of queued jobs, dropping the writes still queued; waits up to ``wait_s``
        for it (then it is still queued,
        ``done`` unset, and applied by a later ``poll``). Once it ran, no node is taken as
        stored any more (``l3`` True -> None: written again at its next offer). ``evict``:
        only that many least recently used pages go, and queued writes stay (a node the tree
        still takes as stored is written again once a write finds its prefix gone)."""
        job = Clear(evict)
        self.io.submit(job)
        job.done.wait(wait_s)
        self.poll()
        return job

    def _clear_done(self, job: Clear) -> None:
        if job.error or job.evict:
            return
        for node in self.cache.tree.iter_nodes():
            if node.l3 is True:
                node.l3 = None
        self.misses.clear()

    # ---- the control thread's turn ------------------------------------------------------------
    def poll(self) -> list[Fetch]:
        """Apply what the IO thread finished; returns the fetches that ended. Call it between
        cache operations only, never from inside one (a fetch evicts and inserts): the cache's
        own ``poll`` (which runs inside allocations) does not call it."""
        ended = []
        done = self.io.done
        while done:
            job = done.popleft()
            if isinstance(job, Write):
                self._write_done(job)
            elif isinstance(job, Clear):
                self._clear_done(job)
            else:
                self._fetch_step(job)
                if job.done:
                    ended.append(job)
        if len(self.misses) > 4096:
            now = self.clock()
            self.misses = {k: t for k, t in self.misses.items() if t > now}
        return ended

    def collect_writes(self) -> bool:
        """Apply the writes the IO thread finished (never waits; fetches stay queued): safe
        inside a cache operation, it only frees pages writes held. Returns whether any were."""
        done = self.io.done
        ended = [job for job in list(done) if isinstance(job, Write)]
        freed = False
        for job in ended:
            done.remove(job)
            freed |= bool(job.held)
            self._write_done(job)
        return freed

    def wait(self, fetch: Fetch, timeout: float | None = None) -> bool:
        """Block until ``fetch`` ended (tests and single-threaded users; the daemon defers
        replies instead). Returns whether it did."""
        deadline = None if timeout is None else self.clock() + timeout
        while not fetch.done:
            if deadline is not None and self.clock() >= deadline:
                return False
            self.poll()
            if not fetch.done:
                time.sleep(0.0005)
        return True

    def drain(self) -> None:
        """Wait until no job is queued or running, and apply them all."""
        while self.writes or self.fetches or self.io.pending() or self.io.done:
            self.poll()
            time.sleep(0.0005)

    # ---- checks and figures ---------------------------------------------------------------------
    def held_pages(self) -> list[np.ndarray]:
        """Pages of the side in the TREE state that writes hold after the tree gave them up."""
        return [p for job in self.writes for p in job.held]

    def owned_by_fetches(self, tier: str) -> int:
        """OWNED pages of the cache's ``tier`` pool (``device``, ``host``) that fetches hold
        (a daemon's sessions own the rest of an engine-tier daemon's one pool)."""
        if tier != ("device" if self.side.sessions_own_pages else "host"):
            return 0
        return sum(len(f.pages) for f in self.fetches.values() if f.pages is not None)

    def check(self, nodes: list[TreeNode]) -> list[str]:
        """Invariants of the tier's state in the cache (messages of those broken)."""
        bad = []
        for node in nodes:
            job = node.l3
            if job is None or job is True:
                continue
            if not isinstance(job, Write) or job not in self.writes or node not in job.nodes:
                bad.append(f"{node}: l3={job!r} is not a live write listing it")
        held = [f.pages for f in self.fetches.values() if f.pages is not None]
        owned = sum(map(len, held))
        state = self.side.alloc.state
        if held and (state[np.concatenate(held)] != PageState.OWNED).any():
            bad.append(f"{self.side.name}: a page a fetch holds is not OWNED")
        count = self.side.alloc.count(PageState.OWNED)
        if count != owned and not (self.side.sessions_own_pages and count > owned):
            bad.append(f"{self.side.name}: {count} OWNED pages, fetches hold {owned}")
        if self.queued_pages != sum(len(j.pages) for j in self.writes):
            bad.append("l3: queued_pages does not match the writes in flight")
        return bad

    def stats(self) -> dict[str, Any]:
        return {
            "url": self.store.url,
            "write_policy": str(self.config.write_policy),
            "prefetch_policy": str(self.config.prefetch_policy),
            "breaker": self.breaker.state,
            "breaker_opened": self.breaker.opened,
            "queued_pages": self.queued_pages,
            "held_pages": sum(map(len, self.held_pages())),  # evicted, freed when written
            "fetches_in_flight": len(self.fetches),
            "read_bytes_per_s": round(self.read_bps),
            "write_bytes_per_s": round(self.write_bps),
            "exists_rtt_ms": round(self.rtt_s * 1e3, 3),
            "store_calls": self.io.calls,
            "store_call_errors": self.io.call_errors,
            **asdict(self.counters),
            # selective, adaptive: pages that left the side unreused, and of those came back
            "let_go_pages": self.admission.let_go_pages,
            "came_back_pages": self.admission.came_back_pages,
            "first_sight": self.admission.first_sight,  # adaptive: every page written now
            **{f"store_{k}": v for k, v in self.store.describe().items()},
        }

    def close(self) -> None:
        """Stop the IO thread (queued jobs end unrun, a running store call gets a second) and
        the store; frees what jobs held. Never waits longer on a store that hangs. With
        ``close_drain_s`` (a disk), first every page on the side that the write policy admits
        and the store lacks is offered (past the queue's bound: the drain's time bounds it),
        and the queued writes run for up to ``close_drain_s``."""
        if self.config.close_drain_s > 0 and self.breaker.allow():
            self._offer_admitted()
        stopped = self.io.close(drain_s=self.config.close_drain_s)
        self.poll()
        if not stopped:
            return  # (its job's pages and the store stay with the thread until the exit)
        for fetch in list(self.fetches.values()):
            self._end_fetch(fetch)
        self.store.close()
