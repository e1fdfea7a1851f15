"""The daemon's side of its ROUTER socket: which request is served next, who sent it, and how
replies leave.

Requests are served one at a time in zmq's fair order (the connections with something queued,
in turn). A long request asks between its parts whether another client waits
(``others_waiting``); that reads what is queued: the served client's own requests are read
ahead (up to READ_AHEAD, kept in their order: its own next request must not end its turn),
another client's request ends the turn and is served next. Serving the read-ahead, the inbox
still looks at the socket first, so a client with requests read ahead takes turns with the
others as before. A wake of the third tier read on the way is noted in ``woken``.

Who sent the request being served (``serving``: its routing id; ``user``: its CurveZMQ key;
``process``: over ipc, the connecting process) is read from that request's own first part,
which reading ahead never replaces.

Replies never block: a peer that does not read its replies (its pipe is full) loses them,
counted in ``dropped``. On tcp, what each connection sent is weighed against what was read
from it (``watch``, wire_watch.py). Used by the control thread only.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import zmq

from hicache.daemon.transport.busy_poll import BusyPoll, queued, yield_cpu
from hicache.daemon.transport.wire_watch import SRCFD, WireWatch

log = logging.getLogger("hicache.daemon")
LOCAL_USER = "local uid "  # a user named so is a local uid (tcp without keys), not a key

# pyzmq's send_multipart/recv_multipart do enum flag arithmetic in Python for every frame; the
# backend methods with int flags do the same work in half the time (measured: 7 vs 15 us).
_send, _recv = zmq.backend.Socket.send, zmq.backend.Socket.recv
SNDMORE, NOBLOCK = int(zmq.SNDMORE), int(zmq.NOBLOCK)
# Frames below this are copied into the message: a zero-copy send makes pyzmq wake its garbage
# thread to release the buffer later, which costs more than a memcpy of up to a MiB here.
COPY_BELOW = 1 << 20
# Received frames below this are copied into bytes (cheaper than keeping pyzmq's Frame); larger
# ones stay in zmq's buffer, read through a memoryview (a batch of prompts: no 500 KiB copy).
KEEP_FROM = 1 << 16
READ_AHEAD = 8  # requests of the client being served read past while looking for another's
YIELD_EVERY_S = 0.0002  # a long request gives its core away at most this often (see below)

Frames = list  # one multipart message: [routing id, header, data frames...]


class Inbox:
    def __init__(
        self, sock: zmq.Socket, busy: BusyPoll, wake_id: bytes, watch: WireWatch | None = None
    ):
        self.sock = sock
        self.busy = busy  # watches the socket after a reply (busy_poll.py)
        self.watch = watch  # tcp: bounds what connections make zmq hold unread
        self.wake_id = wake_id  # routing id of the third tier's wakes (never a client)
        self.serving = b""  # routing id of the request being served
        self.woken = False  # a wake of the third tier read ahead, not acted on yet
        self.dropped = 0  # replies a peer's full pipe refused (stats: replies_dropped)
        self._first: zmq.Frame | None = None  # the served request's first part (properties)
        # requests read by others_waiting, each with its first part, in the order served
        self._ahead: deque[tuple[Frames, zmq.Frame]] = deque()
        self._yield_after = 0.0  # (perf_counter) when others_waiting may yield again
        self._said_no_pid = False  # an ipc peer without a pid was logged

    # ---- reading ----
    def next(self) -> Frames | None:
        """The next message to serve, or None when none came within the socket's RCVTIMEO (a
        wake of the third tier is returned like a request). The read-ahead goes first, except
        that a request of another client queued meanwhile goes before the served client's
        next one."""
        ahead = self._ahead
        if self.watch is not None:
            self.watch.maybe_check()
        if ahead:
            if ahead[0][0][0] == self.serving and queued(self.sock):
                frames, first = self._read()
                if frames[0] != self.serving:  # another client's (or a wake): its turn
                    return self._serve(frames, first)
                ahead.append((frames, first))  # the same client's: behind its others
            return self._serve(*ahead.popleft())
        self.busy.before_recv()  # after a reply: the same engine may be about to ask again
        try:
            return self._serve(*self._read())
        except zmq.Again:
            return None

    def others_waiting(self, may_yield: bool = True) -> bool:
        """Whether another client's request waits (asked by a long request between its parts,
        after a whole-cache view, and by housekeeping). Reads what is queued (see the module's
        docstring); true also once READ_AHEAD of the served client's own are read (others may
        be queued behind them). Past YIELD_EVERY_S since it last did, and ``may_yield``, it
        first gives the core away: requests reach the socket through zmq's IO thread, which
        may be waiting for this core while a long request runs (housekeeping, between
        requests, does not: a yield on a shared core may last milliseconds)."""
        ahead, serving = self._ahead, self.serving
        # the read-ahead is one client's requests in order, another's at most one before them
        if ahead and ahead[0][0][0] != serving:
            return True
        now = time.perf_counter()
        if may_yield and now >= self._yield_after:
            self._yield_after = now + YIELD_EVERY_S
            yield_cpu()
            if self.watch is not None:
                self.watch.maybe_check()
        while len(ahead) < READ_AHEAD and queued(self.sock):
            frames, first = self._read()
            if frames[0] == self.wake_id:
                self.woken = True  # (answered after this request)
                continue
            if frames[0] != serving:
                ahead.appendleft((frames, first))
                return True
            ahead.append((frames, first))
        return len(ahead) >= READ_AHEAD

    def _serve(self, frames: Frames, first: zmq.Frame) -> Frames:
        self.serving, self._first = frames[0], first
        return frames

    def _read(self) -> tuple[Frames, zmq.Frame]:
        """One multipart message and its first part; raises zmq.Again after RCVTIMEO."""
        sock = self.sock  # Frame.more, not getsockopt(RCVMORE): that costs 2 us per frame
        first = frame = _recv(sock, 0, False)
        parts: Frames = [frame.bytes]  # (bytes, or a buffer from KEEP_FROM bytes on)
        while frame.more:
            frame = _recv(sock, 0, False)
            parts.append(frame.buffer if len(frame) >= KEEP_FROM else frame.bytes)
        if self.watch is not None:
            self.watch.took(first, parts[1:])
        return parts, first

    # ---- who sent the request being served ----
    def user(self) -> str:
        """The CurveZMQ client key (z85) the served request came with ("": none)."""
        return self._property("User-Id")

    def local_user(self) -> str:
        """On tcp without CurveZMQ keys: whom the served request's sessions count against,
        the local user the kernel named at the far end of its connection when it was
        accepted ("local uid N"); "" for the watch's trusted users (the daemon's own, root:
        they can stop the daemon anyway); "local uid ?" when not known (a connection closed
        before it was seen: all such share one user's bound)."""
        try:
            fd = self._first.get(SRCFD) if self._first is not None else -1
        except zmq.ZMQError:
            fd = -1
        uid = None if self.watch is None or fd < 0 else self.watch.uid_of(fd)
        if uid is None:
            return f"{LOCAL_USER}?"
        assert self.watch is not None  # (the uid came from it)
        return "" if uid in self.watch.trusted else f"{LOCAL_USER}{uid}"

    def process(self) -> str:
        """Over ipc: the process that opened the served request's connection, as the kernel
        gives it (SO_PEERCRED): "<pid>@<start time>" (a later process given the same pid is
        another one); "" when there is none (tcp, or a peer in another pid namespace, which
        the kernel gives as pid 0)."""
        address = self._property("Peer-Address")
        pid = peer_pid(address)
        if not pid and address and not self._said_no_pid:
            self._said_no_pid = True  # (said once)
            log.info(
                "an ipc peer's process is not known (%s: another pid namespace?): its sessions "
                "are bounded per connection and by max_sessions only",
                address,
            )
        return process_of(pid)

    def _property(self, name: str) -> str:
        first = self._first
        if first is None:
            return ""
        try:
            return first.get(name) or ""  # type: ignore[return-value]  # a str property
        except zmq.ZMQError:  # (none on this message: a wake, or a libzmq without it)
            return ""

    # ---- writing ----
    def send(self, frames: Frames) -> None:
        """Send a reply whole or not at all, never blocking: a full pipe refuses the message
        at its first frame (zmq checks the high-water mark per message); a peer that went
        away loses it quietly."""
        sock, last = self.sock, len(frames) - 1
        try:
            for i, frame in enumerate(frames):
                flags = (SNDMORE if i < last else 0) | NOBLOCK
                _send(sock, frame, flags, len(frame) < COPY_BELOW)
        except zmq.Again:  # the peer does not read, so it loses this reply
            self.dropped += 1
        except zmq.ZMQError as exc:  # the peer went away (ROUTER_MANDATORY): nothing to do
            log.debug("reply dropped: %s", exc)


def peer_pid(address: str) -> int:
    """The pid in zmq's Peer-Address of an ipc connection ("host:uid:gid:pid", from
    SO_PEERCRED); 0 for anything else."""
    parts = address.rsplit(":", 3)
    if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
        return 0
    return int(parts[3])


def process_alive(process: str) -> bool:
    """Whether the process a session's ``process`` names ("<pid>@<start time>") still runs:
    its pid exists, started then (a pid given again names another process) and is not a
    zombie (killed, not yet waited for by its parent: its /proc entry stays). A process whose
    start time was not readable when its session opened (a /proc that does not show it) is
    never judged: it answers alive."""
    pid, _, start = process.partition("@")
    if start in ("", "?"):
        return True
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False
    except (OSError, ValueError):
        return True
    try:
        fields = stat[stat.rindex(b")") + 2 :].split()  # state, ppid, ...: man 5 proc
        return fields[0] not in (b"Z", b"X") and fields[19].decode() == start
    except (ValueError, IndexError):
        return True


def process_of(pid: int) -> str:
    """``pid`` with its start time ("<pid>@<clock ticks since boot>", from /proc), so that a
    pid the kernel gives again later names another process; "" for pid 0."""
    if pid <= 0:
        return ""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        start = stat[stat.rindex(b")") + 2 :].split()[19].decode()  # field 22: starttime
    except (OSError, ValueError, IndexError):  # gone already, or no /proc: the pid alone
        start = "?"
    return f"{pid}@{start}"
