"""The connector's two halves under vLLM's call order, played by hand (tests/vllm_fake.py),
against a live daemon: what is loaded is the right KV, pins never leak, failures are misses.
Fast enough for every path; tests/test_vllm.py runs the real vLLM."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from tests.optional import require_module

require_module("vllm", what="the connector's sides (they subclass vLLM's)")

from hicache.client import HiCacheClient  # noqa: E402
from hicache.client.vllm.meta import Copy, PoolRef, StepPlan  # noqa: E402
from hicache.client.vllm.settings import ConnectorSettings  # noqa: E402
from hicache.daemon.launch import start_daemon, stop_daemon  # noqa: E402
from tests.l3_servers import l3_settled, redis_cluster  # noqa: E402
from tests.vllm_fake import BS, FakeVllm  # noqa: E402

ENGINE = ("--device-tier", "engine", "--host-tokens", "512", "--lease-seconds", "2")


@pytest.fixture
def ep(tmp_path):
    endpoint = f"ipc://{tmp_path}/h.sock"
    proc = start_daemon(endpoint, *ENGINE, "--quarantine-seconds", "0.5")
    try:
        yield endpoint
    finally:
        stop_daemon(proc)


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(1, 1000, n).tolist()


def daemon_state(endpoint: str, *engines: FakeVllm) -> dict:
    """Tokens cached, and what the fake engines' sessions hold: locks, and owned pages beyond
    the reserves ``engines`` keep for their next stores."""
    with HiCacheClient(endpoint, name="probe") as hc:
        stats = hc.stats(check=True)
    assert stats["integrity"] == "ok"
    mine = [s for s in stats["session_list"] if s["client"] == "fake-vllm"]
    return {
        "cached": stats["host_cached_tokens"],
        "locks": sum(s["locks"] for s in mine),
        "owned": sum(s["owned_pages"] for s in mine) - sum(len(e.sched.reserve) for e in engines),
    }


def run_to_end(v: FakeVllm, rid: str, tokens: list[int], decode: int = 0, chunk: int = 64) -> None:
    req = v.add(rid, tokens)
    v.lookup(req)  # (a daemon with a store: until it answered)
    v.admit(req)
    while req.computed < len(req.all_token_ids):
        v.step({rid: min(chunk, len(req.all_token_ids) - req.computed)})
    for i in range(decode):
        v.decode(req, 900 + i)
        v.step({rid: 1})
    v.finish(req)


@pytest.mark.parametrize("layerwise", ["off", "on"])
def test_what_one_engine_stored_another_loads_exactly(ep, layerwise):
    tokens = prompt(42)
    a = FakeVllm(ep)
    run_to_end(a, "a", tokens, decode=5)  # 47 tokens computed: 11 whole blocks
    assert daemon_state(ep, a) == {"cached": 44, "locks": 0, "owned": 0}
    b = FakeVllm(ep, layerwise=layerwise)
    req = b.add("b", tokens)
    ext = b.admit(req)
    assert ext == (len(tokens) - 1) // BS * BS  # never the whole prompt
    b.step({"b": len(tokens) - ext})
    assert not b.load_errors and b.kv_matches(req, len(tokens))
    b.poison_blocks()
    assert not b.kv_matches(req, len(tokens))  # (the check can fail)
    b.finish(req)
    assert daemon_state(ep)["locks"] == 0
    a.close(), b.close()


def test_layer_wise_loads_let_a_layer_be_read_before_the_next_one_landed(ep):
    """Layer 1's copy is held back: waiting for layer 0 returns, layer 1 has not landed, and
    once it may go on, waiting for it returns with every block right."""
    import threading

    tokens = prompt(30, seed=4)
    a = FakeVllm(ep)
    run_to_end(a, "a", tokens)
    b = FakeVllm(ep, layerwise="on")
    w = b.workers[0]
    gate, real = threading.Event(), w.copier.load_layer

    def held(layer, *args):  # noqa: ANN001, ANN002
        if layer == 1:
            assert gate.wait(30)
        return real(layer, *args)

    w.copier.load_layer = held
    req = b.add("b", tokens)
    assert b.admit(req) == 28
    plan = b.sched.plan(_out({"b": 2}, req))
    w.load(plan)
    first, second = list(w.layer_index)
    w.wait_layer(first)
    assert not w.inflight.landed[1].is_set()
    gate.set()
    w.wait_layer(second)
    w.finish_loads()
    assert not w.take_load_errors() and b.kv_matches(req, 28)
    b.finish(req)
    a.close(), b.close()


@pytest.mark.parametrize("writer,reader", [(1, 2), (2, 1), (2, 2)])
def test_ranks_of_any_tensor_parallel_size_share_blocks(ep, writer, reader):
    tokens = prompt(37, seed=writer * 10 + reader)
    a = FakeVllm(ep, ranks=writer)
    run_to_end(a, "a", tokens)
    b = FakeVllm(ep, ranks=reader)
    req = b.add("b", tokens)
    ext = b.admit(req)
    assert ext == 36
    b.step({"b": len(tokens) - ext})
    assert not b.load_errors and b.kv_matches(req, len(tokens))  # each rank its own heads
    b.finish(req)
    a.close(), b.close()


def test_a_whole_prompt_hit_leaves_its_last_block_to_compute(ep):
    tokens = prompt(32, seed=3)  # exactly 8 blocks
    a = FakeVllm(ep)
    run_to_end(a, "a", tokens, decode=4)
    b = FakeVllm(ep)
    req = b.add("b", tokens)
    assert b.admit(req) == 28  # the 8th block holds the last token: computed, not loaded
    b.finish(req)
    a.close(), b.close()


def test_no_path_leaks_a_pin_or_a_page(ep):
    a = FakeVllm(ep)
    run_to_end(a, "seed", prompt(40, seed=5))
    tokens = prompt(40, seed=5)
    b = FakeVllm(ep)
    # looked up, never scheduled, looked up again (vLLM retries), then aborted
    r1 = b.add("r1", tokens)
    assert b.admit(r1, alloc=False) == 36
    assert b.admit(r1, alloc=False) == 36
    assert daemon_state(ep)["locks"] == 1  # the second lookup replaced the first pin
    b.sched.finished("r1")
    assert daemon_state(ep)["locks"] == 0
    # a 0-token allocation (vLLM had the prefix itself), then finished
    r2 = b.add("r2", tokens)
    b.sched.lookup(r2, 36)
    b.sched.after_alloc(r2, [], 0)
    b.sched.finished("r2")
    assert daemon_state(ep)["locks"] == 0
    # preempted mid-prefill (its blocks freed, looked up again from scratch), then finished
    r3 = b.add("r3", prompt(60, seed=6))
    b.admit(r3)
    b.step({"r3": 20})
    b.free.extend(r3.blocks)
    r3.blocks, r3.computed = [], 0
    b.admit(r3)
    b.step({"r3": 60 - r3.computed})
    # finished before the report of its last step arrived: released once it did
    r4 = b.add("r4", prompt(30, seed=7))
    b.admit(r4)
    plan = b.sched.plan(_out({"r4": 30}, r4))
    b._compute(r4, 30)
    b.finish(r4)
    assert daemon_state(ep)["locks"] >= 1  # r4's chain waits for its stores
    for w in b.workers:
        w.store(plan)
    b.sched.report(b.workers[0].report(plan))
    b.finish(r3)
    state = daemon_state(ep, a, b)
    assert state["locks"] == 0 and state["owned"] == 0
    assert state["cached"] >= 40 + 56 + 28  # what r3 and r4 computed was published
    a.close(), b.close()


def test_a_store_that_failed_on_one_rank_is_never_published(ep):
    tokens = prompt(24, seed=8)
    a = FakeVllm(ep, ranks=2)
    a.fail_store_rank = 1
    req = a.add("a", tokens)
    a.admit(req)
    a.step({"a": 24})
    # freed, not inserted (the request's chain found nothing: it holds no lock)
    assert daemon_state(ep, a) == {"cached": 0, "locks": 0, "owned": 0}
    a.fail_store_rank = None
    a.decode(req, 5)
    a.step({"a": 1})  # the blocks are planned again, and published
    assert daemon_state(ep)["cached"] == 24
    a.finish(req)
    b = FakeVllm(ep, ranks=2)
    r = b.add("b", tokens)
    assert b.admit(r) == 20
    b.step({"b": 4})
    assert b.kv_matches(r, 24)
    a.close(), b.close()


def test_a_step_is_published_only_once_every_rank_reported_it(ep):
    """TP 2: rank 0 copied its heads and reported, rank 1's report never came: nothing is
    published (a page without rank 1's share would be served as whole)."""
    tokens = prompt(24, seed=11)
    a = FakeVllm(ep, ranks=2)
    a.silent_rank = 1
    req = a.add("a", tokens)
    a.admit(req)
    a.step({"a": 24})
    assert daemon_state(ep, a)["cached"] == 0
    a.silent_rank = None
    a.decode(req, 5)
    a.step({"a": 1})  # both report this one: planned again, and published
    assert daemon_state(ep)["cached"] == 24
    a.finish(req)
    a.close()


def test_a_load_that_cannot_be_done_is_reported_as_failed_blocks(ep):
    a = FakeVllm(ep)
    run_to_end(a, "a", prompt(20, seed=9))
    w = a.workers[0]
    ref = a.sched.link.pool
    gone = type(ref)(ref.epoch + 1, ref.config, {"device": {"path": "/nonexistent"}}, ref.layout)
    plan = StepPlan(
        99, {gone.epoch: gone}, loads=[Copy(1, "x", gone.epoch, _ids(3, 4), _ids(1, 2))]
    )
    w.load(plan)
    assert w.take_load_errors() == {3, 4}
    plan = StepPlan(100, {ref.epoch: ref}, loads=[Copy(2, "x", ref.epoch, _ids(5), _ids(10**6))])
    w.load(plan)  # a page outside the pool
    assert w.take_load_errors() == {5}
    withdrawn = StepPlan(101, {}, loads=[Copy(3, "x", 0, _ids(6), _ids(1))])
    w.load(withdrawn)
    assert w.take_load_errors() == {6}
    a.close()


def test_a_stalled_scheduler_withdraws_its_loads(ep):
    a = FakeVllm(ep)
    run_to_end(a, "a", prompt(20, seed=10))
    b = FakeVllm(ep)
    req = b.add("b", prompt(20, seed=10))
    b.admit(req)
    b.sched.loads[0][1].looked -= 60  # the lookup happened a minute ago (the pin may be gone)
    b.step({"b": 4})
    assert b.load_errors == set(req.blocks[:4])  # vLLM recomputes them
    a.close(), b.close()


def test_a_daemon_that_is_down_or_restarted_is_a_miss_then_serves_again(tmp_path):
    endpoint = f"ipc://{tmp_path}/h.sock"
    proc = start_daemon(endpoint, *ENGINE)
    try:
        a = FakeVllm(endpoint)
        run_to_end(a, "a", prompt(20, seed=11))
    finally:
        stop_daemon(proc)
    started = time.monotonic()
    req = a.add("b", prompt(20, seed=11))
    assert a.admit(req) == 0  # down: a miss, at once
    a.step({"b": 20})
    a.finish(req)
    assert time.monotonic() - started < 3
    assert a.sched.figures.unavailable >= 1
    proc = start_daemon(endpoint, *ENGINE)  # a new daemon life: no layout until registered
    try:
        run_to_end(a, "c", prompt(20, seed=12))  # re-registers the layout it learned
        b = FakeVllm(endpoint)
        req = b.add("d", prompt(20, seed=12))
        assert b.admit(req) == 16
        b.step({"d": 4})
        assert b.kv_matches(req, 20)
        b.finish(req)
        assert daemon_state(endpoint, a, b) == {"cached": 20, "locks": 0, "owned": 0}
        b.close()
    finally:
        stop_daemon(proc)
    a.close()


def test_a_daemon_that_stalls_during_a_publication_costs_the_engine_nothing(tmp_path):
    """An INSERT times out (the daemon is stopped between a step's plan and its report): the
    next steps plan no stores while the daemon cannot be used, the engine never raises, and
    once the daemon runs again the request's blocks are stored afresh in a new session."""
    endpoint = f"ipc://{tmp_path}/h.sock"
    proc = start_daemon(endpoint, *ENGINE)
    try:
        a = FakeVllm(endpoint)
        tokens = prompt(120, seed=13)
        req = a.add("a", tokens)
        a.admit(req)
        a.step({"a": 8})  # two blocks stored: the reserve has pages for two more
        plan = a.sched.plan(_out({"a": 8}, req))
        a._compute(req, 8)
        for w in a.workers:
            w.store(plan)
        proc.send_signal(signal.SIGSTOP)
        try:
            a.sched.report(a.workers[0].report(plan))  # its INSERT times out: the link is down
            assert a.sched.link.pool is None
            assert a.step({"a": 80}).stores == []  # 20 blocks, no pages to take: none planned
        finally:
            proc.send_signal(signal.SIGCONT)
        a.sched.link.down_until = 0.0  # (no wait for retry_s)
        a.decode(req, 7)
        a.step({"a": 25})  # a new session: every computed block is stored again
        a.finish(req)
        b = FakeVllm(endpoint)
        r = b.add("b", tokens + [7])
        assert b.admit(r) == 120
        b.step({"b": 1})
        assert b.kv_matches(r, 121)
        b.finish(r)
        assert daemon_state(endpoint)["cached"] == 120
        a.close(), b.close()
    finally:
        stop_daemon(proc)


def test_an_engine_stalled_past_its_lease_never_stores_into_pages_it_lost(tmp_path):
    """A stops (no heartbeat) until the daemon reclaimed its session; B publishes into the
    pages A had in reserve; A resumes and computes blocks: it must not copy into them."""
    endpoint = f"ipc://{tmp_path}/h.sock"
    proc = start_daemon(
        endpoint, *ENGINE[:-2], "--lease-seconds", "1", "--quarantine-seconds", "0.2"
    )
    try:
        a = FakeVllm(endpoint)
        ra = a.add("a", prompt(8, seed=1))
        a.admit(ra)
        a.step({"a": 8})  # stored; the reserve keeps pages for later stores
        assert len(a.sched.reserve)
        a.sched.link.client._link._stop_beat.set()  # A's process stalls
        deadline = time.monotonic() + 30
        while any(s["client"] == "fake-vllm" for s in _sessions(endpoint)):  # reclaimed
            assert time.monotonic() < deadline
            time.sleep(0.05)
        b = FakeVllm(endpoint)
        prompts = [prompt(40, seed=100 + i) for i in range(3)]
        for i, p in enumerate(prompts):
            run_to_end(b, f"b{i}", p)
        for i in range(8):  # A resumes: its decode completes a block
            a.decode(ra, 500 + i)
            a.step({"a": 1})
        c = FakeVllm(endpoint)
        for i, p in enumerate(prompts):
            r = c.add(f"c{i}", p)
            ext = c.admit(r)
            c.step({f"c{i}": len(p) - ext})
            assert ext == 36 and c.kv_matches(r, len(p)) and not c.load_errors
            c.finish(r)
        a.close(), b.close(), c.close()
    finally:
        stop_daemon(proc)


def test_a_layout_taken_from_the_daemon_gives_way_to_the_workers_own(tmp_path, monkeypatch):
    """Engine A starts before the daemon; B, same model but another head size, registers
    first. A must not take B's layout for its own: it is refused, and serves B's blocks never."""
    import tests.vllm_fake as fake

    endpoint = f"ipc://{tmp_path}/h.sock"
    a = FakeVllm(endpoint)  # no daemon yet: A's side knows no layout
    proc = start_daemon(endpoint, *ENGINE)
    try:
        monkeypatch.setattr(fake, "HEAD", 16)
        b = FakeVllm(endpoint)
        monkeypatch.setattr(fake, "HEAD", 8)
        p = prompt(40, seed=3)
        run_to_end(b, "b", p)
        a.sched.link.down_until = 0.0
        for i in range(2):
            r = a.add(f"a{i}", p)
            assert a.admit(r) == 0  # never a hit it cannot load
            a.step({f"a{i}": len(p)})
            assert not a.load_errors
            a.finish(r)
        assert a.sched.link.layout.head_size == 8 and a.sched.link.pool is None
        a.close(), b.close()
    finally:
        stop_daemon(proc)


def test_stores_of_a_step_that_do_not_all_fit_store_those_that_do(ep):
    """One long prefill's backlog must not keep every short request from being stored."""
    a = FakeVllm(ep, num_blocks=400)
    long = a.add("long", prompt(1200, seed=20))
    a.admit(long)
    stored = []
    for i in range(10):
        short = a.add(f"s{i}", prompt(20, seed=30 + i))
        a.admit(short)
        todo = {"long": min(64, 1200 - long.computed), f"s{i}": 20}
        a.step(todo)
        a.finish(short)
        stored.append(a.sched.figures.stored_tokens)
    # every step published something, even once the long request's chain filled the pool
    assert all(later > earlier for earlier, later in zip(stored, stored[1:], strict=False))
    a.finish(long)
    a.close()


def test_a_report_that_never_comes_does_not_hold_pages_for_ever(ep):
    a = FakeVllm(ep)
    r = a.add("a", prompt(24, seed=21))
    a.admit(r)
    plan = a.sched.plan(_out({"a": 24}, r))
    a._compute(r, 24)
    for w in a.workers:
        w.store(plan)  # copied, but the report is lost (a worker died)
    a.finish(r)
    assert daemon_state(ep, a)["owned"] > 0  # the store's pages, held until it settles
    for step in a.sched.opened_at:
        a.sched.opened_at[step] -= 60  # ... a minute ago
    a.sched.plan(_out({}, r))  # the next step settles it as failed
    assert daemon_state(ep, a) == {"cached": 0, "locks": 0, "owned": 0}
    a.close()


def test_namespaces_keep_salts_and_unreadable_prompts_apart(ep):
    a = FakeVllm(ep)
    tokens = prompt(20, seed=13)
    req = a.add("a", tokens, cache_salt="tenant-a")
    a.admit(req)
    a.step({"a": 20})
    a.finish(req)
    other = a.add("b", tokens, cache_salt="tenant-b")
    assert a.admit(other) == 0
    a.finish(other)
    same = a.add("c", tokens, cache_salt="tenant-a")
    assert a.admit(same) == 16
    a.finish(same)
    image = a.add("d", tokens, cache_salt="tenant-a", mm_features=["an image"])
    assert a.admit(image) == 0  # token ids do not say an image's KV
    a.finish(image)
    a.close()


def test_settings_refuse_unknown_keys_and_bad_values():
    s = ConnectorSettings.from_extra({"hicache.timeout_s": "0.5", "other.key": 1})
    assert s.timeout_s == 0.5
    with pytest.raises(ValueError, match="hicache.timeuot_s"):
        ConnectorSettings.from_extra({"hicache.timeuot_s": 1})
    with pytest.raises(ValueError, match="hicache.store"):
        ConnectorSettings.from_extra({"hicache.store": "maybe"})
    for key, value in [
        ("timeout_s", "inf"),
        ("timeout_s", True),
        ("timeout_s", 3e6),
        ("retry_s", float("nan")),
        ("retry_s", -1),
        ("endpoint", ""),
        ("endpoint", "garbage"),
        ("endpoint", "tcp://10.0.0.7:5555"),  # another host without CurveZMQ keys: anyone
        ("endpoint", "ipc://@hicache"),  # an abstract socket: no owner
    ]:
        with pytest.raises(ValueError, match=f"hicache.{key}"):
            ConnectorSettings.from_extra({f"hicache.{key}": value})


def test_the_connector_checks_the_daemon_and_its_pools_like_any_client(tmp_path):
    """Its scheduler and workers go through the client's checks (client/trust.py): a pool
    a plan names outside the daemon's own segments is never mapped, its load fails as a miss."""
    from hicache.client.trust import UntrustedDaemon

    ep = f"ipc://{tmp_path}/d.sock"
    proc = start_daemon(ep, "--device-tier", "engine", "--host-bytes", "4MiB")
    try:
        vllm = FakeVllm(ep)
        ref = vllm.sched.link.pool
        assert ref is not None and ref.daemon_uid == os.getuid()
        hostile = PoolRef(ref.epoch + 1, ref.config, {"device": {"name": "x", "path": "/etc/x"}},
                          ref.layout, ref.daemon_uid)  # fmt: skip
        with pytest.raises(UntrustedDaemon):
            vllm.workers[0]._pool(hostile)
        vllm.close()
    finally:
        stop_daemon(proc)


def _sessions(endpoint: str) -> list[dict]:
    with HiCacheClient(endpoint, name="probe") as hc:
        return hc.stats()["session_list"]


def _ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _out(todo: dict, req) -> object:
    from types import SimpleNamespace

    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r, num_computed_tokens=req.computed) for r in todo
        ],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens=dict(todo),
        scheduled_spec_decode_tokens={},
    )


