import os
import stat

import pytest
import torch

from hicache import HiCacheConfig, HiRadixCache, InsufficientMemoryError
from hicache.memory import DevicePool, HostPool, SharedMemoryBacking, attach_shared_memory

MHA = dict(num_layers=3, num_kv_heads=2, head_dim=5, dtype="float32", page_size=4, device_tokens=16)
MLA = dict(
    num_layers=3,
    kv_format="mla",
    kv_lora_rank=6,
    qk_rope_head_dim=3,
    dtype="float32",
    page_size=4,
    device_tokens=16,
)


@pytest.mark.parametrize("shape", [MHA, MLA])
def test_device_pool_is_one_buffer_with_padded_per_layer_views(shape):
    cfg = HiCacheConfig(**shape)
    pool = DevicePool(cfg)
    views = pool.k_buffer + pool.v_buffer if cfg.kv_format == "mha" else pool.kv_buffer
    heads, dim = cfg.head_shape
    for view in views:
        assert view.shape == (cfg.device_tokens + cfg.page_size, heads, dim)
        start = view.data_ptr() - pool.buffer.data_ptr()
        assert 0 <= start and start + view.numel() * 4 <= pool.nbytes
    views[-1][5] = 7.0  # a write through a layer view shows in the page view
    kv, layer = (1, 2) if cfg.kv_format == "mha" else (0, 2)
    assert torch.all(pool.page_view[kv, layer, 1, 1] == 7.0)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("shape", [MHA, MLA])
def test_host_layouts_place_pages_where_their_order_says(layout, shape):
    cfg = HiCacheConfig(**shape, host_layout=layout)
    pool = HostPool(cfg)
    heads, dim = cfg.head_shape
    ps, L, kv = cfg.page_size, cfg.num_layers, cfg.num_kv
    P = pool.num_pages
    flat = pool.buffer.view(torch.float32)
    flat.copy_(torch.arange(flat.numel(), dtype=torch.float32))
    hd = heads * dim
    if layout == "layer_first":
        buf = flat.view(kv, L, P * ps, hd)
        expect = lambda k, ly, p, s: buf[k, ly, p * ps + s]  # noqa: E731
    elif layout == "page_first":
        buf = flat.view(kv, P * ps, L, hd)
        expect = lambda k, ly, p, s: buf[k, p * ps + s, ly]  # noqa: E731
    else:
        buf = flat.view(kv, P, L, ps, hd)
        expect = lambda k, ly, p, s: buf[k, p, ly, s]  # noqa: E731
    for k, ly, p, s in [(0, 0, 0, 0), (kv - 1, L - 1, P - 1, ps - 1), (0, 1, 3, 2)]:
        assert torch.equal(pool.page_view[k, ly, p, s], expect(k, ly, p, s))


def test_shared_memory_backing_is_private_mappable_and_removed(tmp_path):
    backing = SharedMemoryBacking("hicache-test-pool", directory=str(tmp_path))
    buf = backing.allocate(4096, "test pool")
    path = tmp_path / "hicache-test-pool"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    buf[10] = 42
    mm, other = attach_shared_memory(str(path), 4096, {os.getuid()})
    assert other[10] == 42
    other[11] = 7
    assert buf[11] == 7
    del other
    mm.close()
    del buf
    backing.close()
    assert not path.exists()
    with pytest.raises(ValueError):
        SharedMemoryBacking("a/b")


def test_host_pool_larger_than_ram_is_refused_before_allocating():
    huge = HiCacheConfig(
        num_layers=80, num_kv_heads=64, head_dim=128, device_tokens=1024, host_tokens=50_000_000
    )
    with pytest.raises(InsufficientMemoryError, match="host KV pool needs"):
        HostPool(huge)
    with pytest.raises(InsufficientMemoryError):
        HiRadixCache(huge.replace(device_tokens=1024))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.bfloat16])
def test_a_buffer_is_pinned_by_its_bytes_not_its_elements(dtype):
    """register_pinned hands CUDA the buffer's whole byte length: a float32 buffer registered
    by its element count left three quarters unmapped, and the vLLM block copy's kernel
    faulted writing there (the first GPU run)."""
    from hicache.memory import pinned_span

    buf = torch.zeros(3, 160, 256, dtype=dtype)
    address, nbytes = pinned_span(buf)
    assert address == buf.data_ptr() and nbytes == buf.numel() * buf.element_size()
    assert nbytes == buf.untyped_storage().nbytes()  # every byte the kernel may touch
    with pytest.raises(ValueError, match="contiguous"):
        pinned_span(buf[:, ::2])
