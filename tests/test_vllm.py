"""Real vLLM (the CPU build in CI) with HiCacheConnector: every engine runs in a process of its
own (tests/vllm_runner.py), started in a new session and killed with its workers at the end.

A tiny random Llama, greedy decoding: outputs must be bit-identical with KV from hicache, and
the hits must be what the prompt lengths say.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from tests.optional import require_module

require_module("vllm", what="real vLLM engines (tests/test_vllm.py)")

from hicache.client import HiCacheClient  # noqa: E402
from hicache.daemon.launch import start_daemon, stop_daemon  # noqa: E402
from hicache.memory import EngineLayout  # noqa: E402
from tests.daemon_helpers import wait_until  # noqa: E402
from tests.l3_servers import l3_settled, mooncake_master  # noqa: E402
from tests.vllm_runner import BLOCK, daemon_stats, make_model, prompts  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_TIMEOUT_S = 300
EXPECTED_CACHED = [(len(p) - 1) // BLOCK * BLOCK for p in prompts()]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("vllm") / "tiny-llama")
    make_model(folder)
    return folder


@pytest.fixture
def daemon(tmp_path):
    ep = f"ipc://{tmp_path}/h.sock"
    proc = start_daemon(ep, "--device-tier", "engine", "--host-bytes", "16MiB")
    try:
        yield ep, proc
    finally:
        stop_daemon(proc)


def run(scenario: str, **args) -> dict:
    """One engine process; its whole process group is killed whatever happens, and the files
    vLLM leaves in its temporary folder (IPC sockets, dist-init files) go with it."""
    tmp = tempfile.mkdtemp(prefix="hicache-vllm-")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.vllm_runner", scenario, json.dumps(args)],
        cwd=ROOT,
        env={**os.environ, "TMPDIR": tmp},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # stray vLLM workers too
        except ProcessLookupError:
            pass
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    results = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert results, f"{scenario} printed no result (exit {proc.returncode}):\n{err[-4000:]}"
    return json.loads(results[-1][len("RESULT ") :])


def same(a: list[dict], b: list[dict], tol: float = 0.0) -> bool:
    """Token ids equal; logprobs equal (or within ``tol``: another tensor-parallel size sums in
    another order)."""
    for x, y in zip(a, b, strict=True):
        if x["tokens"] != y["tokens"]:
            return False
        for lx, ly in zip(x["logprobs"], y["logprobs"], strict=True):
            if any(abs(p - q) > tol for p, q in zip(lx, ly, strict=True)):
                return False
    return True


def held(stats: dict) -> list:
    """Locks, and owned pages beyond an engine's reserve for its next stores (at most 1/64 of
    the pool), that sessions still hold: none once vLLM is idle."""
    reserve = stats["host_capacity_tokens"] // BLOCK // 64
    return [s for s in stats["sessions"] if s["locks"] or s["owned_pages"] > reserve]


def test_vllm_outputs_are_identical_with_kv_from_hicache(model, daemon):
    ep, proc = daemon
    plain = run("plain", model=model)["run"]
    r = run("main", model=model, endpoint=ep, daemon_pid=proc.pid)
    cold = r["cold"]
    assert same(cold, plain)  # the connector changes nothing of a cold run
    assert r["stats_after_cold"]["host_cached_tokens"] > 0  # stored (the engines' host tier)
    assert r["stats_after_cold"]["integrity"] == "ok" and not held(r["stats_after_cold"])
    # vLLM's 23 blocks hold less than the prompts: hicache serves what vLLM evicted
    assert same(r["warm_no_reset"], cold)
    assert r["external_after_warm"] > 0
    # vLLM's own prefix cache emptied: every whole block of every prompt comes from hicache
    assert same(r["reset"], cold)
    assert [o["cached"] for o in r["reset"]] == EXPECTED_CACHED
    assert r["external_after_reset"] > r["external_after_warm"]  # in vLLM's own metrics
    stats = r["stats_after_reset"]
    assert stats["integrity"] == "ok" and not held(stats)
    engine = [s for s in stats["sessions"] if s["client"].startswith("vllm-scheduler")]
    assert engine and engine[0]["hit_tokens"] > 0  # hits per engine in `hicache info`
    # what hicache says this engine asked and got adds up with vLLM's own counters
    counted, vllm = r["hicache_counted"], r["vllm_counted"]
    assert vllm["hits"] > 0 and counted["engine_hit_tokens"] == vllm["hits"]
    assert counted["engine_queried_tokens"] == vllm["queries"]
    assert counted["engine_loaded_tokens"] == vllm["hits"]  # every hit was copied into vLLM
    # pages poisoned behind the daemon's back change the output: the KV really came from it
    assert not same(r["poisoned"], cold)
    assert same(r["after_flush"], cold)
    # the daemon SIGKILLed two steps into a batch: every request completes, right
    assert same(r["killed"], cold)


def test_engines_of_both_tensor_parallel_sizes_share_what_the_other_stored(model, daemon):
    ep, _ = daemon
    tp1 = run("generate", model=model, endpoint=ep)
    assert tp1["external"] == 0
    tp2 = run("generate", model=model, endpoint=ep, tp=2)  # another process, another TP size
    assert [o["cached"] for o in tp2["run"]] == EXPECTED_CACHED
    assert tp2["external"] > 0
    assert same(tp2["run"], tp1["run"], tol=1e-5)
    with HiCacheClient(ep, name="test", admin=True) as hc:
        hc.flush()
    tp2_cold = run("generate", model=model, endpoint=ep, tp=2)  # both ranks store their heads
    assert tp2_cold["external"] == 0
    tp1_again = run("generate", model=model, endpoint=ep)
    assert [o["cached"] for o in tp1_again["run"]] == EXPECTED_CACHED
    assert same(tp1_again["run"], tp2_cold["run"], tol=1e-5)
    assert daemon_stats(ep)["integrity"] == "ok"


def test_an_engine_with_another_layout_does_not_start(model, daemon, tmp_path):
    ep, _ = daemon
    other = EngineLayout(
        model="another-model|main|",
        num_layers=2,
        num_kv_heads=2,
        head_size=32,
        dtype="float32",
        block_size=BLOCK,
        block_shape=(2, BLOCK, 64),
    )
    with HiCacheClient(ep, name="test") as hc:
        hc.register_layout(other)
    r = run("mismatch", model=model, endpoint=ep)
    assert not r["started"]
    assert "KV layout mismatch" in r["error"]
    assert "another-model" in r["error"] and model in r["error"]  # both named


def test_engines_on_two_machines_share_kv_through_a_store(model, tmp_path):
    """Two daemons for engines (two machines, each with its own pool) on one Mooncake store:
    what the engine on the first computed is written through to the store; the engine on the
    second finds its pool empty, its lookups say "not yet" while the daemon fetches the
    prompts' pages, then every whole block is a hit and the outputs are the same."""
    with mooncake_master() as master:
        daemons = []
        try:
            for name in ("a", "b"):
                ep = f"ipc://{tmp_path}/{name}.sock"
                flags = ("--l3", master.url, "--l3-model", "tiny-llama", "--l3-segment-bytes")
                proc = start_daemon(
                    ep, "--device-tier", "engine", "--host-bytes", "16MiB", *flags, "64MiB"
                )
                daemons.append((ep, proc))
            (ep_a, _), (ep_b, _) = daemons
            first = run("generate", model=model, endpoint=ep_a)
            assert first["external"] == 0
            l3 = l3_settled(ep_a)  # written through, in the background
            assert l3["written_pages"] > 0 and l3["failed_write_pages"] == 0
            second = run("generate", model=model, endpoint=ep_b)
            assert [o["cached"] for o in second["run"]] == EXPECTED_CACHED
            # (requests that waited for their pages ran in other steps, beside other requests:
            # batches of another shape sum in another order, hence the tolerance)
            assert same(second["run"], first["run"], tol=1e-5)
            stats = daemon_stats(ep_b)
            assert stats["integrity"] == "ok"
            assert stats["l3"]["adopted_pages"] >= max(EXPECTED_CACHED) // BLOCK
            assert stats["l3"]["corrupt_pages"] == 0
        finally:
            for _, proc in daemons:
                stop_daemon(proc)


