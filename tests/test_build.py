"""capture_plan.planner.build and what it rests on: the plans' decisions and constraints,
their device items and fidelity, the rules' Digraph, and property tests over random specs.

capture_plan.planner.build: what the plans decide, and the constraints they honour.

A plan's device items (planner/memory/device.py), its fidelity (planner/memory/fidelity.py) and --require-exact.

planner/schedule/graph.py's Digraph: the same order and cycle reports as networkx.

Property tests: any valid spec gives a plan that respects its constraints, reproducibly.

Property: whatever a build accepts, the plan it writes checks clean at once.

A plan records its normalized command (pins sorted and deduplicated, paths
relative to the plan's folder); `planner check` rebuilds from that record. So
any accepted combination of options, typed in any order from any directory,
must give a plan that (a) `planner check` calls up to date from another
directory and (b) a second build of the same command reproduces byte for byte.
An axis pinned twice (the last pin won, the sorted record rebuilt the other one;
tests/test_cli_build.py) broke (a) and is what this would have caught.

Examples: ``CAPTURE_PLAN_FUZZ_EXAMPLES`` (default 10), as tests/test_cli_fuzz.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec
import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from capture_plan.planner import BuildOptions, build_plan, plan_bytes
from capture_plan.planner.cli import main
from capture_plan.planner.inputs.resources import builtin_rules
from capture_plan.planner.inputs.rules import Context, phase_rules, violated
from capture_plan.planner.memory.device import (
    calibration_from_report,
    driver_after,
    graphs_after,
    nodes_at,
    peak,
    taken_after,
)
from capture_plan.planner.schedule.graph import Digraph, check_acyclic
from capture_plan.schemas.errors import ConstraintError, InputError
from capture_plan.schemas.plan import Step
from capture_plan.schemas.report import CaptureReport, DeviceItem, DeviceView, ReportModel, StepMeasurement
from capture_plan.schemas.strategy import AXIS_VALUES
from capture_plan.schemas.units import DRIVER_CHUNK
from cli_inputs import CONFLICTING_RULES


def _edges_respected(plan):
    index = {s.id: s.index for s in plan.steps}
    return all(index[e.src] < index[e.dst] for e in plan.edges)


def test_default_fa3_uses_views_and_stays_near_the_largest_graph(built):
    plan = built(backend="fa3")
    (decode,) = plan.phases
    assert decode.strategy.outputs == "view" and decode.strategy.order == "largest-first"
    assert plan.predicted.pool_bytes <= 1.10 * plan.predicted.largest_graph_bytes
    assert plan.predicted.baseline_bytes > 5 * plan.predicted.pool_bytes
    assert plan.steps[0].op == "warmup" and plan.steps[0].bs == 256  # one warm-up at the largest size
    assert [s.bs for s in plan.steps if s.op == "capture"] == sorted(decode.sizes, reverse=True)
    assert _edges_respected(plan)


def test_sglang_sizes_and_max_bs():
    plan = build_plan(BuildOptions(backend="fa3", max_bs=64))
    assert plan.phases[0].sizes == [64, 56, 48, 40, 32, 24, 16, 12, 8, 4, 2, 1]
    big = build_plan(BuildOptions(backend="torch", max_bs=600))
    sizes = sorted(big.phases[0].sizes)
    assert sizes[-3:] == [512, 544, 576] and 496 in sizes and 504 not in sizes


# The EAGLE preset cut to --max-bs 16: every phase kind, the CI gate and the
# hoisting decision as in the full preset (at --max-bs 8 the gate's two ways tie
# and smallest-first wins), with 48 captures to simulate instead of 204.
SMALL_EAGLE = dict(backend="fa3", speculative="eagle", max_bs=16)


def test_fa3_ci_gate_hoists_the_workspace_for_multi_token_phases_and_says_why(built):
    plan = built(**SMALL_EAGLE, ci=True)
    tv = next(p for p in plan.phases if p.name == "target_verify")
    assert max(tv.sizes) == 16 and tv.tokens_per_request == 4
    assert tv.strategy.workspace == "hoisted" and tv.hoisted_bytes == 4 * (4 * 16 + 1)
    gate = [d for d in plan.decisions if d.rule == "fa3-ci-varlen-gate" and d.phase == "target_verify"]
    assert gate and gate[0].choice == "workspace=hoisted"
    assert "order=smallest-first:" in gate[0].why and "workspace=hoisted:" in gate[0].why
    prov = next(s for s in plan.steps if s.op == "provision" and s.phase == "target_verify")
    first = next(s for s in plan.steps if s.op == "capture" and s.phase == "target_verify")
    assert prov.index < first.index
    # without --ci the gate does not apply and nothing is hoisted
    plain = built(**SMALL_EAGLE)
    assert all(p.strategy.workspace == "pool" for p in plain.phases)


def test_outputs_read_across_phases_get_their_own_pool_or_are_kept(built):
    plan = built(**SMALL_EAGLE)
    tv = next(p for p in plan.phases if p.name == "target_verify")
    assert tv.strategy.pool == "own" or tv.strategy.outputs == "keep"
    opt = next(d for d in plan.decisions if d.phase == "target_verify" and d.rule == "optimizer")
    shared_views = [a for a in opt.alternatives if a.strategy.pool == "shared" and a.strategy.outputs == "view"]
    assert shared_views and all("output-overlap" in a.violates for a in shared_views)


def test_per_shape_backends_warm_up_every_size():
    plan = build_plan(BuildOptions(backend="triton"))
    caps = [s for s in plan.steps if s.op == "capture"]
    warms = [s for s in plan.steps if s.op == "warmup"]
    assert len(warms) == len(caps)
    for w in warms:  # each warm-up right before its capture
        assert plan.steps[w.index + 1].id == f"capture/decode/{w.bs}"


def test_pin_changes_the_choice_and_the_cost_is_reported(built):
    best = built(backend="fa3")
    pinned = build_plan(BuildOptions(backend="fa3", strategies=("order=smallest-first", "outputs=keep")))
    assert pinned.phases[0].strategy.order == "smallest-first"
    assert pinned.predicted.pool_bytes > 5 * best.predicted.pool_bytes
    assert "--strategy" in " ".join(pinned.command)


def test_pin_that_breaks_a_rule_is_refused_naming_it():
    with pytest.raises(ConstraintError, match="breaks rule warmup-per-shape"):
        build_plan(BuildOptions(backend="triton", strategies=("warmup=once-per-phase",)))
    with pytest.raises(ConstraintError, match="breaks rule fa3-ci-varlen-gate"):
        build_plan(
            BuildOptions(
                backend="fa3",
                ci=True,
                speculative="eagle",
                strategies=("target_verify.order=largest-first", "target_verify.workspace=pool"),
            )
        )


def test_bad_pins_are_located():
    with pytest.raises(InputError, match="unknown strategy axis 'colour'"):
        build_plan(BuildOptions(backend="fa3", strategies=("colour=red",)))
    with pytest.raises(InputError, match="unknown phase 'verify'"):
        build_plan(BuildOptions(backend="fa3", strategies=("verify.order=largest-first",)))
    with pytest.raises(InputError, match="unknown backend 'xformers'"):
        build_plan(BuildOptions(backend="xformers"))


def _spec(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "spec.toml"
    path.write_text(text)
    return path


PHASE = '[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 2, 4, 8, 16, 32]\n'


def _verify_after(phase: str) -> str:
    """A spec's target_verify phase "verify" (4 tokens per request, sizes 1 to 4) captured after ``phase``."""
    verify = '\n[[phases]]\nname = "verify"\nkind = "target_verify"\ntokens_per_request = 4\nsizes = [1, 2, 4]\n'
    return verify + f'after = ["{phase}"]\n'


