"""Connection: one DEALER socket to the daemon, request/reply with timeouts. No API here.

Replies are matched to requests by id; a late reply to a request that timed out is dropped.
Every reply's boot epoch is compared with the one seen first: a restarted daemon raises
EpochChanged, so slot indices from the old daemon are never used.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import Any

import zmq

from hicache.protocol import (
    DEFAULT_TIMEOUT_S,
    ErrorCode,
    Op,
    Reply,
    Request,
    decode_reply,
    encode_request,
)

# The backend's methods with int flags: pyzmq's multipart helpers cost twice as much in Python.
_send, _recv = zmq.backend.Socket.send, zmq.backend.Socket.recv
SNDMORE = int(zmq.SNDMORE)


class DaemonError(RuntimeError):
    """The daemon answered with an error code."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code


class EpochChanged(DaemonError):
    """The daemon restarted: every slot index and lock from before is void."""


class DaemonTimeout(TimeoutError):
    """No reply within the timeout (the daemon is down, or busy for too long)."""


class Connection:
    def __init__(self, endpoint: str, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.endpoint = endpoint
        self.timeout_ms = int(timeout_s * 1000)
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, self.timeout_ms)  # recv raises zmq.Again after it
        self.sock.connect(endpoint)
        self.session = 0  # set by hello
        self.epoch = 0  # the daemon's boot epoch, learned from the first reply
        self._ids = itertools.count(1)
        self._pid = os.getpid()

    def call(
        self, op: Op, fields: dict | None = None, frames: Sequence[Any] = ()
    ) -> tuple[Reply, list[zmq.Frame]]:
        """Send one request and wait for its reply. Raises DaemonError, EpochChanged,
        DaemonTimeout."""
        if os.getpid() != self._pid:
            raise RuntimeError("a Connection cannot be used after fork; make a new one")
        request_id = next(self._ids)
        header = encode_request(Request(op, request_id, self.session, fields or {}))
        self._send(header, frames)
        while True:
            try:
                parts = self._recv()
            except zmq.Again:
                raise DaemonTimeout(f"no reply from {self.endpoint} to {op.name}") from None
            reply = decode_reply(parts[0].buffer)
            if reply.request_id == request_id:
                break  # anything else answers an earlier request that timed out
        if self.epoch and reply.boot_epoch != self.epoch:
            raise EpochChanged(
                ErrorCode.UNKNOWN_SESSION, "the daemon restarted; reconnect and start over"
            )
        self.epoch = self.epoch or reply.boot_epoch
        if not reply.ok:
            raise DaemonError(reply.status, str(reply.fields.get("message", "")))
        return reply, parts[1:]

    def _send(self, header: bytes, frames: Sequence[Any]) -> None:
        sock = self.sock
        _send(sock, header, SNDMORE if frames else 0)
        last = len(frames) - 1
        for i, frame in enumerate(frames):  # zero-copy only where pyzmq says it pays
            _send(sock, frame, SNDMORE if i < last else 0, len(frame) < zmq.COPY_THRESHOLD)

    def _recv(self) -> list[zmq.Frame]:
        """One reply, frames not copied; raises zmq.Again after RCVTIMEO."""
        sock = self.sock  # Frame.more, not getsockopt(RCVMORE): that costs 2 us per frame
        parts = [_recv(sock, 0, False)]
        while parts[-1].more:
            parts.append(_recv(sock, 0, False))
        return parts

    def close(self) -> None:
        self.sock.close(linger=0)
