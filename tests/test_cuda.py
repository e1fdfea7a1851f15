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


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("backend", ["kernel", "direct"])
def test_gpu_copiers_equal_the_reference_both_ways(layout, backend):
    from hicache.kernels import copy_pages_all_layers, page_runs
    from hicache.memory import DevicePool, HostPool
    from hicache.transfers import DirectCopier, KernelCopier

    cfg = HiCacheConfig(
        num_layers=3,
        num_kv_heads=3,
        head_dim=40,
        dtype="bfloat16",
        page_size=16,
        device="cuda",
        device_tokens=16 * 32,
        host_layout=layout,
    )
    dev, host = DevicePool(cfg), HostPool(cfg)
    assert host.buffer.is_pinned()
    dev.buffer.copy_(torch.randint(0, 255, dev.buffer.shape, dtype=torch.uint8))
    host.buffer.copy_(torch.randint(0, 255, host.buffer.shape, dtype=torch.uint8))
    copier = KernelCopier() if backend == "kernel" else DirectCopier()
    d_pages = torch.tensor([5, 6, 7, 0, 31, 2])
    h_pages = torch.tensor([9, 10, 11, 3, 0, 60])
    runs = page_runs(d_pages.numpy(), h_pages.numpy())
    on = "cuda" if backend == "kernel" else "cpu"
    for src, dst, sp, dp, r in (
        (dev, host, d_pages, h_pages, runs),
        (host, dev, h_pages, d_pages, [(b, a, n) for a, b, n in runs]),
    ):
        want = dst.page_view.cpu().clone()
        copy_pages_all_layers(src.page_view.cpu(), want, sp, dp)
        copier.copy_all(src.page_view, dst.page_view, sp.to(on), dp.to(on), r)
        torch.cuda.synchronize()
        assert torch.equal(dst.page_view.cpu().view(torch.int16), want.view(torch.int16))


def test_cuda_engine_publishes_layers_and_acks():
    import numpy as np

    from hicache.transfers import LayerProgress

    cfg = HiCacheConfig(
        num_layers=4,
        num_kv_heads=2,
        head_dim=64,
        dtype="float16",
        page_size=16,
        device="cuda",
        device_tokens=16 * 64,
        load_back_threshold=1,
    )
    with HiRadixCache(cfg) as cache:
        cache.engine.progress = table = LayerProgress(np.zeros(64, dtype=np.int64), 4)
        slots = cache.alloc(64)
        cache.device_pool.layers[:, :, slots.cuda()] = 2.0
        cache.insert(list(range(64)), slots)
        cache.engine.wait(list(cache.records))
        cache.poll()
        cache.evict(1000)
        m = cache.match_prefix(list(range(64)))
        loaded = cache.load_back(m.last_host_node)
        ticket = cache.load_ticket(m.last_host_node)
        assert table.wait_layer(ticket, 3, timeout=30)
        assert torch.all(cache.device_pool.layers[:, :, loaded.cuda()] == 2.0)
        cache.wait_load(m.last_host_node)
        assert not cache.records
        cache.check_integrity()


