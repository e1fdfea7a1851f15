"""The third tier inside the cache (hicache/l3/tier.py), on the in-memory store with injected
faults: pages one "machine" wrote are served to another byte for byte, a value that does not
verify is never inserted, a failing store is a miss, and the policies do what they say."""

from __future__ import annotations

import time

import numpy as np
import pytest

from hicache.l3.config import L3Config
from hicache.l3.memory import drop_space, space
from hicache.l3.registry import open_store
from hicache.l3.tier import L3Tier
from tests.conftest import make_cache, settle
from tests.reference import expected_kv, read_kv, write_kv

PS = 4


def machine(name: str, host_tokens: int = 128, device_tokens: int = 64, layout=None, **l3: object):
    """A cache with the memory store ``name`` under its host tier (``host_tokens=0``: under
    its one pool, as a daemon for engines has it; ``layout``: the engines' identity)."""
    cache = make_cache(
        manual=False, page_size=PS, num_kv_heads=2, head_dim=4, device_tokens=device_tokens,
        host_tokens=host_tokens, load_back_threshold=0,
    )  # fmt: skip
    config = L3Config(f"memory://{name}", "test-model", **l3)  # type: ignore[arg-type]
    cache.attach_l3(L3Tier(cache, config, open_store(config.url), layout=layout))
    return cache


@pytest.fixture
def pair():
    drop_space("t")
    a, b = machine("t"), machine("t")
    yield a, b
    for c in (a, b):
        c.l3.drain()
        c.check_integrity()
        c.close()
    drop_space("t")


def tokens_of(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 5000, n).astype(np.int32)


def store(cache, tokens: np.ndarray) -> None:
    """Compute (write known KV), insert, back up and let the store take it."""
    slots = cache.alloc(len(tokens))
    write_kv(cache.device_pool, slots, tokens, 0, tokens)
    cache.insert(tokens, slots)
    settle(cache)
    cache.l3.drain()
    cache.check_integrity()


def fetch(cache, tokens: np.ndarray):
    m = cache.match_prefix(tokens)
    f = cache.l3.prefetch(tokens.tobytes(), None, m.device_hit_length + m.host_hit_length)
    if f is not None:
        assert cache.l3.wait(f, timeout=10)
    cache.check_integrity()
    return f


def served(cache, tokens: np.ndarray) -> int:
    """Tokens of ``tokens`` the cache serves now, loaded to the device and checked byte for
    byte against the KV computed for them."""
    m = cache.match_prefix(tokens)
    if m.host_hit_length:
        assert cache.load_back(m.last_host_node) is not None
        settle(cache)
        m = cache.match_prefix(tokens)
    n = m.device_hit_length
    kv = read_kv(cache.device_pool, m.device_indices)
    assert torch_equal(kv, expected_kv(tokens[:n], 2, 2))
    return n


def torch_equal(a, b) -> bool:
    return bool((a == b).all()) and a.shape == b.shape


def test_what_one_machine_wrote_another_serves_exactly(pair):
    a, b = pair
    tokens = tokens_of(40, 1)  # 10 pages
    store(a, tokens)
    assert a.l3.counters.written_pages == 10
    assert b.match_prefix(tokens).device_hit_length == 0
    f = fetch(b, tokens)
    assert f.hits == 10 and f.arrived == 10 and f.adopted == 10
    assert served(b, tokens) == 40
    # a prefix both hold is not fetched again; a longer prompt fetches only its new pages
    assert fetch(b, tokens) is None
    longer = np.concatenate([tokens, tokens_of(8, 2)])
    store(a, longer)
    assert a.l3.counters.present_pages == 0 and a.l3.counters.written_pages == 12
    f = fetch(b, longer)
    assert (f.first, f.hits) == (10, 2)
    assert served(b, longer) == 48


def test_a_value_that_does_not_verify_ends_the_run_and_is_never_inserted(pair):
    a, b = pair
    tokens = tokens_of(24, 3)
    store(a, tokens)
    keys = list(space("t").values)  # in write order: page 0..5
    space("t").faults.corrupt.add(keys[3])
    f = fetch(b, tokens)
    assert (f.hits, f.arrived, f.corrupt) == (6, 3, 1)
    assert b.l3.counters.corrupt_pages == 1
    assert served(b, tokens) == 12  # the three good pages, and nothing after the bad one


