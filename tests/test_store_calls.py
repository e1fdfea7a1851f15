"""What a store path (SGLang's backend) saves of round trips: a match that allocates what it
lacks in the same request, a release nobody waits for, a batch of inserts checked once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.client import HiCacheClient
from hicache.client.connection import DaemonError, LeaseLost
from hicache.protocol import ErrorCode, Op
from tests.daemon_helpers import start_daemon, stop_daemon, wait_until


@pytest.fixture
def ep(tmp_path):
    endpoint = f"ipc://{tmp_path}/d.sock"
    proc = start_daemon(endpoint)  # (page size 4, 256 device tokens)
    try:
        yield endpoint
    finally:
        stop_daemon(proc)


def owned(hc: HiCacheClient) -> set[int]:
    return set(hc.holdings().owned_slots.tolist())


def test_a_match_allocates_the_pages_its_sequence_lacks_in_the_same_round_trip(ep):
    with HiCacheClient(ep, name="store") as hc:
        cached = list(range(1, 9))
        hc.insert(cached, hc.alloc(8))
        seq = cached + list(range(100, 110))  # 8 cached, 10 more: 3 pages (the last partial)
        m, slots = hc.match_and_alloc(seq)
        assert (m.device_hit_length, m.lock_id, len(slots)) == (8, 0, 10)
        pages = sorted(set((slots // 4).tolist()))
        assert len(pages) == 3 and owned(hc) == {p * 4 for p in pages}
        assert torch.equal(
            slots, (torch.tensor(pages)[:, None] * 4 + torch.arange(4)).reshape(-1)[:10]
        )
        hc.insert(seq, torch.cat([m.device_indices, slots]))
        assert hc.match_prefix(seq, lock=False).device_hit_length == 16
        assert owned(hc) == set()  # (the partial page was freed by the insert)
        whole, none = hc.match_and_alloc(seq[:16])
        assert whole.device_hit_length == 16 and len(none) == 0 and owned(hc) == set()


def test_a_batch_allocates_for_each_sequence_and_a_failed_one_holds_nothing(ep):
    with HiCacheClient(ep, name="store") as hc:
        keys = [[7, 7, 7, i] for i in range(6)]
        hc.insert(keys[2], hc.alloc(4))
        got = hc.match_and_alloc_batch(keys)
        assert [len(s) for _, s in got] == [4, 4, 0, 4, 4, 4]
        assert [m.device_hit_length for m, _ in got] == [0, 0, 4, 0, 0, 0]
        hc.insert_batch([(k, s) for k, (_, s) in zip(keys, got, strict=True) if len(s)])
        assert all(hc.match_prefix(k, lock=False).device_hit_length == 4 for k in keys)
        with pytest.raises(DaemonError) as err:  # more than the pool: nothing allocated
            hc.match_and_alloc(list(range(1, 4000)))
        assert err.value.code in (ErrorCode.OUT_OF_MEMORY, ErrorCode.QUOTA_EXCEEDED)
        assert owned(hc) == set()
        with pytest.raises(DaemonError) as err:  # an allocation under a lock: refused
            hc._call(Op.MATCH, {"lengths": [4], "lock": True, "alloc_rest": True},
                     [np.array(keys[0], np.int32).tobytes()])  # fmt: skip
        assert err.value.code is ErrorCode.BAD_FIELD


def test_a_release_not_waited_for_releases_and_the_next_call_reads_past_its_reply(ep):
    with HiCacheClient(ep, name="reader") as hc:
        seq = list(range(1, 17))
        hc.insert(seq, hc.alloc(16))
        matches = [hc.match_prefix(seq) for _ in range(3)]
        assert len(hc.holdings().lock_ids) == 3
        hc.release(*matches[:2], wait=False)
        assert matches[0].released and matches[1].released
        assert hc.holdings().lock_ids == [matches[2].lock_id]  # (served in order)
        hc.release(matches[2], wait=False)
        hc.release(matches[2], wait=False)  # twice: its error is never raised
        hc.ping()
        assert hc.holdings().lock_ids == []


def test_a_batch_of_inserts_fails_where_a_sequence_does(ep):
    """The batch's pages are checked at once; a page that is not the session's sends it down
    the sequence-by-sequence path, which inserts those before it and fails on it."""
    with HiCacheClient(ep, name="a") as a, HiCacheClient(ep, name="b") as b:
        theirs = b.alloc(4)
        first, second = a.alloc(4), a.alloc(4)
        pairs = [([1, 2, 3, 4], first), ([5, 6, 7, 8], theirs), ([9, 9, 9, 9], second)]
        with pytest.raises(DaemonError) as err:
            a.insert_batch(pairs)
        assert err.value.code is ErrorCode.NOT_OWNED
        assert a.match_prefix([1, 2, 3, 4], lock=False).device_hit_length == 4
        assert a.match_prefix([9, 9, 9, 9], lock=False).device_hit_length == 0
        assert owned(a) == {int(second[0])} and owned(b) == {int(theirs[0])}
        assert a.stats(check=True)["integrity"] == "ok"


def test_a_release_not_waited_for_is_waited_for_once_the_lease_may_have_lapsed(ep):
    """What was read under a lock is vouched for by a release nobody waits for only while the
    session's lease surely holds; past it (a stalled engine: no heartbeat) the release waits,
    and LeaseLost says the lock may have lapsed during the read."""
    seq = list(range(1, 17))
    with HiCacheClient(ep, name="writer") as w:
        w.insert(seq, w.alloc(16))
    with HiCacheClient(ep, name="stalled", heartbeat=False) as hc:
        m = hc.match_prefix(seq)
        assert m.lock_id
        with HiCacheClient(ep, name="probe") as probe:  # (the daemon's lease is 3 s)
            wait_until(lambda: probe.stats()["leases_expired"] >= 1, timeout=30, what="a lapse")
        with pytest.raises(LeaseLost):
            hc.release(m, wait=False)
