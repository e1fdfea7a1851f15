"""One client's heavy requests cannot hold the control loop: a long batched match answers in
turns while other requests wait (the client asks again for the rest), and whole-cache views
(integrity checks, tree dumps) that delay others are refused past their share of the loop."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache import HiCacheConfig, HiRadixCache
from hicache.client import HiCacheClient
from hicache.client.connection import LeaseLost
from hicache.daemon import server as server_module
from hicache.daemon.config import build_parser, resolve
from hicache.daemon.requests import Handlers, Transport, ViewBudget, cache_ops
from hicache.daemon.requests import handlers as handlers_module
from hicache.daemon.server import Daemon
from hicache.daemon.sessions import SessionTable
from hicache.daemon.transport import watch
from hicache.protocol import (
    PROTOCOL_VERSION,
    ErrorCode,
    MatchEntry,
    MatchReply,
    Op,
    ProtocolError,
    TokenBatch,
    decode_reply,
    token_batch,
)
from hicache.tree import pack_shared, unpack_shared

PS = 4
SYSTEM = np.arange(500, 508, dtype=np.int32)
# four cached prompts over one system prompt, a copy of one (all of it shared), and a miss
PROMPTS = [np.concatenate([SYSTEM, np.arange(i * 1000, i * 1000 + 4 + 4 * i, dtype=np.int32)])
           for i in range(4)]  # fmt: skip
PROMPTS += [PROMPTS[3].copy(), np.arange(9000, 9012, dtype=np.int32)]


def _world(
    admin_token: str | None = None, others_waiting: Callable[[], bool] = bool
) -> tuple[HiRadixCache, Handlers, int]:
    cache = HiRadixCache(
        HiCacheConfig(num_layers=1, num_kv_heads=1, head_dim=2, page_size=PS, device_tokens=512)
    )
    handlers = Handlers(
        cache, SessionTable(lease_s=1e9), 3, {}, admin_token=admin_token,
        transport=Transport(others_waiting=others_waiting),
    )  # fmt: skip
    session = handlers.sessions.open("t", 1, time.monotonic()).key
    for p in PROMPTS[:4]:  # four of six cached
        _, out = _call(handlers, session, Op.ALLOC, {"num_tokens": len(p)})
        _call(handlers, session, Op.INSERT, {"lengths": [len(p)]}, [p.tobytes(), out[0]])
    return cache, handlers, session


def _call(handlers: Handlers, session: int, op: Op, fields: dict, frames=()):  # noqa: ANN001
    epoch = handlers.boot_epoch
    reply, out = handlers.handle(
        msgpack.packb([PROTOCOL_VERSION, int(op), 1, session, epoch, fields]), list(frames)
    )
    decoded = decode_reply(reply)
    return decoded, out


def _matches_served(daemon: Daemon) -> int:
    return sum(daemon.handlers.requests.as_dict()["op_latency"]["match"]["buckets"])


def _batch_fields(prompts: list[np.ndarray], lock: bool) -> tuple[dict, list]:
    frame, shared = pack_shared(prompts)
    return {"lengths": [len(p) for p in prompts], "shared": shared, "lock": lock}, [frame]


def test_a_batch_answers_in_turns_while_others_wait_and_alone_in_one(monkeypatch):
    waiting = [False]  # whether the transport says others wait
    cache, handlers, session = _world(others_waiting=lambda: waiting[0])
    fields, frames = _batch_fields(PROMPTS, lock=True)
    assert fields["shared"] == [0, 8, 8, 8, 24, 0]  # (what the parts must rebuild)
    whole, _ = _call(handlers, session, Op.MATCH, fields, frames)  # nobody waits: one reply
    assert whole.ok and len(whole.fields["results"]) == len(PROMPTS)
    _call(handlers, session, Op.RELEASE, {"all": True})

    monkeypatch.setattr(cache_ops, "TURN_S", 0.0)
    monkeypatch.setattr(cache_ops, "TURN_PER_CHECK", 0)
    waiting[0] = True  # someone always waits: one prompt per turn
    turns, results = 0, []
    while len(results) < len(PROMPTS):
        fields, frames = _batch_fields(PROMPTS[len(results) :], lock=True)
        reply, _ = _call(handlers, session, Op.MATCH, fields, frames)
        assert reply.ok, reply.fields
        assert len(reply.fields["results"]) == 1  # at least one, and no more past the turn
        results += reply.fields["results"]
        turns += 1
        handlers.check_integrity()
    assert turns == len(PROMPTS)
    # the same hits as the whole batch, each found prompt locked once (misses hold none)
    entries = MatchReply.read(whole.fields).results
    assert [MatchEntry(*r)[:2] for r in results] == [e[:2] for e in entries]
    locked = [r[2] for r in results if r[2]]
    assert len(locked) == 5 and sorted(
        handlers.sessions.touch(session, time.monotonic()).locks
    ) == sorted(locked)
    cache.close()


def test_the_client_asks_again_for_the_rest_and_releases_all_when_a_part_fails(tmp_path):
    args = ["--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8", "--page-size", "4",
            "--device-tokens", "512", "--endpoint", f"ipc://{tmp_path}/d.sock",
            "--keep-host", "false"]  # fmt: skip
    daemon = Daemon(resolve(build_parser().parse_args(args), environ={}))
    serving = threading.Thread(target=daemon.serve, daemon=True)
    serving.start()
    try:
        with HiCacheClient(daemon.settings.endpoint, name="t") as hc:
            for p in PROMPTS[:4]:
                hc.insert(p, hc.alloc(len(p)))
            whole = hc.match_batch(PROMPTS, lock=False)
            asked = _matches_served(daemon)
            old_turn = cache_ops.TURN_S, cache_ops.TURN_PER_CHECK
            cache_ops.TURN_S = cache_ops.TURN_PER_CHECK = 0
            daemon.inbox.others_waiting = lambda may_yield=True: True  # (what the handlers ask)
            try:
                parts = hc.match_batch(PROMPTS, lock=True)
                again = _matches_served(daemon)
                assert again - asked == len(PROMPTS)  # one round trip per prompt
                assert [m.device_hit_length for m in parts] == [m.device_hit_length for m in whole]
                assert [m.device_indices.tolist() for m in parts] == [
                    m.device_indices.tolist() for m in whole
                ]
                assert len(hc.holdings().lock_ids) == 5
                hc.release(*parts)

                real = daemon.handlers.cache.match_key
                calls = []

                def fail_third(*a, **k):  # noqa: ANN002, ANN003, ANN202
                    calls.append(1)
                    if len(calls) == 3:
                        raise ValueError("a part of the batch fails")
                    return real(*a, **k)

                daemon.handlers.cache.match_key = fail_third
                with pytest.raises(Exception, match="a part of the batch fails"):
                    hc.match_batch(PROMPTS, lock=True)
                daemon.handlers.cache.match_key = real
                assert hc.holdings().lock_ids == []  # the first two parts' locks went back
                assert hc.match_batch([]) == []  # nothing to answer is no error

                # another thread reconnects between two parts: the answer would mix two
                # sessions (the first part's locks void), so the batch is refused
                parts_of, reconnected = hc._matches_and_frames, []

                def reconnect_after_first(*a, **k):  # noqa: ANN002, ANN003, ANN202
                    out = parts_of(*a, **k)
                    if not reconnected:
                        hc._link._open()  # (as a reconnect after a lost lease does)
                        reconnected.append(True)
                    return out

                hc._matches_and_frames = reconnect_after_first
                with pytest.raises(LeaseLost, match="answered in parts"):
                    hc.match_batch(PROMPTS, lock=True)
                hc._matches_and_frames = parts_of
                assert reconnected == [True] and hc.holdings().lock_ids == []
            finally:
                cache_ops.TURN_S, cache_ops.TURN_PER_CHECK = old_turn
                del daemon.inbox.others_waiting  # (the inbox's own again)
            assert hc.stats(check=True)["integrity"] == "ok"
    finally:
        daemon.stop()
        serving.join(30)
        daemon.close()


def test_views_that_delay_others_are_refused_past_their_share():
    now = [0.0]
    budget = ViewBudget(share=0.01, burst_s=0.05, clock=lambda: now[0])
    for _ in range(100):  # nobody waited: free, however many
        budget.check("a view")
        budget.charge(0.01, delayed_others=False)
    for _ in range(6):  # 60 ms of views others waited for: past the 50 ms burst
        budget.check("a view")
        budget.charge(0.01, delayed_others=True)
    with pytest.raises(ProtocolError, match="retry in 1.0 s") as refused:
        budget.check("a view")
    assert refused.value.code is ErrorCode.QUOTA_EXCEEDED and budget.refused == 1
    now[0] = 0.99  # drains at 1% of real time: 9.9 ms gone, still 0.1 ms over
    with pytest.raises(ProtocolError, match="holds the daemon's loop"):
        budget.check("a view")
    now[0] = 1.01
    budget.check("a view")


def test_views_of_non_admins_are_limited_admins_are_not():
    """Integrity checks, tree views, stats reports (every session listed) and capacity reports
    (the estimate fed first) all hold the loop: past their share, non-admins are refused."""
    cache, handlers, session = _world(admin_token="tok", others_waiting=lambda: True)
    hello = {"client": "op", "pid": 2, "admin": True, "admin_token": "tok"}
    admin = _call(handlers, 0, Op.HELLO, hello)[0].fields["session"]
    handlers.views = ViewBudget(share=1e-9, burst_s=0.0)  # any view others waited for: over
    first, _ = _call(handlers, session, Op.TREE, {})
    assert first.ok
    assert _call(handlers, 0, Op.STATS, {})[0].ok  # few sessions: a cheap report, no view
    for i in range(handlers_module.CHEAP_SESSION_LIST):  # more: every one is listed
        handlers.sessions.open(f"engine-{i}", i, time.monotonic())
    asks = [(Op.TREE, {}, session), (Op.STATS, {"check": True}, 0), (Op.STATS, {}, 0),
            (Op.STATS, {}, session), (Op.TREE, {"shape": True}, session),
            (Op.CAPACITY, {}, session)]  # fmt: skip
    for op, fields, who in asks:
        refused, _ = _call(handlers, who, op, fields)
        assert refused.status is ErrorCode.QUOTA_EXCEEDED, (op, refused.fields)
        assert "holds the daemon's loop" in refused.fields["message"]
    ok, _ = _call(handlers, admin, Op.STATS, {"check": True})
    assert ok.ok and ok.fields["integrity"] == "ok"
    assert ok.fields["views_refused"] == len(asks)
    assert _call(handlers, admin, Op.TREE, {})[0].ok
    assert _call(handlers, admin, Op.CAPACITY, {})[0].ok
    assert handlers.report()["views_refused"] == len(asks)  # the metrics' own: never held back
    cache.close()


@settings(max_examples=150, deadline=None)
@given(
    seqs=st.lists(st.lists(st.integers(0, 3), max_size=40), min_size=1, max_size=12),
    block=st.integers(4, 200),
)
def test_a_token_batch_expands_block_by_block_to_the_same_keys(seqs, block):
    arrays = [np.array(s, np.int32) for s in seqs]
    frame, shared = pack_shared(arrays)
    lengths = [len(a) for a in arrays]
    batch = token_batch(frame, lengths, shared)
    if isinstance(batch, TokenBatch):
        batch.BLOCK_BYTES = block  # (an instance's own: blocks of a few sequences)
    assert len(batch) == len(arrays)
    assert list(batch) == [a.tobytes() for a in arrays] == unpack_shared(frame, lengths, shared)


def test_a_wake_of_the_third_tier_is_not_a_request_waiting_and_a_request_read_goes_first(
    tmp_path,
):
    """The turn asks the socket whether others wait: the third tier's wakes arrive on it too
    and must not split a lone client's batch; a request read on the way is served next."""
    import zmq

    args = ["--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8", "--device-tokens",
            "512", "--host-tokens", "1024", "--l3", "memory://fair-turns", "--l3-model", "m",
            "--endpoint", f"ipc://{tmp_path}/d.sock", "--keep-host", "false"]  # fmt: skip
    daemon = Daemon(resolve(build_parser().parse_args(args), environ={}))
    peer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        others = daemon.handlers.transport.others_waiting
        daemon.waits.wake()  # what the tier's IO thread sends when a fetch lands
        assert not others() and daemon.inbox.woken  # noted, not counted
        peer.connect(daemon.settings.endpoint)
        peer.send(b"a request")
        assert watch(daemon.sock, time.perf_counter() + 30)  # (arrived; nothing read)
        assert others() and others()  # read once, kept: asking again reads nothing more
        assert daemon.inbox.next()[-1] == b"a request"
    finally:
        peer.close(linger=0)
        daemon.close()


