"""The EAGLE plans against the H200: traces recorded there predict what was measured there.

``plans/traces/fa3-eagle*.json`` were recorded by ``bench/speculative_bench.py``
on an H200 (the target phases at 3 sizes, the draft phases at every size:
``torch.topk``'s scratch over the vocabulary is not affine in the batch) and
``bench/results/report-fa3-eagle*.json`` are the executor's reports of the
same run, capturing the checked-in plans. No GPU needed: this holds the
planner's simulation, fed the device's own allocations, to the device's
measured pools, and the analytic model to both.

The checked-in plan's schedule is simulated directly (a full ``build_plan``
over a 32-layer trace searches strategies for tens of seconds).
"""

from __future__ import annotations

import json
import pathlib

import msgspec
import pytest

from capture_plan.planner.simulate import simulate
from capture_plan.planner.specs import default_spec
from capture_plan.planner.workload import Workload
from capture_plan.schemas.codec import decode_plan
from capture_plan.schemas.trace import Trace

ROOT = pathlib.Path(__file__).resolve().parent.parent


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
