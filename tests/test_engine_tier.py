"""A daemon for engines that own their device tier (--device-tier engine): layouts, the pool they
make, and what is refused."""

from __future__ import annotations

import pytest
import torch

from hicache.client import DaemonError, HiCacheClient, LayoutMismatch
from hicache.daemon.config import build_parser, parse_bytes, resolve
from hicache.daemon.launch import start_daemon, stop_daemon
from hicache.memory import EngineLayout
from hicache.protocol import ErrorCode
from tests.daemon_helpers import SMALL


def layout(**over) -> EngineLayout:
    fields = dict(
        model="m",
        num_layers=2,
        num_kv_heads=2,
        head_size=32,
        dtype="float32",
        block_size=32,
        block_shape=(2, 32, 64),
        backend="cpu",
    )
    fields.update(over)
    return EngineLayout(**fields)


def test_layouts_of_any_tensor_parallel_size_are_one_identity_when_sharded_by_heads():
    tp1 = layout()
    tp2 = layout(num_kv_heads=1, block_shape=(1, 32, 64), tp_size=2)
    assert tp1.mismatch(tp2) is None and tp1.page_bytes == tp2.page_bytes
    by_rank = layout(num_kv_heads=1, block_shape=(1, 32, 64), tp_size=2, shard="rank")
    assert "tp_size" in tp1.mismatch(by_rank)
    assert "dtype='float32'" in tp1.mismatch(layout(dtype="float16"))
    assert tp1.tokens_for_bytes(10 * tp1.page_bytes + 1) == 10 * 32


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(dtype="int8"), "dtype"),
        (dict(block_shape=(2, 32, 63), block_size=32, head_size=1), None),  # fine: 2*32*63
        (dict(block_shape=(3, 32, 64)), "shard"),  # heads shard: the block starts with the heads
        (dict(num_layers=0), "num_layers"),
        (dict(num_layers=True), "num_layers"),
        (dict(block_shape=(2, 5, 3), block_size=32), "whole number"),
        (dict(model="x" * 600), "model"),
        (dict(shard="layers"), "shard"),
    ],
)
def test_bad_layouts_are_refused_naming_the_field(bad, match):
    if match is None:
        layout(**bad)
        return
    with pytest.raises(ValueError, match=match):
        layout(**bad)


def test_from_dict_refuses_unknown_and_missing_fields():
    raw = layout().as_dict()
    assert EngineLayout.from_dict(raw) == layout()
    with pytest.raises(ValueError, match="unknown"):
        EngineLayout.from_dict({**raw, "extra": 1})
    raw.pop("dtype")
    with pytest.raises(ValueError, match="dtype"):
        EngineLayout.from_dict(raw)


def test_settings_of_the_engine_tier():
    def settings(*argv: str):
        return resolve(build_parser().parse_args(list(argv)), environ={})

    s = settings("--device-tier", "engine", "--host-bytes", "64MiB")
    assert s.engine_tier and s.host_bytes == 64 << 20
    assert s.engine_pool_tokens(page_bytes=32768, page_size=32) == 2048 * 32
    s = settings("--device-tier", "engine", "--host-tokens", "4096")  # no device pool to exceed
    assert s.engine_pool_tokens(page_bytes=32768, page_size=32) == 4096
    assert parse_bytes("2G") == 2 << 30 and parse_bytes(512) == 512
    for argv, match in [
        (("--device-tier", "gpu"), "device_tier"),
        (("--host-bytes", "1GiB"), "only with device_tier=engine"),
        (("--device-tier", "engine", "--host-bytes", "lots"), "not a size"),
        (("--device-tier", "engine", "--host-bytes", "1KiB"), "at least"),
    ]:
        with pytest.raises(ValueError, match=match):
            settings(*argv)


@pytest.fixture
def ep(tmp_path):
    endpoint = f"ipc://{tmp_path}/h.sock"
    proc = start_daemon(endpoint, "--device-tier", "engine", "--host-bytes", "4MiB")
    try:
        yield endpoint
    finally:
        stop_daemon(proc)


