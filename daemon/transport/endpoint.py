"""Claiming the endpoint the daemon listens on, so that no two daemons share it.

For ``ipc://PATH``: the folder must be ours (or root's) and writable by nobody else, sticky
shared folders such as /tmp included, or another user could put their own socket there first
(``hicache.endpoints.folder_problem``, the rule engines check too); it is created 0700 when
missing. A live daemon holds an exclusive ``flock`` on ``PATH.lock`` for its whole life: a
second daemon on the same path is refused at once instead of taking the socket over, and a
socket file left by a dead daemon is removed. The lock file itself stays (removing it while
another daemon opens it would let two daemons hold "the" lock).

``tcp://`` endpoints need no claim: the kernel refuses a second bind itself. Abstract
``ipc://@name`` sockets are refused (settings): they have no owner, anyone may bind one first.

The admin token (``AdminToken``) is written 0600 where ``hicache.endpoints.admin_token_path``
says: a session that opens as admin (flush, evict for everyone) must show it, so only the
daemon's user can.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import stat

from hicache.endpoints import folder_problem


class EndpointError(RuntimeError):
    """The endpoint cannot be used; the message says why and what to do."""


def bind_address(endpoint: str) -> str:
    """tcp endpoints without an explicit host bind to loopback only."""
    if endpoint.startswith("tcp://*:") or endpoint.startswith("tcp://:"):
        return "tcp://127.0.0.1:" + endpoint.rsplit(":", 1)[1]
    return endpoint


def check_folder(folder: str) -> None:
    """Raise EndpointError unless ``folder`` is a directory only we (or root) control; made
    0700 when missing."""
    if not os.path.lexists(folder):
        os.makedirs(folder, mode=0o700, exist_ok=True)
    problem = folder_problem(folder, {os.getuid(), 0})
    if problem:
        raise EndpointError(problem)


class EndpointClaim:
    """Holds an ipc endpoint's path for this daemon (nothing to hold for tcp)."""

    def __init__(self, endpoint: str):
        self.path: str | None = None
        self._fd: int | None = None
        if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):
            return  # tcp, or an abstract socket: the kernel refuses a second bind itself
        path = endpoint[len("ipc://") :]
        if len(path.encode()) > 107:  # sun_path holds 108 bytes with the terminating NUL
            raise EndpointError(f"{endpoint}: an ipc path is at most 107 bytes; use a shorter one")
        check_folder(os.path.dirname(os.path.abspath(path)))
        flags = os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(path + ".lock", flags, 0o600)
        except OSError as exc:  # a link (ELOOP), or something we may not open
            raise EndpointError(f"{path}.lock: cannot be our lock file ({exc.strerror})") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            os.close(fd)
            raise EndpointError(f"{path}.lock: not a regular file of yours; remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise EndpointError(
                f"{endpoint}: another hicache-daemon serves this endpoint; stop it first, or "
                "give this one another --endpoint"
            ) from None
        self.path, self._fd = path, fd
        with contextlib.suppress(FileNotFoundError):  # a dead daemon's socket file
            os.unlink(path)

    def close(self) -> None:
        """Remove the socket file and release the claim (the daemon's socket is closed)."""
        if self._fd is None:
            return
        assert self.path is not None  # (set with the lock's descriptor)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self._fd)
        self._fd = None


class AdminToken:
    """A random token in a 0600 file, removed by close(); admin sessions must show it."""

    def __init__(self, path: str):
        self.path = path
        self.value = secrets.token_hex(16)
        check_folder(os.path.dirname(os.path.abspath(path)))
        tmp = f"{path}.{secrets.token_hex(4)}.tmp"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(self.value)
        os.replace(tmp, path)

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
