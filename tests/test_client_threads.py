"""The client inside multi-threaded, multi-process and asyncio engines: threads sharing one
client, close() racing calls, clients dropped without close(), re-attaching after a restart,
cancelled calls, and work handed from one thread to another. Each fails without its fix.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import threading
import time
import weakref

import numpy as np
import pytest
import torch

from hicache.client import DaemonError, EpochChanged, HiCacheClient
from hicache.client.aio import AsyncHiCacheClient
from hicache.protocol import ErrorCode
from tests.daemon_helpers import start_daemon, stop_daemon, wait_until

OWN_ALL = ("--session-owned-fraction", "1", "--device-tokens", "4096", "--host-tokens", "8192")


@pytest.fixture
def ep(tmp_path):
    return f"ipc://{tmp_path}/d.sock"


@pytest.fixture
def daemon(ep):
    proc = start_daemon(ep, *OWN_ALL)
    yield ep
    stop_daemon(proc)


def held_by(hc: HiCacheClient, name: str) -> tuple[int, int]:
    me = next(s for s in hc.stats()["session_list"] if s["client"] == name)
    return me["owned_pages"], me["locks"]


def cycle(hc: HiCacheClient, k0: torch.Tensor, base: int) -> None:
    """alloc, write KV (the token ids themselves), insert, match, check every slot, release."""
    toks = np.arange(base, base + 32, dtype=np.int32)
    slots = hc.alloc(32)
    k0[slots] = torch.from_numpy(toks.astype(np.float32))[:, None, None]
    hc.insert(toks, slots)
    m = hc.match_prefix(toks)
    got = k0[m.device_indices][:, 0, 0].numpy().astype(np.int64)
    try:
        assert m.device_hit_length == 32 and np.array_equal(got, toks), "another thread's KV"
    finally:
        hc.release(m)


# ---- item 1: threads sharing one client ------------------------------------------------------
def test_threads_sharing_a_client_each_get_their_own_replies(daemon):
    hc = HiCacheClient(daemon, name="shared", timeout_s=10)
    k0 = hc.attach().k_buffer[0]
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for i in range(150):
                cycle(hc, k0, t * 1_000_000 + i * 64 + 1)
        except BaseException as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors, errors[:3]
    assert held_by(hc, "shared") == (0, 0)  # nothing left held
    assert hc.stats(check=True)["integrity"] == "ok"
    hc.close()


# ---- item 2: close() racing calls --------------------------------------------------------------
CLOSE_RACE = """
import sys, threading, collections
import numpy as np
from hicache.client import HiCacheClient, ClientClosed
hc = HiCacheClient(sys.argv[1], name="racy")
seen = collections.Counter()
go = threading.Event()
def caller():
    go.wait()
    while True:
        try:
            m = hc.match_prefix(np.arange(1, 65, dtype=np.int32))
            hc.release(m)
            seen["ok"] += 1
        except ClientClosed:
            seen["closed"] += 1
            return
        except Exception as exc:
            seen[type(exc).__name__] += 1
            return
threads = [threading.Thread(target=caller) for _ in range(4)]
for t in threads: t.start()
go.set()
import time; time.sleep(0.3)
hc.close()
for t in threads: t.join(30)
print(dict(seen), flush=True)
try:
    hc.ping()
except ClientClosed:
    print("after close: ClientClosed", flush=True)
