"""Random interleavings on a cache whose third tier is a small disk (``hicache.disk``, opened as
a daemon opens it): prompts computed, served, evicted, fetched back from the disk, the daemon
restarted cold on the same folder, the drive failing reads or writes, slot files corrupted
underneath, the disk flushed. After every step: ``check_integrity()`` on the cache, the
disk's own invariants (``SlotStore.check``: every slot held or free once, every held parent
more recent than its children), what the disk holds closed under prefixes (a page only with
the page before it), the write budget never exceeded, and every token served holding exactly
the KV computed for its prefix (a torn, flipped or lost slot is a miss, never wrong bytes).
KV events, replayed as a router would: what they say is on STORAGE is held by the disk (all of
it, until a restart: an earlier daemon's pages are announced once read or offered again), each
block under its store key's hash, and the tree's tiers are what the tree holds.
Page sizes 1, 4 and 16; admission ``all``, ``reused`` (which turns to writing at first sight
and back as pages come back or not) and ``reused-strict``; under a host pool and under the
one pool of an engine-tier daemon."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
import time

import numpy as np
import xxhash
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hicache.l3 import LazyStore
from hicache.l3.config import L3Config
from hicache.l3.keys import KeyChain
from hicache.l3.tier import MISS_TTL_S, L3Tier
from hicache.observe import TierEvents
from tests.conftest import make_cache, settle
from tests.event_model import TierModel, tree_blocks
from tests.reference import expected_kv, read_kv, write_kv

SLOTS = 24  # the disk's pages (8 KiB slots: these pages are small)
BUDGET_SLOTS = 30  # the write budget, in slots per day: reached in the longer runs


class DiskMachine(RuleBasedStateMachine):
    page_size = 4
    admission = "reused"
    host_tokens = 14  # pages of the host pool (0: the store sits under the one pool)
    seen = dict.fromkeys(
        "written from_disk restarts refused_budget bad on_storage off_storage first_sight".split(),
        0,
    )

    def __init__(self) -> None:
        super().__init__()
        ps = self.page_size
        rng = np.random.default_rng(ps)
        base = rng.integers(1, 50, 8 * ps)
        self.seqs = [
            np.concatenate([base[: cut * ps], rng.integers(1, 50, 4 * ps)]).astype(np.int32)
            for cut in (0, 2, 4, 6, 8)
        ]  # prompts sharing prefixes of 0 to 8 pages
        self.folder = tempfile.mkdtemp(prefix="hicache-disk-stateful-", dir=os.getcwd())
        self.skew = 0.0
        self.error: dict[str, int] = {}  # the drive's injected errors, by op
        self.cache = self._open()

    # ---- the daemon -------------------------------------------------------------------------
    def _open(self):
        ps = self.page_size
        cache = make_cache(
            manual=False, page_size=ps, num_kv_heads=2, head_dim=2, device_tokens=10 * ps,
            host_tokens=self.host_tokens * ps, load_back_threshold=0,
        )  # fmt: skip
        policy = {
            "all": "write_through",
            "reused": "write_through_adaptive",
            "reused-strict": "write_through_selective",
        }[self.admission]
        url = f"disk://{self.folder}?bytes={SLOTS * 8192}&budget={BUDGET_SLOTS * 8192}"
        self.lazy = LazyStore(url)
        cfg = L3Config(url, "m", write_policy=policy, write_threshold=2, close_drain_s=10.0)
        cache.attach_l3(L3Tier(cache, cfg, self.lazy, clock=self.clock))
        cache.l3.admission.min_pages = 4  # (these runs are short: first sight turns on)
        cache.l3.drain()  # (its IO thread opens the disk as it starts)
        self.lazy.inner.slots.files.fault = self._fault
        self.router = TierModel()  # a router's view, from this daemon's events
        self.life_writes = False  # a restart since: the disk may hold pages not announced
        self.read_back: set[str] = set()  # keys of pages this daemon read from the disk
        cache.attach_events(TierEvents(ps, "GPU" if self.host_tokens else "CPU"))
        return cache

    def _hashes(self) -> dict[str, int]:
        """Every page's store key -> its block hash, for the prompts of this test."""
        ps, out = self.page_size, {}
        chain = self.cache.l3.chain
        seed = xxhash.xxh3_64_intdigest(b"hicache-block-v1" + repr(None).encode())
        for seq in self.seqs:
            names = [KeyChain.name(d) for d in chain.extend(chain.root(None), seq.tobytes())]
            h = seed
            for i, name in enumerate(names):
                h = xxhash.xxh3_64_intdigest(seq[i * ps : (i + 1) * ps].tobytes(), seed=h)
                out[name] = h
        return out

    def _fault(self, op: str, slot: int) -> None:
        code = self.error.get(op)
        if code:
            raise OSError(code, os.strerror(code))

    def clock(self) -> float:
        return time.monotonic() + self.skew

    @property
    def disk(self):
        return self.lazy.inner.slots

    def _count(self) -> None:
        c, f = self.cache.l3.counters, self.disk.figures()
        self.seen["written"] += c.written_pages
        self.seen["from_disk"] += c.adopted_pages
        self.seen["refused_budget"] += f["disk_budget_refused_writes"]
        self.seen["bad"] += f["disk_bad_slots"] + c.corrupt_pages
        self.seen["first_sight"] += self.cache.l3.admission.first_sight

    # ---- rules ------------------------------------------------------------------------------
    @rule(s=st.integers(0, 4), pages=st.integers(1, 12))
    def compute(self, s: int, pages: int) -> None:
        """An engine computes a prompt's first pages (and a bit of the next) and inserts them."""
        tokens = self.seqs[s][: pages * self.page_size + 1]
        slots = self.cache.alloc(len(tokens))
        if slots is None:
            return
        write_kv(self.cache.device_pool, slots, tokens, 0, tokens)
        self.cache.insert(tokens, slots)

    @rule(s=st.integers(0, 4))
    def serve(self, s: int) -> None:
        """Match (the disk fetched for what the pools lack), load, check every device token."""
        cache, tokens = self.cache, self.seqs[s]
        hit = cache.match_prefix(tokens)
        f = cache.l3.prefetch(tokens.tobytes(), None, hit.device_hit_length + hit.host_hit_length)
        if f is not None:
            assert cache.l3.wait(f, timeout=120)
            got = f.digests[f.first : f.first + f.arrived]
            self.read_back |= {KeyChain.name(d) for d in got}
        hit = cache.match_prefix(tokens)
        if hit.host_hit_length:
            cache.load_back(hit.last_host_node)
            settle(cache)
            hit = cache.match_prefix(tokens)
        n = hit.device_hit_length
        got = read_kv(cache.device_pool, hit.device_indices)
        assert bool((got == expected_kv(tokens[:n], 2, 2)).all()), "wrong KV served"

    @rule(device=st.integers(0, 64), host=st.integers(0, 64))
    def evict(self, device: int, host: int) -> None:
        self.cache.evict(device)
        if self.host_tokens:
            self.cache.evict_host(host)

    @rule()
    def settle(self) -> None:
        settle(self.cache)
        self.cache.l3.drain()

    @rule(how=st.sampled_from(["stop", "crash", "lost"]))
    def restart_cold(self, how: str) -> None:
        """The daemon stops (its queued writes land; its index is checkpointed) and starts
        again without its pools; or it crashed with nothing queued (its folder as a SIGKILL
        leaves it: the next start replays the journal, to the index it had); or its
        checkpoint was lost (the next start scans)."""
        self.cache.l3.drain()
        self._count()
        had = self.disk.held()
        left = {
            name: open(os.path.join(self.folder, name), "rb").read()
            for name in os.listdir(self.folder)
            if name != "lock"
        }
        self.cache.close()
        if how == "crash":  # (the files as the killed process left them)
            for name in set(os.listdir(self.folder)) - set(left) - {"lock"}:
                os.unlink(os.path.join(self.folder, name))
            for name, data in left.items():
                with open(os.path.join(self.folder, name), "wb") as fh:
                    fh.write(data)
        if how == "lost":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.folder, "index"))
        self.seen["restarts"] += 1
        self.cache = self._open()
        self.life_writes = True
        if how == "crash":
            assert self.disk.from_checkpoint and self.disk.scanned == 0
            assert self.disk.held() == had, "the journal did not give back the index it had"

    @rule(
        op=st.sampled_from(["read", "write"]),
        code=st.sampled_from([0, 0, 0, errno.EIO, errno.ENOSPC]),
    )
    def drive(self, op: str, code: int) -> None:
        """The drive starts (or stops) failing reads or writes."""
        self.error[op] = code

    @rule(which=st.integers(0, SLOTS - 1), where=st.sampled_from([30, 4096 + 3]))
    def corrupt(self, which: int, where: int) -> None:
        """A byte of a slot's header (30: its trailer's) or page flips underneath."""
        self.cache.l3.drain()  # (not under a write the IO thread is making)
        disk = self.disk
        fd, offset = disk.files.where(which)
        path = os.path.join(self.folder, "slots.dat")
        with open(path, "r+b") as fh:
            fh.seek(offset + where)
            byte = fh.read(1)
            if byte:
                fh.seek(offset + where)
                fh.write(bytes([byte[0] ^ 0x5A]))

    @precondition(lambda self: not self.error.get("write"))
    @rule()
    def flush_disk(self) -> None:
        job = self.cache.l3.clear_store(30.0)
        assert job.done.is_set() and not job.error
        assert self.disk.held() == []

    # ---- after every step ------------------------------------------------------------------
    @invariant()
    def sound(self) -> None:
        self.skew += MISS_TTL_S / 3
        self.cache.poll()
        self.cache.l3.poll()
        self.cache.check_integrity()
        if self.cache.l3.io.pending():  # (the store is the IO thread's while a job runs; only
            return  # this thread gives it jobs: with none left, it is idle until the next)
        disk = self.disk
        assert disk.check() == []
        held = set(disk.held())
        assert all(disk.parent(k) is None or disk.parent(k) in held for k in held), "a tail alone"
        assert disk.budget.used() <= disk.budget.bytes_per_day
        for event in self.cache.events.take():
            self.router.apply(event)
            if getattr(event, "medium", None) == "STORAGE":
                side = "on_storage" if type(event).__name__ == "BlockStored" else "off_storage"
                self.seen[side] += 1
        told = self.router.normalized()
        storage = told.pop("STORAGE", {})
        assert told == tree_blocks(self.cache, "GPU" if self.host_tokens else "CPU")
        blocks = self.cache.events.storage.blocks
        assert set(storage) == {h for h, _, _ in blocks.values()}
        assert set(blocks) <= held, "announced on STORAGE, not on the disk"
        if not self.life_writes:
            assert set(blocks) == held, "on the disk, not announced"
        assert self.read_back & held <= set(blocks), "read from the disk, not announced"
        hashes = self._hashes()
        assert all(hashes[name] == h for name, (h, _, _) in blocks.items()), "a wrong block hash"

    def teardown(self) -> None:
        try:
            self.error.clear()
            self.cache.l3.drain()
            self._count()
            settle(self.cache)
            self.cache.check_integrity()
            self.cache.close()
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


