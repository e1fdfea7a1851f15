"""The third tier's daemon settings: one flag per L3Config field (``--l3-<field>``), plus the
store URL (``--l3``) and the stores' own options. Off unless ``--l3`` names a store."""

from __future__ import annotations

import dataclasses
from typing import Any

from hicache.l3 import L3Config, L3WritePolicy, PrefetchPolicy, check_url

_SKIP = {"url", "options"}
STORE_OPTIONS = ("segment_bytes", "local_host", "redis_pipeline", "store_timeout_s")
_KINDS = {"str": str, "int": int, "float": float}


def _fields() -> dict[str, tuple[type, Any, str]]:
    out: dict[str, tuple[type, Any, str]] = {
        "l3": (
            str,
            "",
            "the store under the host tier (off when empty): mooncake://HOST:PORT (a Mooncake "
            "master), redis://HOST:PORT[,HOST:PORT...] (a Redis Cluster, or one server), "
            "memory://NAME (in this process: tests)",
        )
    }
    choices = {
        "write_policy": [m.value for m in L3WritePolicy],
        "prefetch_policy": [m.value for m in PrefetchPolicy],
    }
    for f in dataclasses.fields(L3Config):
        if f.name in _SKIP:
            continue
        kind = _KINDS.get(str(f.type).split(" ")[0], str)
        default = f.default.value if hasattr(f.default, "value") else f.default
        if default is dataclasses.MISSING:
            default = ""
        help_ = f.metadata["help"]
        if f.name in choices:
            help_ = f"{help_} (one of: {', '.join(choices[f.name])})"
        out[f"l3_{f.name}"] = (kind, default, help_)
    out["l3_segment_bytes"] = (
        str,
        "256MiB",
        "mooncake: memory this daemon lends the store (0: a pure client of memory others "
        "lend); values placed in it vanish when the daemon stops",
    )
    out["l3_local_host"] = (
        str,
        "",
        "mooncake: the address other machines reach this daemon's segment at (default: the "
        "address of the interface that routes to the master)",
    )
    out["l3_redis_pipeline"] = (int, 8, "redis: commands per pipeline to one node")
    out["l3_store_timeout_s"] = (float, 1.0, "redis: seconds before a node counts as down")
    return out


L3_FIELDS = _fields()


def l3_config(values: dict[str, Any], parse_bytes: Any) -> L3Config | None:
    """The L3Config of resolved setting values (None when ``l3`` is empty); ValueError
    naming the setting."""
    url = str(values.get("l3") or "")
    if not url:
        return None
    check_url(url)
    if url.startswith("disk://"):  # (the folders are this node's: refused now, not later)
        from hicache.disk import FolderRefused, check_folder
        from hicache.disk.url import parse_disk_url

        for path in parse_disk_url(url[len("disk://") :]).paths:
            try:
                check_folder(path)
            except FolderRefused as exc:
                raise ValueError(f"l3: {exc}") from None
    kw = {
        name[3:]: values[name]
        for name in L3_FIELDS
        if name.startswith("l3_") and name[3:] not in STORE_OPTIONS
    }
    store_timeout = float(values["l3_store_timeout_s"])
    if not 0 < store_timeout <= 600:
        raise ValueError(f"l3_store_timeout_s: must be in (0, 600] seconds, got {store_timeout}")
    options = {
        "local_host": str(values["l3_local_host"]),
        "segment_bytes": parse_bytes(values["l3_segment_bytes"], "l3_segment_bytes"),
        "batch_pages": int(values["l3_redis_pipeline"]),
        "timeout_s": store_timeout,
    }
    return L3Config(url, options=options, **kw)
