"""bench_serve: drive a running OpenAI-compatible server (vLLM's) and set its counters beside
hicache's.

vLLM's own benchmark client does not start on the CPU build (``vllm bench serve`` looks up the
version of a package named ``vllm``, and ``python -m vllm.benchmarks.serve`` has no main):
this one needs nothing but the standard library (and hicache's client for ``--hicache``).

The trace is vLLM's ``prefix_repetition`` shape in token ids (no tokenizer needed, so it runs
against a server started with ``--skip-tokenizer-init`` too): ``--prefixes`` shared prefixes of
``--prefix-tokens`` random ids, each request one of them plus ``--suffix-tokens`` of its own,
``--requests`` requests sent ``--concurrency`` at a time, ``--max-tokens`` generated greedily.
Time to first token comes from the streamed reply. After the run it reads the server's
/metrics (``vllm:external_prefix_cache_{queries,hits}``, ``vllm:prefix_cache_{queries,hits}``)
and, with ``--hicache ENDPOINT``, the daemon's figures (``engine_*_tokens``, ``load_tokens``,
``hit_host_tokens``), each as the change over the run, so the two can be compared line by
line (docs/vllm.md, "What is counted").

    python -m scripts.bench_serve --url http://127.0.0.1:8000 --hicache ipc:///tmp/h/h.sock

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

VLLM_COUNTERS = (
    "vllm:external_prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
)
HICACHE_FIGURES = (
    "engine_queried_tokens",
    "engine_hit_tokens",
    "engine_loaded_tokens",
    "load_tokens",
    "hit_host_tokens",
    "miss_tokens",
)


def trace(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    ids = range(1, args.vocab)
    prefixes = [[rng.choice(ids) for _ in range(args.prefix_tokens)] for _ in range(args.prefixes)]
    return [
        rng.choice(prefixes) + [rng.choice(ids) for _ in range(args.suffix_tokens)]
        for _ in range(args.requests)
    ]


def model_name(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as r:
        return json.load(r)["data"][0]["id"]


class RequestFailed(Exception):
    """The server answered a request with an error (inside the stream)."""


def one(url: str, model: str, prompt: list[int], max_tokens: int) -> dict[str, float]:
    """One streamed completion: its time to first token and in all (seconds)."""
    body = json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    req = urllib.request.Request(
        f"{url}/v1/completions", body, {"Content-Type": "application/json"}
    )
    started = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if not line.startswith(b"data:") or b"[DONE]" in line:
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk or chunk.get("object") == "error":  # (vLLM answers 200 first)
                raise RequestFailed(str(chunk.get("error", chunk.get("message", chunk))))
            if first is None:
                first = time.perf_counter() - started
    return {
        "ttft": first if first is not None else float("nan"),
        "e2e": time.perf_counter() - started,
    }


def vllm_counters(url: str) -> dict[str, float]:
    """The server's counters of VLLM_COUNTERS (summed over labels)."""
    out = dict.fromkeys(VLLM_COUNTERS, 0.0)
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        for raw in r.read().decode().splitlines():
            if raw.startswith("#"):
                continue
            name = raw.split("{", 1)[0].split(" ", 1)[0]
            if name in out:
                out[name] += float(raw.rsplit(" ", 1)[1])
    return out


def hicache_figures(endpoint: str | None) -> dict[str, int]:
    if not endpoint:
        return {}
    from hicache.client import DaemonTimeout, HiCacheClient

    try:
        with HiCacheClient(endpoint, name="bench-serve", heartbeat=False) as hc:
            stats = hc.stats()
    except (DaemonTimeout, PermissionError) as exc:
        raise SystemExit(f"bench_serve: cannot read hicache-daemon at {endpoint}: {exc}") from None
    return {k: stats.get(k, 0) for k in HICACHE_FIGURES}


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="default: the server's first model")
    ap.add_argument("--hicache", default=None, metavar="ENDPOINT", help="the daemon to read")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prefixes", type=int, default=4)
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--suffix-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=500, help="token ids drawn from 1..vocab-1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--settle-s", type=float, default=10.0, help="wait for the counters to stop moving"
    )
    args = ap.parse_args()
    model = args.model or model_name(args.url)
    prompts = trace(args)
    before_v, before_h = vllm_counters(args.url), hicache_figures(args.hicache)
    done, lock = [], threading.Lock()
    started = time.perf_counter()

    failed: list[str] = []

    def run(prompt: list[int]) -> None:
        try:
            r = one(args.url, model, prompt, args.max_tokens)
        except RequestFailed as exc:
            with lock:
                failed.append(str(exc))
            return
        with lock:
            done.append(r)

    with ThreadPoolExecutor(args.concurrency) as pool:
        list(pool.map(run, prompts))
    wall = time.perf_counter() - started
    if failed:  # (no figure of a run whose requests failed is worth printing)
        print(f"bench_serve: {len(failed)} of {len(prompts)} requests failed; the first: "
              f"{failed[0]} (--vocab: token ids must be below the model's vocabulary size)",
              file=sys.stderr)  # fmt: skip
        return 1
    # the engine's figures reach the daemon with its heartbeat (every 2 s at most): read
    # until both stayed the same for longer than that, or --settle-s passed
    deadline = time.monotonic() + args.settle_s
    v, h = vllm_counters(args.url), hicache_figures(args.hicache)
    still = time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - still < 2.5:
        time.sleep(0.25)
        v2, h2 = vllm_counters(args.url), hicache_figures(args.hicache)
        if (v2, h2) != (v, h):
            v, h, still = v2, h2, time.monotonic()
    vd, hd = _delta(v, before_v), _delta(h, before_h)
    ttft = sorted(r["ttft"] for r in done)
    out: dict[str, Any] = {
        "requests": len(done),
        "requests_per_s": round(len(done) / wall, 3),
        "ttft_p50_ms": round(statistics.median(ttft) * 1000, 1),
        "ttft_p90_ms": round(ttft[int(0.9 * (len(ttft) - 1))] * 1000, 1),
        "vllm": {k.removeprefix("vllm:"): int(x) for k, x in vd.items()},
        "hicache": hd,
    }
    print(f"requests {out['requests']}  {out['requests_per_s']} req/s  "
          f"TTFT p50 {out['ttft_p50_ms']} ms  p90 {out['ttft_p90_ms']} ms")  # fmt: skip
    for k, x in out["vllm"].items():
        print(f"  vllm    {k:<40} {x:>10}")
    for k, x in hd.items():
        print(f"  hicache {k:<40} {x:>10}")
    if hd:
        q, hit = (
            out["vllm"]["external_prefix_cache_queries_total"],
            out["vllm"]["external_prefix_cache_hits_total"],
        )
        out["queries_agree"] = q == hd["engine_queried_tokens"]
        out["hits_agree"] = hit == hd["engine_hit_tokens"]
    print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
