"""Traces as the planner reads them: few-size fitting, memory snapshots, and the recorded EAGLE traces against the H200.

Few-size traces: exact derivation of the unrecorded sizes, and refusals that name sizes.

Memory snapshots as traces: restricted unpickling, windows, labels, same prediction as the JSON trace.

The snapshots here are written in torch.cuda.memory._snapshot()'s format by
replaying a recorded H200 trace through the allocator simulator (addresses
and segments as the caching allocator would give them), with eager warm-up
allocations outside the pool between captures, as engines' loops do. The GPU
test (tests/test_gpu_traces.py) checks a real dump.

The EAGLE plans against the H200: traces recorded there predict what was measured there.

``plans/traces/fa3-eagle*.json`` were recorded by ``bench/speculative_bench.py``
on an H200 (the target phases at 3 sizes, the draft phases at every size:
``torch.topk``'s scratch over the vocabulary is not affine in the batch) and
``bench/results/report-fa3-eagle*.json`` are the executor's reports of the
same run, capturing the checked-in plans. No GPU needed: this holds the
planner's simulation, fed the device's own allocations, to the device's
measured pools, and the analytic model to both.

The checked-in plan's schedule is simulated directly (a full ``build_plan``
over a 32-layer trace searches strategies for tens of seconds)."""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import subprocess
import sys

import msgspec
import pytest
from hypothesis import given, settings, strategies as st

from capture_plan.planner import BuildOptions, build_plan
from capture_plan.planner.inputs.specs import default_spec
from capture_plan.planner.memory.allocator import PoolSim, round_size, segment_size
from capture_plan.planner.memory.program import Alloc, Free, Program, ops_from_events
from capture_plan.planner.memory.simulate import simulate
from capture_plan.planner.memory.snapshot import load_snapshot, trace_from_snapshot
from capture_plan.planner.memory.workload import Workload
from capture_plan.schemas.codec import decode_plan
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
    assert (err.value.phase, err.value.sizes) == ("decode", [16, 32])  # as data, for predict_startup
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
    ) as err:
        _fit(caps, [1, 2, 8, 16, 32])
    assert err.value.sizes == [1, 32]
    # only sizes above the recorded ones: the largest alone (an inner size was asked for before)
    with pytest.raises(InputError, match="fix: record size 64 as well") as err:
        _fit(caps, [2, 4, 8, 16, 64])
    assert err.value.sizes == [64]
    with pytest.raises(
        InputError,
        match=r"sizes \[4\] would be derived from the 2 samples \[2, 8\] with none "
        r"left to check the fit; fix: record one more size between 2 and 8",
    ) as err:
        _fit({bs: _cap(bs, [10 * bs]) for bs in (2, 8)}, [2, 4, 8])
    assert err.value.sizes == [4]


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
    ) as err:
        _fit(caps, [1, 2, 3, 255])
    assert err.value.sizes == [2]


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


def fake_snapshot(trace: Trace, order: list[int], warmup: bool = True) -> dict:
    """A snapshot dict of capturing ``order`` (batch sizes) into one pool, outputs kept."""
    pool = PoolSim()
    eager = 0x7F0000000000
    entries: list[dict] = [{"action": "segment_alloc", "addr": eager, "size": 2 << 20, "stream": 0}]
    segments: list[dict] = []
    by_bs = {c.bs: c for c in trace.captures}

    def e(action, addr, size):
        entries.append(
            {
                "action": action,
                "addr": addr,
                "size": size,
                "stream": 7,
                "time_us": len(entries),
                "frames": [{"filename": "x.py", "line": 1, "name": "f"}],
            }
        )

    for bs in order:
        if warmup:  # an eager warm-up outside the pool
            e("alloc", eager, 4096)
            e("free_requested", eager, 4096)
            e("free_completed", eager, 4096)
        live = {}
        for ev in by_bs[bs].events:
            if ev.op == "alloc":
                before = pool.segments
                b = pool.alloc(ev.size)
                if pool.segments != before:
                    size = segment_size(round_size(ev.size))
                    e("segment_alloc", b.addr, size)
                    segments.append(
                        {
                            "device": 0,
                            "address": b.addr,
                            "total_size": size,
                            "stream": 7,
                            "segment_type": "large",
                            "segment_pool_id": (1, 0),
                            "blocks": [],
                        }
                    )
                live[ev.id] = b
                e("alloc", b.addr, ev.size)
            else:
                b = live.pop(ev.id)
                e("free_requested", b.addr, b.size)
                e("free_completed", b.addr, b.size)
                pool.free(b)
    segments.append({"device": 0, "address": eager, "total_size": 2 << 20, "segment_pool_id": (0, 0), "blocks": []})
    return {"segments": segments, "device_traces": [entries], "allocator_settings": {"expandable_segments": False}}


