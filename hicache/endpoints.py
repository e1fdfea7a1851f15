"""Where the daemon listens by default (shared by the daemon and its clients)."""

from __future__ import annotations

import os
import tempfile


def default_endpoint() -> str:
    """ipc:// under $XDG_RUNTIME_DIR, else a per-user folder in the temp dir (mode 0700)."""
    base = os.environ.get("XDG_RUNTIME_DIR") or os.path.join(
        tempfile.gettempdir(), f"hicache-{os.getuid()}"
    )
    return f"ipc://{os.path.join(base, 'hicache.sock')}"


def env_endpoint() -> str:
    """The endpoint to use: HICACHE_ENDPOINT when set, else the default."""
    return os.environ.get("HICACHE_ENDPOINT") or default_endpoint()
