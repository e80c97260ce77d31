"""Few-size traces: exact derivation of the unrecorded sizes, and refusals that name sizes."""

from __future__ import annotations

import pathlib

import msgspec
import pytest
from hypothesis import given, settings, strategies as st

from capture_plan.planner import BuildOptions, build_plan
from capture_plan.planner.program import Alloc
from capture_plan.planner.workload import Workload
from capture_plan.schemas.errors import InputError
from capture_plan.schemas.spec import Phase
from capture_plan.schemas.trace import CaptureTrace, Event, Trace, default_samples

ROOT = pathlib.Path(__file__).resolve().parent.parent
H200 = ROOT / "plans/traces/fa3-ci.json"


def _h200() -> Trace:
    return msgspec.json.decode(H200.read_bytes(), type=Trace)


def _sizes(w: Workload, phase: str, bs: int) -> list[int | None]:
    """Each op's size, None for a free."""
    return [op.size if isinstance(op, Alloc) else None for op in w.programs[(phase, bs)].prologue]


def test_three_recorded_h200_sizes_give_every_other_size_exactly():
    """The H200 trace of all 36 sizes: 3 of them predict the other 33 event for event."""
    full = _h200()
    sizes = sorted(c.bs for c in full.captures)
    phase = Phase(name="decode", kind="decode", sizes=sizes)
    keep = default_samples(sizes)
    assert keep == [1, 120, 256]
    few = Trace(captures=[c for c in full.captures if c.bs in keep])
    w_full = Workload.from_trace(full, [phase], "full")
    w_few = Workload.from_trace(few, [phase], "few")
    for bs in sizes:
        assert _sizes(w_few, "decode", bs) == _sizes(w_full, "decode", bs), bs
    measured, derived = w_few.samples["decode"]
    assert measured == (1, 120, 256) and len(derived) == 33 and 2 in derived


def test_plan_from_three_sizes_equals_plan_from_all(tmp_path):
    full = _h200()
    keep = default_samples([c.bs for c in full.captures])
    few_path = tmp_path / "few.json"
    few_path.write_bytes(msgspec.json.encode(Trace(captures=[c for c in full.captures if c.bs in keep])))
    a = build_plan(BuildOptions(backend="fa3", ci=True, trace=H200)).predicted
    b = build_plan(BuildOptions(backend="fa3", ci=True, trace=few_path)).predicted
    assert (a.pool_bytes, a.pools, a.timeline, a.baseline_bytes, a.largest_graph_bytes) == (
        b.pool_bytes,
        b.pools,
        b.timeline,
        b.baseline_bytes,
        b.largest_graph_bytes,
    )
    assert b.samples["decode"].measured == [1, 120, 256] and len(b.samples["decode"].derived) == 33
    assert a.samples["decode"].derived == [] and len(a.samples["decode"].measured) == 36


def _cap(bs: int, sizes: list[int], extra: int = 0) -> CaptureTrace:
    """A capture allocating ``sizes`` (freeing all but the last, the output)."""
    ev = []
    for i, s in enumerate(sizes):
        ev.append(Event(op="alloc", id=i, size=s, kind="output" if i == len(sizes) - 1 else "temp"))
    for i in range(extra):  # a kernel that switches algorithm: one more temporary
        ev.append(Event(op="alloc", id=100 + i, size=512))
        ev.append(Event(op="free", id=100 + i))
    ev += [Event(op="free", id=i) for i in range(len(sizes) - 1)]
    return CaptureTrace(phase="decode", bs=bs, events=ev)


def _fit(samples: dict[int, CaptureTrace], planned: list[int]) -> Workload:
    return Workload.from_trace(
        Trace(captures=list(samples.values())), [Phase(name="decode", kind="decode", sizes=planned)], "t.json"
    )


