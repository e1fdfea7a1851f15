"""A stopped daemon's kept host pool comes back within its grace time without another daemon,
``hicache kept`` lists and frees what is kept, and a daemon that ends without keeping (SIGKILL
included) leaves nothing in /dev/shm (daemon/keep/reaper.py, hicache/memory/kept.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from hicache.client import HiCacheClient
from tests.daemon_helpers import start_daemon, stop_daemon, wait_until, write_sequence

CLI = [sys.executable, "-m", "hicache.client.cli"]


def shm_of(pid: int) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if f"-{os.getuid()}-{pid}-" in n)


def reapers() -> list[str]:
    out = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "hicache.daemon.keep.reaper" in line]


def kept(*args: str) -> dict:
    done = subprocess.run([*CLI, "kept", "--json", *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def warm(ep: str) -> None:
    """A prompt backed up to the host: something worth keeping."""
    write_sequence(ep, list(range(1, 41)))
    with HiCacheClient(ep, name="warm") as hc:
        hc.match_prefix(list(range(1, 41)), lock=False)  # the hit that backs it up
        wait_until(lambda: hc.stats()["backup_tokens"] >= 40, what="a backup")


def test_a_kept_pool_nobody_adopts_is_freed_after_its_grace_time(tmp_path):
    ep = f"ipc://{tmp_path}/k.sock"
    proc = start_daemon(ep, "--keep-host", "true", "--keep-host-seconds", "3")
    warm(ep)
    log = stop_daemon(proc)
    assert "kept for the next daemon on " + ep in log and " until " in log
    listed = [p for p in kept()["kept"] if p["endpoint"] == ep]
    assert len(listed) == 1 and listed[0]["bytes"] > 0 and listed[0]["left_s"] <= 3
    assert any(name.endswith("-host") for name in shm_of(proc.pid))
    wait_until(lambda: not shm_of(proc.pid), timeout=30, what="the kept pool freed")
    assert not [p for p in kept()["kept"] if p["endpoint"] == ep]
    assert not os.path.exists(f"{tmp_path}/k.sock.snapshot")
    wait_until(lambda: not [r for r in reapers() if str(proc.pid) in r], what="reaper gone")


def test_a_daemon_restarted_within_the_grace_time_adopts_the_pool(tmp_path):
    ep = f"ipc://{tmp_path}/k.sock"
    first = start_daemon(ep, "--keep-host", "true", "--keep-host-seconds", "60")
    warm(ep)
    stop_daemon(first)
    second = start_daemon(ep, "--keep-host", "true", "--keep-host-seconds", "2")
    try:
        with HiCacheClient(ep, name="reader") as hc:
            m = hc.match_prefix(list(range(1, 41)), lock=False)
            assert m.host_hit_length == 40  # adopted
        assert not shm_of(first.pid)  # renamed to the new daemon's, nothing else left
        wait_until(lambda: not [r for r in reapers() if str(first.pid) in r], what="reaper")
    finally:
        stop_daemon(second)  # (it keeps the pool again, for 2 s)
    wait_until(lambda: not shm_of(second.pid), timeout=30, what="the second one's pool freed")


def test_hicache_kept_frees_a_pool_at_once(tmp_path):
    ep = f"ipc://{tmp_path}/k.sock"
    proc = start_daemon(ep, "--keep-host", "true", "--keep-host-seconds", "3600")
    warm(ep)
    stop_daemon(proc)
    assert [p for p in kept()["kept"] if p["endpoint"] == ep]
    freed = kept("--free", ep)["freed"]
    assert [p["endpoint"] for p in freed] == [ep]
    assert not shm_of(proc.pid)
    wait_until(lambda: not [r for r in reapers() if str(proc.pid) in r], what="reaper gone")
    none = subprocess.run([*CLI, "kept", "--free", "ipc:///nowhere"], capture_output=True)
    assert none.returncode == 1  # nothing kept for that endpoint


def test_a_killed_daemon_leaves_nothing_once_its_grace_time_is_over(tmp_path):
    """SIGKILL: no clean-up ran in the daemon. Without keeping, its reaper removes its pools
    at once; keeping, once the grace time since its last snapshot is over."""
    for keep in ("false", "true"):
        ep = f"ipc://{tmp_path}/{keep}.sock"
        proc = start_daemon(ep, "--keep-host", keep, "--keep-host-seconds", "2")
        warm(ep)
        assert shm_of(proc.pid)
        # the kill lands while a keep marker is half written (under its temporary name)
        instance = shm_of(proc.pid)[0].rsplit("-", 1)[0]
        half = os.path.join("/dev/shm", f"{instance}-keep.deadbeef.tmp")
        os.close(os.open(half, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        wait_until(lambda pid=proc.pid: not shm_of(pid), timeout=30, what=f"keep={keep} freed")
        stop_daemon(proc)  # (the output thread, and a socket file left behind)


def test_a_crash_gives_back_at_once_what_cannot_be_adopted(tmp_path):
    """SIGKILL after a snapshot: the host pool and its marker wait for a successor, but the
    device pool, the progress table and the lock (nothing adopts them) go at once, long
    before the grace time is over."""
    ep = f"ipc://{tmp_path}/k.sock"
    proc = start_daemon(ep, "--keep-host", "true", "--keep-host-seconds", "3600",
                        "--snapshot-seconds", "0.2")  # fmt: skip
    warm(ep)
    snapshot = f"{tmp_path}/k.sock.snapshot"
    wait_until(lambda: os.path.exists(snapshot), what="a periodic snapshot")
    assert {n.rsplit("-", 1)[1] for n in shm_of(proc.pid)} >= {"device", "host", "lock", "keep"}
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    wait_until(lambda: {n.rsplit("-", 1)[1] for n in shm_of(proc.pid)} == {"host", "keep"},
               timeout=30, what="the device pool, progress table and lock freed")  # fmt: skip
    listed = [p for p in kept()["kept"] if p["endpoint"] == ep]
    assert len(listed) == 1 and listed[0]["left_s"] > 3000  # the host pool still waits
    assert [p["endpoint"] for p in kept("--free", ep)["freed"]] == [ep]
    assert not shm_of(proc.pid)
    wait_until(lambda: not [r for r in reapers() if str(proc.pid) in r], what="reaper gone")
    stop_daemon(proc)


def test_a_crash_before_the_first_snapshot_keeps_nothing(tmp_path):
    """No snapshot names the host pool, so nobody could adopt it: everything goes at once,
    and ``hicache kept`` never lists it."""
    ep = f"ipc://{tmp_path}/k.sock"
    proc = start_daemon(ep, "--keep-host", "true", "--keep-host-seconds", "3600",
                        "--snapshot-seconds", "3600")  # fmt: skip
    warm(ep)
    assert not os.path.exists(f"{tmp_path}/k.sock.snapshot")
    assert not [p for p in kept()["kept"] if p["endpoint"] == ep]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    wait_until(lambda: not shm_of(proc.pid), timeout=30, what="everything freed")
    assert not [p for p in kept()["kept"] if p["endpoint"] == ep]
    stop_daemon(proc)


def test_a_marker_whose_snapshot_is_gone_keeps_nothing(tmp_path):
    """The rule the reaper, ``hicache kept`` and the clean-ups share: a pool is kept only while
    the snapshot its marker names is there."""
    from hicache.daemon.keep import reap
    from hicache.memory import HOST, KEEP, own_name, write_marker

    dead = f"{os.getpid()}-{'c' * 32}"
    for pool in (HOST, "device", "progress"):
        (tmp_path / own_name(dead, pool)).write_bytes(b"x")
    write_marker(str(tmp_path / own_name(dead, KEEP)), str(tmp_path / "gone.snapshot"), 2.0)
    lock = tmp_path / "lock"
    lock.write_bytes(b"")
    assert reap(str(lock), dead, str(tmp_path)) == "nothing kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lock"]


def test_a_pool_whose_grace_ran_out_without_its_reaper_is_not_adopted(tmp_path):
    """Hostile review: the reaper killed, the grace time over: the next daemon starts cold
    (and frees the pool) instead of failing to start on a pool its clean-up removed."""
    ep = f"ipc://{tmp_path}/k.sock"
    first = start_daemon(ep, "--keep-host", "true", "--keep-host-seconds", "1")
    warm(ep)
    pattern = f"hicache.daemon.keep.reaper .* {first.pid}-"
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    assert found.split(), "the first daemon's reaper"
    for pid in found.split():
        os.kill(int(pid), signal.SIGKILL)
    wait_until(lambda: not [r for r in reapers() if f" {first.pid}-" in r], what="reaper killed")
    stop_daemon(first)
    listed = [p for p in kept()["kept"] if p["endpoint"] == ep]
    assert listed and any(n.endswith("-host") for n in shm_of(first.pid))
    over = time.time() + listed[0]["left_s"] + 0.2
    wait_until(lambda: time.time() > over, what="the grace time")  # (a deadline, not a race)
    assert any(n.endswith("-host") for n in shm_of(first.pid))  # nobody freed it
    second = start_daemon(ep, "--keep-host", "true", "--keep-host-seconds", "1")
    try:
        with HiCacheClient(ep, name="reader") as hc:
            assert hc.match_prefix(list(range(1, 41)), lock=False).host_hit_length == 0  # cold
    finally:
        log = stop_daemon(second)
    assert "grace time is over" in log, log
    assert not shm_of(first.pid)
    wait_until(lambda: not shm_of(second.pid), timeout=30, what="the second one's pool freed")


def test_a_marker_with_an_absurd_grace_is_not_a_kept_pool(tmp_path):
    from hicache.memory import read_marker, write_marker

    for grace in ("inf", "1e300", "nan", "-1", "86401"):
        path = str(tmp_path / f"m-{grace}")
        write_marker(path, "/x/snapshot", 1.0, "ipc:///x")
        text = open(path).read().replace("grace 1", f"grace {grace}")
        with open(path, "w") as fh:
            fh.write(text)
        assert read_marker(path) is None, grace
    write_marker(str(tmp_path / "ok"), "/x/snapshot", 86400.0, "ipc:///x")
    assert read_marker(str(tmp_path / "ok")).grace_s == 86400.0


def test_the_reaper_imports_nothing_from_the_daemons_working_folder(tmp_path, monkeypatch):
    """Hostile review: ``python -m`` put the working folder (anyone's, e.g. /tmp) first on the
    import path of the reaper: a planted hicache/ package ran as the daemon's user."""
    from hicache.daemon.keep import spawn

    planted = tmp_path / "hicache"
    planted.mkdir()
    ran = tmp_path / "ran"
    (planted / "__init__.py").write_text(f"open({str(ran)!r}, 'w').write('planted')\n")
    monkeypatch.chdir(tmp_path)
    proc = spawn(str(tmp_path / "no-such-lock"), f"{os.getpid()}-deadbeef")
    proc.wait(timeout=60)
    assert not ran.exists()


def test_the_reaper_removes_a_dead_instances_half_written_files(tmp_path):
    """In this process (the reaper's own process imports the installed package): what the
    daemon was writing under a temporary name when it died goes with its other files, and
    another instance's files stay."""
    from hicache.daemon.keep import reap
    from hicache.memory import HOST, KEEP, own_name

    dead, other = f"{os.getpid()}-{'a' * 32}", f"{os.getpid()}-{'b' * 32}"
    names = [own_name(dead, HOST), own_name(dead, KEEP) + ".0badf00d.tmp", own_name(other, HOST)]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    lock = tmp_path / "lock"
    lock.write_bytes(b"")  # nobody holds it: the daemon is dead
    assert reap(str(lock), dead, str(tmp_path)) == "nothing kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([names[2], "lock"])
