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
from dataclasses import fields
from typing import Any, NamedTuple

import numpy as np
import torch

from hicache.backing import AttachedSharedMemory
from hicache.client.connection import (
    ClientClosed,
    Connection,
    DaemonError,
    DaemonTimeout,
    EpochChanged,
    LeaseLost,
    hello_fields,
)
from hicache.client.pools import AttachedPools, attach_pools, attach_progress
from hicache.client.results import LoadTicket, Match, PageFrame
from hicache.config import HiCacheConfig
from hicache.endpoints import env_endpoint
from hicache.fastpath import pack_shared
from hicache.progress import LayerProgress
from hicache.protocol import (
    DEFAULT_TIMEOUT_S,
    HEARTBEAT_INTERVAL_S,
    ErrorCode,
    Op,
    decode_slots,
    slots_frame,
    tokens_frame,
)
from hicache.tokens import as_slots, as_tokens

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


class HiCacheClient:
    """One session with the daemon. Not thread-safe: one thread calls it (see the README)."""

    def __init__(
        self,
        endpoint: str | None = None,
        name: str = "engine",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        heartbeat: bool = True,
        admin: bool = False,
    ):
        """Open a session (hello). ``admin=True``: this session may also flush and evict for
        everyone (operators' tools; engines never need it); it reads the daemon's admin token
        from the file ``hicache.endpoints.admin_token_path(endpoint)`` names (PermissionError
        when this user cannot)."""
        self.endpoint = endpoint or env_endpoint()
        self.timeout_s = timeout_s
        self.conn = Connection(self.endpoint, timeout_s)
        self.conn.on_late = self._late
        reply, _ = self.conn.call(Op.HELLO, hello_fields(name, admin, self.endpoint))
        self.session = self.conn.session = reply.fields["session"]
        self.info = reply.fields
        self.lease_s = float(self.info["lease_s"])
        self._page_size = int(self.info["config"]["page_size"])
        self.pools: AttachedPools | None = None
        self._progress_map: AttachedSharedMemory | None = None
        self._progress_table: LayerProgress | None = None
        self._lost: DaemonError | None = None  # EpochChanged or LeaseLost, once seen
        self._closed = False
        self._heard = time.monotonic()  # when the daemon last answered this session
        self._owed: list[tuple[Op, dict, list]] = []  # give-backs for late replies
        self._probe: Connection | None = None  # liveness checks without a heartbeat thread
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        if heartbeat:
            self._beat = threading.Thread(
                target=self._heartbeat, daemon=True, name="hicache-heartbeat"
            )
            self._beat.start()

    # ---- calls, liveness ----
    def _call(self, op: Op, fields: dict | None = None, frames: list | tuple = ()) -> tuple:
        """One request on the session; raises what an earlier call or the heartbeat learned
        (EpochChanged, LeaseLost) before sending anything."""
        self._raise_if_lost()
        if self._owed:
            self._give_back_late()
        try:
            reply, out = self.conn.call(op, fields, frames)
        except (EpochChanged, LeaseLost) as exc:
            self._lose(exc)
            raise
        self._heard = time.monotonic()
        return reply, out

    def _raise_if_lost(self) -> None:
        if self._closed:
            raise ClientClosed("this HiCacheClient was closed; open a new one")
        lost = self._lost
        if lost is not None:
            raise type(lost)(lost.code, lost.message)

    def _lose(self, exc: DaemonError) -> None:
        if self._lost is None:
            self._lost = exc

    def _heartbeat(self) -> None:
        # at least three beats per lease, so that one lost beat never ends a live session
        interval = min(HEARTBEAT_INTERVAL_S, self.lease_s / 3)
        conn = Connection(self.endpoint, timeout_s=interval * 2)
        conn.session, conn.epoch = self.session, self.conn.epoch
        try:
            while not self._stop.wait(interval) and self._lost is None:
                try:
                    conn.call(Op.HEARTBEAT)
                    self._heard = time.monotonic()
                except (EpochChanged, LeaseLost) as exc:
                    self._lose(exc)  # every later call raises it; beating on is pointless
                except DaemonError as exc:
                    if exc.code is ErrorCode.UNKNOWN_SESSION:
                        self._lose(LeaseLost(exc.code, exc.message))
                except DaemonTimeout:  # the daemon is busy or gone: calls will tell
                    pass
        finally:
            conn.close()

    def _check_alive(self) -> None:
        """Raise unless the daemon answered within a lease (DaemonTimeout), in this life
        (EpochChanged) and for a session still alive (LeaseLost)."""
        self._raise_if_lost()
        if self._beat is not None and self._beat.is_alive():
            silent = time.monotonic() - self._heard
            if silent > self.lease_s:
                raise DaemonTimeout(f"the daemon has not answered for {silent:.1f} s")
            return
        if self._probe is None:
            self._probe = Connection(self.endpoint, timeout_s=min(self.timeout_s, self.lease_s))
            self._probe.session, self._probe.epoch = self.session, self.conn.epoch
        try:
            self._probe.call(Op.HEARTBEAT)
        except (EpochChanged, LeaseLost) as exc:
            self._lose(exc)
            raise
        self._heard = time.monotonic()

    def _late(self, op: Op, reply: Any, frames: list) -> None:
        """A request that timed out ran after all: give back what its reply brought (called
        inside a later call; the give-back itself waits for the next one)."""
        if op in (Op.MATCH, Op.INSERT):
            ids = [r[2] for r in reply.fields.get("results", ()) if r[2]]
            if ids:
                self._owed.append((Op.RELEASE, {"lock_ids": ids}, []))
        elif op is Op.LOCK and reply.fields.get("lock_id"):
            self._owed.append((Op.RELEASE, {"lock_ids": [reply.fields["lock_id"]]}, []))
        elif op is Op.ALLOC and frames:
            self._owed.append((Op.FREE, {}, [bytes(frames[0].buffer)]))
        elif op in (Op.ALLOC_EXTEND, Op.ALLOC_DECODE) and frames:
            # only the pages it started: a slot continuing a partly filled page shares that
            # page with the request's earlier tokens, which the engine still uses
            slots = np.frombuffer(frames[0].buffer, dtype=np.int64)
            new = slots[slots % self._page_size == 0]
            if len(new):
                self._owed.append((Op.FREE, {}, [new.tobytes()]))

    def _give_back_late(self) -> None:
        owed, self._owed = self._owed, []
        for op, fields_, frames in owed:
            with contextlib.suppress(DaemonError, DaemonTimeout):
                self.conn.call(op, fields_, frames)

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
        if self.pools is None:
            self.pools = attach_pools(self.config, self.info["pools"])
        return self.pools

    # ---- cache operations ----
    def match_prefix(self, token_ids: Any, namespace: Any = None, lock: bool = True) -> Match:
        """The longest cached prefix of ``token_ids`` (whole pages) on the device and, after
        it, on the host. ``lock=True`` (the default): the device prefix stays valid for this
        session until ``release(match)``; without a lock its slots may be reused at any time.

        A full hit covers every whole page of the prompt: an engine that must compute at least
        one token backs off a whole page (uses ``device_indices[:-page_size]``). Raises
        ValueError for token ids that are not non-negative int32 integers (floats, bools,
        ids >= 2**31, nested lists)."""
        tokens = as_tokens(token_ids)
        fields = {"lengths": [len(tokens)], "lock": lock, "namespaces": [namespace]}
        return self._matches(fields, [tokens])[1][0]

    def match_batch(
        self, batch: list, namespaces: list | None = None, lock: bool = True
    ) -> list[Match]:
        """``match_prefix`` for many prompts in one round trip (up to 1024)."""
        arrays = [as_tokens(t) for t in batch]
        fields = {
            "lengths": [len(a) for a in arrays],
            "lock": lock,
            "namespaces": namespaces or [None] * len(arrays),
        }
        # a prefix shared with the previous prompt (a system prompt) travels once
        tokens, shared = pack_shared(arrays)
        if any(shared):
            fields["shared"] = shared
        return self._matches(fields, [tokens])[1]

    def _matches(self, fields: dict, frames: list, op: Op = Op.MATCH) -> tuple[dict, list]:
        """A request answered in MATCH's form: (the reply's fields, its Matches)."""
        reply, out = self._call(op, fields, frames)
        frame = PageFrame(out[0], reply.fields["chunk_pages"], self._page_size)
        matches = [
            Match(frame, ids, dev, host, lock) for dev, host, lock, ids in reply.fields["results"]
        ]
        return reply.fields, matches

    def load_back(self, match: Match) -> torch.Tensor | None:
        """Load the host part of a locked match onto the device and wait for it. Returns the
        device slots of that part (in token order, right after ``match.device_indices``; the
        match's lock now covers them too), or None when it stays on the host: nothing there,
        too short to be worth it (load_back_threshold), no room, or the copy failed (treat it
        as a miss and recompute)."""
        if not match.host_hit_length:
            return None
        match.check_locked()
        reply, out = self._call(Op.LOAD_BACK, {"lock_id": match.lock_id})
        return _slots(out[0]) if reply.fields["loaded"] else None

    def load_back_async(self, match: Match) -> LoadTicket | None:
        """Start loading the host part of a locked match and return at once; read layer i only
        after ``wait_layer(ticket, i)``. None when it stays on the host."""
        if not match.host_hit_length:
            return None
        match.check_locked()
        self._progress()  # mapped now, while the daemon is known to be there
        reply, out = self._call(Op.LOAD_BACK, {"lock_id": match.lock_id, "wait": False})
        if not reply.fields["loaded"]:
            return None
        layers = int(self.info["config"]["num_layers"])
        events = tuple(reply.fields.get("events") or ())
        return LoadTicket(_slots(out[0]), int(reply.fields["ticket"]), layers, events)

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
            self._check_alive()

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
                self._progress_map, self._progress_table = attach_progress(desc, layers)
            except FileNotFoundError:  # the daemon is gone (or another life runs)
                self._check_alive()
                raise DaemonTimeout("the daemon's layer-progress table is gone") from None
        return self._progress_table

    def alloc(self, num_tokens: int) -> torch.Tensor:
        """``num_tokens`` device slots, now owned by this session (whole pages: the rest of the
        last page is yours too, but only these slots are returned). Evicts unlocked cache when
        the pool is short. Raises OUT_OF_MEMORY (the text says what holds the pool) or
        QUOTA_EXCEEDED (this session owns too much already). Give them back with ``insert``
        (the daemon then owns them) or ``free``."""
        return _slots(self._call(Op.ALLOC, {"num_tokens": num_tokens})[1][0])

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

    def free(self, slots: Any) -> None:
        """Give back slots this session owns (every page they touch is freed). Raises NOT_OWNED
        for the padding slot, a double free, or slots of the tree or of another session, and
        then frees nothing."""
        self._call(Op.FREE, None, [slots_frame(as_slots(slots, "slots"))])

    def insert(self, token_ids: Any, slots: Any, namespace: Any = None) -> int:
        """Hand a finished sequence to the cache: ``slots[i]`` holds the KV of token i (the
        match's prefix slots, then this session's own). Returns how many leading tokens were
        cached already (by anyone).

        After insert the daemon owns every slot passed: new whole pages join the tree; pages
        duplicating tokens cached meanwhile and the unaligned tail page are freed. Do not
        use or free any of these slots afterwards (a request that decodes on uses
        ``insert_and_lock`` instead). KV must be fully written (the stream synchronized)
        before insert: a backup may start at once. Raises NOT_OWNED (nothing inserted) for
        slots that are neither this session's nor the tree's own at their place."""
        return self.insert_batch([(token_ids, slots)], [namespace])[0]

    def insert_batch(self, pairs: list, namespaces: list | None = None) -> list[int]:
        """``insert`` for many sequences in one round trip. Sequences before a bad one stay
        inserted."""
        fields, frames = _insert_request(pairs, namespaces)
        return self._call(Op.INSERT, fields, frames)[0].fields["prefix_lens"]

    def insert_and_lock(self, token_ids: Any, slots: Any, namespace: Any = None) -> Inserted:
        """Insert an unfinished request (SGLang's cache_unfinished_req) and lock what is now
        cached, atomically: only whole pages are inserted; the slots of the partial tail page
        stay this session's (go on decoding into them). Returns the already-cached length and
        a locked Match whose ``device_indices`` are the slots to use for the whole-page prefix
        from now on: where another engine cached the same tokens first, they are its slots,
        and this session's duplicates were freed. Release the match (and any earlier one) as
        usual; insert again when the request finishes."""
        fields, frames = _insert_request([(token_ids, slots)], [namespace])
        fields["lock"] = True
        reply, matches = self._matches(fields, frames, Op.INSERT)
        return Inserted(reply["prefix_lens"][0], matches[0])

    def release(self, *matches: Match) -> None:
        """Unlock matches (their slots may be reused at once: a released Match refuses to hand
        out its slots). Matches without a lock are skipped; releasing one twice raises
        NOT_OWNED."""
        ids = [m.lock_id for m in matches if m.lock_id]
        if ids:
            self._call(Op.RELEASE, {"lock_ids": ids})
        for m in matches:
            m.mark_released()

    def evict(self, device_tokens: int = 0, host_tokens: int = 0) -> dict:
        """Admin: evict at least this many unlocked tokens from each tier (FORBIDDEN unless the
        client was opened with admin=True). Returns the tokens freed per tier."""
        fields = {"device_tokens": device_tokens, "host_tokens": host_tokens}
        return self._call(Op.EVICT, fields)[0].fields

    def flush(self) -> dict:
        """Admin: evict every unlocked token from both tiers (locked prefixes stay)."""
        return self._call(Op.FLUSH)[0].fields

    def stats(self, check: bool = False) -> dict:
        """The daemon's counters and pool figures; ``check=True`` also runs its integrity check
        (``integrity: ok`` or what broke)."""
        return self._call(Op.STATS, {"check": check})[0].fields

    def tree(self, max_nodes: int = 1000) -> dict:
        """A bounded dump of the tree's nodes (for debugging)."""
        return self._call(Op.TREE, {"max_nodes": max_nodes})[0].fields

    def ping(self) -> dict:
        return self._call(Op.PING)[0].fields

    # ---- lifetime ----
    def close(self) -> None:
        """Say goodbye (the daemon frees what this session still holds) and disconnect. Later
        calls raise ClientClosed; closing twice does nothing."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        with contextlib.suppress(Exception):  # daemon gone or restarted: nothing to give back
            self.conn.call(Op.GOODBYE)
        if self.pools is not None:
            self.pools.close()
        if self._progress_map is not None:
            self._progress_table = None
            self._progress_map.close()
        if self._probe is not None:
            self._probe.close()
        self.conn.close()

    def __enter__(self) -> HiCacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _named(prefix_lens: Any, seq_lens: Any, last_loc: Any) -> list[tuple[Any, str]]:
    return [(prefix_lens, "prefix_lens"), (seq_lens, "seq_lens"), (last_loc, "last_loc")]


def _insert_request(pairs: list, namespaces: list | None) -> tuple[dict, list]:
    tokens = [as_tokens(t) for t, _ in pairs]
    slots = [as_slots(s, "slots") for _, s in pairs]
    for i, (t, s) in enumerate(zip(tokens, slots, strict=True)):
        if len(t) != len(s):
            raise ValueError(f"insert: sequence {i} has {len(t)} token ids but {len(s)} slots")
    fields = {
        "lengths": [len(t) for t in tokens],
        "namespaces": namespaces or [None] * len(pairs),
    }
    frames = [tokens_frame(np.concatenate(tokens)), slots_frame(np.concatenate(slots))]
    return fields, frames
