"""Every copy path against the torch reference, with torch.equal on poisoned destinations.

Paths: the C page copy (cpu backend), run copies (direct backend) and the Triton kernel
(under TRITON_INTERPRET=1 on the CPU: sizes stay small). Cases: every host layout, both
directions, page sizes 1, 16 and 64, an odd layer count, head widths that are not powers of
two, MLA, out-of-order page lists and the padding page. The destination is poisoned first, so
equality with the reference proves that exactly the named pages changed.
"""

import os

import numpy as np
import pytest
import torch

from hicache import HiCacheConfig
from hicache.kernels import copy_pages_all_layers, copy_pages_one_layer, page_runs, triton_copy
from hicache.memory import DevicePool, HostPool
from hicache.transfers import CpuCopier, DirectCopier, KernelCopier, cpu_copy

LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
SHAPES = {  # page_size -> (kv shape fields): widths 5*3=15, 7, 8+3=11
    1: dict(num_kv_heads=3, head_dim=5),
    16: dict(num_kv_heads=1, head_dim=7),
    64: dict(kv_format="mla", kv_lora_rank=8, qk_rope_head_dim=3),
}
interpreted = pytest.mark.skipif(
    not triton_copy.available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernel runs on the CPU only under TRITON_INTERPRET=1",
)


def make_pools(layout: str, ps: int, dtype: str = "float16"):
    cfg = HiCacheConfig(
        num_layers=3,
        dtype=dtype,
        page_size=ps,
        device_tokens=12 * ps,
        host_layout=layout,
        **SHAPES[ps],
    )
    dev, host = DevicePool(cfg), HostPool(cfg)
    gen = torch.Generator().manual_seed(ps)
    for pool in (dev, host):
        pool.buffer.copy_(
            torch.randint(0, 255, pool.buffer.shape, generator=gen, dtype=torch.uint8)
        )
    return dev, host


def pages_for(direction: str):
    """Out of order, a run of consecutive pages, and the device's padding page 0."""
    dev = np.array([5, 6, 7, 0, 11, 2], dtype=np.int64)
    host = np.array([9, 10, 11, 3, 0, 20], dtype=np.int64)
    return (dev, host) if direction == "backup" else (host, dev)


def sides(dev, host, direction):
    return (dev, host) if direction == "backup" else (host, dev)


def as_bits(view: torch.Tensor) -> torch.Tensor:
    return view.view(torch.int16)  # random bytes hold NaNs: compare bit patterns


def expected(src, dst, sp, dp, layers=None) -> torch.Tensor:
    want = dst.page_view.clone()
    if layers is None:
        copy_pages_all_layers(src.page_view, want, torch.from_numpy(sp), torch.from_numpy(dp))
    else:
        for layer in layers:
            copy_pages_one_layer(
                src.page_view, want, torch.from_numpy(sp), torch.from_numpy(dp), layer
            )
    return want


COPIERS = [
    pytest.param(CpuCopier(), id="cpu"),
    pytest.param(DirectCopier(), id="direct"),
    pytest.param(KernelCopier(), id="kernel", marks=interpreted),
]


@pytest.mark.parametrize("copier", COPIERS)
@pytest.mark.parametrize("direction", ["backup", "load"])
@pytest.mark.parametrize("ps", [1, 16, 64])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_copier_equals_the_reference(copier, direction, ps, layout):
    dev, host = make_pools(layout, ps)
    src, dst = sides(dev, host, direction)
    sp, dp = pages_for(direction)
    runs = page_runs(sp, dp)
    args = (src.page_view, dst.page_view, torch.from_numpy(sp), torch.from_numpy(dp), runs)
    want = expected(src, dst, sp, dp, layers=[1])
    copier.copy_layer(*args, 1)  # one step of a layer-wise load
    assert torch.equal(as_bits(dst.page_view), as_bits(want))
    want = expected(src, dst, sp, dp)
    copier.copy_all(*args)
    assert torch.equal(as_bits(dst.page_view), as_bits(want))


