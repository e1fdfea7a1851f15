"""Refusals at the wire's edge, straight into the daemon's handlers (and one engine-tier
daemon): a refused request changes nothing (an engine's counts riding on it included), and
each error names the field as the client sent it."""

import time

import msgpack
import numpy as np
import pytest

from hicache import HiCacheConfig, HiRadixCache
from hicache.client import DaemonError, HiCacheClient
from hicache.daemon.requests import Handlers
from hicache.daemon.sessions import SessionTable
from hicache.protocol import PROTOCOL_VERSION, ErrorCode, Op, Reply, decode_reply
from tests.daemon_helpers import start_daemon, stop_daemon
from tests.test_engine_tier import layout

EPOCH = 7
COUNTS = {"engine_queried_tokens": 100, "engine_hit_tokens": 50}


def _handlers() -> tuple[Handlers, int]:
    cache = HiRadixCache(
        HiCacheConfig(num_layers=1, num_kv_heads=1, head_dim=2, page_size=4, device_tokens=64)
    )
    handlers = Handlers(cache, SessionTable(lease_s=1e9), boot_epoch=EPOCH, info={})
    return handlers, handlers.sessions.open("engine", 1, time.monotonic()).key


def _call(handlers: Handlers, op: Op, session: int, fields: dict, *frames: bytes) -> Reply:
    header = msgpack.packb([PROTOCOL_VERSION, int(op), 1, session, EPOCH, fields])
    return decode_reply(handlers.handle(header, list(frames))[0])


def _engine_totals(handlers: Handlers) -> list[int]:
    report = handlers.report()
    return [report[f"engine_{k}_tokens"] for k in ("queried", "hit", "loaded")]


def test_a_refused_request_adds_none_of_the_counts_it_carries():
    handlers, session = _handlers()
    refused = [
        (Op.ALLOC, {"num_tokens": -1}),  # BAD_FIELD
        (Op.RELEASE, {"lock_ids": [99]}),  # NOT_OWNED
        (Op.FREE, {}, np.array([4], np.int64).tobytes()),  # NOT_OWNED
        (Op.EVICT, {"host_tokens": 4}),  # FORBIDDEN (not an admin)
    ]
    for op, fields, *frames in refused:
        reply = _call(handlers, op, session, {**fields, **COUNTS}, *frames)
        assert not reply.ok and reply.status is not ErrorCode.INTERNAL, (op, reply)
    assert _engine_totals(handlers) == [0, 0, 0]
    assert _call(handlers, Op.HOLDINGS, session, COUNTS).ok  # one that succeeds counts once
    assert _engine_totals(handlers) == [100, 50, 0]


def test_counts_without_a_session_are_refused_not_dropped():
    handlers, _ = _handlers()
    for op, fields in ((Op.PING, {}), (Op.HELLO, {"client": "x"}), (Op.STATS, {})):
        reply = _call(handlers, op, 0, {**fields, **COUNTS})
        assert reply.status is ErrorCode.BAD_FIELD, (op, reply)
        assert "engine counts" in reply.fields["message"]
    assert _engine_totals(handlers) == [0, 0, 0]


@pytest.mark.parametrize("stopping", [True, "yes", 1])
def test_a_heartbeat_does_not_take_a_goodbyes_stopping(stopping):
    handlers, session = _handlers()
    reply = _call(handlers, Op.HEARTBEAT, session, {"stopping": stopping})
    assert reply.status is ErrorCode.BAD_FIELD and "stopping" in reply.fields["message"]
    assert _call(handlers, Op.HEARTBEAT, session, {}).ok  # and the session lives on


@pytest.mark.parametrize("value", [1, 0, "yes", None])
def test_release_all_is_true_or_false(value):
    handlers, session = _handlers()
    reply = _call(handlers, Op.RELEASE, session, {"all": value, "lock_ids": []})
    assert reply.status is ErrorCode.BAD_FIELD and "all" in reply.fields["message"]


@pytest.mark.parametrize("op", [Op.FREE, Op.INSERT])
def test_a_huge_page_id_is_outside_the_pool_not_wrapped_into_it(op):
    handlers, session = _handlers()
    reply = _call(handlers, Op.ALLOC, session, {"num_tokens": 4, "pages": True})
    assert reply.ok
    wrapped = (1 << 62) + 1  # times page_size 4 wraps to page 1 in int64
    frame = np.array([wrapped], np.int64).tobytes()
    if op is Op.FREE:
        reply = _call(handlers, op, session, {"pages": True}, frame)
    else:
        tokens = np.arange(4, dtype=np.int32).tobytes()
        reply = _call(handlers, op, session, {"lengths": [4], "pages": True}, tokens, frame)
    assert not reply.ok and "page id outside the pool" in reply.fields["message"], reply
    assert len(handlers.report()["session_list"]) == 1
    assert handlers.report()["session_list"][0]["owned_pages"] == 1  # nothing freed


def test_a_version_that_is_not_an_int_is_the_wrong_version():
    handlers, session = _handlers()
    header = msgpack.packb([float(PROTOCOL_VERSION), int(Op.PING), 1, 0, 0, {}])
    reply = decode_reply(handlers.handle(header, [])[0])
    assert reply.status is ErrorCode.WRONG_VERSION


@pytest.fixture
def engine_ep(tmp_path):
    endpoint = f"ipc://{tmp_path}/h.sock"
    proc = start_daemon(endpoint, "--device-tier", "engine", "--host-bytes", "4MiB")
    try:
        yield endpoint
    finally:
        stop_daemon(proc)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"host_tokens": -1}, "host_tokens"),
        ({"host_tokens": "x"}, "host_tokens"),
        ({"host_tokens": 1.5}, "host_tokens"),
        ({"device_tokens": None}, "device_tokens"),
        ({"device_tokens": 16}, "no device tier"),
    ],
)
def test_an_engine_daemons_evict_names_the_field_as_sent(engine_ep, fields, named):
    with HiCacheClient(engine_ep, name="admin", admin=True) as admin:
        admin.register_layout(layout())  # (the pool: EVICT needs one)
        with pytest.raises(DaemonError, match=named) as err:
            admin._call(Op.EVICT, fields)
        assert err.value.code is ErrorCode.BAD_FIELD
        assert admin.ping()["state"] == "ready"
