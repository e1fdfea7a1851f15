"""Connection: one DEALER socket to the daemon, request/reply with timeouts. No API here.

Replies are matched to requests by id. A request that timed out may still run in the daemon:
its late reply, when it arrives while a later request waits, goes to ``on_late`` (the client
gives back what it brought: a lock, slots), never to the later request.

Every request names the daemon life it belongs to (the boot epoch learned from the first
reply); a restarted daemon refuses it before doing anything, and the client raises
EpochChanged, so slot indices from the old daemon are never used.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from hicache.client.trust import trusted_uids, verify_endpoint
from hicache.curve import CLIENT_KEY_ENV, SERVER_KEY_ENV, apply_client, client_keys
from hicache.endpoints import admin_token_path
from hicache.errors import InvalidIndicesError
from hicache.protocol import (
    DEFAULT_TIMEOUT_S,
    MAX_FRAME_BYTES,
    ErrorCode,
    HelloRequest,
    Op,
    Reply,
    Request,
    decode_reply,
    encode_request,
)

# The backend's methods with int flags: pyzmq's multipart helpers cost twice as much in Python.
_send, _recv = zmq.backend.Socket.send, zmq.backend.Socket.recv
SNDMORE = int(zmq.SNDMORE)
MAX_LATE = 4096  # timed-out requests remembered (whose late replies are given back)
SLICE_MS = 100  # a wait for a reply looks at the client's closing flag this often


class DaemonError(RuntimeError):
    """The daemon answered with an error code."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class NotOwned(DaemonError, InvalidIndicesError):
    """NOT_OWNED: slots or a lock this session does not hold (a double free, the padding slot,
    another session's or the tree's pages, a released lock). Nothing changed. Also an
    InvalidIndicesError, as the core raises for the same mistakes."""


class EpochChanged(DaemonError):
    """The daemon restarted: every slot index, lock and Match from before is void, and this
    client's session is gone. Drop them all, open a new HiCacheClient and attach again."""


class LeaseLost(DaemonError):
    """This session's lease ran out (the engine was stalled or cut off past the lease): its
    locks and pages are being taken back. Stop using every slot and Match it had, at once, and
    open a new HiCacheClient."""


class LayoutMismatch(DaemonError):
    """LAYOUT_MISMATCH: the daemon serves another KV layout (model, dtype, block size, ...);
    the message names both. Nothing changed: use a daemon of its own for this engine."""


class ClientClosed(RuntimeError):
    """The client was closed: open a new one."""


class DaemonTimeout(TimeoutError):
    """No reply within the timeout (the daemon is down, or busy for too long)."""


_ERRORS = {
    ErrorCode.LEASE_EXPIRED: LeaseLost,
    ErrorCode.NOT_OWNED: NotOwned,
    ErrorCode.LAYOUT_MISMATCH: LayoutMismatch,
}
LateHandler = Callable[[Op, Reply, list], None]


def hello_fields(name: str, admin: bool, endpoint: str) -> dict:
    """HELLO's fields; an admin hello carries the token the daemon left for its own user."""
    token = None
    if admin:
        path = admin_token_path(endpoint)
        try:
            with open(path) as fh:
                token = fh.read().strip()
        except OSError as exc:
            raise PermissionError(
                f"an admin session needs the daemon's admin token in {path}: {exc.strerror} "
                "(run as the daemon's user, on its machine)"
            ) from None
    return HelloRequest(name, os.getpid(), admin, token).fields()


def _nbytes(frame: Any) -> int:
    """Bytes of a frame: bytes, a memoryview or a numpy array (whose len counts elements)."""
    return frame.nbytes if hasattr(frame, "nbytes") else len(frame)


