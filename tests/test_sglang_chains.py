"""SGLang's zero-copy calls with prefix keys (``hicache_storage_pass_prefix_keys``): a prompt's
pages are one path in the daemon's tree, so what it holds is prefix-closed by structure, and a
set is one insert. Driven through SGLang's own classes, as tests/test_sglang.py."""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import os
import signal

import numpy as np
import pytest
import torch

from tests import optional

optional.require_module(
    "sglang.srt.mem_cache.hicache_storage", "sglang", "the SGLang storage backend's tests"
)

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo  # noqa: E402

from hicache.client import HiCacheClient  # noqa: E402
from hicache.client.sglang.pages import LAYOUTS, key_words, page_hashes  # noqa: E402
from tests import sglang_rig as rig  # noqa: E402
from tests.daemon_helpers import start_daemon, stop_daemon  # noqa: E402

P = rig.PAGE


def after(keys: list[str]) -> HiCacheStorageExtraInfo:
    """SGLang's extra_info for a call whose keys follow ``keys``."""
    return HiCacheStorageExtraInfo(prefix_keys=list(keys))


def tokens(n_pages: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 50000, n_pages * P).tolist()


def stats(endpoint: str) -> dict:
    with HiCacheClient(endpoint, name="probe") as hc:
        out = hc.stats(check=True)
    assert out["integrity"] == "ok"
    return out


@pytest.fixture
def ep(tmp_path):
    endpoint = f"ipc://{tmp_path}/h.sock"
    proc = start_daemon(endpoint, "--device-tier", "engine", "--host-bytes", "1MiB")
    try:
        yield endpoint
    finally:
        stop_daemon(proc)


@pytest.fixture
def store(ep):
    _, host = rig.host_pool("page_first")
    rig.fill(host, seed=40)
    be = rig.backend(host, rig.extra_config(ep, chains=True, **{"hicache.pin_s": 600}))
    try:
        yield be, host
    finally:
        be.close()


def page(host, index) -> torch.Tensor:
    return rig.canonical_page(host, int(index))


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_chains_written_by_one_controller_are_prefetched_mid_chain_by_another_process(
    tmp_path, mla
):
    """SGLang's controllers with prefix keys: the writer backs the prompt up from its first
    page, a reader in another process (another host layout) asks from its own host hit on."""
    endpoint = f"ipc://{tmp_path}/h.sock"
    proc = start_daemon(endpoint, "--device-tier", "engine", "--host-bytes", "1MiB")
    spawn = mp.get_context("spawn")
    try:
        with cf.ProcessPoolExecutor(1, mp_context=spawn) as other:
            for i, layout in enumerate(LAYOUTS):
                prompt = tokens(6, seed=50 + i)
                done, written = rig.write_through(
                    endpoint, layout, mla, True, prompt, seed=i, chain=True
                )
                assert done == len(prompt)
                reader = LAYOUTS[(i + 1) % len(LAYOUTS)]
                more = prompt + tokens(2, seed=98)  # two pages nobody wrote
                got, read = other.submit(
                    rig.read_through, endpoint, reader, mla, True, more, chain=True, skip=2
                ).result(timeout=120)
                assert got == len(prompt) - 2 * P, layout
                for a, b in zip(read, written[2:], strict=True):
                    assert torch.equal(a, b), (layout, reader)
                # the same prompt without prefix keys is another namespace: not found
                got, _ = other.submit(rig.read_through, endpoint, reader, mla, True, prompt).result(
                    timeout=120
                )
                assert got == 0
        assert stats(endpoint)["host_cached_tokens"] == 3 * 6 * P
    finally:
        stop_daemon(proc)


