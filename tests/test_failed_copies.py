"""A failed copy is never readable, locked or not; allocation never leaves the caller's page.

Core-level regression tests (copies driven by hand): a load-back whose copy fails while its
node is locked used to stay in the tree as a valid device copy; alloc_decode/alloc_extend
trusted last_loc's offset and handed out slots of the next page.
"""

import pytest
import torch

from tests.conftest import make_cache, put, settle, values_at


def host_only(cache, tokens):
    """Insert ``tokens`` (value token * 10 + position), back them up, evict them from the device."""
    put(cache, tokens)
    settle(cache)
    cache.evict(10_000)
    m = cache.match_prefix(tokens)
    assert (m.device_hit_length, m.host_hit_length) == (0, len(tokens))
    return m


@pytest.mark.parametrize("locked", [True, False])
def test_a_failed_load_leaves_nothing_readable(locked):
    cache = make_cache(page_size=2, device_tokens=32)
    tokens = list(range(1, 9))
    m = host_only(cache, tokens)
    node = m.last_host_node
    loaded = cache.load_back(node)
    if locked:  # what the daemon does right after load_back
        cache.inc_lock_ref(node)
    cache.device_pool.layers[:, :, loaded] = -7.0  # what the failed copy leaves behind
    cache.engine.fail(cache.load_ticket(node))
    settle(cache)
    cache.check_integrity()
    again = cache.match_prefix(tokens)  # another engine
    assert again.device_hit_length == 0 and again.host_hit_length == len(tokens)
    assert cache.stats().transfer_errors == 1
    if locked:  # the caller's lock moved to the anchor: releasing it still works, once
        assert cache.lock_count(node) == 1
        cache.dec_lock_ref(node)
        with pytest.raises(ValueError):
            cache.dec_lock_ref(node)
    cache.check_integrity()
    assert cache.stats().device_protected_tokens == 0
    reloaded = cache.load_back(again.last_host_node)  # the host copy is intact: load it again
    settle(cache)
    want = torch.tensor([t * 10 + i for i, t in enumerate(tokens)], dtype=torch.float32)
    assert torch.equal(values_at(cache, reloaded)[0, 0], want)


def test_a_moved_lock_keeps_the_anchor_and_can_be_taken_again():
    cache = make_cache(page_size=2, device_tokens=32)
    base = list(range(1, 5))
    put(cache, base)
    settle(cache)
    tokens = base + list(range(5, 9))
    put(cache, tokens)
    settle(cache)
    anchor = cache.match_prefix(base).last_device_node
    cache.inc_lock_ref(anchor)  # keeps the base on the device
    cache.evict(10_000)  # the tail goes to the host only
    cache.dec_lock_ref(anchor)
    m = cache.match_prefix(tokens)
    assert (m.device_hit_length, m.host_hit_length) == (4, 4)
    node = m.last_host_node
    cache.load_back(node)
    cache.inc_lock_ref(node)
    cache.engine.fail(cache.load_ticket(node))
    settle(cache)
    assert anchor.lock_ref == 1 and node.device_pages is None  # the lock now holds the anchor
    assert cache.evict(10_000).freed == 0  # the anchor stays: the caller still relies on it
    cache.inc_lock_ref(node)  # a second lock through the first (the daemon's LOCK op)
    assert anchor.lock_ref == 2 and cache.lock_count(node) == 2
    cache.check_integrity()
    cache.dec_lock_ref(node)
    cache.dec_lock_ref(node)
    assert anchor.lock_ref == 0 and cache.lock_count(node) == 0
    cache.check_integrity()


def test_loads_and_inserts_never_stack_on_a_load_that_may_fail():
    cache = make_cache(page_size=2, device_tokens=32)
    base = list(range(1, 5))
    tokens = base + [9, 9]
    m = host_only(cache, base)
    loaded = cache.load_back(m.last_host_node)
    cache.engine.fail(cache.load_ticket(m.last_host_node))
    new = cache.alloc(2)
    # inserting below the loading prefix waits for the load; it failed, so the loaded slots
    # are no longer the tree's and the insert is refused: nothing hangs below garbage
    with pytest.raises(ValueError):
        cache.insert(tokens, torch.cat([loaded, new]))
    cache.check_integrity()
    m = cache.match_prefix(tokens)
    assert (m.device_hit_length, m.host_hit_length) == (0, 4)
    # a load of a longer host chain under a loading one waits for it likewise
    more = list(range(1, 9))
    put(cache, more)
    settle(cache)
    cache.evict(10_000)
    first = cache.match_prefix(base).last_host_node
    cache.load_back(first)
    cache.engine.fail(cache.load_ticket(first))
    whole = cache.match_prefix(more)
    second = cache.load_back(whole.last_host_node)  # waits: the first failed, so it loads all
    assert second is not None and len(second) == 8
    settle(cache)
    cache.check_integrity()
    assert cache.match_prefix(more).device_hit_length == 8


@pytest.mark.parametrize("op", ["decode", "extend"])
def test_allocation_never_runs_past_the_callers_page(op):
    cache = make_cache(page_size=4, device_tokens=64)
    mine = cache.alloc(4)  # one page
    theirs = cache.alloc(4)  # the next page (another caller's)
    last = mine[-1:]  # offset 3: the end of the page
    with pytest.raises(ValueError, match="last_loc"):
        if op == "decode":  # token 1 follows token 0, which is not at offset 3
            cache.alloc_decode(torch.tensor([2]), last)
        else:
            cache.alloc_extend(torch.tensor([1]), torch.tensor([4]), last)
    ok = (
        cache.alloc_decode(torch.tensor([2]), mine[:1])
        if op == "decode"
        else cache.alloc_extend(torch.tensor([1]), torch.tensor([4]), mine[:1])
    )
    assert set((ok // 4).tolist()) == {int(mine[0]) // 4}  # stays in the caller's own page
    assert not set(ok.tolist()) & set(theirs.tolist())
    cache.check_integrity()


def test_a_load_that_finds_no_device_room_leaves_its_chain_evictable_from_the_host():
    """The host pages a load would read are protected while it makes device room; a host
    eviction during that drops their heap entries. When no room came, they are candidates
    again and must be back in the host heap (the integrity check; the host still evicts)."""
    cache = make_cache(page_size=2, device_tokens=8, host_tokens=10, write_policy="write_back")

    def to_host(tokens):  # write-back: eviction backs up, then frees at the ack
        put(cache, tokens)
        for _ in range(2):
            cache.evict(10_000)
            settle(cache)
        m = cache.match_prefix(tokens)
        assert (m.device_hit_length, m.host_hit_length) == (0, len(tokens))
        return m

    p = to_host([1, 2, 3, 4])  # two host pages
    q = to_host([20, 21, 22, 23, 24, 25])  # three: the host pool is full
    cache.load_back(q.last_host_node)
    settle(cache)
    cache.inc_lock_ref(q.last_host_node)  # on both tiers now, and locked on the device
    put(cache, [9, 9])  # a device-only page (write-back): the device pool is full
    # p's load needs two device pages: evicting the device-only page wants a host page for
    # its backup, the host's only candidate is p itself (protected), so that page is dropped
    # instead; one page is not enough, and the load gets none
    assert cache.load_back(p.last_host_node) is None
    cache.check_integrity()
    assert cache.evict_host(4) == 4  # p leaves the host as any candidate does
    cache.dec_lock_ref(q.last_host_node)
    cache.check_integrity()
