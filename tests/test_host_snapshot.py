"""Host snapshots (hicache/host_snapshot.py): a cache over the same host memory adopts what a
snapshot names and still verifies, and nothing else."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch

from hicache import host_snapshot
from tests.conftest import make_cache, put, settle, values_at

SHAPE = dict(page_size=4, device_tokens=64, host_tokens=256)


def warm(cache, seqs):  # noqa: ANN001
    for tokens in seqs:
        put(cache, tokens)
        cache.match_prefix(tokens)  # write_through: backed up at the first hit
        settle(cache)
    cache.check_integrity()


def successor(cache, **extra):  # noqa: ANN001, ANN201
    """A new cache whose host pool holds the same bytes (the same memory, in a daemon)."""
    new = make_cache(**{**SHAPE, **extra})
    new.host_pool.buffer.copy_(cache.host_pool.buffer)
    return new


@pytest.mark.parametrize("verify", [False, True])
def test_a_successor_adopts_the_host_tier_and_serves_the_same_bytes(verify):
    old = make_cache(**SHAPE, verify_pages=verify)
    system = list(range(1, 17))
    seqs = [np.array(system + [100 + i] * 8, np.int32) for i in range(3)]
    seqs.append(np.array([7] * 12, np.int32))
    warm(old, seqs)
    snap = msgpack.unpackb(msgpack.packb(host_snapshot.take(old)))  # as it goes through a file
    new = successor(old, verify_pages=verify)
    adopted, dropped, again = host_snapshot.restore(new, snap)
    assert (adopted, dropped) == (16 + 3 * 8 + 12, 0)
    assert again["nodes"] == snap["nodes"]  # what was adopted, written down as it came
    new.check_integrity()
    assert new.match_prefix(seqs[0]).device_hit_length == 0  # nothing on the device yet
    for tokens in seqs:
        m = new.match_prefix(tokens)
        assert m.device_hit_length + m.host_hit_length == len(tokens)
        loaded = new.load_back(m.last_host_node)
        settle(new)
        slots = torch.cat([m.device_indices, loaded])
        expect = torch.tensor(tokens * 10 + np.arange(len(tokens)), dtype=torch.float32)
        assert torch.equal(values_at(new, slots)[0, 0], expect)
    new.check_integrity()
    old.close()
    new.close()


def test_a_changed_page_drops_its_node_and_what_hangs_below():
    old = make_cache(**SHAPE)
    system = list(range(1, 17))
    warm(old, [np.array(system + [100 + i] * 8, np.int32) for i in range(2)])
    warm(old, [np.array([9] * 8, np.int32)])
    snap = host_snapshot.take(old)
    new = successor(old)
    root_node = next(n for n in old.tree.iter_nodes() if n.num_tokens == 16)
    new.host_pool.page_view[0, 0, int(root_node.host_pages[1]), 0, 0] += 1.0  # reused since
    adopted, dropped, again = host_snapshot.restore(new, snap)
    assert (adopted, dropped) == (8, 16 + 2 * 8)  # only the unrelated prefix stays
    assert [e[2] for e in again["nodes"]] == [np.array([9] * 8, np.int32).tobytes()]
    assert new.match_prefix(np.array([9] * 8, np.int32)).host_hit_length == 8
    assert new.match_prefix(np.array(system, np.int32)).host_hit_length == 0
    new.check_integrity()
    assert new.host_alloc.free_pages == new.host_alloc.capacity_pages - 2
    old.close()
    new.close()


def test_a_snapshot_of_another_shape_is_refused_and_changes_nothing():
    old = make_cache(**SHAPE)
    warm(old, [np.array([3] * 8, np.int32)])
    snap = host_snapshot.take(old)
    other = make_cache(**{**SHAPE, "page_size": 8})
    with pytest.raises(ValueError, match="another host pool"):
        host_snapshot.restore(other, snap)
    assert other.host_alloc.free_pages == other.host_alloc.capacity_pages
    bad = {**snap, "version": 99}
    with pytest.raises(ValueError, match="version"):
        host_snapshot.restore(successor(old), bad)
    with pytest.raises(ValueError, match="not a host snapshot"):
        host_snapshot.restore(successor(old), {**snap, "nodes": 3})
    with pytest.raises(ValueError, match="another host pool"):  # another model's KV
        host_snapshot.restore(successor(old), snap, model="m@rev2")
    # hostile entries (pages out of range, duplicated, a bad namespace, a parent that is not
    # before them, the wrong types) are dropped with what hangs below, never trusted
    page, zero = np.array([1], np.int64).tobytes(), np.zeros(1, np.uint64).tobytes()
    key = b"\0" * 16
    forged = {**snap, "nodes": [
        [-1, None, key, np.array([10**6], np.int64).tobytes(), zero],
        [-1, 3.5, key, page, zero],
        [5, None, key, page, zero],
        [-1, None, "a str key", page, zero],
        [-1, None, key, page, "a str sum"],
        7, None, [], {"a": 1},
        [0, None, key, page, zero],  # under the first, which was dropped
    ]}  # fmt: skip
    new = successor(old)
    assert host_snapshot.restore(new, forged)[:2] == (0, 6 * 4)
    new.check_integrity()
    old.close()
    other.close()
    new.close()


@pytest.mark.parametrize("guarded", [True, False])
def test_a_page_reused_while_summed_in_the_background_is_left_out(guarded):
    """A periodic snapshot lists nodes, then sums their pages off the cache thread. A page
    freed and rewritten in between must not be vouched for: seal leaves its node out (without
    the allocator's watch, the successor would adopt another prefix's bytes)."""
    shape = dict(page_size=4, device_tokens=32, host_tokens=40)
    old = make_cache(**shape)
    a = np.arange(1, 33, dtype=np.int32)
    warm(old, [a])
    host_snapshot.watch_frees(old)
    listing = host_snapshot.list_host(old)
    assert [len(p) for *_, p in listing.nodes] == [8]
    warm(old, [np.arange(1000, 1032, dtype=np.int32)])  # evicts a on both tiers, reuses its pages
    assert old.match_prefix(a).host_hit_length == 0
    host_snapshot.sum_pages(old, listing)  # (what the keeper's thread does)
    freed = host_snapshot.unwatch_frees(old)
    assert freed is not None and freed[listing.pages].all()
    snap = host_snapshot.seal(old, listing, freed if guarded else None)
    new = make_cache(**shape)
    new.host_pool.buffer.copy_(old.host_pool.buffer)
    adopted = host_snapshot.restore(new, snap).adopted
    if guarded:
        assert (adopted, snap["nodes"]) == (0, [])
    else:  # what the guard prevents: a's tokens served with the other prefix's KV
        assert adopted == 32
        m = new.match_prefix(a)
        loaded = new.load_back(m.last_host_node)
        settle(new)
        expect = torch.tensor(a * 10 + np.arange(32), dtype=torch.float32)
        assert not torch.equal(values_at(new, loaded)[0, 0], expect)
    new.check_integrity()
    old.close()
    new.close()


def test_a_snapshot_grows_with_the_pages_it_names_not_with_the_depth():
    """Every entry holds only its own key: a chain of one-page nodes takes linear space."""
    cache = make_cache(**{**SHAPE, "device_tokens": 128, "host_tokens": 512})
    tokens = np.arange(1, 129, dtype=np.int32)
    for end in range(4, 129, 4):  # each insert adds one page below the last: 32 nodes deep
        m = cache.match_prefix(tokens[:end])
        if m.device_hit_length < end:
            new = cache.alloc(end - m.device_hit_length)
            cache.insert(tokens[:end], torch.cat([m.device_indices, new]))
            cache.match_prefix(tokens[:end])
        settle(cache)
    snap = host_snapshot.take(cache)
    assert len(snap["nodes"]) == 32
    packed = len(msgpack.packb(snap))
    assert packed < 32 * (16 + 8 + 8 + 64)  # a full key per node would be 32 * 33 * 8 bytes
    new = successor(cache, device_tokens=128, host_tokens=512)
    assert host_snapshot.restore(new, msgpack.unpackb(msgpack.packb(snap))).adopted == 128
    new.check_integrity()
    cache.close()
    new.close()