def test_a_prefix_coming_from_the_store_is_asked_for_again_until_it_landed(tmp_path):
    """A daemon for engines with a store under its pool: what was flushed from the pool comes
    back from the store. The lookup never waits in the daemon: it answers "not yet" (None,
    holding no pin) until the pages landed, then the hit is loaded exactly; with
    ``l3_wait_s=0`` it answers at once with what the pool has."""
    with redis_cluster(tmp_path / "redis") as cluster:
        ep = f"ipc://{tmp_path}/h.sock"
        proc = start_daemon(ep, *ENGINE, "--l3", cluster.url, "--l3-model", "fake-model")
        try:
            tokens = prompt(42, seed=9)
            a = FakeVllm(ep)
            run_to_end(a, "a", tokens)
            assert l3_settled(ep)["written_pages"] == 10
            for impatient in (False, True):
                with HiCacheClient(ep, name="admin", admin=True) as hc:
                    hc.flush()  # the pool forgets; the store keeps them
                assert daemon_state(ep)["cached"] == 0
                b = FakeVllm(ep, l3_wait_s=0.0 if impatient else 30.0)
                req = b.add("b", tokens)
                first = b.sched.lookup(req, 0)
                if impatient:
                    assert first == 0  # no wait: the engine computes what is not there yet
                    l3_settled(ep)
                else:
                    assert first is None and b.sched.figures.l3_not_yet == 1
                    assert b.sched.figures.lookups == 0  # (counted when answered)
                    assert daemon_state(ep, a, b)["locks"] == 0  # "not yet" pins nothing
                    b.lookup(req)
                b.finish(req)
                req = b.add("b2", tokens)
                assert b.admit(req) == 40
                b.step({"b2": 2})
                assert not b.load_errors and b.kv_matches(req, len(tokens))
                b.finish(req)
                b.close()
            assert daemon_state(ep, a)["locks"] == 0
            a.close()
        finally:
            stop_daemon(proc)


