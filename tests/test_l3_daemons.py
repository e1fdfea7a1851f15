"""Daemons on several "machines" (separate processes, separate host pools) sharing KV through
a real store: what a reference engine computed on one is served on another with the logits of
a full recompute; a dead store node or master, or a corrupted value, is a miss and never wrong
KV; and the prefetch policies bound how long a match waits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.optional import require_module

require_module("transformers", what="the reference engine (tests/test_l3_daemons.py)")

from hicache.client import DaemonError, HiCacheClient  # noqa: E402
from scripts.ref_engine import ReferenceEngine  # noqa: E402
from tests.daemon_helpers import start_daemon, stop_daemon, wait_until  # noqa: E402
from tests.l3_servers import mooncake_master, redis_cluster  # noqa: E402

SHAPE = [
    "--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "8", "--dtype", "float32",
    "--page-size", "4", "--device-tokens", "256", "--host-tokens", "512",
    "--load-back-threshold", "1",
]  # fmt: skip
TOL = 1e-5


def l3_flags(url: str, *extra: str) -> list[str]:
    return ["--l3", url, "--l3-model", "tiny-llama@test", "--l3-segment-bytes", "32MiB", *extra]


def prompts(count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 512, 32, dtype=np.int32)
    return [np.concatenate([base, rng.integers(0, 512, 40, dtype=np.int32)]) for _ in range(count)]


def serve_checked(engine: ReferenceEngine, tokens: np.ndarray):
    served = engine.serve(tokens)
    want = engine.recompute(tokens)[served.computed_from :]
    assert (served.logits - want).abs().max().item() < TOL
    return served


def l3_stats(endpoint: str) -> dict:
    with HiCacheClient(endpoint, name="probe") as hc:
        stats = hc.stats(check=True)
    assert stats["integrity"] == "ok"
    return stats["l3"]


def wait_written(endpoint: str, pages: int) -> None:
    """Until the daemon wrote (or found present) ``pages`` pages (its IO thread is async)."""
    deadline = time.monotonic() + 30
    while True:
        s = l3_stats(endpoint)
        if s["written_pages"] + s["present_pages"] >= pages and not s["queued_pages"]:
            return
        assert time.monotonic() < deadline, s
        time.sleep(0.05)


class Machines:
    """Two daemons and an engine on each."""

    def __init__(self, tmp_path, url: str, *extra: str):
        self.eps = [f"ipc://{tmp_path}/{name}.sock" for name in ("a", "b")]
        self.procs = []
        for ep in self.eps:
            self.procs.append(start_daemon(ep, *SHAPE, *l3_flags(url, *extra)))

    def engine(self, i: int) -> tuple[HiCacheClient, ReferenceEngine]:
        hc = HiCacheClient(self.eps[i], name=f"engine-{i}", admin=True, timeout_s=30)
        return hc, ReferenceEngine(hc)

    def stop(self) -> None:
        for proc in self.procs:
            stop_daemon(proc)


@pytest.fixture(params=["redis", "mooncake"])
def store_url(request, tmp_path):
    if request.param == "redis":
        with redis_cluster(tmp_path / "redis") as cluster:
            yield cluster.url
    else:
        with mooncake_master() as master:
            yield master.url


def test_kv_computed_on_one_machine_is_served_on_another(tmp_path, store_url):
    m = Machines(tmp_path, store_url)
    try:
        hc_a, a = m.engine(0)
        hc_b, b = m.engine(1)
        ps = prompts(3, seed=1)
        assert [serve_checked(a, p).computed_from for p in ps] == [0, 32, 32]  # shared base
        wait_written(m.eps[0], 8 + 3 * 10)  # the shared base once, each prompt's own pages
        for p in ps:  # machine B never computed them: its match waits for the store
            served = serve_checked(b, p)
            assert served.computed_from == len(p) - 4  # all but the last page (a full hit)
            assert served.device_hit + served.host_hit == len(p)
        s = l3_stats(m.eps[1])
        assert s["adopted_pages"] == 8 + 3 * 10 and s["corrupt_pages"] == 0
        hc_a.close(), hc_b.close()
    finally:
        m.stop()


def test_a_dead_redis_node_costs_its_keys_and_nothing_else(tmp_path):
    with redis_cluster(tmp_path / "redis") as cluster:
        m = Machines(tmp_path, cluster.url, "--l3-breaker-failures", "1000")
        try:
            hc_a, a = m.engine(0)
            hc_b, b = m.engine(1)
            ps = prompts(6, seed=2)
            for p in ps:
                serve_checked(a, p)
            wait_written(m.eps[0], 8 + 6 * 10)
            cluster.kill(_a_node_without(cluster, ps[0][:4]))  # (the first page must live)
            hits = [serve_checked(b, p).host_hit for p in ps]  # every request completes, right
            s = l3_stats(m.eps[1])
            print("L3STATS", s)
            assert 0 < s["adopted_pages"] < 8 + 6 * 10  # the live nodes' pages still come
            assert sum(hits) > 0
            hc_a.close(), hc_b.close()
        finally:
            m.stop()


def _a_node_without(cluster, first_page: np.ndarray) -> int:
    """The port of a node that does not hold the key of the page ``first_page`` (the daemons'
    identity as SHAPE and l3_flags set it)."""
    import redis

    from hicache.config import HiCacheConfig
    from hicache.l3.keys import KeyChain, identity_of

    cfg = HiCacheConfig(
        num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", page_size=4,
        device_tokens=256, host_tokens=512,
    )  # fmt: skip
    chain = KeyChain(identity_of(cfg, "tiny-llama@test", "0"), 4)
    key = KeyChain.name(chain.extend(chain.root(None), first_page.tobytes())[0])
    rc = redis.RedisCluster(host="127.0.0.1", port=cluster.ports[0])
    holder = rc.get_node_from_key(key).port
    rc.close()
    assert rc is not None and holder in cluster.ports
    return next(p for p in cluster.ports if p != holder)


def test_a_dead_mooncake_master_is_a_miss(tmp_path):
    with mooncake_master() as master:
        m = Machines(tmp_path, master.url)
        try:
            hc_a, a = m.engine(0)
            hc_b, b = m.engine(1)
            ps = prompts(2, seed=3)
            serve_checked(a, ps[0])
            wait_written(m.eps[0], 18)
            master.kill()
            started = time.monotonic()
            for p in ps:  # every request completes with the right logits, recomputed
                serve_checked(b, p)
            assert time.monotonic() - started < 30
            s = l3_stats(m.eps[1])
            assert s["adopted_pages"] == 0 and s["errors"] >= 1
            hc_a.close(), hc_b.close()
        finally:
            m.stop()


def test_a_value_corrupted_in_the_store_is_never_served(tmp_path):
    import redis

    with redis_cluster(tmp_path / "redis") as cluster:
        m = Machines(tmp_path, cluster.url)
        try:
            hc_a, a = m.engine(0)
            hc_b, b = m.engine(1)
            p = prompts(1, seed=4)[0]
            serve_checked(a, p)
            wait_written(m.eps[0], 18)
            flipped = 0
            for port in cluster.ports:  # around the daemon: flip a byte of every value
                node = redis.Redis(port=port)
                for key in node.scan_iter("hc1:*"):
                    value = bytearray(node.get(key))
                    value[len(value) // 2] ^= 0x40
                    node.set(key, bytes(value))
                    flipped += 1
            assert flipped == 18
            served = serve_checked(b, p)  # recomputed, right
            assert served.host_hit == 0 and served.computed_from == 0
            s = l3_stats(m.eps[1])
            assert s["corrupt_pages"] >= 1 and s["adopted_pages"] == 0
            hc_a.close(), hc_b.close()
        finally:
            m.stop()


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete", "timeout"])
def test_a_match_waits_as_long_as_its_policy_says(tmp_path, policy):
    """One daemon, its own pages written to a slow in-process store and evicted from both of
    its tiers; the next match's wait shows the policy."""
    ep = f"ipc://{tmp_path}/p.sock"
    url = "memory://policy?latency_s=0.6"
    flags = ["--l3-prefetch-policy", policy, "--l3-timeout-s", "0.1", "--l3-timeout-per-ki-s", "0"]
    proc = start_daemon(ep, *SHAPE, *l3_flags(url, *flags))
    try:
        with HiCacheClient(ep, name="engine", admin=True, timeout_s=30) as hc:
            p = prompts(1, seed=5)[0]
            engine = ReferenceEngine(hc)
            serve_checked(engine, p)
            wait_written(ep, 18)
            hc.flush()  # nothing left in the daemon's tiers (a flush writes nothing to the store)
            timeouts = l3_stats(ep)["wait_timeouts"]
            started = time.monotonic()
            m = hc.match_prefix(p, lock=False)
            waited = time.monotonic() - started
            hit = m.host_hit_length
            if policy == "best_effort":  # answered at once; the pages come later
                assert hit == 0 and waited < 0.5
                deadline = time.monotonic() + 10
                while not hc.match_prefix(p, lock=False).host_hit_length:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
            elif policy == "wait_complete":  # answered once the pages arrived
                assert hit == len(p) // 4 * 4 and waited >= 0.6 * 2  # exists, then get
            else:  # answered at its bound (0.1 s), before the slow store answered
                assert hit == 0 and waited < 0.6
                assert l3_stats(ep)["wait_timeouts"] == timeouts + 1
            serve_checked(engine, p)
    finally:
        stop_daemon(proc)