def test_a_store_that_is_down_is_a_miss_and_the_breaker_stops_asking(pair, caplog):
    a, b = pair
    tokens = tokens_of(16, 4)
    store(a, tokens)
    faults = space("t").faults
    faults.down = True
    for i in range(3):  # three failed lookups open the breaker (breaker_failures=3)
        f = fetch(b, np.concatenate([tokens, tokens_of(4, 100 + i)]))
        assert f is not None and f.error and f.arrived == 0
    assert b.l3.breaker.state == "open"
    opened = [r.getMessage() for r in caplog.records if "failing" in r.getMessage()]
    assert len(opened) == 1 and "memory://t" in opened[0]  # said once, naming the store
    assert fetch(b, tokens) is None and b.l3.counters.skipped_breaker == 1
    assert served(b, tokens) == 0  # the engine recomputes
    # writes meanwhile fail and are counted, nothing is held
    store(b, tokens_of(8, 5))
    assert b.l3.counters.failed_write_pages >= 2
    faults.down = False
    b.l3.breaker.open_until = time.monotonic()  # (the cooldown passed)
    f = fetch(b, tokens)
    assert f.arrived == 4 and b.l3.breaker.state == "closed"
    assert any("answers again" in r.getMessage() for r in caplog.records)
    assert served(b, tokens) == 16


def test_writes_past_the_queue_are_dropped_and_counted():
    drop_space("q")
    a = machine("q", queue_pages=3)
    space("q").faults.latency_s = 0.05  # the first write still runs when the others come
    try:
        for seed in range(3):
            slots = a.alloc(8)
            t = tokens_of(8, 10 + seed)
            write_kv(a.device_pool, slots, t, 0, t)
            a.insert(t, slots)
            settle(a)
        assert a.l3.counters.dropped_pages >= 2
        a.l3.drain()
        a.check_integrity()
    finally:
        a.close()
        drop_space("q")


def test_a_host_page_evicted_while_its_write_runs_is_freed_only_after_it():
    drop_space("e")
    a = machine("e")
    space("e").faults.latency_s = 0.2
    try:
        tokens = tokens_of(16, 6)
        slots = a.alloc(16)
        write_kv(a.device_pool, slots, tokens, 0, tokens)
        a.insert(tokens, slots)
        settle(a)  # backed up: the write is queued and sleeps in the store
        assert a.l3.writes
        a.evict(64)  # device copies go; the node is host-only
        free_before = a.host_alloc.free_pages
        assert a.evict_host(16) == 16  # the tree gives the pages up ...
        assert a.host_alloc.free_pages == free_before  # ... but the write still holds them
        a.check_integrity()
        a.l3.drain()
        assert a.host_alloc.free_pages == free_before + 4
        assert a.l3.counters.written_pages == 4
        a.check_integrity()
    finally:
        a.close()
        drop_space("e")


def test_write_back_writes_what_the_host_tier_evicts():
    drop_space("wb")
    a, b = machine("wb", write_policy="write_back"), machine("wb")
    try:
        tokens = tokens_of(20, 7)
        store(a, tokens)
        assert a.l3.counters.written_pages == 0  # nothing until the host tier evicts
        a.evict(64)
        a.evict_host(1000)
        a.l3.drain()
        assert a.l3.counters.written_pages == 5
        a.check_integrity()
        fetch(b, tokens)
        assert served(b, tokens) == 20
        a.evict_host(1000, to_l3=False)  # a flush writes nothing
    finally:
        for c in (a, b):
            c.l3.drain()
            c.check_integrity()
            c.close()
        drop_space("wb")


def test_write_through_selective_waits_for_hits():
    drop_space("s")
    a = machine("s", write_policy="write_through_selective", write_threshold=3)
    try:
        tokens = tokens_of(8, 8)
        store(a, tokens)
        assert a.l3.counters.written_pages == 0
        for _ in range(3):
            a.match_prefix(tokens)
        a.l3.drain()
        assert a.l3.counters.written_pages == 2
        a.check_integrity()
    finally:
        a.close()
        drop_space("s")


