"""Chaos: a storm of engines, kills, stalls, restarts and fuzzed requests against one daemon.

On loopback only, bounded in time and counts. What runs at once:

- ``--clients`` engine processes (torch-free: the bare Connection and the pools mapped with
  numpy) serving chat-like prompts over shared system prompts: match with a lock, load back
  what is on the host, check every KV value they read against the value written for its
  tokens, allocate, write, insert, release; small pools keep both tiers evicting.
- the harness SIGKILLs a random engine and starts another (``--kills`` in all), and stalls
  some with SIGSTOP for longer than their lease (but within lease + quarantine: a writer stalled
  past that could write pages given to others, which no shared-memory design can prevent);
- pauses the daemon (SIGSTOP) and restarts it (SIGKILL, then a new one) under attached
  engines, who must re-attach; the new daemon adopts the host tier of the last periodic
  snapshot (one a second), and the engines check those bytes like any others;
- peers that send requests and never read a reply;
- a fuzzer sending structure-aware mutations (``--fuzz`` in all): valid requests with fields
  of the wrong type or size, hostile lengths, wrong frame counts, huge batches, broken msgpack;
- an integrity check (``stats check=True``) every second, and a probe timing matches.

At the end every engine is killed, and after lease + quarantine the daemon must hold nothing
for them. The last line is one JSON object: clients, kills, fuzzed_requests,
integrity_failures, leaked_pages, leaked_locks, wrong_bytes, internal_errors,
rss_growth_ratio (daemon RSS once everything stopped over after warm-up, within its last life;
the peak, with request queues in flight, beside it) and match
p99 during the storm against a quiet run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import Any

import msgpack
import numpy as np
import psutil
import zmq

from hicache.client.connection import (
    Connection,
    DaemonError,
    DaemonTimeout,
    hello_fields,
)
from hicache.daemon.keep import HostKeeper
from hicache.daemon.launch import start_daemon, stop_daemon
from hicache.protocol import PROTOCOL_VERSION, HelloReply, LoadReply, MatchReply, Op

LEASE_S, QUARANTINE_S = 2.0, 2.0
PS, LAYERS, HEADS, DIM = 4, 2, 2, 4
SHAPE = ["--num-layers", str(LAYERS), "--num-kv-heads", str(HEADS), "--head-dim", str(DIM),
         "--dtype", "float32", "--page-size", str(PS), "--load-back-threshold", "1",
         "--lease-seconds", str(LEASE_S), "--quarantine-seconds", str(QUARANTINE_S),
         "--session-owned-fraction", "0.25", "--keep-host", "true", "--snapshot-seconds", "1",
         "--shutdown-timeout", "0"]  # fmt: skip
ADOPTED = re.compile(r"adopted (\d+) host tokens")
SYSTEMS = [np.random.default_rng(s).integers(1, 30000, 48).astype(np.int32) for s in range(4)]
# per engine counters in shared memory (they survive SIGKILL): ops, wrong bytes, reconnects
OPS, WRONG, RECONNECTS, READ = range(4)


def expected(tokens: np.ndarray) -> np.ndarray:
    """The value an engine writes for each token: a function of the whole prefix."""
    return (np.cumsum(tokens.astype(np.int64) * 7 + 1) % 65521).astype(np.float32)


class Engine:
    """One engine's session: hello, the device pool mapped, reconnect on any loss."""

    def __init__(self, endpoint: str, name: str, counters: Any):
        self.endpoint, self.name, self.counters = endpoint, name, counters
        self.conn: Connection | None = None
        self.pool: np.ndarray | None = None
        self.heard = 0.0

    def connect(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.conn = Connection(self.endpoint, 2.0)
        reply = self.conn.call(Op.HELLO, hello_fields(self.name, False, self.endpoint))[0]
        self.conn.session = HelloReply.read(reply.fields).session
        device = reply.fields["pools"]["device"]
        raw = np.memmap(device["path"], dtype=np.float32, mode="r+")
        self.pool = raw.reshape(2, LAYERS, -1, HEADS * DIM)  # [kv, layer, slot, H*D]
        self.heard = time.monotonic()
        self.counters[RECONNECTS] += 1

    def call(self, op: Op, fields: dict | None = None, frames: list | None = None) -> tuple:
        reply, out = self.conn.call(op, fields or {}, frames or [])
        self.heard = time.monotonic()
        return reply, out

    def alive(self) -> bool:
        """Heard from the daemon within half a lease: its pages are surely still ours."""
        return time.monotonic() - self.heard < LEASE_S / 2

    def serve(self, rng: np.random.Generator, history: list[np.ndarray]) -> None:
        if history and rng.random() < 0.5:
            base = history[rng.integers(len(history))]
        else:
            base = SYSTEMS[rng.integers(len(SYSTEMS))]
        prompt = np.concatenate([base, rng.integers(1, 30000, rng.integers(4, 40))]).astype(
            np.int32
        )
        reply, out = self.call(Op.MATCH, {"lengths": [len(prompt)], "lock": True}, [prompt])
        answer = MatchReply.read(reply.fields)
        device_len, host_len, lock_id = answer.results[0][:3]
        self.last = (device_len, host_len)
        pages = np.frombuffer(out[0], dtype=np.int64)
        bounds = np.concatenate([[0], np.cumsum(answer.chunk_pages)])
        mine = [pages[bounds[i] : bounds[i + 1]] for i in answer.results[0].chunks]
        have = np.concatenate(mine) if mine else np.empty(0, np.int64)
        slots = (have[:, None] * PS + np.arange(PS)).ravel()[:device_len]
        if host_len:
            r, out = self.call(Op.LOAD_BACK, {"lock_id": lock_id})
            if LoadReply.read(r.fields).loaded:
                slots = np.concatenate([slots, np.frombuffer(out[0], dtype=np.int64)])
        self.check(prompt, slots)
        rest = len(prompt) - len(slots)
        if rest:
            r, out = self.call(Op.ALLOC, {"num_tokens": rest})
            new = np.frombuffer(out[0], dtype=np.int64)[:rest]
            if not self.alive():  # stalled: these slots may be someone else's by now
                self.call(Op.RELEASE, {"lock_ids": [lock_id]})
                return
            value = expected(prompt)[len(slots) :]
            for layer in range(LAYERS):
                self.pool[0, layer, new, 0] = value + layer
                self.pool[1, layer, new, 0] = -value - layer
            slots = np.concatenate([slots, new])
        self.call(
            Op.INSERT,
            {"lengths": [len(prompt)], "release": [lock_id]},
            [prompt, slots.astype(np.int64)],
        )
        history.append(prompt)
        del history[:-16]
        self.counters[OPS] += 1

    def check(self, prompt: np.ndarray, slots: np.ndarray) -> None:
        """Every value read (locked, so stable) is the one written for its tokens."""
        if not len(slots):
            return
        want = expected(prompt)[: len(slots)]
        got_k = self.pool[0, LAYERS - 1, slots, 0]
        got_v = self.pool[1, 0, slots, 0]
        wrong = int((got_k != want + LAYERS - 1).sum() + (got_v != -want).sum())
        if wrong and os.environ.get("CHAOS_DEBUG"):
            bad = np.flatnonzero(got_k != want + LAYERS - 1)
            print(
                f"WRONG {self.name} pid={os.getpid()} len={len(prompt)} n={len(slots)} "
                f"device={self.last[0]} host={self.last[1]} bad={bad[:8].tolist()} "
                f"slots={slots[bad[:8]].tolist()} got={got_k[bad[:4]].tolist()} "
                f"want={(want + LAYERS - 1)[bad[:4]].tolist()} alive={self.alive()}",
                file=sys.stderr,
                flush=True,
            )
        self.counters[WRONG] += wrong * 4  # bytes (float32 values)
        self.counters[READ] += len(slots)


def engine_main(endpoint: str, name: str, counters: Any, seed: int) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    rng = np.random.default_rng(seed)
    engine, history = Engine(endpoint, name, counters), []
    while True:
        try:
            if engine.conn is None or not engine.conn.session:
                engine.connect()
            engine.serve(rng, history)
        except DaemonError as exc:  # lost lease, new epoch, out of memory, quota...
            if exc.code.name in ("EPOCH_MISMATCH", "LEASE_EXPIRED", "UNKNOWN_SESSION"):
                engine.conn.session = 0
        except (DaemonTimeout, OSError, KeyError):  # the daemon is away or between lives
            if engine.conn is not None:
                engine.conn.session = 0
            time.sleep(0.05)


# ---- the fuzzer -------------------------------------------------------------------------------
WEIRD = [None, True, -1, 0, 2**63, -(2**63), 1.5, "x" * 300, b"\xff" * 9, [], {}, [1] * 5000,
         {"a": [None]}, "lock", 2**64 - 1]  # fmt: skip
FIELDS = ["lengths", "lock", "lock_id", "lock_ids", "num_tokens", "namespaces", "shared",
          "release", "all", "check", "max_nodes", "device_tokens", "client", "pid", "wait",
          "layout", "shape", "top"]  # fmt: skip


def mutate(rng: random.Random, session: int, epoch: int) -> list[bytes]:
    """One hostile request: mostly a valid one with something wrong."""
    op = rng.choice(list(Op)) if rng.random() < 0.9 else rng.randint(-5, 300)
    fields: dict = {}
    for _ in range(rng.randint(0, 4)):
        fields[rng.choice(FIELDS)] = rng.choice(WEIRD) if rng.random() < 0.7 else rng.randint(0, 64)
    head = [PROTOCOL_VERSION, int(op), rng.randint(0, 2**40), session, epoch, fields]
    kind = rng.random()
    if kind < 0.05:
        head[0] = rng.choice([0, 99, "v"])
    elif kind < 0.1:
        head = head[: rng.randint(0, 5)]
    header = msgpack.packb(head)
    if kind > 0.95:
        header = header[: rng.randint(0, len(header))]
    elif kind > 0.9:
        header = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 40)))
    frames = []
    for _ in range(rng.choice([0, 1, 1, 2, 2, 3, 7])):
        size = rng.choice([0, 1, 3, 4, 8, 12, 64, 4096, 1 << 18])
        frames.append(os.urandom(size) if size <= 4096 else b"\x01" * size)
    return [b"", header, *frames]


