"""A disk hit's latency against a host hit's, through the daemon (``python -m
scripts.bench_disk --part latency``).

Each sample is a fresh prompt of 1 or 64 pages, inserted, then served twice: once from the host
pool and once from the disk (the host pool evicted in between; the disk reads with O_DIRECT, so
no page cache answers for it). What is timed is what an engine waits for before it can use the
prompt's KV:

- a daemon with its own device pool (``--device-tokens``): ``match_prefix`` and ``load_back``
  into the device pool (a disk hit's match waits for the pages to reach the host pool first);
- a daemon for engines (``--device-tier engine``, as vLLM and SGLang run it): ``match_prefix``
  alone (the pool it answers from is the engine's to read; a disk hit's match waits for the
  pages to reach it).

Two page shapes: the end-to-end model's (16 tokens of 64 KiB) and one of an 8B model
(32 layers, 8 KV heads of 128, bf16: 16 tokens of 2 MiB). Samples alternate host and disk on
the same prompt, so the drive's drift falls on both; the extra latency is the median of the
per-sample differences.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from hicache.client import HiCacheClient
from hicache.daemon.launch import start_daemon, stop_daemon
from hicache.memory import EngineLayout

PAGE = 16  # tokens per page
SHAPES = {  # name: (layers, KV heads, head size, dtype, bytes per element)
    "64KiB": (4, 4, 32, "float32", 4),
    "2MiB": (32, 8, 128, "bfloat16", 2),
}
PROMPT_PAGES = (1, 64)
ALL = 1 << 30  # tokens to evict: every unlocked one of the tier (its LRU is another prompt)
SETTLE_S = 30.0  # the longest a sample waits for the disk to hold what was written


def _wait_written(hc: HiCacheClient, pages: int) -> None:
    """Until the disk holds ``pages`` more values than before and nothing is queued."""
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        l3 = hc.stats()["l3"]
        held = l3.get("store_disk_held_values", 0)  # (absent until the disk has opened)
        if not l3["queued_pages"] and held >= pages:
            return
        time.sleep(0.005)
    raise RuntimeError("disk_latency: the disk did not take the prompt's pages in time")


def _sample(hc: HiCacheClient, tokens: np.ndarray, engine: bool, held: int) -> tuple[float, float]:
    """(host hit s, disk hit s) for ``tokens``, inserted here first."""
    m = hc.match_prefix(tokens)
    hc.insert(tokens, hc.alloc(len(tokens)))
    hc.release(m)
    _wait_written(hc, held)
    if not engine:
        hc.evict(device_tokens=ALL)
    times = []
    for tier in ("host", "disk"):
        if tier == "disk":
            hc.evict(host_tokens=ALL)
            read = hc.stats()["l3"]["read_pages"]
        start = time.perf_counter()
        m = hc.match_prefix(tokens)
        slots = None if engine else hc.load_back(m)
        times.append(time.perf_counter() - start)
        try:
            found = m.device_hit_length + (len(slots) if slots is not None else m.host_hit_length)
            if found != len(tokens):
                raise RuntimeError(f"disk_latency: a {tier} hit of {found} of {len(tokens)}")
            if tier == "disk" and hc.stats()["l3"]["read_pages"] - read != len(tokens) // PAGE:
                raise RuntimeError("disk_latency: the disk hit was not read from the disk")
        finally:
            hc.release(m)
        if not engine:
            hc.evict(device_tokens=ALL)
    return times[0], times[1]


def _daemon_flags(shape: str, engine: bool, tokens: int, folder: Path) -> list[str]:
    layers, heads, head, dtype, _ = SHAPES[shape]
    disk = [
        "--disk", str(folder), "--disk-bytes", "8GiB", "--disk-write-budget", "1TiB",
        "--disk-admission", "all", "--l3-model", f"latency-{shape}", "--keep-host", "false",
    ]  # fmt: skip
    if engine:
        _, _, _, _, size = SHAPES[shape]
        page_bytes = layers * 2 * PAGE * heads * head * size
        return ["--device-tier", "engine", "--host-bytes", str(page_bytes * tokens // PAGE), *disk]
    model = [
        "--num-layers", str(layers), "--num-kv-heads", str(heads), "--head-dim", str(head),
        "--dtype", dtype, "--page-size", str(PAGE), "--load-back-threshold", str(PAGE),
    ]  # fmt: skip
    return [*model, "--device-tokens", str(tokens), "--host-tokens", str(2 * tokens), *disk]


def run(samples: int, where: Path | None = None, shapes: tuple[str, ...] = tuple(SHAPES)) -> dict:
    """Each of ``shapes``, both kinds of daemon, both prompt lengths; ``samples`` pairs each.
    RuntimeError where a host hit is not whole or a disk hit was not read from the disk."""
    out: dict[str, Any] = {}
    rng = np.random.default_rng(5)
    for shape in shapes:
        for engine in (False, True):
            kind = "engine" if engine else "own"
            tokens = 2 * PAGE * max(PROMPT_PAGES)
            with tempfile.TemporaryDirectory(prefix="hicache-bench-latency-", dir=where) as tmp:
                endpoint = f"ipc://{tmp}/d.sock"
                proc = start_daemon(endpoint, *_daemon_flags(shape, engine, tokens, Path(tmp)))
                try:
                    with HiCacheClient(endpoint, name="latency", admin=True, timeout_s=60) as hc:
                        if engine:
                            layers, heads, head, dtype, _ = SHAPES[shape]
                            hc.register_layout(EngineLayout(
                                model=f"latency-{shape}", num_layers=layers, num_kv_heads=heads,
                                head_size=head, dtype=dtype, block_size=PAGE,
                                block_shape=(heads, 2, PAGE, head), backend="cpu",
                            ))  # fmt: skip
                        held = 0
                        for pages in PROMPT_PAGES:
                            pairs = []
                            for _ in range(samples):
                                prompt = rng.integers(1, 1 << 20, pages * PAGE).astype(np.int32)
                                held += pages
                                pairs.append(_sample(hc, prompt, engine, held))
                            out[f"{shape}_{kind}_{pages}"] = _row(shape, kind, pages, pairs)
                finally:
                    stop_daemon(proc)
    return out


def _row(shape: str, kind: str, pages: int, pairs: list[tuple[float, float]]) -> dict[str, Any]:
    host = statistics.median(h for h, _ in pairs) * 1e3
    disk = statistics.median(d for _, d in pairs) * 1e3
    extra = statistics.median(d - h for h, d in pairs) * 1e3
    p90 = sorted(d for _, d in pairs)[int(0.9 * (len(pairs) - 1))] * 1e3
    label = "own device pool" if kind == "own" else "engine's pool"
    print(
        f"latency {shape:5s} pages, {label:15s}, {pages:2d}-page prompt: host hit {host:7.2f} ms, "
        f"disk hit {disk:7.2f} ms (p90 {p90:7.2f}), extra {extra:7.2f} ms "
        f"(disk / host {disk / host:5.1f}x), {len(pairs)} pairs",
        flush=True,
    )
    return {
        "host_ms": round(host, 3),
        "disk_ms": round(disk, 3),
        "disk_p90_ms": round(p90, 3),
        "extra_ms": round(extra, 3),
        "disk_vs_host": round(disk / host, 2),
        "pairs": len(pairs),
    }
