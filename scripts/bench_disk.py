"""The disk tier: its store against fio on the same file system, and end to end, side by side
in one run.

    .venv/bin/python -m scripts.bench_disk [--part raw|e2e|both|restart|latency] [--dir DIR]
        [--mib 512] [--pages-kib 256,1024] [--seed 11] [--restart-slots 65536] [--samples 20]

``--part latency`` (``disk_latency.py``): a disk hit's latency against a host hit's through
the daemon, for a one-page and a 64-page prompt, two page shapes, both kinds of daemon.

``--part restart``: a daemon's store killed with SIGKILL after writing ``--restart-slots``
pages (4 KiB each: a start's cost is per slot, not per byte), then opened again from its
checkpoint and journal, and again with the journal removed (a scan of every slot's header),
the page cache dropped before each (where this user may: root); prints the seconds of each
and their ratio.

``--part e2e`` (``disk_e2e.py``): a real transformer through the daemon on traces 4x its host
pool, host only against the disk (admission ``all`` and ``reused``) and the unbounded cache,
and a cold restart on the disk; its docstring says what is measured. ``raw`` (the default):

For each page size: a ``SlotStore`` in a fresh folder under DIR (default: a temp folder on the
checkout's file system, where direct I/O works) writes MiB of distinct pages, then reads them
back (direct I/O: no page cache in between), 128 pages per call (the third tier's batch; its
I/O threads, 4, write and read them at once); fio writes and reads a file of the same size
with the store's own I/O size (a slot: its header block and the padded page), O_DIRECT, with
4 jobs of depth 1 (``psync``: the store's four threads) and, as the drive's ceiling, io_uring
at depth 16. Each page size runs ``--rounds`` times; in each, the store's writes sit beside
fio's, then its reads beside fio's, the store first in even rounds and fio first in odd ones
(the drive's speed drifts within seconds: a pair's two runs are adjacent, and which one the
drift favours alternates). Prints a line per page size and one JSON
object last: each throughput in GB/s (medians) and the store's ratio to fio at its own
concurrency (the median of the rounds' ratios, and each) and to the ceiling. And, after each
store read, plain ``os.preadv`` calls by 4 threads into the same pages the store read into:
fio reads into one buffer per job, hot in the caches, while the store's reads land in 128
distinct pages, as a pool's would; the plain reads tell the store's own cost apart from that.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from hicache.disk import ALIGN, SlotStore, aligned
from hicache.errors import InsufficientMemoryError
from hicache.l3 import L3Config
from hicache.memory import SharedMemoryBacking

ROOT = Path(__file__).resolve().parent.parent


def fio(path: Path, rw: str, bs: int, size: int, engine: str, depth: int, jobs: int = 1) -> float:
    """fio's bandwidth in GB/s for ``rw`` (write or read) of ``size`` bytes in ``bs`` I/Os,
    ``jobs`` jobs each on its own part of the file."""
    part = size // jobs // bs * bs
    out = subprocess.run(
        [
            "fio", "--name=bench", f"--filename={path}", f"--rw={rw}", f"--bs={bs}",
            f"--size={part}", f"--offset_increment={part}", f"--numjobs={jobs}",
            "--group_reporting", "--direct=1", f"--ioengine={engine}", f"--iodepth={depth}",
            "--output-format=json", "--end_fsync=0",
        ],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    job = json.loads(out[out.index("{") :])["jobs"][0]
    return job["write" if rw == "write" else "read"]["bw_bytes"] / 1e9


BATCH = L3Config.batch_pages  # values per call: as many as the third tier puts in one
THREADS = 4  # the store's I/O threads (SlotStore's default)


def plain_read(store: SlotStore, count: int, into: list[np.ndarray]) -> float:
    """GB/s of THREADS threads reading slots [0, count) with one ``os.preadv`` each (a header
    block, then the page) into ``into`` as the store does (slot i into ``into[i % BATCH]``),
    with nothing else: the drive and the memory the pages land in, without the store."""
    taken = itertools.count()
    slot = store.files.slot_bytes

    def work() -> None:
        head = memoryview(aligned(ALIGN))
        while (i := next(taken)) < count:
            fd, offset = store.files.where(i)
            os.preadv(fd, [head, memoryview(into[i % len(into)])], offset)

    threads = [threading.Thread(target=work) for _ in range(THREADS)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return count * slot / (time.perf_counter() - start) / 1e9


class StoreRun:
    """A ``SlotStore`` in ``folder`` holding ``total`` bytes of ``page_bytes`` pages, timed a
    phase at a time (so that each phase sits beside fio's): ``write`` then ``read`` then
    ``plain``, each in GB/s of slots, BATCH values per call. ``close`` removes nothing."""

    def __init__(self, folder: Path, page_bytes: int, total: int):
        self.page_bytes = page_bytes
        self.slot = ALIGN + -(-page_bytes // ALIGN) * ALIGN
        self.count = max(8, total // self.slot)
        self.store = SlotStore(
            [str(folder)], self.count * self.slot, page_bytes, budget_bytes_per_day=1 << 50
        )
        # the pages live in a shared-memory file in /dev/shm, as a daemon's pool does (on huge
        # pages where that tmpfs gives them: ``huge``, the share of the bytes that are)
        # (a /dev/shm too small for them, as a container's may be: process memory, said)
        self.pool: SharedMemoryBacking | None = None
        nbytes = (8 + BATCH) * page_bytes
        try:
            self.pool = SharedMemoryBacking(f"hicache-bench-disk-{os.getpid()}-{page_bytes}")
            buf = self.pool.allocate(nbytes, "bench pages").numpy()
            self.huge = self.pool.huge_page_bytes() / len(buf)
        except InsufficientMemoryError as exc:
            print(f"bench_disk: the pages go in process memory ({exc})", flush=True)
            self.pool = None
            buf = np.frombuffer(aligned(nbytes), np.uint8)[:nbytes]
            self.huge = 0.0
        except BaseException:
            self.store.close()
            raise
        rng = np.random.default_rng(0)
        views = [buf[i * page_bytes : (i + 1) * page_bytes] for i in range(8 + BATCH)]
        self.pages = views[:8]  # (written from)
        for page in self.pages:
            page[:] = rng.integers(0, 256, page_bytes, np.uint8)
        self.into = views[8:]  # (read into, BATCH of them: a call's pages)

    def write(self) -> float:
        tail, count = bytes(16), self.count
        start = time.perf_counter()
        for at in range(0, count, BATCH):
            span = range(at, min(count, at + BATCH))
            items = [(f"k{i}", [memoryview(self.pages[i % 8])], tail) for i in span]
            assert all(self.store.put_many(items))
        self.store.sync()
        return count * self.slot / (time.perf_counter() - start) / 1e9

    def read(self) -> float:
        count, last = self.count, 0
        start = time.perf_counter()
        for at in range(0, count, BATCH):
            keys = [f"k{i}" for i in range(at, min(count, at + BATCH))]
            got = self.store.get_many([(k, [memoryview(self.into[j])]) for j, k in enumerate(keys)])
            assert all(t is not None for t in got)
            last = at
        read = count * self.slot / (time.perf_counter() - start) / 1e9
        assert bytes(self.into[0]) == bytes(self.pages[last % 8])  # (the last batch's first)
        return read

    def plain(self) -> float:
        return plain_read(self.store, self.count, self.into)

    def close(self) -> None:
        self.store.close()
        self.pages = self.into = []
        if self.pool is not None:
            self.pool.close()


_KILLED_WRITER = """
import sys
from hicache.disk import SlotStore
folder, count = sys.argv[1], int(sys.argv[2])
store = SlotStore([folder], count * 8192, 4096, budget_bytes_per_day=1 << 50)
value, tail = [memoryview(bytes(4096))], bytes(16)
for at in range(0, count, 128):
    keys = [f"k{i}" for i in range(at, min(count, at + 128))]
    assert all(store.put_many([(k, value, tail) for k in keys], [None] * len(keys)))
print("written", flush=True)
sys.stdin.read()  # (killed here)
"""


def _drop_caches() -> bool:
    """Drop the page cache (root only); whether it was."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3")
    except OSError:
        return False
    return True


