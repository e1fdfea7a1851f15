"""Copy paths against the torch reference: exact equality, odd shapes, every host layout."""

import numpy as np
import pytest
import torch

from hicache import HiCacheConfig
from hicache.kernels import (
    copy_pages_one_layer,
    copy_runs_one_layer,
    gather_scatter_one_layer,
    page_runs,
)
from hicache.memory import DevicePool, HostPool


def test_page_runs_are_maximal_on_both_sides():
    src = np.array([4, 5, 6, 9, 10, 2])
    dst = np.array([0, 1, 2, 3, 7, 8])
    assert page_runs(src, dst) == [(4, 0, 3), (9, 3, 1), (10, 7, 1), (2, 8, 1)]
    assert page_runs(np.array([], np.int64), np.array([], np.int64)) == []


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize(
    ("ps", "heads", "dim", "mla"), [(1, 3, 5, False), (16, 2, 7, False), (4, 0, 0, True)]
)
def test_run_copies_equal_the_reference(layout, ps, heads, dim, mla):
    shape = (
        dict(kv_format="mla", kv_lora_rank=5, qk_rope_head_dim=3)
        if mla
        else dict(num_kv_heads=heads, head_dim=dim)
    )
    cfg = HiCacheConfig(
        num_layers=3,
        dtype="float32",
        page_size=ps,
        device_tokens=40 * ps,
        host_layout=layout,
        **shape,
    )
    dev, host = DevicePool(cfg), HostPool(cfg)
    gen = torch.Generator().manual_seed(ps)
    dev.buffer.view(torch.float32).copy_(torch.randn(dev.buffer.numel() // 4, generator=gen))
    rng = np.random.default_rng(ps)
    dev_pages = np.concatenate([np.arange(3, 9), rng.permutation(np.arange(10, 40))[:7]])
    host_pages = np.concatenate([np.arange(20, 26), rng.permutation(np.arange(30, 80))[:7]])
    td, th = torch.from_numpy(dev_pages), torch.from_numpy(host_pages)
    want = host.page_view.clone().fill_(-7.0)
    for layer in range(3):
        copy_pages_one_layer(dev.page_view, want, td, th, layer)
    got = host.page_view
    got.fill_(-7.0)
    for layer in range(3):
        copy_runs_one_layer(dev.page_view, got, page_runs(dev_pages, host_pages), layer)
    assert torch.equal(got, want)  # exactly the named pages changed, with the right bytes
    got.fill_(-7.0)
    rows = [gather_scatter_one_layer(dev.page_view, got, td, th, layer) for layer in range(3)]
    # page_first interleaves layers inside a page: its pages are rows only at page_size 1
    assert all(rows) == (layout != "page_first" or ps == 1)
    if all(rows):
        assert torch.equal(got, want)
