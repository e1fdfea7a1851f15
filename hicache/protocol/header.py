"""The message header: versions, limits, ops, error codes, and the msgpack header of a request
and a reply (encoded and checked). Pure functions and constants; one msgpack Packer per
thread."""

from __future__ import annotations

import threading
from enum import IntEnum
from typing import Any, NamedTuple

import msgpack

PROTOCOL_VERSION = 3  # 2: requests carry the boot epoch; 3: ALLOC, FREE and INSERT in pages

# Liveness (seconds). A session's lease is renewed by any message; clients heartbeat at
# HEARTBEAT_INTERVAL_S, so a lease survives LEASE_S / HEARTBEAT_INTERVAL_S missed beats.
HEARTBEAT_INTERVAL_S = 2.0
DEFAULT_LEASE_S = 10.0
DEFAULT_TIMEOUT_S = 30.0  # a client gives up on a reply after this long

MAX_HEADER_BYTES = 1 << 20  # a request header larger than this is refused (TOO_LARGE)
MAX_REPLY_HEADER_BYTES = 64 << 20  # replies (stats, tree dumps) may be larger
MAX_FRAME_BYTES = 64 << 20  # one array frame: 16M token ids or 8M slots
MAX_BATCH = 1024  # sequences in one batched match or insert
# tokens of one batched match once shared prefixes are expanded: bounds the memory a request
# can make the daemon build (1024 long prompts over one frame would otherwise be GiBs)
MAX_MATCH_TOKENS = MAX_FRAME_BYTES // 4


# An engine with a prefix cache of its own reports its figures as it counts them (tokens since
# its previous report): asked beyond its own hit, of them found in hicache, copied from the pool.
ENGINE_REPORT = ("engine_queried_tokens", "engine_hit_tokens", "engine_loaded_tokens")
ENGINE_REPORT_MAX = 1 << 48  # each count of a report is below this


class Op(IntEnum):
    HELLO = 1  # fields: client, pid -> session, boot_epoch, config, pools
    HEARTBEAT = 2  # fields (optional, also on GOODBYE): ENGINE_REPORT's counts since the last
    GOODBYE = 3  # fields: stopping (default false: end now and free what it held; true: the
    # engine's process is stopping and its copies may still run: quarantine, then free)
    # A batch travels as one frame per array kind, sequences concatenated, with their lengths in
    # the header: per-frame costs, not bytes, dominate small messages.
    MATCH = 4  # frame: token ids; fields: lengths, shared (optional: leading tokens each sequence
    # takes from the previous one instead of the frame), namespaces, lock -> MatchReply (below):
    # frame: page ids (int64) of the distinct nodes matched; fields: chunk_pages (pages per
    # node), results (MatchEntry: device_len, host_len, lock_id, chunks), l3_pending (the
    # sequences whose fetch from the third tier still runs). Slot = page * page_size + offset.
    # l3_wait (default true): under a waiting prefetch policy the reply waits for those fetches,
    # at most the policy's bound; false: it never waits (ask again once they have landed).
    # alloc_rest (default false; lock false only): a store's allocation in the same round trip:
    # pages, this session's as ALLOC's, for each answered sequence's tokens past its device hit
    # -> MatchReply's rest_pages (pages per sequence); a second frame: their page ids (int64).
    LOAD_BACK = 5  # fields: lock_id (from a match), wait (default true) -> frame: slots of the
    # loaded part; fields: loaded, ticket (wait=false: read layers once the progress table
    # shows them; 0: complete), events (CUDA pools: one IPC event handle per layer)
    ALLOC = 6  # fields: num_tokens, pages (default false) -> slots frame (pages: page ids)
    ALLOC_EXTEND = 7  # frames: prefix_lens, seq_lens, last_loc (int64) -> slots frame
    ALLOC_DECODE = 8  # frames: seq_lens, last_loc (int64) -> slots frame
    FREE = 9  # frames: slots; fields: pages (default false: true, the frame holds page ids)
    INSERT = 10  # frames: token ids, slots; fields: lengths, namespaces, lock, release (lock ids
    # released once the insert succeeded), pages (default false: true, the second frame holds
    # page ids, ceil(length / page_size) per sequence) -> prefix_lens (lock: a MatchReply's
    # fields too)
    LOCK = 11  # fields: lock_id -> a second lock on the same prefix: lock_id
    RELEASE = 12  # fields: lock_ids, or all: true (every lock of the session)
    EVICT = 13  # fields: device_tokens, host_tokens
    FLUSH = 14  # evict every unlocked token from both tiers
    STATS = 15  # fields: check (run check_integrity) -> the stats fields, sessions
    TREE = 16  # fields: max_nodes -> a bounded dump
    PING = 17
    HOLDINGS = 18  # -> fields: lock_ids, owned_pages; frame: the owned page ids (int64)
    REGISTER = 19  # fields: layout (an EngineLayout's fields) -> layout, config, pools: an
    # engine that owns its device tier names its KV layout; the first one sizes the pool
    CAPACITY = 20  # -> the estimated hit ratios at 0.25x-8x of today's tier sizes (SHARDS)


