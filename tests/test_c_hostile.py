"""Hostile arguments to every C helper: each raises as its Python twin does (same exception
type, or the same result), with overflow-safe arithmetic. A regression here would be memory
corruption in a process that many engines share, so every case runs the C path and the twin.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from hicache import _native
from hicache.transfers import cpu_copy
from hicache.tree import TreeNode, fastpath

pytestmark = pytest.mark.skipif(not _native.USE_C, reason="the C helpers are not built")
BIG = 2**63 - 1  # PY_SSIZE_T_MAX


def both(monkeypatch, call):
    """(outcome of the C path, outcome of the twin): a value, or the exception's type."""
    out = []
    for use_c in (True, False):
        monkeypatch.setattr(_native, "USE_C", use_c)
        try:
            out.append(call())
        except Exception as exc:  # noqa: BLE001  (the type is what is compared)
            out.append(type(exc))
    monkeypatch.setattr(_native, "USE_C", True)
    return out


def same(monkeypatch, call, want=None):
    c, twin = both(monkeypatch, call)
    if isinstance(c, (bytes, bytearray)):
        c, twin = bytes(c), bytes(twin)
    assert c == twin, (c, twin)
    if want is not None:
        assert c is want or c == want
    return c


@pytest.mark.parametrize(
    ("pages", "ps", "want"),
    [
        ([1, 2], 0, ValueError),
        ([1, 2], -4, ValueError),
        ([1, 2], 2**62, ValueError),  # n * ps * 8 would wrap
        ([-1], 4, ValueError),
        ([2**62], 4, ValueError),  # page * ps would wrap
        ([3], 4, None),
    ],
)
def test_page_slots(monkeypatch, pages, ps, want):
    raw = np.array(pages, np.int64).tobytes()
    same(monkeypatch, lambda: fastpath.page_slots(raw, ps), want)


@pytest.mark.parametrize("ps", [0, -1])
def test_slot_pages_page_size(monkeypatch, ps):
    same(monkeypatch, lambda: fastpath.slot_pages(np.arange(8).tobytes(), ps), ValueError)


def test_slot_pages_never_wraps_near_the_top(monkeypatch):
    raw = np.array([2**63 - 2, 2**63 - 1, -(2**63), 0], np.int64).tobytes()
    same(monkeypatch, lambda: fastpath.slot_pages(raw, 2))


@pytest.mark.parametrize(
    ("i", "pos", "pages", "ps", "want"),
    [
        (0, 0, [1], 0, ValueError),
        (0, -1, [1], 4, ValueError),
        (-1, 0, [1], 4, ValueError),
        (0, BIG, [0], 4, (0, BIG)),  # pos past the slots: nothing passes
        (BIG, 0, [0], 4, (BIG, 0)),  # i past the path
        (0, 0, [1, 2], 2**62, (0, 0)),  # n * ps would wrap: too short, never read
        (0, 0, [-1], 4, (0, 0)),  # a negative page is never the tree's
        (0, 0, [2**62], 4, (0, 0)),  # page * ps wraps to a slot that exists
        (0, 0, [1], 4, (1, 4)),
        (0, 0, "pages", 4, TypeError),  # device_pages not bytes
    ],
)
def test_own_nodes(monkeypatch, i, pos, pages, ps, want):
    slots = np.array([4, 5, 6, 7, 0, 1, 2, 3], np.int64).tobytes()
    node = TreeNode(0, b"", None, None)
    node.device_pages = pages if isinstance(pages, str) else np.array(pages, np.int64).tobytes()
    same(monkeypatch, lambda: fastpath.own_nodes([node], i, pos, slots, ps), want)


def test_own_nodes_refuses_a_page_whose_last_slot_wraps(monkeypatch):
    """Page size 3: page (2**63 - 1) // 3 starts at 2**63 - 2 and its third slot would be 2**63,
    which wraps to -2**63: no page id whose slots pass 2**63 - 1 is ever the tree's."""
    page = (2**63 - 1) // 3
    node = TreeNode(0, b"", None, None)
    node.device_pages = np.array([page], np.int64).tobytes()
    wrapped = np.array([2**63 - 2, 2**63 - 1, -(2**63)], np.int64).tobytes()
    same(monkeypatch, lambda: fastpath.own_nodes([node], 0, 0, wrapped, 3), (0, 0))
    node.device_pages = np.array([page - 1], np.int64).tobytes()  # the last page that fits
    fits = np.array([2**63 - 5, 2**63 - 4, 2**63 - 3], np.int64).tobytes()
    same(monkeypatch, lambda: fastpath.own_nodes([node], 0, 0, fits, 3), (1, 3))


