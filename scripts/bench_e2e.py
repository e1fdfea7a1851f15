"""End-to-end: a real transformer served through the daemon on a chat trace and a long-document
QA trace, with no cache, a device-only cache and hicache under each write policy.

The device pool holds 25% of each trace's working set; the host pool holds all of it. Per run:
prompt tokens, tokens recomputed, hit ratio by tier, bytes moved each way, model time and
daemon overhead per request. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from hicache.client import HiCacheClient
from hicache.daemon.launch import start_daemon, stop_daemon
from scripts import traces
from scripts.ref_engine import ReferenceEngine

# 4 layers, 4 KV heads of 32 (8 query heads): heavy enough that prefill time is real on a CPU.
MODEL = [
    "--num-layers",
    "4",
    "--num-kv-heads",
    "4",
    "--head-dim",
    "32",
    "--dtype",
    "float32",
    "--page-size",
    "16",
    "--load-back-threshold",
    "16",
]
POLICIES = ["write_through", "write_through_selective", "write_back"]


def run_cached(endpoint: str, requests, flags: list[str]) -> dict:
    proc = start_daemon(endpoint, *MODEL, *flags, "--keep-host", "false")
    try:
        with HiCacheClient(endpoint, name="bench-engine") as hc:
            engine = ReferenceEngine(hc)
            totals = dict(prompt=0, recomputed=0, device=0, host=0, model_s=0.0, daemon_s=0.0)
            for prompt, finished in requests:
                served = engine.serve(finished)
                reused = min(served.computed_from, len(prompt))
                totals["prompt"] += len(prompt)
                totals["recomputed"] += len(prompt) - reused
                totals["device"] += min(served.device_hit, len(prompt))
                totals["host"] += min(
                    served.host_hit, len(prompt) - min(served.device_hit, len(prompt))
                )
                totals["model_s"] += served.model_s
                totals["daemon_s"] += served.daemon_s
            stats = hc.stats(check=True)
            assert stats["integrity"] == "ok", stats["integrity"]
            totals.update(backup_bytes=stats["backup_bytes"], load_bytes=stats["load_bytes"])
            return totals
    finally:
        stop_daemon(proc)


def run_uncached(endpoint: str, requests) -> dict:
    proc = start_daemon(endpoint, *MODEL, "--host-tokens", "0", "--device-tokens", "64")
    try:
        with HiCacheClient(endpoint, name="bench-nocache") as hc:
            engine = ReferenceEngine(hc)  # only for the same model; the cache is not used
            model_s = 0.0
            for _, finished in requests:
                t0 = time.perf_counter()
                engine.recompute(finished)
                model_s += time.perf_counter() - t0
        prompt = sum(len(p) for p, _ in requests)
        return dict(
            prompt=prompt,
            recomputed=prompt,
            device=0,
            host=0,
            model_s=model_s,
            daemon_s=0.0,
            backup_bytes=0,
            load_bytes=0,
        )
    finally:
        stop_daemon(proc)


def report(trace: str, label: str, r: dict, n: int) -> None:
    print(
        f"{trace:6s} {label:26s} prompt={r['prompt']:7d} recomputed={r['recomputed']:7d} "
        f"hit_device={r['device'] / r['prompt']:.3f} hit_host={r['host'] / r['prompt']:.3f} "
        f"d2h={r['backup_bytes'] / 2**20:7.1f}MiB h2d={r['load_bytes'] / 2**20:7.1f}MiB "
        f"model={r['model_s'] / n * 1e3:7.1f}ms/req daemon={r['daemon_s'] / n * 1e3:6.2f}ms/req"
    )


def bench(name: str, path: Path, tmp: str) -> dict:
    requests = traces.read(path)
    ws = traces.working_set(requests)
    device = max(ws // 4 // 16 * 16, 256)
    pools = ["--device-tokens", str(device), "--host-tokens", str(max(2 * ws, device + 16))]
    n = len(requests)
    runs = {"no cache": run_uncached(f"ipc://{tmp}/{name}-none.sock", requests)}
    runs["device only"] = run_cached(
        f"ipc://{tmp}/{name}-dev.sock",
        requests,
        ["--device-tokens", str(device), "--host-tokens", "0"],
    )
    for policy in POLICIES:
        runs[f"hicache {policy}"] = run_cached(
            f"ipc://{tmp}/{name}-{policy}.sock",
            requests,
            [*pools, "--write-policy", policy, "--write-through-threshold", "2"],
        )
    print(f"# {name}: {n} requests, working set ~{ws} tokens, device pool {device} tokens")
    for label, r in runs.items():
        report(name, label, r, n)
    best = min(POLICIES, key=lambda p: runs[f"hicache {p}"]["recomputed"])
    hi, dev, none = runs[f"hicache {best}"], runs["device only"], runs["no cache"]
    saved_s = (none["model_s"] - hi["model_s"]) / n
    return {
        "reduction": dev["recomputed"] / max(hi["recomputed"], 1),
        "best": best,
        "overhead": (hi["daemon_s"] / n) / saved_s if saved_s > 0 else float("inf"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace-dir", help="where the JSON-lines traces are written (default: temp)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="hicache-e2e-") as tmp:
        out = Path(args.trace_dir or tmp)
        out.mkdir(parents=True, exist_ok=True)
        chat = bench("chat", traces.write(out / "chat.jsonl", traces.chat()), tmp)
        docqa = bench("docqa", traces.write(out / "docqa.jsonl", traces.doc_qa()), tmp)
    print(
        json.dumps(
            {
                "chat_recompute_reduction": round(chat["reduction"], 2),
                "docqa_recompute_reduction": round(docqa["reduction"], 2),
                "overhead_fraction": round(max(chat["overhead"], docqa["overhead"]), 4),
                "best_policy": {"chat": chat["best"], "docqa": docqa["best"]},
            }
        )
    )


if __name__ == "__main__":
    main()