def _daemon(tmp_path) -> Daemon:  # noqa: ANN001
    args = ["--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8", "--device-tokens",
            "512", "--endpoint", f"ipc://{tmp_path}/d.sock", "--keep-host", "false"]  # fmt: skip
    return Daemon(resolve(build_parser().parse_args(args), environ={}))


def test_a_long_turn_yields_the_core_now_and_then_for_zmqs_io_thread(tmp_path, monkeypatch):
    """Requests reach the socket through zmq's io thread: while a long request holds the
    loop, asking whether others wait gives the core away once per YIELD_EVERY_S (so a daemon
    on one core still sees them), and no more often (a yield per prompt would cost more than
    the matches)."""
    from hicache.daemon.transport import inbox as inbox_module

    daemon = _daemon(tmp_path)
    yields = []  # when the inbox decided to yield (read by it, so a preemption between its
    # reading the clock and the yield itself does not shorten the next gap)
    inbox = daemon.inbox
    monkeypatch.setattr(
        inbox_module,
        "yield_cpu",
        lambda: yields.append(inbox._yield_after - inbox_module.YIELD_EVERY_S),
    )
    try:
        others, asked = daemon.handlers.transport.others_waiting, 0
        started = time.perf_counter()
        while time.perf_counter() - started < 0.02:
            assert not others()
            asked += 1
        took = time.perf_counter() - started
        assert asked > 10 * len(yields)
        assert 1 <= len(yields) <= took / inbox_module.YIELD_EVERY_S + 1
        gaps = np.diff(yields)
        assert (gaps >= inbox_module.YIELD_EVERY_S - 1e-9).all()  # (clock readings: 1e-11 s apart)
    finally:
        daemon.close()


