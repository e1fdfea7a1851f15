"""Demo: start hicache-daemon on its embedded default, drive a multi-turn chat trace through
the client library as an engine would, print hit ratios by tier; then the same trace against a
device-only daemon (host tier off) for comparison. Each daemon runs on a private socket and is
stopped at the end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import torch

from hicache.client import HiCacheClient
from hicache.workload import chat_trace


def start(endpoint: str, *flags: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "hicache.daemon", "--endpoint", endpoint, *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    line = proc.stdout.readline()
    if "ready" not in line:
        raise SystemExit(f"daemon failed to start: {line}{proc.stdout.read()}")
    return proc


def serve(endpoint: str, trace) -> dict:  # noqa: ANN001
    """The engine loop: match, load back, allocate, write KV, insert, release."""
    prompt_tokens = device_hits = host_hits = recomputed = 0
    with HiCacheClient(endpoint, name="demo-engine") as hc:
        pools = hc.attach()
        for req in trace:
            m = hc.match_prefix(req.prompt)
            loaded = hc.load_back(m)
            prefix = m.device_indices if loaded is None else torch.cat([m.device_indices, loaded])
            new = hc.alloc(len(req.finished) - len(prefix))
            for layer in range(len(pools.k_buffer)):  # "compute" KV for the new tokens
                pools.k_buffer[layer][new] = 1.0
                pools.v_buffer[layer][new] = 2.0
            hc.insert(req.finished, torch.cat([prefix, new]))
            hc.release(m)
            prompt_tokens += len(req.prompt)
            device_hits += m.device_hit_length
            host_hits += 0 if loaded is None else len(loaded)
            recomputed += len(req.prompt) - len(prefix)
        stats = hc.stats(check=True)
    return {
        "prompt": prompt_tokens,
        "device": device_hits,
        "host": host_hits,
        "recomputed": recomputed,
        "stats": stats,
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
    print(f"integrity:{s['integrity']} seconds:{seconds:.1f}\n")


def main() -> None:
    trace = chat_trace(n_systems=2, system_len=1024, n_convs=24, turns=4, seed=1)
    with tempfile.TemporaryDirectory(prefix="hicache-demo-") as tmp:
        results = {}
        for label, flags in (
            ("hicache (embedded default: write_through, host 4x device)", ()),
            ("device only (--host-tokens 0)", ("--host-tokens", "0")),
        ):
            endpoint = f"ipc://{os.path.join(tmp, 'demo.sock')}"
            proc = start(endpoint, *flags)
            try:
                t0 = time.perf_counter()
                results[label] = serve(endpoint, trace)
                report(label, results[label], time.perf_counter() - t0)
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=30)
        on, off = (r["recomputed"] for r in results.values())
        print(
            f"recompute_reduction:{off / max(on, 1):.2f}x fewer prompt tokens prefilled "
            "with the host tier"
        )


if __name__ == "__main__":
    main()
