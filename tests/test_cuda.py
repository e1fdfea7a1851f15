"""CUDA paths: run only where a GPU exists; skipped cleanly elsewhere."""

import pytest
import torch

from hicache import HiCacheConfig, HiRadixCache

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_device_pool_on_cuda_round_trips_through_pinned_host():
    cfg = HiCacheConfig(
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        dtype="float16",
        page_size=4,
        device="cuda",
        device_tokens=64,
        load_back_threshold=1,
    )
    with HiRadixCache(cfg) as cache:
        assert cache.device_pool.buffer.is_cuda and cache.host_pool.buffer.is_pinned()
        slots = cache.alloc(8)
        cache.device_pool.layers[:, :, slots.cuda()] = 3.0
        cache.insert(list(range(8)), slots)
        cache.engine.wait(list(cache.records))
        cache.poll()
        cache.evict(100)
        m = cache.match_prefix(list(range(8)))
        loaded = cache.load_back(m.last_host_node)
        cache.wait_load(m.last_host_node)
        assert torch.all(cache.device_pool.layers[:, :, loaded.cuda()] == 3.0)


def test_daemon_exports_its_cuda_pool(tmp_path):
    from hicache.client import HiCacheClient
    from tests.daemon_helpers import start_daemon, stop_daemon

    ep = f"ipc://{tmp_path}/cuda.sock"
    proc = start_daemon(ep, "--device", "cuda")
    try:
        with HiCacheClient(ep) as hc:
            pools = hc.attach()
            slots = hc.alloc(4)
            pools.k_buffer[0][slots.cuda()] = 5.0
            assert torch.all(pools.k_buffer[0][slots.cuda()] == 5.0)
    finally:
        stop_daemon(proc)
