"""The third tier on real stores (Mooncake Store and a 3-node Redis Cluster, on loopback).

1. The doc-QA trace split across two daemons (two "machines", requests alternating), each
   with host memory for 25% of the working set: prompt tokens recomputed with the store under
   both daemons against without it, and what an unbounded cache would recompute (the ceiling).
   The engine is synthetic (match, load back, compute = allocate and write the rest, insert):
   what is counted is tokens, not model time.
2. Throughput: pages written through the tier (exists, checksum, put) and read back through it
   (exists, get, verify, insert as host nodes) against the store's own raw batch put and get of
   as many pages in the same run (1 MiB pages, 128 per batch; which side goes first alternates,
   best of 6).
3. The time a match waits under the `timeout` policy, against its bound (p99).

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from hicache.client import HiCacheClient
from hicache.daemon.launch import start_daemon, stop_daemon
from hicache.l3.config import L3Config
from hicache.l3.pages import trailer
from hicache.l3.registry import open_store
from hicache.l3.tier import L3Tier
from scripts import traces
from tests.l3_servers import MooncakeMaster, RedisCluster

SHAPE = [
    "--num-layers", "4", "--num-kv-heads", "4", "--head-dim", "64", "--dtype", "float32",
    "--page-size", "16", "--load-back-threshold", "16", "--session-owned-fraction", "1",
]  # fmt: skip
TOKEN_BYTES = 2 * 4 * 4 * 64 * 4


# ---- 1. the trace across two daemons ------------------------------------------------------------
def serve(hc: HiCacheClient, prompt: np.ndarray, waits: list[float]) -> int:
    """One request; returns the prompt tokens computed."""
    started = time.perf_counter()
    m = hc.match_prefix(prompt)
    waits.append(time.perf_counter() - started)
    try:
        loaded = hc.load_back(m)
        prefix = m.device_indices if loaded is None else torch.cat([m.device_indices, loaded])
        have = len(prefix)
        if have == len(prompt):
            have -= hc.config.page_size  # a full hit computes its last page
        new = hc.alloc(len(prompt) - have)
        hc.insert(prompt, torch.cat([prefix[:have], new]))
    finally:
        hc.release(m)
    return len(prompt) - have


def run_trace(folder: Path, requests, pool_tokens: int, l3: list[str]) -> dict:
    """Requests alternate between two daemons whose host pools hold ``pool_tokens`` each (the
    device pools: one prompt, the least an engine needs)."""
    eps = [f"ipc://{folder}/m{i}.sock" for i in range(2)]
    longest = max(len(p) for p, _ in requests) // 16 * 16 + 16
    host = max(pool_tokens // 16 * 16, longest + 16)
    sizes = ["--device-tokens", str(longest), "--host-tokens", str(host)]
    procs = [start_daemon(ep, *SHAPE, *sizes, *l3, "--keep-host", "false") for ep in eps]
    try:
        clients = [HiCacheClient(ep, name=f"engine{i}", timeout_s=60) for i, ep in enumerate(eps)]
        computed, waits = 0, []
        for i, (prompt, _) in enumerate(requests):
            computed += serve(clients[i % 2], prompt, waits)
            if l3:  # let the writer's store catch up before the other machine asks (as time does)
                _settle(clients[i % 2])
        stats = [c.stats(check=True) for c in clients]
        assert all(s["integrity"] == "ok" for s in stats)
        for c in clients:
            c.close()
        return {"computed": computed, "waits": waits, "l3": [s.get("l3", {}) for s in stats]}
    finally:
        for proc in procs:
            stop_daemon(proc)


def _settle(hc: HiCacheClient) -> None:
    """Until the daemon's backups landed and its store writes ended."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        s = hc.stats()
        if not s["inflight_transfers"] and not s["l3"]["queued_pages"]:
            return
        time.sleep(0.005)


def ceiling(requests) -> int:
    """Tokens an unbounded cache shared by both machines computes: each new page once (a full
    hit still computes its last page)."""
    seen: set[bytes] = set()
    total = 0
    for prompt, _ in requests:
        pages = len(prompt) // 16
        have = 0
        for p in range(pages):
            if prompt[: (p + 1) * 16].tobytes() in seen:
                have = (p + 1) * 16
            else:
                break
        if have == len(prompt):
            have -= 16
        total += len(prompt) - have
        for p in range(pages):
            seen.add(prompt[: (p + 1) * 16].tobytes())
    return total


