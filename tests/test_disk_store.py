"""The disk tier's store (``hicache.disk``) on the machine's real disk (a temp folder: O_DIRECT)
and on tmpfs (buffered): values come back byte-identical, after a close and after a SIGKILL
mid-write (never a torn one); a full tier evicts the least recently used; the write budget is
never exceeded; drive errors are misses or refused writes; folders that are not private, or
are another daemon's, are refused; and a daemon restarted on its disk serves from it."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from hicache.disk import FolderRefused, SlotStore, WriteBudget
from hicache.disk.url import parse_disk_url
from hicache.l3 import open_store
from hicache.l3.keys import KeyChain
from hicache.l3.pages import PageSegments, trailer, verify
from hicache.memory import HostPool
from tests.test_l3_stores import config, digests, filled_pool, page_bytes

SHM = Path("/dev/shm")


@pytest.fixture(params=["disk", "tmpfs"])
def folder(request, tmp_path):
    """A folder on the checkout's file system (direct I/O), or on tmpfs (buffered)."""
    if request.param == "disk":
        yield tmp_path / "disk"
        return
    where = SHM / f"hicache-test-disk-{os.getpid()}-{time.monotonic_ns()}"
    try:
        yield where
    finally:
        import shutil

        shutil.rmtree(where, ignore_errors=True)