def test_conflicting_order_rules_are_reported_as_the_rules_in_conflict(tmp_path):
    spec = _spec(tmp_path, PHASE + CONFLICTING_RULES)
    with pytest.raises(ConstraintError, match=r"rules in conflict: team-a, team-b"):
        build_plan(BuildOptions(backend="fa3", spec=spec))


def test_cyclic_phase_order_is_reported(tmp_path):
    spec = _spec(
        tmp_path,
        """
[[phases]]
name = "a"
kind = "decode"
sizes = [1, 2]
after = ["b"]
[[phases]]
name = "b"
kind = "draft_decode"
sizes = [1, 2]
after = ["a"]
""",
    )
    with pytest.raises(ConstraintError, match=r"rules in conflict: after:a, after:b"):
        build_plan(BuildOptions(backend="fa3", spec=spec))


def test_budget_exceeded_names_the_cheapest_alternative(tmp_path):
    phase = '[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [32, 64, 128, 256]\n'
    spec = _spec(tmp_path, "budget_mib = 300\n" + phase)
    build_plan(BuildOptions(backend="fa3", spec=spec))  # views fit
    with pytest.raises(
        ConstraintError,
        match=r"exceeds budget_mib 300; the cheapest schedule the rules allow, "
        r"without the --strategy pins, takes [\d.]+ MiB \(within the budget\): "
        r"decode: order=largest-first outputs=view ",
    ):
        build_plan(BuildOptions(backend="fa3", spec=spec, strategies=("outputs=keep",)))


def test_budget_below_the_floor(tmp_path):
    spec = _spec(tmp_path, "budget_mib = 1\n" + PHASE)
    with pytest.raises(ConstraintError, match=r"budget_mib 1 is below the floor: the largest graph alone needs"):
        build_plan(BuildOptions(backend="fa3", spec=spec))


def test_phase_after_constraint_orders_phases(tmp_path):
    spec = _spec(tmp_path, PHASE + _verify_after("decode"))
    plan = build_plan(BuildOptions(backend="fa3", spec=spec))
    assert [p.name for p in plan.phases] == ["decode", "verify"]  # though verify's graphs are larger
    assert any(e.rule == "after:verify" for e in plan.edges)
    # the decision says the spec fixed the order, not that the weights chose it (they disagree)
    (order,) = [d for d in plan.decisions if d.rule == "phase-order"]
    assert order.why.startswith("the spec fixes this order (verify after decode); each phase's largest graph alone: ")


def test_phase_order_says_which_pairs_the_spec_fixes_and_which_the_weights_chose(tmp_path):
    small = '\n[[phases]]\nname = "small"\nkind = "decode"\nsizes = [1, 2]\n'
    spec = _spec(tmp_path, PHASE + _verify_after("small") + small)
    plan = build_plan(BuildOptions(backend="fa3", spec=spec))
    (order,) = [d for d in plan.decisions if d.rule == "phase-order"]
    assert order.choice == "decode -> small -> verify"
    assert order.why.startswith("where the spec leaves a choice, phases whose largest graph needs the most pool")
    assert order.why.endswith("; the spec fixes verify after small")


def test_expandable_mode_and_library_workspace(tmp_path):
    native = build_plan(BuildOptions(backend="fa3", strategies=("outputs=keep",)))
    exp = build_plan(BuildOptions(backend="fa3", strategies=("outputs=keep",), allocator="expandable"))
    assert exp.predicted.allocator == "expandable" and exp.predicted.pool_bytes != native.predicted.pool_bytes
    spec = _spec(tmp_path, "library_mib = 32\n" + PHASE)
    cold = build_plan(BuildOptions(backend="fa3", spec=spec))
    warm = build_plan(BuildOptions(backend="fa3", spec=_spec(tmp_path / "..", PHASE)))
    assert cold.predicted.pool_bytes == warm.predicted.pool_bytes + 32 * 2**20


