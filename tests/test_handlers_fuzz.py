"""Random requests straight into the daemon's handlers: every one gets a reply, none escapes as
an exception, and the cache stays intact."""

import time

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache import HiCacheConfig, HiRadixCache
from hicache.daemon.requests import Handlers
from hicache.daemon.sessions import SessionTable
from hicache.protocol import PROTOCOL_VERSION, ErrorCode, MatchReply, Op, decode_reply

CACHE = HiRadixCache(
    HiCacheConfig(
        num_layers=1,
        num_kv_heads=1,
        head_dim=2,
        page_size=2,
        device_tokens=64,
        host_tokens=128,
        load_back_threshold=1,
    )
)
HANDLERS = Handlers(CACHE, SessionTable(lease_s=1e9), boot_epoch=5, info={})
SESSION = HANDLERS.sessions.open("fuzz", 1, time.monotonic()).key

values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
field_names = st.sampled_from(
    [
        "num_tokens",
        "lengths",
        "shared",
        "wait",
        "namespaces",
        "lock",
        "lock_id",
        "lock_ids",
        "device_tokens",
        "host_tokens",
        "check",
        "max_nodes",
        "client",
        "pid",
    ]
)
fields = st.dictionaries(field_names, values | st.lists(st.integers(0, 40), max_size=3), max_size=4)
int_frames = st.lists(st.integers(-3, 140), max_size=24).map(
    lambda xs: np.array(xs, dtype=np.int64).tobytes()
)
token_frames = st.lists(st.integers(0, 3), max_size=24).map(
    lambda xs: np.array(xs, dtype=np.int32).tobytes()
)
frames = st.lists(int_frames | token_frames | st.binary(max_size=20), max_size=3)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    op=st.sampled_from(list(Op)) | st.integers(-1, 40),
    fields=fields,
    frames=frames,
    session=st.sampled_from([SESSION, 0, 999]),
    epoch=st.sampled_from([5, 0, 6]),
    views=st.booleans(),
)
def test_no_request_breaks_the_daemon(op, fields, frames, session, epoch, views):
    if op == Op.GOODBYE:
        op = Op.HEARTBEAT  # keep the fuzzing session alive
    if views:  # large frames reach the handlers as views of zmq's buffer
        frames = [memoryview(f) for f in frames]
    header = msgpack.packb([PROTOCOL_VERSION, int(op), 1, session, epoch, fields])
    reply, out = HANDLERS.handle(header, frames)
    decoded = decode_reply(reply)
    assert decoded.status is not ErrorCode.INTERNAL, decoded.fields
    assert decoded.boot_epoch == 5
    HANDLERS.check_integrity()


# ---- well-formed requests of valid sessions ---------------------------------------------------
# The fuzz above is mostly refused before any handler runs (wrong epoch, unknown op or session).
# Here every request names a live session of this daemon life (an admin one for EVICT and
# FLUSH) and is shaped like a client's, built from what the session was granted, with a share
# of hostile values: every op must succeed at least once, and after each request the daemon's
# ownership must be what its replies said.
OPS_REACHED: dict[str, int] = {}
WELL_FORMED_OPS = [
    Op.ALLOC, Op.ALLOC_EXTEND, Op.ALLOC_DECODE, Op.FREE, Op.INSERT, Op.MATCH, Op.LOAD_BACK,
    Op.LOCK, Op.RELEASE, Op.HOLDINGS, Op.EVICT, Op.FLUSH, Op.STATS, Op.TREE, Op.PING,
    Op.HEARTBEAT, Op.CAPACITY,
]  # fmt: skip
PS = 2


def _client_world():  # noqa: ANN202
    cache = HiRadixCache(
        HiCacheConfig(
            num_layers=1,
            num_kv_heads=1,
            head_dim=2,
            page_size=PS,
            device_tokens=64,
            host_tokens=128,
            load_back_threshold=1,
        )  # fmt: skip
    )
    handlers = Handlers(cache, SessionTable(lease_s=1e9), boot_epoch=7, info={}, admin_token="t")
    return cache, handlers