def test_the_first_layout_makes_the_pool_and_others_are_refused(ep):
    with HiCacheClient(ep, name="e1") as hc:
        with pytest.raises(DaemonError) as err:
            hc.match_prefix(list(range(64)))
        assert err.value.code is ErrorCode.NO_LAYOUT
        assert hc.layout is None and hc.stats()["layout"] is None
        # every figure is there before the pool is, as 0, as /metrics shows it
        stats = hc.stats()
        for name in ("hit_host_tokens", "load_tokens", "miss_tokens", "host_capacity_tokens"):
            assert stats[name] == 0, name
        held = hc.holdings()  # nothing can be held yet, and asking is no error
        with pytest.raises(DaemonError, match="register") as err:
            hc.attach()  # no pool to map yet: said, not a TypeError
        assert err.value.code is ErrorCode.NO_LAYOUT
        assert held.lock_ids == [] and len(held.owned_slots) == 0
        served = hc.register_layout(layout(num_kv_heads=1, block_shape=(1, 32, 64), tp_size=2))
        assert hc.config.page_size == 32 and hc.config.device_tokens == 128 * 32  # 4 MiB
        pools = hc.attach()
        assert pools.kv_buffer[0].numel() == (128 + 1) * 32 * 2 * 64  # + the padding page
        slots = hc.alloc(64)
        pools.kv_buffer[1][slots] = 7.0
        hc.insert(list(range(64)), slots)
    with HiCacheClient(ep, name="e2") as hc:
        assert hc.layout == served
        assert hc.register_layout(layout()) == served  # TP 1 of the same model: shared
        m = hc.match_prefix(list(range(65)))
        assert m.device_hit_length == 64
        assert bool((hc.attach().kv_buffer[1][m.device_indices] == 7.0).all())
        hc.release(m)
        with pytest.raises(LayoutMismatch, match="model='m'.*model='m2'"):
            hc.register_layout(layout(model="m2"))
        stats = hc.stats(check=True)
        assert stats["integrity"] == "ok" and stats["device_tier"] == "engine"
        assert stats["host_cached_tokens"] == 64  # the refused registration changed nothing


def test_a_pool_too_small_for_one_block_is_out_of_memory(tmp_path):
    endpoint = f"ipc://{tmp_path}/h.sock"
    proc = start_daemon(endpoint, "--device-tier", "engine", "--host-bytes", "1MiB")
    try:
        with HiCacheClient(endpoint) as hc:
            with pytest.raises(DaemonError) as err:
                hc.register_layout(layout(block_shape=(2, 32, 4096), head_size=2048))
            assert err.value.code is ErrorCode.OUT_OF_MEMORY
            assert hc.register_layout(layout()) == layout()  # nothing was made: a fit one is
    finally:
        stop_daemon(proc)


def test_a_pool_larger_than_the_ram_is_refused_naming_the_flag_and_logged_once(tmp_path):
    """A --host-bytes the machine cannot give: the daemon starts (engines bring the layout),
    the first registration is refused naming --host-bytes, and the daemon's log says so once
    (an engine asks again every few seconds)."""
    endpoint = f"ipc://{tmp_path}/h.sock"
    proc = start_daemon(endpoint, "--device-tier", "engine", "--host-bytes", "1000000GiB")
    try:
        with HiCacheClient(endpoint) as hc:
            for _ in range(2):
                with pytest.raises(DaemonError) as err:
                    hc.register_layout(layout())
                assert err.value.code is ErrorCode.OUT_OF_MEMORY
                assert "--host-bytes" in err.value.message
    finally:
        output = stop_daemon(proc)
    said = [ln for ln in output.splitlines() if "registration refused" in ln]
    assert len(said) == 1 and "the engines' pool" in said[0], said


def test_a_daemon_that_owns_its_device_pool_refuses_layouts(tmp_path):
    endpoint = f"ipc://{tmp_path}/h.sock"
    proc = start_daemon(endpoint, *SMALL, "--keep-host", "false")
    try:
        with HiCacheClient(endpoint) as hc:
            with pytest.raises(LayoutMismatch, match="device-tier engine"):
                hc.register_layout(layout())
    finally:
        stop_daemon(proc)


def test_hicache_info_before_a_layout_and_hits_per_engine_after(ep):
    import os
    import subprocess
    import sys

    def info(*section: str) -> str:
        env = {**os.environ, "HICACHE_ENDPOINT": ep}
        r = subprocess.run(
            [sys.executable, "-m", "hicache.client.cli", "info", *section],
            capture_output=True,
            text=True,
            timeout=30,
            env=env,
        )
        assert r.returncode == 0, r.stderr
        return r.stdout

    assert "device_tier:engine" in info("memory")  # no pool yet: zeros, not a traceback
    with HiCacheClient(ep, name="vllm-a") as hc:
        hc.register_layout(layout())
        hc.insert(list(range(64)), hc.alloc(64))
        hc.release(hc.match_prefix(list(range(96))))
        text = info("sessions")
    assert "client=vllm-a" in text and "queried_tokens=96,hit_tokens=64" in text


