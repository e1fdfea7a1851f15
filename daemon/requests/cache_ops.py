"""CacheOps: the cache operations of sessions (alloc, free, match, insert, locks, load-back),
with per-session ownership.

A session may pass, free or insert only pages it owns (or, for insert, the tree's own pages
at their place, which the cache itself checks). Every check, limits included, happens before
the cache changes. What it may touch is what its constructor takes: the cache, the sessions'
owned pages and locks (through the sessions it is handed, and the table for what an
OUT_OF_MEMORY reply names), the limits, the capacity feed, and whether other requests wait;
each request's own facts come as its ``call`` argument.
Control thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hicache.cache import HiRadixCache
from hicache.daemon.requests.capacity_feed import CapacityFeed
from hicache.daemon.requests.context import Call
from hicache.daemon.requests.l3_waits import Deferred
from hicache.daemon.sessions import Session, SessionLimits, SessionTable, out_of_memory
from hicache.errors import InvalidIndicesError
from hicache.memory import OWNED, TREE
from hicache.protocol import (
    AllocRequest,
    ErrorCode,
    FreeRequest,
    InsertReply,
    InsertRequest,
    LoadReply,
    LoadRequest,
    LockReply,
    LockRequest,
    MatchEntry,
    MatchReply,
    MatchRequest,
    Op,
    ProtocolError,
    ReleaseRequest,
    TokenBatch,
    decode_pages,
    decode_slots,
    decode_tokens,
    namespaces_field,
    slots_frame,
    split,
    token_batch,
)
from hicache.tree import TreeNode, check_token_bytes
from hicache.types import MatchResult

Frames = list[Any]
_OWNED, _TREE = int(OWNED), int(TREE)  # (plain ints: numpy compares them without enum lookups)
# A batched match answers what it matched in this long once another request waits (the client
# asks again for the rest): one client's heavy batches delay another's request by one turn.
TURN_S = 0.0002
TURN_PER_CHECK = 2  # ... and at least this many times what checking the request took
Result = tuple[dict[str, Any], Frames]
_NO_SLOTS = np.empty(0, np.int64)
MAX_SEQ = 1 << 40  # longest sequence alloc_extend/alloc_decode take (no int64 overflow)


def _need_frames(frames: Frames, count: int, op: str) -> None:
    if len(frames) != count:
        raise ProtocolError(
            ErrorCode.BAD_FIELD, f"{op}: expected {count} frames, got {len(frames)}"
        )


def _chunks_frame(chunks: list[bytes]) -> bytes:
    """A MATCH-form reply's first frame: the distinct nodes' own page ids (int64), not slots:
    page_size times fewer bytes; the client expands them."""
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _chunk_pages(chunks: list[bytes]) -> list[int]:
    return [len(c) >> 3 for c in chunks]


@dataclass
class LockRecord:
    node: TreeNode  # the device node locked for the session
    host_node: TreeNode  # where a load-back of this match would end
    pinned: int = 0  # device pages this lock made unevictable (no lock held them before)


class CacheOps:
    def __init__(
        self,
        cache: HiRadixCache,
        limits: SessionLimits,
        capacity: CapacityFeed | None,
        sessions: SessionTable,
        others_waiting: Callable[[], bool] = bool,
    ):
        self.cache = cache
        self.limits = limits  # what one session may hold
        self.capacity = capacity  # the hit-ratio estimate, fed by matches and inserts
        self.sessions = sessions  # (read only: who holds the pool, for OUT_OF_MEMORY)
        # whether another request waits on the transport (a long batched match then answers
        # what it has and lets it go first)
        self.others_waiting = others_waiting
        self.match_parts = 0  # batched matches answered in part because others waited (stats)

    def table(self) -> dict[Op, Callable[[Session, dict, Frames, Call], Result]]:
        """The ops this answers, for the handlers' table."""
        return {
            Op.MATCH: self.match,
            Op.LOAD_BACK: self.load_back,
            Op.ALLOC: self.alloc,
            Op.ALLOC_EXTEND: self.alloc_extend,
            Op.ALLOC_DECODE: self.alloc_decode,
            Op.FREE: self.free,
            Op.INSERT: self.insert,
            Op.LOCK: self.lock,
            Op.RELEASE: self.release,
        }

    # ---- helpers ----
    def _pages(self, slots: np.ndarray) -> list[int]:
        self.cache.check_slots(slots)
        return np.unique(slots // self.cache.page_size).tolist()

    def _first_slots(self, frame: Any) -> np.ndarray:
        """A page-id frame as the first slot of each page (checked to lie in the pool, before
        the product: a huge id must not wrap into the pool)."""
        pages = decode_pages(frame)
        top = self.cache.device_capacity_pages
        if len(pages) and (int(pages.min()) < 0 or int(pages.max()) >= top):
            raise InvalidIndicesError(f"a page id outside the pool (0 to {top - 1})")
        slots = pages * self.cache.page_size
        self.cache.check_slots(slots)
        return slots

    def _slots_of(self, frame: Any, lengths: Any) -> list[np.ndarray]:
        """A page-id frame (INSERT's ``pages`` form: ceil(length / page_size) per sequence) as
        each sequence's slots."""
        ps = self.cache.page_size
        if not isinstance(lengths, list) or not all(type(n) is int and n >= 0 for n in lengths):
            raise ProtocolError(ErrorCode.BAD_FIELD, "insert: lengths must be a list of ints")
        counts = [-(-n // ps) for n in lengths]
        pages = split(self._first_slots(frame) // ps, counts, "page ids")
        return [self.cache.slots_of_pages(p)[:n] for p, n in zip(pages, lengths, strict=True)]

    def _grant(self, session: Session, slots: Any, pages: int, as_pages: bool = False) -> Result:
        """Record the pages of ``slots`` (a tensor, or None when the pool had no room) as the
        session's; ``as_pages``: reply with their page ids, not the slots."""
        if slots is None:
            raise out_of_memory(self.cache, self.sessions.holders(), pages)
        slots = slots.numpy()
        session.owned.update(self._pages(slots))
        if as_pages:  # (whole pages in order: each page's first slot, every page_size-th)
            return {"num_tokens": len(slots)}, [
                slots_frame(slots[:: self.cache.page_size] // self.cache.page_size)
            ]
        return {"num_tokens": len(slots)}, [slots_frame(slots)]

    def _check_partial(self, session: Session, filled: np.ndarray, last_loc: np.ndarray) -> None:
        """A request that continues a partly filled page must own that page (the cache checks
        that ``last_loc`` sits where the request's last token belongs in it)."""
        partial = filled % self.cache.page_size != 0
        if partial.any():
            session.check_owned(self._pages(last_loc[partial]))

    # ---- allocation ----
    def alloc(self, session: Session, fields: dict, frames: Frames, call: Call) -> Result:
        req = AllocRequest.read(fields, self.cache.config.device_tokens)
        pages = -(-req.num_tokens // self.cache.page_size)
        self.limits.check_owned(session, pages)
        return self._grant(session, self.cache.alloc(req.num_tokens), pages, req.pages)

    def alloc_extend(self, session: Session, fields: dict, frames: Frames, call: Call) -> Result:
        _need_frames(frames, 3, "alloc_extend")
        prefix, seq, last = (decode_slots(f) for f in frames)
        if not len(prefix) == len(seq) == len(last):
            raise ProtocolError(ErrorCode.BAD_FIELD, "alloc_extend: one of each per request")
        if (prefix > seq).any() or (prefix < 0).any() or (seq > MAX_SEQ).any():
            raise ProtocolError(
                ErrorCode.BAD_FIELD, f"alloc_extend: need 0 <= prefix_len <= seq_len <= {MAX_SEQ}"
            )
        self._check_partial(session, prefix, last)
        pages = self.cache.extend_pages_needed(prefix, seq)
        self.limits.check_owned(session, pages)
        return self._grant(session, self.cache.alloc_extend(prefix, seq, last), pages)

    def alloc_decode(self, session: Session, fields: dict, frames: Frames, call: Call) -> Result:
        _need_frames(frames, 2, "alloc_decode")
        seq, last = (decode_slots(f) for f in frames)
        if len(seq) != len(last):
            raise ProtocolError(ErrorCode.BAD_FIELD, "alloc_decode: one last_loc per seq_len")
        if (seq < 1).any() or (seq > MAX_SEQ).any():
            raise ProtocolError(
                ErrorCode.BAD_FIELD, f"alloc_decode: need 1 <= seq_len <= {MAX_SEQ}"
            )
        self._check_partial(session, seq - 1, last)
        pages = int(((seq - 1) % self.cache.page_size == 0).sum())
        self.limits.check_owned(session, pages)
        return self._grant(session, self.cache.alloc_decode(seq, last), pages)

    def free(self, session: Session, fields: dict, frames: Frames, call: Call) -> Result:
        _need_frames(frames, 1, "free")
        if FreeRequest.read(fields).pages:
            slots = self._first_slots(frames[0])  # (a slot frees the page it lies in)
        else:
            slots = decode_slots(frames[0])
        pages = self._pages(slots)
        session.check_owned(pages)
        self.cache.free(slots)
        session.owned.difference_update(pages)
        return {}, []

    # ---- match, load, insert ----
    def match(self, session: Session, fields: dict, frames: Frames, call: Call) -> Result:
        """Match (and lock) each sequence of a batch in turn. Past its turn (TURN_S, or twice
        what checking the request took), while another request waits, the reply answers only
        the sequences matched so far (at least one): the client asks again for the rest."""
        started = time.perf_counter()
        _need_frames(frames, 1, "match")
        req = MatchRequest.read(fields)
        batch = token_batch(frames[0], req.lengths, req.shared)
        check_token_bytes(frames[0])  # every key is built from this frame: one pass for all
        spaces = namespaces_field(req.namespaces, len(batch))
        lock, alloc_rest, l3_wait = req.lock, req.alloc_rest, req.l3_wait
        if lock:
            self.limits.check_locks(session, len(batch))
        # a turn at least twice what checking the request took: a client asking again for the
        # rest pays for its checks and its bytes once per part, so parts stay few
        now = time.perf_counter()
        turn_ends = now + max(TURN_S, TURN_PER_CHECK * (now - started))
        fetches, upto = None, len(batch)  # upto: the prompts this turn may answer
        if self.cache.l3 is not None:
            fetches, upto = self._prefetch(batch, spaces, l3_wait and call.may_wait, turn_ends)
        match_key, feed = self.cache.match_key, self.capacity
        results: list[MatchEntry] = []
        state: tuple[list[bytes], dict[int, int]] = ([], {})  # (see _result)
        queried = 0
        try:
            for tokens, space in zip(batch, spaces, strict=True):
                if results and (
                    len(results) >= upto
                    or (time.perf_counter() > turn_ends and self.others_waiting())
                ):
                    self.match_parts += 1
                    break  # the rest is asked again: the requests waiting go first
                m = match_key(tokens, space, True)
                if m.loading:
                    m = self._landed(tokens, space, m)
                results.append(self._result(session, m, lock, state))
                session.hit_tokens += m.device_hit_length + m.host_hit_length
                queried += len(tokens)
                if feed is not None:
                    feed.saw(True, tokens, space)
            session.queried_tokens += queried >> 2  # keys are int32 bytes
        except BaseException:
            self._undo_locks(session, results)  # a failed request holds nothing
            raise
        rest_pages, frames = None, [_chunks_frame(state[0])]
        if alloc_rest:
            rest_pages, rest = self._alloc_rest(session, fields["lengths"], results)
            frames.append(rest)
        # still coming: an engine that did not wait may ask again later
        pending = [i for i, f in fetches or () if not f.done and i < len(results)]
        reply = MatchReply(results, _chunk_pages(state[0]), pending, rest_pages)
        return reply.fields(), frames

    def _alloc_rest(
        self, session: Session, lengths: list, results: list[MatchEntry]
    ) -> tuple[list, bytes]:
        """A store's allocation in its match's round trip: for each sequence answered, pages
        for its tokens past the device hit (as ALLOC would give), this session's. Returns the
        pages per sequence and their page ids (int64, in sequence order); OUT_OF_MEMORY or
        QUOTA_EXCEEDED as ALLOC, with nothing allocated (the match took no lock)."""
        size = self.cache.page_size
        counts = [-(-(n - e.device_len) // size) for n, e in zip(lengths, results, strict=False)]
        total = sum(counts)
        if not total:
            return counts, b""
        self.limits.check_owned(session, total)
        slots = self.cache.alloc(total * size)
        if slots is None:
            raise out_of_memory(self.cache, self.sessions.holders(), total)
        pages = slots.numpy()[::size] // size
        session.owned.update(pages.tolist())
        return counts, pages.astype(np.int64).tobytes()

    def _prefetch(
        self, batch: TokenBatch | list, spaces: list, wait: bool, turn_ends: float
    ) -> tuple[list, int]:
        """Ask the third tier for what the tree lacks of each prompt; under a waiting policy
        (and when ``wait``: the request and the server allow it) raise Deferred until it
        arrives.
        Past the turn (``turn_ends``) while another request waits, it stops: the match then
        answers the prompts asked for so far. Returns the (index, fetch) of each prompt with
        a fetch still running, and how many prompts were asked for."""
        l3, match_key = self.cache.l3, self.cache.match_key
        assert l3 is not None  # (match asks only with a third tier)
        waiting, upto = [], len(batch)
        for i, (tokens, space) in enumerate(zip(batch, spaces, strict=True)):
            if i and time.perf_counter() > turn_ends and self.others_waiting():
                upto = i  # the rest is asked for when the client asks again
                break
            m = match_key(tokens, space, True, count=False)
            fetch = l3.prefetch(tokens, space, m.device_hit_length + m.host_hit_length)
            if fetch is not None and not fetch.done:
                waiting.append((i, fetch))
        if waiting and wait and l3.config.wait_bound(1) > 0:
            raise Deferred([f for _, f in waiting], max(f.deadline for _, f in waiting))
        return waiting, upto

    def _undo_locks(self, session: Session, results: list[MatchEntry]) -> None:
        """Release the locks a request took before it failed (their ids never reach the
        client)."""
        for entry in results:
            if entry.lock_id:
                self.cache.dec_lock_ref(session.pop_lock(entry.lock_id).node)

    def _landed(self, key: bytes, space: Any, m: MatchResult) -> MatchResult:
        """Another session's load still writes this prefix: let it land and look again (it may
        have failed, and then that part is a host hit, not garbage on the device)."""
        self.cache.wait_load(m.last_device_node)
        return self.cache.match_key(key, space, True, count=False)

    def _result(
        self, session: Session, m: MatchResult, lock: bool, state: tuple, inserted: int = 0
    ) -> MatchEntry:
        """One match's reply entry. A node shared by several matches (a system prompt) travels
        once: ``state`` holds each distinct node's page ids, and the entry lists the chunks its
        prefix is made of. ``inserted``: pages of the session's the insert before it added."""
        found = m.device_hit_length or m.host_hit_length or inserted
        lock_id = self._lock(session, m, inserted) if lock and found else 0  # (nothing: none)
        chunks, index = state
        ids = []
        for chunk in m.page_chunks:  # the nodes' own immutable bytes, alive meanwhile
            i = index.get(id(chunk))
            if i is None:
                i = index[id(chunk)] = len(chunks)
                chunks.append(chunk)
            ids.append(i)
        return MatchEntry(m.device_hit_length, m.host_hit_length, lock_id, ids)

    def _lock(self, session: Session, m: MatchResult, inserted: int = 0) -> int:
        """Lock a match's device prefix for ``session``; returns the lock id. What the lock
        pins counts against the session's share of the pool, with what it owns: the pages no
        lock held before (a backup's lock is one), and at least the session's own pages an
        insert just added (``inserted``). QUOTA_EXCEEDED (nothing locked) past the share."""
        made = -self.cache.inc_lock_ref(m.last_device_node) // self.cache.page_size
        pinned = max(made, inserted)
        try:
            self.limits.check_pinned(session, pinned)
        except ProtocolError:
            self.cache.dec_lock_ref(m.last_device_node)
            raise
        session.pinned_pages += pinned
        return session.add_lock(LockRecord(m.last_device_node, m.last_host_node, pinned))

    def load_back(self, session: Session, fields: dict, frames: Frames, call: Call) -> Result:
        lock_id, wait = LoadRequest.read(fields)  # wait false: answer at once with a ticket
        record = session.locks.get(lock_id)
        if record is None:
            raise ProtocolError(
                ErrorCode.NOT_OWNED,
                f"lock {lock_id} is not held by this session (released, or not from a locked "
                "match)",
            )
        none = LoadReply(0, 0).fields(), [slots_frame(_NO_SLOTS)]
        if not self.cache.holds(record.host_node):  # host-evicted since the match
            return none
        session.loads.intersection_update(self.cache.records)  # those still in flight
        self.limits.check_loads(session, len(session.loads))
        loaded = self.cache.load_back(record.host_node)
        if loaded is None:
            return none
        found = self.cache.load_ticket(record.host_node)
        ticket = found or 0
        events = None
        if found:
            events = self.cache.layer_handles(found)
        if wait:
            self.cache.wait_load(record.host_node)
            if record.host_node.device_pages is None:  # the copy failed: a miss, recompute
                return LoadReply(0, 0, failed=True).fields(), none[1]
            ticket, events = 0, None
        elif ticket:
            session.loads.add(ticket)
        # the match's whole host part: another engine's load may have brought its head to the
        # device meanwhile, and then this load copied only the rest (loaded)
        part = self._host_part_slots(record)
        gained = -self.cache.inc_lock_ref(record.host_node)  # it covers the loaded part now
        lost = self.cache.dec_lock_ref(record.node)
        record.node = record.host_node
        change = max((gained - lost) // self.cache.page_size, -record.pinned)
        record.pinned += change  # (a load of what was matched is not refused for its pages)
        session.pinned_pages += change
        return LoadReply(len(part), ticket, events).fields(), [slots_frame(part)]

    def _host_part_slots(self, record: Any) -> np.ndarray:
        """Device slots of a match's host part, in token order: every node from the match's
        last device node (exclusive) down to its last host node, all on the device now."""
        chain, node = [], record.host_node
        while node is not record.node and node.parent is not None:
            chain.append(node.device_pages)
            node = node.parent
        pages = np.frombuffer(b"".join(reversed(chain)), dtype=np.int64)
        return self.cache.slots_of_pages(pages)

    def insert(self, session: Session, fields: dict, frames: Frames, call: Call) -> Result:
        """Insert each sequence in turn; a bad one stops the batch with an error reply, and the
        sequences before it stay inserted (their pages are the tree's now).

        ``lock: true`` (an unfinished request, SGLang's cache_unfinished_req): only whole pages
        are inserted, the partial tail page stays the session's, and the reply is a locked
        match of what is now cached (MATCH's reply form): the pages the request must use for
        its prefix from now on (where another engine cached the same tokens first, its pages,
        and the caller's duplicates are freed). ``release``: lock ids released once the insert
        succeeded (the match this one replaces: one round trip, and nothing released when the
        insert fails)."""
        _need_frames(frames, 2, "insert")
        req = InsertRequest.read(fields)
        lock = req.lock
        releases = self._held_ids(session, req.release) if "release" in fields else []
        tokens = split(decode_tokens(frames[0]), req.lengths, "token ids")
        if req.pages:
            slots = self._slots_of(frames[1], req.lengths)
        else:
            slots = split(decode_slots(frames[1]), req.lengths, "slot indices")
        spaces = namespaces_field(req.namespaces, len(tokens))
        if lock:
            self.limits.check_locks(session, len(tokens))
        elif len(tokens) > 1 and not releases:
            fast = self._insert_many(session, tokens, slots, spaces)
            if fast is not None:
                return InsertReply(fast).fields(), []
        prefix_lens: list[int] = []
        results: list[MatchEntry] = []
        state: tuple[list[bytes], dict[int, int]] = ([], {})  # (see _result)
        try:
            for seq, seq_slots, space in zip(tokens, slots, spaces, strict=True):
                prefix_len, joined = self._insert_one(session, seq, seq_slots, space, lock)
                prefix_lens.append(prefix_len)
                if lock:
                    m = self._settled(seq, space)
                    results.append(self._result(session, m, True, state, joined))
        except BaseException:
            self._undo_locks(session, results)  # (the sequences before stay inserted)
            raise
        self._release_ids(session, releases)
        if not lock:
            return InsertReply(prefix_lens).fields(), []
        reply = MatchReply(results, _chunk_pages(state[0]))
        return {**reply.fields(), **InsertReply(prefix_lens).fields()}, [_chunks_frame(state[0])]

    def _insert_many(
        self, session: Session, tokens: list, slots: list, spaces: list
    ) -> list[int] | None:
        """A batch of sequences (no lock) with the ownership of all their pages checked once
        (a batch of SGLang's one-page keys is 64 inserts): None, inserting nothing, when some
        page is not the session's or the tree's (the batch then goes sequence by sequence, to
        fail where ``insert`` fails). Returns each sequence's prefix already cached."""
        every = np.concatenate(slots) if slots else np.empty(0, np.int64)
        states = self.cache.page_states
        pages = np.asarray(self._pages(every), dtype=np.int64)
        kinds = states(pages) if len(pages) else pages
        mine = pages[kinds == _OWNED]
        if not session.owns_all(mine.tolist()) or not (kinds[kinds != _OWNED] == _TREE).all():
            return None
        insert, feed = self.cache.insert, self.capacity
        prefix_lens = []
        try:
            for seq, seq_slots, space in zip(tokens, slots, spaces, strict=True):
                prefix_lens.append(insert(seq, seq_slots, namespace=space))
                if feed is not None:
                    feed.saw(False, seq, space)
        finally:  # (what is no longer OWNED joined the tree or was freed as a duplicate)
            session.owned.difference_update(mine[states(mine) != _OWNED].tolist())
        return prefix_lens

    def _insert_one(
        self, session: Session, seq: np.ndarray, slots: np.ndarray, space: Any, whole: bool
    ) -> tuple[int, int]:
        """Insert one sequence with the session's (or the tree's own) slots; ``whole``: only
        its whole pages (the partial tail page stays the session's). Returns the prefix
        already cached and how many of the session's pages joined the tree."""
        if whole:
            aligned = len(seq) // self.cache.page_size * self.cache.page_size
            seq, slots = seq[:aligned], slots[:aligned]
        states = self.cache.page_states
        pages = np.asarray(self._pages(slots), dtype=np.int64)
        mine = pages[states(pages) == _OWNED] if len(pages) else pages
        session.check_owned(mine.tolist())  # never another session's pages
        prefix_len = self.cache.insert(seq, slots, namespace=space)
        if self.capacity is not None:
            self.capacity.saw(False, seq, space)
        # what is no longer OWNED joined the tree or was freed as a duplicate
        gone = mine[states(mine) != _OWNED]
        session.owned.difference_update(gone.tolist())
        return prefix_len, int(np.count_nonzero(states(gone) == _TREE))

    def _settled(self, seq: np.ndarray, space: Any) -> MatchResult:
        """The cached whole-page prefix of ``seq`` (a look-up, not a request), loads landed."""
        aligned = len(seq) // self.cache.page_size * self.cache.page_size
        key = seq[:aligned].tobytes()
        m = self.cache.match_key(key, space, True, count=False)
        return self._landed(key, space, m) if m.loading else m

    # ---- locks ----
    def lock(self, session: Session, fields: dict, frames: Frames, call: Call) -> Result:
        lock_id = LockRequest.read(fields).lock_id
        record = session.locks.get(lock_id)
        if record is None:
            raise ProtocolError(ErrorCode.NOT_OWNED, f"lock {lock_id} is not held")
        self.limits.check_locks(session, 1)
        self.cache.inc_lock_ref(record.node)
        return LockReply(session.add_lock(LockRecord(record.node, record.host_node))).fields(), []

    def release(self, session: Session, fields: dict, frames: Frames, call: Call) -> Result:
        req = ReleaseRequest.read(fields)
        ids = list(session.locks) if req.all else req.lock_ids  # all: asyncio cancellations
        self._release_ids(session, self._held_ids(session, ids))
        return {}, []

    @staticmethod
    def _held_ids(session: Session, ids: Any) -> list[int]:
        """Distinct lock ids the session holds (BAD_FIELD, NOT_OWNED: nothing released). Id 0
        is a match's "no lock" (it found nothing): skipped, as clients may send it back."""
        if (
            not isinstance(ids, list)
            or not all(type(i) is int for i in ids)
            or len(set(ids)) != len(ids)
        ):
            raise ProtocolError(ErrorCode.BAD_FIELD, "release: lock_ids must be distinct ints")
        ids = [i for i in ids if i != 0]
        missing = [i for i in ids if i not in session.locks]
        if missing:
            raise ProtocolError(ErrorCode.NOT_OWNED, f"locks {missing[:8]} are not held")
        return ids

    def _release_ids(self, session: Session, ids: list[int]) -> None:
        for lock_id in ids:
            self.cache.dec_lock_ref(session.pop_lock(lock_id).node)
