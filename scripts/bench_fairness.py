"""Fairness benchmark: one client's heavy requests against another client's match latency.

A victim engine matches a cached prompt (lock=False, one every 2 ms) and records each round
trip, in blocks of half a second: alone, then while a second process sends requests in a loop,
in turns (both see the same machine noise). The second process sends
1. ``batch``: batched matches of 1024 copies of one ``--heavy-tokens`` prompt over a cached
   prefix (the prompt travels once) through HiCacheClient.match_batch (the daemon answers in
   parts while others wait, the client asks again for the rest);
2. ``pipelined``: the same request raw, four in flight at once, never asking for the rest;
3. ``views``: integrity checks (STATS check) and tree dumps of 100,000 nodes, back to back, over
   a tree of ``--nodes`` more cached prompts;
and, as the reference for 1., ``busy``: two processes that only keep both cores busy (on a
machine of two cores the victim then waits for a core as long as under 1., where the daemon
and the attacking client each keep one busy).
Each prints the victim's p50 and p99 under it against the blocks alone between, and what the
attacker got done; then the worst p99 under an attack over the p99 under ``busy`` (what the
daemon's turns add to what the attacker's process does to the engines' core). The last line
is one JSON object.

With ``--pin`` (the default where there are two CPUs or more) the daemon, its threads and its
helpers run on the first CPU alone and both engines on the others, the attacker's process at
SCHED_IDLE (its own work never delays the victim's on their shared CPU): as on a host where the
daemon and the engines have cores of their own, what is left is what the daemon's loop does to
the victim. ``--no-pin``: all share every CPU (on two cores the victim's p99 is then the
machine's: see ``busy``).

    python -m scripts.bench_fairness [--seed 0] [--heavy-tokens 16384] [--nodes 4096] [--no-pin]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time

import msgpack
import numpy as np
import torch
import zmq

from hicache.client import HiCacheClient
from hicache.daemon.launch import start_daemon, stop_daemon
from hicache.protocol import MAX_MATCH_TOKENS, PROTOCOL_VERSION, Op, decode_reply
from hicache.tree import pack_shared

PROBE_EVERY_S = 0.002
BLOCKS, BLOCK_S = 12, 0.5  # per attack: blocks alone and attacked, in turns
KINDS = ("busy", "batch", "pipelined", "views")
BATCH = 1024
IN_FLIGHT = 4


def probe(hc: HiCacheClient, prompt: np.ndarray, seconds: float) -> list[float]:
    """Round trips (seconds) of one match, one every PROBE_EVERY_S, for ``seconds``."""
    out, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.perf_counter()
        hc.match_prefix(prompt, lock=False)
        out.append(time.perf_counter() - t)
        time.sleep(PROBE_EVERY_S)  # (pacing: an engine asks between its forward passes)
    return out


def heavy_batch(rng: np.random.Generator, base: np.ndarray, heavy: int) -> list[np.ndarray]:
    """BATCH copies of one prompt of ``heavy`` tokens that starts with ``base`` (cached): the
    request is small (the prompt travels once) and its matches are long."""
    tail = rng.integers(1, 32000, heavy - len(base), dtype=np.int32)
    return [np.concatenate([base, tail])] * BATCH


def attacker(endpoint: str, kind: str, seed: int, heavy: int, nodes: int, pinned: bool, go,
             stop, counts) -> None:  # fmt: skip  # noqa: ANN001
    """Send ``kind`` requests while ``go`` is set, until ``stop``; counts[kind] = (requests
    answered, refused)."""
    rng = np.random.default_rng(seed + 1)
    if pinned:  # the attacking engine's own work yields to the victim engine's on their core
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    if kind == "busy":  # no request: a core kept busy (what two busy processes cost alone)
        counts[kind] = (0, 0)
        while not stop.is_set():
            if go.wait(0.05):  # keep a core busy for 50 ms (counted, never used)
                spin_until, spins = time.monotonic() + 0.05, 0
                while time.monotonic() < spin_until:
                    spins += 1
        return
    with HiCacheClient(endpoint, name=f"noisy-{kind}") as hc:
        base = rng.integers(1, 32000, heavy * 3 // 4, dtype=np.int32)
        hc.insert(base, hc.alloc(len(base)))
        if kind == "views":
            for _ in range(nodes):  # many distinct prompts: a large tree to walk
                p = rng.integers(1, 32000, 32, dtype=np.int32)
                hc.insert(p, hc.alloc(len(p)))
        batch = heavy_batch(rng, base, heavy)
        frame, shared = pack_shared(batch)
        fields = {"lengths": [heavy] * BATCH, "shared": shared, "lock": False}
        match = msgpack.packb([PROTOCOL_VERSION, int(Op.MATCH), 1, hc.session, hc._link.epoch,
                               fields])  # fmt: skip
        views = [
            msgpack.packb([PROTOCOL_VERSION, int(Op.STATS), 1, 0, 0, {"check": True}]),
            msgpack.packb([PROTOCOL_VERSION, int(Op.TREE), 1, hc.session, hc._link.epoch,
                           {"max_nodes": 100_000}]),
        ]  # fmt: skip
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(endpoint)
        counts[kind] = (0, 0)
        done = refused = outstanding = 0
        while not stop.is_set() or outstanding:
            if kind == "pipelined" and go.is_set() and outstanding < IN_FLIGHT:
                sock.send_multipart([match, frame])  # (the rest of each is never asked)
                outstanding += 1
            elif outstanding:
                refused += not decode_reply(sock.recv_multipart()[0]).ok
                outstanding -= 1
                done += 1
            elif not go.wait(0.05) or stop.is_set():
                counts[kind] = (done, refused)
            elif kind == "batch":
                hc.match_batch(batch, lock=False)
                done += 1
            else:
                sock.send_multipart([views[done % 2]])
                refused += not decode_reply(sock.recv_multipart()[0]).ok
                done += 1
        counts[kind] = (done, refused)
        sock.close(linger=0)


def percentiles(xs: list[float]) -> tuple[float, float]:
    a = np.sort(np.array(xs)) * 1e3
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--heavy-tokens", type=int, default=16384)
    ap.add_argument("--nodes", type=int, default=4096)
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="daemon alone on CPU 0, the engines on the others (as on a host "
                    "where engines have their own cores)")  # fmt: skip
    args = ap.parse_args()
    if BATCH * args.heavy_tokens > MAX_MATCH_TOKENS:  # the daemon would refuse every batch
        ap.error(f"--heavy-tokens: at most {MAX_MATCH_TOKENS // BATCH} ({BATCH} per batch)")
    cpus = sorted(os.sched_getaffinity(0))
    pinned = args.pin and len(cpus) >= 2
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(1, 32000, args.prompt_tokens, dtype=np.int32)
    ctx = mp.get_context("spawn")
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="hicache-fair-") as tmp:
        endpoint = f"ipc://{tmp}/d.sock"
        flags = ["--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8",
                 "--device-tokens", str(-(-max(262144, 2 * args.heavy_tokens + 64 * args.nodes)
                                         // 16) * 16),  # (whole pages of the default 16)
                 "--host-ratio", "2", "--keep-host", "false"]  # fmt: skip
        if pinned:
            os.sched_setaffinity(0, cpus[:1])  # the daemon, its threads and helpers inherit it
        proc = start_daemon(endpoint, *flags)
        if pinned:
            os.sched_setaffinity(0, cpus[1:])  # the victim here, the attackers it spawns
        try:
            with ctx.Manager() as manager, HiCacheClient(endpoint, name="victim") as hc:
                counts = manager.dict()
                hc.insert(torch.from_numpy(prompt), hc.alloc(len(prompt)))
                probe(hc, prompt, 0.5)  # warm up
                alone: list[float] = []
                for i, kind in enumerate(KINDS):
                    go, stop = manager.Event(), manager.Event()
                    work = (endpoint, kind, args.seed + i, args.heavy_tokens, args.nodes, pinned)
                    noisy = [
                        ctx.Process(target=attacker, args=(*work, go, stop, counts))
                        for _ in range(2 if kind == "busy" else 1)  # busy: both cores
                    ]
                    for p in noisy:
                        p.start()
                    while kind not in counts:
                        if not any(p.is_alive() for p in noisy):
                            raise SystemExit(f"the {kind} attacker died in its setup")
                        time.sleep(0.05)  # (its setup: inserting what it needs)
                    base, lat = [], []
                    for _ in range(BLOCKS):  # alone and under attack in turns: the same noise
                        base += probe(hc, prompt, BLOCK_S)
                        go.set()
                        lat += probe(hc, prompt, BLOCK_S)
                        go.clear()
                    stop.set()
                    for p in noisy:
                        p.join()
                    done, refused = counts[kind]
                    failed = [p.exitcode for p in noisy if p.exitcode]
                    if failed or (kind in ("batch", "pipelined") and done <= refused):
                        raise SystemExit(  # (a run that measured no attack is no result)
                            f"the {kind} attacker failed (exit {failed}, {done} requests, "
                            f"{refused} refused): see its error above"
                        )
                    alone += base
                    b50, b99 = percentiles(base)
                    p50, p99 = percentiles(lat)
                    results[kind] = {
                        "p50_ratio": round(p50 / b50, 2),
                        "p99_ratio": round(p99 / b99, 2),
                        "p99_ms": round(p99, 3),
                        "attacker_requests": done,
                        "attacker_refused": refused,
                    }
                    print(
                        f"victim under {kind:10s} p50 {p50:6.2f} ms  p99 {p99:6.2f} ms; alone "
                        f"between: p50 {b50:6.2f} ms  p99 {b99:6.2f} ms ({p50 / b50:.2f}x, "
                        f"{p99 / b99:.2f}x; attacker: {done} requests, {refused} refused)"
                    )
                b50, b99 = percentiles(alone)
                stats = hc.stats()
        finally:
            stop_daemon(proc)
    worst = max(r["p99_ratio"] for k, r in results.items() if k != "busy")
    # the engines' core as busy as an attacker's process makes it, with no request: what is
    # left of a ratio over this is the daemon's share of the turns
    over_busy = max(r["p99_ms"] for k, r in results.items() if k != "busy") / max(
        results["busy"]["p99_ms"], 1e-9
    )
    print(f"worst p99 under attack over p99 under busy: {over_busy:.2f}x")
    print(
        json.dumps(
            {
                **{f"{k}_{m}": v for k, r in results.items() for m, v in r.items()},
                "worst_p99_ratio": worst,
                "worst_p99_over_busy": round(over_busy, 2),
                "baseline_p50_ms": round(b50, 3),
                "baseline_p99_ms": round(b99, 3),
                "views_refused": stats.get("views_refused"),
                "match_parts": stats.get("match_parts"),
                "gc_pause_seconds_max": stats.get("gc_pause_seconds_max"),
                "gc_collections": stats.get("gc_collections"),
                "seed": args.seed,
                "heavy_tokens": args.heavy_tokens,
                "cpu_count": os.cpu_count(),
                "pinned": pinned,
            }
        )
    )


if __name__ == "__main__":
    main()