def test_the_daemon_counts_an_engines_lookups_and_loads_as_vllm_does(ep):
    """engine_*_tokens add up with vLLM's external_prefix_cache_{queries,hits}: a lookup counts
    once the request's blocks are allocated, beyond vLLM's own hit, preempted requests left
    out; engine_loaded_tokens (and an engine daemon's load_tokens) is what the engine copied."""
    from tests.daemon_helpers import wait_until

    tokens = prompt(42)
    a = FakeVllm(ep)
    run_to_end(a, "r1", tokens)  # asked twice (lookup, then admission): counted once
    b = FakeVllm(ep)
    r2 = b.add("r2", tokens)
    assert b.admit(r2, own=BS) == 40 - BS  # vLLM had a block; 40 whole tokens are cached
    b.step({"r2": len(tokens) - r2.computed})  # the load runs
    b.finish(r2)
    r3 = b.add("r3", tokens)
    b.admit(r3, alloc=False)  # no free blocks: vLLM asks again later, counts only then
    r4 = b.add("r4", tokens, num_preemptions=1)
    b.admit(r4)  # resumed after a preemption: vLLM counts it apart
    r5 = b.add("r5", [5, 6, 7])
    assert b.admit(r5) == 0  # shorter than a block and a token: no call, still a query
    queried, hit = (42 - BS) + 3, 40 - BS  # what vLLM's counters say for engine b

    def sessions() -> dict:
        with HiCacheClient(ep, name="probe") as hc:
            listed = hc.stats()["session_list"]
        return {s["id"]: s for s in listed if s["client"] == "fake-vllm"}

    figures = ("engine_queried_tokens", "engine_hit_tokens", "engine_loaded_tokens")
    want = {(42, 0, 0), (queried, hit, hit)}
    # the heartbeats report them (within one beat)
    wait_until(
        lambda: {tuple(s[f] for f in figures) for s in sessions().values()} == want,
        what="the engines' figures",
    )
    b.finish(r3), b.finish(r4), b.finish(r5)
    a.close(), b.close()
    with HiCacheClient(ep, name="probe") as hc:
        stats = hc.stats(check=True)
    assert stats["integrity"] == "ok"
    assert stats["engine_queried_tokens"] == 42 + queried
    assert stats["engine_hit_tokens"] == hit
    assert stats["engine_loaded_tokens"] == stats["load_tokens"] == hit
    assert stats["load_bytes"] == hit * stats["token_bytes"]


