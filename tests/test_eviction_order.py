"""Eviction order against a naive model: after any interleaving of inserts, hits and evictions,
the leaf that goes is the one with the smallest priority under the policy, computed from the
model's own clock. Guards the lazy heap, whose entries are re-keyed only when popped."""

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import make_cache, put, settle

LEAVES = 6
SEQS = [[100 * (i + 1), 100 * (i + 1) + 1] for i in range(LEAVES)]  # distinct first tokens

POLICY_KEY = {
    "lru": lambda m: m["last"],
    "lfu": lambda m: (m["hits"], m["last"]),
    "fifo": lambda m: m["created"],
}

ops = st.lists(
    st.tuples(st.sampled_from(["insert", "match", "evict"]), st.integers(0, LEAVES - 1)),
    max_size=40,
)


def leaf_node(cache, i):
    """The cached node of sequence i, found without touching it (page size 1: first token)."""
    return cache.tree.root(None).children.get(SEQS[i][0].to_bytes(4, "little"))


@settings(max_examples=150, deadline=None)
@given(policy=st.sampled_from(sorted(POLICY_KEY)), steps=ops)
def test_the_smallest_priority_leaf_is_evicted_first(policy, steps):
    cache = make_cache(host_tokens=0, device_tokens=64, eviction_policy=policy)
    model: dict[int, dict] = {}  # cached leaf -> its times and hits
    clock = 0
    for op, i in steps:
        clock += 1
        if op == "insert":
            put(cache, SEQS[i])
            if i in model:
                model[i]["last"] = clock  # an insert through a node touches it, no hit
            else:
                model[i] = {"created": clock, "last": clock, "hits": 1}
        elif op == "match":
            hit = cache.match_prefix(SEQS[i]).device_hit_length
            assert hit == (2 if i in model else 0)
            if i in model:
                model[i]["last"] = clock
                model[i]["hits"] += 1
        else:
            before = {j: leaf_node(cache, j) for j in model}
            freed = cache.evict(1).freed
            if not model:
                assert freed == 0
            else:
                victim = min(model, key=lambda j: POLICY_KEY[policy](model[j]))
                assert freed == 2
                assert before[victim].parent is None  # left the tree
                assert all(leaf_node(cache, j) is before[j] for j in model if j != victim)
                del model[victim]
        cache.check_integrity()
    cache.close()


@settings(max_examples=100, deadline=None)
@given(
    policy=st.sampled_from(sorted(POLICY_KEY)),
    steps=st.lists(
        st.tuples(st.sampled_from(["match", "evict"]), st.integers(0, LEAVES - 1)), max_size=30
    ),
)
def test_host_eviction_takes_the_smallest_priority_host_leaf(policy, steps):
    cache = make_cache(eviction_policy=policy, device_tokens=64, host_tokens=128)
    model: dict[int, dict] = {}
    clock = 0
    for i in range(LEAVES):
        clock += 1
        put(cache, SEQS[i])
        model[i] = {"created": clock, "last": clock, "hits": 1}
    settle(cache)  # write_through: every leaf is backed up
    cache.evict(1 << 10)  # all of them host-only now
    for op, i in steps:
        clock += 1
        if op == "match":
            m = cache.match_prefix(SEQS[i])
            assert (m.device_hit_length, m.host_hit_length) == (0, 2 if i in model else 0)
            if i in model:
                model[i]["last"] = clock
                model[i]["hits"] += 1
            continue
        before = {j: leaf_node(cache, j) for j in model}
        freed = cache.evict_host(1)
        if model:
            victim = min(model, key=lambda j: POLICY_KEY[policy](model[j]))
            assert freed == 2 and before[victim].parent is None
            del model[victim]
        else:
            assert freed == 0
        cache.check_integrity()
    cache.close()
