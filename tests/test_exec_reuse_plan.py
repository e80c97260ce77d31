"""Executable reuse as a plan decision (capture_plan.planner.memory.exec_reuse): the spec's phase
field, the plan's revision, the refusal for piecewise phases, and the forecast a capture
report of the plan gives (on the CPU)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from capture_plan.planner import BuildOptions, build_plan
from capture_plan.planner.memory.exec_reuse import forecast, report_reuse_lines, reuse_lines
from capture_plan.planner.report.render import explain
from capture_plan.schemas.errors import InputError
from capture_plan.schemas.plan import KINDS_REVISION, REUSE_REVISION
from capture_plan.schemas.report import CaptureReport, ExecReuse, ReuseGroup, ReuseRefusal, StepMeasurement
from reports import capture_report

MODEL = (
    "[model]\nlayers = 2\nhidden = 1024\nheads = 8\nkv_heads = 2\nhead_dim = 128\nintermediate = 2048\nvocab = 32000\n"
)


def _plan(tmp_path: Path, reuse: str | None, kind: str = "decode"):
    line = f'reuse = "{reuse}"\n' if reuse else ""
    extra = "pieces = 3\n" if kind == "piecewise" else ""
    spec = tmp_path / "spec.toml"
    spec.write_text(MODEL + f'\n[[phases]]\nname = "decode"\nkind = "{kind}"\nsizes = [1, 2, 4, 8]\n{extra}{line}')
    return build_plan(BuildOptions(backend="fa3", ci=True, spec=spec))


def test_reuse_is_absent_unless_a_phase_sets_it(tmp_path):
    off = _plan(tmp_path, None)
    assert off.phases[0].reuse is msgspec.UNSET and off.revision < REUSE_REVISION
    assert b'"reuse"' not in msgspec.json.encode(off)
    on = _plan(tmp_path, "exec-update")
    assert on.phases[0].reuse == "exec-update" and on.revision == REUSE_REVISION > KINDS_REVISION
    # the rest of the plan is the plan without it
    assert on.steps == off.steps and on.predicted == off.predicted


def test_explain_states_the_bounds_before_a_capture_measured_them(tmp_path):
    plan = _plan(tmp_path, "exec-update")
    text = explain(plan)
    assert "[decode] 1 to 4 executables for 4 graphs" in text
    assert "executable reuse" not in explain(_plan(tmp_path, None))


def test_reuse_on_a_piecewise_phase_is_refused_with_the_fix(tmp_path):
    with pytest.raises(InputError) as err:
        _plan(tmp_path, "exec-update", kind="piecewise")
    assert "remove reuse from phase 'decode'" in str(err.value.fix)


def _report(plan, nodes: dict[int, int], groups: list[list[int]], alone: list[int]) -> CaptureReport:
    steps = [
        StepMeasurement(
            step=i, id=s.id, reserved=0, predicted_reserved=0, seconds=0.0,
            graph_nodes=nodes[s.bs] if s.op == "capture" else None,
        )
        for i, s in enumerate(plan.steps)
    ]  # fmt: skip
    return capture_report(
        plan,
        steps,
        device="NVIDIA H200 sm90, torch 2.11.0",
        torch="2.11.0",
        capture_seconds=0.0,
        reuse=ExecReuse(
            graphs=len(nodes),
            instantiations=len(groups) + len(alone),
            groups=[ReuseGroup(phase="decode", graphs=[f"decode/{b}" for b in g]) for g in groups],
            refusals=[ReuseRefusal(graph=f"decode/{b}", reason="node 3 runs another kernel function") for b in alone],
        ),
    )


def test_a_report_of_the_plan_gives_executables_and_driver_memory(tmp_path):
    plan = _plan(tmp_path, "exec-update")
    nodes = {8: 1000, 4: 1000, 2: 1000, 1: 1200}
    rep = _report(plan, nodes, groups=[[8, 4, 2]], alone=[1])
    (row,) = forecast(plan, rep, per_node=3000.0)
    assert row.graphs == 4 and row.instantiations == 2
    mib2 = 2 << 20
    # without: 4,200 nodes; with: 2,200 nodes (the group's first and the one alone), in 2 MiB steps
    assert row.driver_without == -(-4200 * 3000 // mib2) * mib2
    assert row.driver_with == -(-2200 * 3000 // mib2) * mib2
    lines = report_reuse_lines(rep, plan)
    assert "executable reuse: 2 executables for 4 graphs" in lines[1]
    assert any("refused decode/1: node 3 runs another kernel function" in ln for ln in lines)
    assert any("graph-exec" in ln for ln in lines)  # the H200's per-node figure (devices.toml)
    # without the per-node figure, the executables still; the memory is not invented
    (row,) = forecast(plan, rep, per_node=None)
    assert row.instantiations == 2 and row.driver_with is None
    assert reuse_lines(_plan(tmp_path, None), rep) == []


def test_the_benchs_reuse_plans_are_valid_plans_of_revision_7(tmp_path):
    """bench.device_bench's "reuse" mode sets every phase of a checked-in plan to reuse: the
    result loads (digest, schema) and differs from the plan only there."""
    from bench_modules import ROOT, bench_module
    from capture_plan.executor import load_plan
    from capture_plan.schemas.codec import canonical_bytes

    with_reuse = bench_module("device_bench").with_reuse
    for name in ("fa3-ci.json", "fa3-eagle-ci.json"):
        plan = load_plan(ROOT / "plans" / name, check_env=False)
        on = with_reuse(plan)
        path = tmp_path / name
        path.write_bytes(canonical_bytes(on))
        back = load_plan(path, check_env=False)
        assert back.revision == REUSE_REVISION and {p.reuse for p in back.phases} == {"exec-update"}
        assert back.steps == plan.steps and back.predicted == plan.predicted
        assert "executable reuse" in explain(back)


def test_a_start_up_recording_of_a_reuse_plan_instantiates_every_graph_on_its_own(tmp_path):
    """The start-up prediction records a subset of the plan and measures the driver memory
    per node from each graph's own executable: the subset takes reuse out (otherwise shared
    executables would skew the per-node figure while copies assumed one per graph)."""
    pytest.importorskip("torch")  # executor.profiling records through torch
    from capture_plan.executor.profiling import subset_plan

    plan = _plan(tmp_path, "exec-update")
    assert any(p.reuse is not msgspec.UNSET for p in plan.phases)
    sub = subset_plan(plan)
    assert all(p.reuse is msgspec.UNSET for p in sub.phases)
    assert [p.name for p in sub.phases] == [p.name for p in plan.phases]


def test_planner_report_says_what_the_devices_cluster_probe_found(tmp_path):
    """A capture whose clustered kernels were refused for an unreadable preferred cluster
    dimension: `planner report` gives the probe's verdict beside the refusals."""
    plan = _plan(tmp_path, "exec-update")
    rep = _report(plan, {8: 1000, 4: 1000, 2: 1000, 1: 1000}, groups=[], alone=[8, 4, 2, 1])
    assert not any("cluster probe" in ln for ln in report_reuse_lines(rep, plan))  # no probe ran: no line
    verdict = "a captured launch that sets a preferred cluster dimension ((2, 1, 1)) reads back CUresult 1"
    rep = msgspec.structs.replace(rep, reuse=msgspec.structs.replace(rep.reuse, clusters=verdict))
    assert f"  cluster probe: {verdict}" in report_reuse_lines(rep, plan)