class ErrorCode(IntEnum):
    OK = 0
    UNKNOWN_OP = 1
    BAD_FIELD = 2
    WRONG_VERSION = 3
    NOT_OWNED = 4
    OUT_OF_MEMORY = 5
    UNKNOWN_SESSION = 6
    TOO_LARGE = 7
    INTERNAL = 8  # a bug in the daemon; the daemon keeps serving
    EPOCH_MISMATCH = 9  # the request names another daemon life: refused, nothing happened
    LEASE_EXPIRED = 10  # the session's lease ran out: its locks and pages are taken back
    FORBIDDEN = 11  # an admin operation from a session that did not open as admin
    QUOTA_EXCEEDED = 12  # the session would hold more pages, locks or loads than allowed
    LAYOUT_MISMATCH = 13  # the engine's KV layout differs from the one the daemon serves
    NO_LAYOUT = 14  # a daemon for engine-owned device tiers has no KV layout yet (REGISTER)
    DRAINING = 15  # the daemon is shutting down: no new sessions (connect to its successor)


_OPS = {int(op): op for op in Op}  # a dict lookup: calling an enum class is slow
_CODES = {int(code): code for code in ErrorCode}


class ProtocolError(ValueError):
    """A message that does not follow this schema. ``code`` is the ErrorCode to reply with."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code


class Request(NamedTuple):  # NamedTuples: built per message, a frozen dataclass costs 4x
    op: Op
    request_id: int  # echoed in the reply, so a client matches replies to requests
    session: int  # 0 before hello
    epoch: int  # the boot epoch the session was opened in (0 before hello)
    fields: dict[str, Any]


class Reply(NamedTuple):
    status: ErrorCode  # OK or the error
    request_id: int
    boot_epoch: int  # changes when the daemon restarts: slot indices from another epoch are void
    fields: dict[str, Any]

    @property
    def ok(self) -> bool:
        return self.status is ErrorCode.OK


_packers = threading.local()


def pack(obj: Any) -> bytes:
    """msgpack.packb with one Packer kept per thread. packb makes a Packer per call, and each
    mallocs a 256 KiB buffer: glibc hands out the top of the heap, trims it again on free, and
    the next message page-faults it back in (3-4 faults per request in the daemon). The packer
    is taken out while it packs: a pack inside a pack on this thread (a finalizer the garbage
    collector runs meanwhile sends a goodbye) gets a packer of its own, never the same buffer."""
    packer = getattr(_packers, "packer", None)
    _packers.packer = None
    if packer is None:
        packer = msgpack.Packer()
    try:
        return packer.pack(obj)  # (a failed pack resets the buffer: the next one starts clean)
    finally:
        _packers.packer = packer


def encode_request(req: Request) -> bytes:
    return pack([PROTOCOL_VERSION, int(req.op), req.request_id, req.session, req.epoch, req.fields])


def encode_reply(reply: Reply) -> bytes:
    return pack(
        [PROTOCOL_VERSION, int(reply.status), reply.request_id, reply.boot_epoch, reply.fields]
    )


def _unpack(frame: bytes | memoryview, what: str, size: int, limit: int) -> list:
    if len(frame) > limit:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"{what} header of {len(frame)} bytes")
    try:
        head = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types for garbage
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{what} header is not msgpack: {exc}") from None
    if not isinstance(head, list) or not head:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{what} header must be a {size}-element array")
    if type(head[0]) is not int or head[0] != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.WRONG_VERSION,
            f"a {what} in protocol version {head[0]!r}; this side speaks {PROTOCOL_VERSION}: "
            "the client and the daemon come from different hicache versions (install the same "
            "one for both)",
        )
    if len(head) != size:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{what} header must be a {size}-element array")
    if not all(type(x) is int for x in head[1:-1]):
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{what} header: {_INT_PARTS[what]} are ints")
    if type(head[-1]) is not dict:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{what} header: fields must be a map")
    return head


_INT_PARTS = {"request": "op, id, session and epoch", "reply": "status, id and epoch"}


def decode_request(frame: bytes | memoryview) -> Request:
    _, op, request_id, session, epoch, fields = _unpack(frame, "request", 6, MAX_HEADER_BYTES)
    known = _OPS.get(op)
    if known is None:
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {op}")
    return Request(known, request_id, session, epoch, fields)


def decode_reply(frame: bytes | memoryview) -> Reply:
    _, status, request_id, epoch, fields = _unpack(frame, "reply", 5, MAX_REPLY_HEADER_BYTES)
    known = _CODES.get(status)
    if known is None:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"unknown status {status}")
    return Reply(known, request_id, epoch, fields)
