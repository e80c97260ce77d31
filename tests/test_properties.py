"""Property tests: any valid spec gives a plan that respects its constraints, reproducibly."""

from __future__ import annotations

import hypothesis.strategies as st
import msgspec
from hypothesis import HealthCheck, given, settings

from capture_plan.planner import BuildOptions, build_plan, plan_bytes
from capture_plan.planner.resources import builtin_rules
from capture_plan.planner.rules import Context, phase_rules, violated

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
