"""Session bookkeeping: leases, quarantine, owned pages and locks given back, the service clock."""

import pytest

from hicache.daemon.sessions import ServiceClock, SessionTable
from hicache.protocol import ErrorCode, ProtocolError


def test_messages_renew_the_lease_and_silence_lapses_it_into_quarantine():
    table = SessionTable(lease_s=10, quarantine_s=5)
    a = table.open("engine-a", 101, now=0.0)
    b = table.open("engine-b", 102, now=0.0)
    assert a.id != b.id and a.key != b.key and (a.id, b.id) == (1, 2)  # keys are random
    table.touch(a.key, now=8.0)  # renewed until 18
    assert table.expire(now=12.0) == []  # b lapsed, but stays in quarantine until 15
    assert [s.id for s in table.quarantined()] == [b.id] and len(table) == 1
    with pytest.raises(ProtocolError) as err:
        table.touch(b.key, now=12.5)  # a lapsed session must not act any more
    assert err.value.code is ErrorCode.LEASE_EXPIRED
    ended = table.expire(now=15.5)
    assert [e.session.id for e in ended] == [b.id] and ended[0].reason == "lease expired"
    with pytest.raises(ProtocolError) as err:
        table.touch(b.key, now=16.0)  # still told why, after the quarantine too
    assert err.value.code is ErrorCode.LEASE_EXPIRED
    assert table.touch(a.key, now=17.0) is a
    with pytest.raises(ProtocolError) as err:
        table.touch(a.id, now=17.0)  # the public id is not the key: it names no session
    assert err.value.code is ErrorCode.UNKNOWN_SESSION


def test_a_goodbye_ends_the_quarantine_early():
    table = SessionTable(lease_s=1, quarantine_s=100)
    s = table.open("stalled", 1, now=0.0)
    s.owned.add(7)
    table.expire(now=2.0)
    assert table.quarantined() == [s] and list(table.holders()) == [s]
    assert table.owner_of(7) is s  # its pages are still held
    ended = table.end(s.key)
    assert ended.session is s and table.quarantined() == [] and table.expire(now=3.0) == []


def test_an_ended_session_hands_back_its_pages_and_locks():
    table = SessionTable()
    s = table.open("engine", 1, now=0.0)
    s.owned.update({3, 4, 9})
    lock = s.add_lock("a node")  # any object stands for a lock record here
    s.check_owned([3, 9])
    with pytest.raises(ProtocolError) as err:
        s.check_owned([3, 5])
    assert err.value.code is ErrorCode.NOT_OWNED and "page 5" in str(err.value)
    assert table.owner_of(4) is s and table.owner_of(5) is None
    ended = table.end(s.key)
    assert ended.reason == "goodbye"
    assert ended.session.owned == {3, 4, 9} and list(ended.session.locks) == [lock]
    assert table.end(s.key) is None and len(table) == 0


def test_locks_are_released_once():
    s = SessionTable().open("engine", 1, now=0.0)
    lock = s.add_lock("node")
    assert s.pop_lock(lock) == "node"
    with pytest.raises(ProtocolError) as err:
        s.pop_lock(lock)
    assert err.value.code is ErrorCode.NOT_OWNED
    with pytest.raises(ValueError, match="lease_seconds"):
        SessionTable(lease_s=0)
    with pytest.raises(ValueError, match="quarantine_seconds"):
        SessionTable(lease_s=1, quarantine_s=-1)


def test_the_service_clock_does_not_count_time_the_daemon_was_not_running():
    now = [100.0]
    clock = ServiceClock(max_gap=0.5, source=lambda: now[0])
    start = clock()
    for _ in range(10):  # running: read every 50 ms, every second counts
        now[0] += 0.05
        clock()
    assert clock() - start == pytest.approx(0.5)
    now[0] += 30.0  # SIGSTOP, a frozen VM, one long operation: only max_gap of it counts
    assert clock() - start == pytest.approx(1.0)
    assert clock.skipped == pytest.approx(29.5)
    with pytest.raises(ValueError):
        ServiceClock(max_gap=0)


def test_a_paused_daemon_keeps_sessions_that_beat_before_the_pause():
    now = [0.0]
    clock = ServiceClock(max_gap=0.5, source=lambda: now[0])
    table = SessionTable(lease_s=2, quarantine_s=0)
    s = table.open("engine", 1, clock())
    now[0] += 1.0
    table.touch(s.key, clock())  # its last beat before the pause: lease until 3 (service time)
    now[0] += 10.0  # paused for 5 leases
    assert table.expire(clock()) == [] and len(table) == 1  # resumed: the beats are still queued
    assert table.touch(s.key, clock()) is s


def test_sessions_are_bounded():
    table = SessionTable(max_sessions=2)
    table.open("a", 1, now=0.0)
    table.open("b", 1, now=0.0)
    with pytest.raises(ProtocolError) as err:
        table.open("c", 1, now=0.0)
    assert err.value.code is ErrorCode.QUOTA_EXCEEDED