@pytest.mark.parametrize("index", [-1, 4, 2**61, BIG])
def test_progress_words_outside_the_buffer(monkeypatch, index):
    words = np.zeros(4, np.int64)
    same(monkeypatch, lambda: fastpath.store_release(words, index, 7), IndexError)
    same(monkeypatch, lambda: fastpath.load_acquire(words, index), IndexError)
    assert not words.any()


@pytest.mark.parametrize(
    ("lengths", "shared"),
    [
        ([2, 2], [0]),  # a short shared list
        ([2], [0, 1]),
        ([2**61, 1], [0, 0]),  # 4 * n would wrap
        ([-1, 3], [0, 0]),
        ([2, 3], [0, -1]),
        ([2, 2], [0, 3]),
    ],
)
def test_unpack_shared_with_lists_that_do_not_match(monkeypatch, lengths, shared):
    frame = np.arange(4, dtype=np.int32).tobytes()
    same(monkeypatch, lambda: fastpath.unpack_shared(frame, lengths, shared), ValueError)


@pytest.mark.parametrize("pos", [-4, 100, BIG])
def test_common_tokens_past_the_key(monkeypatch, pos):
    key = np.arange(4, dtype=np.int32).tobytes()
    same(monkeypatch, lambda: fastpath.common_tokens(key, key, pos), 0)


def test_min_token_of_ragged_bytes(monkeypatch):
    same(monkeypatch, lambda: fastpath.min_token(b"\x01\x02\x03"), ValueError)


@pytest.mark.parametrize("pos", [BIG, BIG - 3, 2**62])
def test_descend_from_a_huge_position(pos):
    root = TreeNode(0, b"", None, None)
    root.children[b"\0" * 4] = TreeNode(1, b"\0" * 4, root, None)
    for descend in (fastpath._tree.descend, fastpath.descend_py):
        assert descend(root, b"\0" * 8, pos, 4, 1) == ([], pos)


def test_tally_survives_a_node_that_drops_its_own_path():
    class Hostile:  # an attribute setter that frees the node while tally still uses it
        def __init__(self, path):
            self.path, self.device_pages, self.host_pages, self.io = path, b"\0" * 8, None, None

        @property
        def hit_count(self):
            return 0

        @hit_count.setter
        def hit_count(self, value):
            self.path.clear()

    for tally in (fastpath._tree.tally, fastpath.tally_py):
        for _ in range(50):
            path = []
            path.append(Hostile(path))
            chunks, nbytes, _, _ = tally(path, None)
            assert nbytes == 8 and chunks == [b"\0" * 8]


@pytest.mark.parametrize("ps", [0, -2])
def test_whole_pages_page_size(ps):
    state = np.ones(8, np.int8)
    with pytest.raises(ValueError):
        fastpath._fast.whole_pages(state, np.arange(4, dtype=np.int64).tobytes(), ps, 8, 1, 2)
    assert (state == 1).all()


def test_whole_pages_with_a_huge_page_size_never_wraps():
    state = np.ones(8, np.int8)
    raw = np.arange(4, dtype=np.int64).tobytes()  # one partial page: page 0's first 4 slots
    out = fastpath._fast.whole_pages(state, raw, 2**62, 8, 1, 2)
    assert np.frombuffer(out, np.int64).tolist() == [0] and state.tolist() == [2] + [1] * 7
    far = np.array([2**62, 2**62 + 1], np.int64).tobytes()  # page 1 of 8: out of range
    assert fastpath._fast.whole_pages(np.ones(1, np.int8), far, 2**62, 1, 1, 2) == 1
    # a slot beside the largest id: first + offset would pass 2**63 - 1 (compared unsigned)
    top = np.array([2**63 - 1, 0], np.int64).tobytes()
    assert fastpath._fast.whole_pages(np.ones(5, np.int8), top, 2**63 - 1, 5, 1, 2) == 2


