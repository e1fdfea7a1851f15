"""Demo: start hicache-daemon on its embedded default and serve a multi-turn chat trace with a
real (tiny, random) transformer whose KV lives in the daemon's pools; print hit ratios by tier.
Then the same trace against a device-only daemon (host tier off) for comparison. Each daemon
runs on a private socket and is stopped at the end.
"""

from __future__ import annotations

import os
import tempfile
import time

from hicache.client import HiCacheClient
from hicache.daemon.launch import start_daemon, stop_daemon
from hicache.workload import chat_trace
from scripts.ref_engine import ReferenceEngine


def serve(endpoint: str, trace) -> dict:  # noqa: ANN001
    """A real model (a tiny random Llama) computes only what the cache does not hold."""
    prompt_tokens = device_hits = host_hits = recomputed = 0
    t_model = 0.0
    with HiCacheClient(endpoint, name="demo-engine") as hc:
        engine = ReferenceEngine(hc)
        for req in trace:
            served = engine.serve(req.finished)  # prompt + answer, as if just generated
            n = len(req.prompt)
            reused = min(served.computed_from, n)
            prompt_tokens += n
            device_hits += min(served.device_hit, n)
            host_hits += min(served.host_hit, n - min(served.device_hit, n))
            recomputed += n - reused
            t_model += served.model_s
        stats = hc.stats(check=True)
    return {
        "prompt": prompt_tokens,
        "device": device_hits,
        "host": host_hits,
        "recomputed": recomputed,
        "stats": stats,
        "model_s": t_model,
    }


def report(label: str, r: dict, seconds: float) -> None:
    s = r["stats"]
    print(f"# {label}")
    print(f"prompt_tokens:{r['prompt']}")
    print(f"hit_ratio_device:{r['device'] / r['prompt']:.3f}")
    print(f"hit_ratio_host:{r['host'] / r['prompt']:.3f}")
    print(f"recomputed_tokens:{r['recomputed']}")
    print(
        f"backup_tokens:{s['backup_tokens']} load_tokens:{s['load_tokens']} "
        f"evicted_device_tokens:{s['evicted_device_tokens']}"
    )
    print(f"model_seconds:{r['model_s']:.1f} integrity:{s['integrity']} seconds:{seconds:.1f}\n")


def main() -> None:
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
        results = {}
        for label, flags in (
            ("hicache (embedded default: write_through, host 4x device)", ()),
            ("device only (--host-tokens 0)", ("--host-tokens", "0")),
        ):
            endpoint = f"ipc://{os.path.join(tmp, 'demo.sock')}"
            proc = start_daemon(endpoint, *flags)
            try:
                t0 = time.perf_counter()
                results[label] = serve(endpoint, trace)
                report(label, results[label], time.perf_counter() - t0)
            finally:
                stop_daemon(proc)
        on, off = (r["recomputed"] for r in results.values())
        print(
            f"recompute_reduction:{off / max(on, 1):.2f}x fewer prompt tokens prefilled "
            "with the host tier"
        )


if __name__ == "__main__":
    main()
