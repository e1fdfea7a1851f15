"""HiCacheClient: what an engine uses to talk to hicache-daemon.

    with HiCacheClient(name="my-engine") as hc:
        pools = hc.attach()                       # k_buffer / v_buffer (or kv_buffer) tensors
        m = hc.match_prefix(prompt)               # locked for this session until release
        loaded = hc.load_back(m)                  # host part on the device, or None
        # or layer by layer: load = hc.load_back_async(m); hc.wait_layer(load, i) before layer i
        new = hc.alloc(len(seq) - m.device_hit_length)       # slots this session owns
        ...write KV for the new tokens into pools.k_buffer[layer][new]...
        hc.insert(seq, torch.cat([m.device_indices, loaded, new]))
        hc.release(m)

Every method raises DaemonError (with a stable .code), EpochChanged, LeaseLost or
DaemonTimeout. A background thread heartbeats so that a live engine keeps its session; when
the process dies, the daemon takes back its locks and slots once the lease (and the
quarantine after it) has run out. Once EpochChanged or LeaseLost has been seen, by a call or
by the heartbeat, every later call raises it again: open a new client.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import fields
from typing import Any, NamedTuple

import numpy as np
import torch

from hicache.client.connection import (
    Connection,
    DaemonError,
    DaemonTimeout,
    LeaseLost,
)
from hicache.client.pools import AttachedPools, attach_pools, attach_progress
from hicache.client.results import LoadTicket, Match, PageFrame
from hicache.client.session import SessionLink
from hicache.config import HiCacheConfig
from hicache.endpoints import env_endpoint
from hicache.memory import AttachedSharedMemory, EngineLayout
from hicache.protocol import (
    DEFAULT_TIMEOUT_S,
    ENGINE_REPORT_MAX,
    AllocRequest,
    ErrorCode,
    EvictRequest,
    FlushRequest,
    FreedReply,
    FreeRequest,
    HoldingsReply,
    InsertReply,
    InsertRequest,
    LoadReply,
    LoadRequest,
    LockReply,
    LockRequest,
    MatchReply,
    MatchRequest,
    Op,
    PingReply,
    RegisterReply,
    RegisterRequest,
    ReleaseRequest,
    StatsRequest,
    TreeRequest,
    decode_slots,
    slots_frame,
    tokens_frame,
)
from hicache.transfers import LayerProgress
from hicache.tree import as_slots, as_tokens, pack_shared

REGISTER_TIMEOUT_S = 30.0  # the first REGISTER makes the pool: reserving it takes seconds
LIVENESS_S = 0.5  # a wait for a layer checks that the daemon is still there this often


def _slots(frame: Any) -> torch.Tensor:
    """The slots in a reply frame as a tensor over the frame's own memory (kept alive by it)."""
    buf = frame.buffer
    if len(buf) % 8:
        decode_slots(buf)  # raises with the reason
    if not len(buf):
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(buf, dtype=torch.int64)


class Inserted(NamedTuple):
    """What ``insert_and_lock`` returns."""

    prefix_len: int  # leading tokens that were cached already (by anyone)
    match: Match  # locked: the cached whole-page prefix, the pages to use for it from now on


class Holdings(NamedTuple):
    """What ``holdings`` returns."""

    lock_ids: list[int]  # locks the session holds (Match.lock_id values)
    owned_slots: torch.Tensor  # the first slot of each page the session owns


