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
    be = rig.backend(host, rig.extra_config(ep, **{"hicache.pin_s": 600}))
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
    be = rig.backend(host, rig.extra_config(endpoint))
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
        admin.flush()  # the get released it
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
    be = rig.backend(host, rig.extra_config(ep, v1=False))
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
    be = rig.backend(host, rig.extra_config(ep))
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
    be = rig.backend(host, rig.extra_config(endpoint, **{"hicache.retry_s": 0}))
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
        assert be.batch_get_v1(keys[:2], host.alloc(2 * P), after([])) == [False] * 2
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
