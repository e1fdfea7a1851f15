"""Transfer benchmark (CPU): backup and load of N pages per host layout and copy path, in GB/s,
against a plain contiguous copy of the same number of bytes in the same run.

Paths: `reference` (per layer, one gather and one scatter over all pages) and `runs` (one slice
copy per run of pages consecutive on both sides). Two page patterns: `consecutive` (pages
allocated together, the usual case) and `scattered` (random pages on both sides, the worst
case). The last line is one JSON object; its headline ratios use the scattered pattern with the
path the transfer engine would pick.
"""

from __future__ import annotations

import json
import time

import numpy as np
import torch

from hicache import HiCacheConfig, fastpath
from hicache.kernels import (
    copy_pages_one_layer,
    copy_runs_one_layer,
    gather_scatter_one_layer,
    page_runs,
)
from hicache.pools import DevicePool, HostPool
from hicache.transfer import RUNS_WORTH_IT, TransferEngine

PAGES = 1024


def best_of(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def make_paths(dev, host, td, th, runs) -> dict:  # noqa: ANN001
    """(backup, load) callables per copy path, over all 8 layers."""
    back = [(b, a, n) for a, b, n in runs]

    def ref_backup() -> None:
        for layer in range(8):
            copy_pages_one_layer(dev.page_view, host.page_view, td, th, layer)

    def ref_load() -> None:
        for layer in range(8):
            copy_pages_one_layer(host.page_view, dev.page_view, th, td, layer)

    def runs_backup() -> None:
        for layer in range(8):
            copy_runs_one_layer(dev.page_view, host.page_view, runs, layer)

    def runs_load() -> None:
        for layer in range(8):
            copy_runs_one_layer(host.page_view, dev.page_view, back, layer)

    def rows_backup() -> None:
        for layer in range(8):
            if not gather_scatter_one_layer(dev.page_view, host.page_view, td, th, layer):
                copy_pages_one_layer(dev.page_view, host.page_view, td, th, layer)

    def rows_load() -> None:
        for layer in range(8):
            if not gather_scatter_one_layer(host.page_view, dev.page_view, th, td, layer):
                copy_pages_one_layer(host.page_view, dev.page_view, th, td, layer)

    def c_rows(src, dst, si, di) -> None:  # noqa: ANN001
        for layer in range(8):
            if not TransferEngine._copy_rows_c(src, dst, si, di, layer):
                copy_pages_one_layer(src, dst, si, di, layer)

    return {
        "reference": (ref_backup, ref_load),
        "runs": (runs_backup, runs_load),
        "rows": (rows_backup, rows_load),
        "c_rows": (
            lambda: c_rows(dev.page_view, host.page_view, td, th),
            lambda: c_rows(host.page_view, dev.page_view, th, td),
        ),
    }


def measure(layout: str, ps: int) -> dict:
    cfg = HiCacheConfig(
        num_layers=8,
        num_kv_heads=4,
        head_dim=64,
        dtype="float16",
        page_size=ps,
        device_tokens=2 * PAGES * ps,
        host_layout=layout,
    )
    dev, host = DevicePool(cfg), HostPool(cfg)
    dev.buffer.fill_(1)
    nbytes = PAGES * cfg.page_size * cfg.token_bytes
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    base = nbytes / best_of(lambda: dst.copy_(src)) / 1e9
    rng = np.random.default_rng(0)
    patterns = {
        "consecutive": (np.arange(1, PAGES + 1), np.arange(PAGES)),
        "scattered": (
            rng.permutation(np.arange(1, 2 * PAGES))[:PAGES],
            rng.permutation(np.arange(host.num_pages))[:PAGES],
        ),
    }
    out = {"copy_gbps": base}
    for name, (d, h) in patterns.items():
        runs = page_runs(d, h)
        td, th = torch.from_numpy(d), torch.from_numpy(h)
        paths = make_paths(dev, host, td, th, runs)
        for path, (backup, load) in paths.items():
            out[f"{name}/{path}/backup"] = nbytes / best_of(backup) / 1e9
            out[f"{name}/{path}/load"] = nbytes / best_of(load) / 1e9
        out[f"{name}/engine_path"] = (
            "runs" if len(runs) * RUNS_WORTH_IT <= PAGES else "c_rows" if fastpath.USE_C else "rows"
        )
    return out


def main() -> None:
    headline = {}
    for ps in (1, 16):
        for layout in ("layer_first", "page_first", "page_first_direct"):
            r = measure(layout, ps)
            base = r["copy_gbps"]
            print(f"page_size={ps:<3} {layout:18s} plain copy {base:6.2f} GB/s")
            for name in ("consecutive", "scattered"):
                for path in ("reference", "runs", "rows", "c_rows"):
                    b, ld = r[f"{name}/{path}/backup"], r[f"{name}/{path}/load"]
                    print(
                        f"    {name:11s} {path:9s} backup {b:6.2f} GB/s ({b / base:.2f}x)  "
                        f"load {ld:6.2f} GB/s ({ld / base:.2f}x)"
                    )
            if ps == 16 and layout == "layer_first":
                path = r["scattered/engine_path"]
                headline = {
                    "cpu_backup_vs_copy_page16": round(r[f"scattered/{path}/backup"] / base, 3),
                    "cpu_load_vs_copy_page16": round(r[f"scattered/{path}/load"] / base, 3),
                    "cpu_backup_vs_copy_page16_consecutive": round(
                        r["consecutive/runs/backup"] / base, 3
                    ),
                    "cpu_load_vs_copy_page16_consecutive": round(
                        r["consecutive/runs/load"] / base, 3
                    ),
                }
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
