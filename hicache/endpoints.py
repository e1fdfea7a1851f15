"""Where the daemon listens by default, and where it leaves its admin token (shared by the
daemon and its clients)."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Mapping


def runtime_dir(environ: Mapping[str, str] | None = None) -> str:
    """$XDG_RUNTIME_DIR, else a per-user folder in the temp dir (made 0700 by the daemon)."""
    environ = os.environ if environ is None else environ
    return environ.get("XDG_RUNTIME_DIR") or os.path.join(
        tempfile.gettempdir(), f"hicache-{os.getuid()}"
    )


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
