"""The L3 stores against the interface's contract, on real servers (tests/l3_servers.py):
pages go in from one host pool and come back into another byte for byte, a value that does not
verify is refused, and a dead node or master is a miss, never an exception or a hang."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from hicache.config import HiCacheConfig
from hicache.l3 import StoreDown, open_store
from hicache.l3.keys import KeyChain, identity_of
from hicache.l3.memory import drop_space, space
from hicache.l3.mooncake import pages_per_call as mooncake_pages_per_call
from hicache.l3.pages import PageSegments, trailer, verify
from hicache.memory import HostPool
from tests.l3_servers import mooncake_master, redis_cluster

LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


def config(layout: str = "layer_first", **kw: object) -> HiCacheConfig:
    fields = dict(
        num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32", page_size=4,
        device_tokens=64, host_tokens=128, host_layout=layout,
    )  # fmt: skip
    fields.update(kw)
    return HiCacheConfig(**fields)  # type: ignore[arg-type]


def filled_pool(cfg: HiCacheConfig, seed: int) -> HostPool:
    pool = HostPool(cfg)
    pool.buffer.numpy()[:] = np.random.default_rng(seed).integers(0, 256, pool.nbytes, np.uint8)
    return pool


def digests(n: int, salt: str = "") -> list[bytes]:
    chain = KeyChain(identity_of(config(), "m" + salt, "0"), 4)
    tokens = np.arange(1, 4 * n + 1, dtype=np.int32).tobytes()
    return chain.extend(chain.root(None), tokens)


def page_bytes(pool: HostPool, page: int) -> bytes:
    return PageSegments(pool).read(page)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_pages_runs_are_exactly_its_bytes_in_every_layout(layout):
    cfg = config(layout)
    pool = filled_pool(cfg, 1)
    segs = PageSegments(pool)
    view = pool.page_view.view(torch.int32)  # (random bytes hold NaNs: compare bits)
    before = view.clone()
    value = bytes(range(256)) * (segs.page_bytes // 256) + bytes(segs.page_bytes % 256)
    segs.write(5, value)
    assert segs.read(5) == value
    changed = (view != before).any(dim=(0, 1, 3, 4))
    assert changed.nonzero().flatten().tolist() == [5]  # only page 5 was touched
    assert sum(n for _, n in segs.runs) == segs.page_bytes
    assert len(segs.runs) == {"layer_first": 6, "page_first": 2, "page_first_direct": 2}[layout]


def test_keys_name_the_prefix_and_everything_that_makes_kv_differ():
    cfg = config()
    tokens = np.arange(1, 14, dtype=np.int32).tobytes()  # 3 full pages and one token
    base = KeyChain(identity_of(cfg, "llama", "0"), 4)
    keys = base.extend(base.root(None), tokens)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert keys == KeyChain(identity_of(cfg, "llama", "0"), 4).extend(base.root(None), tokens)
    # the chain: a later page's key depends on every earlier page
    other = np.frombuffer(tokens, np.int32).copy()
    other[0] = 99
    assert set(base.extend(base.root(None), other.tobytes())).isdisjoint(keys)
    # a prefix continues from its last key
    assert base.extend(keys[0], tokens[16:]) == keys[1:]
    for changed in (
        KeyChain(identity_of(cfg, "qwen", "0"), 4),  # model
        KeyChain(identity_of(cfg.replace(dtype="float16"), "llama", "0"), 4),
        KeyChain(identity_of(cfg.replace(host_layout="page_first"), "llama", "0"), 4),
        KeyChain(identity_of(cfg, "llama", "1"), 4),  # tensor-parallel shard
    ):
        assert set(changed.extend(changed.root(None), tokens)).isdisjoint(keys)
    assert set(base.extend(base.root("salt"), tokens)).isdisjoint(keys)  # namespace
    assert KeyChain.name(keys[0]).startswith("hc1:") and len(KeyChain.name(keys[0])) == 68


def test_a_trailer_binds_the_bytes_to_their_key():
    pool = filled_pool(config(), 2)
    segs = PageSegments(pool)
    d = digests(2)
    tail = trailer(segs.views(3), d[0])
    assert verify(segs.views(3), d[0], tail)
    assert not verify(segs.views(3), d[1], tail)  # another key
    assert not verify(segs.views(4), d[0], tail)  # other bytes
    assert not verify(segs.views(3), d[0], tail[:8])  # short
    flipped = bytearray(segs.read(3))
    flipped[7] ^= 1
    assert not verify([bytes(flipped)], d[0], tail)


# ---- every store, the same contract ------------------------------------------------------------
@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    with redis_cluster(tmp_path_factory.mktemp("redis")) as cluster:
        yield cluster.url


@pytest.fixture(scope="module")
def mooncake_url():
    with mooncake_master() as master:
        yield master.url


@pytest.fixture(params=["memory", "redis", "mooncake"])
def store_pair(request):
    """Two clients of one store, each with its own host pool (two machines)."""
    if request.param == "memory":
        url = "memory://contract"
        drop_space("contract")
        opts: dict = {}
    elif request.param == "redis":
        url, opts = request.getfixturevalue("redis_url"), {}
    else:
        url, opts = request.getfixturevalue("mooncake_url"), {"segment_bytes": 32 << 20}
    cfg = config()
    pools, stores = [filled_pool(cfg, 10), HostPool(cfg)], []
    try:
        for pool in pools:
            store = open_store(url, **opts)
            store.attach(PageSegments(pool))
            stores.append(store)
        yield stores, pools
    finally:
        for store in stores:
            store.close()


def test_pages_written_by_one_machine_are_read_by_another(store_pair):
    (a, b), (pa, pb) = store_pair
    d = digests(12, salt=str(time.monotonic()))  # fresh keys in a shared store
    keys = [KeyChain.name(x) for x in d]
    src = list(range(12))
    tails = [trailer(a.pages.views(p), x) for p, x in zip(src, d, strict=True)]
    assert a.put(keys[:10], src[:10], tails[:10]) == [True] * 10
    assert a.put(keys[:2], src[:2], tails[:2]) == [True, True]  # again: still stored
    assert b.exists(keys) == [True] * 10 + [False] * 2
    dst = [30 - i for i in range(12)]  # other pages on the other machine
    got = b.get(keys, dst)
    assert got[10:] == [None, None]
    for i in range(10):
        assert verify(b.pages.views(dst[i]), d[i], got[i])
        assert page_bytes(pb, dst[i]) == page_bytes(pa, src[i])
    # a store that checks values as they arrive (Redis) returns verdicts; a rejected value is
    # not written (Mooncake and memory return trailers: the caller checks)
    pb.buffer.numpy()[:] = 0
    seen = []

    def check(i: int, data: memoryview, tail: bytes) -> bool:
        seen.append(i)
        return i != 3 and verify([data], d[i], tail)

    got = b.get(keys, dst, check)
    if seen:
        assert got == [True] * 3 + [False] + [True] * 6 + [None, None]
        assert page_bytes(pb, dst[3]) == bytes(len(page_bytes(pb, dst[3])))
    else:
        assert all(isinstance(t, bytes) for t in got[:10])
    for i in range(10):
        if i != 3 or not seen:
            assert page_bytes(pb, dst[i]) == page_bytes(pa, src[i])


def test_a_value_that_does_not_verify_is_never_taken(store_pair, request):
    (a, b), _ = store_pair
    d = digests(2, salt="corrupt" + str(time.monotonic()))
    keys = [KeyChain.name(x) for x in d]
    # a page stored under another page's key (a writer that got its keys wrong)
    assert a.put([keys[0]], [1], [trailer(a.pages.views(2), d[0])]) == [True]
    got = b.get([keys[0]], [5])
    assert got[0] is not None and not verify(b.pages.views(5), d[0], got[0])
    if "memory" in request.node.name:  # a bit flipped inside the store
        a.put([keys[1]], [2], [trailer(a.pages.views(2), d[1])])
        space("contract").faults.corrupt.add(keys[1])
        got = b.get([keys[1]], [6])
        assert got[0] is not None and not verify(b.pages.views(6), d[1], got[0])


def test_a_dead_redis_node_costs_only_its_own_keys(tmp_path):
    with redis_cluster(tmp_path) as cluster:
        cfg = config()
        pool = filled_pool(cfg, 3)
        store = open_store(cluster.url)
        store.attach(PageSegments(pool))
        d = digests(30)
        keys = [KeyChain.name(x) for x in d]
        tails = [trailer(store.pages.views(i), x) for i, x in enumerate(d)]
        assert all(store.put(keys, list(range(30)), tails))
        cluster.kill(cluster.ports[1])
        started = time.monotonic()
        got = store.get(keys, list(range(30)))
        present = store.exists(keys)
        assert time.monotonic() - started < 2.0
        alive = [g is not None for g in got]
        assert 0 < sum(alive) < 30 and present == alive  # the other nodes' keys still come back
        for i in np.flatnonzero(alive):
            assert verify(store.pages.views(int(i)), d[i], got[i])
        for port in cluster.ports:
            cluster.kill(port)
        with pytest.raises(StoreDown):
            store.get(keys, list(range(30)))
        store.close()


def test_a_dead_mooncake_master_is_store_down_at_once():
    with mooncake_master() as master:
        pool = filled_pool(config(), 4)
        store = open_store(master.url, segment_bytes=16 << 20)
        store.attach(PageSegments(pool))
        d = digests(4)
        keys = [KeyChain.name(x) for x in d]
        assert all(
            store.put(
                keys, [0, 1, 2, 3], [trailer(store.pages.views(i), x) for i, x in enumerate(d)]
            )
        )
        master.kill()
        started = time.monotonic()
        with pytest.raises(StoreDown):
            store.exists(keys)
        with pytest.raises(StoreDown):
            store.get(keys, [4, 5, 6, 7])
        # (the client's own RPC gives up in 1-2 s, up to ~9 s on a loaded machine: far below
        # its reconnect timeouts, which would stall the IO thread for minutes)
        assert time.monotonic() - started < 20.0
        store.close()


def test_bad_store_urls_are_refused_with_the_reason():
    for url, text in [
        ("redis:/x", "SCHEME://ADDRESS"),
        ("s3://bucket", "unknown store"),
        ("redis://host", "HOST:PORT"),
        ("redis://h:99999", "HOST:PORT"),
        ("mooncake://a:1,b:2", "1 to 1"),
    ]:
        with pytest.raises(ValueError, match=text):
            open_store(url)


def test_a_mooncake_batch_of_many_runs_stays_within_the_tcp_queue(mooncake_url):
    """128 pages of 32 runs are 4,224 transfers: the transfer engine queues 1,024 per peer
    and rejects the rest of a call ("queue-full"), so the store splits a batch by that
    budget and every page comes back."""
    cfg = config(num_layers=16, host_tokens=1024)
    pools = [filled_pool(cfg, 11), HostPool(cfg)]
    stores = [open_store(mooncake_url, segment_bytes=32 << 20) for _ in pools]
    try:
        for store, pool in zip(stores, pools, strict=True):
            store.attach(PageSegments(pool))
        a, b = stores
        assert len(a.pages.runs) == 32
        d = digests(128, salt="queue" + str(time.monotonic()))
        keys = [KeyChain.name(x) for x in d]
        tails = [trailer(a.pages.views(p), x) for p, x in enumerate(d)]
        assert a.put(keys, list(range(128)), tails) == [True] * 128
        dst = list(range(128, 256))
        got = b.get(keys, dst)
        assert all(verify(b.pages.views(p), x, t) for p, x, t in zip(dst, d, got, strict=True))
    finally:
        for store in stores:
            store.close()


def test_the_mooncake_batch_budget_follows_the_engine_settings(monkeypatch):
    runs = [32 << 10] * 32  # 32 runs and the trailer: 33 transfers a page (slices do not count)
    assert mooncake_pages_per_call(runs) == 512 // 33
    monkeypatch.setenv("MC_TCP_SLICE_SIZE", str(4 << 10))
    assert mooncake_pages_per_call(runs) == 512 // 33
    for text, queue in [
        ("8192", 8192),
        ("65535", 65535),
        ("70000", 1024),  # the engine takes at most 65535: more means its default
        ("16384 ", 1024),  # as do spaces, signs and other digits, which int() would take
        ("16384\r", 1024),
        ("+8192", 1024),
        ("8_192", 1024),
        ("\u0668\u0661\u0669\u0662", 1024),
        ("0", 1024),
        ("-5", 1024),
        ("junk", 1024),
        ("0" * 4300 + "100", 100),  # (leading zeros are fine, as the engine reads them)
        ("1" * 5000, 1024),  # (int() refuses that many digits)
    ]:
        monkeypatch.setenv("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", text)
        assert mooncake_pages_per_call(runs) == min(512, queue // 2 // 33), text
    monkeypatch.setenv("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "60")
    assert mooncake_pages_per_call(runs) == 1  # at least one page a call
    monkeypatch.delenv("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER")
    assert mooncake_pages_per_call([1]) == 256  # 2 transfers a page: half the queue / 2


class DeadAfter:
    """A Mooncake client whose calls fail whole from call ``n`` on: -800 (a dead peer) for
    every key, or a wrong number of codes (``count``: a code per key plus this many)."""

    def __init__(self, n: int, size: int, count: int = 0):
        self.n, self.size, self.count, self.calls = n, size, count, 0

    def _codes(self, keys: list[str], ok: int) -> list[int]:
        self.calls += 1
        if self.calls <= self.n:
            return [ok] * len(keys)
        return [ok] * max(0, len(keys) + self.count) if self.count else [-800] * len(keys)

    def batch_get_into_multi_buffers(self, keys, ptrs, sizes):
        return self._codes(keys, self.size)

    def batch_put_from_multi_buffers(self, keys, ptrs, sizes, replicate):
        return self._codes(keys, 0)


@pytest.mark.parametrize("count", [0, -4, -1, 1])  # -800 for every key, or too few/many codes
@pytest.mark.parametrize("dead_from", [0, 1, 2])
def test_a_split_mooncake_batch_keeps_what_came_before_a_dead_call(dead_from, count):
    """A batch is split into calls; one that fails whole (or answers with a code list of the
    wrong length) ends the batch: the calls before it count (a fetch keeps the leading
    pages), and only a batch with nothing answered is StoreDown."""
    from hicache.l3.mooncake import MAX_BATCH, TRAILER_BYTES, MooncakeStore

    store = MooncakeStore.__new__(MooncakeStore)  # (no server: the client is the fake)
    store.url, store.per_call, store.replicate = "mooncake://fake:1", 4, None
    store.tails = np.zeros((2, MAX_BATCH, TRAILER_BYTES), dtype=np.uint8)
    store.pages = PageSegments(filled_pool(config(), 5))  # (attach() would register it)
    keys = [f"k{i}" for i in range(10)]
    for call in ("get", "put"):
        store.store = fake = DeadAfter(dead_from, store.pages.page_bytes + TRAILER_BYTES, count)
        args = (keys, list(range(10))) + (([bytes(TRAILER_BYTES)] * 10,) if call == "put" else ())
        if dead_from == 0:
            with pytest.raises(StoreDown):
                getattr(store, call)(*args)
            continue
        got = getattr(store, call)(*args)
        done = [g is not None and g is not False for g in got]
        assert len(got) == 10 and done == [True] * 4 * dead_from + [False] * (10 - 4 * dead_from)
        assert fake.calls == dead_from + 1  # no call after the dead one
