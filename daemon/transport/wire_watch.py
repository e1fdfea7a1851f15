"""Bounds what tcp peers make zmq hold for the daemon: bytes a connection sent that no read
has taken yet.

zmq bounds each frame (MAXMSGSIZE) and counts whole messages against the high-water mark, but
holds an unfinished multipart message whole until its last frame comes: a peer that speaks
ZMTP itself can send frames that never end a message, and zmq keeps reading them. zmq gives no
way to see or bound that, so the watch compares what the kernel received on each connection
(TCP_INFO's bytes_received) with what reads took from it (each message's frames with their
ZMTP framing, found by the message's source descriptor), and shuts down a connection that holds
more than ``per_connection``, or the ones holding most while all of them together hold more
than ``in_all``. zmq then drops that connection and what it held. What it counts includes
whole requests queued and not read yet (RCVHWM bounds their number, not their bytes). It
keeps at most ``max_connections``: a new one past them is reset, as is one it cannot watch
(no descriptor left for its copy).

Only tcp connections are watched: the kernel counts no bytes on a unix socket, and an ipc
peer is the daemon's own user. A zmq heartbeat a peer turns on (hicache's clients do not) is
counted as held, so such a peer is closed after months on one connection.

Not thread-safe: used by the thread that reads the watched socket (``took`` for each message
read, ``maybe_check`` in its loop).
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import os
import resource
import socket
import struct
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import zmq

from hicache.local_tcp import connection_uid
from hicache.protocol import MAX_FRAME_BYTES

log = logging.getLogger("hicache.daemon")

USER_SHARE = 4  # one CurveZMQ client key holds at most this share (1/4) of max_sessions, and
# so do one local user on tcp without keys and one process over ipc (however many connections);
# one user's connections are bounded likewise (a quarter of them)
CHECK_EVERY_S = 0.01  # how often the kernel's counts are read (at most; when the loop runs)
CHECK_SHARE = 0.05  # ... and checks take at most this share of the reading thread's time
PER_CONNECTION = 4 * MAX_FRAME_BYTES  # unread bytes one connection may make zmq hold
IN_ALL = 4 * PER_CONNECTION  # ... and every connection of one socket together
MAX_CONNECTIONS = 2048  # tcp connections one socket keeps (past it, a new one is reset)
SPARE_DESCRIPTORS = 512  # kept free of watched connections (files, pools, stores)
SAY_EVERY_S = 10.0  # resets past max_connections are logged at most this often, counted
HANDSHAKE_BYTES = 64 << 10  # a connection's greeting and handshake (not read as messages)
CURVE_BYTES = 33  # what CurveZMQ adds to a frame: its MESSAGE command's name, nonce, MAC, flags
_BYTES_RECEIVED = 128  # offset of tcpi_bytes_received (u64) in struct tcp_info (Linux >= 4.1)
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
SRCFD = int(zmq.SRCFD)
UNKNOWN = -1  # the share of connections whose local user is not known (on a loopback listener)


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def wire_bytes(size: int, curve: bool) -> int:
    """What a frame of ``size`` bytes takes on the wire (ZMTP 3: a 2-byte header up to 255
    bytes, 9 beyond; CurveZMQ sends each frame as a MESSAGE command of CURVE_BYTES more)."""
    if curve:
        size += CURVE_BYTES
    return size + (2 if size <= 255 else 9)


def bytes_received(sock: socket.socket) -> int:
    """Every byte the kernel received on a tcp connection since it opened."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    return struct.unpack_from("=Q", info, _BYTES_RECEIVED)[0]