def test_snapshot_gives_the_same_captures_and_prediction_as_the_json_trace(tmp_path):
    """Every one of the 36 captures event for event; the prediction through
    ``build --trace`` at three of them (with all 36 equal event for event, more
    sizes would only simulate more of the same input)."""
    trace = _h200()
    sizes = sorted(c.bs for c in trace.captures)
    snap = pickle.dumps(fake_snapshot(trace, sorted(sizes, reverse=True)))
    got = trace_from_snapshot(snap, [Phase(name="decode", kind="decode", sizes=sizes)], "snap")
    want = {c.bs: c.events for c in trace.captures}
    assert {c.bs: c.events for c in got.captures} == want
    few = [1, 120, 256]
    spec = tmp_path / "s.toml"
    spec.write_text(f'[[phases]]\nname = "decode"\nkind = "decode"\nsizes = {few}\n')
    (tmp_path / "snap.pickle").write_bytes(pickle.dumps(fake_snapshot(trace, sorted(few, reverse=True))))
    a = build_plan(BuildOptions(backend="fa3", ci=True, spec=spec, trace=H200)).predicted
    b = build_plan(BuildOptions(backend="fa3", ci=True, spec=spec, trace=tmp_path / "snap.pickle")).predicted
    assert a.source == b.source == "trace" and len(a.timeline) >= len(few)
    assert (a.pool_bytes, a.pools, a.timeline, a.baseline_bytes) == (
        b.pool_bytes,
        b.pools,
        b.timeline,
        b.baseline_bytes,
    )


def test_cli_accepts_a_snapshot_and_refuses_a_miscounted_one(cli, tmp_path):
    trace = _h200()
    few = [1, 120, 256]
    (tmp_path / "s.toml").write_text(f'[[phases]]\nname = "decode"\nkind = "decode"\nsizes = {few}\n')
    (tmp_path / "snap.pickle").write_bytes(pickle.dumps(fake_snapshot(trace, [256, 120, 1])))
    code, out, err = cli("build", "-b", "fa3", "--spec", "s.toml", "--trace", "snap.pickle")
    assert code == 0 and "(trace," in out, err
    (tmp_path / "two.pickle").write_bytes(pickle.dumps(fake_snapshot(trace, [256, 1])))
    code, out, err = cli("build", "-b", "fa3", "--spec", "s.toml", "--trace", "two.pickle")
    assert code == 1 and err == (
        "planner: error: two.pickle: found 2 capture windows in the snapshot, the spec "
        "plans 3 captures (decode: 3); fix: dump the snapshot of a run that captured "
        "exactly the spec's sizes, each after an eager warm-up, or record the trace "
        "with capture_plan.executor.profile\n"
    )
    (tmp_path / "nowarm.pickle").write_bytes(pickle.dumps(fake_snapshot(trace, [256, 120, 1], warmup=False)))
    code, out, err = cli("build", "-b", "fa3", "--spec", "s.toml", "--trace", "nowarm.pickle")
    assert code == 1 and "found 1 capture windows" in err


