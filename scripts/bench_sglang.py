"""SGLang's storage tier on hicache-daemon, measured through SGLang's own classes.

1. Throughput of SGLang's page get and set paths (the cache controller's own functions over a
   real host pool) at a 7-8B model's page per rank (page 64, 32 layers, 8 KV heads of 128,
   bf16: 8 MiB): hicache (zero-copy v1: the backend copies between SGLang's host pool and the
   daemon's shared pool) against plain copies of the same pages in one process (the ceiling:
   a set copies them into a store as large as the daemon's pool, at the next pages each
   round as the daemon's allocator does, a get copies them back; ``warm_copy`` is one copy
   between the same two pages every round, which the cache favours once a call's pages fit
   in it) and against SGLang's HiCacheFile on /dev/shm (a node-local shared tier without a daemon),
   for 1, 8 and 64 pages per call. The median of ``--rounds``; which side runs first
   alternates.
   hicache runs twice: with one-page keys (SGLang's default) and with chains (its
   ``hicache_storage_pass_prefix_keys``: every call names the keys before its own, and a
   prompt's pages are one path in the daemon's tree).
2. The cost of a miss: ``batch_exists`` on an empty daemon, per call (median of 2,000).
3. Two SGLang instances on the doc-QA trace (requests alternating), each with a cache of a
   quarter of the working set (an LRU of pages: SGLang's device and host tiers together):
   prompt tokens they recompute alone, with hicache under both (the real backend and daemon:
   every page read is checked), and what one unbounded cache would recompute (the ceiling).

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from hicache.daemon.launch import start_daemon, stop_daemon
from scripts import traces
from tests import sglang_rig as rig

POOL_CALLS = 3  # the daemon's pool (and the ceiling's store) holds this many calls' pages


def host_pool(layers: int, heads: int, head_dim: int, page: int, pages: int, layout: str):
    """SGLang's MHA host pool (bf16) of ``pages`` pages."""
    rig.stub_torchvision()
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _mha_host_inputs
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    dev = MHATokenToKVPool(
        size=page, page_size=page, dtype=torch.bfloat16, head_num=heads, head_dim=head_dim,
        layer_num=layers, device="cpu", enable_memory_saver=False, enable_alt_stream=False,
    )  # fmt: skip
    cls, info, kw = _mha_host_inputs(dev)
    kw["device_capacity_tokens"] = pages * page
    return cls(info, 1.0, 0, page, layout, pin_memory=False, device="cpu", **kw)


def make_backend(name: str, host, extra: dict):
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    cfg = rig.storage_config(extra)
    be = StorageBackendFactory.create_backend(name, cfg, host)
    be.register_mem_pool_host(host)
    return be


def page_paths(backend, host, page: int, zero_copy: bool, chain: bool = False):
    """SGLang's controller's own page get and set functions over ``backend``; ``chain``: the
    calls carry prefix keys (the keys are a chain from its start)."""
    from sglang.srt.managers.cache_controller import HiCacheController, PrefetchOperation

    c = HiCacheController.__new__(HiCacheController)
    c.storage_backend, c.storage_host_pool, c.mem_pool_host = backend, host, host
    c.page_size = page
    get = c._page_get_zero_copy if zero_copy else c._generic_page_get
    put = c._page_set_zero_copy if zero_copy else c._generic_page_set
    op = PrefetchOperation("bench", [], None, None)
    info = after([]) if chain else None
    return (lambda keys, idx: get(op, keys, idx, info)), (lambda keys, idx: put(keys, idx, info))