def test_engine_figures_that_are_not_counts_are_refused_and_change_nothing(ep):
    from hicache.client.connection import DaemonError
    from hicache.protocol import Op

    with HiCacheClient(ep, name="e", heartbeat=False) as hc:
        for bad in (
            {"engine_queried_tokens": -1},
            {"engine_queried_tokens": 1.5},
            {"engine_loaded_tokens": True},
            {"engine_queried_tokens": 2, "engine_hit_tokens": 3},  # hits beyond the queries
            {"engine_loaded_tokens": 1 << 60},
        ):
            with pytest.raises(DaemonError, match="engine_"):
                hc._call(Op.HEARTBEAT, bad)
            with pytest.raises(DaemonError, match="engine_"):
                hc._call(Op.HOLDINGS, bad)  # (on any request of a session)
        stats = hc.stats()
        assert [stats[f"engine_{k}_tokens"] for k in ("queried", "hit", "loaded")] == [0, 0, 0]
        with pytest.raises(ValueError, match="more than queried"):
            hc.note_engine(queried=1, hit=2)
        hc._call(Op.HEARTBEAT, {"engine_queried_tokens": 5, "engine_hit_tokens": 5})
        assert hc.stats()["engine_hit_tokens"] == 5


def test_a_stopping_goodbye_quarantines_at_once_then_frees(ep):
    """close(stopping=True): copies of the stopping process may still write its pages, so the
    daemon holds them for the quarantine (not a lease and a quarantine), then frees them."""
    from tests.daemon_helpers import wait_until
    from tests.test_engine_tier import layout

    hc = HiCacheClient(ep, name="stopping")
    hc.register_layout(layout(block_size=BS, block_shape=(2, BS, 16)))
    hc.alloc(8 * BS)
    hc.close(stopping=True)

    def mine() -> list:
        with HiCacheClient(ep, name="probe") as probe:
            return [s for s in probe.stats()["session_list"] if s["client"] == "stopping"]

    held = mine()
    assert held and held[0]["lapsed"] and held[0]["owned_pages"] == 8  # at once, still held
    wait_until(lambda: not mine(), what="the quarantine's end")
    with HiCacheClient(ep, name="probe") as probe:
        stats = probe.stats(check=True)
    assert stats["integrity"] == "ok" and stats["host_owned_tokens"] == 0


