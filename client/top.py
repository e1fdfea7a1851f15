"""`hicache top` and `hicache stats --watch`: the daemon's stats, once per interval.

``Rates.between(before, after, seconds)`` turns two stats snapshots into what moved in between
(hit ratios per tier over the interval, and the rate of every counter of the figures table,
``hicache/observe/figures.py``); ``render_top`` lays out one screen of plain text (no curses:
readable in any terminal, a pipe or a log). Every figure it names is looked up in that table
(a renamed figure fails at import, not as a silent zero). Pure functions over stats dicts, so
a test renders a screen without a daemon.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TextIO

from hicache.observe.figures import BY_NAME, DISK_FIGURES, FIGURES, L3_FIGURES, Figure

CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen (only on a terminal)
MOVING_SHOWN = 16  # counters listed as moving, at most


def _counter(name: str, table: dict[str, Figure] = BY_NAME) -> str:
    """``name``, checked to be a counter of the figures table."""
    if name not in table or table[name].kind != "counter":
        raise KeyError(f"hicache top names {name!r}, which is no counter of the figures table")
    return name


_L3_BY_NAME = {f.name: f for f in (*L3_FIGURES, *DISK_FIGURES)}
HIT_DEVICE, HIT_HOST, MISS = map(_counter, ("hit_device_tokens", "hit_host_tokens", "miss_tokens"))
BACKUP, LOAD = _counter("backup_tokens"), _counter("load_tokens")
EVICTED = {tier: _counter(f"evicted_{tier}_tokens") for tier in ("device", "host")}
L3_READ, L3_WRITTEN = (_counter(n, _L3_BY_NAME) for n in ("read_bytes", "written_bytes"))
DISK_HITS, DISK_READ, DISK_WRITTEN = (
    _counter(f"store_disk_{n}", _L3_BY_NAME) for n in ("hits", "read_bytes", "written_bytes")
)


@dataclass(frozen=True)
class Rates:
    """What moved between two snapshots (ratios over the interval; None: nothing asked)."""

    seconds: float  # length of the interval
    queried_tokens_per_s: float
    hit_ratio_device: float | None  # device hits / tokens queried in the interval
    hit_ratio_host: float | None
    hit_ratio: float | None  # either tier
    backup_tokens_per_s: float
    load_tokens_per_s: float
    evicted_device_tokens_per_s: float
    evicted_host_tokens_per_s: float
    l3_read_bytes_per_s: float
    l3_written_bytes_per_s: float
    disk_hit_pages_per_s: float  # the disk tier's (0 without one)
    disk_read_bytes_per_s: float
    disk_written_bytes_per_s: float
    # every counter of the figures table that moved in the interval: (name, unit, per second),
    # in the table's order (the third tier's named ``l3.NAME``)
    moving: tuple[tuple[str, str, float], ...] = ()

    @staticmethod
    def between(before: dict, after: dict, seconds: float) -> Rates:
        def delta(key: str, section: str | None = None) -> float:
            a = after.get(section, {}) if section else after
            b = before.get(section, {}) if section else before
            return max(0, (a or {}).get(key, 0) - (b or {}).get(key, 0))

        dt = max(seconds, 1e-9)
        dev, host = delta(HIT_DEVICE), delta(HIT_HOST)
        asked = dev + host + delta(MISS)
        moving = [
            (f"{section}.{f.name}" if section else f.name, f.unit, delta(f.name, section) / dt)
            for section, table in ((None, FIGURES), ("l3", L3_FIGURES), ("l3", DISK_FIGURES))
            for f in table
            if f.kind == "counter"
        ]
        return Rates(
            seconds=seconds,
            queried_tokens_per_s=asked / dt,
            hit_ratio_device=dev / asked if asked else None,
            hit_ratio_host=host / asked if asked else None,
            hit_ratio=(dev + host) / asked if asked else None,
            backup_tokens_per_s=delta(BACKUP) / dt,
            load_tokens_per_s=delta(LOAD) / dt,
            evicted_device_tokens_per_s=delta(EVICTED["device"]) / dt,
            evicted_host_tokens_per_s=delta(EVICTED["host"]) / dt,
            l3_read_bytes_per_s=delta(L3_READ, "l3") / dt,
            l3_written_bytes_per_s=delta(L3_WRITTEN, "l3") / dt,
            disk_hit_pages_per_s=delta(DISK_HITS, "l3") / dt,
            disk_read_bytes_per_s=delta(DISK_READ, "l3") / dt,
            disk_written_bytes_per_s=delta(DISK_WRITTEN, "l3") / dt,
            moving=tuple(m for m in moving if m[2] > 0),
        )


def _ratio(value: float | None) -> str:
    return "    -" if value is None else f"{value:5.3f}"


def _overall(stats: dict, key: str) -> float | None:
    asked = sum(stats.get(k, 0) for k in (HIT_DEVICE, HIT_HOST, MISS))
    if not asked:
        return None
    if key == "all":
        return (stats.get(HIT_DEVICE, 0) + stats.get(HIT_HOST, 0)) / asked
    return stats.get(key, 0) / asked


def _tokens(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}B"


def render_top(stats: dict, rates: Rates | None) -> str:
    """One screen: hit ratios (last interval and overall), tiers, transfers, sessions."""
    r = rates
    lines = [
        f"hicache top - pid {stats.get('pid', '?')}, up {stats.get('uptime_s', 0):.0f} s, "
        f"{stats.get('sessions', 0)} sessions ({stats.get('sessions_quarantined', 0)} "
        f"quarantined), "
        + (f"interval {r.seconds:.1f} s" if r else "first sample: rates next time"),
        "",
        "hit ratio        interval  overall",
        f"  device           {_ratio(r.hit_ratio_device if r else None)}    "
        f"{_ratio(_overall(stats, HIT_DEVICE))}",
        f"  host             {_ratio(r.hit_ratio_host if r else None)}    "
        f"{_ratio(_overall(stats, HIT_HOST))}",
        f"  either           {_ratio(r.hit_ratio if r else None)}    "
        f"{_ratio(_overall(stats, 'all'))}",
        f"  queried tokens/s {_tokens(r.queried_tokens_per_s) if r else '-':>8}",
        "",
        "tier       cached  capacity  used  protected  evicted/s",
    ]
    for tier in ("device", "host"):
        cap = stats.get(f"{tier}_capacity_tokens", 0)
        cached = stats.get(f"{tier}_cached_tokens", 0)
        used = (cap - stats.get(f"{tier}_free_tokens", cap)) / cap if cap else 0.0
        protected = stats.get(f"{tier}_protected_tokens", 0)
        evicted = getattr(r, f"evicted_{tier}_tokens_per_s") if r else 0.0
        lines.append(
            f"  {tier:<7}{_tokens(cached):>8}{_tokens(cap):>10}{used:6.0%}"
            f"{_tokens(protected):>11}{_tokens(evicted):>11}"
        )
    lines += [
        "",
        f"transfers in flight {stats.get('inflight_transfers', 0)}   "
        f"backup {_tokens(r.backup_tokens_per_s) if r else '-'} tok/s   "
        f"load {_tokens(r.load_tokens_per_s) if r else '-'} tok/s",
    ]
    l3 = stats.get("l3")
    if l3:
        lines.append(
            f"l3 {l3.get('breaker', '?')}   read {_bytes(r.l3_read_bytes_per_s) if r else '-'}/s   "
            f"written {_bytes(r.l3_written_bytes_per_s) if r else '-'}/s   "
            f"queued {l3.get('queued_pages', 0)} pages"
        )
    if l3 and "store_disk_capacity_bytes" in l3:
        lines.append(_disk_line(l3, r))
    if r and r.moving:
        lines += ["", "counters moving (per s)"]
        for name, unit, per_s in r.moving[:MOVING_SHOWN]:
            value = _bytes(per_s) if unit == "bytes" else _tokens(per_s)
            lines.append(f"  {name:<34}{value:>9} {'' if unit == 'bytes' else unit}".rstrip())
        if len(r.moving) > MOVING_SHOWN:
            lines.append(f"  ... {len(r.moving) - MOVING_SHOWN} more (hicache stats --json)")
    sessions = stats.get("session_list", [])
    if sessions:
        lines += ["", "session  client                 owned  locks  hit ratio"]
        for s in sessions[:10]:
            lines.append(
                f"  {s['id']:<6} {str(s['client'])[:20]:<20} {s['owned_pages']:>7} "
                f"{s['locks']:>6}  {_ratio(_share(s))}"
            )
    return "\n".join(lines)


def _disk_line(l3: dict, r: Rates | None) -> str:
    """The disk tier: held of capacity, its rates over the interval, the write budget left."""
    cap, held = l3.get("store_disk_capacity_bytes", 0), l3.get("store_disk_held_bytes", 0)
    used = f"{held / cap:.0%}" if cap else "-"

    def rate(value: float, unit: Callable[[float], str]) -> str:
        return unit(value) if r else "-"

    return (
        f"disk   held {_bytes(held)} of {_bytes(cap)} ({used})   "
        f"hits {rate(r.disk_hit_pages_per_s if r else 0, _tokens)} pages/s   "
        f"read {rate(r.disk_read_bytes_per_s if r else 0, _bytes)}/s   "
        f"written {rate(r.disk_written_bytes_per_s if r else 0, _bytes)}/s   "
        f"budget left {_bytes(l3.get('store_disk_budget_left_bytes', 0))}"
    )


def _share(session: dict) -> float | None:
    asked = session.get("queried_tokens", 0)
    return session.get("hit_tokens", 0) / asked if asked else None


def watch(
    fetch: Callable[[], dict],
    interval: float,
    count: int | None,
    out: TextIO = sys.stdout,
    as_json: bool = False,
    screen: bool = True,
    stats_only: bool = False,
) -> None:
    """Print a sample every ``interval`` seconds, ``count`` times (None: until interrupted).
    ``stats_only``: the raw stats (`stats --watch`); else the top screen (its rates from the
    previous sample). ``screen``: clear the terminal before each (top on a terminal)."""
    before: dict | None = None  # the previous sample
    t_before, n = 0.0, 0
    while count is None or n < count:
        if n:
            time.sleep(interval)
        stats, now = fetch(), time.monotonic()
        rates = None if before is None else Rates.between(before, stats, now - t_before)
        if stats_only:
            text = json.dumps(stats, sort_keys=True, indent=None if as_json else 2)
        elif as_json:
            text = json.dumps({"stats": stats, "rates": rates and asdict(rates)}, sort_keys=True)
        else:
            text = (CLEAR if screen else "") + render_top(stats, rates)
        print(text, file=out, flush=True)
        before, t_before, n = stats, now, n + 1


def render_shape(shape: dict) -> str:
    """`hicache tree`: per namespace its size, then its heaviest shared prefixes."""
    lines = [f"# Tree\nnodes:{shape['nodes']}\ntokens:{shape['tokens']}"]
    if "disk_tokens" in shape:  # (what the disk holds, the tree's or not)
        lines.append(f"disk_tokens:{shape['disk_tokens']}")
    for ns in shape["namespaces"]:
        lines.append(
            f"\n# Namespace {ns['namespace'] or '(default)'}\n"
            f"nodes:{ns['nodes']}\ntokens:{ns['tokens']}\n"
            f"device_tokens:{ns['device_tokens']}\nhost_tokens:{ns['host_tokens']}\n"
            f"stored_tokens:{ns['stored_tokens']}\nhits:{ns['hits']}"
        )
        lines.append("prefix_len  below_tokens  branches  hits  tiers  first tokens")
        for p in ns["prefixes"]:
            head = " ".join(str(t) for t in p["head"])
            lines.append(
                f"{p['prefix_tokens']:>10}  {p['subtree_tokens']:>12}  {p['branches']:>8}  "
                f"{p['hits']:>4}  {p['tiers']:<5}  {head} ..."
            )
    if shape.get("truncated"):
        lines.append(f"\n(top {shape['top']} prefixes per namespace; --top for more)")
    return "\n".join(lines)
