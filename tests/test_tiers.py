"""Write policies, two-tier eviction and load-back, with copies driven by hand."""

import pytest
import torch

from hicache import IOState
from tests.conftest import make_cache, put, settle, values_at


def test_write_through_backs_up_at_insert_and_locks_until_the_ack():
    cache = make_cache()
    put(cache, [1, 2, 3])
    node = cache.match_prefix([1, 2, 3]).last_device_node
    assert node.io is IOState.BACKUP and node.lock_ref == 1
    assert cache.stats().device_protected_tokens == 3
    assert cache.evict(10).freed == 0  # locked by its backup
    settle(cache)
    assert node.io is IOState.NONE and node.lock_ref == 0 and node.on_host
    s = cache.stats()
    assert s.backup_tokens == 3 and s.backup_bytes == 3 * cache.config.token_bytes
    cache.check_integrity()


def test_selective_backs_up_only_at_the_hit_threshold():
    cache = make_cache(write_policy="write_through_selective", write_through_threshold=3)
    put(cache, [1, 2, 3])  # hit_count 1
    cache.match_prefix([1, 2, 3])  # 2
    assert not cache.records
    node = cache.match_prefix([1, 2, 3]).last_device_node  # 3: backup starts
    assert node.io is IOState.BACKUP and node.lock_ref == 1
    settle(cache)
    assert node.on_host and node.lock_ref == 0
    cache.check_integrity()


def test_write_back_copies_at_eviction_and_frees_at_the_ack():
    cache = make_cache(write_policy="write_back")
    slots = put(cache, [1, 2, 3])
    assert not cache.records  # nothing copied at insert
    node = cache.match_prefix([1, 2, 3]).last_device_node
    result = cache.evict(3)
    assert (result.freed, result.pending) == (0, 3)
    assert node.lock_ref == 0 and node.io is IOState.BACKUP  # never locked under write_back
    assert cache.device_alloc.state[slots].tolist() == [2, 2, 2]  # still TREE: not reusable
    settle(cache)
    assert not node.on_device and node.on_host
    assert cache.stats().evicted_device_tokens == 3
    cache.check_integrity()


def test_device_eviction_keeps_backed_up_nodes_as_host_only_and_loads_them_back():
    cache = make_cache(manual=False, page_size=4, device_tokens=64)
    tokens = list(range(100, 124))
    slots = put(cache, tokens)
    written = values_at(cache, slots).clone()
    settle(cache)
    cache.evict(1000)
    hold = cache.alloc(64)  # hold every device page so the load must reuse... none of the old
    cache.free(hold[24:])
    m = cache.match_prefix(tokens)
    assert (m.device_hit_length, m.host_hit_length) == (0, 24)
    loaded = cache.load_back(m.last_host_node)
    assert not set(loaded.tolist()) & set(slots.tolist())  # different slots than before
    cache.wait_load(m.last_host_node)
    assert torch.equal(values_at(cache, loaded), written)
    assert cache.match_prefix(tokens).device_hit_length == 24
    s = cache.stats()
    assert s.load_tokens == 24 and s.hit_host_tokens == 24
    cache.free(hold[:24])
    cache.check_integrity()
    cache.close()


def test_load_back_is_all_or_nothing():
    cache = make_cache(load_back_threshold=4)
    put(cache, [1, 2, 3])
    settle(cache)
    cache.evict(100)
    m = cache.match_prefix([1, 2, 3])
    assert cache.load_back(m.last_host_node) is None  # under the threshold
    cache2 = make_cache()
    put(cache2, list(range(10)))
    settle(cache2)
    cache2.evict(100)
    m = cache2.match_prefix(list(range(10)))
    assert cache2.load_back(m.last_host_node, mem_quota=5) is None  # over the quota
    owned = cache2.alloc(32)  # device full of owned slots: cannot make room
    assert cache2.load_back(m.last_host_node) is None
    assert not m.last_host_node.on_device and m.last_host_node.host_ref == 0
    cache2.free(owned)
    cache2.check_integrity()


def test_host_eviction_removes_only_unprotected_host_only_leaves_and_requeues_parents():
    cache = make_cache()
    put(cache, [1, 2])
    put(cache, [1, 2, 3, 4])
    put(cache, [1, 2, 3, 4, 5, 6])
    settle(cache)
    m = cache.match_prefix([1, 2, 3, 4, 5, 6])
    cache.inc_lock_ref(m.last_device_node)
    assert cache.evict_host(100) == 0  # everything is on the device too
    cache.dec_lock_ref(m.last_device_node)
    cache.evict(100)
    assert cache.evict_host(100) == 6  # the whole chain, leaf first, parents re-queued
    assert cache.stats().host_cached_tokens == 0 and cache.tree.num_nodes == 0
    cache.check_integrity()


def test_backup_fails_cleanly_when_the_host_is_full():
    # The host pool is larger than the device pool, so only memory held outside the tree (as
    # a future storage prefetch would) can fill it: simulate that holder directly.
    cache = make_cache()
    held = cache.host_alloc.alloc_pages(cache.host_alloc.free_pages)
    put(cache, [1, 2, 3])
    assert not cache.records and cache.stats().backup_failed_tokens == 3
    node = cache.match_prefix([1, 2, 3]).last_device_node  # write_through retries, fails again
    assert not node.on_host and node.lock_ref == 0 and node.io is IOState.NONE
    assert not cache.records and cache.stats().backup_failed_tokens == 6
    cache.check_integrity()
    cache.host_alloc.free_pages_checked(held)
    cache.match_prefix([1, 2, 3])  # write_through retries on the next touch
    settle(cache)
    assert node.on_host
    cache.check_integrity()


def test_failed_copy_ack_forgets_the_host_copy():
    cache = make_cache()
    put(cache, [1, 2, 3])
    (ticket,) = cache.records
    cache.engine.fail(ticket)
    settle(cache)
    (node,) = cache.tree.iter_nodes()
    assert not node.on_host and node.lock_ref == 0 and node.on_device
    s = cache.stats()
    assert s.transfer_errors == 1 and s.host_cached_tokens == 0
    cache.check_integrity()


def test_host_tier_off_is_a_plain_device_radix_cache():
    cache = make_cache(host_tokens=0)
    put(cache, [1, 2, 3])
    assert cache.engine is None and not cache.records
    assert cache.evict(10).freed == 3
    m = cache.match_prefix([1, 2, 3])
    assert m.device_hit_length == 0 and m.host_hit_length == 0
    assert cache.stats().host_capacity_tokens == 0
    cache.check_integrity()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("mla", [False, True])
def test_kv_round_trips_through_every_host_layout(layout, mla):
    shape = (
        dict(kv_format="mla", kv_lora_rank=3, qk_rope_head_dim=2, num_kv_heads=0, head_dim=0)
        if mla
        else {}
    )
    cache = make_cache(manual=False, page_size=4, host_layout=layout, num_layers=3, **shape)
    slots = put(cache, list(range(12)))
    data = cache.device_pool.layers[:, :, slots].clone()
    settle(cache)
    cache.evict(100)
    cache.device_pool.layers.zero_()
    m = cache.match_prefix(list(range(12)))
    loaded = cache.load_back(m.last_host_node)
    cache.wait_load(m.last_host_node)
    assert torch.equal(cache.device_pool.layers[:, :, loaded], data)
    cache.close()
