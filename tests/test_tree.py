import numpy as np
import pytest
import torch

from hicache import InvalidIndicesError
from tests.conftest import make_cache, put, settle


def test_match_is_truncated_to_whole_pages():
    cache = make_cache(page_size=4, device_tokens=64, host_tokens=0)
    put(cache, list(range(1, 11)))  # 10 tokens: 8 cached, the tail page freed
    assert cache.stats().device_cached_tokens == 8
    m = cache.match_prefix(list(range(1, 11)))
    assert m.device_hit_length == 8
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 99]).device_hit_length == 4
    assert cache.match_prefix([1, 2, 3]).device_hit_length == 0
    cache.check_integrity()


def test_match_gives_the_inserted_slots_as_pages_and_slots():
    cache = make_cache(page_size=4, device_tokens=64, host_tokens=0)
    first = put(cache, list(range(1, 9)))  # two nodes after the next insert splits this one
    second = put(cache, [1, 2, 3, 4, 50, 51, 52, 53])
    m = cache.match_prefix([1, 2, 3, 4, 50, 51, 52, 53, 7])
    want = torch.cat([first[:4], second[4:]])  # the tree kept its own copy of the first page
    assert torch.equal(m.device_indices, want)
    assert torch.equal(m.device_pages, want[::4] // 4)
    assert m.device_pages.dtype == m.device_indices.dtype == torch.int64
    m.device_indices[0] = -1  # a tensor the caller owns: the tree is untouched
    assert torch.equal(cache.match_prefix([1, 2, 3, 4]).device_indices, first[:4])
    miss = cache.match_prefix([99, 98, 97, 96])
    assert miss.device_indices.shape == miss.device_pages.shape == (0,)
    cache.check_integrity()


def test_split_carries_locks_hits_and_host_pages():
    cache = make_cache(page_size=2)
    put(cache, [1, 2, 3, 4, 5, 6])
    settle(cache)  # write_through: backed up
    whole = cache.match_prefix([1, 2, 3, 4, 5, 6]).last_device_node
    cache.inc_lock_ref(whole)
    m = cache.match_prefix([1, 2, 3, 4, 9, 9])  # splits after 4 tokens
    upper = m.last_device_node
    assert upper is whole.parent and upper.num_tokens == 4 and whole.num_tokens == 2
    assert upper.lock_ref == whole.lock_ref == 1
    assert upper.hit_count == whole.hit_count + 1  # both carried, the upper one matched again
    assert len(upper.host_pages) == 2 and len(whole.host_pages) == 1
    cache.dec_lock_ref(whole)
    assert upper.lock_ref == 0
    cache.check_integrity()


def test_split_gives_the_upper_half_every_shared_field_and_cuts_every_paged_one():
    """Every field of a node is classified (TreeNode.OWN, SHARED, PAGED): a split copies each
    shared one to the upper half, cuts each paged one at the split point, and a transfer or an
    L3 write in flight learns of the new half."""
    from hicache.tree import RadixTree, TreeNode

    assert set(TreeNode.__slots__) == {*TreeNode.OWN, *TreeNode.SHARED, *TreeNode.PAGED}

    class Work:
        def __init__(self):
            self.nodes: list = []

    tree = RadixTree(page_size=2)
    key = np.arange(6, dtype=np.int32).tobytes()  # three pages
    node = tree.add_leaf(tree.default_root, key, np.arange(3, dtype=np.int64).tobytes())
    node.host_pages = np.array([10, 11, 12])
    node.ev_hashes = np.array([20, 21, 22])
    values = {}
    for i, field in enumerate(TreeNode.SHARED):
        values[field] = Work() if field in ("transfer", "l3") else 100 + i
        setattr(node, field, values[field])
    upper = tree.split(node, 16)  # after two pages (of two int32 tokens)
    for field in TreeNode.SHARED:
        assert getattr(upper, field) is values[field], field
    assert upper.device_pages == np.arange(2, dtype=np.int64).tobytes()
    assert node.device_pages == np.array([2], dtype=np.int64).tobytes()
    assert upper.host_pages.tolist() == [10, 11] and node.host_pages.tolist() == [12]
    assert upper.ev_hashes.tolist() == [20, 21] and node.ev_hashes.tolist() == [22]
    assert values["transfer"].nodes == [upper] and values["l3"].nodes == [upper]
    assert node.parent is upper and upper.parent is tree.default_root


def test_namespaces_never_share_a_prefix():
    cache = make_cache()
    put(cache, [1, 2, 3], namespace="a")
    assert cache.match_prefix([1, 2, 3]).device_hit_length == 0
    assert cache.match_prefix([1, 2, 3], namespace="b").device_hit_length == 0
    assert cache.match_prefix([1, 2, 3], namespace="a").device_hit_length == 3
    put(cache, [1, 2, 3], namespace=7)
    assert cache.stats().device_cached_tokens == 6
    with pytest.raises(ValueError, match="namespace"):
        cache.insert([1], cache.alloc(1), namespace=[1])
    cache.check_integrity()


def test_insert_returns_cached_prefix_and_frees_duplicates():
    cache = make_cache(host_tokens=0)
    put(cache, [1, 2, 3, 4])
    free_before = cache.stats().device_free_tokens
    dup = cache.alloc(6)
    assert cache.insert([1, 2, 3, 4, 5, 6], dup) == 4
    s = cache.stats()
    assert s.device_free_tokens == free_before - 2  # 4 duplicates freed, 2 new slots kept
    assert s.device_owned_tokens == 0 and s.device_cached_tokens == 6
    m = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert m.device_indices[4:].tolist() == dup[4:].tolist()
    # passing the tree's own slots back (the usual engine flow) frees nothing
    extra = cache.alloc(1)
    assert cache.insert([1, 2, 3, 4, 5, 6, 7], torch.cat([m.device_indices, extra])) == 6
    assert cache.stats().device_cached_tokens == 7
    cache.check_integrity()


@pytest.mark.parametrize(
    "bad",
    [[1.5, 2.0], [-1, 2], [[1, 2], [3, 4]], ["a", "b"], torch.tensor([1.0, 2.0]), [2**40]],
)
def test_bad_token_ids_raise_and_change_nothing(bad):
    cache = make_cache()
    put(cache, [1, 2])
    before = cache.stats()
    with pytest.raises(ValueError):
        cache.match_prefix(bad)
    slots = cache.alloc(2)
    with pytest.raises(ValueError):
        cache.insert(bad, slots)
    after = cache.stats()
    assert after.device_cached_tokens == before.device_cached_tokens
    assert after.device_owned_tokens == 2  # the caller still owns its slots
    cache.check_integrity()


def test_insert_rejects_foreign_misshaped_or_mismatched_slots():
    cache = make_cache(page_size=2, device_tokens=32, host_tokens=0)
    tree_slots = put(cache, [1, 2])
    mine = cache.alloc(4)
    with pytest.raises(ValueError, match="device indices"):
        cache.insert([5, 6, 7], mine)
    with pytest.raises(InvalidIndicesError, match="page"):
        cache.insert([5, 6, 7, 8], mine[[1, 0, 2, 3]])
    with pytest.raises(InvalidIndicesError):  # slots the tree owns, at the wrong place
        cache.insert([9, 9, 5, 6], torch.cat([tree_slots, mine[:2]]))
    with pytest.raises(InvalidIndicesError):
        cache.insert([5, 6], torch.tensor([0, 1]))  # the padding page
    s = cache.stats()
    assert s.device_owned_tokens == 4 and s.device_cached_tokens == 2
    assert cache.match_prefix([9, 9]).device_hit_length == 0
    cache.check_integrity()


def test_int32_arrays_tensors_and_lists_match_alike():
    cache = make_cache()
    put(cache, np.array([4, 5, 6], dtype=np.int32))
    for form in ([4, 5, 6], np.array([4, 5, 6]), torch.tensor([4, 5, 6])):
        assert cache.match_prefix(form).device_hit_length == 3


def test_dec_lock_ref_without_a_lock_raises():
    cache = make_cache(host_tokens=0)
    put(cache, [1, 2])
    node = cache.match_prefix([1, 2]).last_device_node
    with pytest.raises(ValueError, match="holds no lock"):
        cache.dec_lock_ref(node)
    assert cache.inc_lock_ref(node) == -2
    assert cache.dec_lock_ref(node) == 2
    cache.check_integrity()


def test_insert_accepts_the_tree_slots_for_part_of_a_node():
    # An engine with a full hit recomputes the last page: it passes the tree's slots for the
    # first pages of the node and fresh ones for the last page, which insert frees.
    cache = make_cache(page_size=2, host_tokens=0)
    tree_slots = put(cache, [1, 2, 3, 4, 5, 6])
    fresh = cache.alloc(2)
    assert cache.insert([1, 2, 3, 4, 5, 6], torch.cat([tree_slots[:4], fresh])) == 6
    s = cache.stats()
    assert s.device_owned_tokens == 0 and s.device_cached_tokens == 6
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).device_indices.tolist() == tree_slots.tolist()
    cache.check_integrity()
