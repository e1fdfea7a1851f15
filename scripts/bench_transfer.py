"""Transfer benchmark: backup and load of N pages per host layout and backend, in GB/s, against a
plain contiguous copy of the same number of bytes in the same run.

CPU: the plain copy is torch's ``copy_`` of one contiguous buffer (the yardstick the issue
names); glibc ``memcpy`` of the same bytes is printed beside it. Backends: `reference` (torch
index_select/index_copy_ per layer, the naive way), `cpu` (the C page copy) and `direct` (one
slice copy per run), over two page patterns: `consecutive` (pages allocated together, the usual
case) and `scattered` (random pages on both sides, the worst case). GPU (when CUDA is present):
`kernel` (Triton, reading and writing pinned host memory) and `direct` against one pinned
cudaMemcpyAsync of the same bytes, both directions. The last line is one JSON object.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from hicache import HiCacheConfig, HiRadixCache, host_snapshot
from hicache.kernels import copy_pages_one_layer, page_runs
from hicache.memory import DevicePool, HostPool, PageSums
from hicache.transfers import Copier, CpuCopier, DirectCopier, KernelCopier

PAGES = 1024


def best_of(fn: Callable, sync: Callable[[], None] = lambda: None, repeats: int = 5) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)


class Reference(Copier):
    name = "reference"

    def copy_layer(self, src, dst, sp, dp, runs, layer) -> None:  # noqa: ANN001
        copy_pages_one_layer(src, dst, sp, dp, layer)


def patterns(host_pages: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return {
        "consecutive": (np.arange(1, PAGES + 1), np.arange(PAGES)),
        "scattered": (
            rng.permutation(np.arange(1, 2 * PAGES))[:PAGES],
            rng.permutation(np.arange(host_pages))[:PAGES],
        ),
    }


def config(layout: str, ps: int, device: str = "cpu") -> HiCacheConfig:
    return HiCacheConfig(
        num_layers=8,
        num_kv_heads=4,
        head_dim=64,
        dtype="float16",
        page_size=ps,
        device=device,
        device_tokens=2 * PAGES * ps,
        host_layout=layout,
    )


def measure(dev, host, copiers, device_pages, sync=lambda: None) -> dict:  # noqa: ANN001
    out = {}
    for name, (d, h) in patterns(host.num_pages).items():
        runs = page_runs(d, h)
        back = [(b, a, n) for a, b, n in runs]
        td = torch.from_numpy(d).to(device_pages)
        th = torch.from_numpy(h).to(device_pages)
        for copier in copiers:
            nbytes = PAGES * dev.page_bytes
            b = best_of(partial(copier.copy_all, dev.page_view, host.page_view, td, th, runs), sync)
            ld = best_of(
                partial(copier.copy_all, host.page_view, dev.page_view, th, td, back), sync
            )
            out[f"{name}/{copier.name}"] = (nbytes / b / 1e9, nbytes / ld / 1e9)
    return out


def cpu_table() -> dict:
    headline = {}
    for ps in (1, 16):
        for layout in ("layer_first", "page_first", "page_first_direct"):
            cfg = config(layout, ps)
            dev, host = DevicePool(cfg), HostPool(cfg)
            dev.buffer.fill_(1)
            nbytes = PAGES * dev.page_bytes
            src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
            base = nbytes / best_of(partial(dst.copy_, src)) / 1e9
            # glibc memcpy (one thread, non-temporal stores at this size): a second yardstick
            memcpy = (
                nbytes
                / best_of(partial(ctypes.memmove, dst.data_ptr(), src.data_ptr(), nbytes))
                / 1e9
            )
            r = measure(dev, host, [Reference(), CpuCopier(), DirectCopier()], "cpu")
            print(f"page_size={ps:<3} {layout:18s} plain copy {base:6.2f} GB/s", end="")
            print(f"  memcpy {memcpy:6.2f} GB/s")
            for key, (b, ld) in r.items():
                print(
                    f"    {key:22s} backup {b:6.2f} GB/s ({b / base:.2f}x)  "
                    f"load {ld:6.2f} GB/s ({ld / base:.2f}x)"
                )
            if ps == 16:
                b, ld = r["scattered/cpu"]
                tag = "" if layout == "layer_first" else f"_{layout}"
                headline[f"cpu_backup_vs_copy_page16{tag}"] = round(b / base, 3)
                headline[f"cpu_load_vs_copy_page16{tag}"] = round(ld / base, 3)
                if not tag:
                    headline["cpu_backup_vs_memcpy_page16"] = round(b / memcpy, 3)
                    headline["cpu_load_vs_memcpy_page16"] = round(ld / memcpy, 3)
            dev.close()
            host.close()
    return headline


def gpu_table() -> dict:
    """Kernel and direct copies between the GPU pool and pinned host memory, page 16 and 64,
    every host layout, both page patterns, as ratios to one pinned cudaMemcpyAsync of the same
    bytes in the same run."""
    headline = {}
    for ps in (16, 64):
        for layout in ("layer_first", "page_first", "page_first_direct"):
            cfg = config(layout, ps, device="cuda")
            dev, host = DevicePool(cfg), HostPool(cfg)
            nbytes = PAGES * dev.page_bytes
            g = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            h = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
            sync = torch.cuda.synchronize
            d2h = nbytes / best_of(partial(h.copy_, g, non_blocking=True), sync) / 1e9
            h2d = nbytes / best_of(partial(g.copy_, h, non_blocking=True), sync) / 1e9
            print(f"GPU page_size={ps:<3} {layout:18s} pinned memcpy d2h {d2h:6.2f} "
                  f"h2d {h2d:6.2f} GB/s")  # fmt: skip
            r = measure(dev, host, [KernelCopier(), DirectCopier()], "cuda", sync)
            for key, (b, ld) in r.items():
                print(
                    f"    {key:22s} backup {b:6.2f} GB/s ({b / d2h:.2f}x)  "
                    f"load {ld:6.2f} GB/s ({ld / h2d:.2f}x)"
                )
                tag = f"page{ps}" + ("" if layout == "layer_first" else f"_{layout}")
                pattern, backend = key.split("/")
                name = f"gpu_{backend}_{pattern}_{tag}"
                headline[f"{name}_backup"] = round(b / d2h, 3)
                headline[f"{name}_load"] = round(ld / h2d, 3)
            dev.close()
            host.close()
    headline.update(layerwise_wait())
    return headline


def layerwise_wait() -> dict:
    """A layer-wise load (one kernel per layer on a side stream, an event after each): how long
    until layer 0 may be read, against the whole load. The forward pass overlaps the rest."""
    cfg = config("layer_first", 16, device="cuda")
    dev, host = DevicePool(cfg), HostPool(cfg)
    d, h = patterns(host.num_pages)["scattered"]
    td, th = torch.from_numpy(d).cuda(), torch.from_numpy(h).cuda()
    copier, stream = KernelCopier(), torch.cuda.Stream()
    firsts, wholes = [], []
    for _ in range(6):
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(cfg.num_layers)]
        with torch.cuda.stream(stream):
            start.record(stream)
            for layer, event in enumerate(events):
                copier.copy_layer(host.page_view, dev.page_view, th, td, [], layer)
                event.record(stream)
        torch.cuda.synchronize()
        firsts.append(start.elapsed_time(events[0]))
        wholes.append(start.elapsed_time(events[-1]))
    first, whole = min(firsts[1:]), min(wholes[1:])
    print(f"layer-wise load of {PAGES} pages x {cfg.num_layers} layers: layer 0 readable after "
          f"{first:.3f} ms, the whole load {whole:.3f} ms ({first / whole:.2f})")  # fmt: skip
    dev.close()
    host.close()
    return {"gpu_layerwise_first_vs_whole": round(first / whole, 3)}


def checksum_cost() -> dict:
    """verify_pages: sealing the pages of a backup (or checking those of a load) against the
    copy itself, page 16, scattered host pages, both host layouts."""
    out = {}
    for layout in ("layer_first", "page_first"):
        cfg = config(layout, 16)
        dev, host = DevicePool(cfg), HostPool(cfg)
        dev.buffer.fill_(1)
        d, h = patterns(host.num_pages)["scattered"]
        runs = page_runs(d, h)
        td, th = torch.from_numpy(d), torch.from_numpy(h)
        copy_s = best_of(partial(CpuCopier().copy_all, dev.page_view, host.page_view, td, th, runs))
        sums = PageSums(host.page_view)
        sum_s = best_of(partial(sums.seal, h))
        print(
            f"checksums page_size=16 {layout:12s} copy {copy_s * 1e3:6.2f} ms, seal "
            f"{sum_s * 1e3:6.2f} ms: +{sum_s / copy_s:.0%} of the copy time"
        )
        tag = "" if layout == "layer_first" else f"_{layout}"
        out[f"verify_cost_vs_copy{tag}"] = round(sum_s / copy_s, 3)
        dev.close()
        host.close()
    return out


def snapshot_cost(seqs: int = 100) -> dict:
    """A periodic host snapshot without verify_pages (daemon/keep/snapshot.py): what the control
    thread spends (listing the host nodes, sealing) against what the keeper's thread spends
    summing the pages, on a host tier of ``seqs`` chat-like sequences over 8 system prompts."""
    cfg = HiCacheConfig(
        num_layers=16, num_kv_heads=8, head_dim=128, page_size=16,
        device_tokens=16384, host_tokens=24576, write_policy="write_through",
    )  # fmt: skip
    cache = HiRadixCache(cfg)
    rng = np.random.default_rng(5)
    systems = [rng.integers(1, 32000, 512, dtype=np.int32) for _ in range(8)]
    for i in range(seqs):
        tokens = np.concatenate([systems[i % 8], rng.integers(1, 32000, 160, dtype=np.int32)])
        m = cache.match_prefix(tokens)
        new = cache.alloc(len(tokens) - m.device_hit_length)
        cache.insert(tokens, torch.cat([m.device_indices, new]))
        cache.match_prefix(tokens)  # the hit that backs it up (write_through)
        cache.settle()
        cache.poll()
    listing = host_snapshot.list_host(cache)
    list_s = best_of(partial(host_snapshot.list_host, cache))
    sum_s = best_of(partial(host_snapshot.sum_pages, cache, listing))
    host_snapshot.watch_frees(cache)
    seal_s = best_of(partial(host_snapshot.seal, cache, listing, cache.host_alloc.freed))
    host_snapshot.unwatch_frees(cache)
    nbytes = len(listing.pages) * cache.host_pool.page_view[:, :, 0].numel() * 2
    print(
        f"snapshot of {len(listing.nodes)} host nodes, {len(listing.pages)} pages "
        f"({nbytes / 1e9:.2f} GB): control thread list {list_s * 1e3:.2f} ms + seal "
        f"{seal_s * 1e3:.2f} ms; keeper thread sums {sum_s * 1e3:.1f} ms "
        f"({nbytes / sum_s / 1e9:.1f} GB/s)"
    )
    cache.close()
    return {
        "snapshot_control_ms": round((list_s + seal_s) * 1e3, 2),
        "snapshot_control_vs_sums": round((list_s + seal_s) / sum_s, 4),
    }


def main() -> None:
    """``--gpu``: the GPU part alone (the device check: scripts/gpu_check.sh)."""
    gpu_only = "--gpu" in sys.argv[1:]
    headline = {}
    if not gpu_only:
        headline.update(cpu_table())
        headline.update(checksum_cost())
        headline.update(snapshot_cost())
    if torch.cuda.is_available():
        headline.update(gpu_table())
    elif gpu_only:
        raise SystemExit("bench_transfer --gpu: no CUDA device")
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
