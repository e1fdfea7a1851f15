"""The disk latency benchmark measures what it says: each disk hit is read from the disk (not
the host pool, which it evicts), under both kinds of daemon."""

from __future__ import annotations

from scripts import disk_latency


def test_each_disk_hit_is_read_from_the_disk_and_each_host_hit_is_whole(tmp_path):
    out = disk_latency.run(2, tmp_path, shapes=("64KiB",))
    assert set(out) == {f"64KiB_{kind}_{n}" for kind in ("own", "engine") for n in (1, 64)}
    for row in out.values():
        assert row["pairs"] == 2 and row["host_ms"] > 0 and row["disk_ms"] > 0
    assert not list(tmp_path.iterdir())  # (each daemon's folder went with it)
