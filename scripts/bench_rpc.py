"""RPC benchmark: match_prefix through hicache-daemon against a raw pyzmq echo of the same bytes.

1. Round trip of one match of a cached 4096-token prompt (lock=False: one message each way),
   against a ROUTER echo process that returns the same request frames: p50 and p99.
2. One batched match of 64 distinct cached 4096-token prompts (sharing a 2048-token system
   prompt) against 8 single matches of the same kind.
3. The client's match against the bare connection path under it (one Connection.call and the
   reply's Match objects: what the client did before it could be shared by threads).
4. 4 threads sharing one client against 4 threads with a client each: matches per second.
5. The same match round trip against a second daemon with Prometheus metrics and KV events on
   (a scraper every second, a subscriber reading the stream), interleaved with the first.
6. In the blocks of 1., the match against a third daemon with ``--busy-poll-us 0`` (it sleeps on
   its socket right after each reply, as the echo does).
The last line is one JSON object.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import tempfile
import threading
import time
import urllib.request

import msgpack
import numpy as np
import torch
import zmq

from hicache.client import HiCacheClient
from hicache.client.results import Match, PageFrame
from hicache.daemon.launch import start_daemon, stop_daemon
from hicache.protocol import PROTOCOL_VERSION, MatchReply, Op, tokens_frame
from hicache.tree import as_tokens

WARMUP, ROUNDS = 200, 2000
THREADS = 4


def echo_server(endpoint: str) -> None:
    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(endpoint)
    while True:
        frames = sock.recv_multipart(copy=False)
        if len(frames) == 2 and bytes(frames[1].buffer) == b"stop":
            return
        sock.send_multipart(frames, copy=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Watchers:
    """What an operator runs beside the daemon: a Prometheus scrape every second and a router
    reading the KV event stream."""

    def __init__(self, port: int, events_ep: str):
        self.scrapes = self.batches = 0
        self._stop = threading.Event()
        self._sub = zmq.Context.instance().socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(events_ep)
        self._threads = [
            threading.Thread(target=self._scrape, args=(port,), daemon=True),
            threading.Thread(target=self._read, daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _scrape(self, port: int) -> None:
        while not self._stop.wait(1.0):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
            self.scrapes += 1

    def _read(self) -> None:
        while not self._stop.is_set():
            if self._sub.poll(100):
                self._sub.recv_multipart()
                self.batches += 1

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()
        self._sub.close()


def percentiles(samples: list[int]) -> tuple[float, float]:
    arr = np.array(samples) / 1e3
    return float(np.percentile(arr, 50)), float(np.percentile(arr, 99))


def block_ratios(ours: list[int], base: list[int], block: int = 100) -> list[float]:
    """Per interleaved block: the p50 of ``ours`` over the p50 of ``base`` in the block beside
    it. A noisy spell of the machine hits both halves of a pair alike, so the median of these
    holds still where the pooled p50s move with the noise."""
    return [
        float(np.median(ours[i : i + block]) / np.median(base[i : i + block]))
        for i in range(0, min(len(ours), len(base)), block)
    ]


def echo_round_trips(sock: zmq.Socket, prompt: np.ndarray, rounds: int) -> list[int]:
    header = msgpack.packb(
        [
            PROTOCOL_VERSION,
            4,
            1,
            1,
            2**61,
            {"lengths": [len(prompt)], "namespaces": [None], "lock": False},
        ]
    )
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        sock.send_multipart([header, tokens_frame(prompt)], copy=False)
        sock.recv_multipart(copy=False)
        out.append(time.perf_counter_ns() - t0)
    return out


def match_round_trips(hc: HiCacheClient, prompt: np.ndarray, rounds: int) -> list[int]:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        hc.match_prefix(prompt, lock=False)
        out.append(time.perf_counter_ns() - t0)
    return out


def direct_round_trips(hc: HiCacheClient, prompt: np.ndarray, rounds: int) -> list[int]:
    """The bare path under match_prefix: validation, one Connection.call, the Matches."""
    conn, ps = hc.conn, hc.config.page_size
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        tokens = as_tokens(prompt)
        fields = {"lengths": [len(tokens)], "lock": False, "namespaces": [None]}
        reply, frames = conn.call(Op.MATCH, fields, [tokens])
        answer = MatchReply.read(reply.fields)
        frame = PageFrame(frames[0], answer.chunk_pages, ps)
        [Match(frame, e.chunks, e.device_len, e.host_len, e.lock_id) for e in answer.results]
        out.append(time.perf_counter_ns() - t0)
    return out


def threads_rate(clients: list[HiCacheClient], prompt: np.ndarray, per_thread: int) -> float:
    """Matches per second of len(clients) threads, thread i calling clients[i]."""
    start = threading.Barrier(len(clients) + 1)

    def run(hc: HiCacheClient) -> None:
        start.wait()
        for _ in range(per_thread):
            hc.match_prefix(prompt, lock=False)

    threads = [threading.Thread(target=run, args=(hc,)) for hc in clients]
    for th in threads:
        th.start()
    start.wait()
    t0 = time.perf_counter()
    for th in threads:
        th.join()
    return len(clients) * per_thread / (time.perf_counter() - t0)


def time_batches(
    hc: HiCacheClient, prompts: list[np.ndarray], rounds: int = 30
) -> tuple[float, float]:
    """Median cost of 8 single matches against one batch of 64 (distinct prompts)."""
    singles, batched = [], []
    for r in range(rounds):
        t0 = time.perf_counter_ns()
        for i in range(8):
            hc.match_prefix(prompts[(r * 8 + i) % len(prompts)], lock=False)
        t1 = time.perf_counter_ns()
        hc.match_batch(prompts, lock=False)
        t2 = time.perf_counter_ns()
        singles.append(t1 - t0)
        batched.append(t2 - t1)
    return float(np.median(singles)) / 1e3, float(np.median(batched)) / 1e3


def cache_prompts(hc: HiCacheClient, prompts: list[np.ndarray]) -> None:
    for p in prompts:
        m = hc.match_prefix(p)
        hc.insert(p, torch.cat([m.device_indices, hc.alloc(len(p) - m.device_hit_length)]))
        hc.release(m)


def main() -> None:
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, 32000, 4096, dtype=np.int32)
    # the batch: 64 distinct 4096-token prompts over one shared 2048-token system prompt
    system = rng.integers(1, 32000, 2048, dtype=np.int32)
    batch = [
        np.concatenate([system, rng.integers(1, 32000, 2048, dtype=np.int32)]) for _ in range(64)
    ]
    with tempfile.TemporaryDirectory(prefix="hicache-rpc-") as tmp:
        echo_ep, daemon_ep = f"ipc://{tmp}/echo.sock", f"ipc://{tmp}/daemon.sock"
        echo = mp.get_context("spawn").Process(target=echo_server, args=(echo_ep,))
        echo.start()
        # a small KV shape: the RPC is measured, and 65 cached prompts must fit the device pool
        flags = [
            "--num-layers",
            "2",
            "--num-kv-heads",
            "1",
            "--head-dim",
            "16",
            "--device-tokens",
            "262144",
            "--host-ratio",
            "2",
            "--keep-host",
            "false",  # a temporary endpoint: nobody will adopt the host pool
        ]
        proc = start_daemon(daemon_ep, *flags)
        observed_ep = f"ipc://{tmp}/observed.sock"
        port, events_ep = free_port(), f"ipc://{tmp}/events.sock"
        observed = start_daemon(
            observed_ep, *flags, "--metrics-port", str(port), "--events-endpoint", events_ep
        )
        watchers = Watchers(port, events_ep)
        sleeper_ep = f"ipc://{tmp}/sleeper.sock"  # sleeps on its socket right after a reply
        sleeper = start_daemon(sleeper_ep, *flags, "--busy-poll-us", "0")
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(echo_ep)
        try:
            with (
                HiCacheClient(daemon_ep, name="bench") as hc,
                HiCacheClient(sleeper_ep, name="bench-sleeper") as hs,
            ):
                cache_prompts(hc, [prompt, *batch])
                cache_prompts(hs, [prompt])
                echo_round_trips(sock, prompt, WARMUP)
                match_round_trips(hc, prompt, WARMUP)
                match_round_trips(hs, prompt, WARMUP)
                echo_ns, match_ns, sleeper_ns = [], [], []
                for _ in range(ROUNDS // 100):  # interleaved blocks: all see the same noise
                    echo_ns += echo_round_trips(sock, prompt, 100)
                    match_ns += match_round_trips(hc, prompt, 100)
                    sleeper_ns += match_round_trips(hs, prompt, 100)
                single8_us, batch64_us = time_batches(hc, batch)
                direct_round_trips(hc, prompt, WARMUP)
                client_ns, direct_ns = [], []
                for _ in range(ROUNDS // 100):
                    direct_ns += direct_round_trips(hc, prompt, 100)
                    client_ns += match_round_trips(hc, prompt, 100)
                own = [HiCacheClient(daemon_ep, name=f"own{i}") for i in range(THREADS)]
                shared_rates, own_rates = [], []
                for _ in range(5):  # interleaved runs, medians
                    shared_rates.append(threads_rate([hc] * THREADS, prompt, 300))
                    own_rates.append(threads_rate(own, prompt, 300))
                for c in own:
                    c.close()
                with HiCacheClient(observed_ep, name="bench-observed") as ho:
                    cache_prompts(ho, [prompt])
                    match_round_trips(ho, prompt, WARMUP)
                    plain_ns, observed_ns = [], []
                    for _ in range(ROUNDS // 100):
                        plain_ns += match_round_trips(hc, prompt, 100)
                        observed_ns += match_round_trips(ho, prompt, 100)
        finally:
            watchers.stop()
            sock.send_multipart([b"stop"])
            sock.close()
            echo.join()
            stop_daemon(proc)
            stop_daemon(observed)
            stop_daemon(sleeper)
    e50, e99 = percentiles(echo_ns)
    m50, m99 = percentiles(match_ns)
    s50, s99 = percentiles(sleeper_ns)
    blocks = block_ratios(match_ns, echo_ns)
    print(f"raw pyzmq echo, 4096 token ids:      p50 {e50:7.1f} us  p99 {e99:7.1f} us")
    print(
        f"match_prefix via daemon, 4096 tokens: p50 {m50:7.1f} us  p99 {m99:7.1f} us  "
        f"({m50 / e50:.2f}x echo)"
    )
    print(
        f"  paired by block (each block's p50 against the echo block beside it): median "
        f"{np.median(blocks):.2f}x, blocks {min(blocks):.2f}x-{max(blocks):.2f}x"
    )
    print(
        f"  the same, --busy-poll-us 0:         p50 {s50:7.1f} us  p99 {s99:7.1f} us  "
        f"({s50 / e50:.2f}x echo)"
    )
    print(
        f"8 single matches {single8_us:8.1f} us; one batch of 64 {batch64_us:8.1f} us "
        f"({batch64_us / single8_us:.2f}x)"
    )
    c50, _ = percentiles(client_ns)
    d50, _ = percentiles(direct_ns)
    shared_rate, own_rate = float(np.median(shared_rates)), float(np.median(own_rates))
    print(
        f"client match p50 {c50:7.1f} us vs the bare connection path {d50:7.1f} us "
        f"({c50 / d50:.3f}x)"
    )
    print(
        f"{THREADS} threads: one shared client {shared_rate:8.0f} matches/s, a client each "
        f"{own_rate:8.0f} matches/s ({shared_rate / own_rate:.2f}x)"
    )
    p50, _ = percentiles(plain_ns)
    o50, _ = percentiles(observed_ns)
    print(
        f"match p50 with metrics and KV events on {o50:7.1f} us vs off {p50:7.1f} us "
        f"({o50 / p50:.3f}x; {watchers.scrapes} scrapes, {watchers.batches} event batches read)"
    )
    print(
        json.dumps(
            {
                "metrics_events_overhead": round(o50 / p50, 3),
                "rpc_vs_echo_p50": round(m50 / e50, 3),
                "single_thread_rpc_vs_echo": round(m50 / e50, 3),
                "rpc_vs_echo_p50_no_busy_poll": round(s50 / e50, 3),
                "rpc_vs_echo_p50_paired": round(float(np.median(blocks)), 3),
                "echo_p99_over_p50": round(e99 / e50, 2),  # > 3: a noisy machine
                "single_thread_client_vs_direct": round(c50 / d50, 3),
                "threads_shared_vs_own": round(shared_rate / own_rate, 3),
                "batch64_vs_single8": round(batch64_us / single8_us, 3),
                "echo_p50_us": round(e50, 1),
                "match_p50_us": round(m50, 1),
                "cpu_count": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
