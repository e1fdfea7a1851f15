"""The disk tier end to end (``python -m scripts.bench_disk --part e2e``): a real transformer
served through the daemon (``ref_engine.py``) on traces whose working set is 4x the host pool
and fits the disk, each configuration in a fresh daemon, side by side in one run:

- ``host only``: the device and host pools, no disk;
- ``disk all`` / ``disk reused`` / ``disk reused-strict``: the same pools over a disk
  (``--disk-admission``);
- ``unbounded``: a host pool that holds the whole trace (the ceiling of any cache).

Per run: prompt tokens, tokens recomputed (and their ratio to the ceiling's), tokens served
from the disk, bytes the disk wrote and the bytes written per token it served. Then the
``disk all`` daemon's folder is opened by a daemon started cold (no host pool kept) and the
trace's first round is served again: the tokens that came from the disk. Traces (seeded, so
that a run can be repeated; the default seeds are not the tests'):

- ``docqa``: long documents, each asked questions in rounds interleaved over all documents
  (a document's next question comes after the host pool has cycled: the worst case for
  ``reused-strict``, which admits a page only once it was reused, and what ``reused`` learns
  to write at first sight);
- ``stream``: documents that keep arriving (a corpus that grows, sessions that come back),
  each asked again twice, a few documents later each time, after the host pool has cycled;
  ``reused`` sees the first documents' pages come back and writes the later ones at first
  sight;
- ``mixed``: documents visited in bursts (two questions back to back, then again rounds later)
  among as many one-off prompts that are never seen again (what ``all`` writes for nothing).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from hicache.client import HiCacheClient
from hicache.daemon.launch import start_daemon, stop_daemon
from scripts import traces
from scripts.bench_e2e import MODEL
from scripts.ref_engine import ReferenceEngine

PAGE = 16  # tokens per page (MODEL's --page-size)
BUDGET = "1TiB"  # (the budget is not what these runs measure)


def docqa(seed: int) -> list[dict]:
    return traces.doc_qa(seed=seed, docs=12, doc_len=1500, questions=4)


def stream(seed: int, docs: int = 24, doc_len: int = 1500, gap: int = 4) -> list[dict]:
    """Document ``t`` arrives at step ``t`` with its first question; documents ``t - gap`` and
    ``t - 2 * gap`` get their second and third then (the last ones' come after the last
    arrival)."""
    rng = np.random.default_rng(seed)
    vocab = 512
    texts = [rng.integers(1, vocab, doc_len).tolist() for _ in range(docs)]
    out = []
    for t in range(docs + 2 * gap):
        for d in (t, t - gap, t - 2 * gap):
            if 0 <= d < docs:
                question = rng.integers(1, vocab, 48).tolist()
                answer = rng.integers(1, vocab, 32).tolist()
                out.append({"prompt": texts[d] + question, "answer": answer})
    return out


def mixed(seed: int, docs: int = 10, doc_len: int = 1500, visits: int = 3) -> list[dict]:
    """Each document visited ``visits`` times in rounds, two questions per visit back to back;
    after every request a one-off prompt of the same length."""
    rng = np.random.default_rng(seed)
    vocab = 512
    texts = [rng.integers(1, vocab, doc_len).tolist() for _ in range(docs)]
    out = []
    for _ in range(visits):
        for d in rng.permutation(docs):
            for _ in range(2):
                question = rng.integers(1, vocab, 48).tolist()
                answer = rng.integers(1, vocab, 32).tolist()
                out.append({"prompt": texts[d] + question, "answer": answer})
                once = rng.integers(1, vocab, doc_len + 48).tolist()
                out.append({"prompt": once, "answer": rng.integers(1, vocab, 32).tolist()})
    return out


def serve(endpoint: str, requests: list, flags: list[str]) -> dict[str, Any]:
    """Serve ``requests`` in a fresh daemon started with ``flags``; its totals."""
    proc = start_daemon(endpoint, *MODEL, *flags, "--keep-host", "false")
    try:
        with HiCacheClient(endpoint, name="bench-engine", admin=True, timeout_s=60) as hc:
            engine = ReferenceEngine(hc)
            prompt = recomputed = 0
            for tokens, finished in requests:
                served = engine.serve(finished)
                prompt += len(tokens)
                recomputed += len(tokens) - min(served.computed_from, len(tokens))
            stats = hc.stats(check=True)
            assert stats["integrity"] == "ok", stats["integrity"]
            l3 = stats.get("l3") or {}
            return {
                "prompt": prompt,
                "recomputed": recomputed,
                "disk_tokens": l3.get("adopted_pages", 0) * PAGE,
                "disk_written_bytes": l3.get("store_disk_written_bytes", 0),
                "disk_held_bytes": l3.get("store_disk_held_bytes", 0),
            }
    finally:
        stop_daemon(proc)  # (a clean stop: the disk's queued writes land)


def bench(name: str, requests: list, rounds: int, tmp: Path) -> dict[str, Any]:
    """``rounds``: how many times the trace's reused prompts come back (its first round is
    the first 1/rounds of it)."""
    ws = traces.working_set(requests)
    reused = traces.working_set(_seen_again(requests))  # what a cache can serve from
    host = max(reused // 4 // PAGE * PAGE, 512)
    longest = max(len(f) for _, f in requests)
    device = -(-2 * longest // PAGE) * PAGE  # (a request's pages, and the next one's)
    page_bytes = 65536  # (MODEL: 4 layers x K,V x 4 heads x 32 x 16 tokens x 4 bytes)
    disk_bytes = 2 * (ws // PAGE + 1) * (page_bytes + 4096)
    pools = ["--device-tokens", str(device), "--host-tokens", str(host)]
    runs: dict[str, dict[str, Any]] = {}
    runs["host only"] = serve(f"ipc://{tmp}/{name}-host.sock", requests, pools)
    for admission in ("all", "reused", "reused-strict"):
        disk = [
            "--disk", str(tmp / f"{name}-{admission}"), "--disk-bytes", str(disk_bytes),
            "--disk-write-budget", BUDGET, "--disk-admission", admission,
            "--l3-model", f"bench-{name}",
        ]  # fmt: skip
        runs[f"disk {admission}"] = serve(
            f"ipc://{tmp}/{name}-{admission}.sock", requests, [*pools, *disk]
        )
    unbounded = ["--device-tokens", str(device), "--host-tokens", str(2 * ws + host)]
    runs["unbounded"] = serve(f"ipc://{tmp}/{name}-all.sock", requests, unbounded)
    # a daemon started cold on the `disk all` folder: the first round again
    first = requests[: len(requests) // rounds]
    disk = [
        "--disk", str(tmp / f"{name}-all"), "--disk-bytes", str(disk_bytes),
        "--disk-write-budget", BUDGET, "--disk-admission", "all", "--l3-model", f"bench-{name}",
    ]  # fmt: skip
    again = serve(f"ipc://{tmp}/{name}-again.sock", first, [*pools, *disk])
    ceiling = runs["unbounded"]["recomputed"]
    print(
        f"# {name}: {len(requests)} requests, working set ~{ws} tokens ({reused} of prompts "
        f"seen again), host pool {host} tokens (1/4 of those), device {device}, disk "
        f"{disk_bytes / 2**20:.0f} MiB"
    )
    out: dict[str, Any] = {"working_set_tokens": ws, "reused_tokens": reused, "host_tokens": host}
    for label, r in runs.items():
        per_token = r["disk_written_bytes"] / r["disk_tokens"] if r["disk_tokens"] else 0.0
        row = {
            "recomputed": r["recomputed"],
            "vs_ceiling": round(r["recomputed"] / max(ceiling, 1), 3),
            "hit_ratio": round(1 - r["recomputed"] / r["prompt"], 4),
            "disk_tokens": r["disk_tokens"],
            "disk_written_mib": round(r["disk_written_bytes"] / 2**20, 1),
            "written_bytes_per_disk_token": round(per_token),
        }
        out[label.replace(" ", "_")] = row
        print(
            f"{name:6s} {label:18s} prompt={r['prompt']:7d} recomputed={r['recomputed']:7d} "
            f"({row['vs_ceiling']:.2f}x the unbounded cache's) hit={row['hit_ratio']:.3f} "
            f"from_disk={r['disk_tokens']:7d} disk_written={row['disk_written_mib']:7.1f}MiB "
            f"written/disk_token={row['written_bytes_per_disk_token']}B",
            flush=True,
        )
    every = out["disk_all"]
    for admission in ("reused", "reused-strict"):
        reuse = out[f"disk_{admission}"]
        out[f"{admission.replace('-', '_')}_vs_all"] = {
            "written_bytes": round(
                reuse["disk_written_mib"] / every["disk_written_mib"], 3
            ) if every["disk_written_mib"] else None,
            "hit_ratio_difference": round(every["hit_ratio"] - reuse["hit_ratio"], 4),
        }  # fmt: skip
    prompt = again["prompt"]
    from_disk = prompt - again["recomputed"]  # (a cold daemon: what it reused is the disk's)
    out["restart_first_round"] = {
        "prompt": prompt,
        "from_disk": from_disk,
        "hit_ratio": round(from_disk / prompt, 4),
        "disk_pages_read": again["disk_tokens"] // PAGE,
    }
    print(
        f"{name:6s} restarted cold on the 'disk all' folder, first round ({len(first)} "
        f"requests): {from_disk} of {prompt} prompt tokens from the disk "
        f"(hit={from_disk / prompt:.3f}), {again['recomputed']} recomputed",
        flush=True,
    )
    return out


def run(seed: int) -> dict[str, Any]:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hicache-bench-disk-e2e-") as tmp:
        base = Path(tmp)
        out = {
            "docqa": bench("docqa", _requests(docqa(seed)), 4, base),
            "stream": bench("stream", _requests(stream(seed + 2)), 3, base),
            "mixed": bench("mixed", _requests(mixed(seed + 1)), 3, base),
        }
    out["seconds"] = round(time.monotonic() - started)
    return out


def _seen_again(requests: list) -> list:
    """The requests whose first 64 tokens another request shares (documents, not one-offs)."""
    heads: dict[bytes, int] = {}
    for tokens, _ in requests:
        heads[tokens[:64].tobytes()] = heads.get(tokens[:64].tobytes(), 0) + 1
    return [r for r in requests if heads[r[0][:64].tobytes()] > 1]


def _requests(reqs: list[dict]) -> list[tuple[np.ndarray, np.ndarray]]:
    out = []
    for r in reqs:
        prompt = np.array(r["prompt"], dtype=np.int32)
        out.append((prompt, np.concatenate([prompt, np.array(r["answer"], np.int32)])))
    return out


if __name__ == "__main__":
    print(json.dumps(run(11)))  # (bench_disk --part e2e --seed N is the documented way)
