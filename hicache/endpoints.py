"""Where the daemon listens by default, and where it leaves its admin token (shared by the
daemon and its clients)."""

from __future__ import annotations

import hashlib
import ipaddress
import os
import stat
import tempfile
from collections.abc import Collection, Mapping

SHM_DIR = "/dev/shm"  # where the daemon's pools live (POSIX shared memory), by name


def runtime_dir(environ: Mapping[str, str] | None = None) -> str:
    """$XDG_RUNTIME_DIR, else a per-user folder in the temp dir (made 0700 by the daemon)."""
    environ = os.environ if environ is None else environ
    return environ.get("XDG_RUNTIME_DIR") or os.path.join(
        tempfile.gettempdir(), f"hicache-{os.getuid()}"
    )


def folder_problem(folder: str, owners: Collection[int]) -> str | None:
    """Why ``folder`` may not hold an ipc socket (None: it may): it must be a real directory
    owned by one of ``owners`` and writable by no one else. A sticky shared folder such as /tmp
    is refused too: anyone may create the socket's name there first. The one rule for the
    daemon (where it listens) and its clients (whom they trust). FileNotFoundError if missing."""
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode):
        return f"{folder}: not a directory (a symlink is refused too)"
    if st.st_uid not in owners:
        allowed = " or ".join(map(str, sorted(owners)))
        return (
            f"{folder}: owned by uid {st.st_uid}, not by uid {allowed}: whoever owns it could "
            "put their own socket there; use a folder of your own"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (
            f"{folder}: writable by other users (mode {oct(stat.S_IMODE(st.st_mode))}): they "
            "could put their own socket there first; chmod go-w it or use a folder of your own"
        )
    return None


def default_endpoint(environ: Mapping[str, str] | None = None) -> str:
    """ipc:// in the runtime folder."""
    return f"ipc://{os.path.join(runtime_dir(environ), 'hicache.sock')}"


def admin_token_path(endpoint: str, environ: Mapping[str, str] | None = None) -> str:
    """The file (mode 0600) holding the token an admin session of ``endpoint`` must show: beside
    an ipc socket, else in the runtime folder. Readable only by the daemon's user."""
    if endpoint.startswith("ipc://") and not endpoint.startswith("ipc://@"):
        return endpoint[len("ipc://") :] + ".admin"
    # readable, and one to one: endpoints that read alike (ipc://@a.b, ipc://@a_b) differ
    name = "".join(c if c.isalnum() else "_" for c in endpoint)[:80]
    digest = hashlib.sha256(endpoint.encode()).hexdigest()[:16]
    return os.path.join(runtime_dir(environ), f"{name}-{digest}.admin")


def env_endpoint(environ: Mapping[str, str] | None = None) -> str:
    """The endpoint to use: HICACHE_ENDPOINT when set, else the default."""
    environ = os.environ if environ is None else environ
    return environ.get("HICACHE_ENDPOINT") or default_endpoint(environ)


def is_loopback(endpoint: str) -> bool:
    """Whether a ``tcp://HOST:PORT`` endpoint listens on loopback only (ipc: always true;
    ``tcp://*:P`` binds to loopback here, see bind_address)."""
    if not endpoint.startswith("tcp://"):
        return True
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    if host in ("*", "", "localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name or an interface name: not provably loopback
        return False