def test_a_chain_is_found_whatever_split_the_calls_use_and_sets_store_what_lacks(ep, store):
    be, host = store
    keys = rig.chain_hashes(tokens(8, seed=41))
    src = host.alloc(8 * P)
    assert be.batch_set_v1(keys[:3], src[: 3 * P], after([])) == [True] * 3
    assert be.batch_set_v1(keys[3:6], src[3 * P : 6 * P], after(keys[:3])) == [True] * 3
    assert stats(ep)["host_cached_tokens"] == 6 * P
    # a set that repeats held pages copies only the rest (one insert, pages per call)
    assert be.batch_set_v1(keys[2:8], src[2 * P :], after(keys[:2])) == [True] * 6
    assert stats(ep)["host_cached_tokens"] == 8 * P
    assert be.get_stats().backup_pgs == [3, 3, 2]
    for start in (0, 1, 5, 7):
        assert be.batch_exists(keys[start:], after(keys[:start])) == 8 - start
        dst = host.alloc((8 - start) * P)
        assert be.batch_get_v1(keys[start:], dst, after(keys[:start])) == [True] * (8 - start)
        for i in range(8 - start):
            assert torch.equal(page(host, dst[i * P]), page(host, src[(start + i) * P]))
        host.free(dst)
    # a get with no pin (another split than the lookup's) matches the chain itself
    dst = host.alloc(3 * P)
    assert be.batch_get_v1(keys[4:7], dst, after(keys[:4])) == [True] * 3
    assert torch.equal(page(host, dst[2 * P]), page(host, src[6 * P]))
    assert be.pinned() == 0 and be.link.failures == 0


def test_a_set_below_a_prefix_the_daemon_lacks_stores_nothing(ep, store):
    """A page is never held without its prefix: a set whose prefix is gone answers True (as
    a page stored and evicted at once) and changes nothing."""
    be, host = store
    keys = rig.chain_hashes(tokens(6, seed=42))
    src = host.alloc(6 * P)
    assert be.batch_set_v1(keys[:2], src[: 2 * P], after([])) == [True] * 2
    assert be.batch_set_v1(keys[3:], src[3 * P :], after(keys[:3])) == [True] * 3
    assert stats(ep)["host_cached_tokens"] == 2 * P
    assert be.chains.orphans == 3
    assert be.batch_exists(keys[3:], after(keys[:3])) == 0
    assert be.batch_exists(keys, after([])) == 2


def test_the_daemon_keeps_a_chain_prefix_closed_under_pressure(tmp_path):
    """Eviction takes a chain's last pages first (leaves), and pinned ones never: whatever
    the daemon holds of a chain is its first pages."""
    endpoint = f"ipc://{tmp_path}/h.sock"
    proc = start_daemon(endpoint, "--device-tier", "engine", "--host-tokens", str(10 * P))
    _, host = rig.host_pool("page_first")
    be = rig.backend(host, rig.extra_config(endpoint, chains=True))
    try:
        chains = [rig.chain_hashes(tokens(6, seed=60 + i)) for i in range(5)]
        rng = np.random.default_rng(7)
        partial = 0  # chains seen with some pages held, not all
        for step in range(40):
            keys = chains[int(rng.integers(5))]
            n = int(rng.integers(1, 7))
            src = host.alloc(n * P)
            assert be.batch_set_v1(keys[:n], src, after([])) == [True] * n
            host.free(src)
            for other in chains:  # held pages of every chain are its first ones
                held = [be.batch_exists(other[i : i + 1], after(other[:i])) for i in range(6)]
                run = held.index(0) if 0 in held else 6
                assert held == [1] * run + [0] * (6 - run), (step, held)
                partial += 0 < run < 6
                be._release(be.pins.drain())
        assert stats(endpoint)["host_cached_tokens"] <= 10 * P
        assert partial >= 20  # (eviction cut chains: the rule was exercised)
    finally:
        be.close()
        stop_daemon(proc)


def test_a_lookup_pins_its_chain_until_the_get(ep, store):
    be, host = store
    keys = rig.chain_hashes(tokens(4, seed=43))
    assert be.batch_set_v1(keys[:3], host.alloc(3 * P), after([])) == [True] * 3
    assert be.batch_exists(keys[1:], after(keys[:1])) == 2
    with HiCacheClient(ep, name="admin", admin=True) as admin:
        admin.flush()  # the pinned chain survives
        assert stats(ep)["host_cached_tokens"] == 3 * P
        assert be.batch_get_v1(keys[1:3], host.alloc(2 * P), after(keys[:1])) == [True] * 2
        assert be.pinned() == 0
        # the get released it: a release posted on the backend's connection, which the
        # daemon serves in order but not before the admin's: a call there returns after it
        assert be.link.call(lambda c: c.holdings()).lock_ids == []
        admin.flush()
        assert stats(ep)["host_cached_tokens"] == 0
    assert be.batch_exists(keys, after([])) == 0
    assert be.pinned() == 0  # a lookup that found nothing holds nothing


