"""A real transformer served through the daemon: cached KV gives the logits of a full recompute."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest

from tests.optional import require_module

require_module("transformers", what="the reference engine (tests/test_engine.py)")

from hicache.client import HiCacheClient  # noqa: E402
from scripts.ref_engine import ReferenceEngine  # noqa: E402
from tests.daemon_helpers import start_daemon, stop_daemon  # noqa: E402

SHAPE = [
    "--num-layers",
    "2",
    "--num-kv-heads",
    "2",
    "--head-dim",
    "8",
    "--dtype",
    "float32",
    "--device-tokens",
    "512",
    "--host-tokens",
    "2048",
    "--load-back-threshold",
    "1",
]
TOL = 1e-5


def check(engine: ReferenceEngine, tokens: np.ndarray):
    served = engine.serve(tokens)
    want = engine.recompute(tokens)[served.computed_from :]
    assert (served.logits - want).abs().max().item() < TOL
    return served


@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_cached_prefix_logits_equal_a_full_recompute(tmp_path, ps, policy):
    ep = f"ipc://{tmp_path}/e.sock"
    proc = start_daemon(ep, *SHAPE, "--page-size", str(ps), "--write-policy", policy)
    try:
        rng = np.random.default_rng(ps)
        base = rng.integers(0, 512, 64, dtype=np.int32)
        p1 = np.concatenate([base, rng.integers(0, 512, 40, dtype=np.int32)])
        p2 = np.concatenate([base, rng.integers(0, 512, 40, dtype=np.int32)])
        with HiCacheClient(ep, name="engine", admin=True) as hc:
            engine = ReferenceEngine(hc)
            assert check(engine, p1).computed_from == 0
            served = check(engine, p2)  # device hit on the shared base
            assert served.device_hit == 64 and served.host_hit == 0
            if policy == "write_through_selective":  # backed up from the second hit on
                check(engine, p1)
                check(engine, p2)
            hc.evict(device_tokens=1 << 20)  # forced: every unlocked prefix moves to the host
            engine.pools.device.buffer.fill_(0x7F)  # freed pages keep old KV: poison them
            served = check(engine, p1)  # host hit: loaded back
            assert served.device_hit == 0 and served.host_hit == len(p1) // ps * ps
            p3 = np.concatenate([p2, rng.integers(0, 512, 10, dtype=np.int32)])
            served = check(engine, p3)  # mixed: base on the device again, p2's tail on the host
            assert served.device_hit == 64 and served.host_hit > 0
            assert hc.stats(check=True)["integrity"] == "ok"
    finally:
        stop_daemon(proc)


def compute_prefix(endpoint: str, tokens: list[int]) -> None:
    with HiCacheClient(endpoint, name="engine-a") as hc:
        ReferenceEngine(hc).serve(np.array(tokens, dtype=np.int32))


def test_two_engine_processes_share_one_daemon(tmp_path):
    ep = f"ipc://{tmp_path}/two.sock"
    proc = start_daemon(ep, *SHAPE, "--page-size", "4")
    try:
        rng = np.random.default_rng(7)
        prefix = rng.integers(0, 512, 96, dtype=np.int32)
        with mp.get_context("spawn").Pool(1) as pool:  # engine A computes the prefix
            pool.apply(compute_prefix, (ep, prefix.tolist()))
        with HiCacheClient(ep, name="engine-b") as hc:  # engine B reuses it
            tokens = np.concatenate([prefix, rng.integers(0, 512, 20, dtype=np.int32)])
            served = check(ReferenceEngine(hc), tokens)
            assert served.device_hit == 96 and served.computed_from == 96
    finally:
        stop_daemon(proc)