@pytest.mark.parametrize("flushed", [False, True])
def test_write_through_selective_writes_a_prompt_computed_again_after_it_left(flushed):
    """A prompt the cache let go unwritten (evicted before its hits) and then computed again
    was reused: its pages go down then, as a hit would send them. A flush forgets nothing it
    did not write, and is not a reuse."""
    drop_space("s2")
    a = machine("s2", write_policy="write_through_selective", write_threshold=2)
    try:
        tokens = tokens_of(12, 11)
        store(a, tokens)
        a.evict(64, to_l3=not flushed)
        a.evict_host(128, to_l3=not flushed)
        settle(a)
        assert (
            a.match_prefix(tokens).host_hit_length + a.match_prefix(tokens).device_hit_length == 0
        )
        assert a.l3.counters.written_pages == 0
        store(a, tokens_of(8, 12))  # (another prompt, computed once: not written)
        store(a, tokens)  # computed again
        assert a.l3.counters.written_pages == (0 if flushed else 3)
        a.check_integrity()
    finally:
        a.close()
        drop_space("s2")


def _cycle(cache) -> None:
    """The pools let every unlocked page go (as a long trace would), nothing flushed."""
    cache.evict(64)
    cache.evict_host(128)
    settle(cache)


@pytest.mark.parametrize("policy", ["write_through_adaptive", "write_through_selective"])
def test_write_through_adaptive_writes_at_first_sight_while_pages_come_back(policy):
    """Documents that come back only after the pools cycled: each is computed twice before it
    earns its write by reuse. Once at least half the pages that left unreused came back,
    ``write_through_adaptive`` writes a new prompt at first sight (``_selective`` does not);
    once too few did, it stops; pages read back from the store count as come back too."""
    drop_space("ad")
    a = machine("ad", write_policy=policy, write_threshold=2)
    adaptive = policy == "write_through_adaptive"
    try:
        docs = [tokens_of(32, 100 + i) for i in range(10)]  # 8 pages each, 80 in all
        for doc in docs:
            store(a, doc)
            _cycle(a)
        adm, c = a.l3.admission, a.l3.counters
        assert (adm.let_go_pages, adm.came_back_pages, c.written_pages) == (80, 0, 0)
        assert not adm.first_sight  # (nothing came back yet)
        for doc in docs[:5]:  # computed again: reused, written (and they leave again)
            store(a, doc)
            _cycle(a)
        assert (adm.let_go_pages, adm.came_back_pages, c.written_pages) == (80, 40, 40)
        assert adm.first_sight is adaptive and a.l3.stats()["first_sight"] is adaptive
        new = [tokens_of(32, 50 + i) for i in range(16)]
        first = 0  # new prompts computed once, each at first sight while it lasts
        while first < len(new) and adm.first_sight:
            store(a, new[first])
            _cycle(a)
            first += 1
        assert (first > 0) is adaptive and first < len(new)  # (then too few came back)
        assert c.written_pages == 40 + 8 * first
        store(a, new[first])  # computed once, now: not written
        _cycle(a)
        assert c.written_pages == 40 + 8 * first and not adm.first_sight
        if adaptive:  # read back from the store: they come back
            back = adm.came_back_pages
            for doc in new[:first]:
                assert fetch(a, doc) is not None and served(a, doc) == 32
                _cycle(a)
            assert adm.came_back_pages == back + 8 * first and adm.first_sight
        a.check_integrity()
    finally:
        a.close()
        drop_space("ad")


def test_a_page_hit_before_its_backup_still_counts_as_come_back():
    """Under a host pool backed up only at device eviction (write_back), a document computed
    again and hit while on the device reaches the hit threshold before its backup: it is
    written for that, and its pages count as come back all the same (the adaptive rule
    learns from them)."""
    drop_space("ad3")
    a = make_cache(
        manual=False, page_size=PS, num_kv_heads=2, head_dim=4, device_tokens=64,
        host_tokens=128, load_back_threshold=0, write_policy="write_back",
    )  # fmt: skip
    config = L3Config("memory://ad3", "test-model", write_policy="write_through_adaptive",
                      write_threshold=2)  # fmt: skip
    a.attach_l3(L3Tier(a, config, open_store(config.url)))
    try:
        docs = [tokens_of(32, 300 + i) for i in range(10)]  # 8 pages each, 80 in all
        for doc in docs:
            store(a, doc)
            _cycle(a)
        adm, c = a.l3.admission, a.l3.counters
        assert adm.let_go_pages >= 64 and (adm.came_back_pages, c.written_pages) == (0, 0)
        for doc in docs:  # computed again, hit twice while on the device, then let go
            store(a, doc)
            a.match_prefix(doc)
            a.match_prefix(doc)
            _cycle(a)
            a.l3.drain()
        assert (adm.let_go_pages, adm.came_back_pages, c.written_pages) == (80, 80, 80)
        assert adm.first_sight
    finally:
        a.l3.drain()
        a.check_integrity()
        a.close()
        drop_space("ad3")


