"""capture_plan.executor.heap: the collector is frozen, not run, and an engine's own freeze is kept (CPU)."""

from __future__ import annotations

import gc

import pytest

from capture_plan.executor.heap import Frozen, collect_young


@pytest.fixture(autouse=True)
def _clean_freeze():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_frozen_freezes_and_thaws_without_collecting():
    before = gc.get_stats()[2]["collections"]
    keep = [[i] for i in range(1000)]
    with Frozen():
        assert gc.get_freeze_count() >= len(keep)
    assert gc.get_freeze_count() == 0
    assert gc.get_stats()[2]["collections"] == before  # no full collection


def test_thaw_on_another_thread():
    import threading

    f = Frozen().__enter__()
    assert gc.get_freeze_count() > 0
    t = threading.Thread(target=f.thaw)
    t.start()
    t.join()
    assert gc.get_freeze_count() == 0
    f.thaw()  # idempotent


def test_an_engine_freeze_is_left_alone():
    gc.freeze()
    engine = gc.get_freeze_count()
    with Frozen():
        pass
    assert gc.get_freeze_count() == engine
    gc.unfreeze()
    f = Frozen().__enter__()
    objs = [[i] for i in range(100)]  # noqa: F841 -- the engine freezes more meanwhile
    gc.freeze()
    more = gc.get_freeze_count()
    f.thaw()
    assert gc.get_freeze_count() == more


def test_a_disabled_collector_is_not_frozen():
    gc.disable()
    try:
        with Frozen():
            assert gc.get_freeze_count() == 0
    finally:
        gc.enable()


def test_collect_young_frees_a_fresh_cycle_without_a_full_collection():
    import weakref

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a
    ref = weakref.ref(a)
    del a, b
    full = gc.get_stats()[2]["collections"]
    assert collect_young() >= 2
    assert ref() is None
    assert gc.get_stats()[2]["collections"] == full
