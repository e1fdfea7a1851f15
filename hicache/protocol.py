"""The wire schema shared by hicache-daemon and its clients. Schema only: no sockets here.

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

import operator
import threading
from collections.abc import Iterator, Sequence
from enum import IntEnum
from typing import Any, NamedTuple

import msgpack
import numpy as np

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


# ---- typed messages ---------------------------------------------------------------------------
class MatchEntry(NamedTuple):
    """One sequence's answer in a MATCH-form reply (MATCH; INSERT with lock). Travels as a
    msgpack array in this field order."""

    device_len: int  # tokens of its prefix on the device tier (whole pages)
    host_len: int  # tokens after them on the host tier
    lock_id: int  # the lock on the device prefix (0: none taken)
    chunks: list[int]  # the reply's chunks (distinct nodes' page ids) the prefix is made of


class MatchReply(NamedTuple):
    """The fields of a MATCH-form reply; its first frame is the chunks' page ids (int64),
    ``chunk_pages`` of them per chunk; with ``rest_pages``, a second frame holds the pages
    allocated for each sequence past its device hit."""

    results: list[MatchEntry]  # one per sequence answered (a batch may be answered in part)
    chunk_pages: list[int]  # pages of each chunk in the first frame
    l3_pending: Sequence[int] = ()  # sequences whose fetch from the third tier still runs
    rest_pages: list[int] | None = None  # alloc_rest: pages allocated per sequence

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {"results": self.results, "chunk_pages": self.chunk_pages}
        if self.l3_pending:
            out["l3_pending"] = self.l3_pending
        if self.rest_pages is not None:
            out["rest_pages"] = self.rest_pages
        return out

    @classmethod
    def read(cls, fields: dict[str, Any]) -> MatchReply:
        """From a decoded reply's fields (ProtocolError BAD_FIELD for a malformed one)."""
        try:
            results = [MatchEntry(*entry) for entry in fields["results"]]
            return cls(
                results,
                list(fields["chunk_pages"]),
                list(fields.get("l3_pending") or ()),
                fields.get("rest_pages"),
            )
        except (KeyError, TypeError) as exc:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"a malformed match reply: {exc}") from None


# ---- typed requests: what each op's header fields hold, checked as the daemon reads them -----
def int_field(fields: dict, name: str, lo: int = 0, hi: int = 2**62) -> int:
    """``fields[name]``, an int in [lo, hi] (BAD_FIELD naming the field, otherwise)."""
    value = fields.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{name}: expected an int in [{lo}, {hi}]")
    return value


def bool_field(fields: dict, name: str, default: bool) -> bool:
    """``fields[name]``, true or false (``default`` when absent; BAD_FIELD otherwise)."""
    value = fields.get(name, default)
    if type(value) is not bool:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{name}: expected true or false")
    return value


def namespaces_field(spaces: Any, count: int) -> list[Any]:
    """``namespaces``: one per sequence of the request (None: all None)."""
    if spaces is None:
        return [None] * count
    if not isinstance(spaces, list) or len(spaces) != count:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"namespaces: expected a list of {count}")
    return spaces


def _sparse(message: Any) -> dict[str, Any]:
    """A typed request's fields as sent: those that differ from their defaults."""
    defaults = message._field_defaults
    return {
        name: value
        for name, value in zip(message._fields, message, strict=True)
        if name not in defaults or value != defaults[name]
    }


class HelloRequest(NamedTuple):
    """HELLO: who opens a session (``client``: shown in logs and ``hicache info``)."""

    client: str = ""
    pid: int = 0  # the engine's process (0: not given)
    admin: bool = False  # an admin session (evict, flush): needs the daemon's admin token
    admin_token: str | None = None

    def fields(self) -> dict[str, Any]:
        return _sparse(self)

    @classmethod
    def read(cls, fields: dict[str, Any]) -> HelloRequest:
        client, pid = fields.get("client", ""), fields.get("pid", 0)
        if not isinstance(client, str) or len(client) > 256:
            raise ProtocolError(ErrorCode.BAD_FIELD, "hello: client is a str of <= 256 chars")
        if isinstance(pid, bool) or not isinstance(pid, int) or not 0 <= pid < 2**62:
            raise ProtocolError(ErrorCode.BAD_FIELD, "hello: pid is an int >= 0")
        return cls(client, pid, bool_field(fields, "admin", False), fields.get("admin_token"))