def test_write_through_adaptive_stays_selective_when_pages_do_not_come_back():
    """Prompts computed once and never again: ``write_through_adaptive`` never writes at first
    sight, and writes what earned it only (a prompt hit while cached)."""
    drop_space("ad2")
    a = machine("ad2", write_policy="write_through_adaptive", write_threshold=2)
    try:
        for i in range(20):
            store(a, tokens_of(32, 200 + i))
            _cycle(a)
        adm = a.l3.admission
        assert adm.let_go_pages == 160 and adm.came_back_pages == 0 and not adm.first_sight
        assert a.l3.counters.written_pages == 0
        hot = tokens_of(32, 300)
        store(a, hot)
        assert a.l3.counters.written_pages == 0
        a.match_prefix(hot)  # a hit while cached: earned
        a.l3.drain()
        assert a.l3.counters.written_pages == 8
        _cycle(a)  # (it leaves reused: not let go)
        assert adm.let_go_pages == 160
        a.check_integrity()
    finally:
        a.close()
        drop_space("ad2")


def test_the_cost_model_skips_a_fetch_slower_than_recomputing():
    drop_space("c")
    a = machine("c")
    fast = machine("c", prefill_tokens_per_s=1.0)  # recomputing is slow: always fetch
    slow = machine("c", prefill_tokens_per_s=1e12)  # recomputing is instant: never fetch
    try:
        for seed in (9, 10):
            store(a, tokens_of(16, seed))
        for b in (fast, slow):  # the first fetch measures the store's bandwidth
            fetch(b, tokens_of(16, 9))
            assert b.l3.read_bps > 0
        assert fetch(fast, tokens_of(16, 10)).arrived == 4
        f = fetch(slow, tokens_of(16, 10))
        assert f.skipped == "cost" and f.arrived == 0 and slow.l3.counters.skipped_cost == 1
        assert served(slow, tokens_of(16, 10)) == 0
    finally:
        for c in (a, fast, slow):
            c.l3.drain()
            c.check_integrity()
            c.close()
        drop_space("c")


def test_pages_the_tree_got_meanwhile_are_not_inserted_twice(pair):
    a, b = pair
    tokens = tokens_of(32, 11)
    store(a, tokens)
    space("t").faults.latency_s = 0.1
    m = b.match_prefix(tokens)
    f = b.l3.prefetch(tokens.tobytes(), None, m.device_hit_length + m.host_hit_length)
    store_no_l3_wait = tokens[:16]
    slots = b.alloc(16)
    write_kv(b.device_pool, slots, store_no_l3_wait, 0, store_no_l3_wait)
    b.insert(store_no_l3_wait, slots)  # the engine computed the first half meanwhile
    assert b.l3.wait(f, timeout=10)
    space("t").faults.latency_s = 0.0
    assert f.arrived == 8 and f.adopted == 4
    b.check_integrity()
    assert served(b, tokens) == 32


def test_a_value_that_failed_to_verify_is_removed_and_written_again(pair):
    a, b = pair
    tokens = tokens_of(16, 12)
    store(a, tokens)
    bad = list(space("t").values)[1]
    space("t").faults.corrupt.add(bad)
    assert fetch(b, tokens).corrupt == 1
    assert bad not in space("t").values  # removed by the reader
    assert fetch(b, tokens) is None  # (not asked for again at once)
    a.evict(64)
    a.evict_host(1000, to_l3=False)  # the writer lost it too, computes it again, writes again
    store(a, tokens)
    assert bad in space("t").values
    b.l3.misses.clear()  # (the second passed)
    assert served(b, tokens) == 4  # the good first page came before; now the rest comes too
    assert fetch(b, tokens).arrived == 3
    assert served(b, tokens) == 16