def test_trace_driven_prediction(tmp_path):
    import msgspec

    from capture_plan.schemas.trace import CaptureTrace, Event, Trace

    caps = [
        CaptureTrace(
            phase="decode",
            bs=bs,
            events=[
                Event(op="alloc", id=0, size=bs * 2**20),
                Event(op="alloc", id=1, size=bs * 2**19, kind="output"),
                Event(op="free", id=0),
            ],
        )
        for bs in (1, 2, 4, 8, 16, 32)
    ]
    tpath = tmp_path / "t.json"
    tpath.write_bytes(msgspec.json.encode(Trace(captures=caps)))
    plan = build_plan(BuildOptions(backend="fa3", spec=_spec(tmp_path, PHASE), trace=tpath))
    assert plan.predicted.source == "trace" and plan.inputs.trace_digest.startswith("sha256:")
    # largest-first with views: bs=32's 32 MiB temp and 16 MiB output segments
    # serve every later capture, except bs=1's 1 MiB temp: a small-pool request
    # with a 2 MiB segment of its own
    assert plan.predicted.pool_bytes == (32 + 16 + 2) * 2**20


def test_building_twice_gives_identical_bytes(built):
    a = plan_bytes(built(**SMALL_EAGLE, ci=True))  # built earlier in the session
    b = plan_bytes(build_plan(BuildOptions(**SMALL_EAGLE, ci=True)))
    assert a == b and a.endswith(b"\n") and b"/work/" not in a and b"/tmp" not in a


def test_many_sizes_are_screened_but_the_prediction_simulates_every_size(tmp_path, built):
    from capture_plan.planner.inputs.resources import backend
    from capture_plan.planner.inputs.specs import model_presets
    from capture_plan.planner.inputs.validate import decode_spec_sources
    from capture_plan.planner.memory.simulate import simulate
    from capture_plan.planner.memory.workload import Workload
    from capture_plan.planner.schedule.optimize import screened

    sizes = list(range(1, 201))
    assert screened(sizes, 24)[0] == 1 and screened(sizes, 24)[-1] == 200 and len(screened(sizes, 24)) == 24
    assert screened([5, 3, 9], 24) == [3, 5, 9] and screened(sizes, None) == sizes
    assert len(screened(list(range(1, 65)), 24)) == 64  # up to 64 sizes: every size
    path = _spec(tmp_path, f'[[phases]]\nname = "decode"\nkind = "decode"\nsizes = {sizes}\n')
    plan = build_plan(BuildOptions(backend="fa3", spec=path))
    opt = next(d for d in plan.decisions if d.rule == "optimizer")
    assert opt.sizes_compared == 24 and "compared on 24 of 200 sizes" in opt.why
    spec = decode_spec_sources(path.read_bytes(), "spec.toml", presets=model_presets())[0]
    wl = Workload.analytic(spec.model, spec.phases, backend("fa3"))
    st = {"decode": plan.phases[0].strategy}
    exact = simulate([("decode", s.bs) for s in plan.steps if s.op == "capture"], st, wl).pool_bytes
    assert plan.predicted.pool_bytes == exact
    small = built(backend="fa3")
    assert next(d for d in small.decisions if d.rule == "optimizer").sizes_compared == 36
    exact = build_plan(BuildOptions(backend="fa3", spec=path, exact=True))
    assert next(d for d in exact.decisions if d.rule == "optimizer").sizes_compared == 200
    assert exact.command[-1] == "--exact" and exact.predicted.pool_bytes == plan.predicted.pool_bytes


def test_a_simulation_resumed_from_a_copy_equals_one_run_straight_through():
    from capture_plan.planner.inputs.resources import backend
    from capture_plan.planner.inputs.specs import default_spec
    from capture_plan.planner.memory.simulate import PoolSetup, Simulation, simulate
    from capture_plan.planner.memory.workload import Workload
    from capture_plan.schemas.plan import Strategy

    spec = default_spec("eagle")
    wl = Workload.analytic(spec.model, spec.phases, backend("fa3"))
    strategies = {
        p.name: Strategy(outputs="keep" if i % 2 else "view", pool="own" if i == 1 else "shared")
        for i, p in enumerate(spec.phases)
    }
    caps = [(p.name, bs) for p in spec.phases for bs in sorted(p.sizes, reverse=True)[:6]]
    protect = frozenset({spec.phases[0].name})
    whole = simulate(caps, strategies, wl, PoolSetup(protect=protect, library_bytes=32 << 20))
    run = Simulation(wl, PoolSetup(protect=protect, library_bytes=32 << 20))
    for phase, bs in caps[:9]:
        run.capture(phase, bs, strategies[phase])
    twin = run.copy()
    for phase, bs in caps[9:]:
        twin.capture(phase, bs, strategies[phase])
    assert twin.result() == whole
    assert run.result().after_capture == whole.after_capture[:9]


def test_the_engines_loop_reuses_the_optimizers_simulation(monkeypatch):
    import capture_plan.planner.schedule.pipeline as build

    reused = []
    real = build._reused_bytes
    monkeypatch.setattr(build, "_reused_bytes", lambda *a: reused.append(real(*a)) or reused[-1])
    build_plan(BuildOptions(backend="fa3", ci=True))
    assert reused and reused[-1] is not None


@pytest.mark.parametrize("kw", [dict(backend="fa3", ci=True), dict(backend="fa3", speculative="eagle", max_bs=16)])
def test_the_baseline_reused_from_the_optimizer_equals_its_own_simulation(kw, monkeypatch):
    import capture_plan.planner.schedule.pipeline as build

    reused = []
    real = build._reused_bytes
    monkeypatch.setattr(build, "_reused_bytes", lambda *a: reused.append(real(*a)) or reused[-1])
    reference = plan_bytes(build_plan(BuildOptions(**kw)))
    assert reused and reused[-1] is not None  # the reference took the optimizer's simulation
    monkeypatch.setattr(build, "_reused_bytes", lambda *a: None)  # always simulate the engines' loop
    assert plan_bytes(build_plan(BuildOptions(**kw))) == reference


