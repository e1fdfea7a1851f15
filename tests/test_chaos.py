"""The chaos harness's short run (scripts/chaos.py --short), and the defect it found: a load
back whose head another engine loaded meanwhile answered only the part it copied, which the
engine read as the head (wrong KV)."""

from __future__ import annotations

import numpy as np
import torch

from hicache.client import HiCacheClient
from tests.daemon_helpers import kv_value, start_daemon, stop_daemon, wait_until, write_sequence


def test_a_load_whose_head_another_engine_loaded_answers_the_whole_host_part(tmp_path):
    ep = f"ipc://{tmp_path}/race.sock"
    proc = start_daemon(ep)
    try:
        system = list(range(1, 49))
        prompt = system + list(range(900, 920))
        write_sequence(ep, system)  # the head, then the whole prompt: two nodes
        write_sequence(ep, prompt)
        with HiCacheClient(ep, name="a") as a, HiCacheClient(ep, name="b") as b:
            a.match_prefix(prompt, lock=False)
            wait_until(lambda: a.stats()["backup_tokens"] >= 68, what="backups")
            with HiCacheClient(ep, name="admin", admin=True) as admin:
                admin.evict(device_tokens=10**6)
            m = a.match_prefix(prompt)
            assert (m.device_hit_length, m.host_hit_length) == (0, 68)
            head = b.match_prefix(system)  # engine B loads the head first
            assert b.load_back(head) is not None
            slots = a.load_back(m)  # A's load copies only the tail now
            assert len(slots) == 68
            pools = a.attach()
            value = kv_value(np.array(prompt))
            for layer in range(len(pools.k_buffer)):
                assert torch.equal(pools.k_buffer[layer][slots][:, 0, 0], value + layer)
            a.release(m)
            b.release(head)
    finally:
        stop_daemon(proc)


def test_the_short_chaos_run_finds_nothing_wrong():
    from scripts import chaos

    report = chaos.main(["--short"])
    assert report["kills"] >= 40 and report["fuzzed_requests"] >= 20_000, report
    assert report["daemon_restarts"] == 1 and report["stalls"] >= 1, report
    assert report["host_tokens_adopted"][0] > 0, report  # a SIGKILL kept the host tier
    for key in ("integrity_failures", "leaked_pages", "leaked_locks", "wrong_bytes",
                "internal_errors", "sessions_left"):  # fmt: skip
        assert report[key] == 0, (key, report)
    assert report["values_checked"] > 1000 and report["integrity_checks"] >= 10
    assert report["rss_growth_ratio"] < 1.5