class HiCacheClient:
    """One session with the daemon, safe to share between the threads of one process: each
    thread talks on a connection of its own (same session), so calls of different threads are
    in flight at once and a reply never reaches another thread's call. Slots, locks and
    Matches belong to the session, whichever thread got them: one thread may match and
    allocate, another insert and release. Not for another process: a forked child raises."""

    def __init__(
        self,
        endpoint: str | None = None,
        name: str = "engine",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        heartbeat: bool = True,
        admin: bool = False,
        daemon_user: str | int | None = None,
    ):
        """Open a session (hello). ``admin=True``: this session may also flush and evict for
        everyone (operators' tools; engines never need it); it reads the daemon's admin token
        from the file ``hicache.endpoints.admin_token_path(endpoint)`` names (PermissionError
        when this user cannot).

        Before anything is sent, the daemon must be this user's, root's or ``daemon_user``'s
        (default ``$HICACHE_DAEMON_USER``): checked on the socket (client/trust.py), else
        UntrustedDaemon (a PermissionError) and nothing is sent.

        The session ends with ``close()``, or when the client is garbage-collected, or when the
        process exits: the daemon then frees what it still holds."""
        self.endpoint = endpoint or env_endpoint()
        self.timeout_s = timeout_s
        self._link = SessionLink(self.endpoint, name, timeout_s, admin, heartbeat, daemon_user)
        self._finalizer = weakref.finalize(self, self._link.close)  # holds the link, not us
        self._attach_lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        """What belongs to one session (and one daemon life): pools, progress table."""
        self.info = self._link.info
        self.lease_s = self._link.lease_s
        self._page_size = int(self.info["config"]["page_size"])
        self.pools: AttachedPools | None = None
        self._progress_map: AttachedSharedMemory | None = None
        self._progress_table: LayerProgress | None = None
        self._generation = self._link.generation

    @property
    def session(self) -> int:
        """The session's key (secret: what requests name it by)."""
        return self._link.key

    @property
    def daemon_uid(self) -> int | None:
        """The user the daemon runs as, as checked on its socket (None: a CurveZMQ daemon)."""
        return self._link.daemon_uid

    @property
    def conn(self) -> Connection:
        """The calling thread's connection (for tests and tools)."""
        return self._link.conn()

    @property
    def lost(self) -> DaemonError | None:
        """EpochChanged or LeaseLost once the session learned it (by a call or the heartbeat),
        until ``reconnect``."""
        return self._link.lost

    def when_draining(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once, on the heartbeat's thread, when the daemon says it is
        shutting down (give back what you hold so that it can stop). It must be thread-safe."""
        self._link.on_draining = callback

    @property
    def draining(self) -> bool:
        """The daemon said (in a heartbeat reply) that it is shutting down: its sessions are
        served until it exits, new ones are refused (DRAINING)."""
        return self._link.draining

    @property
    def heard(self) -> float:
        """When the daemon last answered this session (``time.monotonic()``; heartbeats
        included): a session not heard from for a lease may have lapsed."""
        return self._link.heard

    def _call(self, op: Op, fields: dict | None = None, frames: list | tuple = ()) -> tuple:
        return self._link.call(op, fields, frames)

    def reconnect(self) -> bool:
        """After EpochChanged or LeaseLost: open a new session on this client, for every
        thread at once (the first thread to call does it, the others find it done). Every
        slot, lock, Match, LoadTicket and pool tensor from before is void: drop them (a void
        Match is skipped by ``release``), ``attach()`` again and match again. Returns whether
        this call reconnected."""
        with self._attach_lock:
            generation = self._generation
            if self._link.generation != generation:  # another thread did it
                self._reset_pools()
                return False
            done = self._link.reconnect(generation)
            if done:
                self._reset_pools()
            return done

    def _reset_pools(self) -> None:
        old = (self.pools, self._progress_map)
        self._reset()
        for mapped in old:
            if mapped is not None:
                with contextlib.suppress(Exception):
                    mapped.close()

    # ---- pools ----
    @property
    def config(self) -> HiCacheConfig:
        """The daemon's cache configuration (model shape, page size, pool sizes, policies)."""
        names = {f.name for f in fields(HiCacheConfig)}
        return HiCacheConfig(**{k: v for k, v in self.info["config"].items() if k in names})

    def attach(self) -> AttachedPools:
        """Map the daemon's pools into this process as tensors (same memory, no copy).

        ``pools.k_buffer[layer]`` and ``pools.v_buffer[layer]`` are ``[slots, kv_heads,
        head_dim]`` (MLA: ``pools.kv_buffer[layer]`` of ``[slots, 1, width]``); slot 0 (all of
        page 0) is the padding slot, never handed out."""
        with self._attach_lock:
            if self.pools is None:
                if self.info.get("pools") is None:  # (a daemon for engines, before a layout)
                    raise DaemonError(
                        ErrorCode.NO_LAYOUT,
                        "this daemon (device_tier=engine) has no pool until an engine registers "
                        "its KV layout (register_layout; the vLLM connector and the SGLang "
                        "backend do when the engine starts)",
                    )
                link = self._link
                self.pools = attach_pools(
                    self.config, self.info["pools"], link.daemon_uid, link.trusted
                )
            return self.pools

    def register_layout(self, layout: EngineLayout) -> EngineLayout:
        """For engines that own their device tier (vLLM), with a daemon started with
        ``--device-tier engine``: name this engine rank's KV layout. The first registration
        makes the daemon's pool (the shared host tier, one page per engine block); a later one
        must be equal in identity (``EngineLayout.identity``). Returns the layout the daemon
        serves; ``config`` and ``attach()`` then describe the pool. Raises LayoutMismatch
        (naming both layouts) and changes nothing when it differs. The first registration
        makes the pool (gigabytes reserved in shared memory: seconds), so while the daemon
        serves no layout yet this call waits up to REGISTER_TIMEOUT_S, not the client's
        timeout (a later one only compares layouts)."""
        fields = RegisterRequest(layout.as_dict()).fields()
        timeout = self._link.timeout_s
        if self.layout is None:  # (as hello said: this REGISTER may make the pool)
            timeout = max(REGISTER_TIMEOUT_S, timeout)
        reply = RegisterReply.read(self._link.call(Op.REGISTER, fields, (), timeout)[0].fields)
        with self._attach_lock:
            self._link.info.update(reply.fields())
            if self.pools is None:  # (a pool already mapped stays: the daemon has one pool)
                self._reset()
        return EngineLayout.from_dict(reply.layout)

    @property
    def layout(self) -> EngineLayout | None:
        """The KV layout the daemon serves (device_tier=engine), None before a registration."""
        raw = self.info.get("layout")
        return None if raw is None else EngineLayout.from_dict(raw)

    # ---- cache operations ----
    def match_prefix(
        self, token_ids: Any, namespace: Any = None, lock: bool = True, l3_wait: bool = True
    ) -> Match:
        """The longest cached prefix of ``token_ids`` (whole pages) on the device and, after
        it, on the host. ``lock=True`` (the default): the device prefix stays valid for this
        session until ``release(match)``; without a lock its slots may be reused at any time.
        A match that found nothing on either tier holds no lock (``lock_id`` 0: releasing it
        is a no-op). With a third tier, ``l3_wait=True`` lets the reply wait (up to the
        daemon's prefetch bound) for pages coming from it; ``l3_wait=False`` never waits, and
        ``match.l3_pending`` says more is coming (a later match finds it).

        A full hit covers every whole page of the prompt: an engine that must compute at least
        one token backs off a whole page (uses ``device_indices[:-page_size]``). Raises
        ValueError for token ids that are not non-negative int32 integers (floats, bools,
        ids >= 2**31, nested lists)."""
        tokens = as_tokens(token_ids)
        fields = MatchRequest([len(tokens)], None, [namespace], lock, l3_wait=l3_wait).fields()
        return self._matches(fields, [tokens])[1][0]

    def note_engine(self, queried: int = 0, hit: int = 0, loaded: int = 0) -> None:
        """An engine with a prefix cache of its own (vLLM) counts its lookups as it does:
        ``queried`` tokens asked beyond its own hit, ``hit`` of them found in hicache, and
        ``loaded`` tokens it copied from the pool itself. The heartbeat reports them (within
        about 2 s), the goodbye what is left; the daemon shows them as ``engine_*_tokens``
        (daemon/requests/engine_counts.py). Any thread. ValueError for what is not a count."""
        for name, value in (("queried", queried), ("hit", hit), ("loaded", loaded)):
            if type(value) is not int or not 0 <= value < ENGINE_REPORT_MAX:
                raise ValueError(f"{name}: a count of tokens below 2**48, got {value!r}")
        if hit > queried:
            raise ValueError(f"hit ({hit}) is more than queried ({queried})")
        self._link.note_engine(queried, hit, loaded)

    def match_batch(
        self, batch: list, namespaces: list | None = None, lock: bool = True
    ) -> list[Match]:
        """``match_prefix`` for many prompts (up to 1024) in one round trip, or a few: a daemon
        that other requests wait on answers a long batch in parts (its first prompts), and the
        rest is asked again. A part that fails releases what the parts before it locked; parts
        answered in two sessions (another thread reconnected between them) raise LeaseLost, the
        new session's locks released, as one request's answer is never split that way."""
        return self._match_parts(batch, namespaces, lock, None)

    def match_and_alloc(self, token_ids: Any, namespace: Any = None) -> tuple[Match, torch.Tensor]:
        """A store's first step in one round trip: ``match_prefix`` without a lock, and the
        slots for the tokens of ``token_ids`` past its device hit (whole pages, this session's
        as ``alloc`` gives them). Write their KV, then ``insert`` the sequence with the match's
        device slots and these (a prefix evicted meanwhile fails that insert: free the slots).
        Raises as ``alloc`` does (OUT_OF_MEMORY, QUOTA_EXCEEDED), with nothing allocated."""
        return self.match_and_alloc_batch([token_ids], [namespace])[0]

    def match_and_alloc_batch(
        self, batch: list, namespaces: list | None = None
    ) -> list[tuple[Match, torch.Tensor]]:
        """``match_and_alloc`` for many sequences (``match_batch``'s rules); a part that fails
        frees the slots the parts before it got."""
        rests: list[torch.Tensor] = []
        matches = self._match_parts(batch, namespaces, False, rests)
        return list(zip(matches, rests, strict=True))

    def _match_parts(
        self, batch: list, namespaces: list | None, lock: bool, rests: list | None
    ) -> list[Match]:
        """MATCH over ``batch`` in as many parts as the daemon answers; ``rests`` (a list):
        with ``alloc_rest``, each sequence's new slots are appended to it."""
        arrays = [as_tokens(t) for t in batch]
        spaces = namespaces or [None] * len(arrays)
        lengths = [len(a) for a in arrays]
        # a prefix shared with the previous prompt (a system prompt) travels once
        frame, shared = pack_shared(arrays)
        part, start, pos = frame, 0, 0  # this part's frame, first prompt, offset in ``frame``
        matches: list[Match] = []
        try:
            while True:
                fields = MatchRequest(
                    lengths[start:],
                    [0, *shared[start + 1 :]] if any(shared[start + 1 :]) else None,
                    spaces[start:],
                    lock,
                    alloc_rest=rests is not None,
                ).fields()
                reply, got, out = self._matches_and_frames(fields, [part])
                if rests is not None:
                    rests += _rest_slots(out[1], reply.rest_pages or [], got, lengths[start:],
                                         self._page_size)  # fmt: skip
                matches += got
                if matches and got and got[0].generation != matches[0].generation:
                    raise LeaseLost(
                        ErrorCode.LEASE_EXPIRED,
                        "the session changed while a batched match was answered in parts "
                        "(another thread reconnected): its first matches are void",
                    )
                if len(matches) >= len(arrays):
                    return matches
                if not got:
                    raise DaemonError(ErrorCode.INTERNAL, "a batched match answered none")
                # the rest: its first prompt's shared head put back before its own tokens
                end = len(matches)
                pos += 4 * (sum(lengths[start:end]) - sum(shared[start:end]))
                start = end
                part = arrays[start][: shared[start]].tobytes() + frame[pos:]
        except BaseException:
            with contextlib.suppress(Exception):  # (a daemon gone took its locks with it)
                self.release(*[m for m in matches if m.lock_id])
                if rests:
                    self.free(torch.cat(rests))
            raise

    def _matches(self, fields: dict, frames: list, op: Op = Op.MATCH) -> tuple[dict, list[Match]]:
        """A request answered in MATCH's form: (the reply's fields, its Matches)."""
        reply, out = self._call(op, fields, frames)
        return reply.fields, self._read_matches(MatchReply.read(reply.fields), out)

    def _matches_and_frames(
        self, fields: dict, frames: list, op: Op = Op.MATCH
    ) -> tuple[MatchReply, list[Match], list]:
        reply, out = self._call(op, fields, frames)
        read = MatchReply.read(reply.fields)
        return read, self._read_matches(read, out), out

    def _read_matches(self, reply: MatchReply, out: list) -> list[Match]:
        frame = PageFrame(out[0], reply.chunk_pages, self._page_size)
        gen = self._link.generation
        matches = [
            Match(frame, e.chunks, e.device_len, e.host_len, e.lock_id, gen) for e in reply.results
        ]
        for i in reply.l3_pending:
            matches[i].l3_pending = True
        return matches

    def load_back(self, match: Match) -> torch.Tensor | None:
        """Load the host part of a locked match onto the device and wait for it. Returns the
        device slots of that part (in token order, right after ``match.device_indices``; the
        match's lock now covers them too), or None when it stays on the host: nothing there,
        too short to be worth it (load_back_threshold), no room, or the copy failed (treat it
        as a miss and recompute)."""
        if not match.host_hit_length:
            return None
        match.check_locked()
        reply, out = self._call(Op.LOAD_BACK, LoadRequest(match.lock_id).fields())
        return _slots(out[0]) if LoadReply.read(reply.fields).loaded else None

    def load_back_async(self, match: Match) -> LoadTicket | None:
        """Start loading the host part of a locked match and return at once; read layer i only
        after ``wait_layer(ticket, i)``. None when it stays on the host."""
        if not match.host_hit_length:
            return None
        match.check_locked()
        self._progress()  # mapped now, while the daemon is known to be there
        reply, out = self._call(Op.LOAD_BACK, LoadRequest(match.lock_id, wait=False).fields())
        load = LoadReply.read(reply.fields)
        if not load.loaded:
            return None
        layers = int(self.info["config"]["num_layers"])
        return LoadTicket(_slots(out[0]), int(load.ticket), layers, tuple(load.events or ()))

    def wait_layer(self, load: LoadTicket, layer: int, timeout: float | None = None) -> None:
        """Block until ``layer`` of ``load`` is on the device, read from the daemon's shared
        progress table (no message). Raises LoadFailed when the copy failed (recompute the
        prefix), DaemonTimeout after ``timeout`` or when the daemon stops answering (checked
        every LIVENESS_S), EpochChanged or LeaseLost.

        CUDA pools: when the daemon sent the layer's IPC event, the current CUDA stream waits on
        it instead (on the GPU; this call returns at once and later kernels see the layer)."""
        if not load.ticket:
            return
        if load.events and self._stream_waits(load.events[layer]):
            return
        table = self._progress()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            step = LIVENESS_S if deadline is None else max(0.0, deadline - time.monotonic())
            if table.wait_layer(load.ticket, layer, min(step, LIVENESS_S)):
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise DaemonTimeout(f"layer {layer} of load {load.ticket} not ready in {timeout} s")
            self._link.check_alive()

    def _stream_waits(self, handle: bytes) -> bool:
        try:
            device = torch.device(self.info["config"]["device"])
            event = torch.cuda.Event.from_ipc_handle(device, handle)
        except (RuntimeError, AssertionError):  # the load finished and its event is gone
            return False
        torch.cuda.current_stream(device).wait_event(event)
        return True

    def wait_load(self, load: LoadTicket, timeout: float | None = None) -> None:
        """Block until every layer of ``load`` is on the device (see wait_layer)."""
        self.wait_layer(load, load.num_layers - 1, timeout)

    def _progress(self) -> LayerProgress:
        if self._progress_table is None:
            desc = self.info["pools"].get("progress")
            if desc is None:
                raise RuntimeError("this daemon shares no layer-progress table")
            layers = int(self.info["config"]["num_layers"])
            try:
                self._progress_map, self._progress_table = attach_progress(
                    desc, layers, self._link.daemon_uid, self._link.trusted
                )
            except FileNotFoundError:  # the daemon is gone (or another life runs)
                self._link.check_alive()
                raise DaemonTimeout("the daemon's layer-progress table is gone") from None
        return self._progress_table

    def alloc(self, num_tokens: int, *, pages: bool = False) -> torch.Tensor:
        """``num_tokens`` device slots, now owned by this session (whole pages: the rest of the
        last page is yours too, but only these slots are returned). Evicts unlocked cache when
        the pool is short. Raises OUT_OF_MEMORY (the text says what holds the pool) or
        QUOTA_EXCEEDED (this session owns too much already). Give them back with ``insert``
        (the daemon then owns them) or ``free``. ``pages``: the page ids instead, in order
        (ceil(num_tokens / page_size) of them: page p holds slots p * page_size onwards), for
        ``insert(..., pages=True)`` and ``free(..., pages=True)``."""
        return _slots(self._call(Op.ALLOC, AllocRequest(num_tokens, pages).fields())[1][0])

    def alloc_extend(self, prefix_lens: Any, seq_lens: Any, last_loc: Any) -> torch.Tensor:
        """SGLang's alloc_extend: slots for tokens [prefix_len, seq_len) of each request,
        concatenated; ``last_loc`` is the slot of each request's last prefix token (-1 when
        its prefix is empty). A request that continues a partly filled page must own it, and
        its last_loc must be at offset ``(prefix_len - 1) % page_size`` (BAD_FIELD/NOT_OWNED
        otherwise). The new slots are this session's."""
        frames = [slots_frame(as_slots(x, n)) for x, n in _named(prefix_lens, seq_lens, last_loc)]
        return _slots(self._call(Op.ALLOC_EXTEND, None, frames)[1][0])

    def alloc_decode(self, seq_lens: Any, last_loc: Any) -> torch.Tensor:
        """SGLang's alloc_decode: one slot per request for its token ``seq_len - 1``: the slot
        after ``last_loc`` in the same page, or the first slot of a new page. The same
        ownership and offset rules as alloc_extend."""
        frames = [slots_frame(as_slots(seq_lens, "seq_lens")), slots_frame(as_slots(last_loc))]
        return _slots(self._call(Op.ALLOC_DECODE, None, frames)[1][0])

    def free(self, slots: Any, *, pages: bool = False) -> None:
        """Give back slots this session owns (every page they touch is freed). Raises NOT_OWNED
        for the padding slot, a double free, or slots of the tree or of another session, and
        then frees nothing. ``pages``: ``slots`` holds page ids."""
        frame = slots_frame(as_slots(slots, "pages" if pages else "slots"))
        self._call(Op.FREE, FreeRequest(pages).fields(), [frame])

    def insert(
        self,
        token_ids: Any,
        slots: Any,
        namespace: Any = None,
        replaces: Match | None = None,
        *,
        pages: bool = False,
    ) -> int:
        """Hand a finished sequence to the cache: ``slots[i]`` holds the KV of token i (the
        match's prefix slots, then this session's own). Returns how many leading tokens were
        cached already (by anyone).

        After insert the daemon owns every slot passed: new whole pages join the tree; pages
        duplicating tokens cached meanwhile and the unaligned tail page are freed. Do not
        use or free any of these slots afterwards (a request that decodes on uses
        ``insert_and_lock`` instead). KV must be fully written (the stream synchronized)
        before insert: a backup may start at once. Raises NOT_OWNED (nothing inserted) for
        slots that are neither this session's nor the tree's own at their place. ``replaces``:
        a locked Match released in the same round trip once the insert succeeded (the
        request's match, when it ends). ``pages``: ``slots`` holds page ids instead, one per
        ``page_size`` tokens (the last may be partly filled; a match's ``device_pages``, then
        ``alloc(..., pages=True)``'s): ``page_size`` times fewer bytes on the wire."""
        fields, frames = _insert_request([(token_ids, slots)], [namespace], self._paged(pages))
        _replacing(fields, replaces, self._link.generation)
        prefix_lens = InsertReply.read(self._call(Op.INSERT, fields, frames)[0].fields).prefix_lens
        if replaces is not None:
            replaces.mark_released()
        return prefix_lens[0]

    def _paged(self, pages: bool) -> int:
        """The page size when a request's second array holds page ids (0: slots)."""
        return self._page_size if pages else 0

    def insert_batch(self, pairs: list, namespaces: list | None = None) -> list[int]:
        """``insert`` for many sequences in one round trip. Sequences before a bad one stay
        inserted."""
        fields, frames = _insert_request(pairs, namespaces)
        return InsertReply.read(self._call(Op.INSERT, fields, frames)[0].fields).prefix_lens

    def insert_and_lock(
        self,
        token_ids: Any,
        slots: Any,
        namespace: Any = None,
        replaces: Match | None = None,
        *,
        pages: bool = False,
    ) -> Inserted:
        """Insert an unfinished request (SGLang's cache_unfinished_req) and lock what is now
        cached, atomically: only whole pages are inserted; the slots of the partial tail page
        stay this session's (go on decoding into them). Returns the already-cached length and
        a locked Match whose ``device_indices`` are the slots to use for the whole-page prefix
        from now on: where another engine cached the same tokens first, they are its slots,
        and this session's duplicates were freed. Release the match (and any earlier one) as
        usual; insert again when the request finishes. ``replaces``: an earlier locked Match
        of this request released in the same round trip once the insert succeeded (it is
        left locked when the insert fails). ``pages``: as for ``insert``."""
        fields, frames = _insert_request([(token_ids, slots)], [namespace], self._paged(pages))
        fields["lock"] = True  # (InsertRequest.lock)
        _replacing(fields, replaces, self._link.generation)
        reply, matches = self._matches(fields, frames, Op.INSERT)
        if replaces is not None:
            replaces.mark_released()
        return Inserted(InsertReply.read(reply).prefix_lens[0], matches[0])

    def release(self, *matches: Match, wait: bool = True) -> None:
        """Unlock matches (their slots may be reused at once: a released Match refuses to hand
        out its slots). Matches without a lock are skipped; releasing one twice raises
        NOT_OWNED. ``wait=False``: after reading under the lock, when the session's lease
        surely still holds (what was read was locked all along), the request is sent and not
        waited for, and an error it meets is not raised; otherwise it is waited for as usual,
        and LeaseLost then says that the lock may have lapsed during the read."""
        live = [m for m in matches if m.generation == self._link.generation]  # others: void
        ids = [m.lock_id for m in live if m.lock_id]
        if ids and (wait or not self._link.lease_holds()):
            self._call(Op.RELEASE, ReleaseRequest(ids).fields())
        elif ids:
            self._link.post(Op.RELEASE, ReleaseRequest(ids).fields())
        for m in matches:
            m.mark_released()

    def lock(self, match: Match) -> Match:
        """A second lock on the same prefix (another thread's or request's own), released on
        its own with ``release``. A match that found nothing holds no lock and needs none:
        it is returned as it is."""
        if not (match.lock_id or match.device_hit_length or match.host_hit_length):
            match.check_live()
            return match
        match.check_locked()
        reply = self._call(Op.LOCK, LockRequest(match.lock_id).fields())[0]
        return match.relocked(LockReply.read(reply.fields).lock_id)

    def holdings(self) -> Holdings:
        """What this session holds in the daemon: its lock ids and its owned slots (one per
        owned page's first slot: free() of them frees those pages)."""
        reply, out = self._call(Op.HOLDINGS)
        pages = np.frombuffer(out[0].buffer, dtype=np.int64)
        held = HoldingsReply.read(reply.fields)
        return Holdings(list(held.lock_ids), torch.from_numpy(pages * self._page_size))

    def release_all(self) -> None:
        """Release every lock of this session (every thread's): after cancelled calls, or to
        start over. Matches of this session then hand out nothing valid: drop them."""
        self._call(Op.RELEASE, ReleaseRequest(all=True).fields())

    def evict(self, device_tokens: int = 0, host_tokens: int = 0, disk_tokens: int = 0) -> dict:
        """Admin: evict at least this many unlocked tokens from each tier (FORBIDDEN unless the
        client was opened with admin=True); ``disk_tokens``: the disk's least recently used
        pages, about that many tokens (``disk_freed``; -1: it happens once the disk's running
        call ends). Returns the tokens freed per tier."""
        fields = EvictRequest(device_tokens, host_tokens, disk_tokens).fields()
        return FreedReply.read(self._call(Op.EVICT, fields)[0].fields).fields()

    def flush(self, disk: bool = False) -> dict:
        """Admin: evict every unlocked token from both tiers (locked prefixes stay); ``disk``:
        the daemon's disk tier forgets everything too (``disk_freed``: its tokens; -1: it
        happens once the disk's running call ends)."""
        fields = FlushRequest(disk).fields()
        return FreedReply.read(self._call(Op.FLUSH, fields)[0].fields).fields()

    def stats(self, check: bool = False) -> dict:
        """The daemon's counters and pool figures; ``check=True`` also runs its integrity check
        (``integrity: ok`` or what broke)."""
        return self._call(Op.STATS, StatsRequest(check).fields())[0].fields

    def tree(self, max_nodes: int = 1000) -> dict:
        """A bounded dump of the tree's nodes (for debugging)."""
        return self._call(Op.TREE, TreeRequest(max_nodes).fields())[0].fields

    def ping(self) -> dict:
        return PingReply.read(self._call(Op.PING)[0].fields).fields()

    # ---- lifetime ----
    def close(self, stopping: bool = False) -> None:
        """From any thread: calls still in flight end with ClientClosed, the daemon is told
        goodbye (it frees what this session still holds), the pools are unmapped. Later calls
        raise ClientClosed; closing twice does nothing. ``stopping=True``: this process is
        stopping and copies it started may still write the session's pages (a signal handler):
        the daemon holds them for its quarantine time, then frees them."""
        if stopping and self._finalizer.alive:
            self._finalizer.detach()
            self._link.close(stopping=True)
        self._finalizer()  # SessionLink.close, once
        with self._attach_lock:
            for mapped in (self.pools, self._progress_map):
                if mapped is not None:
                    with contextlib.suppress(Exception):  # a tensor still views it: left mapped
                        mapped.close()
            self.pools = self._progress_map = self._progress_table = None

    def __enter__(self) -> HiCacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _rest_slots(
    frame: Any, counts: list[int], matches: list[Match], lengths: list[int], page_size: int
) -> list[torch.Tensor]:
    """Each answered sequence's new slots from an ``alloc_rest`` reply: its pages expanded,
    the last one cut to the sequence's end."""
    pages = np.frombuffer(frame.buffer, dtype=np.int64) if counts and sum(counts) else None
    out, at = [], 0
    offsets = np.arange(page_size, dtype=np.int64)
    for m, n, count in zip(matches, lengths, counts, strict=False):
        if count:
            assert pages is not None  # (a count: sum(counts) > 0)
            run = pages[at : at + count]
        else:
            run = np.empty(0, np.int64)
        at += count
        slots = (run[:, None] * page_size + offsets).reshape(-1)[: n - m.device_hit_length]
        out.append(torch.from_numpy(slots))
    return out


def _named(prefix_lens: Any, seq_lens: Any, last_loc: Any) -> list[tuple[Any, str]]:
    return [(prefix_lens, "prefix_lens"), (seq_lens, "seq_lens"), (last_loc, "last_loc")]


def _replacing(fields: dict, replaces: Match | None, generation: int) -> None:
    """An INSERT that releases ``replaces`` once it succeeded (a void Match: nothing)."""
    if replaces is not None and replaces.generation == generation and replaces.lock_id:
        replaces.check_locked()
        fields["release"] = [replaces.lock_id]  # (InsertRequest.release)


def _insert_request(pairs: list, namespaces: list | None, page_size: int = 0) -> tuple[dict, list]:
    """INSERT's fields and frames; ``page_size`` (not 0): the second arrays are page ids."""
    what = "pages" if page_size else "slots"
    tokens = [as_tokens(t) for t, _ in pairs]
    slots = [as_slots(s, what) for _, s in pairs]
    for i, (t, s) in enumerate(zip(tokens, slots, strict=True)):
        want = -(-len(t) // page_size) if page_size else len(t)
        if len(s) != want:
            raise ValueError(
                f"insert: sequence {i} has {len(t)} token ids, so {want} {what}, not {len(s)}"
            )
    spaces = namespaces or [None] * len(pairs)
    fields = InsertRequest([len(t) for t in tokens], spaces, pages=bool(page_size)).fields()
    frames = [tokens_frame(np.concatenate(tokens)), slots_frame(np.concatenate(slots))]
    return fields, frames