def test_a_signal_to_vllm_ends_the_scheduler_session_as_stopping(ep):
    """vLLM's engine process may be killed before its shutdown reaches the connector: the
    connector's signal handler says a stopping goodbye first, then runs vLLM's handler."""
    from hicache.client.vllm.connector import _stop_on_signals
    from tests.daemon_helpers import wait_until

    v = FakeVllm(ep)
    run_to_end(v, "r1", prompt(42))
    seen: list[int] = []
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))  # "vLLM's"
        _stop_on_signals(v.sched.link)
        os.kill(os.getpid(), signal.SIGTERM)
        wait_until(lambda: seen, what="the chained handler")
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert seen == [signal.SIGTERM]
    with HiCacheClient(ep, name="probe") as probe:
        fake = [s for s in probe.stats()["session_list"] if s["client"] == "fake-vllm"]
    assert fake and all(s["lapsed"] for s in fake)  # in quarantine now, not after its lease
    assert v.sched.lookup(v.add("r2", prompt(42)), 0) == 0  # a miss: no new session opened
    assert v.sched.link.client is None
    v.close()


def test_the_connectors_log_lines_reach_vllms_log():
    """vLLM configures only its own loggers: hicache's lines go through its handlers."""
    import io
    import logging

    from hicache.client.vllm.connector import route_logs_to_vllm

    ours, theirs = logging.getLogger("hicache"), logging.getLogger("vllm")
    saved = (ours.handlers[:], ours.level, ours.propagate, theirs.handlers[:])
    out = io.StringIO()
    try:
        ours.handlers.clear()
        theirs.handlers[:] = [logging.StreamHandler(out)]
        route_logs_to_vllm()
        logging.getLogger("hicache.vllm").info("hicache: host tier of this engine: ...")
        assert "host tier of this engine" in out.getvalue()
    finally:
        ours.handlers[:], ours.level, ours.propagate, theirs.handlers[:] = saved


