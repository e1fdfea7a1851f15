"""IOWorker: the one thread that talks to the store.

It takes jobs from the control thread (fetches before writes: a waiting request matters more
than a backup), makes the store calls, and puts finished jobs on ``done`` for the control
thread's ``poll``; ``notify`` (if any) wakes that thread. Checksums run on a second thread
(xxhash releases the GIL), one chunk of about ``CHUNK_BYTES`` ahead of or behind the store
call, so computing and checking them overlaps the transfer. The worker reads and writes host
pages only as its job says: pages a job names are held for it by the control thread. It never
lets an exception out: a failure is recorded in the job.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from hicache.l3.breaker import Breaker
from hicache.l3.jobs import Clear, Fetch, Write
from hicache.l3.keys import KeyChain
from hicache.l3.pages import PageSegments, trailer, verify
from hicache.l3.store import L3Store, StoreDown
from hicache.memory import PageSums
from hicache.observe import Forgot, Let, StorageChange, held_pages

log = logging.getLogger("hicache.l3")
FLUSHED = "flushed"  # the error of writes a flush of the store dropped unrun
TICK_S = 1.0  # the store's housekeeping, when the thread is idle this long
CLOSE_WAIT_S = 1.0  # how long close() waits for a store call that runs
CHUNK_BYTES = 128 << 20  # pages per store call: about this many bytes (at most ``batch``)


class IOWorker:
    def __init__(
        self,
        store: L3Store,
        chain: KeyChain,
        pages: PageSegments,
        breaker: Breaker,
        batch: int,
        notify: Callable[[], None] | None = None,
    ):
        self.store, self.chain, self.pages, self.breaker = store, chain, pages, breaker
        self.batch = batch
        self.notify = notify
        self.clears: deque[Clear] = deque()
        self.fetches: deque[Fetch] = deque()
        self.writes: deque[Write] = deque()
        # appended here, popped by the control thread
        self.done: deque[Fetch | Write | Clear] = deque()
        self.cv = threading.Condition()
        self.stopping = False
        self.drain_until = 0.0  # stopping: queued writes still run until then (monotonic)
        self.busy = False
        self.calls = self.call_errors = 0
        self.chunk = max(1, min(batch, CHUNK_BYTES // max(1, pages.page_bytes)))
        # reads: a store that leaves checking to us is read in smaller chunks, so that all but
        # the last chunk's checks overlap the reads after them
        read_bytes = store.read_chunk_bytes or CHUNK_BYTES
        self.read_chunk = max(1, min(self.chunk, read_bytes // max(1, pages.page_bytes)))
        self.page_sums: PageSums | None = None  # host page checksums (verify_pages)
        # what this node's disk holds and lets go, in the order of the calls, for KV events
        # (set once by the control thread: L3Tier.announce; None: not recorded)
        self.storage: deque[StorageChange] | None = None
        self.sums = ThreadPoolExecutor(1, thread_name_prefix="hicache-l3-sum")
        # this node's disk opens (its index recovered) as the thread starts, not at the first
        # lookup: what it holds shows at once; busy until then (drain waits for it)
        self.busy = bool(store.clears)
        self.thread = threading.Thread(target=self._run, name="hicache-l3", daemon=True)
        self.thread.start()

    def submit(self, job: Fetch | Write | Clear) -> None:
        with self.cv:
            if isinstance(job, Fetch):
                self.fetches.append(job)
            elif isinstance(job, Clear):
                self.clears.append(job)
            else:
                self.writes.append(job)
            self.cv.notify()

    def pending(self) -> int:
        return len(self.clears) + len(self.fetches) + len(self.writes) + self.busy

    def close(self, wait_s: float = CLOSE_WAIT_S, drain_s: float = 0.0) -> bool:
        """Stop after the job running now; queued fetches end unrun (error "closing"), and so
        do queued writes, or (``drain_s``) those still queued after ``drain_s``. Returns
        False when a store call still runs after that and ``wait_s`` (a store that hangs): the
        thread is left to the process's exit, holding its views of the host pool (which keeps
        the pool mapped), and the store must not be closed under it."""
        with self.cv:
            self.stopping = True
            self.drain_until = time.monotonic() + drain_s
            queues: tuple[deque, ...] = (self.clears, self.fetches)
            if drain_s <= 0:
                queues += (self.writes,)
            for queue in queues:
                self._end_unrun(queue)
            self.cv.notify()
        self.thread.join(drain_s + wait_s)
        if self.thread.is_alive():
            log.warning("L3: a store call still runs at shutdown; left to the process's exit")
            self.sums.shutdown(wait=False)
            return False
        self.sums.shutdown()
        return True

    # ---- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        if self.busy:  # (the disk: opened now)
            try:
                self.store.exists([])
            except StoreDown as exc:  # (said, and tried again at its first use)
                log.error("third tier %s: not opened (%s); tried again at its first use",
                          self.store.url, exc)  # fmt: skip
            except Exception:  # noqa: BLE001  (a store's bug: logged, the thread lives)
                log.exception("third tier %s: opening failed", self.store.url)
            with self.cv:
                self.busy = False
        while True:
            with self.cv:
                idle = not (self.clears or self.fetches or self.writes or self.stopping)
                tick = idle and not self.cv.wait(TICK_S) and not self.pending()
                if tick:  # (a full second with nothing to do)
                    self.busy = True  # (the store is this thread's while it ticks)
            if idle:
                if tick:
                    self._tick()
                    with self.cv:
                        self.busy = False
                continue
            with self.cv:
                if self.stopping and time.monotonic() >= self.drain_until:
                    self._end_unrun(self.writes)  # (past the drain: what is left ends unrun)
                if self.stopping and not (self.clears or self.fetches or self.writes):
                    return
                job: Fetch | Write | Clear
                if self.clears:
                    job = self.clears.popleft()
                    if not job.evict:  # (a flush: they would write after it)
                        self._end_unrun(self.writes, FLUSHED)
                elif self.fetches:
                    job = self.fetches.popleft()
                else:
                    job = self.writes.popleft()
                self.busy = True
            started = time.perf_counter()
            try:
                if isinstance(job, Clear):
                    self._clear(job)
                elif not self.breaker.allow():
                    job.error = "breaker open"
                elif isinstance(job, Write):
                    self._write(job)
                elif job.stage == "exists":
                    self._exists(job)
                    job.ask_s = time.perf_counter() - started
                    if job.at_once and job.hits:  # (its pages are there: read them now)
                        job.stage = "read"
                        self._get(job)
                else:
                    self._get(job)
            except StoreDown as exc:
                if not isinstance(job, Clear):  # (an operator's retries never open it)
                    self._failed(exc)
                job.error = f"store down: {exc}"
            except Exception as exc:  # a store client's bug: the job fails, the thread lives
                if not isinstance(job, Clear):
                    self._failed(exc)
                job.error = f"{type(exc).__name__}: {exc}"
                log.exception("L3 job failed")
            job.io_s += time.perf_counter() - started
            self._let_go()
            with self.cv:
                self.busy = False
            self.done.append(job)
            if isinstance(job, Clear):
                job.done.set()
            if self.notify is not None:
                try:
                    self.notify()
                except Exception:  # noqa: BLE001  (waking the loop is best effort)
                    log.debug("notify failed", exc_info=True)

    def _tick(self) -> None:
        """The store's idle housekeeping (outside ``cv``: a submit never waits for it; a
        failure is logged, never raised)."""
        try:
            self.store.tick()
        except Exception:  # noqa: BLE001  (a store's bug: logged, the thread lives)
            log.exception("third tier %s: housekeeping failed", self.store.url)

    def _clear(self, job: Clear) -> None:
        if job.evict:
            job.cleared = self.store.evict(job.evict)  # (what it let go: _let_go, as always)
            return
        try:
            job.cleared = self.store.clear()
        except OSError as exc:  # (the drive's error: nothing was forgotten)
            job.error = str(exc)
            log.warning("third tier %s: the flush failed (%s)", self.store.url, exc)
            return
        self.store.dropped()  # (what it let go before: all of it is gone now)
        if self.storage is not None:
            self.storage.append(Forgot())

    def _let_go(self) -> None:
        """Take what the store let go in the calls so far (recorded for KV events)."""
        try:
            gone = self.store.dropped()
        except Exception:  # noqa: BLE001  (a store's bug: logged, the thread lives)
            log.exception("third tier %s: dropped() failed", self.store.url)
            return
        if gone and self.storage is not None:
            self.storage.append(Let(gone))

    def _held(self, job: Fetch | Write, names: list[str], at: list[int]) -> None:
        """Record that this node's disk holds pages ``job.first + i`` (``i`` in ``at``; their
        keys ``names[i]``), where it does (for KV events)."""
        if self.storage is None or not at:
            return
        local = self.store.local([names[i] for i in at])
        at = [i for i, here in zip(at, local, strict=True) if here]
        if at:
            ps = self.chain.page_bytes // 4
            keys = [names[i] for i in at]
            self.storage.append(held_pages(job.key, job.namespace, job.first, at, keys, ps))

    def _end_unrun(self, queue: deque, why: str = "closing") -> None:
        """Every job of ``queue`` done with error ``why`` (under ``cv``)."""
        while queue:
            job = queue.popleft()
            job.error = why
            self.done.append(job)
            if isinstance(job, Clear):
                job.done.set()

    def _failed(self, exc: BaseException) -> None:
        """A job failed as a whole: the breaker counts it; its opening is logged."""
        opened = self.breaker.opened
        self.breaker.failure()
        if self.breaker.opened > opened:
            log.warning(
                "third tier %s failing (%s): not asked for %.0f s, then probed (lookups and "
                "writes are misses meanwhile)",
                self.store.url,
                exc,
                self.breaker.cooldown,
            )

    def _call(self, fn: Callable, *args: object) -> list:
        self.calls += 1
        try:
            out = fn(*args)
        except StoreDown:
            self.call_errors += 1
            raise
        if self.breaker.open_until:
            log.warning("third tier %s answers again", self.store.url)
        self.breaker.success()
        return out

    def _digests(self, job: Fetch | Write, end: int) -> list[bytes]:
        """Digests of chain pages [0, end) of the job's key."""
        return self.chain.extend(
            self.chain.root(job.namespace), job.key[: end * self.chain.page_bytes]
        )

    def _trailers(self, pages: list[int], digests: list[bytes]) -> list[bytes]:
        return [trailer(self.pages.views(p), d) for p, d in zip(pages, digests, strict=True)]

    def _write(self, job: Write) -> None:
        """Put the pages the store lacks, chunk after chunk; the next chunk's checksums are
        computed while this one is put."""
        pages = job.pages.tolist()
        if self.page_sums is not None:  # host pages that changed since written stop the write
            bad = self.page_sums.bad(job.pages)
            if len(bad):
                job.corrupt = len(bad)
                pages = pages[: pages.index(int(bad[0]))]  # the run before the first bad page
        chain = self._digests(job, job.first + len(pages))
        digests = chain[job.first :]
        names = [KeyChain.name(d) for d in digests]
        parents = self._parents(chain, job.first, len(names))
        todo: list[int] = []  # indices of the pages the store lacks
        for at in range(0, len(names), self.batch):
            have = self._call(self.store.exists, names[at : at + self.batch])
            todo += [at + i for i, h in enumerate(have) if not h]
        job.present += len(names) - len(todo)
        lacking = set(todo)
        self._held(job, names, [i for i in range(len(names)) if i not in lacking])
        first_parent = parents[0] if parents and todo[:1] == [0] else None
        if first_parent is not None and not self._call(self.store.exists, [first_parent])[0]:
            job.no_prefix = True  # (the store lost a prefix the tier took as stored)
            job.failed += len(todo)
            return
        chunks = [todo[at : at + self.chunk] for at in range(0, len(todo), self.chunk)]

        def sums(chunk: list[int]) -> Future:
            return self.sums.submit(
                self._trailers, [pages[i] for i in chunk], [digests[i] for i in chunk]
            )

        ahead = sums(chunks[0]) if chunks else None
        for n, chunk in enumerate(chunks):
            assert ahead is not None  # (set for every chunk)
            tails = ahead.result()
            ahead = sums(chunks[n + 1]) if n + 1 < len(chunks) else None
            keys = [names[i] for i in chunk]
            up = [parents[i] for i in chunk] if parents else None
            ok = self._call(self.store.put, keys, [pages[i] for i in chunk], tails, up)
            job.stored += sum(ok)
            job.failed += len(ok) - sum(ok)
            self._let_go()  # (what the puts evicted went before they landed)
            self._held(job, names, [i for i, put in zip(chunk, ok, strict=True) if put])

    def _parents(self, chain: list[bytes], first: int, count: int) -> list[str | None]:
        """Each page's chain parent's key, for pages [first, first + count) of ``chain``
        (digests from the root), where the store ``keeps_prefixes``; else []."""
        if not self.store.keeps_prefixes:
            return []
        return [KeyChain.name(chain[i - 1]) if i else None for i in range(first, first + count)]

    def _exists(self, job: Fetch) -> None:
        job.digests = self._digests(job, job.first + job.want)
        names = [KeyChain.name(d) for d in job.digests[job.first :]]
        for at in range(0, len(names), self.batch):
            have = self._call(self.store.exists, names[at : at + self.batch])
            run = next((i for i, h in enumerate(have) if not h), len(have))
            job.hits += run
            if run < len(have):
                return

    def _check(self, pages: list[int], digests: list[bytes], tails: list) -> tuple[int, bool]:
        """Leading pages that arrived and verify, and whether a value failed to verify (a
        store that checked a value itself returned its verdict instead of the trailer)."""
        for n, (page, digest, tail) in enumerate(zip(pages, digests, tails, strict=True)):
            if tail is None:
                return n, False
            if tail is True:
                continue
            if tail is False or not verify(self.pages.views(page), digest, tail):
                return n, True
        return len(pages), False

    def _get(self, job: Fetch) -> None:
        """Chunk after chunk; a chunk's values are verified while the next one is read (or as
        each arrives, by a store that checks them itself), and the fetch keeps the leading run
        of pages that arrived and verified."""
        assert job.pages is not None and job.hits <= len(job.pages)
        ds = job.digests[job.first : job.first + job.hits]  # (at_once: fewer than its pages)
        names = [KeyChain.name(d) for d in ds]
        parents = self._parents(job.digests, job.first, len(names))
        pages = job.pages[: job.hits].tolist()
        checks: list[tuple[int, Future]] = []
        try:
            for at in range(0, len(names), self.read_chunk):
                part = slice(at, at + self.read_chunk)
                mine = ds[part]
                hot = lambda i, data, tail, mine=mine: verify([data], mine[i], tail)  # noqa: E731
                up = parents[part] if parents else None
                tails = self._call(self.store.get, names[part], pages[part], hot, up)
                check = self.sums.submit(self._check, pages[part], ds[part], tails)
                checks.append((len(tails), check))
                if any(t is None or t is False for t in tails):
                    break  # the run ends in this chunk
        finally:
            for size, check in checks:  # every check ends before the job does
                good, corrupt = check.result()
                job.arrived += good
                job.corrupt += corrupt
                if good < size:
                    break
            for _, check in checks:
                check.result()  # (those after the end of the run too)
        if job.corrupt:  # the bad value goes, so that the next write of the page puts it again
            self.store.remove([names[job.arrived]])
        self._let_go()
        self._held(job, names, list(range(job.arrived)))
