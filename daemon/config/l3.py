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
            "disk:///PATH[,PATH...]?bytes=SIZE (this node's drives: --disk says it too), "
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
    out["disk"] = (
        str,
        "",
        "folders on this node's drives under the host tier, one per drive, comma-separated "
        "(off when empty; with --l3, that store sits under the disk): docs/disk-tier.md",
    )
    out["disk_bytes"] = (str, "", "the disk tier's size over all its folders (e.g. 2TiB)")
    out["disk_admission"] = (
        str,
        "reused",
        "which pages go to the disk (one of: reused: pages hit at least once while cached, or "
        "a longer prompt through them, or computed again after they left the pool, and every "
        "page while at least half of the pages that left the pool unreused came back; "
        "reused-strict: without that last rule; all; none: the disk is only read)",
    )
    out["disk_write_budget"] = (
        str,
        "",
        "bytes the disk tier may write in any 24 hours (default: --disk-bytes, one drive-write "
        "a day); past it, writes are refused and counted",
    )
    out["l3_store_timeout_s"] = (float, 1.0, "redis: seconds before a node counts as down")
    return out


L3_FIELDS = _fields()


def l3_config(values: dict[str, Any], parse_bytes: Any) -> L3Config | None:
    """The L3Config of resolved setting values (None when ``l3`` is empty); ValueError
    naming the setting."""
    url = str(values.get("l3") or "")
    disk = _disk(values, parse_bytes)
    if disk is not None and not url:  # the disk alone: the tier's store
        url = "disk://" + ",".join(disk.paths) + f"?bytes={disk.capacity_bytes}"
        if disk.budget_bytes_per_day is not None:
            url += f"&budget={disk.budget_bytes_per_day}"
        disk = None
    if not url:
        return None
    check_url(url)
    if url.startswith("disk://"):
        if disk is not None:
            raise ValueError("disk: --disk with --l3 names a remote store under it, not a disk")
        from hicache.disk.url import parse_disk_url

        _check_folders(parse_disk_url(url[len("disk://") :]).paths)
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
    if disk is not None:
        options["disk"] = disk
    if values.get("disk"):
        kw.update(_admission(values))
    if (values.get("disk") or url.startswith("disk://")) and not float(kw["close_drain_s"]):
        kw["close_drain_s"] = DISK_DRAIN_S  # (a local drive: a stop lets its writes land)
    return L3Config(url, options=options, **kw)


DISK_DRAIN_S = 10.0  # a disk tier's writes at a clean stop: at most this long

ADMISSION: dict[str, dict[str, Any]] = {  # --disk-admission: the tier's write policy
    # (a node counts 1 at creation: reused once is 2)
    "reused": {"write_policy": "write_through_adaptive", "write_threshold": 2},
    "reused-strict": {"write_policy": "write_through_selective", "write_threshold": 2},
    "all": {"write_policy": "write_through"},
    "none": {"write_policy": "none"},
}


def _admission(values: dict[str, Any]) -> dict[str, Any]:
    """The write policy ``--disk-admission`` makes (one way of saying it: a write policy of
    the third tier's own given too is refused)."""
    choice = str(values.get("disk_admission") or "reused")
    if choice not in ADMISSION:
        raise ValueError(f"disk_admission: {choice!r} is not one of {', '.join(ADMISSION)}")
    default = L3_FIELDS["l3_write_policy"][1]
    if str(values.get("l3_write_policy") or default) != default:
        raise ValueError(
            "disk_admission: with --disk, say which pages go down with --disk-admission "
            f"({', '.join(ADMISSION)}), not --l3-write-policy"
        )
    return ADMISSION[choice]


def _disk(values: dict[str, Any], parse_bytes: Any) -> Any:
    """The DiskUrl of ``--disk``/``--disk-bytes``/``--disk-write-budget`` (None: no disk)."""
    from hicache.disk.url import DiskUrl

    where = str(values.get("disk") or "")
    if not where:
        if values.get("disk_bytes") or values.get("disk_write_budget"):
            raise ValueError("disk_bytes: a size for --disk, which names no folder")
        return None
    paths = [p.strip() for p in where.split(",")]
    if not all(p.startswith("/") for p in paths) or len(set(paths)) != len(paths):
        raise ValueError(f"disk: {where!r}: expected distinct absolute folders, comma-separated")
    if not values.get("disk_bytes"):
        raise ValueError("disk_bytes: give the disk tier's size (--disk-bytes 2TiB)")
    capacity = parse_bytes(values["disk_bytes"], "disk_bytes")
    budget = values.get("disk_write_budget")
    _check_folders(paths)
    return DiskUrl(paths, capacity, parse_bytes(budget, "disk_write_budget") if budget else None)


def _check_folders(paths: list[str]) -> None:
    """The folders are this node's: refused at start, not at the first write."""
    from hicache.disk import FolderRefused, check_folder

    for path in paths:
        try:
            check_folder(path)
        except FolderRefused as exc:
            raise ValueError(f"l3: {exc}") from None