class Connection:
    """One socket, used by one thread at a time. ``closing`` (optional): an event that ends a
    wait for a reply early with ClientClosed (checked every SLICE_MS)."""

    def __init__(
        self,
        endpoint: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        closing: threading.Event | None = None,
        trusted: frozenset[int] | None = None,
    ):
        """Checks who listens on ``endpoint`` first (client/trust.py: UntrustedDaemon, or
        DaemonTimeout when nothing does); ``trusted``: the uids a daemon may run as (default:
        this user, root and $HICACHE_DAEMON_USER)."""
        self.endpoint = endpoint
        keys = client_keys()  # CurveZMQ, from HICACHE_CURVE_* (None: plain)
        trusted = trusted_uids() if trusted is None else trusted
        try:
            self.daemon_uid = verify_endpoint(endpoint, trusted, curve=keys is not None)
        except (FileNotFoundError, ConnectionRefusedError, TimeoutError):
            raise DaemonTimeout(
                f"no daemon at {endpoint}: start hicache-daemon, or pass the endpoint of the one "
                "that runs (or set HICACHE_ENDPOINT)"
            ) from None
        self.trusted = trusted
        self.timeout_ms = int(timeout_s * 1000)
        self.closing = closing
        self.busy = False  # a call is under way (set by the owning thread; see SessionLink)
        self.ctx: zmq.Context[zmq.Socket] = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        slice_ms = self.timeout_ms if closing is None else min(self.timeout_ms, SLICE_MS)
        self.slice_s = max(slice_ms, 1) / 1000  # one receive's wait
        self.sock.setsockopt(zmq.RCVTIMEO, max(slice_ms, 1))  # recv raises zmq.Again after it
        if keys is not None:
            apply_client(self.sock, keys)
        self.sock.connect(endpoint)
        self.session = 0  # set by hello
        self.epoch = 0  # the daemon's boot epoch, learned from the first reply
        self.on_late: LateHandler | None = None  # what to do with a timed-out request's reply
        self._ids = itertools.count(1)
        self._pid = os.getpid()
        self._timed_out: OrderedDict[int, Op] = OrderedDict()

    def call(
        self,
        op: Op,
        fields: dict | None = None,
        frames: Sequence[Any] = (),
        timeout_s: float | None = None,
    ) -> tuple[Reply, list[zmq.Frame]]:
        """Send one request and wait for its reply (``timeout_s``: longer than this
        connection's timeout for this call). Raises DaemonError, EpochChanged, LeaseLost,
        DaemonTimeout."""
        request_id = self.post(op, fields, frames)
        wait = self.timeout_ms / 1000 if timeout_s is None else max(timeout_s, 0.001)
        deadline = time.monotonic() + wait
        while True:
            try:
                parts = self._recv()
            except zmq.Again:
                now = time.monotonic()
                closing = self.closing is not None and self.closing.is_set()
                if not closing and now + self.slice_s <= deadline + 0.001:
                    continue  # one slice of the wait: look whether the client closes
                self._timed_out[request_id] = op
                if len(self._timed_out) > MAX_LATE:
                    self._timed_out.popitem(last=False)
                if closing:
                    raise ClientClosed("the client was closed during this call") from None
                hint = ""
                if op in (Op.HELLO, Op.PING) and self.endpoint.startswith("tcp://"):
                    hint = (
                        " (a daemon with CurveZMQ keys ignores clients without them: set "
                        f"{SERVER_KEY_ENV} and {CLIENT_KEY_ENV}; one at its limit of tcp "
                        "connections resets new ones: its log says so)"
                    )
                raise DaemonTimeout(f"no reply from {self.endpoint} to {op.name}{hint}") from None
            reply = decode_reply(parts[0].buffer)
            if reply.request_id == request_id:
                break
            late = self._timed_out.pop(reply.request_id, None)
            if late is not None and self.on_late is not None and reply.ok:
                self.on_late(late, reply, parts[1:])
        return self._check(reply), parts[1:]

    def post(self, op: Op, fields: dict | None = None, frames: Sequence[Any] = ()) -> int:
        """Send one request without waiting for its reply (its id is returned): the daemon
        serves a connection's requests in order, and the next ``call`` reads past this one's
        reply, unread. For requests whose answer nobody needs (a release after the copy that
        needed the lock)."""
        if os.getpid() != self._pid:
            raise RuntimeError("a Connection cannot be used after fork; make a new one")
        for frame in frames:
            if _nbytes(frame) > MAX_FRAME_BYTES:
                raise DaemonError(
                    ErrorCode.TOO_LARGE,
                    f"{op.name}: a frame of {_nbytes(frame)} bytes is over the "
                    f"{MAX_FRAME_BYTES} limit (16M token ids or 8M slots); split the request",
                )
        request_id = next(self._ids)
        request = Request(op, request_id, self.session, self.epoch, fields or {})
        self._send(encode_request(request), frames)
        return request_id

    def _check(self, reply: Reply) -> Reply:
        if reply.status is ErrorCode.EPOCH_MISMATCH or (
            self.epoch and reply.boot_epoch != self.epoch
        ):
            raise EpochChanged(
                ErrorCode.EPOCH_MISMATCH,
                "the daemon restarted: every slot, lock and Match from before is void; "
                "open a new HiCacheClient",
            )
        self.epoch = self.epoch or reply.boot_epoch
        if reply.ok:
            return reply
        message = str(reply.fields.get("message", ""))
        raise _ERRORS.get(reply.status, DaemonError)(reply.status, message)

    def _send(self, header: bytes, frames: Sequence[Any]) -> None:
        sock = self.sock
        _send(sock, header, SNDMORE if frames else 0)
        last = len(frames) - 1
        for i, frame in enumerate(frames):  # zero-copy only where pyzmq says it pays
            _send(sock, frame, SNDMORE if i < last else 0, _nbytes(frame) < zmq.COPY_THRESHOLD)

    def _recv(self) -> list[zmq.Frame]:
        """One reply, frames not copied; raises zmq.Again after RCVTIMEO."""
        sock = self.sock  # Frame.more, not getsockopt(RCVMORE): that costs 2 us per frame
        parts = [_recv(sock, 0, False)]
        while parts[-1].more:
            parts.append(_recv(sock, 0, False))
        return parts

    def close(self) -> None:
        self.sock.close(linger=0)