@pytest.mark.skipif(not cpu_copy.available(), reason="C helpers not built or switched off")
def test_c_copy_splits_large_copies_across_threads(monkeypatch):
    dev, host = make_pools("page_first", 16)
    sp, dp = pages_for("backup")
    monkeypatch.setattr(cpu_copy, "PARALLEL_MIN_BYTES", 1)  # force the threaded path
    want = expected(dev, host, sp, dp, layers=[0, 2])
    assert cpu_copy.copy_pages_c(dev.page_view, host.page_view, sp, dp, range(0, 3, 2))
    assert torch.equal(as_bits(host.page_view), as_bits(want))


@pytest.mark.skipif(not cpu_copy.available(), reason="C helpers not built or switched off")
def test_c_copy_refuses_bad_pages_and_copies_nothing():
    dev, host = make_pools("layer_first", 16)
    before = host.buffer.clone()
    with pytest.raises(IndexError):
        cpu_copy.copy_pages_c(dev.page_view, host.page_view, np.array([1, 99]), np.array([0, 1]))
    assert torch.equal(host.buffer, before)
    # another dtype or shape: not for C (the caller falls back), nothing copied
    assert not cpu_copy.copy_pages_c(
        dev.page_view.float(), host.page_view, np.array([1]), np.array([0])
    )
    assert torch.equal(host.buffer, before)


@interpreted
def test_kernel_wrapper_checks_its_input():
    dev, host = make_pools("page_first", 16)
    ok = (torch.tensor([1, 2]), torch.tensor([3, 4]))
    before = host.buffer.clone()
    bad = [
        ((dev.page_view[:, :2], host.page_view, *ok), ValueError),  # shapes differ
        ((dev.page_view, host.page_view.float(), *ok), ValueError),  # dtypes differ
        ((dev.page_view, host.page_view, torch.tensor([1]), ok[1]), ValueError),  # lengths
        ((dev.page_view, host.page_view, ok[0].int(), ok[1].int()), ValueError),  # int32 ids
        ((dev.page_view, host.page_view, torch.tensor([1, 13]), ok[1]), IndexError),  # bounds
        ((dev.page_view, host.page_view, ok[0], torch.tensor([-1, 0])), IndexError),
    ]
    for args, error in bad:
        with pytest.raises(error):
            triton_copy.copy_pages_triton(*args)
    with pytest.raises(ValueError):
        triton_copy.copy_pages_triton(dev.page_view, host.page_view, *ok, layers=range(2, 5))
    assert torch.equal(host.buffer, before)
    triton_copy.copy_pages_triton(dev.page_view, host.page_view, ok[0][:0], ok[1][:0])  # no-op
    assert torch.equal(host.buffer, before)


@pytest.mark.parametrize("backend", ["cpu", "direct", pytest.param("kernel", marks=interpreted)])
def test_a_cache_round_trips_kv_with_every_backend(backend):
    from tests.conftest import make_cache, put, settle, values_at

    cache = make_cache(manual=False, page_size=4, transfer_backend=backend)
    try:
        assert cache.engine.copier.name == backend
        tokens = list(range(1, 17))
        put(cache, tokens)
        settle(cache)
        want = torch.tensor(np.array(tokens) * 10 + np.arange(16), dtype=torch.float32)
        cache.evict(1 << 10)  # backed up, now host only
        m = cache.match_prefix(tokens)
        assert (m.device_hit_length, m.host_hit_length) == (0, 16)
        loaded = cache.load_back(m.last_host_node)
        cache.wait_load(m.last_host_node)
        assert torch.equal(values_at(cache, loaded)[0, 0], want)
        cache.check_integrity()
    finally:
        cache.close()


def test_backend_choice_is_validated_at_config_time(monkeypatch):
    from hicache.transfers import resolve_backend

    with pytest.raises(ValueError, match="transfer_backend"):
        HiCacheConfig(num_layers=1, num_kv_heads=1, head_dim=2, transfer_backend="fastest")
    with pytest.raises(ValueError, match="transfer_backend"):
        HiCacheConfig(
            num_layers=1, num_kv_heads=1, head_dim=2, transfer_backend="cpu", device="cuda"
        )
    cfg = HiCacheConfig(num_layers=1, num_kv_heads=1, head_dim=2, transfer_backend="kernel")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        resolve_backend(cfg)
    assert resolve_backend(cfg.replace(transfer_backend="auto")).value == "cpu"
