"""SGLang's storage plug on hicache-daemon, driven through SGLang's own classes (its backend
factory, host pools, and HiCacheController with its threads): pages one controller writes
are prefetched byte-identical by another process, in every host layout, MHA and MLA, zero-copy
and generic paths; failures are misses; hostile input changes nothing."""

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
from hicache.client.sglang import StoreSettings  # noqa: E402
from hicache.client.sglang.pages import (  # noqa: E402
    LAYOUTS,
    copy_pages,
    daemon_view,
    folded,
    host_view,
    key_words,
    page_format,
)
from tests import sglang_rig as rig  # noqa: E402
from tests.daemon_helpers import start_daemon, stop_daemon, wait_until  # noqa: E402

ENGINE = ("--device-tier", "engine", "--host-bytes", "1MiB")


def daemon(endpoint: str, *extra: str):
    return start_daemon(endpoint, *ENGINE, *extra)


@pytest.fixture
def ep(tmp_path):
    endpoint = f"ipc://{tmp_path}/h.sock"
    proc = daemon(endpoint)
    try:
        yield endpoint
    finally:
        stop_daemon(proc)


@pytest.fixture(scope="module")
def other_process():
    """A second process (spawned: nothing shared with this one but the daemon)."""
    with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        yield pool


def tokens(n_pages: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 50000, n_pages * rig.PAGE).tolist()


def cached_tokens(endpoint: str) -> int:
    with HiCacheClient(endpoint, name="probe") as hc:
        stats = hc.stats(check=True)
    assert stats["integrity"] == "ok"
    return stats["host_cached_tokens"]


# ---- the page format, without a daemon -------------------------------------------------------
@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_views_address_every_element_as_sglangs_own_page_accessor(layout, mla):
    _, host = rig.host_pool(layout, mla, pages=8)
    rig.fill(host, seed=1)
    fmt = page_format(host, rig.MODEL)
    view = host_view(fmt, layout, host.kv_buffer)
    pages = host.size // rig.PAGE
    pool = torch.zeros((pages + 1) * fmt.engine_layout().page_elems, dtype=host.kv_buffer.dtype)
    dview = daemon_view(fmt, layout, pool)
    if folded(layout):
        assert view.shape == (fmt.kv, 1, pages, rig.PAGE, rig.LAYERS * fmt.width)
    else:
        assert view.shape == (fmt.kv, rig.LAYERS, pages, rig.PAGE, fmt.width)
    copy_pages(view, dview, np.arange(pages), np.arange(pages) + 1)
    flat_pool = pool.view(pages + 1, fmt.kv, rig.PAGE, rig.LAYERS, fmt.width)  # the format
    for page in (0, 3, pages - 1):
        expected = rig.canonical_page(host, page * rig.PAGE)  # [kv, L, P, W]
        assert torch.equal(flat_pool[page + 1].permute(0, 2, 1, 3), expected)
        flat = host.get_data_page(page * rig.PAGE, flat=True)
        assert torch.equal(host_view(fmt, layout, flat)[:, :, 0], view[:, :, page])


def test_page_keys_are_sglangs_hashes_as_31_bit_words():
    keys = rig.chain_hashes(list(range(40)))
    assert len(keys) == 10 and len(set(keys)) == 10
    for page in (2, 4, 8, 9, 64):
        words = key_words(keys, page)
        assert words.shape == (10, page) and words.dtype == np.int32 and (words >= 0).all()
        assert len({w.tobytes() for w in words}) == 10
    full = key_words(keys, 9)  # 9 words of 31 bits hold all 256 bits: the digest comes back
    digest = bytes.fromhex(keys[0])
    high = [(int(full[0, 8]) >> i) & 1 for i in range(8)]
    rebuilt = b"".join(((int(full[0, i]) | (high[i] << 31)).to_bytes(4, "big")) for i in range(8))
    assert rebuilt == digest
    for bad in ["ab" * 31, "zz" * 32, 7, None, "AB" * 32 + "0"]:
        with pytest.raises(ValueError, match="not a 64-hex-digit page hash"):
            key_words(keys[:1] + [bad], 4)