def _store(folder: Path, pool: HostPool, pages: int = 16, **kw) -> SlotStore:
    segs = PageSegments(pool)
    slot = 4096 + -(-segs.page_bytes // 4096) * 4096
    return SlotStore([str(folder)], pages * slot, segs.page_bytes, **kw)


def _put_all(store: SlotStore, pool: HostPool, keys, d, pages) -> list[bool]:
    segs = PageSegments(pool)
    return [
        store.put(k, segs.views(p), trailer(segs.views(p), x))
        for k, x, p in zip(keys, d, pages, strict=True)
    ]


def _get(store: SlotStore, pool: HostPool, key: str, digest: bytes, page: int) -> bool:
    """Whether ``key`` came back into ``page`` and verifies."""
    segs = PageSegments(pool)
    tail = store.get(key, segs.views(page))
    return tail is not None and verify(segs.views(page), digest, tail)


def test_values_come_back_byte_identical_and_after_a_reopen(folder, request):
    cfg = config()
    src, dst = filled_pool(cfg, 1), HostPool(cfg)
    d = digests(8, salt="roundtrip")
    keys = [KeyChain.name(x) for x in d]
    store = _store(folder, src)
    try:
        if "disk" in request.node.name:
            assert store.direct  # (tmpfs takes O_DIRECT since Linux 6.6; older ones refuse it)
        assert _put_all(store, src, keys, d, range(8)) == [True] * 8
        assert store.exists(keys + ["hc1:nothing"]) == [True] * 8 + [False]
        for i in range(8):
            assert _get(store, dst, keys[i], d[i], 20 + i)
            assert page_bytes(dst, 20 + i) == page_bytes(src, i)
        written = store.written
        assert _put_all(store, src, keys[:2], d[:2], range(2)) == [True, True]
        assert store.written == written  # a value held is never written again
    finally:
        store.close()
    mode = os.stat(folder).st_mode & 0o777
    assert mode == 0o700 and os.stat(folder / "slots.dat").st_mode & 0o777 == 0o600
    again = _store(folder, src)
    try:
        assert again.recovered == 8 and again.exists(keys) == [True] * 8
        dst.buffer.numpy()[:] = 0
        for i in range(8):
            assert _get(again, dst, keys[i], d[i], 24 + i)
            assert page_bytes(dst, 24 + i) == page_bytes(src, i)
    finally:
        again.close()


def test_a_full_tier_evicts_the_least_recently_used(tmp_path):
    cfg = config()
    src, dst = filled_pool(cfg, 2), HostPool(cfg)
    d = digests(6, salt="full")
    keys = [KeyChain.name(x) for x in d]
    store = _store(tmp_path / "d", src, pages=4, budget_bytes_per_day=1 << 40)
    try:
        assert _put_all(store, src, keys[:4], d[:4], range(4)) == [True] * 4
        assert _get(store, dst, keys[0], d[0], 10)  # 0 is now the most recent
        assert _put_all(store, src, keys[4:], d[4:], range(4, 6)) == [True, True]
        assert store.exists(keys) == [True, False, False, True, True, True]
        assert store.evicted == 2
        for i in (0, 3, 4, 5):
            assert _get(store, dst, keys[i], d[i], 20 + i)
            assert page_bytes(dst, 20 + i) == page_bytes(src, i)
    finally:
        store.close()


VALUE = 64  # bytes of a value in the prefix tests (one 8 KiB slot each)
TAIL = bytes(16)


def _chain_store(folder: Path, slots: int, **kw) -> SlotStore:
    return SlotStore([str(folder)], slots * 8192, VALUE, budget_bytes_per_day=1 << 40, **kw)


def _put_chain(store: SlotStore, keys: list[str], parent: str | None = None) -> list[bool]:
    """Put ``keys`` as one chain after ``parent``, in one batch."""
    items = [(k, [k.encode()[:VALUE].ljust(VALUE, b".")], TAIL) for k in keys]
    return store.put_many(items, [parent, *keys[:-1]])


def _closed_under_prefixes(store: SlotStore) -> bool:
    """Every held value's chain parent is held (what the tier holds of a prompt is its first
    pages)."""
    held = set(store.held())
    return all(store.parent(k) is None or store.parent(k) in held for k in held)


def test_a_page_goes_to_disk_only_with_its_prefix(tmp_path):
    faults = Faults()
    store = _chain_store(tmp_path / "d", 8, fault=faults)
    try:
        assert _put_chain(store, ["a", "b"]) == [True, True]
        written = store.written_bytes
        assert _put_chain(store, ["d"], parent="c") == [False]  # c was never written
        assert store.refused_no_prefix == 1 and store.written_bytes == written  # not written
        assert _put_chain(store, ["c", "d"], parent="b") == [True, True]  # with its parent
        # a parent whose write fails takes its tail with it (the tail is never held alone)
        faults.slots, faults.error = {4}, {"write": errno.EIO}  # x's (lowest free slot first)
        assert _put_chain(store, ["x", "y"]) == [False, False]
        assert store.exists(["x", "y"]) == [False, False] and _closed_under_prefixes(store)
        assert store.check() == []
        # bigger than the disk: only the prefixes that fit, never a tail without its head
        faults.error = {}
        long = [f"p{i}" for i in range(12)]
        got = _put_chain(store, long, parent="d")
        assert got == [True] * got.count(True) + [False] * got.count(False)
        assert _closed_under_prefixes(store) and store.check() == []
        assert store.exists(["a", "b", "c", "d"]) == [True] * 4  # the batch's own prefixes stay
    finally:
        store.close()


def test_the_disk_evicts_leaves_before_their_prefixes(tmp_path):
    """A use of a tail is a use of its prefix: the least recently used value is a leaf, and
    the order holds after a restart (rebuilt from the slots' headers)."""
    store = _chain_store(tmp_path / "d", 5)
    try:
        assert _put_chain(store, ["a", "b", "c"]) == [True] * 3
        assert _put_chain(store, ["x"]) == [True]
        got = store.get_many([("c", [memoryview(bytearray(VALUE))])])  # only the tail is read
        assert got[0] == TAIL
        assert _put_chain(store, ["y"]) == [True]  # the disk is full now
        order = []
        for new in ("z1", "z2", "z3"):
            held = set(store.held())
            assert _put_chain(store, [new]) == [True]
            order += sorted(held - set(store.held()))
            assert _closed_under_prefixes(store) and store.check() == []
        assert order == ["x", "c", "b"]  # x was least recent; then the chain, tail first
    finally:
        store.close()
    store = _chain_store(tmp_path / "e", 5)
    try:
        assert _put_chain(store, ["a", "b", "c"]) == [True] * 3
        assert _put_chain(store, ["x"]) == [True]
        assert _put_chain(store, ["d"], parent="c") == [True]  # a write under the chain: used
    finally:
        store.close()
    (tmp_path / "e" / "index").unlink()  # (a crash: no checkpoint of the order)
    store = _chain_store(tmp_path / "e", 5)  # reopened: the order comes from the headers
    try:
        assert not store.from_checkpoint
        assert store.recovered == 5 and store.check() == []
        assert store.evict(2) == 2
        assert store.exists(["x", "d", "c", "b", "a"]) == [False, False, True, True, True]
    finally:
        store.close()


def test_a_page_that_goes_takes_its_tail_along(tmp_path):
    """A slot read back torn (or removed after it failed to verify), and a slot lost before a
    restart: what was held under it goes too, never a tail alone."""
    store = _chain_store(tmp_path / "d", 8)
    try:
        assert _put_chain(store, ["a", "b", "c"]) == [True] * 3
        assert _put_chain(store, ["x"], parent="b") == [True]  # a branch under b
        where = store.files.where(1)[1]  # (b's slot: the second taken)
    finally:
        store.close()
    store = _chain_store(tmp_path / "d", 8)
    try:
        store.remove(["b"])
        assert store.held() == ["a"] and store.check() == []
    finally:
        store.close()
    with open(tmp_path / "d" / "slots.dat", "r+b") as fh:
        fh.seek(where + 30)
        fh.write(b"\xff")
    (tmp_path / "d" / "index").unlink()  # (a crash: the slots are scanned)
    store = _chain_store(tmp_path / "d", 8)
    try:
        assert not store.from_checkpoint
        assert store.held() == ["a"] and store.recovered == 1 and store.check() == []
    finally:
        store.close()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_chains_keep_the_prefix_rule_and_the_order(tmp_path, seed):
    """Random prompts sharing prefixes, reads and restarts on a small disk: after every step
    what the disk holds is closed under prefixes and the recency order is sound."""
    import random

    rng = random.Random(seed)
    store = _chain_store(tmp_path / "d", 12)
    evicted = 0
    try:
        for step in range(300):
            # a prompt: a shared stem (one of 3) and a random tail, written where it is lacking
            stem = [f"s{rng.randrange(3)}-{i}" for i in range(rng.randrange(1, 4))]
            tail = [f"{stem[-1]}/t{rng.randrange(4)}-{i}" for i in range(rng.randrange(0, 4))]
            keys = stem + tail
            held = store.exists(keys)
            start = held.index(False) if False in held else len(keys)
            if rng.random() < 0.3:  # read the run held from some point on
                at = rng.randrange(0, max(1, start))
                store.get_many([(k, [memoryview(bytearray(VALUE))]) for k in keys[at:start]])
            elif start < len(keys):
                parent = keys[start - 1] if start else None
                _put_chain(store, keys[start:], parent=parent)
            if step % 100 == 99:  # a restart
                evicted += store.evicted
                store.close()
                store = _chain_store(tmp_path / "d", 12)
            assert store.check() == [], step
            assert _closed_under_prefixes(store), step
        assert evicted + store.evicted > 50  # (the disk was full most of the time)
    finally:
        store.close()


def test_the_write_budget_is_never_exceeded(tmp_path):
    cfg = config()
    src = filled_pool(cfg, 3)
    d = digests(5, salt="budget")
    keys = [KeyChain.name(x) for x in d]
    probe = _store(tmp_path / "probe", src, pages=1)
    slot = probe.files.slot_bytes
    probe.close()
    store = _store(tmp_path / "d", src, pages=8, budget_bytes_per_day=2 * slot + slot // 2)
    try:
        assert _put_all(store, src, keys, d, range(5)) == [True, True, False, False, False]
        assert store.budget.used() == 2 * slot <= store.budget.bytes_per_day
        figures = store.figures()
        assert figures["disk_budget_refused_writes"] == 3
        assert figures["disk_written_bytes"] == 2 * slot
    finally:
        store.close()


def test_the_budget_outlives_a_restart(tmp_path):
    """What a folder wrote in the last day counts after a restart: a daemon stopped and
    started again (or crash-looping) never writes more than the budget in a day."""
    slot = 8192
    store = SlotStore([str(tmp_path / "d")], 16 * slot, 64, budget_bytes_per_day=6 * slot)
    try:
        got = store.put_many([(f"k{i}", [bytes(64)], bytes(16)) for i in range(4)])
        assert got == [True] * 4
    finally:
        store.close()
    store = SlotStore([str(tmp_path / "d")], 16 * slot, 64, budget_bytes_per_day=6 * slot)
    try:
        assert store.budget.used() == 4 * slot
        got = store.put_many([(f"n{i}", [bytes(64)], bytes(16)) for i in range(4)])
        assert got == [True, True, False, False] and store.budget.refused == 2
    finally:
        store.close()
    (tmp_path / "d" / "budget").write_text("not a record")  # a damaged record: ignored
    store = SlotStore([str(tmp_path / "d")], 16 * slot, 64, budget_bytes_per_day=6 * slot)
    try:
        assert store.budget.used() == 0
    finally:
        store.close()


def test_the_budget_counts_any_24_hours():
    now = [0.0]
    budget = WriteBudget(100, clock=lambda: now[0])
    assert budget.take(60) and not budget.take(50) and budget.take(40)
    now[0] = 86_000.0  # not yet a day (and a minute) after the writes
    assert not budget.take(1)
    now[0] = 86_400.0 + 61.0
    assert budget.left() == 100 and budget.take(100)
    budget.give_back(100)
    assert budget.left() == 100


class Faults:
    """The fault layer in front of every I/O: raise ``error`` for ``op`` while set."""

    def __init__(self) -> None:
        self.error: dict[str, int] = {}
        self.slots: set[int] | None = None  # only these slots' I/O (None: every slot)

    def __call__(self, op: str, slot: int) -> None:
        if op in self.error and (self.slots is None or slot in self.slots):
            raise OSError(self.error[op], os.strerror(self.error[op]))


def test_drive_errors_are_misses_and_refused_writes_and_pass(tmp_path):
    cfg = config()
    src, dst = filled_pool(cfg, 4), HostPool(cfg)
    d = digests(4, salt="faults")
    keys = [KeyChain.name(x) for x in d]
    faults = Faults()
    store = _store(tmp_path / "d", src, pages=8, fault=faults)
    try:
        assert _put_all(store, src, keys[:2], d[:2], range(2)) == [True, True]
        faults.error = {"write": errno.EIO}
        assert _put_all(store, src, keys[2:3], d[2:3], [2]) == [False]
        faults.error = {"write": errno.ENOSPC}
        assert _put_all(store, src, keys[3:], d[3:], [3]) == [False]
        faults.error = {"read": errno.EIO}
        assert not _get(store, dst, keys[0], d[0], 10)
        faults.error = {}  # the drive is back: used again
        assert _get(store, dst, keys[0], d[0], 10) and _get(store, dst, keys[1], d[1], 11)
        assert _put_all(store, src, keys[2:], d[2:], [2, 3]) == [True, True]
        f = store.figures()
        assert (f["disk_write_errors"], f["disk_space_refusals"], f["disk_read_errors"]) == (
            1,
            1,
            1,
        )
        assert store.budget.used() == 4 * store.files.slot_bytes  # refused writes gave theirs back
    finally:
        store.close()


def test_a_corrupted_or_truncated_slot_is_a_miss_never_wrong_bytes(tmp_path):
    cfg = config()
    src, dst = filled_pool(cfg, 5), HostPool(cfg)
    d = digests(3, salt="corrupt")
    keys = [KeyChain.name(x) for x in d]
    where = tmp_path / "d"
    store = _store(where, src, pages=4)
    slot = store.files.slot_bytes
    try:
        assert _put_all(store, src, keys, d, range(3)) == [True] * 3
    finally:
        store.close()
    data = where / "slots.dat"
    with open(data, "r+b") as f:  # a bit of slot 0's value, and slot 1's header
        f.seek(4096 + 100)
        byte = f.read(1)
        f.seek(4096 + 100)
        f.write(bytes([byte[0] ^ 1]))
        f.seek(slot + 30)  # (in the trailer's bytes: only the header's checksum sees it)
        f.write(b"\xff")
    with_checkpoint = _store(where, src, pages=4)  # (a clean stop's index: read, not scanned)
    try:
        assert with_checkpoint.from_checkpoint and with_checkpoint.exists(keys) == [True] * 3
        assert not _get(with_checkpoint, dst, keys[1], d[1], 11)  # its header: refused at read
        assert with_checkpoint.exists(keys) == [True, False, True]
    finally:
        with_checkpoint.close()
    (where / "index").unlink()  # (a crash: no checkpoint)
    store = _store(where, src, pages=4)
    try:
        assert not store.from_checkpoint
        assert store.exists(keys) == [True, False, True]  # a header that does not verify: free
        assert not _get(store, dst, keys[0], d[0], 10)  # read back, its trailer refuses it
        assert _get(store, dst, keys[2], d[2], 12)
        os.truncate(data, 2 * slot)  # slot 2 cut away underneath
        assert not _get(store, dst, keys[2], d[2], 12) and store.read_errors == 1
    finally:
        store.close()


_WRITER = """
import sys
from hicache.l3.keys import KeyChain
from hicache.l3.pages import PageSegments, trailer
from tests.test_l3_stores import config, digests, filled_pool
from tests.test_disk_store import _store
folder = sys.argv[1]
cfg = config()
src = filled_pool(cfg, 6)
segs = PageSegments(src)
store = _store(folder, src, pages=64)
d = digests(64, salt="kill")
for i, x in enumerate(d):
    page = i % 32
    assert store.put(KeyChain.name(x), segs.views(page), trailer(segs.views(page), x))
    print(i, flush=True)
"""


def test_a_sigkill_mid_write_loses_nothing_written_and_serves_nothing_torn(tmp_path):
    folder = tmp_path / "d"
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(folder)], stdout=subprocess.PIPE, text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        done = [int(proc.stdout.readline()) for _ in range(20)]  # 20 puts returned
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    cfg = config()
    src, dst = filled_pool(cfg, 6), HostPool(cfg)
    d = digests(64, salt="kill")
    store = _store(folder, src, pages=64)  # (the lock died with the writer)
    try:  # (its index from the checkpoint and the journal: no scan)
        assert store.from_checkpoint and store.scanned == 0 and store.replayed >= len(done)
        assert store.exists([KeyChain.name(d[i]) for i in done]) == [True] * len(done)
        for i, x in enumerate(d):
            got = _get(store, dst, KeyChain.name(x), x, 31)
            if i in done:
                assert got and page_bytes(dst, 31) == page_bytes(src, i % 32)
            elif store.exists([KeyChain.name(x)])[0]:  # written whole before the kill
                assert got and page_bytes(dst, 31) == page_bytes(src, i % 32)
    finally:
        store.close()


def test_folders_that_are_not_private_or_are_taken_are_refused(tmp_path):
    cfg = config()
    src = filled_pool(cfg, 7)
    open_to_others = tmp_path / "open"
    open_to_others.mkdir(mode=0o755)
    os.chmod(open_to_others, 0o755)
    with pytest.raises(FolderRefused, match="chmod 700"):
        _store(open_to_others, src)
    link = tmp_path / "link"
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link.symlink_to(real)
    with pytest.raises(FolderRefused, match="symlink"):
        _store(link, src)
    first = _store(tmp_path / "mine", src)
    try:
        with pytest.raises(FolderRefused, match="another daemon"):
            _store(tmp_path / "mine", src)
    finally:
        first.close()
    _store(tmp_path / "mine", src).close()  # free again once closed


@pytest.mark.parametrize(
    ("rest", "problem"),
    [
        ("relative/path?bytes=1GiB", "absolute"),
        ("/a?bytes=lots", "not a size"),
        ("/a", "give its size"),
        ("/a?bytes=1G&color=red", "unknown option"),
        ("/a,/a?bytes=1G", "twice"),
    ],
)
def test_bad_disk_urls_are_refused_naming_the_problem(rest, problem):
    with pytest.raises(ValueError, match=problem):
        parse_disk_url(rest)
    with pytest.raises(ValueError, match=problem):
        open_store("disk://" + rest)


def test_the_url_names_folders_size_and_budget():
    got = parse_disk_url("/a,/b?bytes=2GiB&budget=512MiB")
    assert got == (["/a", "/b"], 2 << 30, 512 << 20)
    store = open_store("disk:///x?bytes=1G")
    assert store.url == "disk:///x"


def test_pages_stripe_over_two_folders(tmp_path):
    cfg = config()
    src, dst = filled_pool(cfg, 8), HostPool(cfg)
    segs = PageSegments(src)
    slot = 4096 + -(-segs.page_bytes // 4096) * 4096
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    store = SlotStore(paths, 8 * slot, segs.page_bytes)
    d = digests(8, salt="stripe")
    keys = [KeyChain.name(x) for x in d]
    try:
        assert _put_all(store, src, keys, d, range(8)) == [True] * 8
        assert {store.files.where(s)[0] for s in range(8)} == set(store.files.fds)
        for i in range(8):
            assert _get(store, dst, keys[i], d[i], 16 + i)
            assert page_bytes(dst, 16 + i) == page_bytes(src, i)
    finally:
        store.close()
    assert all(os.path.getsize(os.path.join(p, "slots.dat")) == 4 * slot for p in paths)


def test_a_file_system_that_refuses_direct_io_is_used_buffered(tmp_path, monkeypatch, caplog):
    import hicache.disk.folder as folder_module

    monkeypatch.setattr(folder_module, "_direct", lambda path: -1)  # as an old tmpfs answers
    cfg = config()
    src, dst = filled_pool(cfg, 9), HostPool(cfg)
    d = digests(2, salt="buffered")
    keys = [KeyChain.name(x) for x in d]
    with caplog.at_level("WARNING", logger="hicache.disk"):
        store = _store(tmp_path / "d", src)
    try:
        assert not store.direct and "refuses O_DIRECT" in caplog.text
        assert _put_all(store, src, keys, d, range(2)) == [True, True]
        assert _get(store, dst, keys[1], d[1], 5) and page_bytes(dst, 5) == page_bytes(src, 1)
    finally:
        store.close()


def test_a_daemon_refuses_a_disk_folder_it_may_not_use_at_start(tmp_path):
    from hicache.daemon.config import build_parser, resolve

    open_to_others = tmp_path / "open"
    open_to_others.mkdir()
    os.chmod(open_to_others, 0o755)
    taken = _store(tmp_path / "taken", filled_pool(config(), 10))
    try:
        for where, text in [
            (open_to_others, "chmod 700"),
            (tmp_path / "taken", "another daemon"),
            (tmp_path / "no" / "such", "does not exist"),
        ]:
            argv = ["--l3", f"disk://{where}?bytes=64MiB", "--l3-model", "m"]
            with pytest.raises(ValueError, match=text):
                resolve(build_parser().parse_args(argv), {})
    finally:
        taken.close()
    assert not (tmp_path / "fresh").exists()
    argv = ["--l3", f"disk://{tmp_path}/fresh?bytes=64MiB", "--l3-model", "m"]
    resolve(build_parser().parse_args(argv), {})  # a folder to be made is fine, and not made yet
    assert not (tmp_path / "fresh").exists()


def test_the_disk_over_a_remote_store_reads_the_disk_first_and_keeps_what_came_from_below(
    tmp_path,
):
    from hicache.disk.url import DiskUrl
    from hicache.l3.memory import drop_space, space

    drop_space("below")
    cfg = config()
    src = filled_pool(cfg, 11)
    disk = DiskUrl([str(tmp_path / "d")], 16 << 20, None)
    store = open_store("memory://below", disk=disk)
    store.attach(PageSegments(src))
    other = open_store("memory://below")  # another machine, on the store alone
    other.attach(PageSegments(src))
    d = digests(4, salt="above")
    keys = [KeyChain.name(x) for x in d]
    segs = PageSegments(src)
    tails = [trailer(segs.views(p), x) for p, x in zip(range(4), d, strict=True)]
    try:
        assert store.put(keys[:2], [0, 1], tails[:2]) == [True, True]
        assert other.exists(keys) == [True, True, False, False]  # written below too
        assert other.put(keys[2:], [2, 3], tails[2:]) == [True, True]  # only below
        assert store.exists(keys) == [True] * 4
        disk_figures = store.describe()
        assert disk_figures["disk_held_values"] == 2
        want = [page_bytes(src, i) for i in range(4)]  # (gets land in the store's own pool)
        got = store.get(keys, [10, 11, 12, 13])
        for i in range(4):
            assert verify(segs.views(10 + i), d[i], got[i])
            assert page_bytes(src, 10 + i) == want[i]
        assert store.describe()["disk_held_values"] == 4  # what came from below stays
        space("below").values.clear()  # the store loses everything: the disk still serves
        got = store.get(keys, [20, 21, 22, 23])
        assert all(verify(segs.views(20 + i), d[i], got[i]) for i in range(4))
        assert [page_bytes(src, 20 + i) for i in range(4)] == want
    finally:
        store.close()
        other.close()
        drop_space("below")


def test_disk_flags_make_the_tiers_store(tmp_path):
    from hicache.daemon.config import build_parser, resolve

    def settings(*argv: str):
        return resolve(build_parser().parse_args([*argv, "--l3-model", "m"]), {})

    alone = settings("--disk", f"{tmp_path}/a,{tmp_path}/b", "--disk-bytes", "1GiB")
    assert (
        alone.l3 is not None and alone.l3.url == f"disk://{tmp_path}/a,{tmp_path}/b?bytes={1 << 30}"
    )
    over = settings("--disk", f"{tmp_path}/a", "--disk-bytes", "1GiB",
                    "--disk-write-budget", "2GiB", "--l3", "memory://x")  # fmt: skip
    assert over.l3 is not None and over.l3.url == "memory://x"
    assert over.l3.options["disk"] == ([f"{tmp_path}/a"], 1 << 30, 2 << 30)
    for argv, text in [
        (["--disk", f"{tmp_path}/a"], "disk_bytes"),
        (["--disk", "relative", "--disk-bytes", "1G"], "absolute"),
        (["--disk-bytes", "1G"], "names no folder"),
        (["--disk", f"{tmp_path}/a", "--disk-bytes", "lots"], "not a size"),
        (["--disk", f"{tmp_path}/a", "--disk-bytes", "1G", "--l3", f"disk://{tmp_path}/b?bytes=1G"],
         "remote store"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=text):
            settings(*argv)


def test_disk_admission_is_the_tiers_write_policy(tmp_path):
    from hicache.daemon.config import build_parser, resolve

    def l3(*argv: str):
        disk = ["--disk", f"{tmp_path}/a", "--disk-bytes", "1GiB", "--l3-model", "m"]
        got = resolve(build_parser().parse_args([*disk, *argv]), {}).l3
        assert got is not None
        return str(got.write_policy), got.write_threshold

    assert l3() == ("write_through_adaptive", 2)  # reused once (1 at creation): the default
    assert l3("--disk-admission", "reused-strict") == ("write_through_selective", 2)
    assert l3("--disk-admission", "all")[0] == "write_through"
    assert l3("--disk-admission", "none")[0] == "none"
    for argv, text in [
        (["--disk-admission", "some"], "not one of"),
        (["--l3-write-policy", "write_back"], "--disk-admission"),
    ]:
        with pytest.raises(ValueError, match=text):
            l3(*argv)


@pytest.mark.parametrize("drain_s", [0.0, 30.0])
def test_a_stop_drains_queued_writes_for_close_drain_s(drain_s):
    """The third tier's IO thread at a stop: queued writes end unrun, or (``close_drain_s``,
    a disk's default) still run, for up to that long, before it exits."""
    from hicache.l3.breaker import Breaker
    from hicache.l3.jobs import Write
    from hicache.l3.keys import identity_of
    from hicache.l3.memory import drop_space
    from hicache.l3.worker import IOWorker

    drop_space("drain")
    cfg = config()
    pool = filled_pool(cfg, 12)
    store = open_store("memory://drain?latency_s=0.05")  # each call takes a while
    store.attach(PageSegments(pool))
    chain = KeyChain(identity_of(cfg, "m", "0"), 4)
    worker = IOWorker(store, chain, PageSegments(pool), Breaker(3, 1.0), batch=1)
    tokens = np.arange(1, 4 * 8 + 1, dtype=np.int32).tobytes()
    jobs = [Write(tokens[: 16 * (i + 1)], None, i, np.array([i]), []) for i in range(8)]
    try:
        for job in jobs:
            worker.submit(job)
        assert worker.close(drain_s=drain_s)
        stored = [job.stored for job in jobs]
        if drain_s:
            assert stored == [1] * 8 and not any(job.error for job in jobs)
        else:  # (the one running when close came may have landed)
            assert sum(stored) <= 1 and sum(job.error == "closing" for job in jobs) >= 7
    finally:
        store.close()
        drop_space("drain")


def test_the_disks_figures_reach_info_top_and_metrics(tmp_path):
    """Every DISK_FIGURES name is what the store reports (in the third tier's ``l3``
    structure, as ``store_*``), shown in ``hicache info``'s disk section, exported as
    ``hicache_disk_*`` and moving in ``hicache top``."""
    from hicache.client.info_view import sections
    from hicache.client.top import Rates, render_top
    from hicache.daemon.observe import families
    from hicache.observe import DISK_FIGURES

    cfg = config()
    pool = filled_pool(cfg, 13)
    store = open_store(f"disk://{tmp_path}/d?bytes=16MiB")
    store.attach(PageSegments(pool))
    try:

        def report() -> dict:
            figures = store.describe()
            return {"l3": {"url": store.url, **{f"store_{k}": v for k, v in figures.items()}}}

        before = report()
        names = {f.name for f in DISK_FIGURES}
        assert names == {k for k in before["l3"] if k.startswith("store_disk_")}
        d = digests(3, salt="figures")
        keys = [KeyChain.name(x) for x in d]
        segs = PageSegments(pool)
        assert store.put(keys, [0, 1, 2], [trailer(segs.views(i), d[i]) for i in range(3)])
        after = report()
        assert sections(after)["disk"]["store_disk_written_values"] == 3
        exported = {family.name for family in families(after)}
        for f in DISK_FIGURES:
            assert not f.metric or f"hicache_{f.metric}" in exported, f.name
        rates = Rates.between(before, after, 1.0)
        moving = {name: rate for name, _, rate in rates.moving}
        assert moving["l3.store_disk_written_values"] == 3
        assert rates.disk_written_bytes_per_s == after["l3"]["store_disk_written_bytes"] > 0
        disk_line = next(x for x in render_top(after, rates).splitlines() if x.startswith("disk"))
        held = after["l3"]["store_disk_held_bytes"]
        assert f"held {held // 1024:.1f}KiB of 16.0MiB" in disk_line, disk_line
        assert "written " + f"{held / 1024:.1f}KiB/s" in disk_line, disk_line
        assert not any(x.startswith("disk") for x in render_top({"l3": {}}, None).splitlines())
    finally:
        store.close()


def test_the_tier_writes_again_a_prefix_the_disk_let_go(tmp_path):
    """The tree takes a page written to the disk as stored; when the disk has evicted it since,
    a longer prompt's write is not made without it (never a tail alone), and the next offer
    writes the whole chain."""
    from hicache.l3 import LazyStore
    from hicache.l3.config import L3Config
    from hicache.l3.tier import L3Tier
    from tests.conftest import make_cache
    from tests.test_l3_tier import PS, store, tokens_of

    cache = make_cache(
        manual=False, page_size=PS, num_kv_heads=2, head_dim=4, device_tokens=64,
        host_tokens=128, load_back_threshold=0,
    )  # fmt: skip
    url = f"disk://{tmp_path / 'd'}?bytes=40KiB&budget=1GiB"  # (5 slots of 8 KiB)
    lazy = LazyStore(url)  # (as a daemon opens it: on its IO thread, as it starts)
    assert lazy.keeps_prefixes and lazy.clears
    cache.attach_l3(L3Tier(cache, L3Config(url, "test-model"), lazy))
    cache.l3.drain()  # (opened now)
    disk = lazy.inner.slots
    try:
        assert disk.files.count == 5
        a = tokens_of(3 * PS, 1)
        store(cache, a)
        store(cache, tokens_of(5 * PS, 2))  # another prompt fills the disk: a's pages go
        assert disk.evicted == 3 and cache.l3.counters.no_prefix_writes == 0
        longer = np.concatenate([a, tokens_of(PS, 3)])
        store(cache, longer)  # the tree held a's pages as stored: the write is not made
        assert cache.l3.counters.no_prefix_writes == 1
        assert disk.figures()["disk_refused_no_prefix"] == 0  # (not even tried on the disk)
        assert len(disk.held()) == 5
        written = cache.l3.counters.written_pages
        store(cache, np.concatenate([longer, tokens_of(PS, 4)]))  # the next offer: all of it
        assert cache.l3.counters.written_pages - written == 5  # a's 3 pages and the 2 after
        held = disk.held()
        assert len(held) == 5 and all(disk.parent(k) in (None, *held) for k in held)
        assert disk.check() == []
    finally:
        cache.l3.drain()
        cache.check_integrity()
        cache.close()


def test_after_a_flush_of_the_disk_the_tree_writes_its_prompts_again(tmp_path):
    """What the tree took as written is written again once the disk was flushed (the flush
    runs on the IO thread; the tier forgets which nodes were stored)."""
    from hicache.l3 import LazyStore
    from hicache.l3.config import L3Config
    from hicache.l3.tier import L3Tier
    from tests.conftest import make_cache
    from tests.test_l3_tier import PS, store, tokens_of

    cache = make_cache(
        manual=False, page_size=PS, num_kv_heads=2, head_dim=4, device_tokens=64,
        host_tokens=128, load_back_threshold=0,
    )  # fmt: skip
    url = f"disk://{tmp_path / 'd'}?bytes=1MiB&budget=1GiB"
    disk = LazyStore(url)
    cache.attach_l3(L3Tier(cache, L3Config(url, "test-model"), disk))
    try:
        a = tokens_of(3 * PS, 1)
        store(cache, a)
        job = cache.l3.clear_store(10.0)
        assert job.done.is_set() and job.cleared == 3 and not job.error
        assert disk.inner.slots.held() == []
        written = cache.l3.counters.written_pages
        store(cache, np.concatenate([a, tokens_of(PS, 2)]))
        assert cache.l3.counters.written_pages - written == 4  # a's pages again, and the new one
    finally:
        cache.l3.drain()
        cache.check_integrity()
        cache.close()


@pytest.mark.parametrize("where", ["disk", "tmpfs"])
def test_aligned_values_go_straight_between_memory_and_the_drive(tmp_path, where):
    """Values whose parts sit on 4 KiB boundaries (a pool's pages) are written from and read
    into the caller's memory (no bounce copy): byte-identical; a slot that holds another key
    is a miss; views of another length than the value are refused (the value stays)."""
    import mmap

    folder = tmp_path / "d" if where == "disk" else SHM / f"hicache-test-zc-{os.getpid()}"
    src, dst = mmap.mmap(-1, 4 * 8192), mmap.mmap(-1, 4 * 8192)
    rng = np.random.default_rng(3)
    src[:] = rng.integers(0, 256, 4 * 8192, np.uint8).tobytes()
    store = SlotStore([str(folder)], 8 * (4096 + 8192), 8192, budget_bytes_per_day=1 << 30)
    try:
        parts = [[memoryview(src)[i * 8192 : i * 8192 + 4096],
                  memoryview(src)[i * 8192 + 4096 : (i + 1) * 8192]] for i in range(4)]  # fmt: skip
        assert all(store.files.goes_direct(p) for p in parts)
        assert (
            store.put_many([(f"k{i}", p, bytes([i]) * 16) for i, p in enumerate(parts)])
            == [True] * 4
        )
        into = [[memoryview(dst)[i * 8192 : (i + 1) * 8192]] for i in range(4)]
        assert store.files.goes_direct(into[0])
        got = store.get_many([(f"k{i}", into[i]) for i in range(4)])
        assert got == [bytes([i]) * 16 for i in range(4)] and dst[:] == src[:]
        store._index["k1"], store._index["k2"] = store._index["k2"], store._index["k1"]
        assert store.get_many([("k1", into[1])]) == [None]  # (the slot holds k2)
        with pytest.raises(ValueError, match="not the views'"):  # another length: kept
            store.get_many([("k3", [memoryview(dst)[:4096]])])
        assert store.exists(["k3"]) == [True] and store.check() == []
    finally:
        store.close()
        shutil_rm(folder)


def shutil_rm(folder: Path) -> None:
    import shutil

    shutil.rmtree(folder, ignore_errors=True)


def test_a_clean_stops_checkpoint_is_read_and_only_for_its_geometry(tmp_path):
    """A clean close checkpoints the index (its recency order too) with an empty journal after
    it; the next open reads it instead of the headers (nothing to replay) and writes its own
    at once; a store of another geometry, or a damaged checkpoint, scans instead."""
    store = _chain_store(tmp_path / "d", 8)
    try:
        assert _put_chain(store, ["a", "b"]) == [True, True]
        assert _put_chain(store, ["x"]) == [True]
        store.get_many([("b", [memoryview(bytearray(VALUE))])])  # a, b now the most recent
    finally:
        store.close()
    before = (tmp_path / "d" / "index").read_text().splitlines()[0]
    store = _chain_store(tmp_path / "d", 8)
    try:
        assert store.from_checkpoint and store.held() == ["x", "b", "a"]
        assert (store.replayed, store.scanned) == (0, 0)
        assert (tmp_path / "d" / "index").read_text().splitlines()[0] != before  # (its own)
        assert store.check() == []
    finally:
        store.close()
    store = SlotStore([str(tmp_path / "d")], 16 * 8192, VALUE, budget_bytes_per_day=1 << 30)
    try:  # twice the slots: another geometry, scanned (what it holds is found all the same)
        assert not store.from_checkpoint and sorted(store.held()) == ["a", "b", "x"]
    finally:
        store.close()
    (tmp_path / "d" / "index").write_text('{"magic": "hicache-disk-index/2"}\nnot json\n')
    store = SlotStore([str(tmp_path / "d")], 16 * 8192, VALUE, budget_bytes_per_day=1 << 30)
    try:
        assert not store.from_checkpoint and sorted(store.held()) == ["a", "b", "x"]
    finally:
        store.close()


def _crash(store: SlotStore) -> dict[str, bytes]:
    """What a SIGKILL of ``store``'s process leaves in its folder (the files as they are: the
    kernel's page cache outlives the process), put back after a clean close; returned."""
    folder = Path(store.folders[0].path)
    left = {f.name: f.read_bytes() for f in folder.iterdir() if f.name != "lock"}
    store.close()
    _put_back(folder, left)
    return left


def _put_back(folder: Path, files: dict[str, bytes]) -> None:
    for f in folder.iterdir():
        if f.name != "lock" and f.name not in files:
            f.unlink()
    for name, data in files.items():
        (folder / name).write_bytes(data)


def test_a_crash_finds_the_index_again_from_the_journal_without_a_scan(tmp_path):
    """Writes, uses, evictions, a read back bad and removals after the checkpoint are
    replayed in order: the index after a crash is the one the store had, its recency order
    too, and nothing is scanned; each prefix of the journal is an index the store had (a line
    cut short, and what follows, is not used); a journal that is missing or follows another
    checkpoint is not trusted (the slots are scanned)."""
    folder = tmp_path / "d"
    store = _chain_store(folder, 6)
    try:
        assert _put_chain(store, ["a", "b", "c"]) == [True] * 3
        assert _put_chain(store, ["x", "y"]) == [True] * 2
        store.get_many([("b", [memoryview(bytearray(VALUE))])])  # a, b the most recent
        assert _put_chain(store, ["p", "q"]) == [True] * 2  # (full: c evicted)
        store.remove(["p"])  # (q with it)
        assert _put_chain(store, ["m"]) == [True]
        assert _get_chain(store, "x") and _get_chain(store, "b")  # (uses alone: no write)
        had = store.held()
        assert had == ["y", "m", "x", "b", "a"] and store.check() == []
        store.evict(1)  # (y: its own record, the journal's last)
        assert store.held() == had[1:]
        left = _crash(store)
    except BaseException:
        store.close()
        raise
    store = _chain_store(folder, 6)
    try:
        assert store.from_checkpoint and store.scanned == 0 and store.replayed > 5
        assert store.held() == had[1:] and store.check() == []
        assert _get_chain(store, "m") and _get_chain(store, "a")  # (verified against the slot)
    finally:
        store.close()
    whole = left["journal"]
    cut = whole[: whole.rindex(b"\n", 0, len(whole) - 1) + 5]  # (its last line cut short)
    _put_back(folder, {**left, "journal": cut})
    store = _chain_store(folder, 6)
    try:
        assert store.from_checkpoint and store.held() == had and store.check() == []
    finally:
        store.close()
    _put_back(folder, {k: v for k, v in left.items() if k != "journal"})  # (no journal)
    store = _chain_store(folder, 6)
    try:
        assert not store.from_checkpoint and store.scanned == 6
        assert set(had) <= set(store.held()) and store.check() == []  # (and what was let go
        # but not overwritten: a scan finds every slot whose header verifies)
    finally:
        store.close()
    token = json.loads(left["journal"].split(b"\n", 1)[0])["checkpoint"].encode()
    other = left["journal"].replace(token, b"0" * len(token), 1)
    _put_back(folder, {**left, "journal": other})  # (after another checkpoint)
    store = _chain_store(folder, 6)
    try:
        assert not store.from_checkpoint
    finally:
        store.close()


def test_the_journal_stays_under_its_bound_and_a_failing_one_means_a_scan(tmp_path, monkeypatch):
    """A call whose changes would take the journal to its bound (MAX_BYTES and twice the
    checkpoint) writes a new checkpoint, which holds them, instead: the journal is never as
    long as a reader refuses, and a crash replays only what came after; one the drive fails
    to append to is removed (a crash then scans, never replays a journal that misses changes)
    and started again a minute later."""
    from hicache.disk import index_log, journal

    folder = tmp_path / "d"
    store = _chain_store(folder, 8)
    try:
        monkeypatch.setattr(journal, "MAX_BYTES", 64)
        checkpoints = {(folder / "index").read_bytes()}
        assert _put_chain(store, list("abcdef")) == [True] * 6
        for _ in range(100):  # (uses: the journal grows)
            assert _get_chain(store, "f")
            checkpoints.add((folder / "index").read_bytes())
            size = (folder / "journal").stat().st_size
            assert size < journal.bound((folder / "index").stat().st_size)
        assert len(checkpoints) > 2  # (written again as it went)
        assert _put_chain(store, ["x"]) == [True]
        left = _crash(store)
    except BaseException:
        store.close()
        raise
    store = _chain_store(folder, 8)
    try:
        lines = left["journal"].count(b"\n") - 1
        assert store.from_checkpoint and store.replayed == lines < 40
        assert store.held() == [*"fedcba", "x"] and store.check() == []

        def fail(self, data: bytes) -> None:
            raise OSError(5, "Input/output error")

        with monkeypatch.context() as m:
            m.setattr(journal.Journal, "append", fail)
            assert _put_chain(store, ["y"]) == [True]  # (written; its record is not)
        assert not (folder / "journal").exists()
        store.tick()  # (not a minute yet: still none)
        assert not (folder / "journal").exists()
        _crash(store)
    except BaseException:
        store.close()
        raise
    store = _chain_store(folder, 8)
    try:
        assert not store.from_checkpoint and sorted(store.held()) == [*"abcdef", "x", "y"]
        monkeypatch.setattr(journal.Journal, "append", fail)
        assert _put_chain(store, ["z"]) == [True]
        monkeypatch.undo()
        monkeypatch.setattr(index_log, "CHECKPOINT_RETRY_S", 0.0)
        store.tick()  # (tried again: journaling resumes)
        assert (folder / "journal").exists()
        assert _put_chain(store, ["w"]) == [True]
        had = store.held()
        _crash(store)
    except BaseException:
        store.close()
        raise
    store = _chain_store(folder, 8)
    try:
        assert store.from_checkpoint and store.held() == had
    finally:
        store.close()


def test_every_prefix_of_a_journal_is_an_index_that_keeps_the_rules(tmp_path):
    """A journal of writes, uses, evictions, removals and writes again into slots let go:
    replayed whole it gives the index the store had (a key written again elsewhere, its old
    slot taken by another, included); cut after any line (a power loss, a short write) it
    gives an index that keeps every rule (each parent after its children, a page only with
    its prefix, each slot held once)."""
    folder = tmp_path / "d"
    store = _chain_store(folder, 3)
    try:
        for key in ("A", "B", "C"):
            assert _put_chain(store, [key]) == [True]  # (slots 0, 1, 2)
        store.evict(1)  # (A leaves slot 0)
        store.remove(["B"])
        assert _put_chain(store, ["A"]) == [True]  # (into slot 1)
        assert _put_chain(store, ["J"]) == [True]  # (into slot 0, where A was)
        assert _put_chain(store, ["p", "q"], parent="J") == [True, True]  # (C, A evicted)
        had = store.held()
        left = _crash(store)
    except BaseException:
        store.close()
        raise
    store = _chain_store(folder, 3)
    try:
        assert store.from_checkpoint and store.held() == had and store.check() == []
    finally:
        store.close()
    head, *lines = left["journal"].split(b"\n")
    assert len(lines) > 10
    for n in range(len(lines)):
        _put_back(folder, {**left, "journal": b"\n".join([head, *lines[:n]]) + b"\n"})
        store = _chain_store(folder, 3)
        try:
            assert store.from_checkpoint and store.check() == [], n
            assert _closed_under_prefixes(store), n
        finally:
            store.close()
    chain = _chain_store(tmp_path / "c", 6)
    try:
        assert _put_chain(chain, ["a", "b"]) == [True, True]
        assert _put_chain(chain, ["c", "d"], parent="b") == [True, True]
        left = _crash(chain)
    except BaseException:
        chain.close()
        raise
    head, *lines = left["journal"].split(b"\n")
    for n in range(len(lines)):  # (cut inside a batch: its writes before its closing use)
        _put_back(tmp_path / "c", {**left, "journal": b"\n".join([head, *lines[:n]]) + b"\n"})
        chain = _chain_store(tmp_path / "c", 6)
        try:
            assert chain.check() == [] and _closed_under_prefixes(chain), n
            chain.evict(1)  # (a leaf: never a prefix before its tail)
            assert _closed_under_prefixes(chain), n
        finally:
            chain.close()


def test_a_journal_damaged_or_planted_never_breaks_the_open_or_the_rules(tmp_path):
    """Records that do not fit (a cycle of parents, a sequence past any the store writes, a
    line nested past the parser's depth) end the replay there; a journal longer than any the
    store writes, and a FIFO where the journal, the checkpoint or a note should be, are not
    read (the slots are scanned, or the note ignored), never waited on."""
    folder = tmp_path / "d"
    store = _chain_store(folder, 6)
    try:
        assert _put_chain(store, ["a"]) == [True]
        left = _crash(store)
    except BaseException:
        store.close()
        raise
    bad = {
        "cycle": [b'["w",3,10,"P","Q"]', b'["w",4,11,"Q","P"]'],
        "own parent": [b'["w",3,10,"P","P"]'],
        "sequence": [b'["w",3,' + str(1 << 64).encode() + b',"P",null]'],
        "nested": [b"[" * 200_000],
    }
    for what, records in bad.items():
        _put_back(folder, {**left, "journal": left["journal"] + b"\n".join([*records, b""])})
        store = _chain_store(folder, 6)
        try:
            assert store.from_checkpoint and store.held() == ["a"], what
            assert _put_chain(store, ["x"]) == [True] and store.check() == [], what
        finally:
            store.close()
    _put_back(folder, left)
    with open(folder / "journal", "r+b") as fh:  # (sparse: longer than any the store writes)
        fh.truncate(3 * 16 * 1024 * 1024 + 1)
    store = _chain_store(folder, 6)
    try:
        assert not store.from_checkpoint and "a" in store.held()
    finally:
        store.close()
    _put_back(folder, {**left, "index": left["index"] + b"[" * 5_000 + b"\n"})  # (< its bound)
    store = _chain_store(folder, 6)
    try:  # (a checkpoint nested past the parser: not trusted, the slots are scanned)
        assert not store.from_checkpoint and "a" in store.held()
    finally:
        store.close()
    for name in ("journal", "index", "budget"):
        _put_back(folder, left)
        (folder / name).unlink(missing_ok=True)
        os.mkfifo(folder / name, 0o600)
        store = _chain_store(folder, 6)  # (never waits on the FIFO)
        try:
            assert "a" in store.held() and store.from_checkpoint == (name == "budget"), name
        finally:
            store.close()
        if (folder / name).exists() and not (folder / name).is_file():
            (folder / name).unlink()


def test_a_crash_between_a_checkpoint_and_its_journal_needs_no_scan(tmp_path, monkeypatch):
    """The new checkpoint names the one it replaces: a crash after it was written and before
    its journal was started (at a clean stop, a flush, an open) leaves the old journal, whose
    changes it holds already; the next open reads it with nothing to replay (after a flush:
    nothing held, the flushed pages never back)."""
    from hicache.disk import journal

    folder = tmp_path / "d"
    between: list[dict[str, bytes]] = []
    start = journal.Journal.__init__

    def snapshot(self, where: str, token: str) -> None:  # (what a crash here leaves)
        between.append({f.name: f.read_bytes() for f in Path(where).iterdir() if f.name != "lock"})
        start(self, where, token)

    store = _chain_store(folder, 6)
    try:
        assert _put_chain(store, ["a", "b"]) == [True, True]
        assert _put_chain(store, ["x"]) == [True]
        had = store.held()
        monkeypatch.setattr(journal.Journal, "__init__", snapshot)
    finally:
        store.close()
    _put_back(folder, between.pop())
    store = _chain_store(folder, 6)  # (its open's checkpoint: another snapshot)
    try:
        assert store.from_checkpoint and store.replayed == 0 and store.held() == had
        assert store.clear() == 3
    finally:
        store.close()
    opened, flushed = between[0], between[1]
    for left, holds in ((opened, had), (flushed, [])):
        _put_back(folder, left)
        store = _chain_store(folder, 6)
        try:
            assert store.from_checkpoint and store.scanned == 0 and store.held() == holds
        finally:
            store.close()


def test_a_header_with_a_sequence_past_any_the_store_writes_is_a_free_slot(tmp_path):
    """A slot whose header verifies but names a sequence no write of the store's reaches
    (crafted) is free at a scan: never taken, so it never stops the writes after it."""
    from hicache.disk import Header

    folder = tmp_path / "d"
    store = _chain_store(folder, 4)
    try:
        assert _put_chain(store, ["a", "b"]) == [True, True]
        slot = store._index["a"]
        fd, offset = store.files.where(slot)
    finally:
        store.close()
    (folder / "index").unlink()  # (a scan)
    with open(folder / "slots.dat", "r+b") as fh:
        fh.seek(offset)
        fh.write(Header("a", VALUE, TAIL, (1 << 64) - 1, None).pack())
    store = _chain_store(folder, 4)
    try:
        assert store.held() == [] and store.check() == []  # (b: without its prefix)
        assert _put_chain(store, ["x", "y", "z"]) == [True] * 3 and store.check() == []
        assert store.clear() == 3
    finally:
        store.close()


def test_a_journal_that_cannot_be_removed_takes_its_checkpoint_with_it(tmp_path, monkeypatch):
    """The journal stopped holding every change (a failed append or checkpoint) and the drive
    refuses its removal too: the checkpoint goes instead, so the next open scans (never a
    stale journal trusted, pages written since lost, pages removed since back)."""
    from hicache.disk import journal

    folder = tmp_path / "d"
    store = _chain_store(folder, 6)
    try:
        assert _put_chain(store, ["a", "b"]) == [True, True]
        unlink = os.unlink

        def refuse_the_journal(path, *args, **kw):
            if str(path).endswith("/journal"):
                raise OSError(5, "Input/output error")
            return unlink(path, *args, **kw)

        def fail(self, data: bytes) -> None:
            raise OSError(5, "Input/output error")

        with monkeypatch.context() as m:
            m.setattr(os, "unlink", refuse_the_journal)
            m.setattr(journal.Journal, "append", fail)
            assert _put_chain(store, ["x"]) == [True]  # (its record fails; so does removal)
        assert (folder / "journal").exists() and not (folder / "index").exists()
        store.remove(["a"])
        _crash(store)
    except BaseException:
        store.close()
        raise
    store = _chain_store(folder, 6)
    try:
        assert not store.from_checkpoint and "x" in store.held()
    finally:
        store.close()


def test_a_long_chain_replays_in_its_length(tmp_path, monkeypatch):
    """A batch's writes are one use as they end, as the store makes them: replaying a chain
    written in one batch walks it a few times, not once per page (a crash's open of a long
    prompt would cost its square)."""
    folder = tmp_path / "d"
    store = _chain_store(folder, 64)
    try:
        keys = [f"p{i}" for i in range(64)]
        assert _put_chain(store, keys) == [True] * 64
        had = store.held()
        _crash(store)
    except BaseException:
        store.close()
        raise
    uses = []
    touch = SlotStore._touch

    def counted(self, keys):
        uses.append(len(keys))
        return touch(self, keys)

    monkeypatch.setattr(SlotStore, "_touch", counted)
    store = _chain_store(folder, 64)
    try:
        assert store.from_checkpoint and store.held() == had and store.replayed == 66
        assert len(uses) <= 4, uses  # (the batch's two uses, and its run of writes once)
    finally:
        store.close()


def test_a_flushed_page_never_comes_back_even_by_a_scan(tmp_path):
    """A flush raises the folders' floor before it forgets: a start that has to scan (its
    checkpoint and journal lost) takes every slot written at or below it as free."""
    folder = tmp_path / "d"
    store = _chain_store(folder, 6)
    try:
        assert all(_put_chain(store, [key]) == [True] for key in "abc")  # (first pages)
        assert store.clear() == 3
        assert _put_chain(store, ["x"]) == [True]  # (into one of their slots)
    finally:
        store.close()
    for name in ("index", "journal"):
        (folder / name).unlink()
    store = _chain_store(folder, 6)
    try:
        assert not store.from_checkpoint and store.scanned == 6 and store.held() == ["x"]
    finally:
        store.close()


def _get_chain(store: SlotStore, key: str) -> bool:
    got = store.get_many([(key, [memoryview(bytearray(VALUE))])])[0]
    return got == TAIL


def test_what_a_damaged_folder_holds_is_refused_or_ignored_never_trusted(tmp_path):
    """The folder's small files, damaged: a budget record that does not parse is ignored (the
    folder opens, and its lock is free afterwards); a floor beyond any write sequence refuses
    the folder, saying what to remove; a checkpoint that lists a parent before its child is
    not trusted (the slots are scanned); what a crash left of a file being replaced goes."""
    from hicache.disk import check_folder

    folder = tmp_path / "d"
    store = _chain_store(folder, 8)
    try:
        assert _put_chain(store, ["a", "b"]) == [True, True]
    finally:
        store.close()
    (folder / "budget").write_text("[[0, Infinity]]")
    for name in ("floor", "budget", "index"):
        (folder / f"{name}.4242.0badf00d.tmp").write_text("left by a crash")
    store = _chain_store(folder, 8)
    try:
        assert store.from_checkpoint and store.budget.used() == 0
        assert not list(folder.glob("*.tmp"))
    finally:
        store.close()
    lines = (folder / "index").read_text().splitlines()
    (folder / "index").write_text("\n".join([lines[0], *reversed(lines[1:])]) + "\n")
    store = _chain_store(folder, 8)
    try:
        assert not store.from_checkpoint and store.held() == ["b", "a"] and store.check() == []
    finally:
        store.close()
    (folder / "floor").write_text(str(1 << 64))
    with pytest.raises(FolderRefused, match="floor"):
        check_folder(str(folder))
    with pytest.raises(FolderRefused, match="remove"):
        _chain_store(folder, 8)
    (folder / "floor").unlink()
    _chain_store(folder, 8).close()  # (the refusal left the folder's lock free)


def test_values_are_bytes_and_contiguous_whatever_view_holds_them(tmp_path):
    """A view of 2-byte items counts its bytes (never writing past its slot); memory that
    is not contiguous is refused with ValueError, changing nothing."""
    store = _chain_store(tmp_path / "d", 4)
    try:
        wide = memoryview(bytearray(VALUE)).cast("H")  # VALUE // 2 items, VALUE bytes
        assert store.put_many([("w", [wide], TAIL)]) == [True]
        with pytest.raises(ValueError, match="larger than a slot"):
            store.put_many([("x", [memoryview(bytearray(VALUE * 2)).cast("H")], TAIL)])
        with pytest.raises(ValueError, match="contiguous"):
            store.put_many([("y", [memoryview(bytearray(VALUE * 2))[::2]], TAIL)])
        with pytest.raises(ValueError, match="contiguous"):
            store.get_many([("w", [memoryview(bytearray(VALUE * 2))[::2]])])
        assert store.held() == ["w"] and store.check() == []
    finally:
        store.close()


def test_an_idle_store_syncs_and_saves_its_budget_when_ticked(tmp_path):
    """The IO thread ticks the store when idle: writes a while ago are synced and the write
    budget's record saved without waiting for the next write or the close (a crash then
    forgets at most about ``sync_s`` of writes)."""
    store = _chain_store(tmp_path / "d", 4, sync_s=0.0)
    try:
        assert _put_chain(store, ["a"]) == [True]
        budget = tmp_path / "d" / "budget"
        budget.unlink(missing_ok=True)
        store._dirty_since = 0.0  # (the write was a while ago)
        store.tick()
        assert budget.exists() and store._dirty_since is None
    finally:
        store.close()


def test_a_flush_that_fails_on_one_drive_forgets_nothing_after_a_restart_either(tmp_path):
    """A flush whose floor cannot be written on the second folder fails as a whole: the first
    folder's floor, raised already, is put back, so a clean restart still finds every value
    (the failed flush forgot nothing, now or later)."""
    folders = [tmp_path / "a", tmp_path / "b"]
    open_ = lambda: SlotStore([str(f) for f in folders], 8 * 8192, VALUE,  # noqa: E731
                              budget_bytes_per_day=1 << 40)  # fmt: skip
    store = open_()
    keys = [f"k{i}" for i in range(6)]
    assert all(_put_chain(store, keys))
    (folders[1] / "floor" / "x").mkdir(parents=True)  # (its floor cannot be replaced)
    with pytest.raises(OSError):
        store.clear()
    assert sorted(store.held()) == keys
    store.close()
    (folders[1] / "floor" / "x").rmdir()
    (folders[1] / "floor").rmdir()
    store = open_()
    try:
        assert (
            sorted(store.held()) == sorted(keys) and store.figures()["disk_recovered_values"] == 6
        )
        assert store.clear() == 6  # (and a flush that succeeds forgets them for good)
    finally:
        store.close()
    store = open_()
    try:
        assert store.held() == []
    finally:
        store.close()


def test_a_folder_that_cannot_be_made_is_refused_before_the_daemon_starts(tmp_path):
    """The start's check makes a missing folder (and removes it again), so a place where no
    folder can be made (/proc; a read-only parent) is refused then, not at the first lookup;
    a file where the folder should be is named as what it is."""
    from hicache.disk import check_folder

    with pytest.raises(FolderRefused, match="cannot make /proc/hicache-check"):
        check_folder("/proc/hicache-check")
    check_folder(str(tmp_path / "fine"))
    assert not (tmp_path / "fine").exists()  # (nothing kept)
    (tmp_path / "file").write_text("")
    with pytest.raises(FolderRefused, match="is not a folder$"):
        check_folder(str(tmp_path / "file"))


def _down(*_: object) -> None:
    from hicache.l3.store import StoreDown

    raise StoreDown("the drive went away")


@pytest.mark.parametrize("host_tokens", [128, 0])
def test_a_disk_fetch_asks_and_reads_in_one_turn_when_free_pages_are_there(tmp_path, host_tokens):
    """A local drive (``reads_at_once``): a fetch sets aside pages for all it wants from free
    pages, and the IO thread asks and reads in one turn (one hand-off back to the control
    thread, not two); pages beyond the disk's run are freed, a miss frees them all, and what
    is served is the KV computed; the asking is timed apart from the reading, and a read that
    fails still counts the pages the disk said it has. Without free pages for twice the want
    (with what lookups in flight hold), the two stages as before. Under a host pool and under
    the one pool."""
    from hicache.l3 import LazyStore
    from hicache.l3.config import L3Config
    from hicache.l3.tier import L3Tier
    from tests.conftest import make_cache
    from tests.test_l3_tier import PS, _cycle, fetch, served, store, tokens_of

    cache = make_cache(
        manual=False, page_size=PS, num_kv_heads=2, head_dim=4, device_tokens=64,
        host_tokens=host_tokens, load_back_threshold=0,
    )  # fmt: skip
    url = f"disk://{tmp_path / 'd'}?bytes=1MiB&budget=1GiB"
    lazy = LazyStore(url)
    assert lazy.reads_at_once and not LazyStore("memory://x").reads_at_once
    cache.attach_l3(L3Tier(cache, L3Config(url, "test-model"), lazy))
    cache.l3.drain()
    tier = cache.l3
    steps: list[str] = []
    step = tier._fetch_step
    tier._fetch_step = lambda f: (steps.append(f.stage), step(f))[1]  # type: ignore[method-assign]
    try:
        a = tokens_of(4 * PS, 1)
        store(cache, a)
        _cycle(cache)
        longer = np.concatenate([a, tokens_of(4 * PS, 2)])  # 8 pages wanted, 4 on the disk
        f = fetch(cache, longer)
        assert f is not None and f.at_once and (f.want, f.hits, f.adopted) == (8, 4, 4)
        assert steps == ["read"]  # (one hand-off)
        assert 0 < f.ask_s < f.io_s and tier.rtt_s == f.ask_s  # (the asking, timed apart)
        assert tier.read_bps == 4 * tier.pages.page_bytes / (f.io_s - f.ask_s)
        assert served(cache, longer) == 4 * PS
        cache.check_integrity()  # (the 4 pages beyond the run are free again)
        steps.clear()
        f = fetch(cache, tokens_of(4 * PS, 3))  # a miss
        assert f is not None and f.at_once and f.hits == 0 and steps == ["exists"]
        cache.check_integrity()
        _cycle(cache)
        hits, get = tier.counters.hit_pages, lazy.get
        lazy.get = _down  # type: ignore[method-assign]  (the drive fails as it reads)
        f = fetch(cache, longer)
        lazy.get = get  # type: ignore[method-assign]
        assert f is not None and f.at_once and f.error and f.hits == 4 and not f.adopted
        assert tier.counters.hit_pages == hits + 4  # (what the disk said it has, counted)
        cache.check_integrity()
        assert tier.side.alloc.free_pages < 2 * 18
        steps.clear()
        longest = np.concatenate([a, tokens_of(14 * PS, 2)])  # 18 pages wanted
        f = fetch(cache, longest)
        assert f is not None and not f.at_once and f.adopted == 4
        assert steps == ["exists", "get"]
        _cycle(cache)  # lookups in flight together hold at most half of the free pages
        free = tier.side.alloc.free_pages
        want = free // 4
        gate, exists = threading.Event(), lazy.exists
        lazy.exists = lambda *args: gate.wait(30) and exists(*args)  # type: ignore[method-assign]
        fs = [tier.prefetch(tokens_of(want * PS, 40 + i).tobytes(), None, 0) for i in range(3)]
        assert [f is not None and f.at_once for f in fs] == [True, True, False]
        assert tier.side.alloc.free_pages == free - 2 * want
        gate.set()
        tier.drain()
        lazy.exists = exists  # type: ignore[method-assign]
        cache.check_integrity()
    finally:
        tier.drain()
        cache.close()
