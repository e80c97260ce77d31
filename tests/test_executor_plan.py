"""The executor's torch-free parts on CPU: plan loading, fingerprints, the dispatch table
(the collector freeze: tests/test_executor_heap.py).

Executor parts that run without a GPU: plan loading, fingerprints, dispatch.

The dispatch table as a background capture grows it (torch-free, CPU)."""

from __future__ import annotations

import random
import threading
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from capture_plan.executor import (
    Environment,
    EnvironmentMismatch,
    ExecutorError,
    PadTable,
    check_environment,
    load_plan,
)
from capture_plan.planner import plan_bytes
from capture_plan.schemas.errors import InputError

H200 = Environment("NVIDIA H200", (9, 0), "2.11.0+cu130", frozenset({"fa3_fwd_interface", "torch"}))


@pytest.fixture
def plans(tmp_path, built) -> dict[str, Path]:
    """Fresh files for each test (tests edit them), the plans built once a session."""
    out = {}
    for name, kw in {"ci": dict(backend="fa3", ci=True), "dev": dict(backend="fa3")}.items():
        path = tmp_path / f"{name}.json"
        path.write_bytes(plan_bytes(built(**kw)))
        out[name] = path
    return out


def test_load_plan_accepts_a_fitting_machine(plans):
    plan = load_plan(plans["ci"], env=H200)
    assert plan.requires.modules == ["flash_attn_interface", "fa3_fwd_interface"]
    assert check_environment(plan, H200) == []


def test_mismatch_is_an_error_for_ci_plans_and_a_warning_otherwise(plans):
    a100 = Environment("NVIDIA A100", (8, 0), "2.3.0", frozenset({"torch"}))
    with pytest.raises(
        EnvironmentMismatch,
        match=r"ci.json: plan does not fit this machine: needs compute "
        r"capability >= 9.0, this is NVIDIA A100 \(8.0\); needs torch "
        r">=2.4, this is 2.3.0; backend fa3 kernels not importable",
    ):
        load_plan(plans["ci"], env=a100)
    with pytest.warns(UserWarning, match="plan does not fit this machine"):
        load_plan(plans["dev"], env=a100)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_plan(plans["dev"], env=H200)


def test_tampered_truncated_and_newer_plans(plans):
    path = plans["ci"]
    text = path.read_text()
    path.write_text(text.replace('"outputs": "view"', '"outputs": "keep"', 1))
    with pytest.raises(InputError, match="digest mismatch"):
        load_plan(path, env=H200)
    path.write_text(text[:-200])
    with pytest.raises(InputError, match="truncated or corrupted"):
        load_plan(path, env=H200)
    path.write_text(text.replace('"version": 1', '"version": 2', 1))
    with pytest.raises(InputError, match="newer than this capture-plan understands.*fix: upgrade capture-plan"):
        load_plan(path, env=H200)
    with pytest.raises(InputError, match="cannot read plan"):
        load_plan(path.with_name("nope.json"), env=H200)


def test_a_newer_revision_with_unknown_fields_still_loads(plans):
    import msgspec

    from capture_plan.schemas.codec import canonical_bytes, plan_digest

    raw = msgspec.json.decode(plans["ci"].read_bytes())
    raw["revision"] = 99
    raw["future_field"] = {"x": 1}
    raw["digest"] = plan_digest(raw)
    plans["ci"].write_bytes(canonical_bytes(raw))
    assert load_plan(plans["ci"], env=H200).revision == 99
    raw["future_field"] = {"x": 2}  # the digest covers fields this reader does not know
    plans["ci"].write_bytes(canonical_bytes(raw))
    with pytest.raises(InputError, match="digest mismatch"):
        load_plan(plans["ci"], env=H200)


def test_pad_table_dispatch():
    table = PadTable("decode", {1: "g1", 2: "g2", 4: "g4", 8: "g8", 24: "g24"})
    assert [table[n][0] for n in (1, 2, 3, 4, 5, 8, 9, 23, 24)] == [1, 2, 4, 4, 8, 8, 24, 24, 24]
    assert table[3][1] == "g4"
    for bad in (0, -1, 25, 10**6):
        with pytest.raises(ExecutorError, match=f"batch {bad} is outside the captured sizes 1..24"):
            table[bad]


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