def test_a_size_choice_fits_a_snapshots_captures_to_every_list_it_prices(tmp_path):
    """A snapshot labels its captures with the spec's own sizes (the ones the run captured),
    once; ``build --sizes auto`` fits them to each list it prices, as it fits a JSON trace of
    the same captures: the same plan either way. (It refused before: the snapshot was labelled
    again with each list's sizes, and its capture count matched none of them.)"""
    from capture_plan.planner.inputs.build_options import SizeChoiceOptions

    few = [1, 120, 256]
    spec = tmp_path / "s.toml"
    spec.write_text(f'[[phases]]\nname = "decode"\nkind = "decode"\nsizes = {few}\n')
    snap = tmp_path / "snap.pickle"
    snap.write_bytes(pickle.dumps(fake_snapshot(_h200(), sorted(few, reverse=True))))
    recorded = trace_from_snapshot(snap.read_bytes(), [Phase(name="decode", kind="decode", sizes=few)], "snap")
    (tmp_path / "t.json").write_bytes(msgspec.json.encode(recorded))
    choice = SizeChoiceOptions(traffic=ROOT / "tests/data/traffic-skewed.csv", max_graphs=6)
    a, b = (
        build_plan(
            BuildOptions(backend="fa3", ci=True, spec=spec, trace=trace, sizes=choice, output=tmp_path / "p.json")
        )
        for trace in (snap, tmp_path / "t.json")
    )
    assert a.predicted.source == "trace" and len(a.phases[0].sizes) == 6 and a.predicted.sizes
    assert (a.phases, a.predicted.pool_bytes, a.predicted.timeline, a.predicted.sizes) == (
        b.phases,
        b.predicted.pool_bytes,
        b.predicted.timeline,
        b.predicted.sizes,
    )