# ---- 2. throughput against the raw store --------------------------------------------------------
def throughput(url: str, options: dict, pages: int = 256, reps: int = 6) -> dict:
    """Write and read ``pages`` 1 MiB pages through the tier and raw (the store client's own
    batch put and get of as many host pages under other keys), best of ``reps``; which side
    goes first alternates from rep to rep (the second finds the store warmer: 15% faster on
    Redis); both pools touched first (no page faults in either measurement). A measurement in which
    the store failed some pages is not a sample (a failed transfer returns early)."""
    from tests.conftest import make_cache

    model = f"bench-{time.monotonic_ns()}"  # fresh keys: nothing of an earlier run is present

    def cache():
        c = make_cache(
            manual=False, num_layers=16, num_kv_heads=8, head_dim=128, dtype="float16",
            page_size=16, device_tokens=pages * 16, host_tokens=pages * 16 * 2,
            load_back_threshold=0,
        )  # fmt: skip
        c.host_pool.buffer.numpy()[:] = 1
        c.device_pool.buffer.numpy()[:] = 7
        cfg = L3Config(url, model, batch_pages=128, options=options)
        c.attach_l3(L3Tier(c, cfg, open_store(url, **options)))
        return c

    writer, reader = cache(), cache()
    best = {"tier_write": 0.0, "raw_write": 0.0, "tier_read": 0.0, "raw_read": 0.0}
    failed = dict.fromkeys(best, 0)  # pages that failed (all reps)
    nbytes = pages * writer.l3.pages.page_bytes
    try:
        for rep in range(reps):
            tokens = np.random.default_rng(rep).integers(1, 30000, pages * 16).astype(np.int32)
            writer.insert(tokens, writer.alloc(len(tokens)))
            writer.settle()
            keys = [f"raw-{model}-{rep}-{i}" for i in range(pages)]
            steps = {
                "tier_write": partial(_tier_write, writer),
                "raw_write": partial(_raw_write, writer, keys),
                "tier_read": partial(_tier_read, reader, tokens),
                "raw_read": partial(_raw_read, reader, keys),
            }
            now: dict[str, tuple[float, int]] = {}  # name: (seconds, pages that failed)
            # which side goes first alternates: the second of a pair finds the store warmer
            for pair in (("tier_write", "raw_write"), ("tier_read", "raw_read")):
                for name in pair[:: 1 if rep % 2 else -1]:
                    now[name] = steps[name]()
            for name, (seconds, bad) in now.items():
                failed[name] += bad
                if not bad:  # (a failed transfer returns early: not a sample)
                    best[name] = max(best[name], nbytes / seconds / 1e9)
            reader.evict_host(1 << 30, to_l3=False)
            writer.evict(1 << 30)
            writer.evict_host(1 << 30, to_l3=False)
        return {
            "page_bytes": writer.l3.pages.page_bytes,
            "failed": failed,
            **{f"{k}_gbs": v for k, v in best.items()},
        }
    finally:
        writer.close()
        reader.close()


def _tier_write(writer) -> tuple[float, int]:
    """The writer's inserted pages backed up and written through its tier: (seconds, pages
    that failed)."""
    t0, before = time.perf_counter(), writer.l3.counters.failed_write_pages
    writer.poll()  # backed up: the tier's write starts now
    writer.l3.drain()
    return time.perf_counter() - t0, writer.l3.counters.failed_write_pages - before


def _raw_write(writer, keys: list[str]) -> tuple[float, int]:
    """The store's own batch put of as many host pages of the writer (the same bytes as those
    the tier writes) under ``keys``."""
    src = writer.host_alloc.alloc_pages(len(keys))
    ids, tails = src.tolist(), [trailer([b"x"], b"01234567")] * len(keys)
    t0, bad = time.perf_counter(), 0
    for at in range(0, len(keys), 128):
        part = slice(at, at + 128)
        bad += pages_failed(writer.l3.store.put(keys[part], ids[part], tails[part]))
    seconds = time.perf_counter() - t0
    writer.host_alloc.release(src)
    return seconds, bad


def _tier_read(reader, tokens: np.ndarray) -> tuple[float, int]:
    """A fetch of the whole prompt through the reader's tier (exists, get, verify, insert)."""
    t0 = time.perf_counter()
    fetch = reader.l3.prefetch(tokens.tobytes(), None, 0)
    reader.l3.wait(fetch)
    return time.perf_counter() - t0, len(tokens) // 16 - fetch.adopted