def test_settings_refuse_unknown_keys_and_bad_values_and_leave_sglangs_keys_alone():
    base = rig.extra_config("ipc:///tmp/x.sock")
    s = StoreSettings.from_extra({**base, "hicache.pin_s": "3", "prefetch_threshold": 8})
    assert s.endpoint == "ipc:///tmp/x.sock" and s.pin_s == 3.0
    for key, value, what in [
        ("hicache.pin", 1, "unknown key 'hicache.pin'"),
        ("hicache.pin_s", 0, "pin_s=0.0 must be in"),
        ("hicache.timeout_s", "soon", "is not a float"),
        ("hicache.endpoint", "http://x", "is not ipc://PATH"),
        ("hicache.endpoint", "tcp://10.1.2.3:5555", "another host"),
        ("pin_s", 3, "'pin_s' is not read .did you mean 'hicache.pin_s'"),
        ("hicahce.pin_s", 3, "'hicahce.pin_s' is not read .did you mean 'hicache.pin_s'"),
        ("endpoint", "ipc:///x", "did you mean 'hicache.endpoint'"),
    ]:
        with pytest.raises(ValueError, match=what):
            StoreSettings.from_extra({**base, key: value})
    with pytest.raises(ValueError, match="hicache.pin_s"):
        rig.backend(rig.host_pool("page_first")[1], {**base, "hicache.pin_s": -1})


def test_a_page_size_of_one_token_or_another_layout_is_refused_clearly():
    _, host = rig.host_pool("page_first")
    host.page_size = 1
    with pytest.raises(ValueError, match="page size is 1"):
        page_format(host, "m")
    host.page_size, host.layout = rig.PAGE, "page_head"
    with pytest.raises(ValueError, match="'page_head' is not one of"):
        page_format(host, "m")
    from sglang.srt.mem_cache.hicache_storage import PoolName

    host.layout = "page_first"
    be = rig.backend(host, rig.extra_config("ipc:///nonexistent/h.sock"))
    be.register_mem_host_pool_v2(host, PoolName.KV)  # the KV pool itself: fine
    with pytest.raises(ValueError, match="mamba pool .* not supported"):
        be.register_mem_host_pool_v2(host, PoolName.MAMBA)
    be.close()


# ---- through a daemon, with SGLang's controller ------------------------------------------------
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_pages_written_by_one_controller_are_prefetched_by_another_process(
    tmp_path, other_process, mla
):
    """Every host layout, zero-copy and generic: the writer's layout and the reader's differ
    (the daemon keeps one page format), and the bytes are the writer's."""
    endpoint = f"ipc://{tmp_path}/h.sock"
    proc = daemon(endpoint)
    try:
        for i, layout in enumerate(LAYOUTS):
            reader_layout = LAYOUTS[(i + 1) % len(LAYOUTS)]
            for v1 in (True, False):
                prompt = tokens(5, seed=10 * i + v1)
                done, written = rig.write_through(endpoint, layout, mla, v1, prompt, seed=i)
                assert done == len(prompt)
                more = prompt + tokens(2, seed=99)  # two pages nobody wrote
                got, read = other_process.submit(
                    rig.read_through, endpoint, reader_layout, mla, not v1, more
                ).result(timeout=120)
                assert got == len(prompt), (layout, v1)
                assert len(read) == len(written)
                for a, b in zip(read, written, strict=True):
                    assert torch.equal(a, b), (layout, reader_layout, v1)
        assert cached_tokens(endpoint) == 6 * 5 * rig.PAGE
    finally:
        stop_daemon(proc)


