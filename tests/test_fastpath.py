"""The C helpers and their numpy fallback accept and reject exactly the same input."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache import _native
from hicache.errors import DoubleFreeError, InvalidIndicesError
from hicache.memory import PagedAllocator, PageState
from hicache.tree import IOState, RadixTree, TreeNode, fastpath

needs_c = pytest.mark.skipif(fastpath._fast is None, reason="C helpers not built")


def outcome(fn):
    try:
        return ("ok", np.frombuffer(fn(), dtype=np.int64).tolist())
    except DoubleFreeError:
        return ("double", None)
    except InvalidIndicesError:
        return ("invalid", None)


@needs_c
@settings(max_examples=300, deadline=None)
@given(
    ps=st.sampled_from([1, 2, 4]),
    states=st.lists(st.sampled_from([0, 1, 2]), min_size=2, max_size=12),
    slots=st.lists(st.integers(-3, 60), max_size=14),
)
def test_c_and_numpy_agree_on_claim(ps, states, slots):
    alloc = PagedAllocator(num_pages=len(states) + 1, page_size=ps, reserved_pages=1)
    alloc.state[1:] = states
    raw = np.array(slots, dtype=np.int64).tobytes()
    before = alloc.state.copy()
    with_c = outcome(lambda: alloc.claim(raw, PageState.OWNED, PageState.OWNED))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_native, "USE_C", False)
        without = outcome(lambda: alloc.claim(raw, PageState.OWNED, PageState.OWNED))
    assert with_c == without
    assert np.array_equal(alloc.state, before)  # reads only


@needs_c
@settings(max_examples=300, deadline=None)
@given(
    ps=st.sampled_from([1, 2, 4]),
    states=st.lists(st.sampled_from([0, 1, 1, 1, 2]), min_size=6, max_size=12),
    pages=st.lists(st.integers(-1, 7), max_size=3, unique=True),
    cut=st.integers(0, 3),
    junk=st.sampled_from([[], [], [], [5], [-1]]),
    grouped=st.booleans(),
)
def test_c_and_numpy_agree_on_claiming_and_freeing_the_tail(ps, states, pages, cut, junk, grouped):
    """free_tail: the same ids, states and free stack on both paths (C pushes the tail page
    itself unless frees are grouped), and nothing changed on a refusal. Slots are mostly
    page-shaped (pages, the last cut short), sometimes with junk after them."""
    slots = [p * ps + j for p in pages for j in range(ps)]
    slots = slots[: len(slots) - cut] + junk
    raw = np.array(slots, dtype=np.int64).tobytes()
    results = []
    for use_c in (True, False):
        alloc = PagedAllocator(num_pages=len(states) + 1, page_size=ps, reserved_pages=1)
        alloc.alloc_pages(len(states))  # the stack is empty: free pages come only from here
        alloc.state[1:] = states
        if grouped:
            alloc.free_group_begin()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_native, "USE_C", use_c)
            got = outcome(
                lambda a=alloc: a.claim(raw, PageState.OWNED, PageState.TREE, free_tail=True)
            )
        if grouped:
            alloc.free_group_end()
        results.append((got, alloc.state.tolist(), alloc._stack[: alloc._top].tolist()))
    assert results[0] == results[1]
    got, state, free = results[0]
    if got[0] != "ok":
        assert state == [PageState.RESERVED, *states] and free == []
    elif len(slots) % ps:  # the tail page: freed, not returned
        tail = slots[-(len(slots) % ps)] // ps
        assert free == [tail] and state[tail] == PageState.FREE and tail not in got[1]


def test_whole_pages_and_partial_tail(monkeypatch):
    for use_c in [True, False] if fastpath._fast else [False]:
        monkeypatch.setattr(_native, "USE_C", use_c)
        alloc = PagedAllocator(num_pages=6, page_size=4, reserved_pages=1)
        pages = alloc.alloc_pages(3)
        slots = np.concatenate(
            [np.arange(p * 4, p * 4 + 4) for p in pages[:2]]
            + [np.arange(pages[2] * 4, pages[2] * 4 + 2)]
        )
        got = alloc.claim(slots.tobytes(), PageState.OWNED, PageState.TREE)
        assert np.frombuffer(got, dtype=np.int64).tolist() == pages.tolist()
        assert (alloc.state[pages] == PageState.TREE).all()
        alloc.state[pages] = PageState.OWNED
        with pytest.raises(InvalidIndicesError, match="pool"):
            alloc.claim(np.array([400], np.int64).tobytes(), PageState.OWNED, PageState.TREE)
        with pytest.raises(DoubleFreeError):
            alloc.claim(
                np.concatenate([slots[:4], slots[:4]]).tobytes(),
                PageState.OWNED,
                PageState.TREE,
            )
        assert (alloc.state[pages] == PageState.OWNED).all()  # refused: nothing changed


@pytest.mark.parametrize("use_c", [True, False])
def test_min_token(monkeypatch, use_c):
    if use_c and fastpath._fast is None:
        pytest.skip("C helpers not built")
    monkeypatch.setattr(_native, "USE_C", use_c)
    assert fastpath.min_token(np.array([5, 3, 9], np.int32)) == 0
    assert fastpath.min_token(np.array([5, -3, -9], np.int32)) == -9
    assert fastpath.min_token(np.array([], np.int32)) == 0


@settings(max_examples=200, deadline=None)
@given(
    a=st.lists(st.integers(-2, 2), max_size=12),
    b=st.lists(st.integers(-2, 2), max_size=12),
    pos=st.integers(0, 4),
)
def test_common_tokens_agree(a, b, pos):
    ka = np.array(a, np.int32).tobytes()
    kb = np.array(b, np.int32).tobytes()
    pos = min(pos, len(b)) * 4
    want = 0
    while want < len(a) and want < len(b) - pos // 4 and a[want] == b[pos // 4 + want]:
        want += 1
    results = set()
    for use_c in [True, False] if fastpath._fast else [False]:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_native, "USE_C", use_c)
            results.add(fastpath.common_tokens(ka, kb, pos))
    assert results == {want}


@pytest.mark.parametrize("use_c", [pytest.param(True, marks=needs_c), False])
@settings(max_examples=150, deadline=None)
@given(
    ps=st.sampled_from([1, 2, 4]),
    pages=st.lists(st.integers(0, 99), max_size=6),
    damage=st.lists(st.tuples(st.integers(0, 30), st.integers(-5, 500)), max_size=3),
    tail=st.integers(0, 3),
)
def test_page_slots_and_slot_pages(use_c, ps, pages, damage, tail):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_native, "USE_C", use_c)
        slots = np.frombuffer(
            fastpath.page_slots(np.array(pages, np.int64).tobytes(), ps), np.int64
        )
        want = [p * ps + j for p in pages for j in range(ps)]
        assert slots.tolist() == want
        # an int64 array as it is (what results.py passes): its bytes, not its length
        as_array = fastpath.page_slots(np.array(pages, np.int64), ps)
        assert np.frombuffer(as_array, np.int64).tolist() == want
        runs = slots.copy()
        for at, value in damage:  # break some runs: they must come back as -1
            if at < len(runs):
                runs[at] = value
        raw = np.concatenate([runs, np.arange(min(tail, ps - 1), dtype=np.int64)]).tobytes()
        got = np.frombuffer(fastpath.slot_pages(raw, ps), np.int64).tolist()
    expect = []
    for i in range(len(pages)):
        run = runs[i * ps : (i + 1) * ps].tolist()
        whole = run[0] >= 0 and run[0] % ps == 0 and run == list(range(run[0], run[0] + ps))
        expect.append(run[0] // ps if whole else -1)
    assert got == expect  # the partial tail run is left out


@pytest.mark.parametrize("use_c", [pytest.param(True, marks=needs_c), False])
@settings(max_examples=300, deadline=None)
@given(
    ps=st.sampled_from([1, 2, 4, 16, 32]),  # (16, 32: the unrolled AVX2 compare)
    nodes=st.lists(st.lists(st.integers(0, 99), min_size=1, max_size=3) | st.none(), max_size=4),
    lead=st.integers(0, 5),
    start=st.integers(0, 2),
    damage=st.lists(st.tuples(st.integers(0, 120), st.integers(-5, 500)), max_size=2),
    cut=st.integers(0, 3),
)
def test_own_nodes_passes_the_nodes_whose_pages_the_slots_are(
    use_c, ps, nodes, lead, start, damage, cut
):
    """own_nodes passes node after node while the slots from ``pos`` on are exactly that node's
    pages' slots (in order); it stops at a host-only node, at other slots, at the slots' end."""
    path = [TreeNode(k, b"", None, None) for k in range(len(nodes))]
    for node, pages in zip(path, nodes, strict=True):
        node.device_pages = None if pages is None else np.array(pages, np.int64).tobytes()
    slots = list(range(1000, 1000 + lead))
    for pages in nodes:  # the tree's own slots for each node (a host-only node: any 2 pages)
        slots += [p * ps + j for p in (pages or [50, 51]) for j in range(ps)]
    for at, value in damage:
        if at < len(slots):
            slots[at] = value
    slots = slots[: max(0, len(slots) - cut)]
    i, pos = start, lead
    while i < len(nodes) and nodes[i] is not None:
        want = [p * ps + j for p in nodes[i] for j in range(ps)]
        if slots[pos : pos + len(want)] != want:
            break
        i, pos = i + 1, pos + len(want)
    raw = np.array(slots, np.int64).tobytes()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_native, "USE_C", use_c)
        got = fastpath.own_nodes(path, start, lead, raw, ps)
    assert got == (i, pos)


@pytest.mark.parametrize("use_c", [pytest.param(True, marks=needs_c), False])
@settings(max_examples=100, deadline=None)
@given(
    seqs=st.lists(st.lists(st.integers(0, 3), max_size=9), max_size=6),
)
def test_pack_and_unpack_shared_round_trip(use_c, seqs):
    arrays = [np.array(s, dtype=np.int32) for s in seqs]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_native, "USE_C", use_c)
        frame, shared = fastpath.pack_shared(arrays)
        keys = fastpath.unpack_shared(frame, [len(a) for a in arrays], shared)
    assert keys == [a.tobytes() for a in arrays]
    for i, s in enumerate(shared):  # the longest prefix shared with the previous sequence
        prev = seqs[i - 1] if i else []
        assert seqs[i][:s] == prev[:s]
        assert s == len(seqs[i]) or s == len(prev) or seqs[i][s] != prev[s]
    assert len(frame) == 4 * (sum(map(len, seqs)) - sum(shared))


@needs_c
def test_unpack_shared_refuses_inconsistent_counts():
    frame = np.arange(6, dtype=np.int32).tobytes()
    for lengths, shared in (([3, 4], [0, 4]), ([3, 9], [0, 0]), ([3, 4], [2, 1])):
        with pytest.raises(ValueError):
            fastpath._fast.unpack_shared(frame, lengths, shared)


@needs_c
@settings(max_examples=150, deadline=None)
@given(
    ps=st.sampled_from([1, 2]),
    seqs=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=8), max_size=6),
    query=st.lists(st.integers(0, 2), max_size=10),
    start=st.integers(0, 3),
)
def test_descend_agrees_with_the_python_walk(ps, seqs, query, start):
    tree = RadixTree(ps)
    root = tree.root(None)
    for seq in seqs:  # build the tree through the walk itself: splits, then a new leaf
        key = np.array(seq[: len(seq) // ps * ps], np.int32).tobytes()
        path, pos = tree.walk(root, key)
        if pos < len(key):
            tree.add_leaf(path[-1] if path else root, key[pos:], b"\0" * 2 * (len(key) - pos))
    key = np.array(query[: len(query) // ps * ps], np.int32).tobytes()
    pos = min(start * ps, len(key) // 4 // ps * ps) * 4
    node = root
    results = []
    for now, descend in ((1001, fastpath._tree.descend), (1002, fastpath.descend_py)):
        path, end = descend(node, key, pos, 4 * ps, now)
        assert all(n.last_access == now for n in path)
        results.append(([n.id for n in path], end))
    assert results[0] == results[1]
    ids, end = results[0]
    covered = b"".join(n.key for n in path)  # the path is exactly what the key covers whole
    assert key[pos:end] == covered
    if end < len(key):
        parent = path[-1] if path else node
        child = parent.children.get(key[end : end + 4 * ps])
        assert child is None or not key.startswith(child.key, end)


@needs_c
@settings(max_examples=100, deadline=None)
@given(
    nodes=st.lists(
        st.tuples(
            st.integers(0, 3),  # device pages (count; 0: not on the device)
            st.booleans(),  # has a host copy
            st.sampled_from(list(IOState)),
            st.integers(0, 5),  # hit count
        ),
        max_size=6,
    )
)
def test_tally_agrees_with_the_python_loop(nodes):
    outcomes = []
    for tally in (fastpath._tree.tally, fastpath.tally_py):
        path = []
        for i, (slots, host, io, hits) in enumerate(nodes):
            node = TreeNode(i, b"", None, None)
            node.device_pages = np.arange(slots, dtype=np.int64).tobytes() if slots else None
            node.host_pages = np.zeros(1, np.int64) if host else None
            node.io, node.hit_count = io, hits
            path.append(node)
        chunks, nbytes, unbacked, loading = tally(path, IOState.LOAD)
        assert [n.hit_count for n in path] == [h + 1 for *_, h in nodes]
        outcomes.append((chunks, nbytes, unbacked, loading))
    assert outcomes[0] == outcomes[1]
    device = [n for n in nodes if n[0]]
    assert outcomes[0][1] == 8 * sum(n[0] for n in device)
    assert outcomes[0][2] == any(not n[1] for n in device)
    assert outcomes[0][3] == any(n[2] is IOState.LOAD for n in device)


@pytest.mark.parametrize("use_c", [pytest.param(True, marks=needs_c), False])
def test_a_free_tail_page_of_a_pool_with_nothing_out_is_refused_as_free(monkeypatch, use_c):
    """Every page free: the free stack is full, and a partial page that was never allocated is
    the same error on both paths (not a complaint about the stack)."""
    monkeypatch.setattr(_native, "USE_C", use_c)
    alloc = PagedAllocator(num_pages=4, page_size=4, reserved_pages=1)
    raw = np.arange(4, 6, dtype=np.int64).tobytes()  # page 1's first two slots
    with pytest.raises(DoubleFreeError):
        alloc.claim(raw, PageState.OWNED, PageState.TREE, free_tail=True)
    assert alloc.free_pages == 3 and alloc.count(PageState.FREE) == 3


@pytest.mark.parametrize("use_c", [pytest.param(True, marks=needs_c), False])
@pytest.mark.parametrize(
    "expected, state",
    [
        (PageState.FREE, PageState.TREE),
        (PageState.RESERVED, PageState.TREE),
        (PageState.OWNED, PageState.FREE),
        (PageState.OWNED, PageState.RESERVED),
    ],
)
def test_claim_moves_pages_between_owned_and_tree_only(monkeypatch, use_c, expected, state):
    """Claiming free or reserved pages (or freeing by claim) would take pages the free stack
    still lists: refused on both paths, nothing changed."""
    monkeypatch.setattr(_native, "USE_C", use_c)
    alloc = PagedAllocator(num_pages=4, page_size=4, reserved_pages=1)
    alloc.alloc_pages(1)  # page 1 is OWNED, pages 2 and 3 free, page 0 the padding
    before, free = alloc.state.copy(), alloc.free_pages
    for raw in (np.arange(0, 6), np.arange(4, 8), np.arange(8, 10)):  # padding, owned, free
        with pytest.raises(ValueError, match="OWNED and TREE"):
            alloc.claim(raw.astype(np.int64).tobytes(), expected, state, free_tail=True)
    assert np.array_equal(alloc.state, before) and alloc.free_pages == free
    alloc.check_integrity()