def test_a_load_that_fails_in_a_worker_is_not_counted_as_loaded(ep):
    """vLLM counts the hit (it was promised), but recomputes the blocks: not loaded."""
    tokens = prompt(42, seed=3)
    a = FakeVllm(ep)
    run_to_end(a, "a", tokens)
    b = FakeVllm(ep)

    def broken(*_: object) -> None:
        raise OSError("a copy that fails")

    b.workers[0].copier.load = broken
    req = b.add("b", tokens)
    assert b.admit(req) == 40
    b.step({"b": len(tokens) - req.computed})
    assert b.load_errors == set(req.blocks[:10])
    a.close(), b.close()
    with HiCacheClient(ep, name="probe") as hc:
        stats = hc.stats()
    assert stats["engine_hit_tokens"] == 40 and stats["engine_loaded_tokens"] == 0


def test_engine_totals_saturate_and_a_bad_goodbye_still_ends_the_session(ep):
    """Hostile review: totals past 2**64 made every STATS reply unsendable; a goodbye with a
    figure the daemon refuses left the session (and its pages) to its lease."""
    from hicache.client.connection import DaemonError
    from hicache.daemon.sessions import SATURATED, EngineCounts
    from hicache.protocol import Op
    from tests.test_engine_tier import layout

    total = EngineCounts()
    for _ in range(3):
        total.add(EngineCounts(SATURATED, SATURATED, SATURATED))
    assert total == EngineCounts(SATURATED, SATURATED, SATURATED)
    hc = HiCacheClient(ep, name="bad-goodbye", heartbeat=False)
    hc.register_layout(layout(block_size=BS, block_shape=(2, BS, 16)))
    hc.alloc(4 * BS)
    with pytest.raises(ValueError, match="below 2"):
        hc.note_engine(loaded=1 << 48)
    with pytest.raises(DaemonError, match="session ended"):
        hc._call(Op.GOODBYE, {"engine_loaded_tokens": -1})
    with HiCacheClient(ep, name="probe") as probe:
        stats = probe.stats(check=True)
    assert stats["integrity"] == "ok"
    assert not [s for s in stats["session_list"] if s["client"] == "bad-goodbye"]
    assert stats["host_owned_tokens"] == 0 and stats["engine_loaded_tokens"] == 0
    hc.close()


