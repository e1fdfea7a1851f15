"""StorageBlocks (hicache/observe/storage_events.py): the disk's records, in the order its thread
made them, become the events that bring a router to what the disk holds, however they
interleave between two takes."""

from __future__ import annotations

from collections import deque

import numpy as np

from hicache.observe import Forgot, Held, Let, held_pages
from hicache.observe.kv_events import chain_hashes, namespace_seed
from hicache.observe.storage_events import MEDIUM, StorageBlocks
from tests.event_model import TierModel

PS = 2
PROMPT = np.arange(1, 13, dtype=np.int32)  # six pages
NAMES = [f"k{i}" for i in range(6)]
HASHES = chain_hashes(PROMPT.tobytes(), 4 * PS, namespace_seed(None)).tolist()


def held(*pages: int) -> Held:
    at = list(pages)
    return held_pages(PROMPT.tobytes(), None, 0, at, [NAMES[i] for i in at], PS)


def blocks() -> tuple[StorageBlocks, deque]:
    changes: deque = deque()
    out = StorageBlocks(PS)
    out.follow(changes)
    return out, changes


def replay(out: StorageBlocks, model: TierModel) -> list:
    stores, removals = out.take()
    for event in stores + removals:
        model.apply(event)
    return stores + removals


def test_a_run_of_pages_is_one_block_stored_under_its_parent_with_its_tokens():
    out, changes = blocks()
    changes.append(held(0, 1, 2))
    changes.append(held(1, 2, 3, 5))  # (1, 2 announced already; 5 does not follow 3)
    stores, removals = out.take()
    assert [e.block_hashes for e in stores] == [HASHES[0:3], HASHES[3:4], HASHES[5:6]]
    assert [e.parent_block_hash for e in stores] == [None, HASHES[2], HASHES[4]]
    assert stores[0].token_ids == PROMPT[:6].tolist() and {e.medium for e in stores} == {MEDIUM}
    assert stores[2].token_ids == PROMPT[10:12].tolist() and removals == []
    assert set(out.blocks) == {NAMES[i] for i in (0, 1, 2, 3, 5)}


def test_let_go_and_held_again_between_two_takes_changes_nothing_the_reverse_removes():
    out, changes = blocks()
    changes.append(held(0, 1))
    model = TierModel()
    replay(out, model)
    changes.extend([Let(["k1"]), held(1)])  # (evicted, then written again)
    assert replay(out, model) == []
    changes.extend([held(2), Let(["k2", "unknown"])])  # (written, then evicted)
    events = replay(out, model)
    assert [type(e).__name__ for e in events] == ["BlockStored", "BlockRemoved"]
    assert set(model.blocks[MEDIUM]) == set(HASHES[:2]) and set(out.blocks) == {"k0", "k1"}


def test_a_flush_removes_every_page_and_a_dump_lists_parents_first():
    out, changes = blocks()
    changes.extend([held(3), held(0, 1, 2)])  # (a page found before its parents were)
    out.take()
    late = TierModel()  # (it asserts that a block's parent came before it)
    for event in out.dump():
        late.apply(event)
    assert set(late.blocks[MEDIUM]) == set(HASHES[:4])
    changes.append(Forgot())
    stores, removals = out.take()
    assert stores == [] and len(removals) == 1
    assert set(removals[0].block_hashes) == set(HASHES[:4]) and out.blocks == {}
