"""GcPauses (daemon/observe/gc_pauses.py): what exists at start leaves the collector's sight, and
each collection after is counted and timed; stop leaves the collector's callbacks as found."""

from __future__ import annotations

import gc
import weakref

from hicache.daemon.observe import GcPauses


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_start_freezes_what_exists_and_later_cycles_are_still_freed_and_timed():
    pauses, before = GcPauses(), list(gc.callbacks)
    kept = Cycle()  # made before the start: frozen with the rest
    try:
        pauses.start()
        assert pauses.frozen == gc.get_freeze_count() > 0
        assert not any(o is kept for o in gc.get_objects()), "a collection still walks it"
        assert pauses.collections == 0  # (start's own ran before the daemon is ready)
        gc.collect()
        assert pauses.collections == 1 and 0 < pauses.longest_s == pauses.pause_s
        cycle = Cycle()  # made after the start: garbage like any other
        gone = weakref.ref(cycle)
        del cycle
        gc.collect(0)
        assert gone() is None, "a cycle made after the start was not freed"
        assert pauses.collections == 2 and pauses.pause_s > pauses.longest_s
        figures = pauses.counters()
        assert figures["gc_collections"] == 2 and figures["gc_frozen_objects"] == pauses.frozen
    finally:
        pauses.stop()
    assert gc.callbacks == before
    assert gc.get_freeze_count() == 0 and any(o is kept for o in gc.get_objects())
    gc.collect()
    assert pauses.collections == 2  # not timed after stop


def test_a_daemon_freezes_at_start_and_stops_without_leak_reports(tmp_path):
    """A daemon's start freezes what it made (torch's objects among them), and its stop gives
    them back: the interpreter's exit then frees them, and nothing (triton's bindings) prints
    "leaked" lines."""
    from hicache.client import HiCacheClient
    from hicache.client.info_view import sections, text
    from tests.daemon_helpers import start_daemon, stop_daemon

    endpoint = f"ipc://{tmp_path}/d.sock"
    proc = start_daemon(endpoint)
    try:
        with HiCacheClient(endpoint, name="operator") as hc:
            stats = hc.stats()
        assert stats["gc_frozen_objects"] > 50_000
        server = sections({**stats, "gc_pause_seconds_max": 8.6e-05})["server"]  # (`info`)
        assert server["gc_pause_seconds_max"] == 8.6e-05  # a number (--json), shown fixed:
        assert text(server["gc_pause_seconds_max"]) == "0.000086"
        assert text(0.5) == "0.5" and text(2.0) == "2.0" and text(None) == ""
        assert server["gc_frozen_objects"] == stats["gc_frozen_objects"]
    finally:
        said = stop_daemon(proc)
    assert proc.returncode == 0 and "hicache-daemon stopped" in said
    assert "leaked" not in said, said[-2000:]
