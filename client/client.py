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

Every method raises DaemonError (with a stable .code), EpochChanged or DaemonTimeout.
A background thread heartbeats so that a live engine keeps its session; when the process dies,
the daemon takes back its locks and slots once the lease runs out.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import fields
from typing import Any

import numpy as np
import torch

from hicache.backing import AttachedSharedMemory
from hicache.client.connection import Connection, DaemonTimeout
from hicache.client.pools import AttachedPools, attach_pools, attach_progress
from hicache.client.results import LoadTicket, Match, PageFrame
from hicache.config import HiCacheConfig
from hicache.endpoints import env_endpoint
from hicache.fastpath import pack_shared
from hicache.progress import LayerProgress
from hicache.protocol import (
    DEFAULT_TIMEOUT_S,
    HEARTBEAT_INTERVAL_S,
    Op,
    decode_slots,
    slots_frame,
    tokens_frame,
)

_TOKEN = np.dtype("<i4")  # token ids travel as int32 little-endian


def _slots(frame: Any) -> torch.Tensor:
    """The slots in a reply frame as a tensor over the frame's own memory (kept alive by it)."""
    buf = frame.buffer
    if len(buf) % 8:
        decode_slots(buf)  # raises with the reason
    if not len(buf):
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(buf, dtype=torch.int64)