def test_a_vllm_engine_reads_the_disk_after_the_daemon_restarted_cold(model, tmp_path):
    """docs/disk-tier.md's config for engines (``--device-tier engine --disk``, the default
    admission ``reused``): a first engine computes the prompts, a second one hits them (so they
    earned the disk); the daemon stops and starts again without its pool; a third engine's
    lookups say "not yet" while the daemon reads the disk, then every whole block is a hit,
    with the first engine's outputs."""
    ep = f"ipc://{tmp_path}/h.sock"
    flags = (
        "--device-tier", "engine", "--host-bytes", "16MiB", "--disk", str(tmp_path / "disk"),
        "--disk-bytes", "64MiB", "--l3-model", "tiny-llama", "--keep-host", "false",
    )  # fmt: skip
    proc = start_daemon(ep, *flags)
    try:
        first = run("generate", model=model, endpoint=ep)
        assert [o["cached"] for o in run("generate", model=model, endpoint=ep)["run"]] == (
            EXPECTED_CACHED
        )
        l3 = l3_settled(ep)
        assert l3["written_pages"] >= max(EXPECTED_CACHED) // BLOCK
        assert l3["failed_write_pages"] == 0
    finally:
        stop_daemon(proc)  # (a clean stop: what is queued for the disk lands)
    proc = start_daemon(ep, *flags)
    try:
        third = run("generate", model=model, endpoint=ep)
        assert [o["cached"] for o in third["run"]] == EXPECTED_CACHED
        assert same(third["run"], first["run"], tol=1e-5)
        stats = daemon_stats(ep)
        assert stats["integrity"] == "ok"
        l3 = stats["l3"]
        assert l3["adopted_pages"] >= max(EXPECTED_CACHED) // BLOCK and l3["corrupt_pages"] == 0
        assert l3["store_disk_hits"] >= max(EXPECTED_CACHED) // BLOCK
        assert l3["store_disk_recovered_values"] == l3["store_disk_held_values"] > 0
    finally:
        stop_daemon(proc)