class MatchRequest(NamedTuple):
    """MATCH; its frame holds every sequence's token ids (less each one's ``shared`` head)."""

    lengths: Any  # tokens per sequence (checked against the frame as it is cut)
    shared: Any = None  # leading tokens each sequence shares with the one before (optional)
    namespaces: Any = None  # one per sequence (None: the default namespace)
    lock: bool = True  # lock each device prefix found
    alloc_rest: bool = False  # allocate pages for each sequence past its hit (needs lock false)
    l3_wait: bool = True  # false: answer at once while a fetch from the third tier runs

    def fields(self) -> dict[str, Any]:
        return _sparse(self)

    @classmethod
    def read(cls, fields: dict[str, Any]) -> MatchRequest:
        lock, rest = bool_field(fields, "lock", True), bool_field(fields, "alloc_rest", False)
        if rest and lock:
            raise ProtocolError(ErrorCode.BAD_FIELD, "match: alloc_rest needs lock false")
        return cls(fields.get("lengths"), fields.get("shared"), fields.get("namespaces"),
                   lock, rest, bool_field(fields, "l3_wait", True))  # fmt: skip


class LoadRequest(NamedTuple):
    """LOAD_BACK: the host part of a locked match, onto the device."""

    lock_id: int
    wait: bool = True  # false: answer at once with a ticket

    def fields(self) -> dict[str, Any]:
        return _sparse(self)

    @classmethod
    def read(cls, fields: dict[str, Any]) -> LoadRequest:
        return cls(int_field(fields, "lock_id", 1), bool_field(fields, "wait", True))


class AllocRequest(NamedTuple):
    """ALLOC: pages for ``num_tokens`` tokens, owned by the session."""

    num_tokens: int
    pages: bool = False  # answer page ids, not slots

    def fields(self) -> dict[str, Any]:
        return _sparse(self)

    @classmethod
    def read(cls, fields: dict[str, Any], max_tokens: int) -> AllocRequest:
        return cls(
            int_field(fields, "num_tokens", 0, max_tokens), bool_field(fields, "pages", False)
        )


class FreeRequest(NamedTuple):
    """FREE; its frame holds slots (every page they touch is freed), or page ids."""

    pages: bool = False

    def fields(self) -> dict[str, Any]:
        return _sparse(self)

    @classmethod
    def read(cls, fields: dict[str, Any]) -> FreeRequest:
        return cls(bool_field(fields, "pages", False))


class InsertRequest(NamedTuple):
    """INSERT; frames: every sequence's token ids, then their slots (or page ids)."""

    lengths: Any  # tokens per sequence (checked against the frames as they are cut)
    namespaces: Any = None  # one per sequence (None: the default namespace)
    lock: bool = False  # only whole pages, and the reply is a locked match (MATCH's form)
    release: list[int] | None = None  # lock ids released once the insert succeeded
    pages: bool = False  # the second frame holds page ids: ceil(length / page_size) each

    def fields(self) -> dict[str, Any]:
        return _sparse(self)

    @classmethod
    def read(cls, fields: dict[str, Any]) -> InsertRequest:
        return cls(fields.get("lengths"), fields.get("namespaces"),
                   bool_field(fields, "lock", False), fields.get("release"),
                   bool_field(fields, "pages", False))  # fmt: skip


class LockRequest(NamedTuple):
    """LOCK: a second lock on the prefix another lock of the session holds."""

    lock_id: int

    def fields(self) -> dict[str, Any]:
        return _sparse(self)

    @classmethod
    def read(cls, fields: dict[str, Any]) -> LockRequest:
        return cls(int_field(fields, "lock_id", 1))


