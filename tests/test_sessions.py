"""Session bookkeeping: leases, owned pages and locks given back when a session ends."""

import pytest

from hicache.daemon.sessions import SessionTable
from hicache.protocol import ErrorCode, ProtocolError


def test_messages_renew_the_lease_and_silence_expires_it():
    table = SessionTable(lease_s=10)
    a = table.open("engine-a", 101, now=0.0)
    b = table.open("engine-b", 102, now=0.0)
    assert a.id != b.id
    table.touch(a.id, now=8.0)  # renewed until 18
    ended = table.expire(now=12.0)
    assert [e.session.id for e in ended] == [b.id] and ended[0].reason == "lease expired"
    assert table.touch(a.id, now=17.0) is a
    with pytest.raises(ProtocolError) as err:
        table.touch(b.id, now=12.5)
    assert err.value.code is ErrorCode.UNKNOWN_SESSION


def test_an_ended_session_hands_back_its_pages_and_locks():
    table = SessionTable()
    s = table.open("engine", 1, now=0.0)
    s.owned.update({3, 4, 9})
    lock = s.add_lock(node="a node")  # any object stands for a tree node here
    s.check_owned([3, 9])
    with pytest.raises(ProtocolError) as err:
        s.check_owned([3, 5])
    assert err.value.code is ErrorCode.NOT_OWNED
    assert table.owner_of(4) is s and table.owner_of(5) is None
    ended = table.end(s.id)
    assert ended.reason == "goodbye"
    assert ended.session.owned == {3, 4, 9} and list(ended.session.locks) == [lock]
    assert table.end(s.id) is None and len(table) == 0


def test_locks_are_released_once():
    s = SessionTable().open("engine", 1, now=0.0)
    lock = s.add_lock("node")
    assert s.pop_lock(lock) == "node"
    with pytest.raises(ProtocolError) as err:
        s.pop_lock(lock)
    assert err.value.code is ErrorCode.NOT_OWNED
    with pytest.raises(ValueError, match="lease_seconds"):
        SessionTable(lease_s=0)
