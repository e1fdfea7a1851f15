"""Restarts that keep the host tier (daemon/snapshot.py): after a clean stop, or a crash with
periodic snapshots, the next daemon on the endpoint adopts the host KV that still verifies and
serves the same bytes; a daemon of another shape starts cold; nothing is left behind."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch

from hicache.client import HiCacheClient
from hicache.daemon.snapshot import HostKeeper
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
    finally:
        stop_daemon(third)
    os.unlink(f"{tmp_path}/k.sock.snapshot")  # a kept pool whose snapshot went is freed by
    fourth = start_daemon(f"ipc://{tmp_path}/other.sock")  # the next daemon's clean-up
    stop_daemon(fourth)
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