def test_a_second_writer_stores_only_what_the_daemon_lacks_and_tp_ranks_stay_apart(ep):
    _, host = rig.host_pool("page_first")
    rig.fill(host, seed=3)
    keys = rig.chain_hashes(tokens(6, seed=3))
    src = host.alloc(6 * rig.PAGE)
    rank0 = rig.backend(host, rig.extra_config(ep), tp_rank=0, tp_size=2)
    rank1 = rig.backend(host, rig.extra_config(ep), tp_rank=1, tp_size=2)
    try:
        assert rank0.batch_set_v1(keys[:4], src[: 4 * rig.PAGE]) == [True] * 4
        assert rank0.batch_exists(keys) == 4
        assert rank1.batch_exists(keys) == 0  # rank 1's shard is another page: not found
        stage1 = rig.backend(host, rig.extra_config(ep), tp_size=2, pp_rank=1, pp_size=2)
        try:  # another pipeline stage (another part of the layers) finds nothing either
            assert stage1.batch_exists(keys) == 0
        finally:
            stage1.close()
        assert cached_tokens(ep) == 4 * rig.PAGE
        assert rank0.batch_set_v1(keys, src) == [True] * 6
        assert cached_tokens(ep) == 6 * rig.PAGE  # the 4 it had were not stored again
        stats = rank0.get_stats()
        assert stats.backup_pgs == [4, 2]  # pages copied per call
    finally:
        rank0.close()
        rank1.close()


def test_mla_ranks_share_one_page_and_only_the_writer_stores(ep):
    _, host = rig.host_pool("layer_first", mla=True)
    rig.fill(host, seed=4)
    keys = rig.chain_hashes(tokens(3, seed=4))
    src = host.alloc(3 * rig.PAGE)
    rank0 = rig.backend(host, rig.extra_config(ep), mla=True, tp_rank=0, tp_size=2)
    rank1 = rig.backend(host, rig.extra_config(ep), mla=True, tp_rank=1, tp_size=2)
    try:
        assert rank1.batch_set_v1(keys, src) == [True] * 3  # not the writer: nothing stored
        assert rank1.batch_exists(keys) == 0
        assert rank0.batch_set_v1(keys, src) == [True] * 3
        assert rank1.batch_exists(keys) == 3  # every rank reads rank 0's page
        dst = host.alloc(3 * rig.PAGE)
        assert rank1.batch_get_v1(keys, dst) == [True] * 3
        for i in range(3):
            a = rig.canonical_page(host, int(src[i * rig.PAGE]))
            assert torch.equal(a, rig.canonical_page(host, int(dst[i * rig.PAGE])))
    finally:
        rank0.close()
        rank1.close()


def test_exists_pins_pages_until_the_get_and_releases_the_rest(ep):
    _, host = rig.host_pool("page_first")
    be = rig.backend(host, rig.extra_config(ep, **{"hicache.pin_s": 600}))
    try:
        keys = rig.chain_hashes(tokens(4, seed=5))
        assert be.batch_set_v1(keys[:3], host.alloc(3 * rig.PAGE)) == [True] * 3
        assert be.batch_exists(keys) == 3
        with HiCacheClient(ep, name="admin", admin=True) as admin:
            admin.flush()  # pinned pages survive a flush
            assert cached_tokens(ep) == 3 * rig.PAGE
            assert be.batch_get_v1(keys[:3], host.alloc(3 * rig.PAGE)) == [True] * 3
            # the get posted its release on the backend's connection, which the daemon serves
            # in order but not before the admin's: a call there returns after the release
            assert be.link.call(lambda c: c.holdings()).lock_ids == []
            admin.flush()  # the get released them
            assert cached_tokens(ep) == 0
            assert be.batch_exists(keys) == 0
    finally:
        be.close()


def test_the_daemons_pool_is_made_and_mapped_while_sglang_starts_not_in_a_request(ep):
    """Registering SGLang's host pool connects, registers the layout (the daemon's first
    registration makes its pool) and maps the pool before it returns (SGLang's start), so
    the first requests' lookups do not wait for it on a thread SGLang's loop starves."""
    _, host = rig.host_pool("page_first")
    be = rig.backend(host, rig.extra_config(ep))
    try:
        assert be.link.client is not None and be.link.client.pools is not None
        with HiCacheClient(ep, name="probe") as hc:
            sessions = hc.stats()["session_list"]
            assert [s for s in sessions if s["client"].startswith("sglang")], sessions
            assert hc.layout is not None  # (registered: the pool exists)
    finally:
        be.close()