def raise_descriptor_limit() -> None:
    """Let the process open as many descriptors as it is allowed to (the soft limit up to the
    hard one): connections are bounded by MAX_CONNECTIONS, not by a low default."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def connections_allowed(share: float, most: int) -> int:
    """How many tcp connections a socket may keep: ``most``, or its ``share`` of what the
    descriptor limit leaves for watched connections (each takes two: zmq's and the copy)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return most
    return max(16, min(most, int((soft - SPARE_DESCRIPTORS) // 2 * share)))


def end(sock: socket.socket) -> bool:
    """End a connection zmq holds: zmq reads the end, drops the connection with what it held
    and closes its descriptor, and the kernel then resets the connection once its last
    descriptor closes (no lingering close that leaves the peer's sends waiting on a full
    window). False when it was gone already."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RD)
    except OSError:
        return False
    return True


def abort(sock: socket.socket) -> None:
    """end() the connection of ``sock``, our copy of zmq's descriptor, and close the copy."""
    end(sock)
    sock.close()


@dataclass
class _Connection:
    sock: socket.socket  # our copy of zmq's descriptor (counts, shutdown): closed as zmq's is
    peer: str  # "address:port" (for the log)
    uid: int | None  # the local user at its far end at accept (None: another host's, unknown)
    counted: int | None  # whose share it counts in (None: not counted, a trusted user's)
    taken: int = 0  # bytes of its messages read so far, with their framing


class WireWatch:
    def __init__(
        self,
        sock: zmq.Socket,
        curve: bool,
        name: str,
        per_connection: int = PER_CONNECTION,
        in_all: int = IN_ALL,
        max_connections: int = MAX_CONNECTIONS,
        trusted: frozenset[int] | None = None,
    ):
        self.name = name  # which socket (for the log): "control", "events", ...
        self.curve = curve
        self.per_connection = per_connection
        self.in_all = in_all
        self.max_connections = max_connections
        # one local user keeps at most a quarter of them: it cannot lock others out. Not held
        # to it: ``trusted`` users (the daemon's own and root: they can stop it anyway)
        self.max_per_user = max(4, max_connections // USER_SHARE)
        self.trusted = frozenset({os.getuid(), 0}) if trusted is None else trusted
        # connections reset: holding too much, past max_connections, or not watchable
        self.closed = 0  # (stats: connections_closed)
        self._full_resets = 0  # resets past max_connections not logged yet
        self._say_after = 0.0  # (monotonic) when such resets are logged next
        self._monitor = sock.get_monitor_socket(_EVENTS)
        self._connections: dict[int, _Connection] = {}
        self._per_uid: Counter[int] = Counter()  # connections kept, by local user
        self._next_check = 0.0  # (monotonic) when maybe_check reads the counts again

    # ---- the reading thread ----
    def took(self, first: zmq.Frame, parts: Sequence) -> None:
        """A message was read: ``first`` its first frame (zmq's routing id for a ROUTER, not
        on the wire), ``parts`` the frames its peer sent."""
        fd = first.get(SRCFD)
        if fd < 0:  # (inproc: no descriptor)
            return
        conn = self._connections.get(fd)
        if conn is None:  # accepted since the last check: the monitor says so by now
            self._follow()
            conn = self._connections.get(fd)
            if conn is None:
                return
        curve = self.curve
        conn.taken += sum(wire_bytes(len(p), curve) for p in parts)

    def maybe_check(self) -> None:
        """check(), at most once per CHECK_EVERY_S, and taking at most CHECK_SHARE of the
        time (a check reads every connection's count)."""
        now = time.monotonic()
        if now >= self._next_check:
            self.check()
            spent = time.monotonic() - now
            self._next_check = now + max(CHECK_EVERY_S, spent / CHECK_SHARE)

    def check(self) -> int:
        """Shut down the connections that hold too much (see the module's docstring); returns
        how many."""
        held = {fd: max(0, n - HANDSHAKE_BYTES) for fd, n in self.held().items()}
        total, closed = sum(held.values()), 0
        if total <= self.in_all and max(held.values(), default=0) <= self.per_connection:
            return 0
        for fd in sorted(held, key=held.__getitem__, reverse=True):
            if held[fd] <= self.per_connection and total <= self.in_all:
                break
            conn = self._drop(fd)
            assert conn is not None  # (held: the watched ones)
            log.warning(
                "reset the %s connection from %s: it sent %.1f MiB that no read took yet (a "
                "message not finished, or requests queued); zmq may hold %.0f MiB unread for "
                "one connection, %.0f MiB for all",
                self.name,
                conn.peer,
                held[fd] / 2**20,
                self.per_connection / 2**20,
                self.in_all / 2**20,
            )
            abort(conn.sock)
            total -= held[fd]
            closed += 1
        self.closed += closed
        return closed

    def held(self) -> dict[int, int]:
        """Bytes each connection (by zmq's descriptor) sent that no read took, its greeting
        and handshake included."""
        self._follow()
        held: dict[int, int] = {}
        for fd, conn in self._connections.items():
            try:
                held[fd] = bytes_received(conn.sock) - conn.taken
            except OSError:  # (gone meanwhile: the monitor says so next)
                continue
        return held

    def close(self) -> None:
        for conn in self._connections.values():
            conn.sock.close()
        self._connections.clear()
        self._per_uid.clear()
        self._monitor.close(linger=0)

    def _drop(self, fd: int) -> _Connection | None:
        """Stop watching connection ``fd`` (not closing anything); returns it (None: not
        watched)."""
        conn = self._connections.pop(fd, None)
        if conn is not None and conn.counted is not None:
            self._per_uid[conn.counted] -= 1
            if not self._per_uid[conn.counted]:
                del self._per_uid[conn.counted]
        return conn

    def uid_of(self, fd: int) -> int | None:
        """The local user at the far end of watched connection ``fd`` when it was accepted
        (None: not watched, another host's, or unknown). What a hello on it is charged to:
        looked up later, a connection closed meanwhile would read as nobody's, or root's.
        The monitor's news is taken first, and the number must still name the socket
        watched (our copy's inode): zmq gives a closed connection's number to the next."""
        self._follow()
        conn = self._connections.get(fd)
        if conn is None:
            return None
        try:
            same = os.fstat(fd).st_ino == os.fstat(conn.sock.fileno()).st_ino
        except OSError:  # (closed meanwhile)
            return None
        return conn.uid if same else None

    def _follow(self) -> None:
        """Take in the monitor's news: connections accepted and gone, in their order."""
        monitor = self._monitor
        while True:
            try:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                event, fd = struct.unpack("=Hi", frames[0][:6])
                old = self._drop(fd)
                if old is not None:  # (a descriptor zmq closed, maybe given again since)
                    old.sock.close()
                if event == zmq.EVENT_ACCEPTED:
                    listening = frames[1].rsplit(b":", 1)[-1]  # the port it was accepted on
                    self._accepted(fd, int(listening) if listening.isdigit() else -1)
            except Exception:  # never let a connection's news end the daemon's loop
                log.exception("the %s socket's connection watch", self.name)

    def _accepted(self, fd: int, port: int) -> None:
        """Watch zmq's connection ``fd``, accepted on ``port``: through a copy of the
        descriptor (while we hold it, the number names that connection). One that cannot be
        watched (no descriptor left for the copy) or is one too many is reset."""
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                self._reset_unwatched(fd, port, "no descriptor left to watch it")
            return  # (else gone already, or not a socket any more)
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or (
                sock.getsockname()[1] != port  # (zmq's number given again: not ours)
            ):
                sock.close()
                return
            bytes_received(sock)  # (a kernel without the count: not watched)
            host, peer_port = sock.getpeername()[:2]
            local_host = sock.getsockname()[0]
        except (OSError, struct.error):
            sock.close()
            return
        # the local user at the far end (None: another host's, or closed already); counted
        # unless trusted, and on a loopback listener an unknown one counts as one user too
        uid = connection_uid(host, peer_port, local_host, port)
        counted = None if uid in self.trusted else uid
        if uid is None and _loopback(local_host):
            counted = UNKNOWN
        if len(self._connections) >= self.max_connections:
            why = f"{len(self._connections)} are open, the most this socket keeps"
        elif counted is not None and self._per_uid[counted] >= self.max_per_user:
            who = "an unknown local user" if counted == UNKNOWN else f"uid {counted}"
            why = f"{who} holds {self._per_uid[counted]}, the most one local user may"
        else:
            self._connections[fd] = _Connection(sock, f"{host}:{peer_port}", uid, counted)
            if counted is not None:
                self._per_uid[counted] += 1
            return
        abort(sock)
        self.closed += 1
        self._full_resets += 1
        now = time.monotonic()
        if now >= self._say_after:
            self._say_after = now + SAY_EVERY_S
            log.warning(
                "reset %d new %s connection(s), the last from %s:%s: %s (said at most every "
                "%.0f s)",
                self._full_resets,
                self.name,
                host,
                peer_port,
                why,
                SAY_EVERY_S,
            )
            self._full_resets = 0

    def _reset_unwatched(self, fd: int, port: int, why: str) -> None:
        try:
            sock = socket.socket(fileno=fd)  # zmq's own: let go of, never closed here
        except OSError:  # (closed meanwhile, or given again to something not a socket)
            return
        try:
            ours = sock.getsockname()[1] == port  # (else the number was given again)
        except OSError:
            ours = False
        if ours and end(sock):
            self.closed += 1
            log.warning("reset a new %s connection: %s", self.name, why)
        sock.detach()
