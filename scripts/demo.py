"""Demo: serve one multi-turn chat trace with a real (tiny, random) transformer whose KV lives
in hicache-daemon's pools: against a device-only daemon (``--host-tokens 0``), then against
the embedded default with its host tier and a disk under it (``--disk``, a temporary folder),
then once more after that daemon restarted cold (no host pool kept): the next round's prompts
come from the disk. Each daemon runs on a private socket and is stopped at the end.

While it works, a progress bar per phase goes to stderr. At the end, stdout has a side-by-side
table (what does not depend on machine load first, wall-clock last), a line about the plot,
and one JSON object on its last line::

    .venv/bin/python -m scripts.demo | tail -1 | python -m json.tool

With matplotlib installed (optional), hit ratios by tier over the run go to a PNG
(``--plot PATH``, default ``hicache-demo.png``; ``--no-plot`` skips it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TextIO

DEFAULT_PLOT = "hicache-demo.png"
WINDOW = 20  # requests in the plot's moving window


# ---- per-request counts (pure) ----
@dataclass(frozen=True)
class RequestCount:
    """Prompt tokens of one request, and where they came from."""

    prompt: int
    device: int  # found on the device
    host: int  # loaded back from the host (what was there before the request)
    recomputed: int  # prefilled by the model
    disk: int = 0  # read from the disk into the host for this request, then loaded back


def count_request(
    prompt: int, computed_from: int, device_hit: int, host_hit: int, disk_read: int = 0
) -> RequestCount:
    """Counts over the prompt only: the engine also serves the answer's tokens (as if just
    generated), whose hits are not prompt hits. ``disk_read``: tokens the daemon read from its
    disk for the request (part of its host hit)."""
    device = min(device_hit, prompt)
    host = min(host_hit, prompt - device)
    disk = min(disk_read, host)
    return RequestCount(
        prompt=prompt,
        device=device,
        host=host - disk,
        recomputed=prompt - min(computed_from, prompt),
        disk=disk,
    )


@dataclass
class RunResult:
    """One phase of the demo: every request's counts and the daemon's final stats."""

    label: str
    counts: list[RequestCount] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    model_s: float = 0.0  # seconds in the model's forward passes
    loaded: int = 0  # tokens the engine loaded back from the host, prompts and answers
    seconds: float = 0.0  # the whole phase, engine start included

    @property
    def prompt(self) -> int:
        return sum(c.prompt for c in self.counts)

    @property
    def device(self) -> int:
        return sum(c.device for c in self.counts)

    @property
    def host(self) -> int:
        return sum(c.host for c in self.counts)

    @property
    def disk(self) -> int:
        return sum(c.disk for c in self.counts)

    @property
    def recomputed(self) -> int:
        return sum(c.recomputed for c in self.counts)

    def ratio(self, tokens: int) -> float:
        return tokens / self.prompt if self.prompt else 0.0


def hit_ratio_series(
    counts: Sequence[RequestCount], window: int | None = None
) -> dict[str, list[float]]:
    """Hit ratios after each request, token-weighted: over all requests so far (``window``
    None) or over the last ``window`` requests. Keys: device, host, disk, total."""
    out: dict[str, list[float]] = {"device": [], "host": [], "disk": [], "total": []}
    prompt = device = host = disk = 0
    for i, c in enumerate(counts):
        prompt, device, host, disk = (
            prompt + c.prompt, device + c.device, host + c.host, disk + c.disk
        )  # fmt: skip
        if window is not None and i >= window:
            old = counts[i - window]
            prompt, device = prompt - old.prompt, device - old.device
            host, disk = host - old.host, disk - old.disk
        p = max(prompt, 1)
        out["device"].append(device / p)
        out["host"].append(host / p)
        out["disk"].append(disk / p)
        out["total"].append((device + host + disk) / p)
    return out


# ---- progress (pure: a stream and a clock are passed in) ----
class Progress:
    """A progress bar: on a terminal one line redrawn with ``\\r``; elsewhere (CI logs, pipes)
    a plain line each time another tenth of the requests is done, so at most ten lines."""

    WIDTH = 24

    def __init__(
        self,
        label: str,
        total: int,
        stream: TextIO | None = None,
        tty: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.label, self.total = label, max(total, 1)
        self.stream = sys.stderr if stream is None else stream
        self.tty = self.stream.isatty() if tty is None else tty
        self.clock = clock
        self.start = clock()
        self._tenths = 0  # tenths of the run already printed (when not a terminal)
        self._drawn = False

    def line(self, done: int, hit_ratio: float) -> str:
        filled = self.WIDTH * done // self.total
        bar = "#" * filled + "." * (self.WIDTH - filled)
        return (
            f"{self.label:<12} [{bar}] {done:>{len(str(self.total))}}/{self.total} requests  "
            f"{self.clock() - self.start:6.1f}s  hit ratio {hit_ratio:.3f}"
        )

    def update(self, done: int, hit_ratio: float) -> None:
        if self.tty:
            self.stream.write("\r" + self.line(done, hit_ratio))
            self._drawn = True
        else:
            tenths = 10 * done // self.total
            if tenths <= self._tenths:
                return
            self._tenths = tenths
            self.stream.write(self.line(done, hit_ratio) + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()


# ---- the report (pure) ----
def reduction(device_only: RunResult, hicache: RunResult) -> float:
    """How many times fewer prompt tokens hicache computed."""
    return device_only.recomputed / max(hicache.recomputed, 1)


def render_table(
    device_only: RunResult, hicache: RunResult, restarted: RunResult | None = None
) -> str:
    """The headline, then a plain aligned table: work first (the same on any machine), then
    wall-clock, which depends on how busy the machine is. ``restarted``: a third column, the
    same requests after the hicache daemon restarted cold on its disk."""
    d, h = device_only, hicache
    red = reduction(d, h)
    runs = [d, h] if restarted is None else [d, h, restarted]

    def cells(value: Callable[[RunResult], str]) -> list[str]:
        return [value(r) for r in runs]

    def ratio(tokens: Callable[[RunResult], int]) -> list[str]:
        return cells(lambda r: f"{r.ratio(tokens(r)):.3f}")

    def stat(key: str) -> list[str]:
        return cells(lambda r: f"{r.stats.get(key, 0):,}")

    rows: list[list[str] | str] = [
        "# work (the same on any machine)",
        ["prompt tokens", *cells(lambda r: f"{r.prompt:,}")],
        ["prompt tokens computed", *cells(lambda r: f"{r.recomputed:,}")],
        ["hit ratio: device", *ratio(lambda r: r.device)],
        ["hit ratio: host", *ratio(lambda r: r.host)],
        ["hit ratio: disk", *ratio(lambda r: r.disk)],
        ["hit ratio: total", *ratio(lambda r: r.device + r.host + r.disk)],
        ["backups to host (tokens)", *stat("backup_tokens")],
        ["loads from host (tokens)", *stat("load_tokens")],
        ["  of them prompt tokens", *cells(lambda r: f"{r.host + r.disk:,}")],
        ["device evictions (tokens)", *stat("evicted_device_tokens")],
        ["integrity check", *cells(lambda r: str(r.stats.get("integrity", "?")))],
        "# wall-clock (depends on machine load, not only on the cache)",
        ["model seconds", *cells(lambda r: f"{r.model_s:.1f}")],
        ["phase seconds", *cells(lambda r: f"{r.seconds:.1f}")],
    ]
    head = ["", "device only", "hicache"] + ([] if restarted is None else ["restarted"])
    table = [r for r in rows if isinstance(r, list)] + [head]
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]

    def line(r: list[str]) -> str:
        return "  ".join(
            [f"{r[0]:<{widths[0]}}"] + [f"{c:>{w}}" for c, w in zip(r[1:], widths[1:], strict=True)]
        )

    lines = [
        f"prompt tokens computed: {d.recomputed:,} vs {h.recomputed:,} ({red:.2f}x fewer)",
        f"  device only vs hicache, the same {len(h.counts)} requests on the same model",
    ]
    if restarted is not None:
        lines.append(
            f"  restarted: hicache stopped and started again without its host pool, the same "
            f"requests: {restarted.ratio(restarted.disk):.3f} of their prompt tokens from its disk"
        )
    lines += ["", line(head)]
    lines += [r if isinstance(r, str) else line(r) for r in rows]
    return "\n".join(lines)


def summary(
    device_only: RunResult,
    hicache: RunResult,
    plot: str | None,
    restarted: RunResult | None = None,
) -> dict:
    """The last line of stdout, for scripts."""
    d, h = device_only, hicache
    out = {
        "requests": len(h.counts),
        "prompt_tokens": h.prompt,
        "recomputed_device_only": d.recomputed,
        "recomputed_hicache": h.recomputed,
        "recompute_reduction": round(reduction(d, h), 2),
        "hit_ratio_device": round(h.ratio(h.device), 3),
        "hit_ratio_host": round(h.ratio(h.host), 3),
        "hit_ratio_device_only": round(d.ratio(d.device), 3),
        "model_seconds_device_only": round(d.model_s, 1),
        "model_seconds_hicache": round(h.model_s, 1),
        "integrity": {"device_only": d.stats.get("integrity"), "hicache": h.stats.get("integrity")},
        "plot": plot,
    }
    if restarted is not None:
        r = restarted
        out["restarted"] = {
            "recomputed": r.recomputed,
            "hit_ratio_disk": round(r.ratio(r.disk), 3),
            "hit_ratio_total": round(r.ratio(r.device + r.host + r.disk), 3),
            "integrity": r.stats.get("integrity"),
        }
    return out


def plot_hit_ratios(
    device_only: RunResult,
    hicache: RunResult,
    path: str,
    window: int = WINDOW,
    restarted: RunResult | None = None,
) -> None:
    """A PNG of hit ratios over the run, over a moving window of requests (needs matplotlib);
    ``restarted``: the run after the restart, its disk's, host's and total shares."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = hit_ratio_series(hicache.counts, window)
    d = hit_ratio_series(device_only.counts, window)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    try:
        x = range(1, len(hicache.counts) + 1)
        ax.plot(x, h["total"], label="hicache: total", color="C0", linewidth=2)
        ax.plot(x, h["device"], label="hicache: device", color="C1")
        ax.plot(x, h["host"], label="hicache: host", color="C2")
        xd = range(1, len(device_only.counts) + 1)
        ax.plot(xd, d["device"], label="device only: device", color="C3", linestyle="--")
        if restarted is not None:
            r = hit_ratio_series(restarted.counts, window)
            xr = range(1, len(restarted.counts) + 1)
            ax.plot(xr, r["total"], label="restarted cold: total", color="C4", linewidth=2)
            ax.plot(xr, r["disk"], label="restarted cold: disk", color="C5")
            ax.plot(xr, r["host"], label="restarted cold: host", color="C2", linestyle=":")
        ax.set_xlabel("request")
        ax.set_ylabel(f"hit ratio (prompt tokens, last {window} requests)")
        ax.set_ylim(0, 1)
        ax.set_title("hicache demo: hit ratio by tier")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, frameon=False)
        fig.savefig(path, dpi=110, bbox_inches="tight")
    finally:
        plt.close(fig)


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