def _read(daemon: Daemon, count: int) -> None:
    """Wait until ``count`` messages are read ahead (asking as a long turn does)."""
    deadline = time.monotonic() + 30
    while len(daemon.inbox._ahead) < count:
        assert time.monotonic() < deadline, "messages did not arrive"
        daemon.handlers.transport.others_waiting()


def _peers(daemon: Daemon, *names: bytes) -> list:
    import zmq

    socks = []
    for name in names:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, name)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(daemon.settings.endpoint)
        socks.append(sock)
    return socks


def test_the_served_peers_own_requests_do_not_end_its_turn_and_anothers_goes_first(tmp_path):
    """A client with requests in flight must not make its own turn end (each would then be
    answered in more parts while others wait behind them); another client's request ends it
    and is served before the first client's next ones, which keep their order. A client with
    READ_AHEAD requests read ahead ends its turn too (others may wait in the socket behind
    them). Each request served from the read-ahead carries its own first part (its CurveZMQ
    key and process are read from it), and reading ahead never replaces the first part of the
    request being served."""
    from hicache.daemon.transport import inbox as inbox_module

    daemon = _daemon(tmp_path)
    heavy, light = _peers(daemon, b"heavy", b"light")
    inbox = daemon.inbox
    try:
        others = daemon.handlers.transport.others_waiting
        heavy.send(b"heavy first")
        assert inbox.next()[-1] == b"heavy first"  # serving one of heavy's requests
        for i in range(2):
            heavy.send(b"heavy %d" % i)
        _read(daemon, 2)
        assert not others(), "the served client's own requests ended its turn"
        light.send(b"light 0")
        assert watch(daemon.sock, time.perf_counter() + 30)
        assert others() and others()
        assert inbox.serving == inbox._first.bytes == b"heavy"  # still the served one's
        heavy.send(b"heavy 2")  # after another's: waits behind it
        assert watch(daemon.sock, time.perf_counter() + 30)
        served = []
        while (frames := inbox.next()) is not None:
            served.append(frames[-1])
            assert inbox._first is not None and inbox._first.bytes == frames[0]
        assert served == [b"light 0", b"heavy 0", b"heavy 1", b"heavy 2"]
        for i in range(inbox_module.READ_AHEAD + 2):
            heavy.send(b"more %d" % i)
        inbox.serving = b"heavy"
        _read(daemon, inbox_module.READ_AHEAD)
        assert others() and len(inbox._ahead) == inbox_module.READ_AHEAD
    finally:
        heavy.close(linger=0)
        light.close(linger=0)
        daemon.close()


