"""The dispatch table as a background capture grows it (torch-free, CPU)."""

from __future__ import annotations

import random
import threading

import pytest
from hypothesis import given, settings, strategies as st

from capture_plan.executor import ExecutorError, PadTable


def _expected(captured: set[int], n: int):
    fits = [s for s in captured if s >= n]
    return min(fits) if fits else None


def test_an_empty_table_serves_nothing_yet_and_says_so():
    table = PadTable("decode", {}, limit=256)
    assert table.sizes == () and table.limit == 256
    assert table.get(1) is None and table.get(256) is None and table.get(257) is None
    with pytest.raises(
        ExecutorError,
        match=r"batch 5 has no captured graph yet \(captured so far: none; "
        r"planned up to 256\)",
    ):
        table[5]
    with pytest.raises(ExecutorError, match="batch 300 is outside the captured sizes 1..256"):
        table[300]


def test_largest_first_landing_serves_every_batch_after_the_first_graph():
    table = PadTable("decode", {}, limit=16)
    assert table.add(16, "g16") == range(1, 17)
    assert [table[n][0] for n in (1, 5, 16)] == [16, 16, 16]
    assert table.add(8, "g8") == range(1, 9)  # tighter padding for n <= 8 only
    assert [table[n][0] for n in (1, 8, 9, 16)] == [8, 8, 16, 16]
    assert table.add(12, "g12") == range(9, 13)
    assert [table[n] for n in (9, 12, 13)] == [(12, "g12"), (12, "g12"), (16, "g16")]
    assert table.sizes == (8, 12, 16)


def test_smallest_first_landing_extends_the_servable_range():
    table = PadTable("decode", {}, limit=8)
    table.add(2, "g2")
    assert table.get(2) == (2, "g2") and table.get(3) is None
    with pytest.raises(ExecutorError, match=r"batch 3 has no captured graph yet \(captured so far: 1..2"):
        table[3]
    table.add(8, "g8")
    assert table[3] == (8, "g8") and table[1] == (2, "g2")


def test_add_refuses_duplicates_and_sizes_beyond_the_limit():
    table = PadTable("decode", {4: "a"}, limit=8)
    with pytest.raises(ExecutorError, match="size 4 was already added"):
        table.add(4, "b")
    with pytest.raises(ExecutorError, match=r"size 9 is outside 1..8"):
        table.add(9, "c")
    with pytest.raises(ExecutorError, match="limit 2 is below the largest size 4"):
        PadTable("decode", {4: "a"}, limit=2)


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(1, 64), min_size=1, max_size=20), st.randoms(use_true_random=False))
def test_growth_in_any_order_always_pads_to_the_smallest_captured_size(sizes, rnd):
    order = sorted(sizes)
    rnd.shuffle(order)
    table = PadTable("p", {}, limit=64)
    landed: set[int] = set()
    for bs in order:
        table.add(bs, f"g{bs}")
        landed.add(bs)
        for n in range(1, 65):
            want = _expected(landed, n)
            got = table.get(n)
            assert (got[0] if got else None) == want
            if want is not None:
                assert got[1] == f"g{want}"
    # the grown table equals one built at once
    whole = PadTable("p", {bs: f"g{bs}" for bs in sizes}, limit=64)
    assert [table.get(n) for n in range(66)] == [whole.get(n) for n in range(66)]


def test_readers_during_growth_see_only_valid_entries():
    """A reader racing the writer gets None or a size that fits and never gets looser."""
    sizes = list(range(256, 0, -8)) + [1, 2, 4]
    table = PadTable("decode", {}, limit=256)
    stop = threading.Event()
    bad: list = []

    def reader():
        rng = random.Random(1)
        last: dict[int, int] = {}
        while not stop.is_set():
            n = rng.randint(1, 256)
            slot = table.get(n)
            if slot is None:
                if n in last:
                    bad.append(("lost", n))
                continue
            bs, entry = slot
            if bs < n or entry != f"g{bs}" or bs > last.get(n, bs):
                bad.append((n, bs, entry, last.get(n)))
            last[n] = bs

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for bs in sizes:
        table.add(bs, f"g{bs}")
    stop.set()
    for t in threads:
        t.join()
    assert not bad, bad[:5]
    assert table[3] == (4, "g4") and table[250] == (256, "g256")