def test_bad_prefix_keys_are_a_miss_and_change_nothing(ep, store, caplog):
    be, host = store
    keys = rig.chain_hashes(tokens(3, seed=44))
    src = host.alloc(3 * P)
    assert be.batch_set_v1(keys, src, after([])) == [True] * 3
    before = stats(ep)["host_cached_tokens"]
    bad_infos = [
        after(["zz" * 32]),
        after([keys[0][:-1]]),
        HiCacheStorageExtraInfo(prefix_keys="ab" * 32),  # a string, not a list
        after([7]),
    ]
    for info in bad_infos:
        assert be.batch_exists(keys[1:], info) == 0
        assert be.batch_set_v1(keys[1:], src[P:], info) == [False] * 2
        assert be.batch_get_v1(keys[1:], host.alloc(2 * P), info) == [False] * 2
    assert be.batch_set_v1([os.urandom(31).hex() + "x"], src[:P], after([])) == [False]
    assert stats(ep)["host_cached_tokens"] == before
    assert be.pinned() == 0 and be.link.failures == 0
    assert "not a 64-hex-digit page hash" in caplog.text
    assert "prefix_keys must be a list" in caplog.text


def test_the_generic_path_keys_pages_one_by_one_even_when_sglang_passes_a_prefix(ep):
    """SGLang's generic gets and sets carry no prefix: a backend on that path ignores the
    lookup's, or its gets would never find what its sets stored."""
    _, host = rig.host_pool("page_first")
    rig.fill(host, seed=45)
    be = rig.backend(host, rig.extra_config(ep, chains=True, v1=False))
    try:
        keys = rig.chain_hashes(tokens(3, seed=45))
        src = host.alloc(3 * P)
        flat = [host.get_data_page(int(src[i * P])) for i in range(3)]
        assert be.batch_set(keys, flat)
        assert be.batch_exists(keys[1:], after(keys[:1])) == 2
        out = [torch.zeros_like(f) for f in flat[1:]]
        assert all(t is not None for t in be.batch_get(keys[1:], out))
        assert all(torch.equal(a, b) for a, b in zip(out, flat[1:], strict=True))
    finally:
        be.close()


def test_kv_events_name_sglangs_page_hashes_and_a_chain_links_its_pages(tmp_path):
    """A router reads SGLang's own page hashes out of the events (``page_hashes``), and a
    chain's blocks link parent to child as token prompts' do."""
    from tests.optional import require_module

    require_module("vllm.distributed.kv_events", "vllm", "decoding events as vLLM does")
    from tests.test_kv_events import ask, rebuild

    ep = f"ipc://{tmp_path}/h.sock"
    replay = f"ipc://{tmp_path}/replay.sock"
    proc = start_daemon(
        ep, "--device-tier", "engine", "--host-bytes", "1MiB",
        "--events-endpoint", f"ipc://{tmp_path}/pub.sock", "--events-replay-endpoint", replay,
    )  # fmt: skip
    page = 9  # (from 9 tokens on a page's words hold its whole hash)
    _, host = rig.host_pool("page_first", pages=8, page=page)
    be = rig.backend(host, rig.extra_config(ep, chains=True))
    try:
        keys = [os.urandom(32).hex() for _ in range(3)]
        assert be.batch_set_v1(keys, host.alloc(3 * page), after([])) == [True] * 3
        model = rebuild(ask(replay, b"dump"))
        blocks = model.blocks["CPU"]
        by_hash = {h: page_hashes(tokens, page)[0] for h, (_, tokens) in blocks.items()}
        assert sorted(by_hash.values()) == sorted(keys)
        parents = {by_hash[h]: parent for h, (parent, _) in blocks.items()}
        key_of = {v: k for k, v in by_hash.items()}
        assert parents[keys[0]] is None
        assert parents[keys[1]] == key_of[keys[0]] and parents[keys[2]] == key_of[keys[1]]
    finally:
        be.close()
        stop_daemon(proc)


