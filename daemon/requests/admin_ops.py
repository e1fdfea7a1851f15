"""AdminOps: the operator's requests that act for every session (EVICT and FLUSH; the handlers
let only admin sessions reach them: ``handlers.ADMIN_OPS``).

They evict or flush the cache's pools (settling in-flight copies first, so they act on settled
data) and, with a disk tier, have the disk's IO thread let its pages go ahead of its queue,
waiting a bounded time for it (the daemon's control thread waits with it). What they may touch
is what the constructor takes: the cache (its pools, tree, events and third tier) and how
replies name the tiers. Control thread only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hicache.cache import HiRadixCache
from hicache.daemon.requests.context import Call
from hicache.daemon.requests.tier_names import TierNames
from hicache.daemon.sessions import Session
from hicache.protocol import ErrorCode, EvictRequest, FlushRequest, FreedReply, Op, ProtocolError

Frames = list[Any]
Result = tuple[dict[str, Any], Frames]
DISK_EVICT_WAIT_S = 1.0  # an eviction of the disk waits this long for the store call running
DISK_FLUSH_WAIT_S = 10.0  # a flush of the disk waits this long for the store call running


class AdminOps:
    def __init__(self, cache: HiRadixCache, tiers: TierNames):
        self.cache = cache
        self.tiers = tiers  # how requests and replies name the pools (tier_names.py)

    def table(self) -> dict[Op, Callable[[Session, dict, Frames, Call], Result]]:
        """Each op's handler."""
        return {Op.EVICT: self.evict, Op.FLUSH: self.flush}

    def _settle(self) -> None:
        """Wait for in-flight copies and process their acks (admin ops act on settled data)."""
        self.cache.settle()
        self.cache.poll()

    def evict(self, session: Session, fields: dict, frames: Frames, call: Call) -> Result:
        """Evict unlocked tokens from the tiers named as reported (tier_names.py), and with
        ``disk_tokens`` the disk's least recently used pages (its IO thread does it, ahead of
        its queue; this waits up to DISK_EVICT_WAIT_S for it, the whole daemon with it: then
        ``disk_freed`` is -1 and it happens once the store call running ends)."""
        asked = EvictRequest.read(fields)  # (checked as the operator named the tiers)
        if self.tiers.engine and asked.device_tokens:
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                "this daemon has no device tier (the engines keep theirs): host_tokens evicts "
                "from its pool",
            )
        l3, page_size = self.cache.l3, self.cache.page_size
        if asked.disk_tokens and (l3 is None or not l3.store.clears):
            raise ProtocolError(ErrorCode.BAD_FIELD, "disk_tokens: this daemon has no disk tier")
        req = EvictRequest(**self.tiers.request(asked._asdict(), EvictRequest._fields))
        disk = None
        if req.disk_tokens:
            assert l3 is not None
            job = l3.clear_store(DISK_EVICT_WAIT_S, evict=-(-req.disk_tokens // page_size))
            if job.error:
                raise ProtocolError(ErrorCode.INTERNAL, f"disk: the eviction failed: {job.error}")
            disk = job.cleared * page_size if job.done.is_set() else -1
        freed = self._evict_device(req.device_tokens) if req.device_tokens else 0
        freed_host = self.cache.evict_host(req.host_tokens) if req.host_tokens else 0
        return self.tiers.fields(FreedReply(freed, freed_host, disk).fields()), []

    def _evict_device(self, tokens: int, to_l3: bool = True) -> int:
        """Evict and settle until ``tokens`` are freed or nothing moves. Backups started by the
        eviction free their pages only at the ack, and only then do parents become leaves.
        ``to_l3=False`` (a flush): nothing is written back to a third tier."""
        self._settle()
        freed = 0
        while freed < tokens:
            result = self.cache.evict(tokens - freed, to_l3)
            self._settle()
            freed += result.freed + result.pending
            if not result.freed and not result.pending:
                return freed
        return freed

    def flush(self, session: Session, fields: dict, frames: Frames, call: Call) -> Result:
        """Evict every unlocked token from both tiers (locked data stays); with ``disk``, the
        disk tier forgets everything too (its IO thread does it, ahead of its queue; this
        waits up to DISK_FLUSH_WAIT_S for it)."""
        req = FlushRequest.read(fields)
        l3 = self.cache.l3
        if req.disk and (l3 is None or not l3.store.clears):
            raise ProtocolError(ErrorCode.BAD_FIELD, "disk: this daemon has no disk tier")
        disk = None
        if req.disk:  # (first: a disk that fails its flush leaves the pools as they were)
            assert l3 is not None
            job = l3.clear_store(DISK_FLUSH_WAIT_S)
            if job.error:
                raise ProtocolError(ErrorCode.INTERNAL, f"disk: the flush failed: {job.error}")
            disk = job.cleared * self.cache.page_size if job.done.is_set() else -1
        freed = self._evict_device(self.cache.config.device_tokens, to_l3=False)
        freed_host = self.cache.evict_host(self.cache.config.host_capacity_tokens, to_l3=False)
        if self.cache.events is not None:
            self.cache.events.flushed()
        if disk is not None and disk >= 0:  # (writes the pools' flush queued: gone too)
            assert l3 is not None
            again = l3.clear_store(DISK_FLUSH_WAIT_S)
            disk += again.cleared * self.cache.page_size if again.done.is_set() else 0
        return self.tiers.fields(FreedReply(freed, freed_host, disk).fields()), []