# ---- running it ----
def serve(
    endpoint: str, trace: Sequence, result: RunResult, progress: Progress, disk: bool = False
) -> None:
    """A real model (a tiny random Llama) computes only what the cache does not hold.
    ``disk``: the daemon has one (what it read for each request is asked of its stats)."""
    from hicache.client import HiCacheClient
    from scripts.ref_engine import ReferenceEngine

    def disk_pages(hc: HiCacheClient) -> int:
        return int((hc.stats().get("l3") or {}).get("adopted_pages", 0)) if disk else 0

    prompt = hits = 0
    try:
        with HiCacheClient(endpoint, name="demo-engine") as hc:
            engine = ReferenceEngine(hc)
            ps = hc.config.page_size
            progress.update(0, 0.0)
            read = disk_pages(hc)
            for i, req in enumerate(trace):
                served = engine.serve(req.finished)  # prompt + answer, as if just generated
                before, read = read, disk_pages(hc)
                c = count_request(
                    len(req.prompt), served.computed_from, served.device_hit, served.host_hit,
                    (read - before) * ps,
                )  # fmt: skip
                result.counts.append(c)
                result.model_s += served.model_s
                result.loaded += served.host_hit
                prompt, hits = prompt + c.prompt, hits + c.device + c.host + c.disk
                progress.update(i + 1, hits / max(prompt, 1))
            result.stats = hc.stats(check=True)
    finally:
        progress.close()  # an error then starts on a line of its own