def _raw_read(reader, keys: list[str]) -> tuple[float, int]:
    """The store's own batch get of ``keys`` into free host pages of the reader."""
    dst = reader.host_alloc.alloc_pages(len(keys))
    t0, bad = time.perf_counter(), 0
    for at in range(0, len(keys), 128):
        got = reader.l3.store.get(keys[at : at + 128], dst[at : at + 128].tolist())
        bad += sum(g is None for g in got)
    seconds = time.perf_counter() - t0
    reader.host_alloc.release(dst)
    return seconds, bad


def pages_failed(ok: list[bool]) -> int:
    return len(ok) - sum(ok)


def _path(node):
    out = []
    while node.parent is not None:
        out.append(node)
        node = node.parent
    return out[::-1]


# ---- main -------------------------------------------------------------------------------------
def _ratio(ours: float, raw: float) -> float | None:
    """ours / raw, or None when a side has no sample (the store failed pages in every one)."""
    return round(ours / raw, 3) if ours and raw else None


def _shown(ratio: float | None) -> str:
    return "no sample: the store failed pages in every try" if ratio is None else f"{ratio:.2f}x"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller trace and fewer pages")
    args = ap.parse_args()
    docs = 6
    requests = [
        (np.array(r["prompt"], np.int32), None)
        for r in traces.doc_qa(docs=docs, doc_len=1000 if args.quick else 2500)
    ]
    working = sum(len(p) for p, _ in requests) // len(requests) * docs  # ~ every document once
    pool = working // 4
    ceil = ceiling(requests)
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        base = run_trace(folder, requests, pool, [])
        print(f"docqa  2 daemons, no store   computed={base['computed']:7d} (ceiling {ceil})")
        waits: list[float] = []
        bound_s = L3Config("memory://x", "m").wait_bound(len(requests[0][0]))
        for kind in ("mooncake", "redis"):
            server = (
                MooncakeMaster()
                if kind == "mooncake"
                else RedisCluster(folder / "redis", maxmemory="1gb")
            )
            try:
                server.start()
                flags = [
                    "--l3",
                    server.url,
                    "--l3-model",
                    f"bench-{kind}",
                    "--l3-segment-bytes",
                    "512MiB",
                ]
                r = run_trace(folder, requests, pool, flags)
                waits += r["waits"]
                red = base["computed"] / max(1, r["computed"])
                read = sum(s.get("read_pages", 0) for s in r["l3"])
                print(
                    f"docqa  2 daemons + {kind:8s}  computed={r['computed']:7d} (ceiling {ceil}, "
                    f"{ceil / max(1, r['computed']):.2f} of it) {red:.2f}x fewer than without; "
                    f"pages read from the store {read}"
                )
                out[f"l3_recompute_reduction_{kind}"] = round(red, 2)
                out[f"ceiling_over_l3_{kind}"] = round(ceil / max(1, r["computed"]), 3)
                opts = {"segment_bytes": 2 << 30} if kind == "mooncake" else {}
                t = throughput(server.url, opts, pages=64 if args.quick else 128)
                w, rw = t["tier_write_gbs"], t["raw_write_gbs"]
                rd, rr = t["tier_read_gbs"], t["raw_read_gbs"]
                write, read = _ratio(w, rw), _ratio(rd, rr)
                print(
                    f"{kind:8s} {t['page_bytes'] >> 20} MiB pages: write tier {w:.2f} GB/s raw "
                    f"{rw:.2f} ({_shown(write)}); read tier {rd:.2f} raw {rr:.2f} "
                    f"({_shown(read)}); pages that failed (store-side) {t['failed']}"
                )
                out[f"l3_write_vs_raw_{kind}"] = write
                out[f"l3_read_vs_raw_{kind}"] = read
            finally:
                server.stop()
        p99 = float(np.percentile(waits, 99)) * 1e3
        print(
            f"match wait under timeout: p50 {statistics.median(waits) * 1e3:.1f} ms, "
            f"p99 {p99:.1f} ms (bound {bound_s * 1e3:.0f} ms)"
        )
        out["l3_wait_p99_ms"] = round(p99, 1)
        out["l3_wait_bound_ms"] = round(bound_s * 1e3, 1)
        out["recompute_ceiling"] = ceil
        out["recompute_without_l3"] = base["computed"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
