"""GcPauses: keep Python's cycle collector off what start-up made, and count its pauses.

A full collection walks every tracked object. A started daemon holds about 185,000 of them
that never become garbage (torch's, numpy's and the other modules', the settings, the pools'
handles), and walking them took 80-100 ms: a request that came then waited that long.
``start`` (before the daemon says it is ready) moves them out of the collector's sight
(``gc.freeze``): a full collection then walks only what serving made since (the tree, the
sessions) and took 3-5 ms in the same run. Collections still run as usual, so cycles made
later are still freed. ``stop`` gives the frozen objects back, so the interpreter's exit
frees them.

Every collection after start's own (before the daemon is ready: no request waits for it, and
it would be the longest, 80-150 ms, for good) is timed through ``gc.callbacks`` (stats
``gc_collections``, ``gc_pause_seconds``, ``gc_pause_seconds_max``). The callbacks run in
whichever of the daemon's threads collects; collections never overlap (the collector holds
the interpreter), and the control loop waits for each, except while a finalizer it runs
releases the interpreter (that time is counted too: an upper bound on the loop's wait).
"""

from __future__ import annotations

import gc
import time


class GcPauses:
    def __init__(self) -> None:
        self.frozen = 0  # objects moved out of the collector's sight at start (gc_frozen_objects)
        self.collections = 0  # collections run since start, all generations (gc_collections)
        self.pause_s = 0.0  # seconds they took (gc_pause_seconds)
        self.longest_s = 0.0  # the longest one (gc_pause_seconds_max)
        self._began = 0.0  # (perf_counter) when the running collection began

    def start(self) -> None:
        """Freeze what exists now and time collections from here. Call once start-up made
        what it makes, before the daemon says it is ready (this takes 0.1-0.2 s)."""
        gc.collect()  # start-up's own garbage goes first: frozen objects are never freed
        gc.freeze()
        self.frozen = gc.get_freeze_count()
        if self._timed not in gc.callbacks:
            gc.callbacks.append(self._timed)

    def stop(self) -> None:
        """Stop timing, and give the frozen objects back to the collector: the interpreter's
        exit frees only what it sees (frozen ones stayed: triton's bindings then printed
        hundreds of "leaked" lines at a stop)."""
        if self._timed in gc.callbacks:
            gc.callbacks.remove(self._timed)
        if self.frozen:
            gc.unfreeze()
            self.frozen = 0

    def counters(self) -> dict[str, float]:
        return {
            "gc_frozen_objects": self.frozen,
            "gc_collections": self.collections,
            "gc_pause_seconds": round(self.pause_s, 6),
            "gc_pause_seconds_max": round(self.longest_s, 6),
        }

    def _timed(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        took = time.perf_counter() - self._began
        self.collections += 1
        self.pause_s += took
        self.longest_s = max(self.longest_s, took)