def test_a_daemon_stops_at_once_while_its_store_hangs(tmp_path):
    """SIGTERM while a store call has 30 s to go: the daemon exits within seconds and leaves
    no shared memory behind."""
    import glob

    ep = f"ipc://{tmp_path}/s.sock"
    proc = start_daemon(ep, *SHAPE, *l3_flags("memory://hang?latency_s=30"))
    with HiCacheClient(ep, name="engine", admin=True, timeout_s=30) as hc:
        tokens = prompts(1, seed=6)[0]
        slots = hc.alloc(len(tokens))
        hc.insert(tokens, slots)  # its backup's store write now sleeps in the store
        deadline = time.monotonic() + 10
        while not hc.stats()["l3"]["queued_pages"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    segments = glob.glob(f"/dev/shm/hicache-*-{proc.pid}-*")
    assert segments
    started = time.monotonic()
    stop_daemon(proc, timeout=10)
    assert time.monotonic() - started < 5
    assert not [s for s in segments if os.path.exists(s)]


def test_settings_that_would_break_the_tier_are_refused_at_start():
    from hicache.daemon.config import build_parser, resolve

    for argv, text in [
        (["--l3", "memory://x", "--l3-model", "m", "--host-tokens", "0"], "host tier"),
        (["--l3", "memory://x", "--l3-model", "m", "--l3-store-timeout-s", "-1"], "timeout"),
        (["--l3", "memory://x", "--l3-model", "m", "--l3-breaker-cooldown-s", "inf"], "cooldown"),
        (["--l3", "memory://x?latency_s=abc", "--l3-model", "m"], "latency_s"),
        (["--l3", "redis://nohost", "--l3-model", "m"], "HOST:PORT"),
    ]:
        with pytest.raises(ValueError, match=text):
            resolve(build_parser().parse_args(argv), {})


def test_many_clients_parked_on_one_prefix_share_one_fetch(tmp_path):
    """Eight engines ask for the same prompt while its pages come slowly from the store: one
    fetch, every match answered with the hit once it landed, nothing left held."""
    import threading

    ep = f"ipc://{tmp_path}/c.sock"
    flags = ["--l3-prefetch-policy", "wait_complete"]
    proc = start_daemon(ep, *SHAPE, *l3_flags("memory://many?latency_s=0.3", *flags))
    try:
        p = prompts(1, seed=7)[0]
        with HiCacheClient(ep, name="writer", admin=True, timeout_s=30) as hc:
            serve_checked(ReferenceEngine(hc), p)
            wait_written(ep, 18)
            hc.flush()
            lookups = l3_stats(ep)["lookups"]
        hits: list[int] = []

        def engine(i: int) -> None:
            with HiCacheClient(ep, name=f"engine-{i}", timeout_s=30) as c:
                m = c.match_prefix(p)
                hits.append(m.device_hit_length + m.host_hit_length)
                c.release(m)

        threads = [threading.Thread(target=engine, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert hits == [len(p)] * 8
        s = l3_stats(ep)
        assert s["lookups"] == lookups + 1 and s["fetches_in_flight"] == 0
        with HiCacheClient(ep, name="probe") as hc:
            stats = hc.stats(check=True)
        assert stats["integrity"] == "ok" and stats["device_owned_tokens"] == 0
    finally:
        stop_daemon(proc)


def test_a_redis_node_stopped_in_the_middle_of_a_fetch_is_a_miss(tmp_path):
    """The node holding the prompt's first page stops answering while a fetch runs, then is
    killed: the request completes with the right logits, and the daemon serves on."""
    with redis_cluster(tmp_path / "redis") as cluster:
        m = Machines(tmp_path, cluster.url)
        try:
            hc_a, a = m.engine(0)
            hc_b, b = m.engine(1)
            p = prompts(1, seed=8)[0]
            serve_checked(a, p)
            wait_written(m.eps[0], 18)
            holder = next(port for port in cluster.ports if port != _a_node_without(cluster, p[:4]))
            cluster.procs[holder].send_signal(signal.SIGSTOP)
            try:
                started = time.monotonic()
                served = serve_checked(b, p)  # the fetch times out on the stopped node
                assert time.monotonic() - started < 15
                assert served.host_hit == 0
            finally:
                cluster.procs[holder].send_signal(signal.SIGCONT)
                cluster.kill(holder)
            assert serve_checked(b, prompts(1, seed=9)[0]).computed_from == 0  # serves on
            assert l3_stats(m.eps[1])["adopted_pages"] == 0
            hc_a.close(), hc_b.close()
        finally:
            m.stop()


@pytest.mark.parametrize("how", ["l3-url", "disk-over-a-store"])
def test_a_daemon_restarted_cold_serves_from_its_own_disk(tmp_path, how):
    """``--l3 disk://`` (the store is this node's drive), or ``--disk`` with a store under it
    (an in-process one, which a restart empties). A daemon stopped without keeping its host
    pool, then started again on the same folder, serves what the first one computed from the
    disk, with the logits of a full recompute; its stats name the disk's figures."""
    ep = f"ipc://{tmp_path}/d.sock"
    if how == "l3-url":
        tier = l3_flags(f"disk://{tmp_path}/disk?bytes=64MiB")
    else:
        disk = ["--disk", f"{tmp_path}/disk", "--disk-bytes", "64MiB", "--disk-admission", "all"]
        tier = [*l3_flags("memory://below"), *disk]
    flags = [*SHAPE, *tier, "--keep-host", "false"]
    ps = prompts(3, seed=4)
    proc = start_daemon(ep, *flags)
    try:
        hc = HiCacheClient(ep, name="engine", admin=True, timeout_s=30)
        engine = ReferenceEngine(hc)
        assert [serve_checked(engine, p).computed_from for p in ps] == [0, 32, 32]
        wait_written(ep, 8 + 3 * 10)
        hc.close()
    finally:
        stop_daemon(proc)
    proc = start_daemon(ep, *flags)  # cold: no host pool kept, the disk only
    try:
        hc = HiCacheClient(ep, name="engine", admin=True, timeout_s=30)
        engine = ReferenceEngine(hc)
        for p in ps:
            served = serve_checked(engine, p)
            assert served.computed_from == len(p) - 4  # all but the last page, from the disk
        s = l3_stats(ep)
        assert s["adopted_pages"] == 8 + 3 * 10 and s["corrupt_pages"] == 0
        assert s["store_disk_recovered_values"] == 8 + 3 * 10 and s["store_disk_direct_io"]
        hc.close()
    finally:
        stop_daemon(proc)


@pytest.mark.parametrize("admission", ["reused", "reused-strict", "none"])
def test_the_disk_takes_only_pages_that_earned_it(tmp_path, admission):
    """``--disk-admission reused`` (the default) and ``reused-strict``: a prompt computed once
    goes nowhere (no page came back yet); once a later prompt hits it, its pages (prefix first)
    go to the disk. ``none``: nothing does."""
    ep = f"ipc://{tmp_path}/d.sock"
    disk = ["--disk", f"{tmp_path}/disk", "--disk-bytes", "64MiB", "--disk-admission", admission]
    proc = start_daemon(ep, *SHAPE, "--l3-model", "tiny-llama@test", *disk)
    try:
        with HiCacheClient(ep, name="engine", admin=True, timeout_s=30) as hc:
            engine = ReferenceEngine(hc)
            p = prompts(1, seed=5)[0]
            serve_checked(engine, p)
            hc.evict(device_tokens=4)  # (an admin op settles every copy and its ack first)
            s = l3_stats(ep)
            assert s["written_pages"] == 0 and s["queued_pages"] == 0
            assert serve_checked(engine, p).computed_from == len(p) - 4  # reused: a hit
            if admission != "none":
                wait_written(ep, 18)  # the prompt's 18 full pages (72 tokens / 4)
                assert l3_stats(ep)["store_disk_held_values"] == 18
            else:
                s = l3_stats(ep)
                assert s["written_pages"] == 0 and s["store_disk_held_values"] == 0
    finally:
        stop_daemon(proc)


def test_a_clean_stop_lets_the_disks_queued_writes_land(tmp_path):
    """Stopped at once after serving (its writes still queued), a daemon with a disk lets them
    land before it exits (``close_drain_s``, 10 s for a disk): the next one serves them all."""
    ep = f"ipc://{tmp_path}/d.sock"
    disk = ["--disk", f"{tmp_path}/disk", "--disk-bytes", "64MiB", "--disk-admission", "all"]
    flags = [*SHAPE, "--l3-model", "tiny-llama@test", *disk, "--keep-host", "false"]
    ps = prompts(3, seed=6)
    proc = start_daemon(ep, *flags)
    try:
        with HiCacheClient(ep, name="engine", admin=True, timeout_s=30) as hc:
            engine = ReferenceEngine(hc)
            for p in ps:
                serve_checked(engine, p)
            hc.evict(device_tokens=4)  # (settles the copies: their writes are queued now)
    finally:
        stop_daemon(proc)
    proc = start_daemon(ep, *flags)
    try:
        with HiCacheClient(ep, name="engine", admin=True, timeout_s=30) as hc:
            engine = ReferenceEngine(hc)
            for p in ps:
                assert serve_checked(engine, p).computed_from == len(p) - 4
    finally:
        stop_daemon(proc)


def test_a_clean_stop_writes_the_admitted_pages_a_full_queue_dropped(tmp_path):
    """With a write queue too short for what is served (``--l3-queue-pages 4``), writes are
    dropped and counted; a clean stop writes every admitted page the disk lacks, so the next
    daemon, started cold, serves every prompt from the disk."""
    ep = f"ipc://{tmp_path}/d.sock"
    disk = ["--disk", f"{tmp_path}/disk", "--disk-bytes", "64MiB", "--disk-admission", "all"]
    flags = [*SHAPE, "--l3-model", "tiny-llama@test", *disk, "--keep-host", "false",
             "--l3-queue-pages", "4"]  # fmt: skip
    ps = prompts(3, seed=23)
    proc = start_daemon(ep, *flags)
    try:
        with HiCacheClient(ep, name="engine", admin=True, timeout_s=30) as hc:
            engine = ReferenceEngine(hc)
            for p in ps:
                serve_checked(engine, p)
            hc.evict(device_tokens=4)  # (settles the copies: their writes were offered)
        assert l3_stats(ep)["dropped_pages"] > 0
    finally:
        stop_daemon(proc)
    proc = start_daemon(ep, *flags)
    try:
        with HiCacheClient(ep, name="engine", admin=True, timeout_s=30) as hc:
            engine = ReferenceEngine(hc)
            for p in ps:
                assert serve_checked(engine, p).computed_from == len(p) - 4
    finally:
        stop_daemon(proc)


def test_a_flush_of_the_disk_forgets_it_now_and_after_a_restart(tmp_path):
    """``hicache flush --disk``: the pools and the disk forget everything; a daemon started
    cold on the folder afterwards finds nothing (the flush outlived the stop), and what it
    serves is written and found by the next one. A daemon without a disk refuses the flag,
    changing nothing."""
    ep = f"ipc://{tmp_path}/d.sock"
    disk = ["--disk", f"{tmp_path}/disk", "--disk-bytes", "64MiB", "--disk-admission", "all"]
    flags = [*SHAPE, "--l3-model", "tiny-llama@test", *disk, "--keep-host", "false"]
    first, second = prompts(1, seed=21)[0], prompts(1, seed=22)[0]
    proc = start_daemon(ep, *flags)
    try:
        with HiCacheClient(ep, name="engine", admin=True, timeout_s=30) as hc:
            engine = ReferenceEngine(hc)
            serve_checked(engine, first)
            wait_written(ep, 18)
            freed = hc.flush(disk=True)
            assert freed["disk_freed"] == 18 * 4 and freed["device_freed"] > 0
            s = l3_stats(ep)
            assert s["store_disk_held_values"] == 0 and s["store_disk_cleared_values"] == 18
        proc.send_signal(signal.SIGKILL)  # a crash: no checkpoint, the next start scans
        proc.wait()
    finally:
        stop_daemon(proc)
    proc = start_daemon(ep, *flags)
    try:
        with HiCacheClient(ep, name="engine", admin=True, timeout_s=30) as hc:
            engine = ReferenceEngine(hc)
            assert serve_checked(engine, first).computed_from == 0  # not from the disk
            assert l3_stats(ep)["store_disk_recovered_values"] == 0
            serve_checked(engine, second)  # what comes after the flush is written and found
            wait_written(ep, 2 * 18)
    finally:
        stop_daemon(proc)
    proc = start_daemon(ep, *flags)
    try:
        with HiCacheClient(ep, name="engine", admin=True, timeout_s=30) as hc:
            engine = ReferenceEngine(hc)
            for p in (first, second):
                assert serve_checked(engine, p).computed_from == len(p) - 4
    finally:
        stop_daemon(proc)
    ep2 = f"ipc://{tmp_path}/plain.sock"
    proc = start_daemon(ep2, *SHAPE)
    try:
        with HiCacheClient(ep2, name="engine", admin=True, timeout_s=30) as hc:
            engine = ReferenceEngine(hc)
            serve_checked(engine, first)
            held = hc.stats()["device_cached_tokens"]
            with pytest.raises(DaemonError, match="no disk tier"):
                hc.flush(disk=True)
            assert hc.stats()["device_cached_tokens"] == held > 0  # nothing flushed
            assert "disk_freed" not in hc.flush()
    finally:
        stop_daemon(proc)


def tree(env: dict) -> dict:
    """``hicache tree --json``."""
    cli = [sys.executable, "-m", "hicache.client.cli", "tree", "--json"]
    return json.loads(subprocess.run(cli, env=env, capture_output=True, check=True).stdout)


def test_evicting_part_of_the_disk_takes_its_least_recently_used_tails(tmp_path):
    """``hicache evict --disk-tokens N``: the disk lets go of about N tokens' worth of its
    least recently used pages, a prompt's last pages first, so a cold daemon afterwards still
    finds the rest of the prompt there; the pools are untouched. ``hicache tree`` shows what
    the disk holds and what the tree takes as stored there. A daemon without a disk
    refuses the field, changing nothing."""
    ep = f"ipc://{tmp_path}/d.sock"
    disk = ["--disk", f"{tmp_path}/disk", "--disk-bytes", "64MiB", "--disk-admission", "all"]
    flags = [*SHAPE, "--l3-model", "tiny-llama@test", *disk, "--keep-host", "false"]
    prompt = prompts(1, seed=23)[0]
    env = {**os.environ, "HICACHE_ENDPOINT": ep}
    cli = [sys.executable, "-m", "hicache.client.cli", "evict", "--disk-tokens", "18"]
    proc = start_daemon(ep, *flags)
    try:
        with HiCacheClient(ep, name="engine", admin=True, timeout_s=30) as hc:
            serve_checked(ReferenceEngine(hc), prompt)
            wait_written(ep, 18)
            pooled = hc.stats()["device_cached_tokens"]
            before = tree(env)
            ns = before["namespaces"][0]
            assert before["disk_tokens"] == ns["stored_tokens"] == 72 == len(prompt)
            assert all(p["tiers"].endswith("S") for p in ns["prefixes"])
            out = subprocess.run(cli, env=env, capture_output=True, text=True, check=True).stdout
            assert "disk_freed:20" in out.split()  # (18 tokens: 5 whole pages of 4)
            assert l3_stats(ep)["store_disk_held_values"] == 18 - 5
            assert tree(env)["disk_tokens"] == 72 - 20  # (the disk's own count)
            assert hc.stats()["device_cached_tokens"] == pooled  # (the pools: untouched)
    finally:
        stop_daemon(proc)
    proc = start_daemon(ep, *flags)
    try:  # (the disk opens as the daemon starts: what it holds shows before any lookup)
        wait_until(lambda: l3_stats(ep).get("store_disk_held_values") == 13, what="disk opened")
        with HiCacheClient(ep, name="engine", admin=True, timeout_s=30) as hc:
            assert serve_checked(ReferenceEngine(hc), prompt).computed_from == (18 - 5) * 4
    finally:
        stop_daemon(proc)
    ep2 = f"ipc://{tmp_path}/plain.sock"
    proc = start_daemon(ep2, *SHAPE)
    try:
        with HiCacheClient(ep2, name="engine", admin=True, timeout_s=30) as hc:
            with pytest.raises(DaemonError, match="no disk tier"):
                hc.evict(device_tokens=8, disk_tokens=8)
            assert "disk_freed" not in hc.evict(device_tokens=8)
    finally:
        stop_daemon(proc)