def test_page_hashes_undo_key_words_from_a_page_of_nine_tokens_on():
    keys = [os.urandom(32).hex() for _ in range(4)]
    for size in (9, 16, 64):
        assert page_hashes(key_words(keys, size).reshape(-1), size) == keys
    with pytest.raises(ValueError, match="holds 248 of a hash's bits"):
        page_hashes(key_words(keys, 8).reshape(-1), 8)
    for bad in ([1] * 10, [-1] * 9, [1 << 31] + [0] * 8):
        with pytest.raises(ValueError, match="whole pages of 9 31-bit words"):
            page_hashes(bad, 9)


def test_a_daemon_killed_during_a_chain_get_or_set_fails_that_call_only(tmp_path, monkeypatch):
    """Misses and False, never an exception; nothing half-written is readable; the next
    daemon gets a new session and the layout again by itself."""
    endpoint = f"ipc://{tmp_path}/h.sock"
    start = ("--device-tier", "engine", "--host-bytes", "1MiB")
    proc = start_daemon(endpoint, *start)
    _, host = rig.host_pool("page_first")
    be = rig.backend(host, rig.extra_config(endpoint, chains=True, **{"hicache.retry_s": 0}))
    try:
        rig.fill(host, seed=46)
        keys = rig.chain_hashes(tokens(4, seed=46))
        src = host.alloc(4 * P)
        assert be.batch_set_v1(keys[:2], src[: 2 * P], after([])) == [True] * 2
        assert be.batch_exists(keys[:2], after([])) == 2
        from hicache.client.sglang import chains

        real, state = chains.copy_pages, {"proc": proc}

        def copy_then_die(*args):  # the daemon dies while the pages are being copied
            real(*args)
            os.kill(state["proc"].pid, signal.SIGKILL)
            state["proc"].wait()

        monkeypatch.setattr(chains, "copy_pages", copy_then_die)
        # the pages were pinned, and the session surely alive, until the copy ended: they are
        # read (the release after it is not waited for), and nobody could write them
        got = host.alloc(2 * P)
        assert be.batch_get_v1(keys[:2], got, after([])) == [True] * 2
        assert torch.equal(page(host, got[P]), page(host, src[P]))
        assert be.batch_exists(keys, after([])) == 0  # down: a miss
        state["proc"] = proc = start_daemon(endpoint, *start)
        assert be.batch_set_v1(keys, src, after([])) == [False] * 4  # killed before its insert
        monkeypatch.setattr(chains, "copy_pages", real)
        proc = start_daemon(endpoint, *start)
        assert be.batch_exists(keys, after([])) == 0  # nothing half-written is readable
        assert be.batch_set_v1(keys, src, after([])) == [True] * 4
        dst = host.alloc(4 * P)
        assert be.batch_exists(keys[1:], after(keys[:1])) == 3
        assert be.batch_get_v1(keys[1:], dst[: 3 * P], after(keys[:1])) == [True] * 3
        assert torch.equal(page(host, dst[2 * P]), page(host, src[3 * P]))
    finally:
        be.close()
        stop_daemon(proc)


def test_a_long_chain_is_stored_in_batches_without_its_prefix_charged_to_the_rank(tmp_path):
    """A set locks nothing: storing a chain of most of the pool, a batch at a time, never
    counts the pages already stored against the rank's share (75% of 120 pages)."""
    endpoint = f"ipc://{tmp_path}/h.sock"
    proc = start_daemon(endpoint, "--device-tier", "engine", "--host-tokens", str(120 * P))
    _, host = rig.host_pool("page_first", pages=160)
    be = rig.backend(host, rig.extra_config(endpoint, chains=True))
    try:
        keys = rig.chain_hashes(tokens(100, seed=47))
        src = host.alloc(100 * P)
        for at in range(0, 100, 20):
            got = be.batch_set_v1(keys[at : at + 20], src[at * P : (at + 20) * P], after(keys[:at]))
            assert got == [True] * 20, at
        assert stats(endpoint)["host_cached_tokens"] == 100 * P
        assert be.batch_exists(keys[40:80], after(keys[:40])) == 40
        dst = host.alloc(40 * P)  # (a read pins its path, prefix too: 80 of the 90 allowed)
        assert be.batch_get_v1(keys[40:80], dst, after(keys[:40])) == [True] * 40
        assert torch.equal(page(host, dst[39 * P]), page(host, src[79 * P]))
    finally:
        be.close()
        stop_daemon(proc)