def test_a_lookup_that_finds_nothing_holds_nothing(ep):
    _, host = rig.host_pool("page_first")
    be = rig.backend(host, rig.extra_config(ep))
    try:
        assert be.batch_exists(rig.chain_hashes(tokens(8, seed=15))) == 0
        with HiCacheClient(ep, name="probe") as hc:
            (me,) = [s for s in hc.stats()["session_list"] if s["client"].startswith("sglang")]
            assert me["locks"] == 0 and be.pinned() == 0
            m = hc.match_prefix(tokens(2, seed=16))
            assert m.lock_id == 0 and hc.holdings().lock_ids == []
            assert hc.lock(m) is m  # nothing to lock: the same (empty) match
            hc.release(m)  # (a no-op)
            from hicache.protocol import Op

            hc._call(Op.RELEASE, {"lock_ids": [0]})  # a raw client sending "no lock" back: fine
    finally:
        be.close()


def test_pins_no_get_took_are_released_after_pin_s(ep):
    _, host = rig.host_pool("page_first")
    be = rig.backend(host, rig.extra_config(ep, **{"hicache.pin_s": 0.2}))
    try:
        keys = rig.chain_hashes(tokens(2, seed=6))
        assert be.batch_set_v1(keys, host.alloc(2 * rig.PAGE)) == [True] * 2
        assert be.batch_exists(keys) == 2  # ... and SGLang never asks for them
        with HiCacheClient(ep, name="admin", admin=True) as admin:
            admin.flush()
            assert cached_tokens(ep) == 2 * rig.PAGE  # pinned
            wait_until(lambda: be.batch_exists([]) == 0 and not be.pinned(), what="pins")
            admin.flush()
            assert cached_tokens(ep) == 0
    finally:
        be.close()


def test_hostile_input_is_a_miss_or_false_and_changes_nothing(ep, caplog):
    _, host = rig.host_pool("page_first", pages=16)
    be = rig.backend(host, rig.extra_config(ep))
    try:
        keys = rig.chain_hashes(tokens(2, seed=7))
        src = host.alloc(2 * rig.PAGE)
        assert be.batch_set_v1(keys, src) == [True, True]
        before = cached_tokens(ep)
        beyond = torch.arange(host.size, host.size + 2 * rig.PAGE)
        other = rig.chain_hashes(tokens(2, seed=8))
        cases = [
            ("not hashes", lambda: be.batch_set_v1(["../../etc", "x"], src), [False, False]),
            ("not hashes", lambda: be.batch_exists(["f" * 63, keys[0]]), 0),
            ("not hashes", lambda: be.batch_get_v1([b"x" * 32, keys[1]], src), [False, False]),
            ("wrong count", lambda: be.batch_set_v1(other, src[:5]), [False, False]),
            ("wrong count", lambda: be.batch_get_v1(keys, src[:4]), [False, False]),
            ("out of range", lambda: be.batch_set_v1(other, beyond), [False, False]),
            ("out of range", lambda: be.batch_get_v1(keys, beyond), [False, False]),
            ("unaligned", lambda: be.batch_set_v1(other, src + 1), [False, False]),
            ("flat size", lambda: be.batch_set(other, [torch.zeros(3), torch.zeros(3)]), False),
            ("flat size", lambda: be.batch_get(keys, [torch.zeros(3)] * 2), [None, None]),
            ("flat count", lambda: be.batch_get(keys, [torch.zeros(3)]), [None, None]),
            ("no indices", lambda: be.batch_set_v1(other, None), [False, False]),
            ("not a tensor", lambda: be.batch_get_v1(keys, {"a": 1}), [False, False]),
            ("objects", lambda: be.batch_set_v1(other, [object()] * 8), [False, False]),
            ("floats", lambda: be.batch_set_v1(other, src.double() + 0.5), [False, False]),
            (
                "scattered",
                lambda: be.batch_set_v1(other, src[[0, 5, 2, 3, 4, 1, 6, 7]]),
                [False] * 2,
            ),
            ("no keys", lambda: be.batch_set_v1(None, src), [False]),
            ("no keys", lambda: be.batch_get_v1(None, src), [False]),
            ("no keys", lambda: be.batch_exists(None), 0),
        ]
        for what, call, expected in cases:
            assert call() == expected, what
        assert cached_tokens(ep) == before
        assert be.batch_exists(keys) == 2  # and the backend still works
        assert be.batch_get_v1(keys, host.alloc(2 * rig.PAGE)) == [True, True]
    finally:
        be.close()