class ReleaseRequest(NamedTuple):
    """RELEASE: these locks of the session, or every one (``all``)."""

    lock_ids: Any = None  # distinct ints (checked against the session's locks)
    all: bool = False

    def fields(self) -> dict[str, Any]:
        return _sparse(self)

    @classmethod
    def read(cls, fields: dict[str, Any]) -> ReleaseRequest:
        return cls(fields.get("lock_ids"), fields.get("all") is True)


class StatsRequest(NamedTuple):
    """STATS: the daemon's figures (``check``: run the integrity check too)."""

    check: bool = False

    def fields(self) -> dict[str, Any]:
        return _sparse(self)

    @classmethod
    def read(cls, fields: dict[str, Any]) -> StatsRequest:
        return cls(bool_field(fields, "check", False))


class TreeRequest(NamedTuple):
    """TREE: the first ``max_nodes`` nodes, or (``shape``) each namespace's ``top`` prefixes."""

    max_nodes: int = 1000
    shape: bool = False
    top: int = 10

    def fields(self) -> dict[str, Any]:
        return _sparse(self)

    @classmethod
    def read(cls, fields: dict[str, Any]) -> TreeRequest:
        return cls(
            int_field(fields, "max_nodes", 1, 100_000) if "max_nodes" in fields else 1000,
            bool_field(fields, "shape", False),
            int_field(fields, "top", 1, 1000) if "top" in fields else 10,
        )


class ReportRequest(NamedTuple):
    """HEARTBEAT and GOODBYE: an engine's counts since its previous report (``ENGINE_REPORT``'s
    names; all 0: nothing to report), and for GOODBYE, whether its process is stopping (true:
    what the session holds is given back after the quarantine, copies may still land)."""

    engine_queried_tokens: int = 0  # tokens asked about beyond the engine's own hit
    engine_hit_tokens: int = 0  # of them, found in hicache (<= queried)
    engine_loaded_tokens: int = 0  # tokens the engine copied from the pool
    stopping: bool = False  # GOODBYE only

    def fields(self) -> dict[str, Any]:
        return _sparse(self)

    @property
    def counts(self) -> tuple[int, int, int]:
        return self[:3]

    @classmethod
    def read(cls, fields: dict[str, Any]) -> ReportRequest:
        """BAD_FIELD for a value that is not a count below ENGINE_REPORT_MAX, or hits beyond
        what was queried."""
        counts = []
        for name in ENGINE_REPORT:
            value: Any = fields.get(name, 0)
            if type(value) is not int or not 0 <= value < ENGINE_REPORT_MAX:
                raise ProtocolError(
                    ErrorCode.BAD_FIELD, f"{name}: a count of tokens, got {value!r}"
                )
            counts.append(value)
        queried, hit, loaded = counts
        if hit > queried:
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"engine_hit_tokens {hit} is more than engine_queried_tokens {queried}",
            )
        return cls(queried, hit, loaded, bool_field(fields, "stopping", False))


assert ReportRequest._fields[:3] == ENGINE_REPORT


class EvictRequest(NamedTuple):
    """EVICT (admin): at least this many unlocked tokens from each tier, named as the daemon
    reports its tiers (an engine-tier daemon's one pool is ``host``)."""

    device_tokens: int = 0
    host_tokens: int = 0

    def fields(self) -> dict[str, Any]:
        return self._asdict()

    @classmethod
    def read(cls, fields: dict[str, Any]) -> EvictRequest:
        device = int_field(fields, "device_tokens") if "device_tokens" in fields else 0
        return cls(device, int_field(fields, "host_tokens") if "host_tokens" in fields else 0)


class RegisterRequest(NamedTuple):
    """REGISTER: an engine's KV layout (an EngineLayout's fields, checked where it is read)."""

    layout: Any

    def fields(self) -> dict[str, Any]:
        return {"layout": self.layout}

    @classmethod
    def read(cls, fields: dict[str, Any]) -> RegisterRequest:
        return cls(fields.get("layout"))