def restart_run(where: Path | None, count: int) -> dict[str, object]:
    """A store of ``count`` 4 KiB pages killed after its writes, opened from its journal, then
    by a scan (the journal removed); seconds of each (see the module's docstring)."""
    import signal
    import sys

    base = Path(tempfile.mkdtemp(prefix="hicache-bench-restart-", dir=where))
    folder = base / "d"
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", _KILLED_WRITER, str(folder), str(count)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
        )  # fmt: skip
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "written"
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
        opens = {}
        dropped = True
        for how in ("journal", "scan"):
            if how == "scan":
                (folder / "journal").unlink()
            dropped = _drop_caches() and dropped
            start = time.perf_counter()
            store = SlotStore([str(folder)], count * 8192, 4096, budget_bytes_per_day=1 << 50,
                              scan_s=600.0)  # fmt: skip
            seconds = time.perf_counter() - start
            try:
                assert store.recovered == count, (how, store.recovered)
                assert store.from_checkpoint == (how == "journal")
                opens[how] = (seconds, store.replayed, store.scanned)
            finally:
                store.close()
        (j, replayed, _), (sc, _, scanned) = opens["journal"], opens["scan"]
        print(
            f"restart after SIGKILL, {count} pages of 4 KiB: from the checkpoint and journal "
            f"({replayed} records) {j:.2f} s, by a scan of {scanned} headers {sc:.2f} s "
            f"(scan / journal {sc / j:.1f}x; page cache dropped: {dropped})",
            flush=True,
        )
        return {
            "pages": count,
            "journal_s": round(j, 3),
            "journal_records": replayed,
            "scan_s": round(sc, 3),
            "scan_vs_journal": round(sc / j, 2),
            "page_cache_dropped": dropped,
        }
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=None, help="where (default: the temp folder)")
    ap.add_argument("--mib", type=int, default=512, help="MiB written and read per page size")
    ap.add_argument("--pages-kib", default="256,1024", help="page sizes, KiB, comma-separated")
    ap.add_argument("--part", choices=("raw", "e2e", "both", "restart", "latency"), default="raw")
    ap.add_argument("--restart-slots", type=int, default=65536, help="restart: pages written")
    ap.add_argument("--rounds", type=int, default=5, help="raw: store and fio runs, paired")
    ap.add_argument("--seed", type=int, default=11, help="the e2e traces' seed")
    ap.add_argument("--samples", type=int, default=20, help="latency: host/disk pairs per row")
    args = ap.parse_args()
    out: dict[str, object] = {}
    if args.part == "restart":
        out["restart"] = restart_run(args.dir, args.restart_slots)
        print(json.dumps(out))
        return
    if args.part == "latency":
        from scripts import disk_latency

        out["latency"] = disk_latency.run(args.samples, args.dir)
        print(json.dumps(out))
        return
    if args.part in ("e2e", "both"):
        from scripts import disk_e2e

        out["e2e"] = disk_e2e.run(args.seed)
        if args.part == "e2e":
            print(json.dumps(out))
            return
    if shutil.which("fio") is None:
        raise SystemExit("bench_disk: fio is not installed (apt-get install fio)")
    base = Path(tempfile.mkdtemp(prefix="hicache-bench-disk-", dir=args.dir))
    out.update(dir=str(base.parent), mib=args.mib)
    try:
        for kib in (int(k) for k in args.pages_kib.split(",")):
            total = args.mib << 20
            rounds = []  # each: store, fio at its concurrency, fio's ceiling, plain reads
            for n in range(args.rounds):
                run = StoreRun(base / f"store-{kib}-{n}", kib << 10, total)
                slot = run.slot
                size = run.count * slot
                data = base / f"fio-{kib}.dat"
                took: dict[str, float] = {}
                try:  # each phase beside fio's; who goes first alternates (drift falls on both)
                    for rw in ("write", "read"):
                        steps = {
                            "store": getattr(run, rw),
                            "fio": functools.partial(
                                fio, data, rw, slot, size, "psync", 1, THREADS
                            ),
                        }
                        for who in ("store", "fio") if n % 2 == 0 else ("fio", "store"):
                            took[f"{who}_{rw}"] = steps[who]()
                    plain = run.plain()
                finally:
                    run.close()
                    shutil.rmtree(base / f"store-{kib}-{n}")
                fio_w16 = fio(data, "write", slot, size, "io_uring", 16)
                fio_r16 = fio(data, "read", slot, size, "io_uring", 16)
                data.unlink()
                rounds.append((took["store_write"], took["store_read"], took["fio_write"],
                               took["fio_read"], fio_w16, fio_r16, plain))  # fmt: skip
                huge = run.huge
            mid = [float(np.median(col)) for col in zip(*rounds, strict=True)]
            wrote, read, fio_w1, fio_r1, fio_w16, fio_r16, plain = mid
            w_ratio = float(np.median([r[0] / r[2] for r in rounds]))
            r_ratio = float(np.median([r[1] / r[3] for r in rounds]))
            row = {
                "slot_bytes": slot,
                "pages_on_huge_pages": round(huge, 3),
                "rounds": args.rounds,
                "store_write_gbs": round(wrote, 3),
                "store_read_gbs": round(read, 3),
                "fio_write_gbs_4x1": round(fio_w1, 3),
                "fio_read_gbs_4x1": round(fio_r1, 3),
                "fio_write_gbs_uring16": round(fio_w16, 3),
                "fio_read_gbs_uring16": round(fio_r16, 3),
                "write_vs_fio_4x1": round(w_ratio, 3),
                "read_vs_fio_4x1": round(r_ratio, 3),
                "write_vs_fio_4x1_rounds": [round(r[0] / r[2], 3) for r in rounds],
                "read_vs_fio_4x1_rounds": [round(r[1] / r[3], 3) for r in rounds],
                "write_vs_fio_uring16": round(wrote / fio_w16, 3),
                "read_vs_fio_uring16": round(read / fio_r16, 3),
                "plain_preadv_read_gbs": round(plain, 3),
                "read_vs_plain_preadv": round(float(np.median([r[1] / r[6] for r in rounds])), 3),
                "read_vs_plain_preadv_rounds": [round(r[1] / r[6], 3) for r in rounds],
            }
            out[f"page_{kib}k"] = row
            print(
                f"page {kib:5d} KiB (slot {slot} B, pages {huge:.0%} on huge pages), median of "
                f"{args.rounds} rounds: store "
                f"write {wrote:.2f} GB/s, read {read:.2f} GB/s; fio 4 jobs x depth 1 "
                f"{fio_w1:.2f} / {fio_r1:.2f}, io_uring depth 16 {fio_w16:.2f} / {fio_r16:.2f}; "
                f"store / fio 4 x 1 (paired per round): write {row['write_vs_fio_4x1']} "
                f"{row['write_vs_fio_4x1_rounds']}, read {row['read_vs_fio_4x1']} "
                f"{row['read_vs_fio_4x1_rounds']}; plain preadv into the store's pages "
                f"{plain:.2f} GB/s, store / plain read {row['read_vs_plain_preadv']} "
                f"{row['read_vs_plain_preadv_rounds']}",
                flush=True,
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