def test_a_pool_pinned_full_refuses_a_set_and_changes_nothing(tmp_path):
    endpoint = f"ipc://{tmp_path}/h.sock"
    proc = start_daemon(endpoint, "--device-tier", "engine", "--host-tokens", str(8 * rig.PAGE))
    _, host = rig.host_pool("page_first")
    extra = rig.extra_config(endpoint, **{"hicache.pin_s": 600})
    one, two = rig.backend(host, extra), rig.backend(host, extra)  # (a session pins <= 3/4)
    try:
        keys = rig.chain_hashes(tokens(8, seed=13))
        assert one.batch_set_v1(keys[:4], host.alloc(4 * rig.PAGE)) == [True] * 4
        assert two.batch_set_v1(keys[4:], host.alloc(4 * rig.PAGE)) == [True] * 4
        assert one.batch_exists(keys[:4]) == 4 and two.batch_exists(keys[4:]) == 4
        more = rig.chain_hashes(tokens(2, seed=14))  # every page of the pool is pinned:
        assert one.batch_set_v1(more, host.alloc(2 * rig.PAGE)) == [False, False]
        assert cached_tokens(endpoint) == 8 * rig.PAGE and one.batch_exists(more) == 0
        assert one.batch_get_v1(keys[:4], host.alloc(4 * rig.PAGE)) == [True] * 4  # released
        assert one.batch_set_v1(more, host.alloc(2 * rig.PAGE)) == [True, True]  # room again
        assert one.batch_exists(more) == 2
    finally:
        one.close()
        two.close()
        stop_daemon(proc)


def test_another_layout_gets_an_error_naming_both_and_misses(ep, caplog):
    _, mha = rig.host_pool("page_first")
    _, mla = rig.host_pool("page_first", mla=True)
    first, second = rig.backend(mha, rig.extra_config(ep)), None
    try:
        keys = rig.chain_hashes(tokens(2, seed=9))
        assert first.batch_set_v1(keys, mha.alloc(2 * rig.PAGE)) == [True, True]
        with caplog.at_level("WARNING", logger="hicache.sglang"):
            # (its layout goes to the daemon as it is built, refused: logged once, from there)
            second = rig.backend(mla, rig.extra_config(ep), mla=True)
            assert second.batch_exists(keys) == 0
            assert second.batch_set_v1(keys, mla.alloc(2 * rig.PAGE)) == [False, False]
        said = " ".join(r.getMessage() for r in caplog.records)
        assert "sglang-v1-mha" in said and "sglang-v1-mla" in said
        assert cached_tokens(ep) == 2 * rig.PAGE
    finally:
        first.close()
        if second is not None:
            second.close()


# ---- failures ----------------------------------------------------------------------------------
def test_a_killed_daemon_is_a_miss_and_a_new_one_is_used_without_a_restart(tmp_path):
    """SIGKILL between and during SGLang's calls: its threads see misses and False, never an
    exception; the next daemon on the endpoint gets a new session and the layout again."""
    endpoint = f"ipc://{tmp_path}/h.sock"
    proc = daemon(endpoint)
    dev, host = rig.host_pool("page_first")
    extra = rig.extra_config(endpoint, **{"hicache.retry_s": 0, "hicache.timeout_s": 1})
    c = rig.controller(dev, host, extra)
    try:
        rig.fill(host, seed=11)
        prompt = tokens(4, seed=11)
        src = host.alloc(len(prompt))
        c.write_storage(src, prompt, hash_value=rig.chain_hashes(prompt))
        assert c.ack_backup_queue.get(timeout=60).completed_tokens == len(prompt)
        expected = [rig.canonical_page(host, int(src[i])) for i in range(0, 16, rig.PAGE)]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert rig.prefetch(c, host, prompt) == (0, [])  # a miss
        c.write_storage(src, prompt, hash_value=rig.chain_hashes(prompt))
        assert c.ack_backup_queue.get(timeout=60).completed_tokens == 0  # False: not stored
        proc = daemon(endpoint)  # a new daemon: empty, registered again at the next call
        assert rig.prefetch(c, host, prompt) == (0, [])
        c.write_storage(src, prompt, hash_value=rig.chain_hashes(prompt))
        assert c.ack_backup_queue.get(timeout=60).completed_tokens == len(prompt)
        got, pages = rig.prefetch(c, host, prompt)
        assert got == len(prompt)
        assert all(torch.equal(a, b) for a, b in zip(pages, expected, strict=True))
        assert all(t.is_alive() for t in (c.prefetch_thread, c.backup_thread))
    finally:
        c.detach_storage_backend()
        stop_daemon(proc)