def test_a_tail_recorded_from_an_equal_state_continues_a_run_exactly():
    """Simulation.since/result_with: what the optimizer reuses when a phase leaves its pool as before."""
    from capture_plan.planner.inputs.resources import backend
    from capture_plan.planner.inputs.specs import default_spec
    from capture_plan.planner.memory.simulate import PoolSetup, Simulation, simulate
    from capture_plan.planner.memory.workload import Workload
    from capture_plan.schemas.plan import Strategy

    spec = default_spec("eagle")
    wl = Workload.analytic(spec.model, spec.phases, backend("fa3"))
    first, *rest = [p.name for p in spec.phases]
    view, keep = Strategy(outputs="view"), Strategy(outputs="keep")
    strategies = {first: view, **{n: keep for n in rest}}
    later = [(n, bs) for n in rest for bs in (64, 8, 16)]
    protect = frozenset({rest[0]})
    runs = []
    for head in ([256, 248], [256, 4, 2]):  # different captures of the first phase, the same segments left
        run = Simulation(wl, PoolSetup(protect=protect))
        for bs in head:
            run.capture(first, bs, view)
        runs.append(run)
    a, b = runs
    assert a.state() == b.state() and a.timeline != b.timeline
    mark = a.mark()
    for phase, bs in later:
        a.capture(phase, bs, strategies[phase])
    whole = simulate([(first, 256), (first, 4), (first, 2)] + later, strategies, wl, PoolSetup(protect=protect))
    assert b.result_with(a.since(mark)) == whole
    assert a.result().hazards == whole.hazards


def test_the_optimizer_reusing_recorded_tails_builds_what_it_builds_without(monkeypatch):
    from capture_plan.planner.memory.simulate import Simulation

    opts = BuildOptions(backend="fa3", ci=True, speculative="eagle", max_bs=16)
    reused = []
    real = Simulation.result_with
    monkeypatch.setattr(Simulation, "result_with", lambda self, tail: reused.append(tail) or real(self, tail))
    with_reuse = plan_bytes(build_plan(opts))
    assert reused  # tails were taken as recorded
    monkeypatch.setattr(Simulation, "state", lambda self: object())  # every state new: nothing reused
    reused.clear()
    assert plan_bytes(build_plan(opts)) == with_reuse and not reused


def test_blocks_are_recorded_only_where_a_protected_phases_outputs_can_be_overwritten():
    """Simulation records the blocks a capture touches only when a protected phase other
    than its own shares (or may share) its pool. The hazards and every other figure are
    those of recording every block, in schedules with and without hazards."""
    import itertools

    from capture_plan.planner.inputs.resources import backend
    from capture_plan.planner.inputs.specs import default_spec
    from capture_plan.planner.memory.simulate import PoolSetup, Simulation, simulate
    from capture_plan.planner.memory.workload import Workload
    from capture_plan.schemas.plan import Strategy

    spec = default_spec("eagle", 16)
    wl = Workload.analytic(spec.model, spec.phases, backend("fa3"))
    names = [p.name for p in spec.phases]
    protected = names[0]
    protect = frozenset({protected})
    caps = [(p.name, bs) for p in spec.phases for bs in sorted(p.sizes, reverse=True)]
    hazards = []
    for outputs, pools in itertools.product(("keep", "view"), itertools.product(("shared", "own"), repeat=2)):
        strategies = {
            n: Strategy(
                outputs=outputs if n == protected else "view",
                pool=pools[0] if n == protected else pools[1] if n == names[1] else "shared",
            )
            for n in names
        }
        fast = simulate(caps, strategies, wl, PoolSetup(protect=protect))
        every = Simulation(wl, PoolSetup(protect=protect))  # no `where`: every capture records its blocks
        for phase, bs in caps:
            every.capture(phase, bs, strategies[phase])
        assert fast == every.result(), (outputs, pools)
        hazards.append(bool(fast.hazards))
        if pools[0] == "own":  # alone in its pool: nothing anywhere needs recording
            run = Simulation(wl, PoolSetup(protect=protect), where={protected: f"phase:{protected}"})
            for phase, bs in caps:
                run.capture(phase, bs, strategies[phase])
            assert run.touched == {}
    assert any(hazards) and not all(hazards)  # both kinds of schedule were compared


def test_the_optimizer_guarding_only_pools_with_protected_phases_builds_what_recording_every_block_builds(
    monkeypatch, tmp_path
):
    """The optimizer's runs hold one pool each and record blocks only for the protected
    phases in it; its reused prefixes and tails are keyed by that set. Two protected
    phases, one captured late, so that runs with and without them share prefixes."""
    import msgspec

    import capture_plan.planner.schedule.optimize as optimize
    from capture_plan.planner.inputs.specs import default_spec
    from capture_plan.planner.memory.simulate import PoolSetup, Simulation

    spec = default_spec("eagle", 16)
    late = {"target_verify", "draft_decode"}
    spec = msgspec.structs.replace(
        spec,
        phases=[
            msgspec.structs.replace(p, output_lifetime="across-phases" if p.name in late else "next-replay")
            for p in spec.phases
        ],
    )
    path = tmp_path / "spec.json"
    path.write_bytes(msgspec.json.encode(spec))
    opts = BuildOptions(backend="fa3", spec=path, output=tmp_path / "p.json")
    guarded = plan_bytes(build_plan(opts))

    class EveryBlock(Simulation):  # before: every run guarded every protected phase's outputs
        def __init__(self, workload, setup=None, where=None):
            super().__init__(workload, (setup or PoolSetup())._replace(protect=frozenset(late)))

    monkeypatch.setattr(optimize, "Simulation", EveryBlock)
    assert plan_bytes(build_plan(opts)) == guarded