def _call(handlers, op, session, fields=None, frames=(), count=True):  # noqa: ANN001, ANN202
    header = msgpack.packb([PROTOCOL_VERSION, int(op), 1, session, 7, fields or {}])
    reply, out = handlers.handle(header, list(frames))
    decoded = decode_reply(reply)
    assert decoded.status is not ErrorCode.INTERNAL, (op, decoded.fields)
    if decoded.ok and count:
        OPS_REACHED[op.name] = OPS_REACHED.get(op.name, 0) + 1
    return decoded, out


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_well_formed_requests_of_live_sessions_keep_ownership_exact(data):
    cache, handlers = _client_world()
    hello = {"client": "fuzz", "pid": 1}
    reply, _ = _call(handlers, Op.HELLO, 0, hello)
    session = reply.fields["session"]
    reply, _ = _call(handlers, Op.HELLO, 0, {**hello, "admin": True, "admin_token": "t"})
    admin = reply.fields["session"]
    granted: list[np.ndarray] = []  # slot arrays this session holds, as the replies said
    locks: list[int] = []
    seqs: list[np.ndarray] = []
    # Every session starts with a cached, locked prefix (a finished prefill kept for its
    # decode), so LOCK, LOAD_BACK and RELEASE find a lock to act on whatever order the ops are
    # drawn in; without it they were reached by luck and a fresh run could miss them (not
    # counted as reached: the loop below must reach ALLOC and INSERT on its own).
    first = np.array(data.draw(st.lists(st.integers(0, 3), min_size=PS, max_size=4 * PS)),
                     np.int32)  # fmt: skip
    reply, out = _call(handlers, Op.ALLOC, session, {"num_tokens": len(first)}, count=False)
    slots = np.frombuffer(bytes(out[0]), np.int64).copy()
    reply, _ = _call(handlers, Op.INSERT, session, {"lengths": [len(first)], "lock": True},
                     [first.tobytes(), slots.tobytes()], count=False)  # fmt: skip
    locks += [e.lock_id for e in MatchReply.read(reply.fields).results if e.lock_id]
    seqs.append(first)
    assert locks, reply.fields
    # the partial tail page (if any) stays the session's
    if len(first) % PS:
        granted.append(slots[len(first) // PS * PS :])
    ints = st.integers(-2, 40)
    for _ in range(data.draw(st.integers(5, 30))):
        op = data.draw(st.sampled_from(WELL_FORMED_OPS))
        hostile = data.draw(st.integers(0, 9)) == 0  # one request in ten: values out of range
        tokens = np.array(data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=12)),
                          np.int32)  # fmt: skip
        if seqs and data.draw(st.booleans()):
            tokens = np.concatenate([data.draw(st.sampled_from(seqs)), tokens])
        fields, frames, who = {}, [], session
        if op is Op.ALLOC:
            fields = {"num_tokens": data.draw(ints) if hostile else len(tokens)}
        elif op is Op.ALLOC_EXTEND:
            prefix = data.draw(st.integers(0, 4)) * PS
            last = prefix - 1 if prefix else -1
            frames = [np.array(v, np.int64).tobytes() for v in ([prefix], [prefix + 3], [last])]
        elif op is Op.ALLOC_DECODE:
            last = data.draw(ints) if hostile else -1
            frames = [np.array([data.draw(st.integers(1, 9))], np.int64).tobytes(),
                      np.array([last], np.int64).tobytes()]  # fmt: skip
        elif op is Op.FREE and granted:
            slots = granted[data.draw(st.integers(0, len(granted) - 1))]
            frames = [(slots + hostile).tobytes()]
        elif op is Op.INSERT and granted:
            slots = max(granted, key=len)
            n = min(len(slots), len(tokens))
            fields = {"lengths": [n], "lock": data.draw(st.booleans())}
            frames = [tokens[:n].tobytes(), slots[:n].tobytes()]
        elif op is Op.MATCH:
            if seqs and data.draw(st.integers(0, 4)):  # mostly what was inserted: a match that
                tokens = data.draw(st.sampled_from(seqs))  # finds pages holds a lock (LOCK,
            fields = {"lengths": [len(tokens)], "lock": data.draw(st.booleans())}  # LOAD_BACK
            frames = [tokens.tobytes()]
        elif op in (Op.LOAD_BACK, Op.LOCK):
            fields = {"lock_id": data.draw(st.sampled_from(locks)) if locks else 1}
        elif op is Op.RELEASE:
            fields = {"lock_ids": locks[:1] if locks and not hostile else [10**6]}
        elif op is Op.EVICT:
            fields, who = {"device_tokens": data.draw(st.integers(0, 64))}, admin
        elif op is Op.FLUSH:
            who = admin
        elif op is Op.STATS:
            fields = {"check": True}
        before = {int(p) for s in granted for p in (s // PS).tolist()}
        reply, out = _call(handlers, op, who, fields, frames)
        if reply.ok and op in (Op.ALLOC, Op.ALLOC_EXTEND, Op.ALLOC_DECODE) and len(out[0]):
            slots = np.frombuffer(bytes(out[0]), np.int64).copy()
            new = set((slots // PS).tolist()) - before
            assert not new & {p for s in handlers.sessions for p in s.owned if s.key != session}
            granted.append(slots)
        elif reply.ok and op is Op.FREE:
            granted = [s for s in granted if s is not slots]
        elif reply.ok and op is Op.INSERT:  # (what it did not insert stays the session's)
            seqs.append(tokens[: fields["lengths"][0]])
            if fields["lock"]:
                locks += [e.lock_id for e in MatchReply.read(reply.fields).results if e.lock_id]
        elif reply.ok and op in (Op.MATCH, Op.LOCK):
            new = [r[2] for r in reply.fields.get("results", ())] or [reply.fields.get("lock_id")]
            locks += [i for i in new if i]
        elif reply.ok and op is Op.RELEASE:
            locks = locks[1:]
        handlers.check_integrity()
        holds, frames_out = _call(handlers, Op.HOLDINGS, session)
        owned = set(np.frombuffer(bytes(frames_out[0]), np.int64).tolist())
        # what the daemon says the session owns: only pages it was granted and did not free (an
        # insert takes some of them), and every lock it handed out and was not released
        assert owned <= {int(p) for s in granted for p in (s // PS).tolist()}
        assert sorted(holds.fields["lock_ids"]) == sorted(locks)
    cache.close()


def test_every_op_was_reached_with_success():
    """(Runs after the test above.) A fuzz whose every request is refused tests nothing."""
    missing = [op.name for op in WELL_FORMED_OPS if not OPS_REACHED.get(op.name)]
    assert not missing, f"never succeeded: {missing} (reached: {OPS_REACHED})"


@settings(max_examples=300, deadline=None)
@given(
    token=st.one_of(
        st.text(max_size=80), st.binary(max_size=40), st.integers(-(2**63), 2**63 - 1), st.none()
    )
)
def test_an_admin_hello_is_admitted_with_the_daemons_token_only(token):
    """Any other value, of any length or alphabet, is FORBIDDEN (never INTERNAL: _call
    checks), and changes nothing."""
    _, handlers = _client_world()
    hello = {"client": "ops", "pid": 1, "admin": True, "admin_token": token}
    reply, _ = _call(handlers, Op.HELLO, 0, hello, count=False)
    if token == "t":
        assert reply.ok
    else:
        assert reply.status is ErrorCode.FORBIDDEN and "admin token" in reply.fields["message"]
        assert len(handlers.sessions) == 0
