"""Block copies between vLLM-shaped KV caches and the pool: every path (C, Triton under the
interpreter, torch) and layout, every rank's share, bytes compared with torch.equal."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.client.vllm.blocks import BlockCopier, block_format, engine_layout, ordered_layers

L, NB, H, BS, HS, P = 3, 12, 2, 4, 3, 9


def cpu_layout(seed: int) -> list[torch.Tensor]:
    """vLLM's CPU layout: [blocks, heads, block, 2 * head] per layer, views of one allocation."""
    g = torch.Generator().manual_seed(seed)
    whole = torch.randn(L, NB, H, BS, 2 * HS, generator=g)
    return [whole[i] for i in range(L)]


def flash_layout(seed: int) -> list[torch.Tensor]:
    """FlashAttention's: [2, blocks, block, heads, head] per layer (K and V apart)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, NB, BS, H, HS, generator=g) for _ in range(L)]


def strided_layout(seed: int) -> list[torch.Tensor]:
    """A block that is no contiguous run (torch path only)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(H, NB, BS, 2 * HS, generator=g).transpose(0, 1) for _ in range(L)]


def pool(elems: int, ranks: int) -> list[torch.Tensor]:
    return [torch.full((P * BS, 1, elems * ranks // BS), -7.0) for _ in range(L)]


@pytest.mark.parametrize("make", [cpu_layout, flash_layout, strided_layout])
@pytest.mark.parametrize("path", ["c", "triton", "torch"])
@pytest.mark.parametrize("ranks", [1, 2])
def test_blocks_round_trip_through_every_rank_share(make, path, ranks):
    engines = [make(seed) for seed in range(ranks)]
    fmt = block_format(engines[0], NB)
    elems = int(np.prod(fmt.block_shape))
    buffers = pool(elems, ranks)
    copiers = [BlockCopier(t, fmt, r * elems, BS) for r, t in enumerate(engines)]
    if make is strided_layout:
        assert copiers[0].path == "torch"
        if path != "torch":
            return
    for c in copiers:
        c.path = path
    blocks, pages = np.array([5, 2, 9]), np.array([3, 1, 8])
    for c in copiers:
        c.store(c.pool_views(buffers), blocks, pages)
    for r, t in enumerate(engines):  # every rank's bytes in its share of every page, in order
        for layer in range(L):
            row = buffers[layer].view(P, -1)[:, r * elems : (r + 1) * elems]
            for b, p in zip(blocks, pages, strict=True):
                expect = t[layer].movedim(fmt.block_dim, 0)[b].reshape(-1)
                assert torch.equal(row[p], expect)
    untouched = [i for i in range(P) if i not in pages]
    assert all(bool((buf.view(P, -1)[untouched] == -7.0).all()) for buf in buffers)
    before = [[x.clone() for x in t] for t in engines]
    for c in copiers:
        c.load(c.pool_views(buffers), np.array([0, 11, 7]), pages)
    for t, old in zip(engines, before, strict=True):
        for layer in range(L):
            view = t[layer].movedim(fmt.block_dim, 0)
            old_view = old[layer].movedim(fmt.block_dim, 0)
            for dst, src in zip([0, 11, 7], blocks, strict=True):
                assert torch.equal(view[dst], old_view[src])
            for other in set(range(NB)) - {0, 11, 7}:
                assert torch.equal(view[other], old_view[other])


def test_bad_ids_raise_and_copy_nothing():
    tensors = cpu_layout(0)
    fmt = block_format(tensors, NB)
    c = BlockCopier(tensors, fmt, 0, BS)
    buffers = pool(int(np.prod(fmt.block_shape)), 1)
    views = c.pool_views(buffers)
    for blocks, pages in [([1, NB], [1, 2]), ([1, 2], [0, 1]), ([1, 2], [1, P]), ([1], [1, 2])]:
        with pytest.raises((IndexError, ValueError)):
            c.store(views, np.array(blocks), np.array(pages))
    assert all(bool((b == -7.0).all()) for b in buffers)


def test_layouts_from_vllm_tensors():
    tensors = cpu_layout(0)
    fmt = block_format(tensors, NB)
    assert (fmt.block_dim, fmt.kv_parts, fmt.block_shape) == (0, 1, (H, BS, 2 * HS))
    facts = dict(model="m", num_layers=L, head_size=HS, block_size=BS, backend="cpu")
    by_heads = engine_layout(fmt, num_kv_heads=H, total_kv_heads=2 * H, tp_size=2, **facts)
    assert by_heads.shard == "heads"
    replicated = engine_layout(fmt, num_kv_heads=H, total_kv_heads=H, tp_size=2, **facts)
    assert replicated.shard == "rank"  # heads replicated over ranks: no shared concatenation
    flash = block_format(flash_layout(0), NB)
    assert (flash.block_dim, flash.kv_parts) == (1, 2)
    assert engine_layout(flash, num_kv_heads=H, total_kv_heads=H, tp_size=1, **facts).shard == (
        "rank"
    )
    with pytest.raises(ValueError, match="hybrid"):
        block_format([tensors[0], torch.zeros(NB, H, BS, 4)], NB)
    with pytest.raises(ValueError, match="dtype"):
        block_format([t.to(torch.int8) for t in tensors], NB)
    with pytest.raises(ValueError, match="block count"):
        block_format(tensors, NB + 1)
    names = {f"model.layers.{i}.self_attn.attn": i for i in (10, 2, 1)}
    assert ordered_layers(names) == [
        "model.layers.1.self_attn.attn",
        "model.layers.2.self_attn.attn",
        "model.layers.10.self_attn.attn",
    ]