MiB = 2**20


ROOT = Path(__file__).resolve().parent.parent


def _report(
    plan,
    *,
    per_graph=2 * MiB,
    scratch=100 * MiB,
    workspace=32 * MiB,
    device="NVIDIA H200 sm90, torch 2.11",
    nodes=None,
):
    """A report of ``plan`` as the executor writes it: free memory falls by the pool's growth
    plus ``per_graph`` driver bytes per capture; warm-ups took ``scratch``; ``nodes(bs)``:
    each graph's node count (None: not counted)."""
    free0 = 100_000 * MiB
    free, reserved, steps = free0 - workspace, workspace, []
    for s, m in zip(plan.steps, plan.predicted.timeline):
        if s.op == "capture":
            grown = m.reserved + workspace - reserved
            reserved += grown
            free -= grown + per_graph
        steps.append(
            StepMeasurement(
                step=s.index,
                id=s.id,
                reserved=m.reserved,
                predicted_reserved=m.reserved,
                seconds=0.0,
                free=free,
                allocator_reserved=reserved,
                scratch=scratch if s.op == "warmup" else None,
                graph_nodes=nodes(s.bs) if nodes is not None and s.op == "capture" else None,
            )
        )
    pool = plan.predicted.pool_bytes
    view = DeviceView(
        free_before=free0,
        free_after=free,
        drop=free0 - free,
        items=[
            DeviceItem(name="pool", bytes=pool),
            DeviceItem(name="hoisted", bytes=0),
            DeviceItem(name="allocator-held", bytes=workspace),
            DeviceItem(name="allocator-cached", bytes=0),
            DeviceItem(name="outside-allocator", bytes=free0 - free - pool - workspace),
        ],
        first_in_process=True,
    )
    return CaptureReport(
        plan=plan.name,
        plan_digest=plan.digest,
        device=device,
        torch="2.11",
        backend_module="",
        pool_bytes=pool,
        predicted_pool_bytes=pool,
        capture_seconds=1.0,
        steps=steps,
        driver="580.1",
        device_view=view,
        backend=plan.requires.backend,
        model=ReportModel(dimensions=plan.inputs.model.dimensions, phases=plan.inputs.model.phases),
    )


@pytest.fixture(scope="module")
def fa3ci():
    return build_plan(BuildOptions(backend="fa3", ci=True))


def test_a_device_view_item_nobody_measured_is_an_error_not_zero(fa3ci):
    """DeviceView.item of an item the view lacks (a report of another executor version)
    raises, naming the items there are; before, it read as 0 bytes."""
    from capture_plan.schemas.report import DeviceView

    view = _report(fa3ci).device_view
    assert view.item("pool") == fa3ci.predicted.pool_bytes
    partial = DeviceView(
        free_before=view.free_before,
        free_after=view.free_after,
        drop=view.drop,
        items=[i for i in view.items if i.name != "allocator-cached"],
    )
    with pytest.raises(KeyError, match=r"no item 'allocator-cached'; it has \['pool'"):
        partial.item("allocator-cached")


def test_without_a_calibration_the_measured_items_are_unknown_never_zero(fa3ci):
    dev = fa3ci.predicted.device
    items = {i.name: i for i in dev.items}
    assert items["pool"].bytes == fa3ci.predicted.pool_bytes and items["pool"].provenance == "simulated"
    for name in ("stream-workspace", "allocator-other", "graph-exec"):
        assert items[name].bytes is None and items[name].provenance == "unknown"
        assert "--calibration" in items[name].source
    assert dev.total_bytes is None and dev.peak_bytes is None


def test_a_calibration_report_gives_the_total_and_the_warmup_peak(tmp_path, fa3ci):
    rep = tmp_path / "report.json"
    rep.write_bytes(msgspec.json.encode(_report(fa3ci)))
    plan = build_plan(BuildOptions(backend="fa3", ci=True, calibration=rep, output=tmp_path / "p.json"))
    dev = plan.predicted.device
    items = {i.name: i.bytes for i in dev.items}
    captures = sum(s.op == "capture" for s in plan.steps)
    assert items["stream-workspace"] == 32 * MiB  # planner/data/devices.toml, sm90
    assert items["graph-exec"] == captures * 2 * MiB
    assert dev.total_bytes == sum(items.values())
    # the warm-up runs first, on an empty pool: its 100 MiB scratch is below the final pools here
    assert dev.peak_bytes == dev.total_bytes > 100 * MiB + 32 * MiB
    assert "NVIDIA H200" in dev.device and "580.1" in dev.device
    assert plan.inputs.calibration == "report.json"


def test_a_warmup_larger_than_the_pools_is_the_peak(tmp_path, fa3ci):
    rep = tmp_path / "report.json"
    rep.write_bytes(msgspec.json.encode(_report(fa3ci, scratch=1000 * MiB)))
    plan = build_plan(BuildOptions(backend="fa3", ci=True, calibration=rep, output=tmp_path / "p.json"))
    # the one warm-up runs before any capture: its scratch plus the workspace (allocator-other is 0 here)
    assert plan.predicted.device.peak_bytes == 1000 * MiB + 32 * MiB > plan.predicted.device.total_bytes


def test_a_calibration_without_the_device_items_or_a_workspace_figure_gives_no_zeros(tmp_path, fa3ci):
    rep = _report(fa3ci, device="NVIDIA H200")  # no compute capability: no workspace figure
    path = tmp_path / "r.json"
    path.write_bytes(msgspec.json.encode(rep))
    plan = build_plan(BuildOptions(backend="fa3", ci=True, calibration=path, output=tmp_path / "p.json"))
    items = {i.name: i for i in plan.predicted.device.items}
    assert items["stream-workspace"].bytes is None and items["allocator-other"].bytes is None
    assert plan.predicted.device.total_bytes is None
    bare = msgspec.structs.replace(rep, device_view=msgspec.structs.replace(rep.device_view, items=[]))
    with pytest.raises(InputError, match="lacks pool, hoisted, allocator-held"):
        calibration_from_report(bare, "bare.json", {})