def test_insert_and_lock_replaces_a_match_in_one_round_trip_and_only_on_success(ep):
    with HiCacheClient(ep, name="e") as hc:
        hc.register_layout(layout())
        first = hc.alloc(64)
        old = hc.insert_and_lock(list(range(64)), first).match
        assert hc.holdings().lock_ids == [old.lock_id]
        more = hc.alloc(32)
        with pytest.raises(DaemonError):  # slots not the session's: nothing happens
            hc.insert_and_lock(list(range(96)), torch.cat([more, more, more]), replaces=old)
        assert hc.holdings().lock_ids == [old.lock_id] and not old.released
        new = hc.insert_and_lock(
            list(range(96)), torch.cat([old.device_indices, more]), replaces=old
        ).match
        assert new.device_hit_length == 96 and old.released
        assert hc.holdings().lock_ids == [new.lock_id]
        hc.release(new)
        assert hc.stats(check=True)["integrity"] == "ok"


def test_a_daemon_for_engines_names_its_pool_the_host_tier_everywhere(ep):
    """The engines keep their device tier; the daemon's pool is their host tier: stats, info,
    metrics, capacity, the tree and eviction all say host, and the device tier is empty."""
    from hicache.client.capacity_view import render_capacity
    from hicache.client.info_view import sections
    from hicache.daemon.observe import families
    from hicache.protocol import Op

    with HiCacheClient(ep, name="e", admin=True) as hc:
        hc.register_layout(layout())
        hc.insert(list(range(64)), hc.alloc(64))
        hc.release(hc.match_prefix(list(range(96))))
        stats = hc.stats(check=True)
        capacity = hc._call(Op.CAPACITY, {})[0].fields
        tree = hc.tree()
        shape = hc._call(Op.TREE, {"shape": True})[0].fields
        with pytest.raises(DaemonError, match="no device tier"):
            hc.evict(device_tokens=64)  # (not a silent 0)
        evicted = hc.evict(host_tokens=64)
        after = hc.stats(check=True)
        with pytest.raises(DaemonError, match=r"would hold \d+ host pages"):
            hc.alloc(128 * 32)  # (past a session's share of the pool)
    assert stats["integrity"] == "ok"
    assert (stats["hit_host_tokens"], stats["hit_device_tokens"]) == (64, 0)
    assert stats["host_capacity_tokens"] == 128 * 32 and stats["device_capacity_tokens"] == 0
    assert stats["host_cached_tokens"] == 64 and stats["host_evictable_tokens"] == 64
    info = sections(stats)
    assert info["hits"]["hit_ratio_host"] == 0.6667 and info["hits"]["hit_ratio_device"] == 0.0
    assert info["host_pool"]["host_cached_tokens"] == 64
    metrics = {
        (f.name, sample.labels.get("tier")): sample.value
        for f in families(stats)
        for sample in f.samples
    }
    assert metrics[("hicache_hit_tokens", "host")] == 64
    assert metrics[("hicache_hit_tokens", "device")] == 0
    assert metrics[("hicache_capacity_tokens", "host")] == 128 * 32
    assert metrics[("hicache_cached_tokens", "device")] == 0
    assert metrics[("hicache_evictable_tokens", "host")] == 64
    assert (capacity["device_pages"], capacity["host_pages"]) == (0, 128)
    assert capacity["accesses_needed"] == 128 and capacity["recommendation"] == ""  # (too few)
    assert all(p["device_hit"] == 0 for p in capacity["points"])
    assert "host_tokens" in render_capacity(capacity)
    assert [(n["device"], n["host"]) for n in tree["nodes"]] == [(False, True)]
    (ns,) = shape["namespaces"]
    assert (ns["device_tokens"], ns["host_tokens"]) == (0, 64)
    assert [p["tiers"] for p in ns["prefixes"]] == ["H"]
    estimates = [  # (the capacity request ran the estimator: ``after`` has its points)
        (sample.labels["tier"], sample.labels["factor"], sample.value)
        for f in families(after)
        if f.name == "hicache_estimated_hit_ratio"
        for sample in f.samples
    ]
    host = {(k, v) for t, k, v in estimates if t == "host"}
    assert host and host == {(k, v) for t, k, v in estimates if t == "total"}
    assert evicted == {"device_freed": 0, "host_freed": 64}  # --host-tokens: the pool
    assert after["host_cached_tokens"] == 0 and after["evicted_host_tokens"] == 64


def test_info_config_shows_the_registered_layout_not_a_default_shape(ep):
    from hicache.client.info_view import sections

    with HiCacheClient(ep, name="e") as hc:
        before = sections(hc.stats())["config"]
        hc.register_layout(layout())
        after = sections(hc.stats())["config"]
    assert before["layout"].startswith("none registered yet")
    assert "num_kv_heads" not in before and "head_dim" not in before
    assert after["layout_model"] == "m" and after["layout_num_kv_heads"] == 2
    assert after["layout_head_size"] == 32 and after["host_capacity_tokens"] == 128 * 32
    assert "num_kv_heads" not in after and "kv_format" not in after
