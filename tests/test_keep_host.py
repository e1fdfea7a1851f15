"""Restarts that keep the host tier (daemon/keep/snapshot.py): after a clean stop, or a crash with
periodic snapshots, the next daemon on the endpoint adopts the host KV that still verifies and
serves the same bytes; a daemon of another shape starts cold; nothing is left behind."""

from __future__ import annotations

import os
import signal

import msgpack
import numpy as np
import pytest
import torch

from hicache.client import HiCacheClient
from hicache.daemon.keep import HostKeeper, snapshot_path
from tests.daemon_helpers import (
    kv_value,
    start_daemon,
    stop_daemon,
    wait_until,
    write_sequence,
)

KEEP = ("--keep-host", "true")


def backed_up(ep: str, seqs: list[list[int]]) -> None:
    for tokens in seqs:
        write_sequence(ep, tokens)
    with HiCacheClient(ep, name="warm") as hc:
        for tokens in seqs:
            hc.match_prefix(tokens, lock=False)  # a hit: write_through backs it up
        total = sum(len(t) for t in seqs)
        wait_until(lambda: hc.stats()["backup_tokens"] >= total, what="backups")


def served_from_host(ep: str, tokens: list[int]) -> None:
    """The prefix is on the host only, and loads back as the bytes written for it."""
    with HiCacheClient(ep, name="reader") as hc:
        pools = hc.attach()
        m = hc.match_prefix(tokens)
        assert (m.device_hit_length, m.host_hit_length) == (0, len(tokens))
        slots = hc.load_back(m)
        value = kv_value(np.array(tokens))
        for layer in range(len(pools.k_buffer)):
            got = pools.k_buffer[layer][slots][:, 0, 0]
            assert torch.equal(got, value + layer), "wrong KV after a restart"
        hc.release(m)


def shm_of(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if f"-{pid}-" in n]


def test_a_clean_restart_keeps_the_host_tier(tmp_path):
    ep = f"ipc://{tmp_path}/k.sock"
    seqs = [list(range(1, 41)), list(range(500, 532))]
    first = start_daemon(ep, *KEEP)
    try:
        backed_up(ep, seqs)
    finally:
        out = stop_daemon(first)
    assert "host tier kept" in out
    assert os.path.exists(f"{tmp_path}/k.sock.snapshot")
    assert sorted(n.rsplit("-", 1)[1] for n in shm_of(first.pid)) == ["host", "keep"]
    second = start_daemon(ep, *KEEP)
    try:
        assert "adopted 72 host tokens" in second.output()
        assert not shm_of(first.pid)  # renamed to the new daemon's, marker gone
        for tokens in seqs:
            served_from_host(ep, tokens)
    finally:
        stop_daemon(second)
    assert sorted(n.rsplit("-", 1)[1] for n in shm_of(second.pid)) == ["host", "keep"]
    third = start_daemon(ep, *KEEP, "--page-size", "8")  # another shape: starts cold
    try:
        assert "starting cold" in third.output()
        assert not shm_of(second.pid)  # what the endpoint's last daemon kept is freed
        with HiCacheClient(ep, name="x") as hc:
            assert hc.match_prefix(seqs[0], lock=False).host_hit_length == 0
        backed_up(ep, [seqs[0]])
    finally:
        stop_daemon(third)
    os.unlink(f"{tmp_path}/k.sock.snapshot")  # a kept pool whose snapshot went is freed by
    fourth = start_daemon(f"ipc://{tmp_path}/other.sock", *KEEP)  # the next daemon's clean-up
    stop_daemon(fourth)  # and a daemon whose host tier is empty keeps nothing
    assert not os.path.exists(f"{tmp_path}/other.sock.snapshot")
    assert not shm_of(third.pid) and not shm_of(fourth.pid)