# ---- typed replies ----------------------------------------------------------------------------
def _read(cls: Any, what: str, fields: dict[str, Any]) -> Any:
    """``cls`` from a decoded reply's fields: each of its fields by name, the defaults where
    absent (ProtocolError BAD_FIELD for a reply without a required one)."""
    try:
        return cls(**{name: fields[name] for name in cls._fields if name in fields})
    except TypeError as exc:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"a malformed {what} reply: {exc}") from None


class LoadReply(NamedTuple):
    """LOAD_BACK's fields; its frame holds the device slots of the match's host part."""

    loaded: int  # slots in the frame (0: nothing to load, or no room: recompute)
    ticket: int  # the copy still in flight (0: landed already, or wait was asked)
    events: list[bytes] | None = None  # one CUDA IPC event handle per layer (GPU pools)
    failed: bool = False  # the copy failed: a miss (recompute)

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {"loaded": self.loaded, "ticket": self.ticket}
        if self.events:
            out["events"] = self.events
        if self.failed:
            out["failed"] = True
        return out

    @classmethod
    def read(cls, fields: dict[str, Any]) -> LoadReply:
        return _read(cls, "load_back", fields)


class InsertReply(NamedTuple):
    """INSERT's fields: the prefix each sequence already had cached (with ``lock``, a
    MATCH-form reply's fields too: ``MatchReply.read``)."""

    prefix_lens: list[int]

    def fields(self) -> dict[str, Any]:
        return {"prefix_lens": self.prefix_lens}

    @classmethod
    def read(cls, fields: dict[str, Any]) -> InsertReply:
        return _read(cls, "insert", fields)


class LockReply(NamedTuple):
    """LOCK's fields: a second lock on the same prefix."""

    lock_id: int

    def fields(self) -> dict[str, Any]:
        return {"lock_id": self.lock_id}

    @classmethod
    def read(cls, fields: dict[str, Any]) -> LockReply:
        return _read(cls, "lock", fields)


class HoldingsReply(NamedTuple):
    """HOLDINGS' fields; its frame holds the owned page ids (int64)."""

    lock_ids: list[int]  # the session's locks
    owned_pages: int  # page ids in the frame

    def fields(self) -> dict[str, Any]:
        return {"lock_ids": self.lock_ids, "owned_pages": self.owned_pages}

    @classmethod
    def read(cls, fields: dict[str, Any]) -> HoldingsReply:
        return _read(cls, "holdings", fields)


class HelloReply(NamedTuple):
    """HELLO's fields: the session, its terms, and what the daemon serves."""

    session: int  # what requests name the session by (a secret: logs show session_id)
    session_id: int  # the session's public number
    lease_s: float  # the session ends this long after its last message
    quarantine_s: float  # a lapsed or stopping session's pages come back after this long
    limits: dict[str, int]  # the session's quotas and the daemon's request bounds
    # what the daemon serves (a real daemon sends each; the defaults serve handler tests)
    boot_epoch: int = 0  # the daemon's life: requests name it
    protocol: int = PROTOCOL_VERSION
    endpoint: str = ""  # where the daemon listens
    config: dict[str, Any] | None = None  # the daemon's settings (HiCacheConfig's among them)
    pools: dict[str, Any] | None = None  # how to map the pools (None: no layout registered yet)
    layout: dict[str, Any] | None = None  # the engine layout served (engine-tier daemons)

    def fields(self) -> dict[str, Any]:
        return self._asdict()

    @classmethod
    def read(cls, fields: dict[str, Any]) -> HelloReply:
        return _read(cls, "hello", fields)


class HeartbeatReply(NamedTuple):
    """HEARTBEAT's fields."""

    draining: bool = False  # the daemon is shutting down: move to its successor

    def fields(self) -> dict[str, Any]:
        return _sparse(self)

    @classmethod
    def read(cls, fields: dict[str, Any]) -> HeartbeatReply:
        return _read(cls, "heartbeat", fields)


