"""The daemon's own settings, each with its type, default and help (``DAEMON_FIELDS``), the
embedded default model, and sizes as operators write them (``parse_bytes``). Constants only:
``settings.py`` merges and checks them.
"""

from __future__ import annotations

import re
from typing import Any

from hicache.protocol import DEFAULT_LEASE_S

# A small model that serves on any machine: 4 layers, 4 KV heads of 64, fp32, page 16.
EMBEDDED_DEFAULT: dict[str, Any] = {
    "num_layers": 4,
    "num_kv_heads": 4,
    "head_dim": 64,
    "dtype": "float32",  # CPU matmuls in fp16/bf16 are several times slower than fp32
    "page_size": 16,
    "device": "cpu",
    "device_tokens": 16384,
    "host_ratio": 4.0,
}

# The daemon's own settings: name -> (type, default, help). None: computed (see the help).
DAEMON_FIELDS: dict[str, tuple[type, Any, str]] = {
    "endpoint": (
        str,
        None,
        "where to listen: ipc://PATH or tcp://HOST:PORT (default: "
        "$HICACHE_ENDPOINT, else ipc:// under $XDG_RUNTIME_DIR or /tmp/hicache-UID)",
    ),
    "lease_seconds": (
        float,
        DEFAULT_LEASE_S,
        "a session without messages for this long lapses (its client heartbeats 3 times per lease)",
    ),
    "quarantine_seconds": (
        float,
        None,
        "a lapsed session's pages and locks are held this "
        "long before reuse, in case its engine was only stalled "
        "(default: the lease)",
    ),
    "session_owned_fraction": (
        float,
        0.75,
        "the share of the device pool (the one pool with --device-tier engine) one session may "
        "hold at once (pages it allocated and has "
        "not inserted, and pages its locks pinned); so may all sessions of one CurveZMQ key",
    ),
    "session_max_locks": (
        int,
        65536,
        "locks one session may hold at once (at most a quarter of the daemon-wide bound, which "
        "the start log states)",
    ),
    "session_max_loads": (int, 256, "load-backs one session may have in flight at once"),
    "max_sessions": (
        int,
        4096,
        "sessions (live and quarantined) at once; a quarter of them per CurveZMQ key or per ipc "
        "process",
    ),
    "device_tier": (
        str,
        "daemon",
        "who owns the device tier: daemon (its own device pool, engines write into it) or "
        "engine (vLLM: engines keep their own blocks; the daemon's one pool is the shared host "
        "tier, shaped by the first engine that registers its KV layout)",
    ),
    "host_bytes": (
        int,
        None,
        "device_tier=engine: host pool size in bytes (suffixes KiB, MiB, GiB; "
        "default: host_tokens if set, else 1GiB)",
    ),
    "metrics_port": (
        int,
        0,
        "serve Prometheus metrics at http://METRICS_HOST:PORT/metrics (0: off)",
    ),
    "metrics_host": (str, "127.0.0.1", "the address the metrics endpoint listens on"),
    "events_endpoint": (
        str,
        None,
        "publish KV events in vLLM's format on this ZMQ PUB endpoint (tcp://HOST:PORT or "
        "ipc://PATH; default: off)",
    ),
    "events_replay_endpoint": (
        str,
        None,
        "serve replays of buffered event batches and full dumps on this ROUTER endpoint "
        "(default: off)",
    ),
    "events_topic": (str, "", "the topic frame of every event message"),
    "events_buffer": (int, 10000, "event batches kept for replay"),
    "curve_secret_key": (
        str,
        None,
        "CurveZMQ: the daemon's .key_secret file (hicache keygen); required to listen on a tcp "
        "address other than loopback (default: off)",
    ),
    "curve_clients": (
        str,
        None,
        "CurveZMQ: the folder of the public .key files of the clients let in (default: off)",
    ),
    "insecure_local_tcp": (
        bool,
        False,
        "accept a loopback tcp:// endpoint (control or events) without CurveZMQ keys: EVERY "
        "local user can then connect, read cached prompts' token ids and insert KV under any "
        "tokens (default: refused; use ipc://, private to your user, or CurveZMQ keys)",
    ),
    "keep_host": (
        bool,
        True,
        "a clean stop leaves the host pool and a snapshot of its tree; the next daemon on the "
        "same endpoint with the same KV shape adopts what still verifies",
    ),
    "keep_host_seconds": (
        float,
        120.0,
        "with keep_host: how long a stopped daemon's host pool waits for the next daemon on its "
        "endpoint; then its memory is given back (hicache kept lists and frees what is kept)",
    ),
    "snapshot_seconds": (
        float,
        30.0,
        "with keep_host: a snapshot this often, so that a crash keeps the host tier too "
        "(summed on a worker thread unless verify_pages keeps the checksums; 0: only at a "
        "clean stop)",
    ),
    "busy_poll_us": (
        float,
        200.0,
        "after a reply, watch the socket this many microseconds (at most 10000) before "
        "sleeping on it: an engine's next request finds the daemon awake, its CPU's caches "
        "warm. Only while requests come back within that time of the reply before them; a "
        "core busy at most this long per request; 0: sleep at once",
    ),
    "shutdown_timeout": (
        float,
        10.0,
        "SIGTERM drains: not ready, no new sessions, in-flight copies finish, and the daemon "
        "exits once no session holds pages or locks, or after this many seconds (a second "
        "SIGTERM: at once)",
    ),
}
DEVICE_TIERS = ("daemon", "engine")
DEFAULT_ENGINE_HOST_BYTES = 1 << 30
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(raw: object, name: str = "host_bytes") -> int:
    """A size in bytes from an int or a string such as 512MiB, 4GiB, 2G (powers of 1024)."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    m = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(?:i?b)?\s*", str(raw), re.I)
    if m is None:
        raise ValueError(f"{name}: {raw!r} is not a size (e.g. 4GiB, 512MiB, 1073741824)")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]
