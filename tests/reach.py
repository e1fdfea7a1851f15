"""Property tests that must reach their states: a state machine counts in ``seen`` how often
its random runs reached each state a rule is about, and a run that never reached one proves
nothing about it."""

from __future__ import annotations

from typing import Any

ROUNDS = 3  # rounds of random runs (each its settings' examples) before a state counts as missed


def run_until_reached(machine: Any, rounds: int = ROUNDS) -> None:
    """Run ``machine``'s random runs (``machine.TestCase``, its settings set) until every state
    in ``machine.seen`` was reached, at most ``rounds`` times: one unlucky draw must not fail,
    a state the runs cannot reach still does."""
    for _ in range(rounds):
        machine.TestCase().runTest()
        if all(machine.seen.values()):
            return
    raise AssertionError(f"the runs did not reach every state in {rounds} rounds: {machine.seen}")
