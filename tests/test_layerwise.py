"""Layer-wise loading across processes (CPU): a reader process sees layer i of a load complete,
and reads its KV, while later layers are still copying.

The daemon runs in this process (a thread), with its copier gated per layer; the reader, a
spawned process, opens gate i, waits for layer i through the shared progress table, and checks
that the last layer is not done yet and that layer i holds the bytes the writer wrote.
"""

import multiprocessing as mp
import threading

import numpy as np
import pytest
import torch

from hicache.client import DaemonTimeout, HiCacheClient, LoadFailed
from hicache.daemon.config import build_parser, resolve
from hicache.daemon.server import Daemon
from hicache.transfers import FAILED
from tests.daemon_helpers import SMALL, kv_value, write_sequence

LAYERS = 4
SPAWN = mp.get_context("spawn")


class GatedCopier:
    """Delegates to the daemon's copier; copies layer i of a load only once gates[i] is set."""

    def __init__(self, inner, gates):  # noqa: ANN001
        self.inner, self.gates = inner, gates

    def copy_layer(self, src, dst, sp, dp, runs, layer) -> None:  # noqa: ANN001
        assert self.gates[layer].wait(timeout=60)
        self.inner.copy_layer(src, dst, sp, dp, runs, layer)

    def copy_all(self, *args) -> None:  # noqa: ANN002  (backups are not gated)
        self.inner.copy_all(*args)


def reader(endpoint: str, tokens: list[int], gates, out) -> None:  # noqa: ANN001
    with HiCacheClient(endpoint, name="reader") as hc:
        pools = hc.attach()
        m = hc.match_prefix(tokens)
        load = hc.load_back_async(m)
        want = kv_value(np.array(tokens))
        seen = []
        for layer in range(LAYERS):
            gates[layer].set()
            hc.wait_layer(load, layer, timeout=30)
            done = hc._progress().layers_done(load.ticket)
            same = torch.equal(pools.k_buffer[layer][load.slots][:, 0, 0], want + layer)
            seen.append((layer, done, same))
        hc.release(m)
        out.put((m.device_hit_length, m.host_hit_length, len(load.slots), load.ticket, seen))


@pytest.fixture
def gated_daemon(tmp_path):
    endpoint = f"ipc://{tmp_path}/layers.sock"
    args = [*SMALL, "--num-layers", str(LAYERS), "--endpoint", endpoint, "--keep-host", "false"]
    daemon = Daemon(resolve(build_parser().parse_args(args), environ={}))
    gates = [SPAWN.Event() for _ in range(LAYERS)]
    engine = daemon.cache.engine
    engine.copier = GatedCopier(engine.copier, gates)
    serving = threading.Thread(target=daemon.serve, daemon=True)
    serving.start()
    yield endpoint, gates, daemon
    for gate in gates:
        gate.set()  # never leave the copy thread blocked
    daemon.stop()
    serving.join()
    daemon.close()


def test_a_reader_process_reads_each_layer_before_the_last_is_copied(gated_daemon):
    endpoint, gates, daemon = gated_daemon
    tokens = list(range(1, 33))  # 8 pages of 4
    write_sequence(endpoint, tokens)
    with HiCacheClient(endpoint, name="admin", admin=True) as hc:
        hc.evict(device_tokens=1 << 20)  # the prefix now lives on the host only
    daemon.cache.device_pool.buffer.fill_(0xFF)  # freed pages keep old KV: poison them
    out = SPAWN.Queue()
    proc = SPAWN.Process(target=reader, args=(endpoint, tokens, gates, out))
    proc.start()
    dev, host, loaded, ticket, seen = out.get(timeout=60)
    proc.join(timeout=30)
    assert (dev, host, loaded) == (0, 32, 32) and ticket > 0
    for layer, done, same in seen:
        assert same, f"layer {layer} did not hold the written KV once announced"
        assert done == layer + 1  # the next layer's gate was still closed: not yet copied
    with HiCacheClient(endpoint, name="auditor") as hc:
        assert hc.stats(check=True)["integrity"] == "ok"


def test_a_waiting_reader_times_out_and_a_failed_load_is_reported(gated_daemon):
    endpoint, gates, daemon = gated_daemon
    tokens = list(range(100, 116))
    write_sequence(endpoint, tokens)
    with HiCacheClient(endpoint, name="engine", admin=True) as hc:
        hc.evict(device_tokens=1 << 20)
        m = hc.match_prefix(tokens)
        load = hc.load_back_async(m)
        with pytest.raises(DaemonTimeout):
            hc.wait_layer(load, 0, timeout=0.05)  # gate 0 closed: nothing copied yet
        table = hc._progress()
        table.publish(load.ticket, FAILED)  # what the engine publishes when a copy raises
        with pytest.raises(LoadFailed):
            hc.wait_layer(load, 0, timeout=1)
        for gate in gates:
            gate.set()
        hc.release(m)


def test_a_match_on_a_prefix_still_loading_waits_for_the_load(gated_daemon):
    endpoint, gates, daemon = gated_daemon
    tokens = list(range(200, 232))
    write_sequence(endpoint, tokens)
    want = kv_value(np.array(tokens))
    with (
        HiCacheClient(endpoint, name="first", admin=True) as first,
        HiCacheClient(endpoint, name="second") as second,
    ):
        first.evict(device_tokens=1 << 20)
        daemon.cache.device_pool.buffer.fill_(0xFF)  # freed pages keep old KV: poison them
        m1 = first.match_prefix(tokens)
        load = first.load_back_async(m1)  # copying blocked at layer 0: every gate is closed
        pools = second.attach()
        opener = threading.Timer(0.5, lambda: [g.set() for g in gates])
        opener.start()  # the second match below holds the daemon until the load has landed
        m2 = second.match_prefix(tokens)
        got = [pools.k_buffer[layer][m2.device_indices][:, 0, 0] for layer in range(LAYERS)]
        opener.join()  # (read before this: a match that did not wait would read garbage)
        assert (m2.device_hit_length, m2.host_hit_length) == (32, 0)
        assert torch.equal(m2.device_indices, load.slots)
        for layer in range(LAYERS):
            assert torch.equal(got[layer], want + layer)
        second.release(m2)
        first.release(m1)
        assert first.stats(check=True)["integrity"] == "ok"