def test_whole_pages_refuses_a_bad_stack_and_changes_nothing():
    raw = np.arange(6, dtype=np.int64).tobytes()  # page 0 whole, page 1 partial (page size 4)
    whole = fastpath._fast.whole_pages
    stack = np.zeros(4, np.int64)
    for bad in (
        (stack, 4, 0),  # top past the stack
        (stack, -1, 0),
        (np.zeros(8, np.uint8)[1:].view(np.uint8), 0, 0),  # misaligned (7 bytes: no slot)
        (memoryview(np.zeros(33, np.uint8))[1:], 0, 0),  # misaligned int64 slots
    ):
        state = np.ones(4, np.int8)
        with pytest.raises(ValueError, match="stack"):
            whole(state, raw, 4, 4, 1, 2, *bad)
        assert (state == 1).all() and not stack.any()
    for bad in (
        (np.zeros(8, np.int32), 0, 0),  # 4-byte items: an int64 write would span two
        (stack, 0, 300),  # a free state that is no int8
        (stack, 0, -129),
    ):
        state = np.ones(4, np.int8)
        with pytest.raises(ValueError, match="stack"):
            whole(state, raw, 4, 4, 1, 2, *bad)
        assert (state == 1).all() and not stack.any()
    both = np.ones(64, np.int8)  # the stack inside the state buffer
    with pytest.raises(ValueError, match="apart"):  # the very same bytes
        whole(both[:16], raw, 4, 16, 1, 2, both[:16].view(np.int64), 0, 0)
    with pytest.raises(ValueError, match="apart"):
        whole(both[:16], raw, 4, 16, 1, 2, both[8:24].view(np.int64), 0, 0)
    assert (both == 1).all()
    out = whole(both[:8], raw, 4, 8, 1, 2, both[8:].view(np.int64), 0, 0)  # side by side: fine
    assert np.frombuffer(out, np.int64).tolist() == [0] and both[:2].tolist() == [2, 0]
    state = np.ones(4, np.int8)
    with pytest.raises((TypeError, BufferError)):
        whole(state, raw, 4, 4, 1, 2, bytes(32), 0, 0)  # read-only
    with pytest.raises(TypeError):
        whole(state, raw, 4, 4, 1, 2, object(), 0, 0)
    assert (state == 1).all()
    out = whole(state, raw, 4, 4, 1, 2, stack, 3, 0)  # the tail page goes to stack[3], FREE
    assert np.frombuffer(out, np.int64).tolist() == [0]
    assert state.tolist() == [2, 0, 1, 1] and stack.tolist() == [0, 0, 0, 1]
    state[:] = 1
    assert whole(state, raw[:32], 4, 4, 1, 2, stack, 0, 0) == np.int64(0).tobytes()  # no tail
    assert stack.tolist() == [0, 0, 0, 1] and state.tolist() == [2, 1, 1, 1]


@pytest.mark.parametrize("layers", [range(-1, 0), range(1, 3), range(10**9, 10**9 + 1)])
def test_copy_pages_refuses_layers_outside_the_views(layers):
    big_src = torch.arange(4 * 4 * 2 * 8, dtype=torch.float32).reshape(1, 4, 4, 2, 8) + 1
    big_dst = torch.zeros(1, 4, 4, 2, 8)
    src, dst = big_src[:, :2], big_dst[:, :2]  # 2-layer views of 4-layer buffers
    pages = np.array([1], np.int64)
    with pytest.raises(IndexError):
        cpu_copy.copy_pages_c(src, dst, pages, pages, layers=layers)
    assert not big_dst.any()


def test_copy_pages_checks_what_its_arguments_tell():
    src, dst = torch.ones(64), torch.zeros(64)
    bases = np.array([[src.data_ptr(), dst.data_ptr()]], np.int64)
    one = np.array([0], np.int64)
    for args, error in (
        ((bases, 16, 16, 16, 16, 1, 16, one, np.array([0, 1], np.int64)), ValueError),
        ((bases, 16, 16, 16, 16, 1, 16, one, np.array([-1], np.int64)), IndexError),
        ((bases[:, :1], 16, 16, 16, 16, 1, 16, one, one), ValueError),
        ((bases, -16, 16, 16, 16, 1, 16, one, one), ValueError),
        ((bases, 16, 16, 16, 16, 0, 16, one, one), ValueError),
    ):
        with pytest.raises(error):
            cpu_copy._copy.copy_pages(*args, 1, False)
    assert not dst.any()


def _node(pages, node_id=0):
    node = TreeNode(node_id, b"", None, None)
    node.device_pages = pages
    return node


class _Bytes(bytes):
    """A bytes subclass: C's bytes check takes it, and so must the twin's."""