def run_phase(
    tmp: str, label: str, flags: Sequence[str], trace: Sequence, disk: bool = False
) -> RunResult:
    from hicache.daemon.launch import start_daemon, stop_daemon

    print(f"{label}: starting hicache-daemon {' '.join(flags)}".rstrip(), file=sys.stderr)
    result = RunResult(label)
    t0 = time.perf_counter()
    endpoint = f"ipc://{os.path.join(tmp, 'demo.sock')}"
    proc = start_daemon(endpoint, *flags, "--keep-host", "false")  # a temporary endpoint
    try:
        serve(endpoint, trace, result, Progress(label, len(trace)), disk)
    finally:
        stop_daemon(proc)
    result.seconds = time.perf_counter() - t0
    return result


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m scripts.demo",
        description="Serve a chat trace with a tiny model whose KV lives in hicache-daemon, "
        "device-only and then with the host tier; compare.",
    )
    p.add_argument(
        "--plot",
        default=DEFAULT_PLOT,
        metavar="PATH",
        help=f"PNG of hit ratios by tier (needs matplotlib; default {DEFAULT_PLOT})",
    )
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    from hicache.workload import chat_trace

    # 24 conversations of 4 turns over 2 system prompts: a working set (~30k tokens) larger
    # than the embedded default's device pool (16k tokens), so the host tier matters.
    trace = chat_trace(
        n_systems=2,
        system_len=1024,
        n_convs=24,
        turns=4,
        user_len=150,
        answer_len=80,
        seed=1,
        vocab=512,
    )
    with tempfile.TemporaryDirectory(prefix="hicache-demo-") as tmp:
        device_only = run_phase(tmp, "device only", ("--host-tokens", "0"), trace)
        # the embedded default (host 4x device) with a disk under it (default admission)
        disk = ("--disk", os.path.join(tmp, "disk"), "--disk-bytes", "1GiB", "--l3-model", "demo")
        hicache = run_phase(tmp, "hicache", disk, trace, disk=True)
        restarted = run_phase(tmp, "restarted", disk, trace, disk=True)  # its pool not kept

    print()
    print(render_table(device_only, hicache, restarted))
    print()
    plot = None
    if args.no_plot:
        print("plot: skipped (--no-plot)")
    elif not have_matplotlib():
        print("plot: skipped, matplotlib is not installed (pip install matplotlib)")
    else:
        plot_hit_ratios(device_only, hicache, args.plot, restarted=restarted)
        plot = os.path.abspath(args.plot)
        print(f"plot: {plot} (hit ratios by tier over the last {WINDOW} requests)")
    print(json.dumps(summary(device_only, hicache, plot, restarted)), flush=True)
    unreconciled = unreconciled_loads([device_only, hicache, restarted])
    if unreconciled:
        raise SystemExit(f"demo: the daemon's counts disagree with the engine's: {unreconciled}")


def unreconciled_loads(runs: Sequence[RunResult]) -> list[str]:
    """The runs whose daemon counted other loads (``load_tokens``) than the engine made, and
    those whose integrity check failed (empty: every count adds up). Pure."""
    out = []
    for r in runs:
        if r.stats.get("load_tokens", 0) != r.loaded:
            out.append(f"{r.label}: load_tokens {r.stats.get('load_tokens')} != {r.loaded} loaded")
        if r.stats.get("integrity") != "ok":
            out.append(f"{r.label}: integrity {r.stats.get('integrity')!r}")
    return out


if __name__ == "__main__":
    main()