def fuzzer_main(endpoint: str, count: int, sent: Any, seed: int) -> None:
    rng = random.Random(seed)
    ctx = zmq.Context()
    while sent.value < count:
        conn = Connection(endpoint, 2.0)
        try:
            reply = conn.call(Op.HELLO, hello_fields(f"fuzz-{seed}", False, endpoint))[0]
            session, epoch = HelloReply.read(reply.fields).session, reply.boot_epoch
        except (DaemonError, DaemonTimeout, OSError):
            session, epoch = 0, 0
        conn.close()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.connect(endpoint)
        pool = [mutate(rng, session, epoch) for _ in range(1000)]  # sent 20 times each
        done = 0
        for i in range(20_000):
            try:
                sock.send_multipart(pool[i % len(pool)], zmq.NOBLOCK)
            except zmq.Again:
                time.sleep(0.005)
                continue
            done += 1
            if done % 500 == 0:
                with sent.get_lock():
                    sent.value += 500
            while sock.poll(0):  # read what came back (the daemon must answer or drop)
                sock.recv_multipart()
        with sent.get_lock():
            sent.value += done % 500
        sock.close()


def silent_peer_main(endpoint: str) -> None:
    """Sends requests and never reads: its replies pile up until the daemon drops them."""
    sock = zmq.Context().socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.connect(endpoint)
    ping = msgpack.packb([PROTOCOL_VERSION, int(Op.PING), 1, 0, 0, {}])
    while True:
        try:
            sock.send_multipart([b"", ping], zmq.NOBLOCK)
        except zmq.Again:  # its own queue is full too: it just keeps trying
            pass
        time.sleep(0.002)