def _fa3_workspace(bs: int) -> int:
    return 4 * (3 * -(-bs // 4) * 4 + 1)  # FA3's scheduler metadata: batch padded to 4


def test_padded_batch_is_fitted_exactly():
    f = lambda bs: [8192 * bs, _fa3_workspace(bs), 4096, 2 * bs]  # noqa: E731
    w = _fit({bs: _cap(bs, f(bs)) for bs in (1, 7, 64)}, list(range(1, 65)))
    for bs in range(1, 65):
        assert _sizes(w, "decode", bs)[:4] == f(bs), bs


def test_samples_that_do_not_line_up_name_the_sizes_to_record():
    caps = {
        1: _cap(1, [10, 20]),
        8: _cap(8, [80, 160]),
        64: _cap(64, [640, 1280], extra=1),
        128: _cap(128, [1280, 2560], extra=1),
    }
    with pytest.raises(InputError) as err:
        _fit(caps, [1, 2, 4, 8, 16, 32, 64, 128])
    msg = str(err.value)
    assert "sizes [1, 8] and [64, 128] do not line up" in msg and "[16, 32] cannot be derived" in msg
    assert "fix: record the sizes between 8 and 64 ([16, 32])" in msg
    # sizes inside an aligned run are still fine; the gap is what is refused
    w = _fit(
        {**caps, 4: _cap(4, [40, 80]), 16: _cap(16, [160, 320]), 32: _cap(32, [320, 640])}
        | {97: _cap(97, [970, 1940], extra=1)},
        [1, 2, 4, 8, 16, 32, 64, 97, 100, 128],
    )
    assert _sizes(w, "decode", 2)[:2] == [20, 40] and _sizes(w, "decode", 100)[:2] == [1000, 2000]


def test_no_extrapolation_and_no_unchecked_fit():
    caps = {bs: _cap(bs, [10 * bs]) for bs in (2, 8, 16)}
    with pytest.raises(
        InputError,
        match=r"planned sizes \[1, 32\] lie outside the recorded sizes 2\.\.16; "
        r"sizes are never extrapolated",
    ):
        _fit(caps, [1, 2, 8, 16, 32])
    with pytest.raises(
        InputError,
        match=r"sizes \[4\] would be derived from the 2 samples \[2, 8\] with none "
        r"left to check the fit; fix: record one more size between 2 and 8",
    ):
        _fit({bs: _cap(bs, [10 * bs]) for bs in (2, 8)}, [2, 4, 8])


def test_a_size_no_exact_function_fits_is_refused():
    caps = {bs: _cap(bs, [bs * bs * 512]) for bs in (1, 4, 16)}
    with pytest.raises(
        InputError,
        match=r"allocation #0 \(output\) has sizes \{1: 512, 4: 8192, 16: 131072\} "
        r"that no exact function",
    ):
        _fit(caps, [1, 2, 4, 16])


def test_samples_two_functions_fit_are_refused_naming_a_size():
    # bs + 1 and round_up(bs, 2) agree at 1, 3 and 255 but not at even sizes
    caps = {bs: _cap(bs, [-(-bs // 2) * 2]) for bs in (1, 3, 255)}
    with pytest.raises(
        InputError,
        match=r"fits both 1\*round_up\(bs, 1\) \+ 1 and 1\*round_up\(bs, 2\) \+ 0, "
        r"which differ at bs 2; fix: record size 2 as well",
    ):
        _fit(caps, [1, 2, 3, 255])


def test_held_out_sample_catches_a_wrong_fit():
    # affine through 1 and 64, but the middle sample disagrees: refused, not averaged
    caps = {1: _cap(1, [100]), 32: _cap(32, [3300]), 64: _cap(64, [6400])}
    with pytest.raises(InputError, match="no exact function"):
        _fit(caps, [1, 16, 32, 64])


def test_library_blocks_stay_with_the_capture_that_recorded_them():
    cap = _cap(64, [640, 1280])
    lib = CaptureTrace(phase="decode", bs=64, events=[Event(op="alloc", id=50, size=8, kind="library")] + cap.events)
    w = _fit({1: _cap(1, [10, 20]), 8: _cap(8, [80, 160]), 64: lib}, [1, 2, 8, 64])
    assert _sizes(w, "decode", 64)[0] == 8 and 8 not in _sizes(w, "decode", 2)


@settings(max_examples=60, deadline=None)
@given(
    a=st.integers(0, 1 << 16), b=st.integers(0, 1 << 12), k=st.sampled_from([1, 2, 4, 8, 16]), mid=st.integers(2, 254)
)
def test_any_exact_affine_of_a_padded_batch_is_recovered(a, b, k, mid):
    f = lambda bs: a * (-(-bs // k) * k) + b  # noqa: E731
    planned = sorted({1, mid, 255} | set(range(1, 256, 17)))
    try:
        w = _fit({bs: _cap(bs, [f(bs)]) for bs in (1, mid, 255)}, planned)
    except InputError as err:  # three samples can fit two functions: refused, naming a size
        assert "which differ at bs" in str(err) and "fix: record size" in str(err)
        return
    for bs in planned:
        assert _sizes(w, "decode", bs)[0] == f(bs)


def test_profile_subset_keeps_planned_order_and_warmups(built):
    pytest.importorskip("torch")
    from capture_plan.executor.profiling import subset_plan

    plan = built(backend="fa3", ci=True, speculative="eagle", max_bs=16)  # the plan test_build reads
    sub = subset_plan(plan)
    caps = [(s.phase, s.bs) for s in sub.steps if s.op == "capture"]
    for p in plan.phases:
        assert sorted(bs for ph, bs in caps if ph == p.name) == default_samples(p.sizes)
    full_order = [(s.phase, s.bs) for s in plan.steps if s.op == "capture"]
    assert caps == [c for c in full_order if c in set(caps)]
    assert [s.index for s in sub.steps] == list(range(len(sub.steps)))
    assert sum(s.op == "warmup" for s in sub.steps) >= len(plan.phases)
    assert subset_plan(plan, "all").steps == plan.steps
    with pytest.raises(ValueError, match="no planned sizes"):
        subset_plan(plan, {"decode": [300]})


def test_build_summary_says_which_sizes_were_derived(cli, tmp_path):
    """Five of the 36 sizes planned (three recorded, two derived): the summary line
    as for all 36, with five captures to simulate instead of 36."""
    full = _h200()
    keep = default_samples([c.bs for c in full.captures])
    (tmp_path / "few.json").write_bytes(msgspec.json.encode(Trace(captures=[c for c in full.captures if c.bs in keep])))
    (tmp_path / "s.toml").write_text('[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 2, 64, 120, 256]\n')
    code, out, err = cli("build", "-b", "fa3", "--ci", "--spec", "s.toml", "--trace", "few.json", "--dry-run")
    assert code == 0, err
    assert out.splitlines()[-1] == "  trace sizes: decode measured [1, 120, 256], 2 derived"
