"""`hicache info`: the daemon's stats as Redis-INFO-like sections (``key:value`` lines under
``# Section``, ``_human`` twins for sizes) and their ``--json`` twin. Pure functions over a
stats dict, so a test groups the sections without a daemon.
"""

from __future__ import annotations

from hicache.observe import DISK_FIGURES, shown


def _human(tokens: int, token_bytes: int) -> str:
    size = float(tokens * token_bytes)
    for unit in ("B", "K", "M", "G", "T"):
        if size < 1024 or unit == "T":
            return f"{size:.2f}{unit}"
        size /= 1024
    return ""


def _ratio(part: int, whole: int) -> float:
    """A ratio as a number (4 decimals; 0.0 of nothing): ``--json`` keeps it a number."""
    return round(part / whole, 4) if whole else 0.0


def text(value: object) -> str:
    """A value as an INFO line shows it: a float in fixed notation (0.000086, never 8.6e-05;
    0.5, not 0.500000), None as nothing."""
    if value is None:
        return ""
    if isinstance(value, float):
        shown = f"{value:.6f}".rstrip("0")
        return shown + "0" if shown.endswith(".") else shown
    return str(value)


GC_SECONDS = ("gc_pause_seconds", "gc_pause_seconds_max")


_EMPTY = dict.fromkeys(
    [
        "hit_device_tokens",
        "hit_host_tokens",
        "miss_tokens",
        "device_capacity_tokens",
        "host_capacity_tokens",
        "page_size",
    ],
    0,
)


def _l3_section(stats: dict) -> dict:
    if stats.get("l3"):
        return {"enabled": 1, **stats["l3"]}
    url = stats.get("config", {}).get("l3")
    if url:  # a daemon for engines: the tier starts with the pool, at the first layout
        return {"enabled": 1, "url": url, "waiting_for": "the first engine's KV layout"}
    return {"enabled": 0}


def _disk_section(stats: dict) -> dict:
    """The disk tier's figures (``enabled: 0`` without one; ``opened: 0`` before its first
    use: the store opens on the third tier's thread)."""
    l3 = stats.get("l3") or {}
    figures = {f.name: l3[f.name] for f in DISK_FIGURES if f.name in l3}
    config = stats.get("config") or {}
    if figures:
        return {"enabled": 1, **figures}
    if config.get("disk") or str(config.get("l3") or "").startswith("disk://"):
        return {"enabled": 1, "opened": 0}
    return {"enabled": 0}


# the cache's shape: for a daemon for engines (device_tier=engine), the first engine's layout
# says it (the embedded default before one registered; an opaque row per token after)
_SHAPE = (
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "dtype",
    "kv_format",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "page_size",
    "device",
    "device_tokens",
    "host_ratio",
    "host_layout",
    "host_capacity_tokens",
)


def _config(stats: dict) -> dict:
    """The settings; a daemon for engines shows the layout engines registered (or that none
    did yet) and its pool's size instead of a cache shape nobody chose."""
    config = dict(stats.get("config", {}))
    if config.get("device_tier") != "engine":
        return config
    for name in _SHAPE:
        config.pop(name, None)
    layout = stats.get("layout")
    if not layout:
        config["layout"] = "none registered yet (the first engine to start sizes the pool)"
        return config
    config.pop("host_tokens", None)  # (the cache's: 0, no tier under the pool)
    config["host_capacity_tokens"] = stats.get("host_capacity_tokens", 0)
    config.update({f"layout_{k}": v for k, v in layout.items()})
    return config


def sections(stats: dict) -> dict[str, dict]:
    """Group the daemon's stats into INFO sections (shared by `info` and tests)."""
    stats = {**_EMPTY, **stats}  # (a daemon for engine-owned tiers before any layout: zeros)
    requested = stats["hit_device_tokens"] + stats["hit_host_tokens"] + stats["miss_tokens"]
    tb = stats.get("token_bytes", 0)
    return {
        "server": shown(stats, "server") | {k: float(stats[k]) for k in GC_SECONDS if k in stats},
        "config": _config(stats),
        "memory": {
            "device_capacity_tokens": stats["device_capacity_tokens"],
            "device_capacity_human": _human(stats["device_capacity_tokens"], tb),
            "host_capacity_tokens": stats["host_capacity_tokens"],
            "host_capacity_human": _human(stats["host_capacity_tokens"], tb),
            "page_size": stats["page_size"],
            # engine: the engines keep their device tier; the daemon's pool is their host tier
            "device_tier": stats.get("device_tier", "daemon"),
        },
        "device_pool": shown(stats, "device_pool"),
        "host_pool": shown(stats, "host_pool"),  # (owned, protected: a daemon for engines')
        "hits": {
            "hit_device_tokens": stats["hit_device_tokens"],
            "hit_host_tokens": stats["hit_host_tokens"],
            "miss_tokens": stats["miss_tokens"],
            "hit_ratio_device": _ratio(stats["hit_device_tokens"], requested),
            "hit_ratio_host": _ratio(stats["hit_host_tokens"], requested),
            "hit_ratio": _ratio(stats["hit_device_tokens"] + stats["hit_host_tokens"], requested),
        },
        # as engines with a prefix cache of their own count (vLLM's external_prefix_cache_*)
        "engines": {
            "engine_queried_tokens": stats.get("engine_queried_tokens", 0),
            "engine_hit_tokens": stats.get("engine_hit_tokens", 0),
            "engine_hit_ratio": _ratio(
                stats.get("engine_hit_tokens", 0), stats.get("engine_queried_tokens", 0)
            ),
            "engine_loaded_tokens": stats.get("engine_loaded_tokens", 0),
        },
        "transfers": shown(stats, "transfers"),
        # the third tier: the store under the daemon's pool (off unless --l3)
        "l3": _l3_section(stats),
        # the disk tier (--disk, or --l3 disk://): its store's figures, once it opened
        "disk": _disk_section(stats),
        "sessions": shown(stats, "sessions")
        | {
            f"session_{s['id']}": f"client={s['client']},pid={s['pid']},"
            + (f"peer_pid={s['peer_pid']}," if s.get("peer_pid") else "")
            + f"owned_pages={s['owned_pages']},locks={s['locks']},"
            f"queried_tokens={s.get('queried_tokens', 0)},hit_tokens={s.get('hit_tokens', 0)},"
            f"hit_ratio={_ratio(s.get('hit_tokens', 0), s.get('queried_tokens', 0))}"
            + _engine_figures(s)
            + (",lapsed" if s.get("lapsed") else "")
            for s in stats.get("session_list", [])
        },
    }


def _engine_figures(session: dict) -> str:
    """A session's figures as its engine counts them (only an engine that reports them)."""
    names = ("engine_queried_tokens", "engine_hit_tokens", "engine_loaded_tokens")
    if not any(session.get(n) for n in names):
        return ""
    return "".join(f",{n}={session[n]}" for n in names)


def heading(name: str) -> str:
    """A section's name as its ``# Heading`` (``device_pool`` -> ``DevicePool``)."""
    return name.replace("_", " ").title().replace(" ", "")


def normal(name: str) -> str:
    """A section name as typed, compared loosely (``devicepool``, ``Device-Pool``)."""
    return name.replace("_", "").replace("-", "").lower()