def test_a_stopped_link_stays_stopped(ep):
    """Hostile review: a call interrupted by the stop (ClientClosed) marked the link down for
    retry_s only, and the next lookup opened a new session."""
    v = FakeVllm(ep)
    link = v.sched.link
    link.stop()
    link._down("a call ended by the stop")
    link.down_until = 0.0  # (its retry time passed)
    assert link.ready() is None and link.client is None
    v.close()


def test_a_signal_the_process_ignores_leaves_the_session_alone(ep):
    from hicache.client.vllm.connector import _stop_on_signals

    v = FakeVllm(ep)
    saved = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _stop_on_signals(v.sched.link)
        os.kill(os.getpid(), signal.SIGTERM)
        assert v.sched.link.client is not None and not v.sched.link.stopped
    finally:
        signal.signal(signal.SIGTERM, saved)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    v.close()


def test_a_draining_daemon_gets_the_engines_reserve_back_and_stops_without_waiting(tmp_path):
    """Operator's walk: the connector held pages ahead for later stores, so a daemon stopped
    under an idle vLLM always waited its whole --shutdown-timeout. The heartbeat's "draining"
    now makes the engine give them back."""
    endpoint = f"ipc://{tmp_path}/d.sock"
    proc = start_daemon(endpoint, *ENGINE, "--shutdown-timeout", "60")
    v = FakeVllm(endpoint)
    try:
        run_to_end(v, "r1", prompt(42))
        assert len(v.sched.reserve) > 0  # pages held ahead, as an idle vLLM holds them
    finally:
        log = stop_daemon(proc, timeout=90)
        v.close()
    assert "drained: no session holds pages or locks" in log, log
    assert "shutdown timeout" not in log
