"""Whom an engine trusts: the daemon behind an endpoint, and the memory that daemon names.

An engine sends the daemon its prompts' token ids and maps the pools the daemon's hello reply
names, so a process that answers in the daemon's place (an impostor on a socket path or port
another user took first) would read the prompts and serve its own KV, and a pool path from the
wire opened as is would let it make the engine write wherever it points. Before a connection
sends anything, ``verify_endpoint`` checks who listens:

- ``ipc://PATH``: the folder must be a directory (not a link) owned by a trusted user and
  writable by nobody else (a sticky shared folder such as /tmp is refused: anyone may create
  the name first), the socket file must be a socket owned by a trusted user, and the process
  listening on it (``SO_PEERCRED``) must run as a trusted user. Abstract sockets
  (``ipc://@name``) have no owner at all and are refused.
- ``tcp://``: another host needs CurveZMQ keys (the server key then proves the daemon); on
  loopback without them, the listening socket's owner (``/proc/net/tcp``) must be trusted.

Trusted users are this process's own, root, and the one ``HICACHE_DAEMON_USER`` (or the
client's ``daemon_user``) names. ``segment_path`` then turns a pool description into a path
only under /dev/shm, from a segment name of the daemon's own form and user, and the mapping
itself (``hicache.memory.backing.attach_shared_memory``) refuses links, FIFOs and files of another
owner. Stateless; thread-safe.
"""

from __future__ import annotations

import os
import pwd
import re
import socket
import stat
import struct
from collections.abc import Mapping

from hicache.endpoints import SHM_DIR, folder_problem, is_loopback
from hicache.local_tcp import listener_uid

DAEMON_USER_ENV = "HICACHE_DAEMON_USER"
_SEGMENT = re.compile(r"hicache-(\d+)-\d+-[0-9a-f]{32}-[a-z]+")


class UntrustedDaemon(PermissionError):
    """The endpoint, or what its daemon named, is not under a trusted user's control; nothing
    was sent. The message says what was found and how to fix it."""


def trusted_uids(
    daemon_user: str | int | None = None, environ: Mapping[str, str] | None = None
) -> frozenset[int]:
    """This process's user, root, and the daemon's user when named (a name or a uid)."""
    environ = os.environ if environ is None else environ
    named = daemon_user if daemon_user is not None else environ.get(DAEMON_USER_ENV) or None
    uids = {os.getuid(), 0}
    if named is not None:
        uids.add(_uid_of(named))
    return frozenset(uids)


def _uid_of(user: str | int) -> int:
    if isinstance(user, int) or str(user).isdigit():
        return int(user)
    try:
        return pwd.getpwnam(str(user)).pw_uid
    except KeyError:
        raise ValueError(f"{DAEMON_USER_ENV}: no user named {user!r}") from None


def _who(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _refuse(what: str, uid: int, trusted: frozenset[int]) -> UntrustedDaemon:
    return UntrustedDaemon(
        f"{what} belongs to {_who(uid)}, not to a user this engine trusts "
        f"({', '.join(_who(u) for u in sorted(trusted))}); if that user runs your daemon, "
        f"name it in {DAEMON_USER_ENV}"
    )


def verify_endpoint(endpoint: str, trusted: frozenset[int], curve: bool = False) -> int | None:
    """Check who listens on ``endpoint`` before anything is sent there. Returns the daemon's
    uid (None: a CurveZMQ daemon, proven by its key instead). Raises UntrustedDaemon, or
    ConnectionRefusedError/FileNotFoundError when nothing listens on an ipc path."""
    if endpoint.startswith("ipc://@"):
        raise UntrustedDaemon(
            f"{endpoint}: abstract sockets have no owner, so any local user may take the name "
            "first; use ipc://PATH in a folder of your own"
        )
    if endpoint.startswith("ipc://"):
        return _verify_ipc(endpoint[len("ipc://") :], trusted)
    if endpoint.startswith("tcp://"):
        port = endpoint.rpartition(":")[2]
        if curve:
            return None
        if not is_loopback(endpoint):
            raise UntrustedDaemon(
                f"{endpoint}: another host without CurveZMQ keys could be anyone (and would read "
                "every prompt); set HICACHE_CURVE_SERVER_KEY and HICACHE_CURVE_CLIENT_KEY"
            )
        uid = listener_uid(int(port))
        if uid is not None and uid not in trusted:
            raise _refuse(f"{endpoint}: the process listening on port {port}", uid, trusted)
        return uid
    raise ValueError(f"endpoint: {endpoint!r} is neither ipc://PATH nor tcp://HOST:PORT")


def _verify_ipc(path: str, trusted: frozenset[int]) -> int:
    folder = os.path.dirname(os.path.abspath(path))
    check_folder(folder, trusted)
    st = os.lstat(path)  # FileNotFoundError: no daemon there
    if not stat.S_ISSOCK(st.st_mode):
        raise UntrustedDaemon(f"ipc://{path}: not a socket (a link or a file is refused)")
    if st.st_uid not in trusted:
        raise _refuse(f"ipc://{path}", st.st_uid, trusted)
    uid = peer_uid(path)
    if uid not in trusted:
        raise _refuse(f"ipc://{path}: the process listening there", uid, trusted)
    return uid


def check_folder(folder: str, trusted: frozenset[int]) -> None:
    """The folder of an ipc socket: a real directory that only a trusted user can change (the
    daemon's own rule: ``hicache.endpoints.folder_problem``)."""
    problem = folder_problem(folder, trusted)
    if problem:
        raise UntrustedDaemon(f"{problem} (if that user runs your daemon: {DAEMON_USER_ENV})")


def peer_uid(path: str) -> int:
    """The uid of the process listening on unix socket ``path`` (SO_PEERCRED)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(2.0)
        sock.connect(path)
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


def segment_path(
    desc: Mapping[str, object], daemon_uid: int | None, trusted: frozenset[int]
) -> str:
    """The /dev/shm path of a pool the hello described, built from its name (never from a path
    on the wire): a segment name of the daemon's form, of the daemon's own user."""
    name = str(desc.get("name", ""))
    form = _SEGMENT.fullmatch(name)
    if form is None:
        raise UntrustedDaemon(f"the daemon named a pool {name!r}, not a hicache segment name")
    uid = int(form.group(1))
    allowed = trusted if daemon_uid is None else {daemon_uid}
    if uid not in allowed:
        raise _refuse(f"pool segment {name}", uid, trusted)
    return os.path.join(SHM_DIR, name)
