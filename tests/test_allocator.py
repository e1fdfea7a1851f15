import numpy as np
import pytest
import torch

from hicache import DoubleFreeError, HiCacheConfig, HiRadixCache, InvalidIndicesError
from hicache.memory import PagedAllocator, PageState


def make_cache(ps=4, tokens=64, host=0):
    cfg = HiCacheConfig(
        num_layers=1,
        num_kv_heads=1,
        head_dim=2,
        page_size=ps,
        device_tokens=tokens,
        host_tokens=host,
    )
    return HiRadixCache(cfg)


def test_alloc_hands_out_whole_pages_and_never_the_padding_page():
    cache = make_cache(ps=4, tokens=16)
    a = cache.alloc(6)  # two pages, six slots
    assert a.tolist()[:4] == list(range(a[0], a[0] + 4)) and a[0] % 4 == 0
    b = cache.alloc(8)
    assert cache.alloc(4) is None  # 4 pages in all, 4 used (the padding page is extra)
    used = set(a.tolist()) | set(b.tolist())
    assert not used & {0, 1, 2, 3}
    cache.free(a)
    assert cache.stats().device_free_tokens == 8
    cache.check_integrity()


def test_free_rejects_double_free_padding_foreign_and_changes_nothing():
    cache = make_cache(ps=1, tokens=8)
    a = cache.alloc(3)
    cache.free(a[:1])
    with pytest.raises(DoubleFreeError):
        cache.free(a)  # a[0] already free: a[1:] must stay owned
    assert cache.stats().device_owned_tokens == 2
    with pytest.raises(InvalidIndicesError, match="padding"):
        cache.free([0])
    with pytest.raises(InvalidIndicesError, match="outside"):
        cache.free([9])
    with pytest.raises(DoubleFreeError):
        cache.free([a[1].item(), a[1].item()])
    with pytest.raises(InvalidIndicesError):
        cache.free(torch.tensor([1.0]))
    cache.insert([5, 6], a[1:])
    with pytest.raises(InvalidIndicesError, match="owned"):
        cache.free(a[1:2])  # the tree owns it now
    cache.check_integrity()


def test_free_group_defers_reuse_until_end():
    alloc = PagedAllocator(num_pages=5, page_size=1, reserved_pages=1)
    pages = alloc.alloc_pages(4)
    alloc.free_group_begin()
    alloc.release(pages[:2])
    with pytest.raises(DoubleFreeError):
        alloc.free_pages_checked(pages[:1])
    assert alloc.free_pages == 2
    alloc.free_group_end()
    assert sorted(alloc.alloc_pages(2).tolist()) == sorted(pages[:2].tolist())
    alloc.check_integrity()


def test_alloc_extend_matches_sglang_example():
    # The seed article's trace at page_size 16: a 42-token prompt, then 10 more after 32.
    cache = make_cache(ps=16, tokens=256)
    out = cache.alloc_extend([0], [42], [-1])
    assert len(out) == 42 and out[0] % 16 == 0
    assert out.tolist() == list(range(out[0], out[0] + 16)) + out[16:].tolist()
    last = int(out[41])
    dec = cache.alloc_decode([43], [last])
    assert dec.tolist() == [last + 1]  # same page
    # crossing a page boundary takes a new page
    owned = cache.alloc(16 * 3)
    seq = cache.alloc_extend([32], [42], [int(owned[31])])
    # the prefix ended on a page boundary, so all 10 tokens go to one new page, in order
    assert int(seq[0]) % 16 == 0 and seq.tolist() == list(range(int(seq[0]), int(seq[0]) + 10))
    dec = cache.alloc_decode([49], [int(owned[47])])
    assert int(dec[0]) % 16 == 0 and int(dec[0]) // 16 not in set((owned // 16).tolist())
    cache.check_integrity()


def test_alloc_extend_fills_the_partial_page_first():
    cache = make_cache(ps=4, tokens=32)
    first = cache.alloc_extend([0], [6], [-1])  # one full page + 2 slots of the next
    more = cache.alloc_extend([6], [11], [int(first[5])])
    assert more.tolist()[:2] == [int(first[5]) + 1, int(first[5]) + 2]
    assert int(more[2]) % 4 == 0
    with pytest.raises(ValueError):
        cache.alloc_extend([3], [2], [-1])
    with pytest.raises(InvalidIndicesError):  # continuing a page nobody owns
        cache.alloc_extend([6], [7], [29])
    cache.check_integrity()


def test_alloc_returns_none_only_when_eviction_cannot_help():
    cache = make_cache(ps=1, tokens=8)
    slots = cache.alloc(8)
    cache.insert(list(range(8)), slots)
    again = cache.alloc(8)  # evicts the whole (unlocked) tree
    assert again is not None and cache.stats().device_cached_tokens == 0
    assert cache.alloc(1) is None  # everything owned by the caller now
    assert np.all(cache.device_alloc.state[1:] == PageState.OWNED)


def test_a_request_larger_than_the_pool_evicts_nothing():
    cache = make_cache(ps=4, tokens=32)
    cache.insert(list(range(16)), cache.alloc(16))
    assert cache.alloc(36) is None  # more than the pool could ever hold
    assert cache.alloc_extend([0], [40], [-1]) is None
    assert cache.stats().device_cached_tokens == 16  # the cache was not flushed for nothing
    cache.check_integrity()
