"""Files another user plants where the daemon keeps its own (/dev/shm, its socket's folder) are
never written through, never waited on, never taken for the daemon's own, and never stop it.

Unit cases run in a folder of the test's own (the functions take the folder); the ones that
need a file of another uid run as root (as CI does) and are skipped otherwise.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import stat
import threading

import pytest

from hicache.daemon.keep import (
    HOST,
    KEEP,
    LOCK,
    instance_alive,
    kept_for,
    mark_kept,
    remove_stale,
    segment_name,
)
from hicache.daemon.transport import EndpointClaim, EndpointError
from tests.daemon_helpers import start_daemon, stop_daemon

OTHER = 4242
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="plants another uid's files (root)")


def dead_instance(folder, pools=("device", HOST)) -> tuple[str, str]:
    """Segments of a daemon that died (no lock): (its instance, its token)."""
    token = secrets.token_hex(16)
    for pool in pools:
        (folder / segment_name(pool, token, pid=999)).write_bytes(b"x")
    return f"999-{token}", token


def bounded(call, *args):
    """``call(*args)`` in a thread that must end within 10 s (a FIFO opened for reading would
    block forever)."""
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("v", call(*args)), daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), f"{call.__name__} blocked"
    return out["v"]


def test_a_keep_marker_planted_as_a_link_is_replaced_never_written_through(tmp_path):
    """s8: root's daemon truncated a root file through a planted marker link."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    victim.chmod(0o600)
    token = secrets.token_hex(16)
    marker = tmp_path / segment_name(KEEP, token)
    marker.symlink_to(victim)
    assert mark_kept(token, "/run/snap", str(tmp_path)) == str(marker)
    assert victim.read_text() == "precious"
    assert stat.S_ISREG(os.lstat(marker).st_mode)
    assert marker.read_text().splitlines()[0] == "/run/snap"
    assert stat.S_IMODE(os.lstat(marker).st_mode) == 0o600
    assert not list(tmp_path.glob("*.tmp"))


def test_a_fifo_planted_as_a_keep_marker_never_hangs_a_cleanup(tmp_path):
    """s15: a FIFO marker hung the start forever while it held the endpoint lock."""
    instance, token = dead_instance(tmp_path)
    os.mkfifo(tmp_path / f"hicache-{os.getuid()}-{instance}-{KEEP}", 0o600)
    assert bounded(kept_for, instance, str(tmp_path)) is None
    removed = bounded(remove_stale, str(tmp_path))
    assert sorted(removed) == sorted(segment_name(p, token, 999) for p in ("device", HOST))


def test_a_fifo_planted_as_a_keep_marker_never_hangs_a_daemon_start(tmp_path):
    token = secrets.token_hex(16)
    host = f"/dev/shm/{segment_name(HOST, token, pid=999)}"
    fifo = f"/dev/shm/{segment_name(KEEP, token, pid=999)}"
    with open(host, "wb") as fh:
        fh.write(b"x")
    os.mkfifo(fifo, 0o600)
    try:
        proc = start_daemon(f"ipc://{tmp_path}/d.sock")  # (returns once ready, or raises)
        stop_daemon(proc)
        assert not os.path.exists(host)  # a dead daemon's: removed; the FIFO is not ours
    finally:
        for path in (host, fifo):
            if os.path.lexists(path):
                os.unlink(path)


@root_only
def test_files_of_another_user_under_our_names_are_left_alone(tmp_path):
    """s6: a file named like ours but owned by another user made the start fail (EPERM)."""
    planted = f"/dev/shm/{segment_name(HOST, secrets.token_hex(16), pid=999)}"
    with open(planted, "wb") as fh:
        fh.write(b"x")
    os.chown(planted, OTHER, OTHER)
    try:
        assert planted.rsplit("/", 1)[1] not in remove_stale()
        proc = start_daemon(f"ipc://{tmp_path}/d.sock")
        stop_daemon(proc)
        assert os.lstat(planted).st_uid == OTHER  # untouched
    finally:
        os.unlink(planted)


@root_only
def test_a_lock_another_user_holds_keeps_none_of_our_segments_alive(tmp_path):
    """s15: a fake -lock with a held flock kept a pool-sized segment alive."""
    instance, token = dead_instance(tmp_path)
    lock = tmp_path / segment_name(LOCK, token, pid=999)
    lock.write_bytes(b"")
    os.chown(lock, OTHER, OTHER)
    fd = os.open(lock, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert not instance_alive(instance, str(tmp_path))
        removed = remove_stale(str(tmp_path))
        assert segment_name(HOST, token, 999) in removed
        assert segment_name("device", token, 999) in removed
    finally:
        os.close(fd)


def test_a_link_planted_as_the_endpoint_lock_is_refused(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "d.sock.lock").symlink_to(victim)
    with pytest.raises(EndpointError, match=r"d\.sock\.lock"):
        EndpointClaim(f"ipc://{tmp_path}/d.sock")
    assert victim.read_text() == "precious"
    (tmp_path / "d.sock.lock").unlink()
    claim = EndpointClaim(f"ipc://{tmp_path}/d.sock")
    claim.close()