def test_the_peak_is_a_warmup_on_top_of_the_pools_captured_before_it():
    steps = [
        Step(index=0, id="warmup/a/8", op="warmup", phase="a", bs=8),
        Step(index=1, id="capture/a/8", op="capture", phase="a", bs=8),
        Step(index=2, id="warmup/b/8", op="warmup", phase="b", bs=8),
        Step(index=3, id="capture/b/8", op="capture", phase="b", bs=8),
    ]
    after = [0, 300, 300, 320]
    graphs = graphs_after(steps, {"a": 2.0, "b": 1.0}, {})
    assert graphs == [0.0, 2.0, 2.0, 3.0]
    got = peak(steps, taken_after(after, 10, graphs), {"a": 50, "b": 100}, {})
    assert got == 300 + 100 + 10 + 2  # during b's warm-up: a's pool, b's scratch, fixed, a's driver memory
    assert graphs_after(steps, {"a": 2.0}, {}) is None  # b's graphs: unknown
    assert peak(steps, taken_after(after, 10, graphs), {"a": 50}, {}) is None  # b's scratch: unknown


def test_driver_memory_follows_the_nodes_in_whole_chunks_less_what_the_driver_holds():
    """Measured on an H200: the driver takes a graph's memory at instantiation, in 2 MiB
    steps, about 3 KB a node, and reuses what destroyed graphs took."""
    steps = [
        Step(index=0, id="warmup/a/8", op="warmup", phase="a", bs=8),
        Step(index=1, id="capture/a/8", op="capture", phase="a", bs=8),
        Step(index=2, id="capture/a/4", op="capture", phase="a", bs=4),
        Step(index=3, id="capture/a/1", op="capture", phase="a", bs=1),
    ]
    nodes = {"a": {1: 1000, 8: 300}}  # bs 4 is not recorded: between 1 and 8
    assert nodes_at(nodes["a"], 4) == 1000 - 700 * 3 / 7 == 700
    assert nodes_at(nodes["a"], 16) == 300  # outside the recorded sizes: the nearest count
    per_node = 3000.0
    got = driver_after(steps, nodes, per_node)
    chunk = DRIVER_CHUNK
    assert got == [0, chunk, 2 * chunk, 3 * chunk]  # 0.9 MB, 3.0 MB, then 6.0 MB in 2 MiB steps
    assert driver_after(steps, nodes, per_node, held=chunk) == [0, 0, chunk, 2 * chunk]
    assert driver_after(steps, {"b": {1: 5}}, per_node) is None  # a's graphs were never counted


