"""Where the daemon listens by default (shared by the daemon and its clients)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping


def default_endpoint(environ: Mapping[str, str] | None = None) -> str:
    """ipc:// under $XDG_RUNTIME_DIR, else a per-user folder in the temp dir (mode 0700)."""
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_RUNTIME_DIR") or os.path.join(
        tempfile.gettempdir(), f"hicache-{os.getuid()}"
    )
    return f"ipc://{os.path.join(base, 'hicache.sock')}"


def env_endpoint(environ: Mapping[str, str] | None = None) -> str:
    """The endpoint to use: HICACHE_ENDPOINT when set, else the default."""
    environ = os.environ if environ is None else environ
    return environ.get("HICACHE_ENDPOINT") or default_endpoint(environ)
