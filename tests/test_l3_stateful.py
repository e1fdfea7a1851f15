"""Random interleavings of writes, fetches, evictions, loads and store faults on two caches
that share one in-memory store: check_integrity() holds after every step on both, and every
token either cache serves holds exactly the KV computed for its prefix (a corrupted, lost or
half-written value is a miss, never wrong bytes)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from hicache.l3.config import L3Config
from hicache.l3.memory import drop_space, space
from hicache.l3.registry import open_store
from hicache.l3.tier import MISS_TTL_S, L3Tier
from hicache.observe import TierEvents
from tests.conftest import make_cache, settle
from tests.event_model import TierModel, tree_blocks
from tests.reference import expected_kv, read_kv, write_kv

PS = 2
SPACE = "stateful"


def _sequences() -> list[np.ndarray]:
    """Prompts sharing prefixes of several lengths (a small tree)."""
    rng = np.random.default_rng(0)
    base = rng.integers(1, 50, 24)
    out = []
    for cut in (0, 4, 8, 12, 16, 20):
        out.append(np.concatenate([base[:cut], rng.integers(1, 50, 12)]).astype(np.int32))
    return out


SEQS = _sequences()


class TwoMachines(RuleBasedStateMachine):
    second = "write_through_selective"  # the other machine's write policy
    host_tokens = 24 * PS  # 0: caches whose one pool the store sits under (engine-owned tiers)
    seen = {"adopted": 0, "corrupt": 0, "errors": 0, "served": 0, "written_back": 0}

    def __init__(self) -> None:
        super().__init__()
        drop_space(SPACE)
        self.skew = 0.0  # each step moves the tiers' clocks on: "the store lacked it" lapses
        self.caches = []
        for policy in ("write_through", self.second):
            cache = make_cache(
                manual=False, page_size=PS, num_kv_heads=2, head_dim=2,
                device_tokens=16 * PS, host_tokens=self.host_tokens, load_back_threshold=0,
                verify_pages=policy == "write_through",  # fetched pages are sealed too
            )  # fmt: skip
            cfg = L3Config(f"memory://{SPACE}", "m", write_policy=policy, write_threshold=2,
                           breaker_failures=2, breaker_cooldown_s=0.001)  # fmt: skip
            cache.attach_l3(L3Tier(cache, cfg, open_store(cfg.url), clock=self.clock))
            cache.attach_events(TierEvents(PS))
            self.caches.append(cache)
        self.routers = [TierModel(), TierModel()]  # each machine's KV events, replayed
        self.faults = space(SPACE).faults

    def clock(self) -> float:
        return time.monotonic() + self.skew

    @rule(m=st.integers(0, 1), s=st.integers(0, len(SEQS) - 1), n=st.integers(1, 36))
    def compute(self, m: int, s: int, n: int) -> None:
        """An engine computes a prompt's first ``n`` tokens and inserts them."""
        cache, tokens = self.caches[m], SEQS[s][:n]
        slots = cache.alloc(len(tokens))
        if slots is None:
            return
        write_kv(cache.device_pool, slots, tokens, 0, tokens)
        cache.insert(tokens, slots)

    @rule(m=st.integers(0, 1), s=st.integers(0, len(SEQS) - 1), wait=st.booleans())
    def fetch(self, m: int, s: int, wait: bool) -> None:
        cache, tokens = self.caches[m], SEQS[s]
        hit = cache.match_prefix(tokens)
        f = cache.l3.prefetch(tokens.tobytes(), None, hit.device_hit_length + hit.host_hit_length)
        if f is not None and wait:  # (a bound, not a pace: a loaded machine takes longer)
            assert cache.l3.wait(f, timeout=120)

    @rule(m=st.integers(0, 1), s=st.integers(0, len(SEQS) - 1))
    def serve(self, m: int, s: int) -> None:
        """Match, load what is on the host, and check every device token's KV."""
        cache, tokens = self.caches[m], SEQS[s]
        hit = cache.match_prefix(tokens)
        if hit.host_hit_length:
            cache.load_back(hit.last_host_node)
            settle(cache)
            hit = cache.match_prefix(tokens)
        n = hit.device_hit_length
        self.seen["served"] += n
        got = read_kv(cache.device_pool, hit.device_indices)
        assert bool((got == expected_kv(tokens[:n], 2, 2)).all()), "wrong KV served"

    @rule(m=st.integers(0, 1), device=st.integers(0, 32), host=st.integers(0, 48))
    def evict(self, m: int, device: int, host: int) -> None:
        cache = self.caches[m]
        cache.evict(device)
        cache.evict_host(host)

    @rule(m=st.integers(0, 1))
    def settle(self, m: int) -> None:
        settle(self.caches[m])

    @rule(m=st.integers(0, 1))
    def drain(self, m: int) -> None:
        self.caches[m].l3.drain()

    @rule(
        down=st.booleans(),
        fail=st.sampled_from([0.0, 0.0, 0.3]),
        lose=st.sampled_from([0.0, 0.0, 0.5]),
        corrupt=st.integers(0, 3),
    )
    def faults_change(self, down: bool, fail: float, lose: float, corrupt: int) -> None:
        for cache in self.caches:  # the calls queued so far meet the faults they were queued
            cache.l3.drain()  # under, and the store holds what was written, however loaded the
        self.faults.down = down and not corrupt  # machine (its IO threads' pace)
        self.faults.fail_rate, self.faults.lose_rate = fail, lose
        if corrupt:  # some of the stored values come back with a bit flipped
            keys = list(space(SPACE).values)
            self.faults.corrupt.update(keys[corrupt - 1 :: 2])

    @rule()
    def store_forgets(self) -> None:
        """The store evicts (or a node dies with) some values."""
        for cache in self.caches:  # (what was queued before it: as in faults_change)
            cache.l3.drain()
        values = space(SPACE).values
        with space(SPACE).lock:
            for key in list(values)[::3]:
                del values[key]

    @invariant()
    def integrity(self) -> None:
        self.skew += MISS_TTL_S / 3
        for cache, router in zip(self.caches, self.routers, strict=True):
            cache.poll()
            cache.l3.poll()
            cache.check_integrity()
            for event in cache.events.take():  # pages fetched from the store included
                router.apply(event)
            assert router.normalized() == tree_blocks(cache)

    def teardown(self) -> None:
        for cache in self.caches:
            c = cache.l3.counters
            seen = self.seen
            seen["adopted"] += c.adopted_pages
            if "written_back" in seen:
                seen["written_back"] += c.write_back_pages
            if "corrupt" in seen:  # (test_l3_only_pool.py tests these under the only pool)
                seen["corrupt"] += c.corrupt_pages
                seen["errors"] += c.errors
            cache.l3.drain()
            settle(cache)
            cache.check_integrity()
            cache.close()
        drop_space(SPACE)


