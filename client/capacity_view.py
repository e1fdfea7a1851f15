"""`hicache capacity`: the daemon's hit-ratio-against-size estimate as a table, and a plot."""

from __future__ import annotations

from typing import Any


def render_capacity(report: dict[str, Any]) -> str:
    """Redis-INFO-like: the estimator's state, then one row per size factor."""
    est = report["estimator"]
    ps = report["page_size"]
    lines = [
        "# Capacity",
        f"device_pages:{report['device_pages']}",
        f"host_pages:{report['host_pages']}",
        f"page_size:{ps}",
        f"requests_seen:{est['requests']}",
        f"sampled_pages:{est['samples']}",
        f"sampling_rate:{est['rate']:.4f}",
        f"estimator_bytes:{est['memory_bytes']}",
        f"dropped_requests:{report['dropped_requests']}",
        "",
        "factor  device_tokens  host_tokens  device_hit  host_hit  total_hit",
    ]
    for p in report["points"]:
        mark = "  <- today" if p["factor"] == 1 else ""
        lines.append(
            f"{p['factor']:>5g}x  {p['device_pages'] * ps:>13}  {p['host_pages'] * ps:>11}  "
            f"{p['device_hit']:>10.3f}  {p['host_hit']:>8.3f}  {p['total_hit']:>9.3f}{mark}"
        )
    disk = report.get("disk_pages", 0)
    if "disk_points" in report:
        unit = "today's disk" if disk else "a disk the host pool's size"
        lines += [
            "",
            f"# Disk (under the host pool; factors of {unit}; admission all)",
            f"disk_pages:{disk}",
            "factor    disk_tokens  total_hit",
        ]
        for p in report["disk_points"]:
            mark = "  <- today" if p["factor"] == 1 and disk else ""
            lines.append(
                f"{p['factor']:>5g}x  {p['disk_pages'] * ps:>13}  {p['total_hit']:>9.3f}{mark}"
            )
    lines += ["", f"recommendation:{report['recommendation'] or _not_yet(report)}"]
    return "\n".join(lines)


def _not_yet(report: dict[str, Any]) -> str:
    """Why there is no recommendation: the traffic counted is less than today's host pool."""
    seen, needed = report["estimator"]["accesses"], report.get("accesses_needed", 0)
    if not seen:
        return "no traffic seen yet"
    return (
        f"none yet: {seen} page accesses counted, {needed} needed (today's host pool; "
        f"until then the curve is cold misses)"
    )


def plot_capacity(report: dict[str, Any], path: str) -> None:
    """Hit ratios against size factor, one line per tier (needs matplotlib: hicache[plot])."""
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit(
            "hicache capacity --plot needs matplotlib: pip install matplotlib"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = report["points"]
    x = [p["factor"] for p in pts]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(x, [p["device_hit"] for p in pts], marker="o", label="device tier")
    ax.plot(x, [p["total_hit"] for p in pts], marker="o", label="device + host tiers")
    disk = report.get("disk_points") or []
    if disk:
        what = "today's host + disk at" if report.get("disk_pages") else "today's host + a disk,"
        ax.plot([p["factor"] for p in disk], [p["total_hit"] for p in disk], marker="o",
                label=f"{what} x its size")  # fmt: skip
    ax.axvline(1.0, color="grey", linestyle=":", label="today")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size relative to today's")
    ax.set_ylabel("hit ratio (tokens)")
    ax.set_ylim(0, 1)
    ax.set_title("hicache: hit ratio against capacity (SHARDS estimate)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