class PingReply(NamedTuple):
    """PING's fields (no session needed)."""

    pong: bool
    pid: int  # the daemon's process
    state: str  # "ready" or "draining"

    def fields(self) -> dict[str, Any]:
        return self._asdict()

    @classmethod
    def read(cls, fields: dict[str, Any]) -> PingReply:
        return _read(cls, "ping", fields)


class FreedReply(NamedTuple):
    """EVICT's and FLUSH's fields: tokens freed per tier (named as the daemon reports)."""

    device_freed: int
    host_freed: int

    def fields(self) -> dict[str, Any]:
        return self._asdict()

    @classmethod
    def read(cls, fields: dict[str, Any]) -> FreedReply:
        return _read(cls, "evict", fields)


class RegisterReply(NamedTuple):
    """REGISTER's fields: the layout served and the pool it made (hello's ``config`` and
    ``pools`` as they now are)."""

    layout: dict[str, Any]
    config: dict[str, Any]
    pools: dict[str, Any] | None

    def fields(self) -> dict[str, Any]:
        return self._asdict()

    @classmethod
    def read(cls, fields: dict[str, Any]) -> RegisterReply:
        return _read(cls, "register", fields)


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
    if head[0] != PROTOCOL_VERSION:
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


# ---- array frames ---------------------------------------------------------------------------
_TOKEN = np.dtype("<i4")
_SLOT = np.dtype("<i8")


def array_frame(values: Any, dtype: np.dtype) -> memoryview:
    """A contiguous little-endian buffer of ``values`` (zero-copy when already so)."""
    if hasattr(values, "numpy"):  # a CPU torch tensor: its own memory, not __array__
        values = values.detach().numpy()
    arr = np.ascontiguousarray(values, dtype=dtype)
    # (numpy's stubs give ndarray __buffer__ on Python 3.12+ only: it has one on 3.11 too)
    return memoryview(arr).cast("B")  # type: ignore[arg-type]


def tokens_frame(token_ids: Any) -> memoryview:
    return array_frame(token_ids, _TOKEN)


def slots_frame(slots: Any) -> memoryview:
    return array_frame(slots, _SLOT)


def _decode_array(frame: bytes | memoryview, dtype: np.dtype, what: str) -> np.ndarray:
    size = len(frame)
    if size > MAX_FRAME_BYTES:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"{what} frame of {size} bytes")
    if size % dtype.itemsize:
        raise ProtocolError(
            ErrorCode.BAD_FIELD, f"{what} frame of {size} bytes is not whole {dtype.name} values"
        )
    return np.frombuffer(frame, dtype=dtype)


def decode_tokens(frame: bytes | memoryview) -> np.ndarray:
    """Token ids (read-only int32 view of the frame; keep the frame alive while in use)."""
    return _decode_array(frame, _TOKEN, "token ids")


def split(values: np.ndarray, lengths: Any, what: str) -> list[np.ndarray]:
    """Cut a concatenated array into sequences of ``lengths`` (a msgpack list of ints)."""
    if (
        type(lengths) is list
        and len(lengths) == 1
        and type(lengths[0]) is int
        and lengths[0] == len(values)
    ):
        return [values]  # the common single sequence, without numpy's split machinery
    if (
        not isinstance(lengths, list)
        or len(lengths) > MAX_BATCH
        or not all(type(n) is int and n >= 0 for n in lengths)
        or sum(lengths) != len(values)
    ):
        raise ProtocolError(ErrorCode.BAD_FIELD, f"lengths: must be ints summing to the {what}")
    out, pos = [], 0
    for n in lengths:  # plain slices: np.split costs ~3 us per piece
        out.append(values[pos : pos + n])
        pos += n
    return out


def split_tokens(frame: bytes | memoryview, lengths: Any, shared: Any = None) -> list[bytes]:
    """Cut a token frame into per-sequence int32 LE byte strings (the tree's key form), with no
    numpy on the way: the match path keys the tree with these bytes directly.

    ``shared[i]`` (optional) tokens of sequence i are the first ones of sequence i - 1 and are
    not in the frame: a batch whose prompts share a system prompt sends it once.
    """
    return list(token_batch(frame, lengths, shared))