class ColdFetches(TwoMachines):
    """Two machines whose caches also let go of everything before a fetch, some of them with
    the store's values corrupted just before: what the store holds is read, faulty or not,
    whatever the IO threads' pace."""

    @rule(m=st.integers(0, 1), s=st.integers(0, len(SEQS) - 1), corrupt=st.booleans())
    def fetch_cold(self, m: int, s: int, corrupt: bool) -> None:
        cache = self.caches[m]
        cache.l3.drain()
        settle(cache)
        cache.evict(1 << 20)
        cache.evict_host(1 << 20)
        if corrupt:  # (every other value the store holds: drained first, the store up)
            self.faults_change(down=False, fail=0.0, lose=0.0, corrupt=1)
        cache.l3.drain()
        self.fetch(m, s, wait=True)


class WithWriteBack(ColdFetches):
    second = "write_back"


class UnderTheOnlyPool(TwoMachines):
    """Caches with no host tier (a daemon for engines that own their device tier): the store
    sits under their one pool; device eviction hands pages a write still reads to it."""

    host_tokens = 0
    seen = dict.fromkeys(("adopted", "served"), 0)


SETTINGS = settings(
    max_examples=40, stateful_step_count=40, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip
ColdFetches.TestCase.settings = WithWriteBack.TestCase.settings = SETTINGS
UnderTheOnlyPool.TestCase.settings = settings(SETTINGS, max_examples=80)


@pytest.mark.parametrize(
    "machines", [(ColdFetches, WithWriteBack), (UnderTheOnlyPool,)], ids=["two", "only_pool"]
)
def test_random_runs_on_a_faulty_store_went_through_every_path(machines):
    """The random runs (each rule checked after every step; with write-through and with
    write-back on the second machine) fetched, served, refused corrupt values, survived a
    down store and wrote back what eviction gave up, counted from this test's own runs
    (whatever ran before it)."""
    seen = machines[0].seen  # (the machines of one case share it)
    for name in seen:
        seen[name] = 0
    for machine in machines:
        machine.TestCase().runTest()
    assert all(seen.values()), f"the runs did not reach every state: {seen}"