@pytest.mark.parametrize("verify", ["true", "false"])
def test_after_a_crash_the_last_periodic_snapshot_is_adopted(tmp_path, verify):
    """With verify_pages the snapshot uses the maintained checksums; without, the keeper sums
    the pages on its own thread. Either way a SIGKILL keeps what the last snapshot names."""
    ep = f"ipc://{tmp_path}/c.sock"
    seqs = [list(range(1, 33))]
    flags = (*KEEP, "--verify-pages", verify, "--snapshot-seconds", "0.2")
    first = start_daemon(ep, *flags)
    try:
        backed_up(ep, seqs)
        snap = f"{tmp_path}/c.sock.snapshot"
        mtime = os.stat(snap).st_mtime if os.path.exists(snap) else 0
        wait_until(lambda: os.path.exists(snap) and os.stat(snap).st_mtime > mtime,
                   what="a snapshot after the backups")  # fmt: skip
        first.send_signal(signal.SIGKILL)
        first.wait()
    finally:
        stop_daemon(first)
    second = start_daemon(ep, *flags)
    try:
        assert "adopted 32 host tokens" in second.output()
        served_from_host(ep, seqs[0])
    finally:
        stop_daemon(second)
    HostKeeper(ep, "test", 0).discard_previous()  # what the second kept goes with the test
    assert not shm_of(second.pid)


def test_a_daemon_that_keeps_nothing_frees_what_its_endpoint_kept(tmp_path):
    ep = f"ipc://{tmp_path}/n.sock"
    first = start_daemon(ep, *KEEP)
    try:
        backed_up(ep, [list(range(1, 17))])
    finally:
        stop_daemon(first)
    assert sorted(n.rsplit("-", 1)[1] for n in shm_of(first.pid)) == ["host", "keep"]
    second = start_daemon(ep, "--keep-host", "false")
    try:
        assert not shm_of(first.pid)  # freed at once, not left for a day
        assert not os.path.exists(f"{tmp_path}/n.sock.snapshot")
    finally:
        stop_daemon(second)


def kept_tier(ep: str, seqs: list[list[int]]) -> str:
    """A daemon that backed ``seqs`` up and stopped, keeping its host tier; returns its host
    segment's name."""
    first = start_daemon(ep, *KEEP)
    try:
        backed_up(ep, seqs)
    finally:
        stop_daemon(first)
    (host,) = [n for n in shm_of(first.pid) if n.endswith("-host")]
    return host


def tamper_fifo(snap: str, host: str) -> None:
    os.unlink(snap)
    os.mkfifo(snap, 0o600)  # a reader that opened it without O_NONBLOCK would wait forever


def tamper_mode(snap: str, host: str) -> None:
    os.chmod(snap, 0o644)  # not a file our daemons write


def tamper_nodes(snap: str, host: str) -> None:
    with open(snap, "rb") as fh:
        data = msgpack.unpackb(fh.read())
    data["nodes"] = [[-1, None, 3, "x", 7], "junk"]  # well-formed file, entries that are not
    with open(snap, "wb") as fh:
        fh.write(msgpack.packb(data))


def tamper_size(snap: str, host: str) -> None:
    os.truncate(f"/dev/shm/{host}", 4096)


