"""The early stop of a start-up's graph copies (executor/node_bytes.py, profiling._settles):
when the driver's bytes per node are bounded well enough to predict the copies not made,
and when it refuses (too few readings, readings no one figure explains)."""

from __future__ import annotations

import math

from hypothesis import given, strategies as st

from capture_plan.executor.node_bytes import MIN_READINGS, STEP, NodeBytes

MiB = 2**20


def _driver(per_node: float, offset: int):
    """A driver that takes memory in 2 MiB steps, ``offset`` bytes of its current step used
    before the copies: the bytes taken after ``n`` nodes."""
    return lambda n: STEP * math.ceil((offset + per_node * n) / STEP) - STEP * math.ceil(offset / STEP)


@given(
    per_node=st.floats(2000, 4000),
    offset=st.integers(0, STEP - 1),
    nodes=st.lists(st.integers(300, 2000), min_size=1, max_size=60),
    remaining=st.integers(0, 100_000),
)
def test_the_error_bound_holds_for_a_driver_in_2_mib_steps(per_node, offset, nodes, remaining):
    """Predicting ``remaining`` more nodes at the last reading's bytes a node is never off
    by more than ``error`` says, whatever the true figure and where in a step it started."""
    take, bounds, total = _driver(per_node, offset), NodeBytes(), 0
    for n in nodes:
        total += n
        bounds.add(total, take(total))
    assert bounds.consistent
    n, t = bounds.readings[-1]
    off = abs(t / n * remaining - per_node * remaining)
    assert off <= bounds.error(remaining) + 1e-6 * max(1, remaining)


def test_it_settles_once_the_copies_left_are_within_the_budget():
    take, bounds, total = _driver(2900.0, 123_456), NodeBytes(), 0
    per_copy, want, settled_at = 650, 48, None
    for made in range(1, want + 1):
        total += per_copy
        bounds.add(total, take(total))
        if bounds.settled((want - made) * per_copy, 1 * MiB):
            settled_at = made
            break
    assert settled_at is not None and settled_at < want  # fewer copies than the plan captures
    assert bounds.error((want - settled_at) * per_copy) <= 1 * MiB
    # one copy earlier, the bound was not yet within the budget (it stopped at the first it could)
    early = NodeBytes(readings=[], lo=0.0, hi=math.inf)
    for n, t in bounds.readings[:-1]:
        early.add(n, t)
    assert not early.settled((want - settled_at + 1) * per_copy, 1 * MiB)


def test_it_refuses_before_enough_readings_took_memory():
    bounds = NodeBytes()
    for i in range(1, MIN_READINGS):
        bounds.add(i * 10_000, i * 10_000 * 3000)
    assert bounds.error(10) < 1 * MiB  # narrow enough, but too few readings to show it stable
    assert not bounds.settled(10, 1 * MiB)
    bounds.add(MIN_READINGS * 10_000, MIN_READINGS * 10_000 * 3000)
    assert bounds.settled(10, 1 * MiB)


def test_it_refuses_readings_no_single_figure_explains():
    """A driver that took a large block at one copy (not linear in nodes) empties the
    interval: never settled, whatever the budget, and the reason says so."""
    bounds = NodeBytes()
    for i in range(1, 6):
        bounds.add(i * 1000, i * 1000 * 3000)
    bounds.add(6000, 6000 * 3000 + 64 * MiB)
    assert not bounds.consistent
    assert bounds.error(1) == math.inf and not bounds.settled(1, 1e18)
    assert "inconsistent" in bounds.describe()


def test_nothing_left_is_always_settled_and_no_reading_never_is():
    assert NodeBytes().settled(0, 0)
    assert not NodeBytes().settled(1, 1e18)