def test_settings_that_would_break_the_tier_are_refused():
    from hicache.l3.registry import check_url

    for field, value in [
        ("breaker_cooldown_s", float("inf")),
        ("breaker_cooldown_s", 0),
        ("timeout_s", float("nan")),
        ("timeout_max_s", -1),
        ("min_tokens", -5),
        ("queue_pages", 0),
        ("write_policy", "sometimes"),
    ]:
        with pytest.raises(ValueError, match=f"l3_{field}"):
            L3Config("memory://x", "m", **{field: value})
    with pytest.raises(ValueError, match="l3_model"):
        L3Config("memory://x", "")
    with pytest.raises(ValueError, match="latency_s"):
        check_url("memory://x?latency_s=abc")
    with pytest.raises(ValueError, match="memory fault"):
        check_url("memory://x?melt=1")


def test_an_idle_io_thread_ticks_its_store_and_never_while_a_job_runs(monkeypatch):
    """The IO thread gives its store a tick (housekeeping: a disk's sync) after a second with
    nothing to do, and not while a job is queued or running."""
    from tests.daemon_helpers import wait_until

    drop_space("tick")
    a = machine("tick")
    ticks: list[int] = []
    monkeypatch.setattr(a.l3.store, "tick", lambda: ticks.append(a.l3.io.pending()))
    try:
        wait_until(lambda: len(ticks) > 0, timeout=10, what="a tick")
        assert all(p == 1 for p in ticks)  # (its own busy mark only: no job beside it)
    finally:
        a.close()
        drop_space("tick")


def test_a_write_never_reads_host_pages_a_backup_still_copies_into():
    """The store is written only from host pages that hold their KV: an offer of a node (or
    of one under it) whose backup has not landed yet is put off, and a cache closed with its
    backups in flight lets them land before its stop writes them. Another machine then serves
    exactly the KV computed (never the bytes the host pages held before the copy)."""
    drop_space("unready")
    config = L3Config("memory://unready", "test-model", close_drain_s=10.0)
    a = make_cache(manual=True, page_size=PS, num_kv_heads=2, head_dim=4, device_tokens=64,
                   host_tokens=128, load_back_threshold=0)  # fmt: skip
    a.attach_l3(L3Tier(a, config, open_store(config.url)))
    b = machine("unready")
    try:
        first, second = tokens_of(16, 41), tokens_of(24, 42)
        for tokens in (first, second):
            slots = a.alloc(len(tokens))
            write_kv(a.device_pool, slots, tokens, 0, tokens)
            a.insert(tokens, slots)
        assert a.engine.queued()  # (the backups: submitted, not copied)
        for node in a.tree.iter_nodes():
            a.l3.offer(node)  # (as a hit would, or a stop)
        assert a.l3.queued_pages == 0  # nothing read from pages still being copied into
        a.close()  # its backups land first, then its stop writes them
        for tokens in (first, second):
            fetch(b, tokens)
            assert served(b, tokens) == len(tokens)
    finally:
        b.l3.drain()
        b.close()
        drop_space("unready")


def test_an_operators_flush_or_eviction_that_fails_never_opens_the_breaker():
    """A disk that cannot be flushed or evicted (its folder locked by another daemon, say)
    fails the operator's call, and only it: retries never open the breaker, so lookups and
    writes go on."""
    from hicache.l3.memory import MemoryStore
    from hicache.l3.store import StoreDown

    class Unflushable(MemoryStore):
        clears = True

        def clear(self) -> int:
            raise StoreDown("the folder is locked")

        def evict(self, count: int) -> int:
            raise StoreDown("the folder is locked")

    drop_space("unflushable")
    cache = make_cache(manual=False, page_size=PS, num_kv_heads=2, head_dim=4, device_tokens=64,
                       host_tokens=128, load_back_threshold=0)  # fmt: skip
    config = L3Config("memory://unflushable", "test-model", breaker_failures=1)
    cache.attach_l3(L3Tier(cache, config, Unflushable("unflushable")))
    try:
        for evict in (0, 3, 0):
            job = cache.l3.clear_store(10.0, evict=evict)
            assert job.done.is_set() and "locked" in job.error
        assert cache.l3.breaker.state == "closed" and cache.l3.breaker.opened == 0
        store(cache, tokens_of(16, 51))  # (the store still takes writes)
        assert cache.l3.counters.written_pages == 4
    finally:
        cache.l3.drain()
        cache.close()
        drop_space("unflushable")