def test_layerwise_load_through_a_cuda_daemon(tmp_path):
    from hicache.client import HiCacheClient
    from tests.daemon_helpers import start_daemon, stop_daemon

    ep = f"ipc://{tmp_path}/cuda-layers.sock"
    proc = start_daemon(ep, "--device", "cuda")
    try:
        with HiCacheClient(ep, admin=True) as hc:
            pools = hc.attach()
            tokens = list(range(1, 33))
            slots = hc.alloc(32)
            for layer in range(len(pools.k_buffer)):
                pools.k_buffer[layer][slots.cuda()] = float(layer + 1)
            torch.cuda.synchronize()  # KV complete before insert: a backup may start at once
            hc.insert(tokens, slots)
            hc.evict(device_tokens=1 << 20)
            m = hc.match_prefix(tokens)
            load = hc.load_back_async(m)
            assert load is not None and len(load.slots) == 32
            for layer in range(load.num_layers):
                hc.wait_layer(load, layer, timeout=30)
                got = pools.k_buffer[layer][load.slots.cuda()]  # ordered after the wait
                assert torch.all(got == float(layer + 1))
            hc.release(m)
            assert hc.stats(check=True)["integrity"] == "ok"
    finally:
        stop_daemon(proc)


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_vllm_blocks_on_cuda_round_trip_through_a_pinned_pool(path):
    """The connector's worker copies with vLLM's caches on the GPU: the Triton page kernel (or
    torch) reads and writes the pinned, mapped pool."""
    import numpy as np

    from hicache.client.vllm.blocks import BlockCopier, block_format
    from hicache.memory import register_pinned

    layers, nb, heads, bs, hs, pages = 3, 16, 2, 16, 64, 10
    engine = torch.randn(layers, 2, nb, bs, heads, hs, device="cuda")  # FlashAttention-like
    tensors = [engine[i] for i in range(layers)]
    fmt = block_format(tensors, nb)
    elems = int(np.prod(fmt.block_shape))
    host = torch.full((layers, pages * bs, 1, elems // bs), -7.0)
    pinned = register_pinned(host)
    try:
        copier = BlockCopier(tensors, fmt, 0, bs)
        assert copier.path == "triton"
        copier.path = path
        views = copier.pool_views(list(host))
        copier.store(views, np.array([3, 9]), np.array([2, 7]))
        torch.cuda.synchronize()
        for layer in range(layers):
            row = host[layer].view(pages, -1)
            assert torch.equal(row[2], engine[layer][:, 3].reshape(-1).cpu())
        copier.load(views, np.array([0, 15]), np.array([7, 2]))
        torch.cuda.synchronize()
        assert torch.equal(engine[:, :, 0], engine[:, :, 9])
        assert torch.equal(engine[:, :, 15], engine[:, :, 3])
        # layer-wise, on a side stream: each layer waited for on the current stream
        from types import SimpleNamespace

        from hicache.client.vllm.layer_loads import StreamLoads

        failed = []
        job = SimpleNamespace(block_ids=np.array([1, 14]), pages=np.array([2, 7]))
        loads = StreamLoads(copier, [(job, views)], failed.append)
        for layer in range(layers):
            loads.wait(layer)
            assert torch.equal(engine[layer][:, 1], engine[layer][:, 3])  # (ordered on the GPU)
        loads.finish()
        assert not failed and torch.equal(engine[:, :, 14], engine[:, :, 9])
    finally:
        if pinned is not None:
            torch.cuda.cudart().cudaHostUnregister(pinned)


def _engine_a(endpoint: str, tokens: list[int]) -> None:
    """Another process computes a prefix into the CUDA daemon's pool (mapped by CUDA IPC)."""
    import numpy as np

    from hicache.client import HiCacheClient
    from scripts.ref_engine import ReferenceEngine

    with HiCacheClient(endpoint, name="engine-a") as hc:
        ReferenceEngine(hc).serve(np.array(tokens, dtype=np.int32))


def test_two_engines_share_kv_through_one_cuda_daemon(tmp_path):
    """The e2e check on the GPU: an engine process computes a prefix into the daemon's CUDA
    pool, a second one reuses it (and what the host gives back after an eviction): the logits
    of every token it computes equal a full recompute."""
    import multiprocessing as mp

    import numpy as np

    from hicache.client import HiCacheClient
    from tests.daemon_helpers import start_daemon, stop_daemon
    from tests.optional import require_module

    require_module("transformers", what="the reference engine on the GPU")
    from scripts.ref_engine import ReferenceEngine

    ep = f"ipc://{tmp_path}/e2e.sock"
    shape = ["--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "8", "--dtype", "float32",
             "--device-tokens", "512", "--host-tokens", "2048", "--page-size", "4",
             "--load-back-threshold", "1"]  # fmt: skip
    proc = start_daemon(ep, "--device", "cuda", *shape)
    try:
        rng = np.random.default_rng(7)
        prefix = rng.integers(0, 512, 96, dtype=np.int32)
        with mp.get_context("spawn").Pool(1) as pool:
            pool.apply(_engine_a, (ep, prefix.tolist()))
        with HiCacheClient(ep, name="engine-b", admin=True) as hc:
            engine = ReferenceEngine(hc)
            assert engine.device.type == "cuda"
            tokens = np.concatenate([prefix, rng.integers(0, 512, 20, dtype=np.int32)])
            served = engine.serve(tokens)
            want = engine.recompute(tokens)[served.computed_from :]
            assert served.device_hit == 96 and served.computed_from == 96
            assert (served.logits - want).abs().max().item() < 1e-4
            hc.evict(device_tokens=1 << 20)  # everything unlocked to the host, then back
            served = engine.serve(tokens)
            want = engine.recompute(tokens)[served.computed_from :]
            assert served.host_hit > 0 and (served.logits - want).abs().max().item() < 1e-4
    finally:
        stop_daemon(proc)
