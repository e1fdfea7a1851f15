"""The live view: `hicache top` on a pseudo-terminal, `hicache stats --watch`, `hicache tree`'s
shape, and the interval arithmetic behind them."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys

import numpy as np

from hicache.client import HiCacheClient
from hicache.client.top import CLEAR, Rates, render_shape, render_top
from hicache.observe import tree_shape
from tests.conftest import make_cache, put
from tests.daemon_helpers import start_daemon, stop_daemon

CLI = [sys.executable, "-m", "hicache.client.cli"]


def test_rates_are_the_interval_not_the_lifetime():
    before = {"hit_device_tokens": 100, "hit_host_tokens": 0, "miss_tokens": 100,
              "evicted_device_tokens": 10, "l3": {"read_bytes": 0}}  # fmt: skip
    after = {"hit_device_tokens": 130, "hit_host_tokens": 60, "miss_tokens": 110,
             "evicted_device_tokens": 30, "l3": {"read_bytes": 4096}}  # fmt: skip
    r = Rates.between(before, after, 2.0)
    assert (r.hit_ratio_device, r.hit_ratio_host, r.hit_ratio) == (0.3, 0.6, 0.9)
    assert r.queried_tokens_per_s == 50 and r.evicted_device_tokens_per_s == 10
    assert r.l3_read_bytes_per_s == 2048
    # every counter of the figures table that moved, in the table's order, and only those
    assert [(n, u) for n, u, _ in r.moving] == [
        ("evicted_device_tokens", "tokens"), ("hit_device_tokens", "tokens"),
        ("hit_host_tokens", "tokens"), ("miss_tokens", "tokens"),
        ("l3.read_bytes", "bytes")]  # fmt: skip
    quiet = Rates.between(after, after, 1.0)
    assert quiet.hit_ratio is None and quiet.queried_tokens_per_s == 0
    screen = render_top(after, r)
    assert "interval 2.0 s" in screen
    assert "0.300    0.433" in screen  # device: this interval, and overall (130 / 300)
    assert "l3.read_bytes" in screen and "2.0KiB" in screen and "miss_tokens" in screen


def test_tree_shape_ranks_shared_prefixes_by_what_hangs_below():
    cache = make_cache(page_size=4, device_tokens=512, host_tokens=1024)
    system_a, system_b = list(range(1, 33)), list(range(100, 108))
    for i in range(4):
        put(cache, system_a + [200 + i] * 8)  # 4 conversations under a 32-token prompt
    for i in range(2):
        put(cache, system_b + [300 + i] * 4)
    put(cache, [7] * 8, namespace="tenant")
    shape = tree_shape(cache, top=1)
    default, tenant = shape["namespaces"]
    assert (default["namespace"], tenant["namespace"]) == ("", "'tenant'")
    assert "# Namespace (default)" in render_shape(shape) and "None" not in render_shape(shape)
    assert default["tokens"] == 32 + 4 * 8 + 8 + 2 * 4 and tenant["tokens"] == 8
    [first] = default["prefixes"]  # top=1: the heaviest only
    assert (first["prefix_tokens"], first["subtree_tokens"], first["branches"]) == (32, 32, 4)
    assert first["head"] == system_a[:8] and shape["truncated"]
    assert tree_shape(cache, top=5)["namespaces"][0]["prefixes"][1]["prefix_tokens"] == 8


def test_top_on_a_terminal_stats_watch_and_tree(tmp_path):
    ep = f"ipc://{tmp_path}/top.sock"
    proc = start_daemon(ep)
    try:
        with HiCacheClient(ep, name="chat-engine") as hc:
            for i in range(6):
                tokens = np.array(list(range(1, 41)) + [100 + i] * 8, np.int32)
                m = hc.match_prefix(tokens)
                hc.insert(
                    tokens, np.concatenate([m.device_indices, hc.alloc(48 - len(m.device_indices))])
                )
                hc.release(m)
            leader, follower = pty.openpty()  # `hicache top` sees a terminal
            top = subprocess.run([*CLI, "--endpoint", ep, "top", "-n", "2", "-i", "0.1"],
                                 stdout=follower, stderr=subprocess.PIPE, timeout=60)  # fmt: skip
            os.close(follower)
            screen = b""
            while True:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # the other end closed
                    break
                if not chunk:
                    break
                screen += chunk
            os.close(leader)
            text = screen.decode()
            assert top.returncode == 0, top.stderr
            assert text.count(CLEAR) == 2  # one redraw per sample
            last = text.split(CLEAR)[-1]
            assert "interval" in last and "chat-engine" in last
            # 6 prompts of 48: 5 * 40 device hits of 288 asked
            assert f"{200 / 288:5.3f}" in last
            argv = [*CLI, "--endpoint", ep, "stats", "--watch", "0.1", "-n", "3", "--json"]
            watch = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            samples = [json.loads(line) for line in watch.stdout.splitlines()]
            assert len(samples) == 3 and all(s["hit_device_tokens"] == 200 for s in samples)
            tree = subprocess.run([*CLI, "--endpoint", ep, "tree", "--json"],
                                  capture_output=True, text=True, timeout=60)  # fmt: skip
            [ns] = json.loads(tree.stdout)["namespaces"]
            assert ns["prefixes"][0]["prefix_tokens"] == 40
            assert ns["prefixes"][0]["branches"] == 6
    finally:
        stop_daemon(proc)
