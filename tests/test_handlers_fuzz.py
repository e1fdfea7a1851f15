"""Random requests straight into the daemon's handlers: every one gets a reply, none escapes as
an exception, and the cache stays intact."""

import time

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache import HiCacheConfig, HiRadixCache
from hicache.daemon.handlers import Handlers
from hicache.daemon.sessions import SessionTable
from hicache.protocol import PROTOCOL_VERSION, ErrorCode, Op, decode_reply

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