class TokenBatch:
    """The sequences of a checked token frame, expanded a block at a time as they are read
    (1024 prompts sharing a 16k-token prefix are 64 MiB of keys at once, 30 ms of copying
    before the first match). ``lengths``: each sequence's token count."""

    BLOCK_BYTES = 256 << 10  # keys expanded at once (a block holds at least one sequence)

    def __init__(self, frame: bytes | memoryview, lengths: list[int], shared: list[int]):
        self.frame = frame
        self.lengths = lengths
        self.shared = shared

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[bytes]:
        from hicache.tree import unpack_shared  # the schema alone imports no torch

        frame, lengths, shared = self.frame, self.lengths, self.shared
        i, n, pos, prev = 0, len(lengths), 0, b""
        while i < n:
            j, size = i + 1, 4 * lengths[i]
            while j < n and size < self.BLOCK_BYTES:
                size += 4 * lengths[j]
                j += 1
            take = 4 * (sum(lengths[i:j]) - sum(shared[i:j]))
            part = frame[pos : pos + take]
            # the block's first sequence brings what it shares with the previous one along
            head = prev[: 4 * shared[i]]
            keys = unpack_shared(head + part if head else part, lengths[i:j],
                                 [0, *shared[i + 1 : j]])  # fmt: skip
            pos, prev, i = pos + take, keys[-1], j
            yield from keys


def token_batch(frame: bytes | memoryview, lengths: Any, shared: Any = None) -> TokenBatch | list:
    """``split_tokens``, checked at once and expanded as it is read (a TokenBatch; a lone
    sequence that is the whole frame: a list of its key)."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"token ids frame of {len(frame)} bytes")
    if shared is None and type(lengths) is list and len(lengths) == 1:
        if type(lengths[0]) is int and lengths[0] * 4 == len(frame):  # the frame is its key
            return [frame if type(frame) is bytes else bytes(frame)]
    shared = _check_shared(lengths, shared)
    if sum(lengths) > MAX_MATCH_TOKENS:  # checked before anything is built
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"a match of {sum(lengths)} tokens (shared prefixes expanded); the limit is "
            f"{MAX_MATCH_TOKENS}",
        )
    if sum(lengths) - sum(shared) != len(frame) // 4 or len(frame) % 4:
        raise ProtocolError(ErrorCode.BAD_FIELD, "lengths: must be ints summing to the token ids")
    return TokenBatch(frame, lengths, shared)


_INTS = {int}  # (bool is not one)


def _check_shared(lengths: Any, shared: Any) -> list[int]:
    if (
        not isinstance(lengths, list)
        or len(lengths) > MAX_BATCH
        or not set(map(type, lengths)) <= _INTS  # (C loops: a batch has up to 1024 entries)
        or min(lengths, default=0) < 0
    ):
        raise ProtocolError(ErrorCode.BAD_FIELD, "lengths: must be a list of ints >= 0")
    if shared is None:
        return [0] * len(lengths)
    if not isinstance(shared, list) or len(shared) != len(lengths):
        raise ProtocolError(ErrorCode.BAD_FIELD, "shared: must be a list as long as lengths")
    # whole-list checks (a batch has up to MAX_BATCH entries): each at most what its sequence
    # and the previous one hold, none before the first sequence
    if (
        not set(map(type, shared)) <= _INTS
        or (shared and shared[0] != 0)
        or min(shared, default=0) < 0
        or any(map(operator.gt, shared, lengths))
        or any(map(operator.gt, shared[1:], lengths))
    ):
        raise ProtocolError(
            ErrorCode.BAD_FIELD, "shared: ints, 0 first, each at most its and the previous length"
        )
    return shared


def decode_pages(frame: bytes | memoryview) -> np.ndarray:
    """Page ids (read-only int64 view of the frame)."""
    return _decode_array(frame, _SLOT, "page ids")


def decode_slots(frame: bytes | memoryview) -> np.ndarray:
    """Slot indices (read-only int64 view of the frame)."""
    return _decode_array(frame, _SLOT, "slot indices")