def test_a_pin_is_used_only_by_a_get_of_its_own_path(ep, store):
    """A caller whose prefix is not the chain's (SGLang never does this) gets what its keys
    name, or a miss: never the page at another depth of the pinned path."""
    be, host = store
    keys = rig.chain_hashes(tokens(4, seed=48))
    src = host.alloc(4 * P)
    assert be.batch_set_v1(keys, src, after([])) == [True] * 4
    assert be.batch_exists(keys, after([])) == 4
    dst = host.alloc(P)
    assert be.batch_get_v1(keys[-1:], dst, after([])) == [False]  # keys[3] is no first page
    assert be.batch_exists(keys, after([])) == 4
    assert be.batch_get_v1(keys[-1:], dst, after(keys[:3])) == [True]
    assert torch.equal(page(host, dst[0]), page(host, src[3 * P]))
    assert be.pinned() == 0
    assert be.link.call(lambda c: c.holdings()).lock_ids == []  # (after the posted releases)
    with HiCacheClient(ep, name="probe") as hc:
        locks = [s["locks"] for s in hc.stats()["session_list"] if s["client"] != "probe"]
    assert locks == [0]


def test_a_lookup_that_finds_only_the_prefix_pins_nothing(ep, store):
    be, host = store
    keys = rig.chain_hashes(tokens(4, seed=49))
    assert be.batch_set_v1(keys[:2], host.alloc(2 * P), after([])) == [True] * 2
    assert be.batch_exists(keys[2:], after(keys[:2])) == 0
    assert be.pinned() == 0
    with HiCacheClient(ep, name="probe") as hc:
        locks = [s["locks"] for s in hc.stats()["session_list"] if s["client"] != "probe"]
    assert locks == [0]


def test_keys_that_are_not_a_list_or_are_str_subclasses(ep, store):
    """What is not a list of keys is a miss or False on the chain path too, never an
    exception in SGLang's threads; a str subclass (numpy's) is a key like any other."""
    be, host = store
    keys = rig.chain_hashes(tokens(2, seed=50))
    src = host.alloc(2 * P)
    assert be.batch_set_v1([np.str_(k) for k in keys], src, after([])) == [True] * 2
    assert be.batch_exists(keys, after([])) == 2
    assert be.batch_get_v1(keys, host.alloc(2 * P), after([])) == [True] * 2
    for bad in ({keys[0]: 1}, set(keys[:1]), iter(keys[:1])):
        assert be.batch_exists(bad, after([])) == 0
        assert be.batch_get_v1(bad, host.alloc(P), after([])) == [False]
        assert be.batch_set_v1(bad, src[:P], after([])) == [False]
    assert be.pinned() == 0


