"""Each op's fields as a typed message: clients build them (``.fields()``: a request sends what
differs from its defaults), the daemon reads them (``.read``: each field checked, a bad one
named in BAD_FIELD). Replies read by name (a reply lacking a field raises ProtocolError)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from hicache.protocol.header import (
    ENGINE_REPORT,
    ENGINE_REPORT_MAX,
    PROTOCOL_VERSION,
    ErrorCode,
    ProtocolError,
)


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
        return cls(fields.get("lock_ids"), bool_field(fields, "all", False))


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
    reports its tiers (an engine-tier daemon's one pool is ``host``); ``disk_tokens``: the
    disk's least recently used pages, about this many tokens (whole pages, leaves first)."""

    device_tokens: int = 0
    host_tokens: int = 0
    disk_tokens: int = 0

    def fields(self) -> dict[str, Any]:
        return _sparse(self)

    @classmethod
    def read(cls, fields: dict[str, Any]) -> EvictRequest:
        device = int_field(fields, "device_tokens") if "device_tokens" in fields else 0
        host = int_field(fields, "host_tokens") if "host_tokens" in fields else 0
        return cls(device, host, int_field(fields, "disk_tokens") if "disk_tokens" in fields else 0)


class FlushRequest(NamedTuple):
    """FLUSH (admin): every unlocked token of the pools, and with ``disk`` everything the
    node's disk tier holds."""

    disk: bool = False

    def fields(self) -> dict[str, Any]:
        return _sparse(self)

    @classmethod
    def read(cls, fields: dict[str, Any]) -> FlushRequest:
        return cls(bool_field(fields, "disk", False))


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
    # FLUSH with disk, EVICT with disk_tokens: tokens the disk forgot (-1: it waits behind a
    # store call that still runs, and happens when that ends); absent otherwise
    disk_freed: int | None = None

    def fields(self) -> dict[str, Any]:
        out = self._asdict()
        if self.disk_freed is None:
            del out["disk_freed"]
        return out

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