@pytest.mark.parametrize(
    ("path", "i", "pos", "slots", "ps"),
    [
        ([258], 0, 0, np.array([2, 1, 0, 0, 0, 0, 0, 0], np.int64), 1),  # int64 items, not bytes
        ([258], 0, 0, memoryview(np.arange(8, dtype=np.int64)), 4),
        ([258], 0, 0, np.arange(16, dtype=np.int64)[::2], 4),  # not contiguous
        ([258], 0, 0, "abc", 4),
        ("tuple", 0, 0, b"", 4),
        ([258], 2**63, 0, b"", 4),
        ([258], 0, 0, b"", 2**64),
        ([258], 1.5, 0, b"", 4),
        ("subclass", 0, 0, np.arange(4, 8, dtype=np.int64).tobytes(), 4),
        ("empty", 0, 0, b"", 2**62),
    ],
)
def test_own_nodes_hostile_arguments(monkeypatch, path, i, pos, slots, ps):
    if path == "tuple":
        path = (_node(np.array([1], np.int64).tobytes()),)
    elif path == "subclass":
        path = [_node(_Bytes(np.array([1], np.int64).tobytes()))]
    elif path == "empty":
        path = [_node(b"")]
    else:
        path = [_node(np.array(path, np.int64).tobytes())]
    same(monkeypatch, lambda: fastpath.own_nodes(path, i, pos, slots, ps))


def own_first(slots, pages: bytes):
    return fastpath.own_nodes([_node(pages)], 0, 0, slots, 4)


def test_misaligned_buffers_read_as_the_twin_reads_them(monkeypatch):
    ids = np.array([3, 0, 7], np.int64).tobytes()
    slots = np.arange(8, 16, dtype=np.int64).tobytes()
    toks = np.array([5, -2, 9], np.int32).tobytes()
    for raw, call in (
        (ids, lambda b: fastpath.page_slots(b, 4)),
        (slots, lambda b: fastpath.slot_pages(b, 4)),
        (slots, lambda b: own_first(b, ids[8:16])),
        (toks, lambda b: fastpath.min_token(b)),
    ):
        off = memoryview(b"\0" + raw)[1:]  # one byte off any alignment
        same(monkeypatch, lambda off=off, call=call: call(off))
        assert bytes(fastpath.page_slots(ids, 4)) == bytes(
            fastpath.page_slots(memoryview(b"\0" + ids)[1:], 4)
        )


OWN_NODES_CASES = """
import sys
import numpy as np
from hicache import _native
from hicache.tree import fastpath
from hicache.tree import TreeNode

rng = np.random.default_rng(int(sys.argv[1]))
for case in range(400):
    ps = int(rng.choice([2, 3, 4, 8, 16, 32, 48, 64]))
    nodes, slots = [], []
    for _ in range(int(rng.integers(1, 4))):
        pages = rng.integers(0, 50, int(rng.integers(1, 6))).astype(np.int64)
        node = TreeNode(0, b"", None, None)
        node.device_pages = pages.tobytes()
        nodes.append(node)
        slots.append((pages[:, None] * ps + np.arange(ps)).ravel())
    raw = np.concatenate(slots)
    if case % 2:  # one slot wrong, anywhere (or a page id that wraps)
        raw[int(rng.integers(0, len(raw)))] += int(rng.choice([1, -1, 2**62]))
    if case % 7 == 0:
        nodes[-1].device_pages = np.array([2**62, -1], np.int64)[: 1 + case % 2].tobytes()
    got = fastpath._tree.own_nodes(nodes, 0, 0, raw.tobytes(), ps)
    _native.USE_C = False
    want = fastpath.own_nodes(nodes, 0, 0, raw.tobytes(), ps)
    _native.USE_C = True
    assert got == want, (case, ps, got, want)
print("ok")
"""


@pytest.mark.parametrize("no_avx2", ["", "1"])
def test_own_nodes_agrees_with_the_twin_on_both_c_paths(no_avx2):
    """The compare has an AVX2 path (page sizes that are multiples of 4, on CPUs with AVX2)
    and a plain one (HICACHE_NO_AVX2=1, read at import): both as the Python twin."""
    env = {k: v for k, v in os.environ.items() if k != "HICACHE_NO_AVX2"}
    if no_avx2:
        env["HICACHE_NO_AVX2"] = no_avx2
    out = subprocess.run(
        [sys.executable, "-c", OWN_NODES_CASES, "7"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
