"""EventPublisher: KV events on the wire exactly as vLLM publishes them, for KV-aware routers.

- **Stream**: a PUB socket (``--events-endpoint``) sends ``(topic, seq, payload)``: ``seq`` an
  8-byte big-endian counter from 0, ``payload`` a msgpack ``[ts, [event, ...]]`` (vLLM's
  ``KVEventBatch``: an array), each event a map tagged ``{"type": "BlockStored", ...}``.
- **Replay** (``--events-replay-endpoint``, a ROUTER, as vLLM's): a DEALER or REQ peer sends
  ``start_seq`` (8 bytes, big-endian) and gets ``(topic, seq, payload)`` for every batch still
  buffered (the last ``--events-buffer``) from ``start_seq`` on, then ``(b"", -1, b"")``.
- **Full dump** (our addition, for a consumer late to the stream or whose replay came back
  with a gap): it sends ``b"dump"`` instead and gets ``BlockStored`` batches of everything the
  tiers hold now, each framed as ``(topic, next_seq, payload)``, then the same end marker;
  ``next_seq`` is the first live batch the dump does not include (apply live batches from it).

The control thread encodes each batch and hands it to the publisher thread through an inproc
pipe (never blocking: when that thread is hopelessly behind the batch is dropped and
counted, a gap a consumer sees in ``seq``). The publisher thread owns the PUB and ROUTER
sockets; PUB drops what a slow subscriber does not take (its high-water mark), so no
subscriber ever slows the daemon. A dump is made by the control thread (it owns the tree),
asked for by the publisher thread through ``dumps_wanted`` (bounded), at most one a second,
and one dump answers every peer that asked. What peers send is small (subscriptions, a replay
or dump ask): frames of at most MAX_ASK_BYTES, and on tcp at most PEER_SENDS unread per
connection (wire_watch.py; the stream's subscriptions count, as zmq takes them itself).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from hicache.daemon.transport import WireWatch, connections_allowed
from hicache.observe import AllBlocksCleared, BlockRemoved, BlockStored, Event

log = logging.getLogger("hicache.daemon.events")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
DUMP = b"dump"
PIPE_HWM = 100_000  # batches the control thread may run ahead of the publisher thread
PUB_HWM = 100_000  # batches queued per subscriber before PUB drops them for it
DUMP_EVENTS = 512  # events per dump batch
MAX_DUMP_ASKS = 1024  # dump requests waiting at once
POLL_MS = 100
WATCH_POLL_MS = 20  # ... with tcp sockets to watch: what a peer sends meanwhile is not bounded
MAX_ASK_BYTES = 4096  # a frame a peer sends (a subscription, an ask)
ASKS_QUEUED = 16  # replay asks queued per peer (RCVHWM)
PEER_SENDS = 1 << 20  # on tcp, bytes one connection may send that no read took (see above)
PEERS_SEND = 64 << 20  # ... every connection of one socket together
MAX_PEERS = 512  # tcp connections one event socket keeps


def encode_event(event: Event) -> dict[str, Any]:
    """One event as vLLM's tagged map (every field its decoder requires, None where unused)."""
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": None,
            "medium": event.medium,
            "lora_name": None,
        }
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": event.block_hashes, "medium": event.medium}
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {event!r}")


def encode_batch(events: list[Event], ts: float | None = None) -> bytes:
    return msgpack.packb([time.time() if ts is None else ts, [encode_event(e) for e in events]])