def test_a_daemon_killed_during_a_get_or_a_set_fails_that_call_only(tmp_path, monkeypatch):
    endpoint = f"ipc://{tmp_path}/h.sock"
    proc = daemon(endpoint)
    _, host = rig.host_pool("page_first")
    be = rig.backend(host, rig.extra_config(endpoint, **{"hicache.retry_s": 0}))
    try:
        rig.fill(host, seed=12)
        keys = rig.chain_hashes(tokens(3, seed=12))
        src = host.alloc(3 * rig.PAGE)
        assert be.batch_set_v1(keys, src) == [True] * 3
        assert be.batch_exists(keys) == 3
        from hicache.client.sglang import pages

        real = pages.copy_pages
        state = {"proc": proc}

        def copy_then_die(*args):  # the daemon dies while the pages are being copied
            real(*args)
            os.kill(state["proc"].pid, signal.SIGKILL)
            state["proc"].wait()

        monkeypatch.setattr("hicache.client.sglang.page_keys.copy_pages", copy_then_die)
        dst = host.alloc(3 * rig.PAGE)  # pinned, with the session surely alive, all along:
        assert be.batch_get_v1(keys, dst) == [True] * 3  # read (the release is not waited for)
        assert torch.equal(
            rig.canonical_page(host, int(dst[0])), rig.canonical_page(host, int(src[0]))
        )
        assert be.batch_exists(keys) == 0  # down: a miss
        state["proc"] = proc = daemon(endpoint)
        assert be.batch_set_v1(keys, src) == [False] * 3  # killed before its insert
        monkeypatch.setattr("hicache.client.sglang.page_keys.copy_pages", real)
        proc = daemon(endpoint)
        assert be.batch_exists(keys) == 0  # nothing half-written is readable
        assert be.batch_set_v1(keys, src) == [True] * 3
        assert be.batch_exists(keys) == 3
    finally:
        be.close()
        stop_daemon(proc)


