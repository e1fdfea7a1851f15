"""How much of a pool the kernel backs with huge pages: read from smaps for the pool's own
range, reported per tier, and said at start to a daemon with a disk tier."""

from __future__ import annotations

import mmap
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from hicache.client import HiCacheClient
from hicache.daemon.launch import start_daemon, stop_daemon
from hicache.memory import SharedMemoryBacking, huge_page_bytes
from tests.daemon_helpers import SMALL

MIB = 1 << 20
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _smaps(tmp_path: Path, mappings: list[tuple[int, int, dict[str, int]]]) -> str:
    lines = []
    for start, stop, fields in mappings:
        lines.append(f"{start:x}-{stop:x} rw-s 00000000 00:19 42 /dev/shm/pool\n")
        lines.append(f"Size: {(stop - start) // 1024} kB\n")
        for name in ("AnonHugePages", "ShmemPmdMapped", "FilePmdMapped"):
            lines.append(f"{name}: {fields.get(name, 0)} kB\n")
        lines.append("VmFlags: rd wr sh mr mw me ms\n")
    path = tmp_path / "smaps"
    path.write_text("".join(lines))
    return str(path)


def test_only_the_mappings_over_the_range_count_and_never_more_than_it(tmp_path):
    a, b = 0x7F0000000000, 0x7F0000800000  # two 8 MiB mappings, one after the other
    smaps = _smaps(tmp_path, [
        (a, a + 8 * MIB, {"ShmemPmdMapped": 4096}),
        (b, b + 8 * MIB, {"AnonHugePages": 8192, "FilePmdMapped": 2048}),
    ])  # fmt: skip
    assert huge_page_bytes(a, 8 * MIB, smaps) == 4 * MIB
    assert huge_page_bytes(b, 8 * MIB, smaps) == 8 * MIB  # (10 MiB said: clamped to the range)
    assert huge_page_bytes(a + 4 * MIB, 8 * MIB, smaps) == 8 * MIB  # (both overlap: 14, clamped)
    assert huge_page_bytes(b + 8 * MIB, MIB, smaps) == 0  # (past both)
    assert huge_page_bytes(a, 0, smaps) == 0
    assert huge_page_bytes(a, MIB, str(tmp_path / "missing")) == 0


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here"
)
def test_private_memory_counts_its_huge_pages_and_none_where_they_are_refused():
    def mapped(advice: int) -> tuple[mmap.mmap, int]:
        mm = mmap.mmap(-1, 8 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mm.madvise(advice)
        for at in range(0, len(mm), 4096):
            mm[at] = 1
        return mm, np.frombuffer(mm, np.uint8).ctypes.data

    refused, at = mapped(mmap.MADV_NOHUGEPAGE)
    try:
        assert huge_page_bytes(at, 8 * MIB) == 0
    finally:
        refused.close()
    wanted, at = mapped(mmap.MADV_HUGEPAGE)
    try:
        got = huge_page_bytes(at, 8 * MIB)
        assert got % (2 * MIB) == 0 and got <= 8 * MIB
        if not got:
            pytest.skip("the kernel found no free huge page (fragmented memory)")
    finally:
        wanted.close()


@pytest.fixture
def tmpfs(tmp_path):
    """A private tmpfs mounted with huge pages where this user may mount (root), and one
    without; unmounted after."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    made = []
    try:
        for name, huge in (("huge", "within_size"), ("small", "never")):
            where = tmp_path / name
            where.mkdir()
            done = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size=64m,huge={huge}", "tmpfs", str(where)],
                capture_output=True,
                text=True,
            )
            if done.returncode:
                pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
            made.append(where)
        yield made[0], made[1]
    finally:
        for where in made:
            subprocess.run(["umount", str(where)], check=True)


def test_a_shared_pool_on_a_huge_tmpfs_is_wholly_on_huge_pages_and_not_otherwise(tmpfs):
    huge, small = tmpfs
    for where, expected in ((huge, 16 * MIB), (small, 0)):
        pool = SharedMemoryBacking("pool", directory=str(where))
        try:
            pool.allocate(16 * MIB, "test pool")
            if where == huge and pool.huge_page_bytes() == 0:
                pytest.skip("the kernel found no free huge page (fragmented memory)")
            assert pool.huge_page_bytes() == expected
        finally:
            pool.close()
    assert not list(huge.iterdir()) and not list(small.iterdir())


def test_the_daemon_reports_its_pools_and_says_at_start_whether_disk_io_gets_huge_pages(
    tmp_path,
):
    endpoint = f"ipc://{tmp_path}/d.sock"
    disk = ["--disk", str(tmp_path / "disk"), "--disk-bytes", "64MiB", "--l3-model", "m"]
    proc = start_daemon(endpoint, *SMALL, "--keep-host", "false", *disk)
    try:
        with HiCacheClient(endpoint, name="t") as hc:
            stats = hc.stats()
    finally:
        said = stop_daemon(proc)
    pool = stats["host_capacity_tokens"] * stats["token_bytes"]
    assert 0 <= stats["device_huge_page_bytes"]
    assert 0 <= stats["host_huge_page_bytes"] <= pool
    if stats["host_huge_page_bytes"] * 2 >= pool:
        assert "disk: the pool is on huge pages" in said
    else:
        assert "is on 4 KiB pages" in said and "huge=within_size" in said


def test_a_daemon_for_engines_names_its_one_pool_the_host_tier(tmp_path):
    endpoint = f"ipc://{tmp_path}/d.sock"
    proc = start_daemon(endpoint, "--device-tier", "engine", "--host-bytes", "4MiB")
    try:
        with HiCacheClient(endpoint, name="t") as hc:
            from tests.test_engine_tier import layout

            hc.register_layout(layout())
            stats = hc.stats()
    finally:
        stop_daemon(proc)
    assert "host_huge_page_bytes" in stats and "device_huge_page_bytes" not in stats