def after(keys: list[str]):
    """SGLang's extra_info for a call whose keys follow ``keys`` (its prefix keys)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    return HiCacheStorageExtraInfo(prefix_keys=list(keys))


def fresh_keys(n: int) -> list[str]:
    return [os.urandom(32).hex() for _ in range(n)]


def throughput(args, endpoint: str, shm: str) -> dict:
    page, n_max = args.page, max(args.batches)
    page_bytes = 2 * args.layers * page * args.heads * args.head_dim * 2
    src = host_pool(args.layers, args.heads, args.head_dim, page, n_max, "page_first")
    dst = host_pool(args.layers, args.heads, args.head_dim, page, n_max, "page_first")
    src.kv_buffer.copy_(torch.randn(src.kv_buffer.shape).to(torch.bfloat16))
    store = torch.empty((POOL_CALLS * n_max, *src.kv_buffer[:, :page].shape), dtype=torch.bfloat16)
    store.fill_(0)  # (its pages mapped before any round, as the daemon's pool is)
    s_idx, d_idx = src.alloc(n_max * page), dst.alloc(n_max * page)
    extra = rig.extra_config(endpoint, **{"hicache.timeout_s": 30})
    hc_src, hc_dst = make_backend("dynamic", src, extra), make_backend("dynamic", dst, extra)
    chained = rig.extra_config(endpoint, chains=True, **{"hicache.timeout_s": 30})
    ch_src, ch_dst = make_backend("dynamic", src, chained), make_backend("dynamic", dst, chained)
    file_cfg = {"file_storage_path": shm}
    f_src, f_dst = make_backend("file", src, file_cfg), make_backend("file", dst, file_cfg)
    sides = {
        "hicache": (page_paths(hc_src, src, page, True), page_paths(hc_dst, dst, page, True)),
        "chain": (
            page_paths(ch_src, src, page, True, chain=True),
            page_paths(ch_dst, dst, page, True, chain=True),
        ),
        "file": (page_paths(f_src, src, page, False), page_paths(f_dst, dst, page, False)),
    }
    out: dict = {"page_bytes": page_bytes}
    try:
        for n in args.batches:
            nbytes = n * page_bytes
            seen: dict[str, list[float]] = {}

            def note(name: str, seconds: float, seen: dict = seen) -> None:
                seen.setdefault(name, []).append(seconds)

            for r in range(args.rounds):
                order = ["ceiling", "hicache", "chain", "file"]
                for name in order if r % 2 == 0 else order[::-1]:
                    si, di = s_idx[: n * page], d_idx[: n * page]
                    if name == "ceiling":  # plain copies of the same pages (K and V runs)
                        # set: into a store as large as the daemon's pool, at the next free
                        # pages, as the daemon's allocator hands them out (memory not in the
                        # cache, as a store's is); get: back from there into the same pages.
                        at = (r * n_max) % (len(store) - n + 1)
                        t = time.perf_counter()
                        for j, i in enumerate(range(0, n * page, page)):
                            a = int(si[i])
                            store[at + j].copy_(src.kv_buffer[:, a : a + page])
                        note("ceiling_set", time.perf_counter() - t)
                        dst.kv_buffer.fill_(0)  # (as before every side's get)
                        t = time.perf_counter()
                        for j, i in enumerate(range(0, n * page, page)):
                            b = int(di[i])
                            dst.kv_buffer[:, b : b + page].copy_(store[at + j])
                        note("ceiling_get", time.perf_counter() - t)
                        t = time.perf_counter()  # (the first ceiling: one warm page set)
                        for i in range(0, n * page, page):
                            a, b = int(si[i]), int(di[i])
                            dst.kv_buffer[:, b : b + page].copy_(src.kv_buffer[:, a : a + page])
                        note("warm_copy", time.perf_counter() - t)
                        continue
                    (_, put), (get, _) = sides[name]
                    keys = fresh_keys(n)
                    t = time.perf_counter()
                    assert put(keys, si), f"{name}: set failed"
                    note(f"{name}_set", time.perf_counter() - t)
                    dst.kv_buffer.fill_(0)
                    t = time.perf_counter()
                    if name == "hicache":
                        assert hc_dst.batch_exists(keys) == n
                    elif name == "chain":
                        assert ch_dst.batch_exists(keys, after([])) == n
                    else:
                        assert f_dst.batch_exists(keys) == n
                    assert get(keys, di) == n, f"{name}: get failed"
                    note(f"{name}_get", time.perf_counter() - t)
                    for i in (0, n * page - page):
                        a, b = int(si[i]), int(di[i])
                        assert torch.equal(
                            dst.kv_buffer[:, b : b + page], src.kv_buffer[:, a : a + page]
                        ), f"{name}: wrong bytes"
                for f in Path(shm).iterdir():  # (the file tier's pages of this round)
                    f.unlink()
            # GB/s of each side's median round
            row = {k: round(nbytes / statistics.median(v) / 1e9, 3) for k, v in seen.items()}
            for op in ("get", "set"):
                row[f"{op}_vs_ceiling"] = round(row[f"hicache_{op}"] / row[f"ceiling_{op}"], 3)
                row[f"{op}_vs_file"] = round(row[f"hicache_{op}"] / row[f"file_{op}"], 3)
                row[f"chain_{op}_vs_ceiling"] = round(row[f"chain_{op}"] / row[f"ceiling_{op}"], 3)
                row[f"chain_{op}_vs_file"] = round(row[f"chain_{op}"] / row[f"file_{op}"], 3)
            out[f"pages_{n}"] = row
            print(f"pages per call {n:3d}: " + " ".join(f"{k} {v}" for k, v in row.items()))
    finally:
        for be in (hc_src, hc_dst, ch_src, ch_dst):
            be.close()
    return out


def miss_cost(args, endpoint: str) -> dict:
    """batch_exists against a daemon that holds nothing of this namespace, one-page keys and
    chains, beside the daemon's bare round trip (a PING on the same session) in the same
    blocks: what no call can go below on this machine."""
    host = host_pool(args.layers, args.heads, args.head_dim, args.page, 1, "page_first")
    ns = {"hicache.namespace": "miss"}
    pages = make_backend("dynamic", host, rig.extra_config(endpoint, **ns))
    chains = make_backend("dynamic", host, rig.extra_config(endpoint, chains=True, **ns))
    out = {}
    try:
        assert pages.batch_exists(fresh_keys(1)) == 0 and pages.link.client is not None
        ping = []
        for n in (1, 64):
            keys = fresh_keys(n)
            for name, be, info in (("miss", pages, None), ("chain_miss", chains, after([]))):
                times = []
                for _ in range(2000):
                    t = time.perf_counter()
                    assert be.batch_exists(keys, info) == 0 and be.link.client is not None
                    times.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    pages.link.client.ping()
                    ping.append(time.perf_counter() - t)
                out[f"{name}_ms_{n}_keys"] = round(statistics.median(times) * 1e3, 4)
        out["ping_ms"] = round(statistics.median(ping) * 1e3, 4)
        print(f"a miss (batch_exists, empty daemon), and a bare PING: {out}")
    finally:
        pages.close()
        chains.close()
    return out


# ---- the doc-QA trace ----------------------------------------------------------------------------
def chain(tokens: np.ndarray, page: int) -> list[str]:
    keys, prev = [], b""
    for i in range(0, len(tokens) - len(tokens) % page, page):
        prev = hashlib.sha256(prev + tokens[i : i + page].astype("<u4").tobytes()).digest()
        keys.append(prev.hex())
    return keys


class Instance:
    """An SGLang instance as a cache of pages (LRU, prefix-closed by chain: a hit is the
    leading run of a prompt's keys), with or without hicache under it."""

    def __init__(self, capacity_pages: int, backend=None, host=None, chain: bool = False):
        self.capacity = capacity_pages
        self.pages: OrderedDict[str, None] = OrderedDict()
        self.backend, self.host = backend, host
        self.chain = chain  # calls carry prefix keys

    def serve(self, keys: list[str], kv) -> tuple[int, int]:
        """(pages found in its own cache, pages found in hicache after them)."""
        own = 0
        while own < len(keys) and keys[own] in self.pages:
            own += 1
        stored = 0
        if self.backend is not None and own < len(keys):
            rest = keys[own:]
            stored = self.backend.batch_exists(rest, self.info(keys[:own]))
            if stored:
                page = self.host.page_size
                idx = self.host.alloc(stored * page)
                got = self.backend.batch_get_v1(rest[:stored], idx, self.info(keys[:own]))
                stored = got.index(False) if False in got else stored
                for i, key in enumerate(rest[:stored]):  # every page read is its key's
                    assert torch.equal(self.host.kv_buffer[:, int(idx[i * page])], kv(key))
                self.host.free(idx)
        computed = keys[own + stored :]
        if self.backend is not None and computed:  # write-through: computed pages go down
            page = self.host.page_size
            idx = self.host.alloc(len(computed) * page)
            for i, key in enumerate(computed):
                self.host.kv_buffer[:, int(idx[i * page]) : int(idx[i * page]) + page] = kv(key)[
                    :, None
                ]
            prefix = self.info(keys[: own + stored])
            assert all(self.backend.batch_set_v1(computed, idx, prefix))
            self.host.free(idx)
        for key in keys:
            self.pages[key] = None
            self.pages.move_to_end(key)
        while len(self.pages) > self.capacity:
            self.pages.popitem(last=False)
        return own, stored

    def info(self, prefix: list[str]):
        return after(prefix) if self.chain else None


def doc_qa(args, endpoint: str) -> dict:
    page = 64
    requests = traces.doc_qa(seed=args.seed)
    prompts = [np.array(r["prompt"], dtype=np.int64) for r in requests]
    finished = [
        np.concatenate([p, np.array(r["answer"])]) for p, r in zip(prompts, requests, strict=True)
    ]
    distinct = {k for f in finished for k in chain(f, page)}
    quarter = max(1, len(distinct) // 4)

    def kv(key: str) -> torch.Tensor:  # one token's K/V of the page, from its key
        gen = torch.Generator().manual_seed(int(key[:12], 16))
        return torch.randn((2, 1, 1, 64), generator=gen).to(torch.bfloat16)

    results = {}
    for mode in ("alone", "hicache", "chain"):
        instances = []
        for _ in range(2):
            if mode == "alone":
                instances.append(Instance(quarter))
                continue
            host = host_pool(1, 1, 64, page, 64, "page_first")
            extra = rig.extra_config(
                endpoint, chains=mode == "chain", **{"hicache.namespace": f"docqa-{args.seed}"}
            )
            backend = make_backend("dynamic", host, extra)
            instances.append(Instance(quarter, backend, host, chain=mode == "chain"))
        recomputed = 0
        for n, (prompt, done) in enumerate(zip(prompts, finished, strict=True)):
            inst = instances[n % 2]
            keys = chain(prompt, page)
            own, stored = inst.serve(keys, kv)
            recomputed += len(prompt) - (own + stored) * page
            inst.serve(chain(done, page), kv)  # the finished sequence is cached too
        for inst in instances:
            if inst.backend is not None:
                inst.backend.close()
        results[mode] = recomputed
    seen: set[str] = set()
    ceiling = 0
    for prompt, done in zip(prompts, finished, strict=True):
        keys = chain(prompt, page)
        hit = 0
        while hit < len(keys) and keys[hit] in seen:
            hit += 1
        ceiling += len(prompt) - hit * page
        seen.update(chain(done, page))
    out = {
        "docqa_requests": len(prompts),
        "docqa_working_set_pages": len(distinct),
        "docqa_cache_pages_each": quarter,
        "recomputed_alone": results["alone"],
        "recomputed_hicache": results["hicache"],
        "recomputed_chain": results["chain"],
        "recomputed_ceiling": ceiling,
        "hicache_vs_ceiling": round(results["hicache"] / max(1, ceiling), 3),
        "chain_vs_ceiling": round(results["chain"] / max(1, ceiling), 3),
        "alone_vs_ceiling": round(results["alone"] / max(1, ceiling), 3),
    }
    print(f"doc-QA, two instances: {out}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page", type=int, default=64)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--seed", type=int, default=2)
    p.add_argument("--parts", nargs="+", default=["throughput", "miss", "docqa"],
                   choices=["throughput", "miss", "docqa"], help="what to measure")  # fmt: skip
    args = p.parse_args()
    page_bytes = 2 * args.layers * args.page * args.heads * args.head_dim * 2
    pool = max(args.batches) * page_bytes * POOL_CALLS + (64 << 20)
    out: dict = {"bench": "sglang"}
    with tempfile.TemporaryDirectory(prefix="hicache-bench-", dir="/tmp") as tmp:
        endpoint = f"ipc://{tmp}/h.sock"
        proc = start_daemon(
            endpoint, "--device-tier", "engine", "--host-bytes", str(pool), "--keep-host", "false"
        )
        shm = tempfile.mkdtemp(prefix="hicache-bench-file-", dir="/dev/shm")
        try:
            if "throughput" in args.parts:
                out.update(throughput(args, endpoint, shm))
            if "miss" in args.parts:
                out.update(miss_cost(args, endpoint))
        finally:
            stop_daemon(proc)
            for f in Path(shm).iterdir():
                f.unlink()
            os.rmdir(shm)
        if "docqa" not in args.parts:
            print(json.dumps(out))
            return
        # the trace on a daemon of its own, sized for the trace's working set and a margin
        proc = start_daemon(
            endpoint, "--device-tier", "engine", "--host-tokens", "131072", "--keep-host", "false"
        )
        try:
            out.update(doc_qa(args, endpoint))
        finally:
            stop_daemon(proc)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