def test_a_vllm_engine_killed_before_its_goodbye_holds_nothing_for_its_lease(model, tmp_path):
    """vLLM's front end may SIGKILL its engine core before the connector's stopping goodbye
    goes out: the daemon sees the process gone and gives its session back after the
    quarantine, long before a lease of two minutes would run out."""
    ep = f"ipc://{tmp_path}/h.sock"
    proc = start_daemon(ep, "--device-tier", "engine", "--host-bytes", "16MiB",
                        "--lease-seconds", "120", "--quarantine-seconds", "1")  # fmt: skip
    tmp = tempfile.mkdtemp(prefix="hicache-vllm-")
    engine = subprocess.Popen(
        [sys.executable, "-m", "tests.vllm_runner", "serve_then_hang",
         json.dumps({"model": model, "endpoint": ep})],
        cwd=ROOT, env={**os.environ, "TMPDIR": tmp}, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        for line in engine.stdout:  # (until it served, or it ended)
            if line.startswith("SERVED"):
                break
        assert engine.poll() is None, "the engine did not serve"
        vllm = [s for s in daemon_stats(ep)["session_list"] if s["client"].startswith("vllm")]
        assert vllm and any(s["owned_pages"] for s in vllm)  # (its pages held ahead)
        os.killpg(engine.pid, signal.SIGKILL)  # the engine core and its workers: no goodbye
        engine.wait()
        t0 = time.monotonic()
        wait_until(lambda: not [s for s in daemon_stats(ep)["session_list"]
                                if s["client"].startswith("vllm")], timeout=60,
                   what="the killed engine's sessions given back")  # fmt: skip
        assert time.monotonic() - t0 < 60 and daemon_stats(ep)["host_owned_tokens"] == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(engine.pid, signal.SIGKILL)
        engine.wait()
        shutil.rmtree(tmp, ignore_errors=True)
        log = stop_daemon(proc)
    assert "ended: lease expired" not in log and "(pid " in log and ") ended:" in log, log[-3000:]
