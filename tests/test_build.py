"""capture_plan.planner.build: what the plans decide, and the constraints they honour."""

from __future__ import annotations

from pathlib import Path

import pytest

from capture_plan.planner import BuildOptions, build_plan, plan_bytes
from capture_plan.schemas.errors import ConstraintError, InputError


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


def test_conflicting_order_rules_are_reported_as_the_rules_in_conflict(tmp_path):
    spec = _spec(
        tmp_path,
        PHASE
        + """
[[rules]]
id = "team-a"
why = "x"
require = [{ order = "largest-first" }]
[[rules]]
id = "team-b"
why = "y"
require = [{ order = "smallest-first" }]
""",
    )
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
    spec = _spec(
        tmp_path,
        PHASE
        + """
[[phases]]
name = "verify"
kind = "target_verify"
tokens_per_request = 4
sizes = [1, 2, 4]
after = ["decode"]
""",
    )
    plan = build_plan(BuildOptions(backend="fa3", spec=spec))
    assert [p.name for p in plan.phases] == ["decode", "verify"]  # though verify's graphs are larger
    assert any(e.rule == "after:verify" for e in plan.edges)


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
    from capture_plan.planner.optimize import screened
    from capture_plan.planner.resources import backend, phase_kind_settings
    from capture_plan.planner.simulate import simulate
    from capture_plan.planner.validate import decode_spec
    from capture_plan.planner.workload import Workload

    sizes = list(range(1, 201))
    assert screened(sizes, 24)[0] == 1 and screened(sizes, 24)[-1] == 200 and len(screened(sizes, 24)) == 24
    assert screened([5, 3, 9], 24) == [3, 5, 9] and screened(sizes, None) == sizes
    assert len(screened(list(range(1, 65)), 24)) == 64  # up to 64 sizes: every size
    path = _spec(tmp_path, f'[[phases]]\nname = "decode"\nkind = "decode"\nsizes = {sizes}\n')
    plan = build_plan(BuildOptions(backend="fa3", spec=path))
    opt = next(d for d in plan.decisions if d.rule == "optimizer")
    assert opt.sizes_compared == 24 and "compared on 24 of 200 sizes" in opt.why
    spec = decode_spec(path.read_bytes(), "spec.toml", phase_kinds=phase_kind_settings())
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
    from capture_plan.planner.resources import backend
    from capture_plan.planner.simulate import Simulation, simulate
    from capture_plan.planner.specs import default_spec
    from capture_plan.planner.workload import Workload
    from capture_plan.schemas.plan import Strategy

    spec = default_spec("eagle")
    wl = Workload.analytic(spec.model, spec.phases, backend("fa3"))
    strategies = {
        p.name: Strategy(outputs="keep" if i % 2 else "view", pool="own" if i == 1 else "shared")
        for i, p in enumerate(spec.phases)
    }
    caps = [(p.name, bs) for p in spec.phases for bs in sorted(p.sizes, reverse=True)[:6]]
    protect = frozenset({spec.phases[0].name})
    whole = simulate(caps, strategies, wl, protect=protect, library_bytes=32 << 20)
    run = Simulation(wl, protect=protect, library_bytes=32 << 20)
    for phase, bs in caps[:9]:
        run.capture(phase, bs, strategies[phase])
    twin = run.copy()
    for phase, bs in caps[9:]:
        twin.capture(phase, bs, strategies[phase])
    assert twin.result() == whole
    assert run.result().after_capture == whole.after_capture[:9]


def test_the_engines_loop_reuses_the_optimizers_simulation(monkeypatch):
    import capture_plan.planner.build as build

    reused = []
    real = build._reused_bytes
    monkeypatch.setattr(build, "_reused_bytes", lambda *a: reused.append(real(*a)) or reused[-1])
    build_plan(BuildOptions(backend="fa3", ci=True))
    assert reused and reused[-1] is not None


@pytest.mark.parametrize("kw", [dict(backend="fa3", ci=True), dict(backend="fa3", speculative="eagle", max_bs=16)])
def test_the_baseline_reused_from_the_optimizer_equals_its_own_simulation(kw, monkeypatch):
    import capture_plan.planner.build as build

    reused = []
    real = build._reused_bytes
    monkeypatch.setattr(build, "_reused_bytes", lambda *a: reused.append(real(*a)) or reused[-1])
    reference = plan_bytes(build_plan(BuildOptions(**kw)))
    assert reused and reused[-1] is not None  # the reference took the optimizer's simulation
    monkeypatch.setattr(build, "_reused_bytes", lambda *a: None)  # always simulate the engines' loop
    assert plan_bytes(build_plan(BuildOptions(**kw))) == reference


def test_a_tail_recorded_from_an_equal_state_continues_a_run_exactly():
    """Simulation.since/result_with: what the optimizer reuses when a phase leaves its pool as before."""
    from capture_plan.planner.resources import backend
    from capture_plan.planner.simulate import Simulation, simulate
    from capture_plan.planner.specs import default_spec
    from capture_plan.planner.workload import Workload
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
        run = Simulation(wl, protect=protect)
        for bs in head:
            run.capture(first, bs, view)
        runs.append(run)
    a, b = runs
    assert a.state() == b.state() and a.timeline != b.timeline
    mark = a.mark()
    for phase, bs in later:
        a.capture(phase, bs, strategies[phase])
    whole = simulate([(first, 256), (first, 4), (first, 2)] + later, strategies, wl, protect=protect)
    assert b.result_with(a.since(mark)) == whole
    assert a.result().hazards == whole.hazards


def test_the_optimizer_reusing_recorded_tails_builds_what_it_builds_without(monkeypatch):
    from capture_plan.planner.simulate import Simulation

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

    from capture_plan.planner.resources import backend
    from capture_plan.planner.simulate import Simulation, simulate
    from capture_plan.planner.specs import default_spec
    from capture_plan.planner.workload import Workload
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
        fast = simulate(caps, strategies, wl, protect=protect)
        every = Simulation(wl, protect=protect)  # no `where`: every capture records its blocks
        for phase, bs in caps:
            every.capture(phase, bs, strategies[phase])
        assert fast == every.result(), (outputs, pools)
        hazards.append(bool(fast.hazards))
        if pools[0] == "own":  # alone in its pool: nothing anywhere needs recording
            run = Simulation(wl, protect=protect, where={protected: f"phase:{protected}"})
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

    import capture_plan.planner.optimize as optimize
    from capture_plan.planner.simulate import Simulation
    from capture_plan.planner.specs import default_spec

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
        def __init__(self, workload, expandable=False, protect=frozenset(), library_bytes=0, where=None):
            super().__init__(workload, expandable, frozenset(late), library_bytes)

    monkeypatch.setattr(optimize, "Simulation", EveryBlock)
    assert plan_bytes(build_plan(opts)) == guarded
