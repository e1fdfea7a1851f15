"""One regression test per single-process pitfall in sglang_hicache.md (issue numbers are
sgl-project/sglang's)."""

import numpy as np
import torch

from hicache import IOState
from hicache.memory import PageState
from tests.conftest import make_cache, put, settle, values_at


def test_31715_device_slots_under_an_unacked_backup_are_never_reused():
    # write_through: the backing-up node is locked, so eviction cannot take it.
    cache = make_cache(device_tokens=8, host_tokens=16)
    slots = put(cache, list(range(8)))
    assert cache.evict(8).freed == 0
    # write_back: eviction starts the copy; the pages stay TREE until the ack ...
    wb = make_cache(device_tokens=8, host_tokens=16, write_policy="write_back")
    slots = put(wb, list(range(8)))
    expected = values_at(wb, slots).clone()
    assert wb.evict(8).pending == 8
    assert np.all(wb.device_alloc.state[slots.numpy()] == PageState.TREE)
    # ... and an alloc that needs them waits for the copy first, so the host copy is intact.
    fresh = wb.alloc(8)
    wb.device_pool.layers[:, :, fresh] = -1.0
    m = wb.match_prefix(list(range(8)))
    assert m.host_hit_length == 8
    wb.free(fresh)
    loaded = wb.load_back(m.last_host_node)
    wb.wait_load(m.last_host_node)
    assert torch.equal(values_at(wb, loaded), expected)
    wb.check_integrity()


def test_27631_host_pages_being_loaded_survive_nested_eviction():
    # Loading needs device room; making room under write_back backs up other nodes, which
    # needs host room; host eviction must not take the pages the load is reading.
    cache = make_cache(device_tokens=8, host_tokens=12, write_policy="write_back")
    a = list(range(100, 108))
    slots = put(cache, a)
    expected = values_at(cache, slots).clone()
    cache.evict(8)
    settle(cache)  # a is host-only now: 8 of 12 host pages
    put(cache, list(range(200, 208)))  # device full again, not backed up
    m = cache.match_prefix(a)
    loaded = cache.load_back(m.last_host_node)
    # room for a: evicting b needs 8 host pages, only 4 are free and a's 8 are protected
    assert loaded is not None
    cache.wait_load(m.last_host_node)
    assert torch.equal(values_at(cache, loaded), expected)
    cache.check_integrity()


def test_748_write_back_never_locks_and_a_failed_backup_is_not_backed_up():
    cache = make_cache(write_policy="write_back")
    put(cache, [1, 2, 3])
    (node,) = cache.tree.iter_nodes()
    cache.evict(3)
    assert node.lock_ref == 0 and cache.stats().device_protected_tokens == 0
    (ticket,) = cache.records
    cache.engine.fail(ticket)
    settle(cache)
    assert node.on_device and not node.on_host  # the device copy stays, not marked backed up
    cache.check_integrity()


def test_4987_host_eviction_counts_and_stops():
    cache = make_cache()
    for start in range(0, 30, 5):
        put(cache, list(range(start, start + 5)))
    settle(cache)
    cache.evict(1000)
    freed = cache.evict_host(10**9)  # terminates, frees what exists
    assert freed == 30 and cache.stats().evicted_host_tokens == 30
    assert cache.evict_host(10) == 0
    cache.check_integrity()


def test_5499_write_back_requeues_parents_and_frees_device_pages():
    cache = make_cache(write_policy="write_back", device_tokens=16, host_tokens=64)
    put(cache, [1, 2, 3, 4])
    put(cache, [1, 2, 3, 4, 5, 6])
    put(cache, [1, 2, 3, 4, 5, 6, 7, 8])  # a chain of three nodes
    for _ in range(3):  # each round evicts the current leaf; its parent must come next
        cache.evict(1)
        settle(cache)
    s = cache.stats()
    assert s.device_cached_tokens == 0 and s.device_free_tokens == 16
    assert s.host_cached_tokens == 8
    cache.check_integrity()


def test_35270_shared_prefixes_are_counted_once():
    cache = make_cache(host_tokens=0)
    put(cache, [1, 2, 3, 4])
    put(cache, [1, 2, 3, 4, 5])
    put(cache, [1, 2, 3, 4, 6])
    s = cache.stats()
    assert s.device_cached_tokens == 6
    assert s.device_evictable_tokens + s.device_protected_tokens == 6
    cache.check_integrity()


def test_38452_every_host_only_ancestor_of_a_hit_can_be_loaded():
    cache = make_cache(manual=False, write_policy="write_back", device_tokens=16, host_tokens=48)
    put(cache, [1, 2, 3, 4])
    put(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    cache.evict(100)
    settle(cache)
    cache.evict(100)
    settle(cache)
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert m.device_hit_length == 0 and m.host_hit_length == 8
    loaded = cache.load_back(m.last_host_node)
    cache.wait_load(m.last_host_node)
    assert len(loaded) == 8
    assert all(n.io is IOState.NONE and n.on_device for n in cache.tree.iter_nodes())
    cache.check_integrity()
    cache.close()


def test_host_eviction_during_a_load_leaves_the_pages_it_reads():
    """A load reads host pages until its ack: however much host room is asked for meanwhile,
    those pages stay in the tree (and are not reused) until the copy landed."""
    cache = make_cache(device_tokens=16, host_tokens=24, write_policy="write_through")
    a, b = list(range(100, 108)), list(range(300, 308))
    expected = values_at(cache, put(cache, a)).clone()
    put(cache, b)
    settle(cache)  # both backed up
    cache.evict(16)  # both host-only now
    m = cache.match_prefix(a)
    node = m.last_host_node
    host_pages = node.host_pages.copy()
    loaded = cache.load_back(node)
    assert loaded is not None and cache.engine.queued()  # the copy has not run yet
    assert cache.evict_host(24) == 8  # only b could go: a's pages are being read
    assert node.host_pages is not None and (node.host_pages == host_pages).all()
    assert cache.host_alloc.alloc_pages(24, PageState.OWNED) is None  # none of a's reusable
    settle(cache)
    assert torch.equal(values_at(cache, loaded), expected)
    cache.check_integrity()
    assert cache.evict_host(24) == 0 and cache.evict(8).freed == 8  # now it may go (device first)
    assert cache.evict_host(24) == 8
    cache.check_integrity()
