"""``disk:///PATH[,PATH...]?bytes=SIZE[&budget=SIZE]``: a disk tier's folders (absolute, one
per drive), its size over all of them and its write budget per day (default: ``bytes``, one
drive-write a day). Sizes as 512MiB, 4GiB, 2T or bytes (powers of 1024). Pure."""

from __future__ import annotations

import re
from typing import NamedTuple
from urllib.parse import parse_qs

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


class DiskUrl(NamedTuple):
    paths: list[str]
    capacity_bytes: int
    budget_bytes_per_day: int | None  # None: capacity_bytes


def size(raw: str, name: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(?:i?b)?\s*", raw, re.I)
    if m is None:
        raise ValueError(f"disk: {name}={raw!r} is not a size (e.g. 64GiB, 512MiB, 2T)")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def parse_disk_url(rest: str) -> DiskUrl:
    """What follows ``disk://``; ValueError naming the bad part."""
    where, _, query = rest.partition("?")
    paths = [p.strip() for p in where.split(",")]
    if not where or not all(p.startswith("/") for p in paths):
        raise ValueError(f"disk: {where!r}: expected absolute folders, disk:///PATH[,PATH...]")
    if len(set(paths)) != len(paths):
        raise ValueError("disk: a folder named twice")
    options = parse_qs(query, keep_blank_values=True, strict_parsing=bool(query))
    unknown = set(options) - {"bytes", "budget"}
    if unknown:
        raise ValueError(f"disk: unknown option {sorted(unknown)[0]!r} (bytes, budget)")
    if "bytes" not in options:
        raise ValueError("disk: give its size, disk:///PATH?bytes=SIZE")
    capacity = size(options["bytes"][-1], "bytes")
    budget = size(options["budget"][-1], "budget") if "budget" in options else None
    return DiskUrl(paths, capacity, budget)