class HiCacheClient:
    def __init__(
        self,
        endpoint: str | None = None,
        name: str = "engine",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        heartbeat: bool = True,
    ):
        self.endpoint = endpoint or env_endpoint()
        self.conn = Connection(self.endpoint, timeout_s)
        reply, _ = self.conn.call(Op.HELLO, {"client": name, "pid": os.getpid()})
        self.session = self.conn.session = reply.fields["session"]
        self.info = reply.fields
        self._page_size = int(self.info["config"]["page_size"])
        self.pools: AttachedPools | None = None
        self._progress_map: AttachedSharedMemory | None = None
        self._progress_table: LayerProgress | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        if heartbeat:
            self._beat = threading.Thread(
                target=self._heartbeat, daemon=True, name="hicache-heartbeat"
            )
            self._beat.start()

    def _heartbeat(self) -> None:
        # at least three beats per lease, so that one lost beat never ends a live session
        interval = min(HEARTBEAT_INTERVAL_S, float(self.info["lease_s"]) / 3)
        conn = Connection(self.endpoint, timeout_s=interval * 2)
        conn.session, conn.epoch = self.session, self.conn.epoch
        try:
            while not self._stop.wait(interval):
                # a failed beat is not fatal: the main thread sees the same failure on its next call
                with contextlib.suppress(Exception):
                    conn.call(Op.HEARTBEAT)
        finally:
            conn.close()

    # ---- pools ----
    @property
    def config(self) -> HiCacheConfig:
        names = {f.name for f in fields(HiCacheConfig)}
        return HiCacheConfig(**{k: v for k, v in self.info["config"].items() if k in names})

    def attach(self) -> AttachedPools:
        """Map the daemon's pools into this process as tensors (same memory, no copy)."""
        if self.pools is None:
            self.pools = attach_pools(self.config, self.info["pools"])
        return self.pools

    # ---- cache operations ----
    def match_prefix(self, token_ids: Any, namespace: Any = None, lock: bool = True) -> Match:
        tokens = np.ascontiguousarray(token_ids, dtype=_TOKEN)  # sent as it is: no copy
        fields = {"lengths": [len(tokens)], "lock": lock, "namespaces": [namespace]}
        return self._matches(fields, tokens)[0]

    def match_batch(
        self, batch: list, namespaces: list | None = None, lock: bool = True
    ) -> list[Match]:
        arrays = [np.ascontiguousarray(t, dtype=_TOKEN) for t in batch]
        fields = {
            "lengths": [len(a) for a in arrays],
            "lock": lock,
            "namespaces": namespaces or [None] * len(arrays),
        }
        # a prefix shared with the previous prompt (a system prompt) travels once
        tokens, shared = pack_shared(arrays)
        if any(shared):
            fields["shared"] = shared
        return self._matches(fields, tokens)

    def _matches(self, fields: dict, tokens: Any) -> list[Match]:
        reply, out = self.conn.call(Op.MATCH, fields, [tokens])
        frame = PageFrame(out[0], reply.fields["chunk_pages"], self._page_size)
        return [
            Match(frame, ids, dev, host, lock) for dev, host, lock, ids in reply.fields["results"]
        ]

    def load_back(self, match: Match) -> torch.Tensor | None:
        """Load the host part of a locked match; returns its device slots once they hold the
        data (the lock then covers them too), or None when it stays on the host."""
        if not match.host_hit_length:
            return None
        reply, out = self.conn.call(Op.LOAD_BACK, {"lock_id": match.lock_id})
        return _slots(out[0]) if reply.fields["loaded"] else None

    def load_back_async(self, match: Match) -> LoadTicket | None:
        """Start loading the host part of a locked match and return at once; read layer i only
        after ``wait_layer(ticket, i)``. None when it stays on the host."""
        if not match.host_hit_length:
            return None
        reply, out = self.conn.call(Op.LOAD_BACK, {"lock_id": match.lock_id, "wait": False})
        if not reply.fields["loaded"]:
            return None
        layers = int(self.info["config"]["num_layers"])
        events = tuple(reply.fields.get("events") or ())
        return LoadTicket(_slots(out[0]), int(reply.fields["ticket"]), layers, events)

    def wait_layer(self, load: LoadTicket, layer: int, timeout: float | None = None) -> None:
        """Block until ``layer`` of ``load`` is on the device, read from the daemon's shared
        progress table (no message). Raises DaemonTimeout, or LoadFailed when the copy failed.

        CUDA pools: when the daemon sent the layer's IPC event, the current CUDA stream waits on
        it instead (on the GPU; this call returns at once and later kernels see the layer)."""
        if not load.ticket:
            return
        if load.events and self._stream_waits(load.events[layer]):
            return
        if not self._progress().wait_layer(load.ticket, layer, timeout):
            raise DaemonTimeout(f"layer {layer} of load {load.ticket} not ready in {timeout} s")

    def _stream_waits(self, handle: bytes) -> bool:
        try:
            device = torch.device(self.info["config"]["device"])
            event = torch.cuda.Event.from_ipc_handle(device, handle)
        except (RuntimeError, AssertionError):  # the load finished and its event is gone
            return False
        torch.cuda.current_stream(device).wait_event(event)
        return True

    def wait_load(self, load: LoadTicket, timeout: float | None = None) -> None:
        """Block until every layer of ``load`` is on the device."""
        self.wait_layer(load, load.num_layers - 1, timeout)

    def _progress(self) -> LayerProgress:
        if self._progress_table is None:
            desc = self.info["pools"].get("progress")
            if desc is None:
                raise RuntimeError("this daemon shares no layer-progress table")
            layers = int(self.info["config"]["num_layers"])
            self._progress_map, self._progress_table = attach_progress(desc, layers)
        return self._progress_table

    def alloc(self, num_tokens: int) -> torch.Tensor:
        return _slots(self.conn.call(Op.ALLOC, {"num_tokens": num_tokens})[1][0])

    def alloc_extend(self, prefix_lens: Any, seq_lens: Any, last_loc: Any) -> torch.Tensor:
        frames = [slots_frame(x) for x in (prefix_lens, seq_lens, last_loc)]
        return _slots(self.conn.call(Op.ALLOC_EXTEND, None, frames)[1][0])

    def alloc_decode(self, seq_lens: Any, last_loc: Any) -> torch.Tensor:
        frames = [slots_frame(seq_lens), slots_frame(last_loc)]
        return _slots(self.conn.call(Op.ALLOC_DECODE, None, frames)[1][0])

    def free(self, slots: Any) -> None:
        self.conn.call(Op.FREE, None, [slots_frame(slots)])

    def insert(self, token_ids: Any, slots: Any, namespace: Any = None) -> int:
        return self.insert_batch([(token_ids, slots)], [namespace])[0]

    def insert_batch(self, pairs: list, namespaces: list | None = None) -> list[int]:
        tokens = [np.asarray(t, dtype=np.int32) for t, _ in pairs]
        slots = [np.asarray(s, dtype=np.int64) for _, s in pairs]
        fields = {
            "lengths": [len(t) for t in tokens],
            "namespaces": namespaces or [None] * len(pairs),
        }
        frames = [tokens_frame(np.concatenate(tokens)), slots_frame(np.concatenate(slots))]
        return self.conn.call(Op.INSERT, fields, frames)[0].fields["prefix_lens"]

    def release(self, *matches: Match) -> None:
        ids = [m.lock_id for m in matches if m.lock_id]
        if ids:
            self.conn.call(Op.RELEASE, {"lock_ids": ids})

    def evict(self, device_tokens: int = 0, host_tokens: int = 0) -> dict:
        return self.conn.call(
            Op.EVICT, {"device_tokens": device_tokens, "host_tokens": host_tokens}
        )[0].fields

    def flush(self) -> dict:
        return self.conn.call(Op.FLUSH)[0].fields

    def stats(self, check: bool = False) -> dict:
        return self.conn.call(Op.STATS, {"check": check})[0].fields

    def tree(self, max_nodes: int = 1000) -> dict:
        return self.conn.call(Op.TREE, {"max_nodes": max_nodes})[0].fields

    def ping(self) -> dict:
        return self.conn.call(Op.PING)[0].fields

    # ---- lifetime ----
    def close(self) -> None:
        """Say goodbye (the daemon frees what this session still holds) and disconnect."""
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
        self.conn.close()

    def __enter__(self) -> HiCacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