def test_no_allocation_of_the_backend_falls_between_a_chain_sets_match_and_insert(
    ep, store, monkeypatch
):
    """A chain set matches without a lock and names the held pages in its insert: a prefix page
    evicted meanwhile and given to this very session would pass as the chain's. So the
    backend's other sets (the generic path's, another thread's) wait for the insert."""
    import threading

    from hicache.client.client import HiCacheClient as Client
    from hicache.client.sglang import chains

    be, host = store
    order: list[str] = []
    for name in ("match_and_alloc_batch", "insert", "insert_batch"):  # (every allocation)
        real = getattr(Client, name)

        def traced(self, *a, _real=real, _name=name, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            order.append(f"{threading.current_thread().name}:{_name}")
            return _real(self, *a, **k)

        monkeypatch.setattr(Client, name, traced)
    in_window, other_allocated = threading.Event(), threading.Event()
    real_copy = chains.copy_pages

    def copy_in_window(*args):  # (between the chain set's allocation and its insert)
        in_window.set()
        other_allocated.wait(1.0)  # it must not come: the other set waits for the insert
        real_copy(*args)

    monkeypatch.setattr(chains, "copy_pages", copy_in_window)
    keys = rig.chain_hashes(tokens(2, seed=51))
    other = [os.urandom(32).hex()]

    def one_page_set() -> None:
        in_window.wait(10)
        assert be.batch_set(other, [host.get_data_page(int(host.alloc(P)[0]))])  # (generic)
        other_allocated.set()

    thread = threading.Thread(target=one_page_set, name="other")
    thread.start()
    threading.current_thread().name, name = "chain", threading.current_thread().name
    try:
        assert be.batch_set_v1(keys, host.alloc(2 * P), after([])) == [True] * 2
    finally:
        threading.current_thread().name = name
        thread.join(10)
    assert order == [
        "chain:match_and_alloc_batch",
        "chain:insert",
        "other:match_and_alloc_batch",
        "other:insert_batch",
    ]


def test_a_lookup_from_the_prompts_start_without_a_prefix_finds_the_chain_sets_stored(ep, store):
    """SGLang 0.5.23's served server asks ``batch_exists`` with ``prefix_keys=None`` when
    nothing precedes the keys, and passes ``[]`` to the get and the sets of the same pages: a
    chain backend takes both as the prompt's start (the mode is the configuration's)."""
    be, host = store
    keys = rig.chain_hashes(tokens(4, seed=61))
    src = host.alloc(4 * P)
    assert be.batch_set_v1(keys, src, after([])) == [True] * 4
    assert be.batch_exists(keys, None) == 4
    dst = host.alloc(4 * P)
    assert be.batch_get_v1(keys, dst, after([])) == [True] * 4
    for i in range(4):
        assert torch.equal(page(host, dst[i * P]), page(host, src[i * P]))
    assert be.batch_exists(keys[2:], after(keys[:2])) == 2  # mid-chain, as before


def test_one_page_keys_never_use_a_prefix_sglang_passes(ep):
    """Without ``hicache_storage_pass_prefix_keys`` every call keys pages one by one, whatever
    a call passes: what a set stored is found by a lookup with or without a prefix."""
    _, host = rig.host_pool("page_first")
    rig.fill(host, seed=62)
    be = rig.backend(host, rig.extra_config(ep))
    try:
        keys = rig.chain_hashes(tokens(3, seed=62))
        assert be.batch_set_v1(keys, host.alloc(3 * P), after([])) == [True] * 3
        assert be.batch_exists(keys, None) == 3
        assert be.batch_exists(keys[1:], after(keys[:1])) == 2
        assert be.batch_get_v1(keys[1:], host.alloc(2 * P), None) == [True] * 2
    finally:
        be.close()


def test_the_key_mode_is_read_from_the_configuration(monkeypatch):
    """Where SGLang leaves the setting in the extra config (its cache controller as a library)
    it is read there; else from the server's own extra config, which SGLang's server strips
    before it builds the backend; neither: one-page keys."""
    from types import SimpleNamespace

    from hicache.client.sglang import key_mode as km

    chains, pages = km.KeyMode.CHAINS, km.KeyMode.PAGE_KEYS
    on = {"interface_v1": 1, km.SETTING: True}
    assert km.key_mode(on)[0] is chains
    assert km.key_mode({**on, km.SETTING: False})[0] is pages
    assert km.key_mode({**on, "interface_v1": 0})[0] is pages  # (generic calls: no prefix)
    with pytest.raises(ValueError, match="true or false"):
        km.key_mode({**on, km.SETTING: "yes"})
    assert km.key_mode({"interface_v1": 1})[0] is pages  # no server in this process
    import sglang.srt.runtime_context as rc

    for raw, want in (('{"hicache_storage_pass_prefix_keys": true}', chains), ("{}", pages)):
        bag = SimpleNamespace(hicache_storage_backend_extra_config=raw)
        monkeypatch.setattr(rc, "get_memory", lambda bag=bag: bag)
        mode, where = km.key_mode({"interface_v1": 1})
        assert mode is want and "server" in where