def test_a_client_with_requests_read_ahead_still_takes_turns_with_the_socket(tmp_path):
    """Read-ahead must not let one client's requests run back to back ahead of another's that
    arrived meanwhile: serving the read-ahead, a request queued in the socket by another
    client goes before the served client's next one."""
    daemon = _daemon(tmp_path)
    heavy, light = _peers(daemon, b"heavy", b"light")
    inbox = daemon.inbox
    try:
        heavy.send(b"heavy first")
        assert inbox.next()[-1] == b"heavy first"
        for i in range(3):
            heavy.send(b"heavy %d" % i)
        _read(daemon, 3)  # its own: read ahead
        light.send(b"light 0")  # not read yet: in the socket
        assert watch(daemon.sock, time.perf_counter() + 30)
        served = []
        while (frames := inbox.next()) is not None:
            served.append(frames[-1])
        assert served == [b"light 0", b"heavy 0", b"heavy 1", b"heavy 2"]
    finally:
        heavy.close(linger=0)
        light.close(linger=0)
        daemon.close()


def test_the_third_tiers_lookups_take_turns_too(tmp_path, monkeypatch):
    """With a third tier, a batch first asks the store for what the tree lacks of each prompt:
    that pass takes turns as the matching does (the prompts it reached are answered, the rest
    asked for again), so it cannot hold the loop for a whole batch either."""
    args = ["--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8", "--device-tokens",
            "512", "--host-tokens", "1024", "--l3", "memory://fair-turns-l3", "--l3-model", "m",
            "--endpoint", f"ipc://{tmp_path}/d.sock", "--keep-host", "false"]  # fmt: skip
    daemon = Daemon(resolve(build_parser().parse_args(args), environ={}))
    try:
        handlers = daemon.handlers
        session = handlers.sessions.open("t", 1, time.monotonic()).key
        asked = []
        real = daemon.cache.l3.prefetch

        def prefetch(tokens, space, covered):  # noqa: ANN001, ANN202
            asked.append(bytes(tokens))
            return real(tokens, space, covered)

        monkeypatch.setattr(daemon.cache.l3, "prefetch", prefetch)
        fields, frames = _batch_fields(PROMPTS, lock=False)
        fields["l3_wait"] = False
        whole, _ = _call(handlers, session, Op.MATCH, fields, frames)  # nobody waits
        assert whole.ok, whole.fields
        assert len(whole.fields["results"]) == len(PROMPTS) == len(asked)

        monkeypatch.setattr(cache_ops, "TURN_S", 0.0)
        monkeypatch.setattr(cache_ops, "TURN_PER_CHECK", 0)
        monkeypatch.setattr(daemon.inbox, "others_waiting", lambda may_yield=True: True)
        asked.clear()
        part, _ = _call(handlers, session, Op.MATCH, fields, frames)
        assert part.ok and len(part.fields["results"]) == 1 and len(asked) == 1
        assert asked[0] == PROMPTS[0].tobytes()
        handlers.check_integrity()
    finally:
        daemon.close()


