"""`storage.memory`: the one gate on bytes in flight and the worker policies."""

from __future__ import annotations

import os
import threading

import pytest

from orbax_maxtext_layout.storage.memory import (
    CONVERT,
    DEFAULT_BUDGET,
    EXPORT,
    IMPORT,
    MERGE,
    Gate,
    Stopped,
    Workers,
    cores,
)


def _waits(fn) -> tuple[threading.Thread, list]:
    """``fn`` on a thread of its own, and what it returned once it did."""
    got: list = []
    t = threading.Thread(target=lambda: got.append(fn()), daemon=True)
    t.start()
    t.join(0.2)
    return t, got


def test_a_claim_waits_until_it_fits_and_one_over_the_limit_passes_alone():
    gate = Gate(10)
    gate.take(6)
    t, got = _waits(lambda: gate.take(6))
    assert t.is_alive() and not got  # 12 > 10
    gate.give(6)
    t.join(5)
    assert got == [6]
    gate.give(6)
    assert gate.take(25) == 25 and gate.used == 25  # nothing held: passes, uncapped
    t, got = _waits(lambda: gate.take(1))
    assert t.is_alive()
    gate.give(25)
    t.join(5)
    assert got == [1]


def test_spare_capped_claims_and_lanes():
    gate = Gate(10)
    gate.take(4)
    t, _ = _waits(lambda: gate.take(4, spare=3))  # 4 + 4 + 3 > 10
    assert t.is_alive()
    gate.give(4)
    t.join(5)
    assert gate.used == 4
    capped = Gate(10, cap=True)
    assert capped.take(30) == 10  # holds the limit
    # A lane: a claim that does not fit still passes once nothing is active in its lane.
    gate.count("tasks", 1)
    t, got = _waits(lambda: gate.take(9, lane="tasks"))
    assert t.is_alive()
    gate.count("tasks", -1)
    t.join(5)
    assert got == [9] and gate.used == 13


def test_stop_wakes_every_waiter():
    gate = Gate(1)
    gate.take(1)
    errors = []

    def wait():
        try:
            gate.take(1)
        except Stopped as e:
            errors.append(e)

    threads = [threading.Thread(target=wait) for _ in range(3)]
    for t in threads:
        t.start()
    gate.stop()
    for t in threads:
        t.join(5)
    assert len(errors) == 3
    with pytest.raises(Stopped):
        gate.take(0)


def test_worker_policies():
    n = len(os.sched_getaffinity(0))
    assert cores() == n
    assert Workers().count() == n
    assert IMPORT.count() == max(1, min(8, 2 * n))
    assert MERGE.count() == max(1, min(2, n))
    assert (CONVERT.count(), EXPORT.count()) == (3, 2)  # fixed: measured, or recorded
    assert DEFAULT_BUDGET == 1 << 30