@pytest.mark.parametrize("tamper", [tamper_fifo, tamper_mode, tamper_nodes, tamper_size])
def test_a_snapshot_or_segment_not_as_we_left_it_starts_cold(tmp_path, tamper):
    """Whatever happened to the kept tier, the next daemon starts (cold, or adopting
    nothing), serves, and leaves nothing behind."""
    ep = f"ipc://{tmp_path}/t.sock"
    seq = list(range(1, 33))
    host = kept_tier(ep, [seq])
    snap = f"{tmp_path}/t.sock.snapshot"
    tamper(snap, host)
    second = start_daemon(ep, *KEEP)
    try:
        out = second.output()
        assert "adopted 32" not in out
        assert "starting cold" in out or "adopted 0 host tokens" in out, out
        with HiCacheClient(ep, name="x") as hc:
            assert hc.match_prefix(seq, lock=False).host_hit_length == 0
        write_sequence(ep, seq)  # and it serves
    finally:
        stop_daemon(second)
    assert host not in os.listdir("/dev/shm")
    HostKeeper(ep, "test", 0).discard_previous()
    assert not shm_of(second.pid)
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_a_running_daemons_host_pool_is_never_adopted(tmp_path):
    """A snapshot naming a live daemon's segment (a planted file, or endpoints whose names
    once mapped to one snapshot path) is refused: the live daemon keeps serving its own KV."""
    assert snapshot_path("ipc://@hicache.a") != snapshot_path("ipc://@hicache_a")
    ep_a, ep_b = f"ipc://{tmp_path}/a.sock", f"ipc://{tmp_path}/b.sock"
    seq = list(range(1, 33))
    a = start_daemon(ep_a, *KEEP, "--snapshot-seconds", "0.2")
    b = None
    try:
        backed_up(ep_a, [seq])
        snap_a = f"{tmp_path}/a.sock.snapshot"
        wait_until(lambda: os.path.exists(snap_a), what="a periodic snapshot")
        os.link(snap_a, f"{tmp_path}/b.sock.snapshot")  # b's snapshot names a's live pool
        b = start_daemon(ep_b, *KEEP)
        assert "host tokens from the last daemon" not in b.output()
        assert "is running): starting cold" in b.output()
        with HiCacheClient(ep_a, name="reader") as hc:
            pools = hc.attach()
            m = hc.match_prefix(seq)
            assert m.device_hit_length + m.host_hit_length == len(seq)
            slots = torch.cat([m.device_indices, hc.load_back(m) if m.host_hit_length else
                               m.device_indices[:0]])  # fmt: skip
            assert torch.equal(pools.k_buffer[0][slots][:, 0, 0], kv_value(np.array(seq)))
            hc.release(m)
    finally:
        stop_daemon(a)
        if b is not None:
            stop_daemon(b)
    for ep in (ep_a, ep_b):
        HostKeeper(ep, "test", 0).discard_previous()
    assert not shm_of(a.pid) and not shm_of(b.pid)


def test_a_crash_right_after_an_adopting_start_keeps_the_tier(tmp_path):
    """The adopting daemon writes down what it adopted at once: killed before its first
    periodic snapshot, the next daemon still adopts it. A temporary file a killed writer
    left is removed."""
    ep = f"ipc://{tmp_path}/r.sock"
    seq = list(range(1, 33))
    kept_tier(ep, [seq])
    second = start_daemon(ep, *KEEP, "--snapshot-seconds", "3600")
    try:
        assert "adopted 32 host tokens" in second.output()
        second.send_signal(signal.SIGKILL)
        second.wait()
    finally:
        stop_daemon(second)
    stale = f"{tmp_path}/r.sock.snapshot.x1y2z3.tmp"
    with open(stale, "wb") as fh:
        fh.write(b"half a snapshot")
    third = start_daemon(ep, *KEEP)
    try:
        assert "adopted 32 host tokens" in third.output()
        assert not os.path.exists(stale)
        served_from_host(ep, seq)
    finally:
        stop_daemon(third)
    HostKeeper(ep, "test", 0).discard_previous()
    assert not shm_of(second.pid) and not shm_of(third.pid)


def test_a_daemon_of_another_model_starts_cold(tmp_path):
    """The third tier's model and shard say what the KV means: another revision does not
    adopt the last one's host KV, though its shape is the same."""
    ep = f"ipc://{tmp_path}/m.sock"
    seq = list(range(1, 33))
    l3 = ("--l3", f"memory://{tmp_path.name}")
    first = start_daemon(ep, *KEEP, *l3, "--l3-model", "m@rev1")
    try:
        backed_up(ep, [seq])
    finally:
        stop_daemon(first)
    second = start_daemon(ep, *KEEP, *l3, "--l3-model", "m@rev2")
    try:
        assert "another host pool or model" in second.output()
        with HiCacheClient(ep, name="x") as hc:
            assert hc.match_prefix(seq, lock=False).host_hit_length == 0
    finally:
        stop_daemon(second)
    HostKeeper(ep, "test", 0).discard_previous()
    assert not shm_of(first.pid) and not shm_of(second.pid)