def test_a_calibration_that_counted_nodes_gives_graph_exec_from_them(tmp_path, fa3ci):
    from capture_plan.planner.memory.device import per_node_figure

    n = {bs: 900 - bs for bs in fa3ci.phases[0].sizes}
    rep = tmp_path / "report.json"
    rep.write_bytes(msgspec.json.encode(_report(fa3ci, nodes=n.get)))
    plan = build_plan(BuildOptions(backend="fa3", ci=True, calibration=rep, output=tmp_path / "p.json"))
    item = next(i for i in plan.predicted.device.items if i.name == "graph-exec")
    per_node = per_node_figure("sm90")
    assert per_node is not None  # measured on the H200: planner/data/devices.toml
    expected = -(-round(sum(n.values()) * per_node) // DRIVER_CHUNK) * DRIVER_CHUNK
    assert item.bytes == expected != len(n) * 2 * MiB  # not the report's per-graph figure
    assert "nodes" in item.source and "devices.toml" in item.source
    # the calibration's own figure: its graphs' driver bytes over their nodes
    cal = calibration_from_report(_report(fa3ci, nodes=n.get), "r.json", {})
    assert cal.graph_exec_per_node == pytest.approx(len(n) * 2 * MiB / sum(n.values()))
    assert cal.graph_nodes == {"decode": dict(sorted(n.items()))}


def test_a_report_without_device_memory_is_refused_as_a_calibration(tmp_path, fa3ci):
    old = msgspec.structs.replace(_report(fa3ci), device_view=None)
    with pytest.raises(InputError, match="no device view"):
        calibration_from_report(old, "old.json", {})


def test_a_calibration_from_another_device_than_the_trace_is_refused_naming_both(tmp_path, capsys):
    trace = ROOT / "plans/traces/fa3-ci.json"
    plan = build_plan(BuildOptions(backend="fa3", ci=True, trace=trace, output=tmp_path / "t.json"))
    rep = tmp_path / "h100.json"
    rep.write_bytes(msgspec.json.encode(_report(plan, device="NVIDIA H100 80GB HBM3 sm90, torch 2.11")))
    code = main(
        ["build", "-b", "fa3", "--ci", "--trace", str(trace), "--calibration", str(rep), "-o", str(tmp_path / "x.json")]
    )
    err = capsys.readouterr().err
    assert code == 1 and "H100" in err and "H200" in err and err.count("\n") == 1, err


def _config_spec(tmp_path: Path, config: dict) -> Path:
    """A spec (m.toml) whose model is ``config`` in bfloat16, written beside it as config.json,
    and one decode phase of sizes 1 and 8."""
    (tmp_path / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    spec = tmp_path / "m.toml"
    spec.write_text('[model]\nconfig = "config.json"\n[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 8]\n')
    return spec


def test_config_builds_are_approximate_and_require_exact_refuses_them(tmp_path, capsys):
    spec = _config_spec(
        tmp_path,
        {
            "model_type": "llama",
            "hidden_size": 2048,
            "num_hidden_layers": 4,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "intermediate_size": 5632,
            "vocab_size": 32000,
        },
    )
    plan = build_plan(BuildOptions(backend="torch", spec=spec, output=tmp_path / "m.json"))
    assert plan.predicted.fidelity == "approximate"
    caveat = plan.predicted.caveat
    assert "llama" in caveat and "-89%" in caveat and "capture_plan.executor.profile" in caveat
    out = tmp_path / "m.json"
    assert main(["build", "-b", "torch", "--spec", str(spec), "-o", str(out), "--require-exact"]) == 1
    err = capsys.readouterr().err
    assert "approximate" in err and err.count("\n") == 1 and not out.exists()  # refused before writing
    assert main(["build", "-b", "torch", "--spec", str(spec), "-o", str(out)]) == 0
    assert "approximate: the figures describe the reference" in capsys.readouterr().out
    assert main(["check", str(out)]) == 0 and main(["check", str(out), "--require-exact"]) == 1


def test_reference_and_trace_plans_say_what_they_describe(fa3ci):
    assert fa3ci.predicted.fidelity == "reference" and "capture_plan.references" in fa3ci.predicted.describes
    traced = build_plan(BuildOptions(backend="fa3", ci=True, trace=ROOT / "plans/traces/fa3-ci.json"))
    assert traced.predicted.fidelity == "recorded" and "fa3-ci.json" in traced.predicted.describes


def test_a_report_from_another_device_than_the_calibration_is_refused_naming_both(tmp_path, fa3ci, capsys):
    rep = tmp_path / "report.json"
    rep.write_bytes(msgspec.json.encode(_report(fa3ci)))
    out = tmp_path / "p.json"
    assert main(["build", "-b", "fa3", "--ci", "--calibration", str(rep), "-o", str(out)]) == 0
    plan = json.loads(out.read_text())
    other = msgspec.structs.replace(
        _report(fa3ci), device="NVIDIA H100 80GB HBM3 sm90, torch 2.11", plan_digest=plan["digest"]
    )
    (tmp_path / "h100.json").write_bytes(msgspec.json.encode(other))
    capsys.readouterr()
    assert main(["report", str(tmp_path / "h100.json"), "--plan", str(out)]) == 1
    err = capsys.readouterr().err
    assert "H100" in err and "H200" in err and err.count("\n") == 1, err
    same = msgspec.structs.replace(_report(fa3ci), plan_digest=plan["digest"])
    (tmp_path / "same.json").write_bytes(msgspec.json.encode(same))
    assert main(["report", str(tmp_path / "same.json"), "--plan", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "device view (foreground, first capture of its process" in shown and "graph-exec" in shown


def test_report_require_exact_refuses_an_approximate_plan_and_needs_one(tmp_path, capsys):
    spec = _config_spec(
        tmp_path,
        {
            "model_type": "mixtral",
            "hidden_size": 1024,
            "num_hidden_layers": 2,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "intermediate_size": 3584,
            "vocab_size": 32000,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
        },
    )
    out = tmp_path / "m.json"
    assert main(["build", "-b", "torch", "--spec", str(spec), "-o", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["predicted"]["fidelity"] == "approximate" and "mixtral" in plan["predicted"]["caveat"]
    rep = tmp_path / "r.json"
    p = build_plan(BuildOptions(backend="torch", spec=spec, output=out))
    rep.write_bytes(msgspec.json.encode(_report(p)))
    capsys.readouterr()
    assert main(["report", str(rep), "--plan", str(out)]) == 0
    assert main(["report", str(rep), "--plan", str(out), "--require-exact"]) == 1
    assert "approximate" in capsys.readouterr().err
    assert main(["report", str(rep), "--require-exact"]) == 1
    assert "--plan" in capsys.readouterr().err


def test_a_calibrated_plan_compares_with_its_own_calibration_report(capsys):
    cal = ROOT / "plans/calibration/h200-fa3-ci.json"
    assert main(["report", str(cal), "--plan", str(ROOT / "plans/fa3-ci-h200.json")]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("graph-exec"))
    assert row.split()[1:3] == ["94.0", "94.0"]  # predicted from that very report, measured in it
    # another plan's report stays refused
    assert main(["report", str(cal), "--plan", str(ROOT / "plans/fa3-eagle-ci-h200.json")]) == 1


@st.composite
def _dags(draw):
    n = draw(st.integers(1, 12))
    edges = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=30))
    keys = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))  # ties broken by insertion order
    perm = draw(st.permutations(range(n)))  # insertion order differs from node value
    return n, [(a, b) for a, b in edges if a < b], keys, perm


@settings(max_examples=150, deadline=None)
@given(_dags())
def test_topological_order_is_networkx_lexicographic_order(case):
    n, edges, keys, perm = case
    g, ng = Digraph(), nx.DiGraph()
    for v in perm:
        g.add_node(v)
        ng.add_node(v)
    for a, b in edges:
        g.add_edge(a, b, rule="r")
        ng.add_edge(a, b)
    key = keys.__getitem__
    assert g.topological_order(key) == list(nx.lexicographical_topological_sort(ng, key=key))


def test_cycle_names_its_rules():
    g = Digraph()
    g.add_edge("a", "b", rule="r1")
    g.add_edge("b", "c", rule="r2")
    g.add_edge("c", "a", rule="r3")
    g.add_edge("c", "d", rule="r4")
    assert g.topological_order(lambda n: n) is None
    with pytest.raises(ConstraintError, match=r"rules in conflict: r1, r2, r3 .*a -> b -> c -> a"):
        check_acyclic(g)


KINDS = ("decode", "target_verify", "draft_decode", "draft_extend")


@st.composite
def specs(draw):
    n = draw(st.integers(1, 3))
    phases = []
    for i in range(n):
        # up to 4 sizes a phase: both capture orders and every rule (no rule looks at
        # how many sizes a phase has), with half the captures to simulate per example
        sizes = draw(st.lists(st.integers(1, 96), min_size=1, max_size=4, unique=True))
        phase = {
            "name": f"p{i}",
            "kind": draw(st.sampled_from(KINDS)),
            "sizes": sizes,
            "tokens_per_request": draw(st.sampled_from([1, 2, 4])),
            "output_lifetime": draw(st.sampled_from(["next-replay", "across-phases"])),
        }
        if i and draw(st.booleans()):
            phase["after"] = [f"p{draw(st.integers(0, i - 1))}"]
        phases.append(phase)
    model = {
        "layers": draw(st.integers(1, 4)),
        "hidden": 512,
        "heads": 8,
        "kv_heads": 2,
        "head_dim": 64,
        "intermediate": 1024,
        "vocab": draw(st.sampled_from([1000, 32000, 128256])),
    }
    return {"model": model, "phases": phases, "allocator": draw(st.sampled_from(["native", "expandable"]))}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs(), st.sampled_from(["fa3", "flashinfer", "triton", "torch"]), st.booleans())
def test_plans_respect_every_constraint_and_are_reproducible(tmp_path, spec, backend, ci):
    path = tmp_path / "spec.json"
    path.write_bytes(msgspec.json.encode(spec))
    opts = BuildOptions(backend=backend, ci=ci, spec=path, output=tmp_path / "plan.json")
    plan = build_plan(opts)
    index = {s.id: s.index for s in plan.steps}
    # every ordering edge holds in the step list
    assert all(index[e.src] < index[e.dst] for e in plan.edges)
    # every capture is planned exactly once, in its phase's declared order
    for ph in plan.phases:
        caps = [s.bs for s in plan.steps if s.op == "capture" and s.phase == ph.name]
        assert caps == ph.sizes == sorted(ph.sizes, reverse=ph.strategy.order == "largest-first")
        first = min(index[f"capture/{ph.name}/{bs}"] for bs in ph.sizes)
        warm = [s for s in plan.steps if s.op == "warmup" and s.phase == ph.name]
        assert warm and all(s.index < first or ph.strategy.warmup == "every-size" for s in warm)
    # every rule holds for the chosen strategies
    from capture_plan.schemas.spec import Phase

    ctx = Context(backend=backend, ci=ci)
    for ph in plan.phases:
        p = msgspec.convert(next(x for x in spec["phases"] if x["name"] == ph.name), Phase)
        assert violated(ph.strategy, phase_rules(list(builtin_rules()), p, ctx)) == []
        for dep in p.after:  # `after` holds: every capture of dep precedes every capture of ph
            assert max(index[f"capture/{dep}/{b}"] for b in spec["phases"][int(dep[1:])]["sizes"]) < min(
                index[f"capture/{ph.name}/{b}"] for b in ph.sizes
            )
    # reserved memory never falls, and the peak is what the plan reports
    reserved = [m.reserved for m in plan.predicted.timeline]
    assert reserved == sorted(reserved) and reserved[-1] == plan.predicted.pool_bytes
    # the same inputs give the same bytes
    assert plan_bytes(build_plan(opts)) == plan_bytes(plan)


EXAMPLES = int(os.environ.get("CAPTURE_PLAN_FUZZ_EXAMPLES", "10"))


PROPS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


SPEC = (
    '[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 2, 4, 8]\n'
    '[[phases]]\nname = "verify"\nkind = "target_verify"\nsizes = [1, 4]\ntokens_per_request = 4\n'
    'output_lifetime = "across-phases"\n'
)


PINS = st.lists(
    st.sampled_from(
        [
            f"{scope}{axis}={value}"
            for scope in ("", "decode.", "verify.")
            for axis, values in AXIS_VALUES.items()
            for value in values
        ]
    ),
    max_size=4,
)


def run(cli_main, cwd: Path, *args: str) -> tuple[int, str, str]:
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    old = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli_main(list(args))
    finally:
        os.chdir(old)
    return code, out.getvalue(), err.getvalue()


@PROPS
@given(
    pins=PINS,
    ci=st.booleans(),
    backend=st.sampled_from(["fa3", "triton"]),
    tp=st.sampled_from([None, 1, 2, 8]),
    allocator=st.sampled_from([None, "native", "expandable"]),
    out_name=st.sampled_from([None, "what-if.json"]),
)
def test_an_accepted_build_checks_clean_from_anywhere_and_rebuilds_byte_identical(
    tmp_path_factory, pins, ci, backend, tp, allocator, out_name
):
    from capture_plan.planner.cli import main

    root = tmp_path_factory.mktemp("p")
    (root / "specs").mkdir()
    (root / "specs/s.toml").write_text(SPEC)
    (root / "elsewhere").mkdir()

    def build_args(pin_order: list[str]) -> list[str]:
        args = ["build", "-b", backend, "--spec", "../specs/s.toml"]
        args += ["--ci"] * ci + [a for p in pin_order for a in ("-s", p)]
        args += ["--tp", str(tp)] if tp is not None else []
        args += ["--allocator", allocator] if allocator else []
        return args + (["-o", f"../plans/{out_name}"] if out_name else [])

    code, out, err = run(main, root / "elsewhere", *build_args(pins))  # not from the repo root
    assert code in (0, 1), err
    if code == 1:
        assert err.startswith("planner: error: ") and err.count("\n") == 1, err
        return
    plans = sorted((root / "plans" if out_name else root / "elsewhere/plans").glob("*.json"))
    assert len(plans) == 1, plans
    first = plans[0].read_bytes()
    code, out, err = run(main, root / "specs", "check", os.path.relpath(plans[0], root / "specs"))
    assert code == 0 and out.endswith(": up to date\n"), (pins, err)
    code, _, err = run(main, root / "elsewhere", *build_args(pins[::-1]))  # same pins, other order
    assert code == 0, err
    assert plans[0].read_bytes() == first
