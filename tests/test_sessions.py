"""Session bookkeeping: leases, quarantine, owned pages and locks given back, the service clock."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hicache.daemon.sessions import ServiceClock, SessionTable
from hicache.protocol import ErrorCode, ProtocolError
from tests.daemon_helpers import wait_until


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


def test_one_session_cannot_pin_the_pool_by_locking_what_it_inserted(tmp_path):
    """s10 (pin): insert_and_lock a share at a time pinned 16,368 of 16,384 device tokens.
    Pages a lock makes unevictable count with the session's owned pages; another engine still
    gets room, and what the lock released counts no more."""
    import numpy as np

    from hicache.client import DaemonError, HiCacheClient
    from tests.daemon_helpers import start_daemon, stop_daemon

    ep = f"ipc://{tmp_path}/d.sock"
    # 256 device tokens, page 4: a session may hold 192. write_back: an insert starts no backup
    # (a backup's lock protects pages while it runs, and the lock then pins nothing new)
    proc = start_daemon(ep, "--write-policy", "write_back")
    try:
        with HiCacheClient(ep, name="pinner") as hc, HiCacheClient(ep, name="victim") as v:
            limit = hc.info["limits"]["max_owned_pages"] * hc.config.page_size
            pinned, base, held, refused = 0, 1000, [], None
            while refused is None and pinned < hc.config.device_tokens:
                try:
                    seq = np.arange(base, base + 32, dtype=np.int32)
                    held.append(hc.insert_and_lock(seq, hc.alloc(32)).match)
                    pinned, base = pinned + 32, base + 32
                except DaemonError as exc:
                    refused = exc
            assert refused is not None and refused.code is ErrorCode.QUOTA_EXCEEDED
            assert "pinned by its locks" in refused.message
            assert pinned <= limit
            v.alloc(v.config.device_tokens - limit - 16)  # what the pinner could not take
            stats = hc.stats(check=True)
            assert stats["integrity"] == "ok"
            plain = np.arange(50_000, 50_032, dtype=np.int32)  # insert, then lock by a match
            hc.release(*held)
            hc.insert(plain, hc.alloc(32))
            m = hc.match_prefix(plain)  # pins what no lock held: charged like the inserts were
            mine = [s for s in hc.stats()["session_list"] if s["client"] == "pinner"][0]
            assert mine["pinned_pages"] == 32 // hc.config.page_size
            hc.release(m)
            mine = [s for s in hc.stats()["session_list"] if s["client"] == "pinner"][0]
            assert mine["pinned_pages"] == 0
    finally:
        stop_daemon(proc)


def test_one_connection_cannot_take_every_session():
    """s10 (sessions): one socket opened 4096 sessions in 0.7 s; every new engine was refused."""
    from hicache.daemon.sessions import MAX_SESSIONS_PER_PEER

    table = SessionTable(max_sessions=4 * MAX_SESSIONS_PER_PEER)
    mine = [table.open("x", 1, 0.0, peer=b"attacker") for _ in range(MAX_SESSIONS_PER_PEER)]
    with pytest.raises(ProtocolError) as err:
        table.open("x", 1, 0.0, peer=b"attacker")
    assert err.value.code is ErrorCode.QUOTA_EXCEEDED and "connection" in str(err.value)
    table.open("engine", 2, 0.0, peer=b"engine")  # another connection still gets in
    table.end(mine[0].key)
    table.open("x", 1, 0.0, peer=b"attacker")  # an ended one frees its place
    table.expire(10.0)  # every lease ran out: quarantined, still counted
    with pytest.raises(ProtocolError):
        table.open("x", 1, 10.0, peer=b"attacker")
    assert len(table.expire(1000.0)) == MAX_SESSIONS_PER_PEER + 1  # given back: uncounted
    table.open("x", 1, 1000.0, peer=b"attacker")


def test_locks_of_all_sessions_together_are_bounded():
    """s10 (locks): 65,536 locks per session x 4096 sessions allowed ~46 GiB; every session's
    locks now count against one daemon-wide bound, said at start with what it costs."""
    from hicache.daemon.sessions import SessionLimits

    limits = SessionLimits.for_pool(1024, max_locks=100)
    assert limits.max_total_locks == 65536  # (the floor; 64 per device page above it)
    assert SessionLimits.for_pool(1 << 22).max_total_locks == 1 << 20
    # (hostile review) one session cannot take them all: at most a quarter each
    small = SessionLimits.for_pool(16)
    assert small.max_locks * 4 <= small.max_total_locks == 65536
    limits = SessionLimits(max_owned_pages=10, max_locks=100, max_loads=1, max_total_locks=150)
    table = SessionTable()
    a, b = table.open("a", 1, 0.0), table.open("b", 1, 0.0)
    for _ in range(100):
        a.add_lock("node")
    limits.check_locks(b, 50)
    for _ in range(50):
        b.add_lock("node")
    with pytest.raises(ProtocolError, match="for all sessions") as err:
        limits.check_locks(b, 1)
    assert err.value.code is ErrorCode.QUOTA_EXCEEDED
    assert a.drop_locks() == ["node"] * 100 and table.locks == [50]
    limits.check_locks(b, 50)
    assert "150 in all" in limits.describe(4096)
    said = "4096 sessions (16 per connection, 1024 per CurveZMQ key, ipc process or local user"
    assert said in limits.describe(4096)


def test_one_client_key_cannot_take_every_session_over_many_connections():
    """s10 (sessions), spread over connections: a CurveZMQ key holds at most its share."""
    table = SessionTable(max_sessions=256)
    assert table.max_per_user == 64
    held = [table.open("x", 1, 0.0, peer=b"c%d" % (i // 16), user="k1") for i in range(64)]
    with pytest.raises(ProtocolError) as err:
        table.open("x", 1, 0.0, peer=b"fresh", user="k1")
    assert err.value.code is ErrorCode.QUOTA_EXCEEDED and "client key" in str(err.value)
    table.open("engine", 2, 0.0, peer=b"engine", user="k2")  # another key gets in
    table.open("local", 3, 0.0, peer=b"ipc")  # no key (ipc): only the per-connection bound
    table.end(held[0].key)
    table.open("x", 1, 0.0, peer=b"fresh", user="k1")  # an ended one frees its place


def test_one_client_key_holds_at_most_one_share_of_the_pool_over_its_sessions():
    """Each session is held to its share of the pool; so is every session of one CurveZMQ
    key together, or one client would pin the whole pool a share per session."""
    from hicache.daemon.sessions import SessionLimits
    from hicache.errors import IntegrityError

    table = SessionTable()
    limits = SessionLimits.for_pool(100, owned_fraction=0.5)  # 50 pages per session or key
    a, b = (table.open("x", 1, 0.0, peer=b"c%d" % i, user="k1") for i in range(2))
    other = table.open("engine", 2, 0.0, peer=b"e", user="k2")
    local, local2 = table.open("ipc", 3, 0.0, peer=b"i"), table.open("ipc", 3, 0.0, peer=b"j")
    a.owned.update(range(30))
    a.pinned_pages = 10
    limits.check_owned(b, 10)  # 40 + 10: the key's share exactly
    with pytest.raises(ProtocolError) as err:
        limits.check_owned(b, 11)
    assert err.value.code is ErrorCode.QUOTA_EXCEEDED
    assert "2 sessions of this client key would hold 51" in str(err.value)
    limits.check_owned(other, 50)  # another key has its own share
    local.owned.update(range(50))
    limits.check_owned(local2, 50)  # no key (ipc: the daemon's own user): per session only
    table.check_integrity()
    table.end(a.key)  # an ended session's pages are no longer the key's
    limits.check_owned(b, 50)
    assert b.fellows == [b] and other.fellows == [other] and local.fellows == []
    table.check_integrity()
    b.fellows.append(other)  # (a corrupted list is caught)
    with pytest.raises(IntegrityError):
        table.check_integrity()


def test_one_process_cannot_take_every_session_over_many_ipc_connections():
    """s10 (sessions) on ipc: the kernel's pid of each connection (SO_PEERCRED) bounds one
    process's sessions over all its connections to a quarter of max_sessions; another process
    still gets in, an ended session frees its place, and the counts are checked."""
    from hicache.errors import IntegrityError

    table = SessionTable(max_sessions=256)
    held = [table.open("x", 1, 0.0, peer=b"c%d" % (i // 16), process="77@5") for i in range(64)]
    with pytest.raises(ProtocolError) as err:
        table.open("x", 1, 0.0, peer=b"fresh", process="77@5")
    assert err.value.code is ErrorCode.QUOTA_EXCEEDED and "process (pid 77)" in str(err.value)
    assert table.open("engine", 2, 0.0, peer=b"engine", process="78@5").fellows == []  # no share
    table.open("later", 3, 0.0, peer=b"later", process="77@9")  # the pid again: another process
    table.check_integrity()
    table.end(held[0].key)
    table.open("x", 1, 0.0, peer=b"fresh", process="77@5")
    table.check_integrity()
    held[1].process = "79@5"  # (a session counted under another process is caught)
    with pytest.raises(IntegrityError, match="per process"):
        table.check_integrity()


def test_the_daemon_counts_ipc_sessions_by_the_kernels_pid(tmp_path):
    """End to end: the pid a hello claims is not what counts, the connection's is, with its
    start time (a pid the kernel gives again later is another process)."""
    import json
    import os
    import subprocess
    import sys

    import msgpack
    import zmq

    from hicache.daemon.transport import peer_pid, process_of
    from hicache.protocol import PROTOCOL_VERSION, Op, decode_reply
    from tests.daemon_helpers import start_daemon, stop_daemon

    assert peer_pid("localhost:0:0:4242") == 4242
    assert peer_pid("127.0.0.1:5555") == peer_pid("") == peer_pid("a:b:c:d") == 0
    me = process_of(os.getpid())
    with open("/proc/self/stat") as f:
        assert me == f"{os.getpid()}@{f.read().rsplit(')', 1)[1].split()[19]}"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert process_of(int(gone.stdout)) == f"{int(gone.stdout)}@?" and process_of(0) == ""
    ep = f"ipc://{tmp_path}/d.sock"
    proc = start_daemon(ep, "--max-sessions", "64", "--keep-host", "false")  # 16 per process
    socks = []

    def hello(claimed_pid: int):  # noqa: ANN202
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 20000)
        sock.connect(ep)
        socks.append(sock)
        fields = {"client": "many", "pid": claimed_pid}
        sock.send(msgpack.packb([PROTOCOL_VERSION, int(Op.HELLO), 1, 0, 0, fields]))
        return decode_reply(sock.recv())

    try:
        replies = [hello(1000 + i) for i in range(17)]  # a connection each, pids made up
        assert all(r.ok for r in replies[:16])
        assert replies[16].status is ErrorCode.QUOTA_EXCEEDED
        assert f"process (pid {os.getpid()})" in str(replies[16].fields)
        other = subprocess.run(
            [sys.executable, "-c", "import json\nfrom hicache.client import HiCacheClient as C\n"
             f"with C({ep!r}, name='other') as c: print(json.dumps(c.stats()['session_list']))"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        listed = json.loads(other.stdout)  # (another process gets in, and lists them all)
        many = [s for s in listed if s["client"] == "many"]
        assert sorted(s["pid"] for s in many) == list(range(1000, 1016))  # as claimed
        assert {s["peer_pid"] for s in many} == {os.getpid()}  # the kernel's
        assert {s["peer_pid"] for s in listed if s["client"] == "other"} - {os.getpid()}
    finally:
        for sock in socks:
            sock.close()
        stop_daemon(proc)


def test_a_killed_process_its_parent_has_not_waited_for_is_gone():
    """A zombie keeps its /proc entry and start time: it is still gone."""
    from hicache.daemon.transport import process_alive, process_of

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        named = process_of(child.pid)
        assert process_alive(named)
        child.kill()
        stat = Path(f"/proc/{child.pid}/stat")
        wait_until(lambda: b") Z " in stat.read_bytes(), timeout=30, what="a zombie")
        assert not process_alive(named)
    finally:
        child.kill()
        child.wait()


def test_sessions_of_a_process_that_ended_go_to_quarantine_and_others_stay():
    from hicache.daemon.transport import process_alive, process_of

    table = SessionTable(lease_s=60.0, quarantine_s=5.0)
    mine = process_of(os.getpid())
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    theirs = process_of(dead.pid)
    dead.wait()
    a = table.open("live", 1, 0.0, process=mine)
    b = table.open("killed", 2, 0.0, process=theirs)
    c = table.open("unknown", 3, 0.0, process=f"{dead.pid}@?")  # (/proc did not show it)
    assert process_alive(mine) and not process_alive(theirs) and process_alive(f"{dead.pid}@?")
    assert not process_alive(mine.split("@")[0] + "@1")  # the pid, another start: another one
    gone = table.orphaned(1.0, process_alive)
    assert [s.id for s in gone] == [b.id] and b.ending == f"its process (pid {dead.pid}) ended"
    assert table.live(a.key, 1.0) is a and table.live(c.key, 1.0) is c
    assert table.live(b.key, 1.0) is None and table.quarantined() == [b]
    assert [e.session.id for e in table.expire(6.5)] == [b.id]  # after its quarantine
    table.check_integrity()