# ---- the third tier ---------------------------------------------------------------------------
@pytest.mark.parametrize("store", ["redis", "mooncake"])
def test_pages_stored_on_one_machine_come_back_on_another_through_the_third_tier(tmp_path, store):
    """Two daemons ("machines") over one store: an SGLang instance on the second finds and
    reads, byte-identical, the pages an instance on the first stored."""
    from tests.l3_servers import mooncake_master, redis_cluster

    servers = redis_cluster(tmp_path / "redis") if store == "redis" else mooncake_master()
    with servers as server:
        flags = ["--l3", server.url, "--l3-model", "rig@test", "--l3-segment-bytes", "32MiB"]
        eps = [f"ipc://{tmp_path}/{name}.sock" for name in ("a", "b")]
        procs = [daemon(ep, *flags) for ep in eps]
        _, host_a = rig.host_pool("page_first")
        _, host_b = rig.host_pool("page_first_direct")
        a = rig.backend(host_a, rig.extra_config(eps[0]))
        b = rig.backend(host_b, rig.extra_config(eps[1], **{"hicache.timeout_s": 30}))
        try:
            rig.fill(host_a, seed=21)
            keys = rig.chain_hashes(tokens(6, seed=21))
            src = host_a.alloc(6 * rig.PAGE)
            assert a.batch_set_v1(keys, src) == [True] * 6
            with HiCacheClient(eps[0], name="probe") as hc:
                wait_until(
                    lambda: (
                        hc.stats()["l3"]["written_pages"] == 6
                        and not hc.stats()["l3"]["queued_pages"]
                    ),
                    what="pages written to the store",
                )
            assert b.batch_exists(keys) == 6  # (the daemon waited for the store)
            dst = host_b.alloc(6 * rig.PAGE)
            assert b.batch_get_v1(keys, dst) == [True] * 6
            for i in range(0, 6 * rig.PAGE, rig.PAGE):
                assert torch.equal(
                    rig.canonical_page(host_b, int(dst[i])),
                    rig.canonical_page(host_a, int(src[i])),
                )
            # chains (prefix keys): the second machine asks mid-chain, the store has it all
            info = HiCacheStorageExtraInfo
            a.close()
            b.close()
            a = rig.backend(host_a, rig.extra_config(eps[0], chains=True))
            b = rig.backend(
                host_b, rig.extra_config(eps[1], chains=True, **{"hicache.timeout_s": 30})
            )
            chain = rig.chain_hashes(tokens(5, seed=22))
            assert a.batch_set_v1(chain, src[: 5 * rig.PAGE], info([])) == [True] * 5
            with HiCacheClient(eps[0], name="probe") as hc:
                wait_until(
                    lambda: (
                        hc.stats()["l3"]["written_pages"] == 11
                        and not hc.stats()["l3"]["queued_pages"]
                    ),
                    what="the chain written to the store",
                )
            assert b.batch_exists(chain[2:], info(chain[:2])) == 3
            assert b.batch_get_v1(chain[2:], dst[: 3 * rig.PAGE], info(chain[:2])) == [True] * 3
            for i in range(3):
                assert torch.equal(
                    rig.canonical_page(host_b, int(dst[i * rig.PAGE])),
                    rig.canonical_page(host_a, int(src[(i + 2) * rig.PAGE])),
                )
            with HiCacheClient(eps[1], name="probe") as hc:
                stats = hc.stats(check=True)
            assert stats["integrity"] == "ok" and stats["l3"]["adopted_pages"] == 11
        finally:
            a.close()
            b.close()
            for proc in procs:
                stop_daemon(proc)


# ---- races and limits a hostile review found -----------------------------------------------------
def test_pins_of_a_session_another_thread_renewed_are_never_used(tmp_path):
    """A renewal (a restarted daemon) between another thread's exists and its get: the old
    session's pins are void; the get never reads the new pool at the old pages, never releases
    the new session's locks by the old ids."""
    endpoint = f"ipc://{tmp_path}/h.sock"
    state = {"proc": daemon(endpoint)}
    _, host = rig.host_pool("page_first", pages=32)
    extra = {"hicache.retry_s": 0, "hicache.timeout_s": 1, "hicache.pin_s": 600}
    be = rig.backend(host, rig.extra_config(endpoint, **extra))
    try:
        rig.fill(host, seed=31)
        mine, theirs = rig.chain_hashes(tokens(3, 31)), rig.chain_hashes(tokens(3, 32))
        src_mine, src_theirs = host.alloc(12), host.alloc(12)
        assert be.batch_set_v1(mine, src_mine) == [True] * 3
        real, armed = be.link.call_at, [True]

        def call_at(fn, generation=None):
            out = real(fn, generation)
            if armed.pop() if armed else False:  # --- another thread runs here ---
                os.kill(state["proc"].pid, signal.SIGKILL)
                state["proc"].wait()
                state["proc"] = daemon(endpoint)
                wait_until(lambda: be.batch_set_v1(theirs, src_theirs) == [True] * 3)
                assert be.batch_exists(theirs) == 3  # the new session's pins, ids from 1
            return out

        be.link.call_at = call_at
        assert be.batch_exists(mine) == 3  # (found in the old daemon)
        del be.link.call_at
        assert be.batch_get_v1(mine, host.alloc(12)) == [False] * 3  # not in the new one
        dst = host.alloc(12)
        assert be.batch_get_v1(theirs, dst) == [True] * 3  # their pins were not released
        for i in range(0, 12, rig.PAGE):
            a, b = (
                rig.canonical_page(host, int(dst[i])),
                rig.canonical_page(host, int(src_theirs[i])),
            )
            assert torch.equal(a, b)
        assert be.pinned() == 0
    finally:
        be.close()
        stop_daemon(state["proc"])