class EventPublisher:
    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_batches: int = 10_000,
        secure: Callable[[zmq.Socket], None] | None = None,
    ):
        self.topic = topic.encode()
        self.next_seq = 0  # the seq of the next batch (assigned on the control thread)
        self.dropped_batches = 0  # batches the publisher thread could not take
        self.published_batches = 0
        # peers asking for a dump (a bounded queue: beyond it, the oldest asks are dropped)
        self.dumps_wanted: collections.deque[bytes] = collections.deque(maxlen=MAX_DUMP_ASKS)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=buffer_batches
        )
        pipe = f"inproc://hicache-events-{id(self)}"
        self._pull = ctx.socket(zmq.PULL)
        self._pull.bind(pipe)
        self._push = ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, PIPE_HWM)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(pipe)
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, PUB_HWM)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.MAXMSGSIZE, MAX_ASK_BYTES)
        self._replay: zmq.Socket | None = None
        self._watches: list[WireWatch] = []  # tcp sockets' (used by the publisher thread)
        self._replay_watch: WireWatch | None = None
        try:
            if secure is not None:  # CurveZMQ: token ids are what prompts say
                secure(self._pub)
            self._watch(self._pub, endpoint, secure is not None, "KV event stream")
            self._pub.bind(endpoint)
            if replay_endpoint:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.MAXMSGSIZE, MAX_ASK_BYTES)
                self._replay.setsockopt(zmq.RCVHWM, ASKS_QUEUED)
                if secure is not None:
                    secure(self._replay)
                self._replay_watch = self._watch(
                    self._replay, replay_endpoint, secure is not None, "KV event replay"
                )
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = (
            None if self._replay is None else self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        )
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hicache-events", daemon=True)
        self._thread.start()

    # ---- control thread -------------------------------------------------------------------
    def publish(self, events: list[Event]) -> None:
        """Send one batch (never blocks; a batch the publisher thread cannot take is dropped)."""
        if not events:
            return
        seq = self.next_seq
        self.next_seq += 1
        try:
            self._push.send_multipart(
                [b"E", seq.to_bytes(8, "big"), encode_batch(events)], zmq.NOBLOCK
            )
            self.published_batches += 1
        except zmq.Again:
            self.dropped_batches += 1

    def send_dump(self, peers: list[bytes], events: list[Event]) -> None:
        """Answer the dump requests of ``peers`` with ``events`` (everything the tiers hold,
        made right after the last publish()), encoded once for all."""
        ts = time.time()
        payloads = [
            encode_batch(events[i : i + DUMP_EVENTS], ts)
            for i in range(0, len(events), DUMP_EVENTS)
        ]
        try:
            self._push.send_multipart(
                [b"D", msgpack.packb(peers), self.next_seq.to_bytes(8, "big"), *payloads],
                zmq.NOBLOCK,
            )
        except zmq.Again:
            self.dropped_batches += 1

    def close(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=2)
        self._close_sockets()
        for endpoint in (self.endpoint, self.replay_endpoint):  # zmq leaves ipc files behind
            if endpoint and endpoint.startswith("ipc://"):
                path = endpoint[len("ipc://") :]
                with contextlib.suppress(OSError):
                    if stat.S_ISSOCK(os.lstat(path).st_mode):
                        os.unlink(path)

    def connections_closed(self) -> int:
        """tcp connections shut down for sending more than PEER_SENDS unread."""
        return sum(w.closed for w in self._watches)

    def _watch(self, sock: zmq.Socket, endpoint: str, curve: bool, name: str) -> WireWatch | None:
        if not endpoint.startswith("tcp://"):
            return None
        most = connections_allowed(0.25, MAX_PEERS)  # (the control socket: half)
        watch = WireWatch(sock, curve, name, PEER_SENDS, PEERS_SEND, most)
        self._watches.append(watch)
        return watch

    def _close_sockets(self) -> None:
        for watch in self._watches:
            watch.close()
        self._watches = []
        for sock in (self._push, self._pull, self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)

    # ---- publisher thread -----------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        timeout = WATCH_POLL_MS if self._watches else POLL_MS
        while not self._stopping.is_set():
            try:
                ready = dict(poller.poll(timeout))
                for watch in self._watches:
                    watch.maybe_check()
                if self._pull in ready:
                    for _ in itertools.repeat(None, 1024):  # a bounded burst, then the replay
                        try:
                            self._forward(self._pull.recv_multipart(zmq.NOBLOCK))
                        except zmq.Again:
                            break
                if self._replay is not None and self._replay in ready:
                    self._serve_request(self._read_ask())
            except zmq.ZMQError as exc:  # the context is ending
                if not self._stopping.is_set():
                    log.warning("event publisher: %s", exc)
                return
            except Exception:  # never let a peer's bad request end the stream
                log.exception("event publisher")

    def _forward(self, frames: list[bytes]) -> None:
        if frames[0] == b"E":
            seq, payload = frames[1], frames[2]
            self._send(self._pub, [self.topic, seq, payload])
            self._buffer.append((int.from_bytes(seq, "big"), payload))
        elif frames[0] == b"D":
            seq = frames[2]
            for peer in msgpack.unpackb(frames[1]):  # every peer's copy is the same buffer
                for payload in frames[3:]:
                    self._send(self._replay, [peer, b"", self.topic, seq, payload])
                self._send(self._replay, [peer, b"", b"", END_SEQ, b""])

    def _read_ask(self) -> list[bytes]:
        assert self._replay is not None  # (asked only on the replay socket)
        frames = self._replay.recv_multipart(copy=False)
        if self._replay_watch is not None:
            self._replay_watch.took(frames[0], frames[1:])
        return [f.bytes for f in frames]

    def _serve_request(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            return
        peer, request = frames[0], frames[-1]
        if request == DUMP:
            self.dumps_wanted.append(peer)
            return
        if len(request) == 8:
            start = int.from_bytes(request, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._send(
                        self._replay, [peer, b"", self.topic, seq.to_bytes(8, "big"), payload]
                    )
        self._send(self._replay, [peer, b"", b"", END_SEQ, b""])  # also the answer to nonsense

    @staticmethod
    def _send(sock: zmq.Socket | None, frames: list[bytes]) -> None:
        """Without copying payloads: the replies a dump or replay queues for many peers that
        read slowly (or never) share the buffers instead of holding one copy each."""
        if sock is None:
            return
        try:
            last = len(frames) - 1
            for i, frame in enumerate(frames):
                flags = (zmq.SNDMORE if i < last else 0) | zmq.NOBLOCK
                sock.send(frame, flags, copy=len(frame) < zmq.COPY_THRESHOLD)
        except zmq.Again:  # a peer that does not read loses what it does not take (zmq
            pass  # checks the high-water mark at a message's first frame: all or nothing)
