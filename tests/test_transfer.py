"""Transfer engines: copies run in the background, acks come only through poll."""

import numpy as np
import pytest
import torch

from hicache import HiCacheConfig, HiRadixCache
from hicache.memory import DevicePool, HostPool, SharedMemoryBacking
from hicache.transfers import (
    CpuCopier,
    Direction,
    LayerProgress,
    LoadFailed,
    ManualTransferEngine,
    ThreadTransferEngine,
)
from tests.conftest import put, settle, values_at

CFG = HiCacheConfig(
    num_layers=3,
    num_kv_heads=2,
    head_dim=3,
    dtype="float32",
    page_size=4,
    device_tokens=32,
    host_layout="page_first",
)


def pools():
    dev, host = DevicePool(CFG), HostPool(CFG)
    dev.buffer.view(torch.float32).copy_(torch.arange(dev.buffer.numel() // 4))
    host.buffer.zero_()
    return dev, host


def test_thread_engine_copies_every_layer_and_acks_once():
    dev, host = pools()
    engine = ThreadTransferEngine(dev, host)
    ticket = engine.submit(Direction.BACKUP, np.array([2, 5]), np.array([0, 7]))
    assert engine.wait([ticket], timeout=10)
    assert engine.wait_layer(ticket, CFG.num_layers - 1, timeout=10)
    acks = engine.poll()
    assert [(a.ticket, a.ok) for a in acks] == [(ticket, True)]
    assert engine.poll() == [] and engine.pending() == 0
    assert torch.equal(host.page_view[:, :, [0, 7]], dev.page_view[:, :, [2, 5]])
    engine.close()


class FailingCopier(CpuCopier):
    def copy_layer(self, *args) -> None:  # noqa: ANN002
        raise RuntimeError("injected copy failure")


def test_thread_engine_refuses_bad_pages_and_reports_a_failed_copy():
    dev, host = pools()
    engine = ThreadTransferEngine(dev, host)
    engine.progress = table = LayerProgress(np.zeros(8, dtype=np.int64), CFG.num_layers)
    with pytest.raises(IndexError):  # no such host page: refused before anything runs
        engine.submit(Direction.LOAD, np.array([1]), np.array([10_000]))
    assert engine.pending() == 0
    engine.copier = FailingCopier()
    bad = engine.submit(Direction.LOAD, np.array([1]), np.array([0]))
    engine.wait([bad], timeout=10)
    engine.copier = CpuCopier()
    good = engine.submit(Direction.LOAD, np.array([1]), np.array([0]))
    engine.wait([good], timeout=10)
    acks = {a.ticket: a for a in engine.poll()}
    assert not acks[bad].ok and "injected" in acks[bad].error
    assert acks[good].ok
    with pytest.raises(LoadFailed):  # a reader in another process learns it too
        table.layers_done(bad)
    assert table.layers_done(good) == CFG.num_layers
    engine.close()


def test_manual_engine_honours_dependencies():
    dev, host = pools()
    engine = ManualTransferEngine(dev, host)
    first = engine.submit(Direction.BACKUP, np.array([3]), np.array([1]))
    second = engine.submit(Direction.LOAD, np.array([6]), np.array([1]), after=[first])
    engine.complete(second)  # runs `first` before it: the load reads what the backup wrote
    assert [a.ticket for a in engine.poll()] == [first, second]
    assert torch.equal(dev.page_view[:, :, 6], dev.page_view[:, :, 3])


def test_cache_on_shared_memory_pools_cleans_up(tmp_path):
    cache = HiRadixCache(
        CFG.replace(host_layout="layer_first"),
        device_backing=SharedMemoryBacking("hc-dev", directory=str(tmp_path)),
        host_backing=SharedMemoryBacking("hc-host", directory=str(tmp_path)),
        transfer_engine=ThreadTransferEngine,
    )
    slots = put(cache, list(range(16)))  # above the default load_back_threshold (10)
    written = values_at(cache, slots).clone()
    settle(cache)
    cache.evict(100)
    m = cache.match_prefix(list(range(16)))
    loaded = cache.load_back(m.last_host_node)
    cache.wait_load(m.last_host_node)
    assert torch.equal(values_at(cache, loaded), written)
    cache.check_integrity()
    del m, loaded, slots
    cache.close()
    assert not list(tmp_path.iterdir())