# ---- the harness ------------------------------------------------------------------------------
class Admin:
    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.conn: Connection | None = None

    def stats(self, check: bool = False) -> dict | None:
        for _ in range(3):
            try:
                if self.conn is None:
                    self.conn = Connection(self.endpoint, 5.0)
                    hello = hello_fields("chaos-admin", True, self.endpoint)
                    self.conn.session = HelloReply.read(
                        self.conn.call(Op.HELLO, hello)[0].fields
                    ).session
                return self.conn.call(Op.STATS, {"check": check})[0].fields
            except (DaemonError, DaemonTimeout, OSError, PermissionError):
                if self.conn is not None:
                    self.conn.close()
                self.conn = None
                time.sleep(0.2)
        return None


def match_latencies(endpoint: str, seconds: float, stop: threading.Event) -> list[float]:
    """Match round trips every 10 ms until ``seconds`` pass or ``stop``; a daemon restart or a
    lost lease costs a new session, not the rest of the samples."""
    out: list[float] = []
    prompt = np.concatenate([SYSTEMS[0], np.arange(1, 9, dtype=np.int32)])
    end = time.monotonic() + seconds
    conn: Connection | None = None
    while time.monotonic() < end and not stop.is_set():
        try:
            if conn is None:
                conn = Connection(endpoint, 5.0)
                hello = hello_fields("probe", False, endpoint)
                conn.session = HelloReply.read(conn.call(Op.HELLO, hello)[0].fields).session
            t0 = time.perf_counter()
            conn.call(Op.MATCH, {"lengths": [len(prompt)], "lock": False}, [prompt])
            out.append(time.perf_counter() - t0)
        except (DaemonError, DaemonTimeout, OSError):  # between daemon lives: start again
            if conn is not None:
                conn.close()
            conn = None
        time.sleep(0.01)
    if conn is not None:
        conn.close()
    return out


