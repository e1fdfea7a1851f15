"""Handlers of the cache operations (a mixin of Handlers), with per-session ownership.

A session may pass, free or insert only pages it owns (or, for insert, the tree's own pages
at their place, which the cache itself checks). Every check happens before the cache changes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hicache.allocator import OWNED
from hicache.daemon.sessions import Session
from hicache.protocol import (
    ErrorCode,
    ProtocolError,
    decode_slots,
    decode_tokens,
    slots_frame,
    split,
    split_tokens,
)
from hicache.tokens import check_token_bytes
from hicache.types import MatchResult

Frames = list[Any]
Result = tuple[dict[str, Any], Frames]


def _need_frames(frames: Frames, count: int, op: str) -> None:
    if len(frames) != count:
        raise ProtocolError(
            ErrorCode.BAD_FIELD, f"{op}: expected {count} frames, got {len(frames)}"
        )


class CacheOpsMixin:
    # ---- helpers ----
    def _pages(self, slots: np.ndarray) -> list[int]:
        self.cache.device_alloc.check_slot_range(slots)
        return np.unique(slots // self.cache.page_size).tolist()

    def _grant(self, session: Session, slots: np.ndarray | None) -> Result:
        if slots is None:
            raise ProtocolError(ErrorCode.OUT_OF_MEMORY, "the device pool is full of locked data")
        session.owned.update(self._pages(slots))
        return {"num_tokens": len(slots)}, [slots_frame(slots)]

    def _check_partial(self, session: Session, filled: np.ndarray, last_loc: np.ndarray) -> None:
        partial = filled % self.cache.page_size != 0
        if partial.any():
            session.check_owned(self._pages(last_loc[partial]))

    # ---- allocation ----
    def alloc(self, session: Session, fields: dict, frames: Frames) -> Result:
        n = self._int(fields, "num_tokens", 0, self.cache.config.device_tokens)
        slots = self.cache.alloc(n)
        return self._grant(session, None if slots is None else slots.numpy())

    def alloc_extend(self, session: Session, fields: dict, frames: Frames) -> Result:
        _need_frames(frames, 3, "alloc_extend")
        prefix, seq, last = (decode_slots(f) for f in frames)
        if not len(prefix) == len(seq) == len(last) or (prefix > seq).any() or (prefix < 0).any():
            raise ProtocolError(ErrorCode.BAD_FIELD, "alloc_extend: need 0 <= prefix <= seq")
        self._check_partial(session, prefix, last)
        out = self.cache.alloc_extend(prefix, seq, last)
        return self._grant(session, None if out is None else out.numpy())

    def alloc_decode(self, session: Session, fields: dict, frames: Frames) -> Result:
        _need_frames(frames, 2, "alloc_decode")
        seq, last = (decode_slots(f) for f in frames)
        if len(seq) != len(last) or (seq < 1).any():
            raise ProtocolError(ErrorCode.BAD_FIELD, "alloc_decode: need seq_len >= 1")
        self._check_partial(session, seq - 1, last)
        out = self.cache.alloc_decode(seq, last)
        return self._grant(session, None if out is None else out.numpy())

    def free(self, session: Session, fields: dict, frames: Frames) -> Result:
        _need_frames(frames, 1, "free")
        slots = decode_slots(frames[0])
        pages = self._pages(slots)
        session.check_owned(pages)
        self.cache.free(slots)
        session.owned.difference_update(pages)
        return {}, []

    # ---- match, load, insert ----
    def match(self, session: Session, fields: dict, frames: Frames) -> Result:
        _need_frames(frames, 1, "match")
        batch = split_tokens(frames[0], fields.get("lengths"), fields.get("shared"))
        check_token_bytes(frames[0])  # every key is built from this frame: one pass for all
        spaces = self._namespaces(fields, len(batch))
        lock = fields.get("lock", True) is not False
        match_key = self.cache.match_key
        # A node shared by several matches (a system prompt) travels once: the reply frame holds
        # each distinct node's page ids, and each result lists the chunks its prefix is made of.
        results, chunks, index = [], [], {}
        add_result, seen = results.append, index.get
        for tokens, space in zip(batch, spaces, strict=True):
            m = match_key(tokens, space, True)
            if m.loading:  # another session's load still writes this prefix: let it land
                self.cache.wait_load(m.last_device_node)
            lock_id = self._lock(session, m) if lock else 0
            ids = []
            for chunk in m.page_chunks:  # the nodes' own immutable bytes, alive meanwhile
                i = seen(id(chunk))
                if i is None:
                    i = index[id(chunk)] = len(chunks)
                    chunks.append(chunk)
                ids.append(i)
            add_result([m.device_hit_length, m.host_hit_length, lock_id, ids])
        return self._match_reply(results, chunks)

    def _lock(self, session: Session, m: MatchResult) -> int:
        """Lock a match's device prefix for ``session``; returns the lock id."""
        self.cache.inc_lock_ref(m.last_device_node)
        return session.add_lock(self.LockRecord(m.last_device_node, m.last_host_node))

    def _match_reply(self, results: list, chunks: list[bytes]) -> Result:
        """Pages, not slots, travel (the nodes' own page ids): page_size times fewer bytes than
        slots; the client expands them."""
        frame = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        return {"results": results, "chunk_pages": [len(c) >> 3 for c in chunks]}, [frame]

    def load_back(self, session: Session, fields: dict, frames: Frames) -> Result:
        lock_id = self._int(fields, "lock_id", 1)
        wait = fields.get("wait", True) is not False  # False: answer at once with a ticket
        record = session.locks.get(lock_id)
        if record is None:
            raise ProtocolError(ErrorCode.NOT_OWNED, f"lock {lock_id} is not held")
        none = {"loaded": 0, "ticket": 0}, [slots_frame(np.empty(0, np.int64))]
        if not self.cache.tree.in_tree(record.host_node):  # host-evicted since the match
            return none
        loaded = self.cache.load_back(record.host_node)
        if loaded is None or not len(loaded):
            return none
        ticket = self.cache.load_ticket(record.host_node) or 0
        events = self.cache.engine.layer_handles(ticket) if ticket else None
        if wait:
            self.cache.wait_load(record.host_node)
            ticket, events = 0, None
        self.cache.inc_lock_ref(record.host_node)  # the lock now covers the loaded part
        self.cache.dec_lock_ref(record.node)
        record.node = record.host_node
        fields = {"loaded": len(loaded), "ticket": ticket}
        if events:
            fields["events"] = events  # opaque CUDA IPC handles, one per layer
        return fields, [slots_frame(loaded)]

    def insert(self, session: Session, fields: dict, frames: Frames) -> Result:
        """Insert each sequence in turn; a bad one stops the batch with an error reply, and the
        sequences before it stay inserted (their pages are the tree's now)."""
        _need_frames(frames, 2, "insert")
        tokens = split(decode_tokens(frames[0]), fields.get("lengths"), "token ids")
        slots = split(decode_slots(frames[1]), fields.get("lengths"), "slot indices")
        spaces = self._namespaces(fields, len(tokens))
        prefix_lens = []
        state = self.cache.device_alloc.state
        for seq, seq_slots, space in zip(tokens, slots, spaces, strict=True):
            pages = np.asarray(self._pages(seq_slots), dtype=np.int64)
            mine = pages[state[pages] == OWNED].tolist() if len(pages) else []
            session.check_owned(mine)  # never another session's pages
            prefix_lens.append(self.cache.insert(seq, seq_slots, namespace=space))
            session.owned.difference_update(mine)
        return {"prefix_lens": prefix_lens}, []

    # ---- locks ----
    def lock(self, session: Session, fields: dict, frames: Frames) -> Result:
        record = session.locks.get(self._int(fields, "lock_id", 1))
        if record is None:
            raise ProtocolError(ErrorCode.NOT_OWNED, "lock is not held")
        self.cache.inc_lock_ref(record.node)
        return {"lock_id": session.add_lock(self.LockRecord(record.node, record.host_node))}, []

    def release(self, session: Session, fields: dict, frames: Frames) -> Result:
        ids = fields.get("lock_ids")
        if not isinstance(ids, list) or len(set(map(repr, ids))) != len(ids):
            raise ProtocolError(ErrorCode.BAD_FIELD, "release: lock_ids must be distinct ints")
        missing = [i for i in ids if i not in session.locks]
        if missing:
            raise ProtocolError(ErrorCode.NOT_OWNED, f"locks {missing} are not held")
        for lock_id in ids:
            self.cache.dec_lock_ref(session.pop_lock(lock_id).node)
        return {}, []