def _machine(ps: int, admission: str, host: int) -> type[DiskMachine]:
    name = f"Disk_ps{ps}_{admission}_{'host' if host else 'only_pool'}"
    return type(name, (DiskMachine,), {"page_size": ps, "admission": admission,
                                       "host_tokens": host})  # fmt: skip


SETTINGS = settings(
    max_examples=25, stateful_step_count=50, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip


MACHINES = [
    (1, "all", 14), (4, "reused", 14), (16, "all", 14), (4, "all", 0), (16, "reused-strict", 0),
]  # fmt: skip


def test_random_runs_on_a_small_disk_went_through_every_path():
    """The random runs keep every rule after every step (page sizes 1, 4, 16; admission all,
    reused and reused-strict; under a host pool and under an engine-tier daemon's one pool),
    and went where it matters, counted from this test's own runs: pages written, served from
    the disk after restarts, writes refused past the budget, slots that did not hold their
    page, pages announced on STORAGE and removed from it, reused writing at first sight."""
    seen = dict.fromkeys(DiskMachine.seen, 0)
    for ps, admission, host in MACHINES:
        machine = _machine(ps, admission, host)
        machine.TestCase.settings = SETTINGS
        machine.seen = seen
        machine.TestCase().runTest()
    assert all(seen.values()), f"the runs did not reach every state: {seen}"
