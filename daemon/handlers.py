"""Request handlers: decode a request, act on the cache for a session, encode the reply.

No sockets here (server.py moves frames). ``Handlers.handle`` never raises: a bad request gets
an error reply with a stable code, an unexpected exception an INTERNAL reply, and the daemon
keeps serving. Handlers run on the control thread only.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hicache.cache import HiRadixCache
from hicache.daemon.cache_ops import CacheOpsMixin
from hicache.daemon.sessions import Ended, Session, SessionTable
from hicache.errors import HiCacheError, InvalidIndicesError
from hicache.node import TreeNode
from hicache.protocol import ErrorCode, Op, ProtocolError, Reply, decode_request, encode_reply

log = logging.getLogger("hicache.daemon")
Frames = list[Any]
Result = tuple[dict[str, Any], Frames]
NO_SESSION_OPS = {Op.HELLO, Op.PING, Op.STATS}


@dataclass
class LockRecord:
    node: TreeNode  # the device node locked for the session
    host_node: TreeNode  # where a load-back of this match would end


def _int(fields: dict, name: str, lo: int = 0, hi: int = 2**62) -> int:
    value = fields.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{name}: expected an int in [{lo}, {hi}]")
    return value


def _namespaces(fields: dict, count: int) -> list:
    spaces = fields.get("namespaces")
    if spaces is None:
        return [None] * count
    if not isinstance(spaces, list) or len(spaces) != count:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"namespaces: expected a list of {count}")
    return spaces


class Handlers(CacheOpsMixin):
    LockRecord = LockRecord
    _int = staticmethod(_int)
    _namespaces = staticmethod(_namespaces)

    def __init__(
        self,
        cache: HiRadixCache,
        sessions: SessionTable,
        boot_epoch: int,
        info: dict[str, Any],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cache = cache
        self.sessions = sessions
        self.boot_epoch = boot_epoch
        self.info = info  # hello's config and pool description, and server facts for stats
        self.clock = clock
        self.started = clock()
        self.table: dict[Op, Callable[[Session | None, dict, Frames], Result]] = {
            Op.HELLO: self.hello,
            Op.HEARTBEAT: self.heartbeat,
            Op.GOODBYE: self.goodbye,
            Op.MATCH: self.match,
            Op.LOAD_BACK: self.load_back,
            Op.ALLOC: self.alloc,
            Op.ALLOC_EXTEND: self.alloc_extend,
            Op.ALLOC_DECODE: self.alloc_decode,
            Op.FREE: self.free,
            Op.INSERT: self.insert,
            Op.LOCK: self.lock,
            Op.RELEASE: self.release,
            Op.EVICT: self.evict,
            Op.FLUSH: self.flush,
            Op.STATS: self.stats,
            Op.TREE: self.tree,
            Op.PING: self.ping,
        }

    # ---- transport-facing -------------------------------------------------------------------
    def handle(self, header: bytes | memoryview, frames: Frames) -> tuple[bytes, Frames]:
        request_id = 0
        try:
            req = decode_request(header)
            request_id = req.request_id
            session = None
            if req.op not in NO_SESSION_OPS:
                session = self.sessions.touch(req.session, self.clock())
            fields, out = self.table[req.op](session, req.fields, frames)
            return self._reply(ErrorCode.OK, request_id, fields), out
        except ProtocolError as exc:
            return self._reply(exc.code, request_id, {"message": str(exc)}), []
        except InvalidIndicesError as exc:
            return self._reply(ErrorCode.NOT_OWNED, request_id, {"message": str(exc)}), []
        except (ValueError, TypeError, HiCacheError) as exc:
            return self._reply(ErrorCode.BAD_FIELD, request_id, {"message": str(exc)}), []
        except Exception as exc:  # a daemon bug: report it, keep serving
            log.exception("internal error")
            message = f"internal error: {type(exc).__name__}: {exc}"
            return self._reply(ErrorCode.INTERNAL, request_id, {"message": message}), []

    def _reply(self, status: ErrorCode, request_id: int, fields: dict) -> bytes:
        return encode_reply(Reply(status, request_id, self.boot_epoch, fields))

    def housekeep(self) -> list[Ended]:
        """Process transfer acks and end sessions whose lease ran out."""
        self.cache.poll()
        ended = self.sessions.expire(self.clock())
        for gone in ended:
            self.give_back(gone)
        return ended

    def give_back(self, ended: Ended) -> None:
        """Release every lock and free every page an ended session still held."""
        session = ended.session
        for record in session.locks.values():
            self.cache.dec_lock_ref(record.node)
        if session.owned:
            pages = np.fromiter(session.owned, dtype=np.int64)
            self.cache.free(pages * self.cache.page_size)
        log.info("session %d (%s) ended: %s", session.id, session.client, ended.reason)

    # ---- sessions ----
    def hello(self, _: Session | None, fields: dict, frames: Frames) -> Result:
        client = fields.get("client", "")
        pid = fields.get("pid", 0)
        if not isinstance(client, str) or isinstance(pid, bool) or not isinstance(pid, int):
            raise ProtocolError(ErrorCode.BAD_FIELD, "hello: client is a str and pid an int")
        session = self.sessions.open(client, pid, self.clock())
        return {"session": session.id, "lease_s": session.lease_s, **self.info}, []

    def heartbeat(self, session: Session, fields: dict, frames: Frames) -> Result:
        return {}, []

    def goodbye(self, session: Session, fields: dict, frames: Frames) -> Result:
        self.give_back(self.sessions.end(session.id))  # type: ignore[arg-type]
        return {}, []

    def ping(self, _: Session | None, fields: dict, frames: Frames) -> Result:
        return {"pong": True, "pid": os.getpid()}, []

    # ---- maintenance ----
    def _settle(self) -> None:
        """Wait for in-flight copies and process their acks (admin ops act on settled data)."""
        if self.cache.engine is not None:
            self.cache.engine.wait(list(self.cache.records))
        self.cache.poll()

    def evict(self, session: Session, fields: dict, frames: Frames) -> Result:
        device = self._int(fields, "device_tokens") if "device_tokens" in fields else 0
        host = self._int(fields, "host_tokens") if "host_tokens" in fields else 0
        freed = self._evict_device(device) if device else 0
        freed_host = self.cache.evict_host(host) if host else 0
        return {"device_freed": freed, "host_freed": freed_host}, []

    def _evict_device(self, tokens: int) -> int:
        """Evict and settle until ``tokens`` are freed or nothing moves. Backups started by the
        eviction free their pages only at the ack, and only then do parents become leaves."""
        self._settle()
        freed = 0
        while freed < tokens:
            result = self.cache.evict(tokens - freed)
            self._settle()
            freed += result.freed + result.pending
            if not result.freed and not result.pending:
                return freed
        return freed

    def flush(self, session: Session, fields: dict, frames: Frames) -> Result:
        """Evict every unlocked token from both tiers (locked data stays)."""
        freed = self._evict_device(self.cache.config.device_tokens)
        freed_host = self.cache.evict_host(self.cache.config.host_capacity_tokens)
        return {"device_freed": freed, "host_freed": freed_host}, []

    def stats(self, _: Session | None, fields: dict, frames: Frames) -> Result:
        out: dict[str, Any] = self.cache.stats().as_dict()
        out.update(
            sessions=len(self.sessions),
            boot_epoch=self.boot_epoch,
            uptime_s=round(self.clock() - self.started, 3),
            pid=os.getpid(),
            token_bytes=self.cache.config.token_bytes,
            endpoint=self.info.get("endpoint", ""),
            session_list=[
                {
                    "id": s.id,
                    "client": s.client,
                    "pid": s.pid,
                    "owned_pages": len(s.owned),
                    "locks": len(s.locks),
                }
                for s in self.sessions
            ],
        )
        if fields.get("check"):
            try:
                self.cache.check_integrity()
                out["integrity"] = "ok"
            except AssertionError as exc:
                out["integrity"] = f"BROKEN: {exc}"
        return out, []

    def tree(self, session: Session, fields: dict, frames: Frames) -> Result:
        limit = self._int(fields, "max_nodes", 1, 100_000) if "max_nodes" in fields else 1000
        nodes = []
        for node in self.cache.tree.iter_nodes():
            if len(nodes) == limit:
                break
            nodes.append(
                {
                    "id": node.id,
                    "parent": node.parent.id,
                    "tokens": node.num_tokens,
                    "device": node.on_device,
                    "host": node.on_host,
                    "lock_ref": node.lock_ref,
                    "hits": node.hit_count,
                    "io": node.io.name.lower(),
                }
            )
        return {"nodes": nodes, "total": self.cache.tree.num_nodes}, []