def test_a_get_refused_room_for_unpinned_keys_serves_the_pinned_run_and_releases_it(tmp_path):
    endpoint = f"ipc://{tmp_path}/h.sock"
    proc = start_daemon(endpoint, "--device-tier", "engine", "--host-tokens", str(8 * rig.PAGE))
    _, host = rig.host_pool("page_first")
    extra = rig.extra_config(endpoint, **{"hicache.pin_s": 600})
    one, two = rig.backend(host, extra), rig.backend(host, extra)
    try:
        keys = rig.chain_hashes(tokens(7, seed=33))
        assert one.batch_set_v1(keys[:6], host.alloc(6 * rig.PAGE)) == [True] * 6
        assert two.batch_set_v1(keys[6:], host.alloc(rig.PAGE)) == [True]
        assert one.batch_exists(keys[:6]) == 6  # the session's whole share pinned
        # the 7th key was never pinned: pinning it now is past the share (refused)
        assert one.batch_get_v1(keys, host.alloc(7 * rig.PAGE)) == [True] * 6 + [False]
        assert one.link.call(lambda c: c.holdings()).lock_ids == []  # (after its posted release)
        with HiCacheClient(endpoint, name="probe") as hc:
            held = [s["locks"] for s in hc.stats()["session_list"] if s["client"] != "probe"]
        assert held == [0, 0] and one.pinned() == 0
    finally:
        one.close()
        two.close()
        stop_daemon(proc)


def test_key_lists_past_a_batch_are_split_not_dropped(ep):
    _, host = rig.host_pool("page_first")
    be = rig.backend(host, rig.extra_config(ep))
    try:
        keys = rig.chain_hashes(tokens(5, seed=34))
        assert be.batch_set_v1(keys, host.alloc(5 * rig.PAGE)) == [True] * 5
        many = keys + [os.urandom(32).hex() for _ in range(30000)]
        assert be.batch_exists(many) == 5  # 30 batches of at most 1024 keys
        assert be.batch_get_v1(keys, host.alloc(5 * rig.PAGE)) == [True] * 5
        assert be.link.failures == 0 and be.pinned() == 0
    finally:
        be.close()


def test_under_pressure_a_chain_loses_its_tail_first(tmp_path):
    """SGLang looks a prompt up from the first page it lacks: the daemon evicts a chain's last
    pages before its first ones, so what stays is still found."""
    endpoint = f"ipc://{tmp_path}/h.sock"
    proc = start_daemon(endpoint, "--device-tier", "engine", "--host-tokens", str(8 * rig.PAGE))
    _, host = rig.host_pool("page_first")
    be = rig.backend(host, rig.extra_config(endpoint))
    try:
        first, second = rig.chain_hashes(tokens(6, seed=35)), rig.chain_hashes(tokens(4, 36))
        assert be.batch_set_v1(first, host.alloc(6 * rig.PAGE)) == [True] * 6
        assert be.batch_exists(first) == 6  # (a lookup touches them all: the head last)
        assert be.batch_get_v1(first, host.alloc(6 * rig.PAGE)) == [True] * 6
        assert be.batch_set_v1(second, host.alloc(4 * rig.PAGE)) == [True] * 4  # evicts 2
        assert be.batch_exists(first) == 4  # the head stayed
        assert be.batch_exists(first[4:]) == 0  # the tail went
        # the rank pins 4 pages, and 4 more would pass its share (6): found, not pinned
        assert be.batch_exists(second) == 4
        assert be.batch_get_v1(first[:4], host.alloc(4 * rig.PAGE)) == [True] * 4  # releases
        assert be.batch_get_v1(second, host.alloc(4 * rig.PAGE)) == [True] * 4  # pins now
    finally:
        be.close()
        stop_daemon(proc)