def test_a_resumed_match_between_read_and_serve_leaves_the_request_its_sender(tmp_path):
    """(hostile review) A match parked on the third tier may be answered between reading a
    request and serving it; its turn reads ahead as its own client's. The request then served
    must still be its own sender's (a HELLO reads its process and CurveZMQ key from it)."""
    daemon = _daemon(tmp_path)
    heavy, light = _peers(daemon, b"heavy", b"light")
    inbox = daemon.inbox
    try:
        light.send(b"not a request")
        frames = inbox.next()
        heavy.send(b"heavy's next")
        assert watch(daemon.sock, time.perf_counter() + 30)
        daemon._handle_resumed(b"heavy", b"a parked match", [])  # (answered: an error)
        assert inbox.serving == b"heavy" and not daemon.handlers.transport.others_waiting()
        assert inbox._first.bytes == b"light"  # its read-ahead replaced nothing
        served, handle = [], daemon.handlers.handle
        daemon.handlers.handle = lambda h, f, call: served.append(call.peer) or handle(h, f, call)
        daemon._serve_one(frames)
        assert inbox.serving == b"light" and served == [b"light"]
        assert inbox.next()[-1] == b"heavy's next"
    finally:
        heavy.close(linger=0)
        light.close(linger=0)
        daemon.close()