def p99_ms(samples: list[float]) -> float:
    return round(float(np.percentile(samples, 99)) * 1e3, 2) if samples else float("nan")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--short", action="store_true", help="the CI run: small and quick")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--kills", type=int, default=1000)
    ap.add_argument("--fuzz", type=int, default=1_000_000)
    ap.add_argument("--seconds", type=float, default=600.0, help="an upper bound on the storm")
    args = ap.parse_args(argv)
    if args.short:
        # (the storm ends when the kills and the fuzzing are done: about 25 s on a quiet
        # machine; the time bound only stops a run the machine cannot keep up with)
        args.clients, args.kills, args.fuzz, args.seconds = 8, 40, 20_000, 90.0
    ctx = mp.get_context("fork")
    rng = random.Random(0)
    tmp = tempfile.mkdtemp(prefix="hicache-chaos-")
    ep = f"ipc://{tmp}/chaos.sock"
    pools = ["--device-tokens", str(64 * args.clients), "--host-tokens", str(256 * args.clients)]
    try:
        daemon = start_daemon(ep, *SHAPE, *pools)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    counters: list[Any] = []
    engines: list[mp.Process] = []
    report: dict[str, Any] = {
        "clients": args.clients,
        "kills": 0,
        "stalls": 0,
        "host_tokens_adopted": [],  # by each restarted daemon
    }
    stop = threading.Event()

    def spawn(i: int) -> mp.Process:
        if i >= len(counters):
            counters.append(ctx.Array("q", 4, lock=False))
        seed = rng.randrange(2**32)
        p = ctx.Process(target=engine_main, args=(ep, f"engine-{i}", counters[i], seed))
        p.start()
        return p

    try:
        admin = Admin(ep)
        quiet = match_latencies(ep, 3.0, stop)
        engines = [spawn(i) for i in range(args.clients)]
        sent = ctx.Value("q", 0)
        fuzzers = [ctx.Process(target=fuzzer_main, args=(ep, args.fuzz, sent, s)) for s in range(2)]
        silent = [ctx.Process(target=silent_peer_main, args=(ep,)) for _ in range(2)]
        for p in fuzzers + silent:
            p.start()
        storm: list[float] = []
        probe = threading.Thread(
            target=lambda: storm.extend(match_latencies(ep, args.seconds, stop)), daemon=True
        )
        probe.start()
        t0 = time.monotonic()
        checks = failures = restarts = pauses = 0
        rss: list[int] = []
        next_check = t0
        kill_every = max(0.005, (args.seconds * 0.6) / max(1, args.kills))
        restart_at = (
            {t0 + args.seconds * f for f in (0.2, 0.4)}
            if not args.short
            else {t0 + args.seconds * 0.3}
        )
        pause_at = {t0 + args.seconds * f for f in (0.1, 0.5)}
        life_start = time.monotonic()
        flood = False  # the second phase: the engines gone, the fuzzers flat out
        warm_s = 5.0 if args.short else 30.0
        while True:
            now = time.monotonic()
            done_kills = report["kills"] >= args.kills
            done_fuzz = sent.value >= args.fuzz
            if (done_kills and done_fuzz and now - t0 > 5) or now - t0 > args.seconds:
                break
            if done_kills and not flood and not args.short and now - t0 > 5:
                flood = True  # the storm is over: the rest of the fuzzing at full speed
                stop.set()
                for p in engines:
                    p.kill()
                    p.join()
                more = [
                    ctx.Process(target=fuzzer_main, args=(ep, args.fuzz, sent, s))
                    for s in range(2, 4)
                ]
                for p in more:
                    p.start()
                fuzzers += more
            if not done_kills:
                victim = rng.randrange(len(engines))
                engines[victim].kill()
                engines[victim].join()
                engines[victim] = spawn(victim)
                report["kills"] += 1
                if rng.random() < 0.05:  # a stall past the lease, within lease + quarantine
                    staller = engines[rng.randrange(len(engines))]
                    staller_pid = staller.pid
                    try:
                        os.kill(staller_pid, signal.SIGSTOP)
                    except ProcessLookupError:  # (it died on its own)
                        continue
                    threading.Timer(
                        LEASE_S + QUARANTINE_S / 2, lambda p=staller_pid: _cont(p)
                    ).start()
                    report["stalls"] += 1
            for at in sorted(pause_at):
                if now >= at:
                    pause_at.discard(at)
                    os.kill(daemon.pid, signal.SIGSTOP)
                    time.sleep(1.0)
                    os.kill(daemon.pid, signal.SIGCONT)
                    pauses += 1
            for at in sorted(restart_at):
                if now >= at:
                    restart_at.discard(at)
                    daemon.kill()
                    daemon.wait()
                    daemon = start_daemon(ep, *SHAPE, *pools)
                    admin = Admin(ep)
                    restarts += 1
                    found = ADOPTED.search(daemon.output())  # the last snapshot's host tier
                    report["host_tokens_adopted"].append(int(found[1]) if found else 0)
                    life_start, rss = time.monotonic(), []
            if now >= next_check:
                next_check = now + 1.0
                s = admin.stats(check=True)
                checks += 1
                if s is None or s.get("integrity") != "ok":
                    failures += 1
                    print(f"integrity: {None if s is None else s.get('integrity')}", flush=True)
                if now - life_start > warm_s:  # after warm-up
                    rss.append(psutil.Process(daemon.pid).memory_info().rss)
            time.sleep(kill_every)
        stop.set()
        for p in engines + fuzzers + silent:
            p.kill()
            p.join()
        probe.join()
        # every dead engine's lease, then its quarantine; and a quiet spell long enough for
        # the daemon to give freed heap back (daemon/observe/memory_trim.py)
        time.sleep(max(LEASE_S + QUARANTINE_S + 1.0, 11.0))
        end = admin.stats(check=True) or {}
        rss_end = psutil.Process(daemon.pid).memory_info().rss
        checks += 1
        failures += end.get("integrity") != "ok"
        report.update(
            fuzzed_requests=sent.value,
            daemon_restarts=restarts,
            daemon_pauses=pauses,
            integrity_checks=checks,
            integrity_failures=failures,
            leaked_pages=(end.get("device_owned_tokens", -PS) // PS)
            + end.get("quarantined_tokens", 0) // PS,
            leaked_locks=end.get("device_protected_tokens", -1),
            sessions_left=len(
                [s for s in end.get("session_list", []) if s["client"] != "chaos-admin"]
            ),
            wrong_bytes=int(sum(c[WRONG] for c in counters)),
            values_checked=int(sum(c[READ] for c in counters)),
            engine_requests=int(sum(c[OPS] for c in counters)),
            internal_errors=end.get("errors_by_code", {}).get("INTERNAL", 0)
            + end.get("housekeep_errors", 0),
            rss_start_mb=round(rss[0] / 2**20, 1) if rss else None,
            rss_peak_mb=round(max(rss) / 2**20, 1) if rss else None,  # queues in flight too
            rss_end_mb=round(rss_end / 2**20, 1),  # once every engine and peer is gone
            rss_growth_ratio=round(rss_end / rss[0], 3) if rss else 1.0,
            rss_mb_series=[round(r / 2**20) for r in rss[:: max(1, len(rss) // 8)]],
            match_p99_quiet_ms=p99_ms(quiet),
            match_p99_storm_ms=p99_ms(storm),
            seconds=round(time.monotonic() - t0, 1),
        )
    finally:
        stop.set()
        for p in engines:
            if p.is_alive():
                p.kill()
        stop_daemon(daemon)
        HostKeeper(ep, "chaos", 0).discard_previous()  # what the last daemon kept goes too
        shutil.rmtree(tmp, ignore_errors=True)  # (the socket's folder and its lock file)
    print(json.dumps(report), flush=True)
    return report


def _cont(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    result = main()
    bad = ("integrity_failures", "leaked_pages", "leaked_locks", "wrong_bytes", "internal_errors")
    sys.exit(1 if any(result[k] for k in bad) else 0)