"""


def test_close_from_another_thread_ends_calls_cleanly(daemon):
    for _ in range(3):  # a libzmq abort would kill the child: it runs apart
        r = subprocess.run(
            [sys.executable, "-c", CLOSE_RACE, daemon], capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0, r.stderr[-2000:]
        counts, after = r.stdout.strip().splitlines()
        seen = eval(counts)  # noqa: S307  (our own child's dict literal)
        assert set(seen) <= {"ok", "closed"} and seen.get("closed") == 4, seen
        assert after == "after close: ClientClosed"
    with HiCacheClient(daemon, name="auditor") as hc:
        wait_until(lambda: hc.stats()["sessions"] == 1, what="the racy sessions to end")


# ---- item 3: a client dropped without close() --------------------------------------------------
def test_a_dropped_client_ends_its_session(daemon):
    with HiCacheClient(daemon, name="auditor") as auditor:
        before = {t for t in threading.enumerate() if t.name == "hicache-heartbeat"}

        def make_and_drop() -> weakref.ref:
            hc = HiCacheClient(daemon, name="dropped")
            toks = np.arange(1, 65, dtype=np.int32)
            hc.insert(toks, hc.alloc(64))
            hc.match_prefix(toks)  # a lock
            hc.alloc(32)  # owned slots
            return weakref.ref(hc)

        ref = make_and_drop()
        gc.collect()
        assert ref() is None  # the heartbeat thread does not keep it alive
        s = auditor.stats()  # the goodbye went out as it was collected
        assert [x["client"] for x in s["session_list"]] == ["auditor"]
        assert s["device_owned_tokens"] == 0
        beats = {t for t in threading.enumerate() if t.name == "hicache-heartbeat"}
        assert beats <= before  # the dropped client's heartbeat ended (others' may linger)


EXITS = """
import sys, numpy as np
from hicache.client import HiCacheClient
hc = HiCacheClient(sys.argv[1], name="exits")
hc.alloc(64); hc.match_prefix(np.arange(1, 65, dtype=np.int32))
print("ready", flush=True)   # and exits without close()
"""


def test_a_process_that_exits_without_close_ends_its_session(daemon):
    r = subprocess.run([sys.executable, "-c", EXITS, daemon], capture_output=True, text=True)
    assert r.stdout.strip() == "ready"
    with HiCacheClient(daemon, name="auditor") as hc:
        s = hc.stats()  # at once: no lease to wait for
        assert s["sessions"] == 1 and s["device_owned_tokens"] == 0


# ---- item 4: re-attaching after a restart ------------------------------------------------------
def test_threads_and_clients_reattach_after_a_restart(ep):
    proc = start_daemon(ep, *OWN_ALL)
    shared = HiCacheClient(ep, name="shared", timeout_s=5)
    own = [HiCacheClient(ep, name=f"own{i}", timeout_s=5) for i in range(2)]
    restarted, stop = threading.Event(), threading.Event()
    outcome: dict[str, int] = {"reconnects": 0}
    after: dict[int, int] = {id(hc): 0 for hc in (shared, *own)}  # cycles after the restart
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker(hc: HiCacheClient, t: int) -> None:
        k0, i = hc.attach().k_buffer[0], 0
        while not stop.is_set():
            i += 1
            try:
                cycle(hc, k0, t * 1_000_000 + (i % 5000) * 64 + 1)
                if restarted.is_set():
                    with lock:
                        after[id(hc)] += 1
            except EpochChanged:
                did = hc.reconnect()  # the one documented way back
                with lock:
                    outcome["reconnects"] += did
                k0 = hc.attach().k_buffer[0]  # new pools
            except BaseException as exc:  # noqa: BLE001
                if not restarted.is_set() or not isinstance(exc, (DaemonError, OSError)):
                    errors.append(exc)
                    return
                time.sleep(0.05)  # the daemon is between lives: try again

    threads = [threading.Thread(target=worker, args=(shared, t)) for t in range(3)]
    threads += [threading.Thread(target=worker, args=(hc, 10 + i)) for i, hc in enumerate(own)]
    try:
        for th in threads:
            th.start()
        time.sleep(1.0)
        restarted.set()
        stop_daemon(proc)
        proc = start_daemon(ep, *OWN_ALL)
        wait_until(lambda: min(after.values()) > 20, timeout=60, what="every client's work")
        stop.set()
        for th in threads:
            th.join(60)
        assert not errors, errors[:3]
        assert outcome["reconnects"] == 3  # one per client, however many threads saw it
        with HiCacheClient(ep, name="auditor") as auditor:
            s = auditor.stats(check=True)
            assert s["integrity"] == "ok" and s["sessions"] == 4  # three clients, the auditor
            assert all(x["locks"] == 0 for x in s["session_list"])
    finally:
        stop.set()
        for hc in (shared, *own):
            hc.close()
        stop_daemon(proc)


# ---- item 5: calls that time out or are cancelled -----------------------------------------------
def test_a_cancelled_asyncio_call_gives_back_its_lock_and_slots(ep):
    proc = start_daemon(ep, *OWN_ALL)
    try:

        async def main() -> None:
            hc = await AsyncHiCacheClient.open(ep, name="aio")
            toks = np.arange(1, 65, dtype=np.int32)
            await hc.insert(toks, await hc.alloc(64))
            os.kill(proc.pid, signal.SIGSTOP)  # both calls are under way when cancelled
            try:
                tasks = [
                    asyncio.ensure_future(hc.match_prefix(toks)),
                    asyncio.ensure_future(hc.alloc(16)),
                ]
                await asyncio.sleep(0.2)
                for task in tasks:
                    task.cancel()
                results = await asyncio.gather(*tasks, return_exceptions=True)
                assert all(isinstance(r, asyncio.CancelledError) for r in results)
            finally:
                os.kill(proc.pid, signal.SIGCONT)

            def nothing_held() -> bool:
                return held_by(hc.client, "aio") == (0, 0)

            deadline = time.monotonic() + 20
            while not nothing_held():
                assert time.monotonic() < deadline, "the cancelled calls' lock and slots stay"
                await asyncio.sleep(0.05)
            m = await hc.match_prefix(toks)  # still usable
            assert m.device_hit_length == 64
            await hc.release(m)
            await hc.close()

        asyncio.run(main())
    finally:
        stop_daemon(proc)


def test_holdings_and_release_all(daemon):
    with HiCacheClient(daemon, name="h") as hc:
        toks = np.arange(1, 33, dtype=np.int32)
        hc.insert(toks, hc.alloc(32))
        ms = [hc.match_prefix(toks) for _ in range(3)]
        owned = hc.alloc(20)
        held = hc.holdings()
        assert sorted(held.lock_ids) == sorted(m.lock_id for m in ms)
        assert torch.equal(held.owned_slots, owned[::4])  # page size 4: five pages
        hc.release_all()
        hc.free(held.owned_slots)
        assert hc.holdings().lock_ids == [] and held_by(hc, "h") == (0, 0)


# ---- item 6: work handed from one thread to another --------------------------------------------
def test_a_scheduler_thread_and_a_worker_thread_share_the_work(daemon):
    hc = HiCacheClient(daemon, name="engine")
    k0 = hc.attach().k_buffer[0]
    base = np.arange(1, 65, dtype=np.int32)
    hc.insert(base, hc.alloc(64))
    handed: list = []
    done = threading.Event()

    def scheduler() -> None:  # matches, locks, allocates
        for i in range(40):
            seq = np.concatenate([base, np.arange(1000 + i * 32, 1032 + i * 32, dtype=np.int32)])
            m = hc.match_prefix(seq)
            extra = hc.lock(m)  # a second lock, for the worker to drop on its own
            handed.append((seq, m, extra, hc.alloc(len(seq) - m.device_hit_length)))
        done.set()

    def worker() -> None:  # writes, inserts, releases what the scheduler started
        while not (done.is_set() and not handed):
            if not handed:
                time.sleep(0.001)
                continue
            seq, m, extra, new = handed.pop(0)
            k0[new] = torch.from_numpy(seq[m.device_hit_length :].astype(np.float32))[:, None, None]
            hc.insert(seq, torch.cat([m.device_indices, new]))
            hc.release(m)
            hc.release(extra)

    threads = [threading.Thread(target=scheduler), threading.Thread(target=worker)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert held_by(hc, "engine") == (0, 0)
    m = hc.match_prefix(np.concatenate([base, np.arange(1000, 1032, dtype=np.int32)]))
    assert m.device_hit_length == 96
    assert torch.equal(k0[m.device_indices[64:]][:, 0, 0], torch.arange(1000, 1032).float())
    hc.release(m)
    hc.close()


# ---- item 7: a MATCH that multiplies memory ------------------------------------------------------
def test_an_amplified_match_is_refused_at_once(daemon):
    import psutil
    import zmq

    from hicache.protocol import Op, Request, decode_reply, encode_request

    with HiCacheClient(daemon, name="amp") as hc:
        pid = hc.ping()["pid"]
        before = psutil.Process(pid).memory_info().rss
        frame = np.zeros((1 << 20) // 4, dtype=np.int32).tobytes()  # 1 MiB of tokens
        n = len(frame) // 4
        fields = {"lengths": [n] * 1024, "shared": [0] + [n] * 1023, "lock": False}
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(daemon)
        start = time.monotonic()
        header = encode_request(Request(Op.MATCH, 1, hc.session, hc.conn.epoch, fields))
        sock.send_multipart([header, frame])
        assert sock.poll(10_000)
        reply = decode_reply(sock.recv_multipart()[0])
        sock.close(linger=0)
        assert reply.status is ErrorCode.TOO_LARGE and time.monotonic() - start < 1.0
        assert psutil.Process(pid).memory_info().rss - before < 64 << 20
        assert hc.info["limits"]["max_match_tokens"] == 1 << 24
        with pytest.raises(DaemonError):
            hc.match_batch([np.zeros(n, np.int32)] * 65)  # 17M tokens of keys: over the limit
