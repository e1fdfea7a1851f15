"""LayerProgress: how many layers of each load are on the device, readable from other processes.

A table of ``capacity`` int64 words in memory the daemon shares (POSIX shared memory on the
CPU); load ``ticket`` owns word ``ticket % capacity`` and the word holds
``ticket << LAYER_BITS | layers_done``. One aligned 8-byte store publishes both halves at once,
so a reader never sees a new ticket with an old count. The writer (the transfer engine) stores
after each layer's copy has finished (on CUDA: after the layer's event completed), as a release
store; readers load with acquire order, so KV a reader sees announced is KV it can read.

A word is reused by ticket + capacity only once the older load has finished, so a reader that
finds a larger ticket in its word knows its own load finished long ago.
"""

from __future__ import annotations

import time

import numpy as np

from hicache.tree import load_acquire, store_release
from hicache.types import Ticket

LAYER_BITS = 16  # up to 65535 layers
LAYER_MASK = (1 << LAYER_BITS) - 1
FAILED = LAYER_MASK  # the layer count of a load whose copy raised
DEFAULT_CAPACITY = 4096  # loads that can be in flight at once (more are delayed, not lost)
SPIN_S = 50e-6  # first waits spin this long, then back off to sleeping


class LoadFailed(RuntimeError):
    """The copy of a load raised: its device pages hold garbage."""


class LayerProgress:
    """Writer and reader of one progress table. ``words`` is an int64 array of ``capacity``."""

    def __init__(self, words: np.ndarray, num_layers: int):
        if words.dtype != np.int64 or words.ndim != 1 or not len(words):
            raise ValueError("progress table: expected a non-empty 1-D int64 array")
        if not 0 < num_layers < FAILED:
            raise ValueError(f"num_layers: must be in [1, {LAYER_MASK}]")
        self.words = words
        self.capacity = len(words)
        self.num_layers = num_layers

    # ---- writer (the transfer engine's thread) ----------------------------------------------
    def can_start(self, ticket: Ticket) -> bool:
        """Whether the word of ``ticket`` is free: its previous load (if any) finished."""
        word = load_acquire(self.words, ticket % self.capacity)
        return word == 0 or (word & LAYER_MASK) >= self.num_layers

    def publish(self, ticket: Ticket, layers_done: int) -> None:
        """Record that the first ``layers_done`` layers of load ``ticket`` are on the device
        (``FAILED``: the copy raised)."""
        store_release(self.words, ticket % self.capacity, (ticket << LAYER_BITS) | layers_done)

    # ---- reader (any process: a ticket is a Ticket, or the int a client was sent) ------------
    def layers_done(self, ticket: int) -> int:
        """Layers of load ``ticket`` on the device (num_layers once finished, 0 if not started).
        Raises LoadFailed when its copy raised."""
        word = load_acquire(self.words, ticket % self.capacity)
        owner = word >> LAYER_BITS
        if owner > ticket:  # the word was reused: this load finished before
            return self.num_layers
        if owner < ticket:
            return 0
        layers = word & LAYER_MASK
        if layers == FAILED:
            raise LoadFailed(f"load {ticket} failed: its KV is not on the device")
        return layers

    def wait_layer(self, ticket: int, layer: int, timeout: float | None = None) -> bool:
        """Block until ``layer`` of load ``ticket`` is on the device; False on timeout.
        Raises LoadFailed when the copy raised, ValueError for a layer out of range.

        Spins briefly (a layer often lands within microseconds), then sleeps in growing steps
        up to a millisecond: a reader never burns a core for long.
        """
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} outside [0, {self.num_layers})")
        start = time.perf_counter()
        pause = 0.0
        while self.layers_done(ticket) <= layer:
            waited = time.perf_counter() - start
            if timeout is not None and waited >= timeout:
                return False
            if waited > SPIN_S:
                pause = min(max(pause * 2, 20e-6), 1e-3)
                time.sleep(pause)
        return True
