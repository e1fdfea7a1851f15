"""In-process demo: a multi-turn chat trace through HiRadixCache, with and without the host tier.

Prints the hit ratio by tier and how many prompt tokens an engine would still have to prefill.
"""

from __future__ import annotations

import time

from hicache import HiCacheConfig, HiRadixCache
from hicache.workload import chat_trace, serve


def run(label: str, config: HiCacheConfig, trace) -> None:  # noqa: ANN001
    t0 = time.perf_counter()
    with HiRadixCache(config) as cache:
        loop = serve(cache, trace, write_kv=True)
        cache.check_integrity()
        s = cache.stats()
    elapsed = time.perf_counter() - t0
    print(f"# {label}")
    print(f"prompt_tokens:{loop.prompt_tokens}")
    print(f"hit_ratio_device:{loop.device_hit_tokens / loop.prompt_tokens:.3f}")
    print(f"hit_ratio_host:{loop.host_hit_tokens / loop.prompt_tokens:.3f}")
    print(f"recomputed_tokens:{loop.recomputed_tokens}")
    print(f"backup_tokens:{s.backup_tokens} load_tokens:{s.load_tokens}")
    print(f"evicted_device_tokens:{s.evicted_device_tokens} seconds:{elapsed:.2f}\n")
    return loop.recomputed_tokens


def main() -> None:
    trace = chat_trace(n_systems=2, system_len=1024, n_convs=24, turns=4, seed=1)
    base = HiCacheConfig(
        num_layers=4,
        num_kv_heads=2,
        head_dim=32,
        dtype="float32",
        page_size=16,
        device_tokens=8192,
        host_ratio=8.0,
    )
    off = run("device only (host tier off)", base.replace(host_tokens=0), trace)
    on = run("hicache write_through (host 8x device)", base, trace)
    print(f"recompute_reduction:{off / max(on, 1):.2f}x fewer prompt tokens prefilled")


if __name__ == "__main__":
    main()