def test_housekeeping_leaves_what_can_wait_while_another_clients_request_does(
    tmp_path, monkeypatch
):
    """A housekeeping pass always handles acks and leases, but the capacity feed's slice and
    giving memory back (0.37 ms a pass) wait while another client's request is queued: that
    request is served first, and the next pass with nobody waiting does them. Looking never
    gives the core away (a yield on a shared core may take milliseconds)."""
    from hicache.daemon.transport import inbox as inbox_module

    yields = []
    monkeypatch.setattr(inbox_module, "yield_cpu", lambda: yields.append(1))
    daemon = _daemon(tmp_path)
    housekeep = daemon._housekeep

    def _housekeep() -> None:
        daemon.inbox._yield_after, before = 0.0, len(yields)  # (a yield would be due)
        housekeep()
        assert len(yields) == before, "housekeeping gave the core away"

    daemon._housekeep = _housekeep
    heavy, light = _peers(daemon, b"heavy", b"light")
    feed, trims = daemon.handlers.capacity, []
    daemon._trim.maybe = lambda: trims.append(1)  # (the instance's: nothing else sees it)
    expired = []
    real_expire = daemon.handlers.sessions.expire
    daemon.handlers.sessions.expire = lambda now: expired.append(now) or real_expire(now)
    try:
        feed.saw(True, np.arange(64, dtype=np.int32).tobytes(), None)
        heavy.send(b"heavy first")
        assert daemon.inbox.next()[-1] == b"heavy first"  # serving heavy's request
        light.send(b"light 0")
        assert watch(daemon.sock, time.perf_counter() + 30)
        daemon._housekeep()
        assert len(expired) == 1, "leases are looked at whoever waits"
        assert len(feed.pending) == 1 and not trims, "a statistic went before a request"
        assert daemon.inbox.next()[-1] == b"light 0"  # served next
        daemon._housekeep()  # nobody waits now
        assert len(expired) == 2 and not feed.pending and trims == [1]
        # engines that always keep one waiting: past DEFER_AT_MOST_S, the parts run anyway
        feed.saw(True, np.arange(64, dtype=np.int32).tobytes(), None)
        heavy.send(b"heavy again")
        assert watch(daemon.sock, time.perf_counter() + 30)
        assert daemon.handlers.transport.others_waiting()
        daemon._housekeep()
        assert len(feed.pending) == 1 and trims == [1]
        daemon._optional_ran -= server_module.DEFER_AT_MOST_S
        daemon._housekeep()
        assert not feed.pending and trims == [1, 1]
    finally:
        heavy.close(linger=0)
        light.close(linger=0)
        daemon.close()
