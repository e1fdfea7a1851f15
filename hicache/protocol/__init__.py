"""The wire schema shared by hicache-daemon and its clients. Schema only: no sockets here.

``header`` (versions, limits, ops, error codes, the msgpack header), ``messages`` (each op's
fields, typed) and ``frames`` (array frames); everything is imported from here.

A message is a multipart frame list:

    request:  [header, array frame, array frame, ...]
    reply:    [header, array frame, array frame, ...]

The header is msgpack. Requests: ``[version, op, request_id, session, epoch, fields]``;
replies: ``[version, status, request_id, boot_epoch, fields]`` where status 0 is success and
anything else an ErrorCode (``fields["message"]`` says why). A request names the daemon life
(boot epoch) its session belongs to: a restarted daemon refuses a request from an earlier life
(``EPOCH_MISMATCH``) before anything happens, so a stale session id never acts on a new session.
Arrays never travel inside msgpack: token ids are raw int32 little-endian frames, slot indices
raw int64 little-endian frames, in the order the op defines. Nothing is ever pickled.

Each op's fields are a typed message here (``HelloRequest`` ... ``RegisterRequest``;
``HelloReply``, ``MatchReply`` ...): clients build them (``.fields()``), the daemon reads them
(``.read``, which checks each field and names a bad one), so a change of an op's fields is one
edit here plus the callers of its fields. ``Op``'s comments say what each op carries, frames
included. Three replies are records kept elsewhere: STATS (the figures table,
``hicache.observe.figures``), TREE (a bounded dump) and CAPACITY (the estimate's report).
"""

from __future__ import annotations

from hicache.protocol.frames import (
    TokenBatch,
    array_frame,
    decode_pages,
    decode_slots,
    decode_tokens,
    slots_frame,
    split,
    split_tokens,
    token_batch,
    tokens_frame,
)
from hicache.protocol.header import (
    DEFAULT_LEASE_S,
    DEFAULT_TIMEOUT_S,
    ENGINE_REPORT,
    ENGINE_REPORT_MAX,
    HEARTBEAT_INTERVAL_S,
    MAX_BATCH,
    MAX_FRAME_BYTES,
    MAX_HEADER_BYTES,
    MAX_MATCH_TOKENS,
    MAX_REPLY_HEADER_BYTES,
    PROTOCOL_VERSION,
    ErrorCode,
    Op,
    ProtocolError,
    Reply,
    Request,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    pack,
)
from hicache.protocol.messages import (
    AllocRequest,
    EvictRequest,
    FlushRequest,
    FreedReply,
    FreeRequest,
    HeartbeatReply,
    HelloReply,
    HelloRequest,
    HoldingsReply,
    InsertReply,
    InsertRequest,
    LoadReply,
    LoadRequest,
    LockReply,
    LockRequest,
    MatchEntry,
    MatchReply,
    MatchRequest,
    PingReply,
    RegisterReply,
    RegisterRequest,
    ReleaseRequest,
    ReportRequest,
    StatsRequest,
    TreeRequest,
    bool_field,
    int_field,
    namespaces_field,
)

__all__ = [
    "AllocRequest",
    "DEFAULT_LEASE_S",
    "DEFAULT_TIMEOUT_S",
    "ENGINE_REPORT",
    "ENGINE_REPORT_MAX",
    "ErrorCode",
    "EvictRequest",
    "FlushRequest",
    "FreeRequest",
    "FreedReply",
    "HEARTBEAT_INTERVAL_S",
    "HeartbeatReply",
    "HelloReply",
    "HelloRequest",
    "HoldingsReply",
    "InsertReply",
    "InsertRequest",
    "LoadReply",
    "LoadRequest",
    "LockReply",
    "LockRequest",
    "MAX_BATCH",
    "MAX_FRAME_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_MATCH_TOKENS",
    "MAX_REPLY_HEADER_BYTES",
    "MatchEntry",
    "MatchReply",
    "MatchRequest",
    "Op",
    "PROTOCOL_VERSION",
    "PingReply",
    "ProtocolError",
    "RegisterReply",
    "RegisterRequest",
    "ReleaseRequest",
    "Reply",
    "ReportRequest",
    "Request",
    "StatsRequest",
    "TokenBatch",
    "TreeRequest",
    "array_frame",
    "bool_field",
    "decode_pages",
    "decode_reply",
    "decode_request",
    "decode_slots",
    "decode_tokens",
    "encode_reply",
    "encode_request",
    "int_field",
    "namespaces_field",
    "pack",
    "slots_frame",
    "split",
    "split_tokens",
    "token_batch",
    "tokens_frame",
]
