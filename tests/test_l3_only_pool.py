"""The third tier under a cache's one pool (no host tier: a daemon for engines that own their
device tier, ``--device-tier engine``), on the in-memory store: what one machine inserted is
written through and served to another from its pool byte for byte, device eviction hands pages
to a write-back and a write that still reads them, fetches make room by eviction, and the keys
never match a host-tier cache's or another engine layout's."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from hicache.daemon.config import build_parser, resolve
from hicache.daemon.requests import Handlers
from hicache.daemon.sessions import SessionTable
from hicache.l3.config import L3Config
from hicache.l3.keys import KeyChain, identity_of
from hicache.l3.memory import drop_space, space
from hicache.l3.registry import open_store
from hicache.l3.tier import L3Tier
from hicache.memory import PageState
from tests.conftest import make_cache
from tests.reference import expected_kv, read_kv, write_kv
from tests.test_l3_tier import machine as tier_machine

PS = 4
LAYOUT = {"num_layers": 2, "backend": "TEST", "block_shape": [2, PS, 4], "model": "local/path"}


def machine(name: str, device_tokens: int = 64, **l3: object):
    """A cache whose one pool (CPU, no host tier) has the memory store ``name`` under it."""
    return tier_machine(name, 0, device_tokens, LAYOUT, **l3)


def writer(name: str, tokens: np.ndarray):
    """A machine that computed ``tokens`` and wrote them to the store."""
    a = machine(name)
    compute(a, tokens)
    a.l3.drain()
    return a


@pytest.fixture
def space_name():
    drop_space("only")
    yield "only"
    drop_space("only")


def tokens_of(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 5000, n).astype(np.int32)


def compute(cache, tokens: np.ndarray) -> None:
    """An engine computes ``tokens`` into pages it owns and inserts them."""
    slots = cache.alloc(len(tokens))
    write_kv(cache.device_pool, slots, tokens, 0, tokens)
    cache.insert(tokens, slots)
    cache.check_integrity()


def fetch(cache, tokens: np.ndarray):
    m = cache.match_prefix(tokens)
    f = cache.l3.prefetch(tokens.tobytes(), None, m.device_hit_length)
    if f is not None:
        assert cache.l3.wait(f, timeout=10)
    cache.check_integrity()
    return f


def served(cache, tokens: np.ndarray) -> int:
    """Tokens of ``tokens`` the pool serves now, checked against the KV computed for them."""
    m = cache.match_prefix(tokens)
    assert m.host_hit_length == 0
    n = m.device_hit_length
    kv = read_kv(cache.device_pool, m.device_indices)
    assert kv.shape[-1] == n and bool((kv == expected_kv(tokens[:n], 2, 2)).all())
    return n


def close(*caches) -> None:
    for c in caches:
        c.l3.drain()
        c.check_integrity()
        c.close()


def test_an_insert_is_written_through_and_another_machine_serves_it_from_its_pool(space_name):
    tokens = tokens_of(40, 1)
    a, b = writer(space_name, tokens), machine(space_name)
    try:
        assert a.l3.counters.written_pages == 10
        assert served(b, tokens) == 0
        f = fetch(b, tokens)
        assert (f.hits, f.arrived, f.adopted) == (10, 10, 10)
        assert served(b, tokens) == 40
        # the fetched pages are an ordinary unlocked leaf: evictable like any insert
        assert b.tree.evictable_tokens == 40 and b.device_alloc.count(PageState.OWNED) == 0
        assert b.evict(40).freed == 40
        assert served(b, tokens) == 0
    finally:
        close(a, b)


def test_a_value_that_does_not_verify_ends_the_run_and_the_rest_is_freed(space_name):
    tokens = tokens_of(24, 8)
    a, b = writer(space_name, tokens), machine(space_name)
    try:
        space(space_name).faults.corrupt.add(list(space(space_name).values)[3])
        free = b.device_alloc.free_pages
        f = fetch(b, tokens)
        assert (f.hits, f.arrived, f.corrupt, f.adopted) == (6, 3, 1, 3)
        assert served(b, tokens) == 12  # the good pages before it, and nothing after
        assert b.device_alloc.free_pages == free - 3  # the other pages went back
    finally:
        close(a, b)


def test_write_back_is_refused_under_the_only_pool(space_name):
    cache = make_cache(manual=False, page_size=PS, device_tokens=64, host_tokens=0)
    config = L3Config(f"memory://{space_name}", "m", write_policy="write_back")
    try:
        with pytest.raises(ValueError, match="write_back needs a host tier"):
            L3Tier(cache, config, open_store(config.url))
    finally:
        cache.close()
    with pytest.raises(ValueError, match="write_back needs a host tier"):
        argv = ["--device-tier", "engine", "--l3", "memory://x", "--l3-model", "m"]
        resolve(build_parser().parse_args([*argv, "--l3-write-policy", "write_back"]), {})


def test_a_leaf_evicted_while_its_write_runs_keeps_its_pages_until_the_write_ends(space_name):
    a = machine(space_name)
    space(space_name).faults.latency_s = 0.2
    try:
        tokens = tokens_of(16, 3)
        compute(a, tokens)
        assert a.l3.writes  # written through at the insert; sleeping in the store
        free = a.device_alloc.free_pages
        assert a.evict(16) == (0, 16)  # pending: freed when the write ends
        assert a.device_alloc.free_pages == free
        a.check_integrity()
        a.l3.drain()
        assert a.device_alloc.free_pages == free + 4
        assert a.l3.counters.written_pages == 4
    finally:
        close(a)


def test_an_allocation_evicts_no_more_than_it_needs_while_writes_hold_pages(space_name):
    a = machine(space_name, device_tokens=32)  # 8 pages
    space(space_name).faults.latency_s = 0.3  # every write still runs when we allocate
    try:
        for seed in (4, 5, 6):
            compute(a, tokens_of(8, seed))  # 3 leaves of 2 pages, each written through
        free = a.device_alloc.free_pages
        assert a.alloc((free + 1) * PS) is None  # the leaf it evicted is held by its write ...
        assert a.tree.evictable_tokens == 16  # ... and the other two stay cached
        a.check_integrity()
        a.l3.drain()  # the writes end: the held pages are free
        assert a.alloc((free + 1) * PS) is not None
        a.check_integrity()
    finally:
        close(a)


def test_a_fetch_into_a_full_pool_evicts_unlocked_leaves_and_never_locked_ones(space_name):
    wanted = tokens_of(24, 5)
    a, b = writer(space_name, wanted), machine(space_name, device_tokens=32)  # 8 pages
    try:
        locked = tokens_of(12, 6)
        compute(b, locked)
        held = b.match_prefix(locked).last_device_node
        b.inc_lock_ref(held)
        compute(b, tokens_of(8, 7))  # unlocked: may go
        b.l3.drain()  # (a leaf whose write still runs keeps its pages until the write ends)
        assert b.device_alloc.free_pages == 8 - 5
        f = fetch(b, wanted)
        assert f.arrived == 5 and f.adopted == 5  # room for 5 of 6 pages: the leading ones
        assert served(b, wanted) == 20 and served(b, locked) == 12
        b.dec_lock_ref(held)
    finally:
        close(a, b)


def test_keys_differ_from_a_host_tier_cache_and_from_another_engine_layout():
    host = make_cache(manual=False, page_size=PS, num_kv_heads=2, head_dim=4)
    try:
        cfg = host.config
        chains = [
            KeyChain(identity_of(cfg, "m", "0"), PS),  # a host tier: values in its layout
            KeyChain(identity_of(cfg, "m", "0", LAYOUT, under_host=False), PS),
            KeyChain(identity_of(cfg, "m", "0", {**LAYOUT, "backend": "OTHER"}, False), PS),
        ]
        assert len({c.seed for c in chains}) == 3
        # the engines' own model name (a local path) is not part of it: --l3-model is
        elsewhere = KeyChain(identity_of(cfg, "m", "0", {**LAYOUT, "model": "/x"}, False), PS)
        assert elsewhere.seed == chains[1].seed
    finally:
        host.close()


def test_a_fetch_that_found_no_room_is_not_started_again_at_once(space_name):
    wanted = tokens_of(16, 9)
    a, b = writer(space_name, wanted), machine(space_name, device_tokens=16)  # 4 pages
    try:
        mine = tokens_of(16, 10)
        compute(b, mine)
        b.inc_lock_ref(b.match_prefix(mine).last_device_node)  # the pool is all locked
        f = fetch(b, wanted)
        assert f.skipped == "no_room" and b.l3.counters.skipped_room == 1
        # asked again at once (an engine polling while it waits): nothing starts, no wait
        assert b.l3.prefetch(wanted.tobytes(), None, 0) is None
        assert b.l3.counters.lookups == 1
    finally:
        close(a, b)


def test_the_daemons_check_takes_a_fetchs_pages_as_the_fetchs(space_name):
    """The daemon's integrity check (STATS with ``check``) under an engine-tier daemon's one
    pool counts the pages a fetch from the store holds as the fetch's, not as OWNED pages no
    session owns: no false "BROKEN" while a lookup reads."""
    tokens = tokens_of(32, 7)
    a = writer(space_name, tokens)
    b = machine(space_name)
    handlers = Handlers(b, SessionTable(), 1, {})
    gate, get = threading.Event(), b.l3.store.get
    b.l3.store.get = lambda *args: gate.wait(30) and get(*args)  # (the read waits for it)
    f = b.l3.prefetch(tokens.tobytes(), None, 0)
    deadline = time.monotonic() + 30
    while f.pages is None and not f.done and time.monotonic() < deadline:
        b.l3.poll()  # (the store said it has them: pages for the read, which waits)
        time.sleep(0.001)
    assert f.pages is not None and not f.done
    assert b.count_pages(PageState.OWNED) == len(f.pages) == 8
    handlers.check_integrity()
    gate.set()
    assert b.l3.wait(f, timeout=30)
    handlers.check_integrity()
    assert served(b, tokens) == 32
    for cache in (a, b):
        cache.close()