class _Payload:
    """Unpickling this runs ``os.system`` -- what a malicious snapshot would do."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_with_code_is_refused_before_it_runs(tmp_path, cli):
    marker = tmp_path / "pwned"
    data = pickle.dumps({"segments": [], "device_traces": [[{"action": _Payload(marker)}]]})
    # the payload is real: plain pickle runs it
    pickle.loads(data)
    assert marker.exists()
    marker.unlink()
    with pytest.raises(InputError, match=r"snap: pickle refers to (posix|os|nt)\.system: only plain data"):
        load_snapshot(data, "snap")
    (tmp_path / "s.toml").write_text('[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1]\n')
    (tmp_path / "evil.pickle").write_bytes(data)
    code, out, err = cli("build", "-b", "fa3", "--spec", "s.toml", "--trace", "evil.pickle")
    assert code == 1 and "evil.pickle: pickle refers to" in err and err.count("\n") == 1
    assert not marker.exists()


def test_payload_never_runs_in_a_fresh_process(tmp_path):
    """Out of process, so nothing this test imported can mask an execution."""
    marker = tmp_path / "ran"
    (tmp_path / "evil.pickle").write_bytes(pickle.dumps([1, _Payload(marker)]))
    code = (
        "import sys; from capture_plan.planner.memory.snapshot import load_snapshot\n"
        "from capture_plan.schemas.errors import InputError\n"
        "try:\n    load_snapshot(open(sys.argv[1], 'rb').read(), 'x')\n"
        "except InputError as e:\n    print('refused', e)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "evil.pickle")], capture_output=True, text=True, cwd=ROOT
    )
    assert r.stdout.startswith("refused x: pickle refers to"), r.stderr
    assert not marker.exists()


@pytest.mark.parametrize(
    "data,message",
    [
        (b"\x80\x04garbage", "not a readable pickle"),
        (pickle.dumps([1, 2]), "not a memory snapshot"),
        (pickle.dumps({"segments": [], "device_traces": []}), "the snapshot has no graph-pool segments"),
        (
            pickle.dumps({"segments": [{"segment_pool_id": 7}], "device_traces": []}),
            r"segments\[0\].segment_pool_id: segment_pool_id must be a pair of integers, got 7",
        ),
        (
            pickle.dumps(
                {"segments": [{"segment_pool_id": (1, 0), "address": "x", "total_size": 1}], "device_traces": []}
            ),
            r"segments\[0\]: missing or non-integer `address`",
        ),
        (
            pickle.dumps(
                {
                    "segments": [{"segment_pool_id": (1, 0), "address": 0, "total_size": 1}],
                    "device_traces": [[{"action": "segment_alloc", "addr": [1]}]],
                }
            ),
            r"device_traces\[0\]\[0\]: missing or non-integer `addr`",
        ),
        (
            pickle.dumps(
                {"segments": [{"segment_pool_id": (1, 0), "address": 0, "total_size": 1}], "device_traces": [[1, 2]]}
            ),
            r"device_traces\[0\]: the history must be a list of dicts",
        ),
    ],
)
def test_malformed_snapshots_are_refused(data, message):
    with pytest.raises(InputError, match=message):
        trace_from_snapshot(data, [Phase(name="decode", kind="decode", sizes=[1])], "snap")


def test_history_started_after_the_pool_is_refused():
    snap = fake_snapshot(_h200(), [256, 1])
    snap["device_traces"][0] = [e for e in snap["device_traces"][0] if e["action"] != "segment_alloc"]
    with pytest.raises(
        InputError,
        match=r"snap: device_traces\[0\]\[\d+\]: an allocation at 0x[0-9a-f]+ lies in a "
        "graph pool's segment created before the recorded history starts",
    ):
        trace_from_snapshot(pickle.dumps(snap), [Phase(name="decode", kind="decode", sizes=[1, 256])], "snap")


def test_an_older_idle_pool_is_ignored():
    trace = _h200()
    snap = fake_snapshot(trace, [256, 1])
    snap["segments"].append({"device": 0, "address": 0x10, "total_size": 2 << 20, "segment_pool_id": (9, 0)})
    got = trace_from_snapshot(pickle.dumps(snap), [Phase(name="decode", kind="decode", sizes=[1, 256])], "snap")
    assert {c.bs: c.events for c in got.captures} == {c.bs: c.events for c in trace.captures if c.bs in (1, 256)}


@pytest.fixture(scope="module", params=["fa3-eagle-ci", "fa3-eagle"])
def case(request):
    name = request.param
    plan = decode_plan((ROOT / f"plans/{name}.json").read_bytes(), name)
    trace = msgspec.json.decode((ROOT / f"plans/traces/{name}.json").read_bytes(), type=Trace)
    workload = Workload.from_trace(trace, default_spec("eagle").phases, name)
    captures = [(s.phase, s.bs) for s in plan.steps if s.op == "capture"]
    assert plan.predicted.allocator == "native"
    sim = simulate(captures, {p.name: p.strategy for p in plan.phases}, workload)
    report = json.loads((ROOT / f"bench/results/report-{name}.json").read_text())
    return plan, workload, sim, report


def test_trace_predicts_the_pool_measured_on_the_h200_to_the_byte(case):
    """In total, after every capture, and per pool."""
    plan, _, sim, report = case
    # the same plan's steps (revision 2 of the plan file added device items, which changed
    # its digest and nothing the executor runs): the report measured exactly these captures
    assert report["device"].startswith("NVIDIA H200") and report["plan"] == plan.name, report["plan"]
    assert [m["id"] for m in report["steps"]] == [s.id for s in plan.steps], (
        "the report is of other steps: rerun bench/speculative_bench.py"
    )
    assert sim.pool_bytes == report["pool_bytes"]
    measured = [m["reserved"] for m in report["steps"] if m["id"].startswith("capture/")]
    assert [reserved for reserved, _ in sim.after_capture] == measured
    bench = json.loads((ROOT / "bench/results/speculative-2026-11-29-32l.json").read_text())
    pools = bench[f"{plan.name}.json"]["pools"]
    assert dict(sim.pools) == {p: int(v["measured_mib"] * 2**20) for p, v in pools.items()}


def test_target_phases_derived_from_three_sizes_drafts_recorded_at_every_size(case):
    plan, workload, _, _ = case
    for p in plan.phases:
        measured, derived = workload.samples[p.name]
        if p.kind in ("decode", "target_verify"):
            assert len(measured) == 3 and len(derived) == len(p.sizes) - 3, p.name
        else:
            assert len(measured) == len(p.sizes) and not derived, p.name


def test_analytic_prediction_within_two_percent_of_the_trace_per_pool(case):
    """The analytic model against the H200's own allocations (which the test
    above ties to the measured pools)."""
    plan, _, sim, _ = case
    assert plan.predicted.pools.keys() == sim.pools.keys()
    for pool, measured in sim.pools.items():
        assert abs(plan.predicted.pools[pool] - measured) <= 0.02 * measured, pool


# -- torch.topk's scratch (planner/memory/scratch_shapes.py) ---------------------------------------------

H200_SMS = 132  # the H200's streaming multiprocessors: what the committed EAGLE trace was recorded on


def _eagle_few(multiprocessors: int | None) -> tuple[Trace, Trace]:
    """The committed EAGLE trace (every draft size recorded), and the same keeping only the
    default three sizes of each phase, with the SM count a recording now writes."""
    full = msgspec.json.decode((ROOT / "plans/traces/fa3-eagle-ci.json").read_bytes(), type=Trace)
    keep: dict[str, list[int]] = {}
    for c in full.captures:
        keep.setdefault(c.phase, []).append(c.bs)
    few = [c for c in full.captures if c.bs in default_samples(keep[c.phase])]
    return full, msgspec.structs.replace(full, captures=few, multiprocessors=multiprocessors)


def test_topk_blocks_reproduce_every_recorded_draft_size():
    """ATen's multi-block top-k: the 51 recorded sizes of both draft phases, each
    allocation 512 or 4 bytes per block (the module docstring's check, kept)."""
    from capture_plan.planner.memory.fitting import _skeleton
    from capture_plan.planner.memory.scratch_shapes import MBTOPK

    full, _ = _eagle_few(None)
    by: dict[str, dict[int, CaptureTrace]] = {}
    for c in full.captures:
        by.setdefault(c.phase, {})[c.bs] = c
    seen = 0
    for phase in ("draft_decode", "draft_extend"):
        caps = by[phase]
        sizes = {bs: _skeleton(c)[1] for bs, c in caps.items()}
        n = len(next(iter(sizes.values())))
        for j in range(n):
            ys = {bs: s[j] for bs, s in sizes.items()}
            if len(set(ys.values())) == 1:
                continue
            per = {y / MBTOPK.blocks(bs, 128256, H200_SMS) for bs, y in ys.items()}
            if per <= {512.0} or per <= {4.0}:
                seen += 1
    assert seen == 12


def test_draft_phases_derived_from_three_sizes_with_the_sm_count():
    """With the SM count the draft phases need 3 recorded sizes, not all 51: every derived
    size's allocations equal the recorded ones, event for event."""
    full, few = _eagle_few(H200_SMS)
    spec = default_spec("eagle")
    got = Workload.from_trace(few, spec.phases, "few", spec.model)
    want = Workload.from_trace(full, spec.phases, "full", spec.model)
    for p in spec.phases:
        measured, derived = got.samples[p.name]
        assert len(measured) == 3 and len(derived) == len(p.sizes) - 3, p.name
        for bs in p.sizes:
            assert got.program(p.name, bs).flatten() == want.program(p.name, bs).flatten(), (p.name, bs)


def test_without_the_sm_count_the_draft_phases_ask_for_every_size():
    """A trace that does not say its SM count (the committed ones) gets no topk basis:
    refused with every size to record, as before, never a guess."""
    _, few = _eagle_few(None)
    spec = default_spec("eagle")
    with pytest.raises(InputError, match=r"phase 'draft_\w+'.*no exact function") as err:
        Workload.from_trace(few, spec.phases, "few", spec.model)
    assert "record every planned size between 1 and 256" in (err.value.fix or "")
    # and says so as data: the phase and every unrecorded size (what predict_startup records next)
    phase = next(p for p in spec.phases if p.name == err.value.phase)
    assert err.value.sizes == [s for s in phase.sizes if s not in default_samples(phase.sizes)]


def test_another_sm_count_far_off_does_not_fit_the_h200s_draft_scratch():
    """The H200's sizes with an H100 PCIe's 114 SMs are refused. Nearby counts (134 to
    143) give the same blocks at 1, 60 and 256, so three samples cannot tell them apart:
    the count is the device's own, read by the recording, never fitted
    (planner/memory/scratch_shapes.py)."""
    _, few = _eagle_few(114)
    spec = default_spec("eagle")
    with pytest.raises(InputError, match="torch.topk blocks"):
        Workload.from_trace(few, spec.phases, "few", spec.model)


@pytest.mark.parametrize(
    "kernel", [{"blocks_per_sm": 4}, {"blocks_per_sm": 8}, {"max_items": 32}, {"max_items": 128}, {"threads": 128}]
)
def test_other_kernel_constants_are_refused_by_the_held_out_sample(monkeypatch, kernel):
    """What the middle sample guards: ATen's constants. A topk with other ones (another torch
    could change them) fits none of the H200's draft allocations: refused, not derived."""
    import dataclasses

    from capture_plan.planner.memory import scratch_shapes

    monkeypatch.setattr(scratch_shapes, "MBTOPK", dataclasses.replace(scratch_shapes.MBTOPK, **kernel))
    _, few = _eagle_few(H200_SMS)
    spec = default_spec("eagle")
    with pytest.raises(InputError, match="no exact function"):
        Workload.from_trace(few, spec.phases, "few", spec.model)


# -- folding a trace's repeated layers (planner/memory/layers.py) ----------------------------------------


def _h200_few():
    full = _h200()
    sizes = sorted(c.bs for c in full.captures)
    few = Trace(captures=[c for c in full.captures if c.bs in default_samples(sizes)])
    return few, Phase(name="decode", kind="decode", sizes=sizes)


def test_derived_sizes_refold_as_folding_their_own_ops_would():
    """A derived size takes another derived size's folded program with its own sizes
    (layers.refold, instead of rebuilding and folding every op): event for event what
    folding its own ops gives, and folded, on the H200 decode trace cut to three sizes."""
    from capture_plan.planner.memory.fitting import fit_phase
    from capture_plan.planner.memory.layers import fold

    few, phase = _h200_few()
    w = Workload.from_trace(few, [phase], "few")
    fit = fit_phase("decode", list(phase.sizes), {c.bs: c for c in few.captures}, "few")
    assert len(fit.derived) == 33
    for bs in fit.derived:
        own, _ = fold(fit.derived_ops(bs))
        got = w.program("decode", bs)
        assert got.repeats == own.repeats > 1 and got.flatten() == own.flatten(), bs


def _padded_middle(bs: int) -> CaptureTrace:
    """Three layers whose middle one pads its temporary to 4: the layers repeat only at
    multiples of 4; a prologue block lives until the epilogue frees it."""
    ev: list[Event] = []

    def alloc(i, size, kind="temp"):
        ev.append(Event(op="alloc", id=i, size=size, kind=kind))

    alloc(1, 512)
    alloc(0, 512)
    h = 0
    for layer in range(3):
        t = 10 + 10 * layer
        alloc(t, 16 * (-(-bs // 4) * 4 if layer == 1 else bs))
        alloc(t + 1, 1024)
        ev += [Event(op="free", id=t), Event(op="free", id=h)]
        h = t + 1
    alloc(99, 64, "output")
    ev += [Event(op="free", id=h), Event(op="free", id=1)]
    return CaptureTrace(phase="decode", bs=bs, events=ev)


def test_a_derived_size_folds_where_its_layers_repeat_though_the_first_did_not():
    """Found by fuzzing folded against flat builds: sizes 2 and 3 do not repeat, 4 and 8 do;
    each is folded where it can be, and every program runs its own ops."""
    from capture_plan.planner.memory.layers import _expand

    phase = Phase(name="decode", kind="decode", sizes=list(range(1, 9)))
    w = Workload.from_trace(Trace(captures=[_padded_middle(bs) for bs in (1, 5, 8)]), [phase], "t")
    assert [bs for bs in phase.sizes if w.program("decode", bs).repeats] == [4, 8]
    for bs in phase.sizes:
        flat = Program(prologue=tuple(ops_from_events(_padded_middle(bs).events)))
        assert _expand(w.program("decode", bs)) == _expand(flat), bs


def test_a_fold_that_failed_is_not_searched_again_for_a_size_alike(monkeypatch):
    """EAGLE's target phases do not fold (two blocks cross every layer): a derived size whose
    shape, equal sizes and hint match one that failed stays flat without searching again
    (before: every one of their derived sizes searched, 102 failed folds; the programs are
    the full trace's, event for event, test_draft_phases_derived_from_three_sizes_with_the_sm_count)."""
    from capture_plan.planner.memory import layers

    real, tried = layers.fold, []

    def counting(ops, hint=None):
        prog, found = real(ops, hint)
        if not prog.repeats:
            seen: dict = {}
            tried.append((tuple(seen.setdefault(t, len(seen)) for t in layers._tokens(ops)), hint))
        return prog, found

    monkeypatch.setattr(layers, "fold", counting)
    _, few = _eagle_few(H200_SMS)
    spec = default_spec("eagle")
    Workload.from_trace(few, spec.phases, "few", spec.model)
    recorded = 3 * len(spec.phases)  # recorded sizes are folded each from its own ops, not cached
    assert len(tried) - len(set(tried)) <= recorded, len(tried)


def test_flatten_keeps_an_epilogue_free_of_a_prologue_block():
    """One id space, as the simulator runs it: flatten() used to rename the epilogue's ids
    apart and drop the free of block 1, allocated in the prologue."""
    from capture_plan.planner.memory.layers import fold

    ops = tuple(ops_from_events(_padded_middle(8).events))
    folded, _ = fold(ops)
    assert folded.repeats == 3
    assert folded.flatten() == Program(prologue=ops).flatten()
    assert sum(e.op == "free" for e in folded.flatten()) == sum(type(op) is Free for op in ops)


def test_refold_refuses_sizes_whose_repetitions_differ():
    from capture_plan.planner.memory.fitting import fit_phase
    from capture_plan.planner.memory.layers import fold, refold

    few, phase = _h200_few()
    fit = fit_phase("decode", list(phase.sizes), {c.bs: c for c in few.captures}, "few")
    first, other = fit.derived[0], fit.derived[1]
    template, _ = fold(fit.derived_ops(first))
    sizes = list(fit.shapes[other][1])
    assert refold(template, sizes) is not None
    a0 = next(op.id for op in template.body if isinstance(op, Alloc))
    per = sum(isinstance(op, Alloc) for op in template.body)
    sizes[a0 + per] += 512  # the second repetition's first allocation, alone
    assert refold(template, sizes) is None


def _layered(layers: int, crossing: int = 1, leak: bool = False) -> tuple:
    """A flat capture: a prologue block, then ``layers`` layers, each allocating a temporary
    and ``crossing`` blocks the next layer frees (``leak``: one more block never freed)."""
    from capture_plan.planner.memory.program import Free

    ops = [Alloc(4096, i) for i in range(crossing)]
    nid = crossing
    handed = list(range(crossing))
    for _ in range(layers):
        t = nid
        ops.append(Alloc(8192, t))
        new = list(range(nid + 1, nid + 1 + crossing))
        ops += [Alloc(4096, i) for i in new]
        ops += [Free(i) for i in handed] + [Free(t)]
        if leak:
            ops.append(Alloc(512, nid + 1 + crossing))
        nid += 2 + crossing
        handed = new
    ops += [Free(i) for i in handed]
    return tuple(ops)


def test_a_traced_layer_folds_into_one_repeated_body_and_simulates_the_same():
    from capture_plan.planner.memory.layers import fold
    from capture_plan.planner.memory.program import Program

    ops = _layered(32)
    prog, run = fold(ops)
    assert prog.repeats == 32 and run is not None and len(prog.body) == 4  # alloc, alloc, free, free
    flat = Program(prologue=ops)
    a, b = PoolSim(), PoolSim()
    for sim, p in ((a, prog), (b, flat)):
        live: dict = {}
        code = p.runnable
        sim.run(code.prologue, live)
        carried = live.pop(p.carry_in) if p.repeats else None
        for _ in range(p.repeats):
            live[-1] = carried
            sim.run(code.body, live)
            carried = live.pop(p.carry_out)
        if p.repeats:
            live[-1] = carried
        sim.run(code.epilogue, live)
    assert (a.peak_reserved, a.peak_allocated, a.allocated) == (b.peak_reserved, b.peak_allocated, b.allocated)
    # the next size of the phase: the same run, checked and reused
    again, hint = fold(tuple(Alloc(op.size * 2, op.id) if type(op) is Alloc else op for op in ops), run)
    assert hint == run and again.repeats == prog.repeats


@pytest.mark.parametrize("crossing, leak", [(2, False), (1, True)])
def test_layers_that_hand_on_two_blocks_or_leak_one_stay_flat(crossing, leak):
    from capture_plan.planner.memory.layers import fold

    prog, run = fold(_layered(32, crossing=crossing, leak=leak))
    assert prog.repeats == 0 and run is None


@pytest.mark.parametrize(
    "trace, speculative",
    [("plans/traces/fa3-ci.json", None), ("plans/traces/fa3-eagle-ci.json", "eagle")],
)
def test_a_plan_from_a_folded_trace_is_the_plan_from_the_flat_one(trace, speculative, monkeypatch):
    """Folding changes how fast a capture is simulated, never the plan (byte for byte)."""
    from capture_plan.planner.memory import layers
    from capture_plan.planner.memory.program import Program
    from capture_plan.schemas.codec import canonical_bytes

    root = pathlib.Path(__file__).resolve().parent.parent
    opts = BuildOptions(backend="fa3", ci=True, trace=root / trace, speculative=speculative)
    folded = build_plan(opts)
    monkeypatch.setattr(layers, "fold", lambda ops, hint=None: (Program(prologue=ops), None))
    assert canonical_bytes(build_plan(opts)) == canonical_bytes(folded)


def test_layers_that_carry_a_workspace_or_allocate_an_output_stay_flat():
    """A hoisted workspace is dropped section by section (a carried one broke the carry:
    KeyError in the simulator), and an output allocated in a layer the simulator skips
    went uncounted in hazard checks; found by fuzzing folded against flat."""
    from capture_plan.planner.memory.layers import fold
    from capture_plan.planner.memory.program import Free

    ws = (Alloc(1 << 20, 0, "workspace"),) + sum(
        ((Alloc(1 << 20, i, "workspace"), Free(i - 1)) for i in range(1, 6)), ()
    )
    assert fold(ws + (Free(5),))[0].repeats == 0
    out = (Alloc(4096, 0),) + sum(
        ((Alloc(8192, i, "output"), Alloc(4096, 100 + i), Free(i - 1 + 100 * (i > 1))) for i in range(1, 6)), ()
    )
    assert fold(out)[0].repeats == 0
    temps = tuple(Alloc(op.size, op.id) if type(op) is Alloc else op for op in ws + (Free(5),))
    assert fold(temps)[0].repeats >= 3  # the same layers of temporaries fold
