"""The build pipeline: a resolved build -> a canonical, sealed plan.

Reading and checking the inputs is planner/schedule/resolve.py's (step 1, once per build);
what a build was asked is planner/inputs/build_options.py's; choosing sizes for a traffic
before the pipeline runs is planner/build.py's (planner/sizes/ prices lists on the resolved
build, with :func:`schedule`, and hands the plan its decisions ready-made: a
:class:`SizeRecord`); writing and checking plan files is planner/report/plan_files.py's.

In named steps (:func:`plan`): optimize the strategies (optimize.py) -> order the
steps (graph.py) -> predict memory (the ordered steps simulated, and the engines'
loop) -> the budget (and its floor) -> assemble the sealed plan.

Everything recorded in the plan is relative and sorted: the same inputs give
the same bytes on any machine (tests/test_build.py: test_building_twice_gives_identical_bytes,
test_an_accepted_build_checks_clean_from_anywhere_and_rebuilds_byte_identical).
"""

from __future__ import annotations

import msgspec

from capture_plan.schemas.codec import seal, sha256
from capture_plan.schemas.errors import ConstraintError
from capture_plan.schemas.key_fields import set_key_fields
from capture_plan.schemas.keys import needed_revision
from capture_plan.schemas.plan import (
    INPUTS_REVISION,
    SIZES_REVISION,
    Decision,
    Inputs,
    PhasePlan,
    Plan,
    Prediction,
    Requires,
    SizeChoice,
    Step,
    StepMemory,
    Strategy,
    TraceSamples,
    VariantAxis,
    record_command,
)
from capture_plan.schemas.spec import Spec
from capture_plan.schemas.strategy import AXES, MEMORY_AXES
from capture_plan.schemas.units import MiB, mib

from ..inputs import resources
from ..inputs.build_options import relative
from ..inputs.rules import rule_text, satisfies
from ..memory.analytic import workspace_bytes
from ..memory.device import CaptureFigures, device_prediction, pools_after
from ..memory.fidelity import fidelity
from ..memory.simulate import SimResult, pool_id, simulate
from .graph import StepGraph, build_steps, fixed_by_spec
from .keys import key_predictions, keyed_steps, piece_count, uses_keys
from .optimize import SCREEN_SIZES, Problem, Solution, optimize
from .resolve import Resolved
from .sequence import Build, capture_sequence

__all__ = ["SizeRecord", "plan", "schedule"]


class SizeRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What a size choice adds to the plan built with its sizes, ready-made by planner/sizes/
    (the pipeline records it as given): its decisions, its figures per phase, and the traffic."""

    decisions: list[Decision]
    sizes: list[SizeChoice]
    #: the traffic's path relative to the plan's folder, and the digest of its bytes
    traffic: str
    traffic_digest: str


def _order_rule(rules, st: Strategy, pins: dict) -> str:
    forcing = [r.id for r in rules if r.require and all(c.order == st.order for c in r.require)]
    if forcing:
        return forcing[0]
    if "order" in pins:
        return f"--strategy order={st.order}"
    preferring = [r.id for r in rules if r.prefer is not None and r.prefer.order == st.order]
    meeting = [r.id for r in rules if r.require and any(c.order == st.order and satisfies(st, c) for c in r.require)]
    return (meeting or preferring or ["optimizer"])[0]


def _steps(b: Build, sg: StepGraph, order: list[str]) -> list[Step]:
    strategies, phases, backend = b.strategies, b.resolved.by_name, b.resolved.backend
    steps = []
    for i, sid in enumerate(order):
        node = sg.g.nodes[sid]
        op, name, bs = node["op"], node["phase"], node["bs"]
        st = strategies[name]
        steps.append(
            Step(
                index=i,
                id=sid,
                op=op,
                phase=name,
                bs=bs,
                pool=pool_id(name, st) if op == "capture" else "",
                outputs=st.outputs if op == "capture" else None,
                runs=1 if op == "warmup" else 0,
                bytes=workspace_bytes(backend, bs, phases[name].tokens_per_request) if op == "provision" else 0,
            )
        )
    return steps


def _timeline(steps: list[Step], after_capture: list[tuple[int, int]]) -> list[StepMemory]:
    """Pool state after every step; only captures change it."""
    timeline, reserved, allocated = [], 0, 0
    captures = iter(after_capture)
    for s in steps:
        if s.op == "capture":
            reserved, allocated = next(captures)
        timeline.append(StepMemory(step=s.index, reserved=reserved, allocated=allocated))
    return timeline


def _check_budget(b: Build, pred: _Predicted) -> None:
    """Refuse a plan over the spec's ``budget_mib``, naming the cheapest schedule
    the rules allow, per phase, at its real total. With ``--strategy`` pins that
    is the build without them (the alternatives a pinned build records are
    each priced with the other phases still pinned: their minimum named a
    schedule no build would make); without pins it is this plan."""
    r, sol = b.resolved, b.solution
    spec = r.spec
    total = pred.sim.pool_bytes + pred.hoisted
    if spec.budget_mib is None or total <= spec.budget_mib * MiB:
        return
    where = f"{r.spec_source}: $.budget_mib"
    budget = spec.budget_mib * MiB
    floor = max(r.alone.values())
    if r.pins:
        free = r.without_pins()
        free_sol = _optimize(free)
        free_build = _build(free, free_sol)
        free_pred = _predict(free_build, _order(free_build).steps)
        cheapest, strategies = free_pred.sim.pool_bytes + free_pred.hoisted, free_sol.strategies
        named = "; ".join(f"{n}: {strategies[n].label()}" for n in r.sequence)
        found = (
            f"the cheapest schedule the rules allow, without the --strategy pins, takes {mib(cheapest)} "
            f"({'within' if cheapest <= budget else 'also over'} the budget): {named}"
        )
    else:
        cheapest = total
        named = "; ".join(f"{n}: {sol.strategies[n].label()}" for n in r.sequence)
        found = f"no schedule the rules allow is cheaper than this one: {named}"
    # this plan's own total, in whole MiB: a budget that fits this build (the floor, the
    # largest graph alone, did not: the other graphs and the hoisted workspaces add to it)
    fits = f"raise budget_mib to at least {-(-total // MiB)}"
    if cheapest <= budget:
        fix = f"drop the --strategy pins, or {fits}"
    elif r.pins:
        fix = f"{fits} ({-(-cheapest // MiB)} without the --strategy pins), or capture fewer sizes"
    else:
        fix = f"{fits}, or capture fewer sizes"
    what = f"predicted {mib(total)} exceeds budget_mib {spec.budget_mib:g}; {found}"
    if budget < floor:
        what = f"budget_mib {spec.budget_mib:g} is below the floor: the largest graph alone needs {mib(floor)}; {what}"
    raise ConstraintError(what, where=where, fix=fix)


def _phase_order_decision(spec: Spec, sequence: list[str], alone: dict[str, int]) -> Decision:
    """The phase order and why: by pool weight where the spec leaves a choice, and what the
    spec fixes itself (``after``, ``twin_of``) said as such, not as a weight that only
    happens to agree with it."""
    weights = ", ".join(f"{n} {mib(alone[n])}" for n in sequence)
    fixed = fixed_by_spec(spec.phases, sequence)
    if not fixed:
        why = "phases whose largest graph needs the most pool capture first, so later phases reuse "
        why += f"its freed blocks: {weights}"
    elif len(fixed) == len(sequence) - 1:
        why = f"the spec fixes this order ({'; '.join(fixed)}); each phase's largest graph alone: {weights}"
    else:
        why = (
            "where the spec leaves a choice, phases whose largest graph needs the most pool capture first, so later "
            f"phases reuse its freed blocks: {weights}; the spec fixes {'; '.join(fixed)}"
        )
    return Decision(
        phase="*",
        rule="phase-order",
        constraint="after: " + (", ".join(f"{p.name} after {d}" for p in spec.phases for d in p.after) or "none"),
        choice=" -> ".join(sequence),
        why=why,
    )


def _reused_bytes(sims: dict, strategies: dict[str, Strategy], captures: tuple[tuple, ...]) -> int | None:
    """Pool bytes of ``captures`` under ``strategies`` if the optimizer already
    simulated exactly that (same captures in the same order, same memory axes;
    warm-ups and hazard tracking do not change the bytes); else None."""
    for members, (seq, sim) in sims.items():
        if seq == captures and all(_memory(st) == _memory(strategies[n]) for n, st in members):
            return sim.pool_bytes
    return None


def _memory(st: Strategy) -> tuple[str, ...]:
    return tuple(getattr(st, ax) for ax in MEMORY_AXES)


class _Ordered(msgspec.Struct, frozen=True):
    """Step 3: the step graph of the chosen strategies and its canonical order."""

    graph: StepGraph
    order: list[str]
    steps: list[Step]


class _Predicted(msgspec.Struct, frozen=True):
    """Step 4: the plan's exact simulation and the engines' loop for comparison."""

    sim: SimResult
    baseline_bytes: int
    hoisted: int


def _with_key_orders(r: Resolved, strategies: dict[str, Strategy]) -> dict[str, Strategy]:
    """``strategies`` in ``r``'s phase order, each phase with variant axes given the key
    order its rules set (``r.keys``): each phase's strategy as a plan of ``r`` records it."""
    return {
        n: msgspec.structs.replace(strategies[n], key_order=r.keys[n][1]) if n in r.keys else strategies[n]
        for n in r.sequence
    }


def _build(r: Resolved, sol: Solution) -> Build:
    """``r`` under the optimizer's strategies (their key orders set), with the sequence they
    capture: made once per plan, what the later steps read."""
    chosen = _with_key_orders(r, sol.strategies)
    return Build(r, chosen, capture_sequence([r.by_name[n] for n in r.sequence], chosen), sol)


def _optimize(r: Resolved) -> Solution:
    """Step 2: each phase's strategy (optimize.py)."""
    return optimize(
        Problem(
            phases=r.spec.phases,
            sequence=r.sequence,
            rules=r.rules,
            backend=r.backend,
            workload=r.workload,
            pins=r.pins,
            baseline=resources.baseline(),
            expandable=r.expandable,
            library_bytes=r.library,
            screen=None if r.opts.exact else SCREEN_SIZES,
            keys=r.keys,
        )
    )


def _order(b: Build) -> _Ordered:
    """Step 3: the steps of the build's capture sequence, ordered by the rules' edges."""
    r, strategies = b.resolved, b.strategies
    names = [p.name for p in r.spec.phases]
    pins = r.pins
    order_rule = {n: _order_rule(r.rules[n], strategies[n], {**pins.get(None, {}), **pins.get(n, {})}) for n in names}
    warm_rule = {n: next((x.id for x in r.rules[n] if any(c.warmup for c in x.require)), "warmup") for n in names}
    hoist_rule = {
        n: next((x.id for x in r.rules[n] if any(c.workspace == "hoisted" for c in x.require)), "optimizer")
        for n in names
    }
    sg = build_steps(b, order_rule, warm_rule, hoist_rule)
    order = sg.order()
    steps = _steps(b, sg, order)
    if any(uses_keys(p) for p in r.spec.phases):
        labels = {sid: sg.g.nodes[sid]["labels"] for sid in order}
        steps = keyed_steps(b, steps, labels)
    return _Ordered(graph=sg, order=order, steps=steps)


def _predict(b: Build, steps: list[Step]) -> _Predicted:
    """Step 4: the build's capture sequence simulated, at every size (the optimizer's
    simulation when it ran the same captures), and the engines' loop."""
    r, sol = b.resolved, b.solution
    strategies = sol.strategies
    if [s.id for s in steps if s.op == "capture"] != [c.id for c in b.sequence.captures]:
        raise ConstraintError(  # the rules' edges only ever confirm the sequence's order
            "the ordered steps capture in another order than the build's capture sequence",
            where="planned step order",
            fix="report this as a bug (`planner --debug` shows where); pin another order with -s meanwhile",
        )
    captures = tuple(c.key for c in b.sequence.captures)
    seen = sol.sims.get(tuple((n, strategies[n]) for n in r.sequence))
    sim = seen[1] if seen is not None and seen[0] == captures else simulate(captures, strategies, r.workload, r.pools)
    if sim.hazards:  # the optimizer never picks such a schedule; this guards the step order
        raise ConstraintError(
            sim.hazards[0],
            where="planned step order",
            fix="report this as a bug (`planner --debug` shows where); pin another order with -s meanwhile",
        )
    baseline = resources.baseline()
    # rules.toml's baseline sets every axis it has a value for; another keeps Strategy's default
    set_axes = {ax: getattr(baseline, ax) for ax in AXES if getattr(baseline, ax) is not None}
    base_st = dict.fromkeys(r.sequence, Strategy(**set_axes))
    # the engines' loop captures every graph key too: per size, every variant; a twin after its phase
    loop = capture_sequence([r.by_name[n] for n in r.sequence], base_st, twins=False)
    base_seq = tuple(c.key for c in loop.captures)
    baseline_bytes = _reused_bytes(sol.sims, base_st, base_seq)
    if baseline_bytes is None:
        # the engines' loop guards no outputs
        loop_pools = r.pools._replace(protect=frozenset())
        baseline_bytes = simulate(base_seq, base_st, r.workload, loop_pools).pool_bytes
    hoisted = sum(s.bytes for s in steps if s.op == "provision")
    return _Predicted(sim=sim, baseline_bytes=baseline_bytes, hoisted=hoisted)


def _phase_plan_keys(r: Resolved, name: str) -> dict:
    """The graph-key fields of one phase's PhasePlan (none for a phase without them), and
    the properties of its kind that the plan records for its consumer."""
    p, out = r.by_name[name], {}
    if p.variants is not msgspec.UNSET:
        out["variants"] = [VariantAxis(name=a, labels=list(v)) for a, v in p.variants.items()]
    n = piece_count(p, r.spec.model)
    if n is not None:
        out["pieces"] = n
    out |= set_key_fields(p)  # the graph-key fields (schemas/key_fields.py), as the spec sets them
    if p.warmup_keeps is not msgspec.UNSET:
        out["warmup_keeps"] = p.warmup_keeps
    if resources.phase_kinds()[p.kind].piecewise:  # the kind's property its consumer reads (revision 6)
        out["piecewise"] = True
    if p.reuse is not msgspec.UNSET:  # executable reuse (revision 7); its module loads only then
        from ..memory.exec_reuse import reuse_fields

        out |= reuse_fields(p)
    return out


def _key_order_decisions(r: Resolved) -> list[Decision]:
    """Why each phase with variant axes captures its keys in their order."""
    out = []
    for n in r.sequence:
        if n not in r.keys:
            continue
        combos, order, rule = r.keys[n]
        axes = ", ".join(f"{a} ({len(v)})" for a, v in r.by_name[n].variants.items())  # pyright: ignore[reportAttributeAccessIssue]
        why = (
            "per size, every variant (the engines' loop: SGLang's _capture_one_stream)"
            if order == "size-major"
            else "per variant, every size"
        )
        out.append(
            Decision(
                phase=n,
                rule=rule,
                constraint=f"variant axes {axes}: {len(combos)} graph keys per size",
                choice=f"key_order={order}",
                why=why if rule != "default" else f"no rule sets it: {why}",
            )
        )
    return out


def _assemble(b: Build, ordered: _Ordered, pred: _Predicted, chosen: SizeRecord | None) -> Plan:
    """Step 5: the Plan, sealed with its digest."""
    r, strategies = b.resolved, b.strategies
    opts, steps, spec, by_name = r.opts, ordered.steps, r.spec, r.by_name
    decisions = [_phase_order_decision(spec, r.sequence, r.alone)] if len(r.sequence) > 1 else []
    decisions += b.solution.decisions
    if chosen is not None:
        decisions += chosen.decisions
    if r.keys:
        decisions += _key_order_decisions(r)
    output = r.output
    timeline = _timeline(steps, pred.sim.after_capture)
    fid, describes, caveat = fidelity(
        r.workload.source,
        spec.model,
        r.spec_read.model_config,
        f"{relative(r.trace_path, output.parent)} ({r.traced_on})" if r.trace_path else "",
    )
    device = device_prediction(
        CaptureFigures(
            pool=pred.sim.pool_bytes,
            hoisted=pred.hoisted,
            steps=steps,
            pool_after=pools_after(steps, timeline),
            kept=sum(s.keeps for s in steps if s.keeps is not msgspec.UNSET)  # pyright: ignore[reportArgumentType]
            if any(s.keeps is not msgspec.UNSET for s in steps)
            else None,
        ),
        {p.name: p.kind for p in spec.phases},
        r.calibration or r.device_estimate,
    )
    plan = Plan(
        name=output.stem,
        command=record_command(r.record),
        inputs=Inputs(
            spec=r.spec_read.name,
            spec_digest=sha256(r.spec_read.raw),
            rules_digest=resources.rules_digest(),
            backend=opts.backend,
            ci=opts.ci,
            speculative=opts.speculative,
            max_bs=max(max(p.sizes) for p in spec.phases),
            tp=r.tp,
            strategies=sorted(set(opts.strategies)),
            trace=relative(r.trace_path, output.parent) if r.trace_path is not None else None,
            trace_digest=r.trace_digest,
            **(
                {"model_config": r.spec_read.model_config[0], "model_config_digest": r.spec_read.model_config[1]}
                if r.spec_read.model_config
                else {}
            ),
            **(
                {"calibration": r.calibration_record[0], "calibration_digest": r.calibration_record[1]}
                if r.calibration_record
                else {}
            ),
            **({"traffic": chosen.traffic, "traffic_digest": chosen.traffic_digest} if chosen is not None else {}),
            build=r.record,
            model=r.spec_read.model,
            rules={rule.id: rule_text(rule) for rule in list(resources.builtin_rules()) + list(spec.rules)},
        ),
        requires=Requires(
            backend=opts.backend,
            modules=list(r.backend.modules),
            min_compute_capability=list(r.backend.min_compute_capability),
            tp=r.tp,
        ),
        phases=[
            PhasePlan(
                name=n,
                kind=by_name[n].kind,
                sizes=list(b.sequence.sizes[n]),
                tokens_per_request=by_name[n].tokens_per_request,
                output_lifetime=by_name[n].output_lifetime,
                strategy=strategies[n],
                pool=pool_id(n, strategies[n]),
                hoisted_bytes=sum(s.bytes for s in steps if s.op == "provision" and s.phase == n),
                **_phase_plan_keys(r, n),
            )
            for n in r.sequence
        ],
        steps=steps,
        edges=ordered.graph.edges({sid: i for i, sid in enumerate(ordered.order)}),
        decisions=decisions,
        predicted=Prediction(
            source=r.workload.source,
            allocator=r.allocator,
            pool_bytes=pred.sim.pool_bytes,
            pools=pred.sim.pools,
            largest_graph_bytes=max(r.alone.values()),
            hoisted_bytes=pred.hoisted,
            baseline_bytes=pred.baseline_bytes,
            warmup_runs=sum(s.runs for s in steps),
            timeline=timeline,
            samples={
                n: TraceSamples(measured=list(m), derived=list(d)) for n, (m, d) in sorted(r.workload.samples.items())
            },
            device=device,
            kv=None if r.kv is None else _kv_cost(r.kv, device, [b.sequence.sizes[n] for n in r.sequence]),
            fidelity=fid,
            describes=describes,
            caveat=caveat,
            keys=key_predictions(b, steps, timeline, fid) if any(uses_keys(p) for p in spec.phases) else [],
            sizes=chosen.sizes if chosen is not None else [],
        ),
    )
    # the lowest revision the plan needs: plans without graph keys keep their bytes
    # every plan built now records its model and rules (revision 4), graph keys or not
    base = SIZES_REVISION if chosen is not None else INPUTS_REVISION
    return seal(msgspec.structs.replace(plan, revision=needed_revision(plan, base=base)))


def _kv_cost(pricer, device, lists):
    """The plan's graph memory, of its phases' capture ``lists``, in KV tokens, for a build
    that names an engine (schedule/kv.py)."""
    from .kv import kv_cost  # a build that names an engine only

    return kv_cost(pricer, device, pricer.sizes_of(lists))


def schedule(r: Resolved) -> dict[str, Strategy]:
    """Each phase's strategy as a plan of ``r`` would capture it (its key order set), in the
    plan's phase order: what a size choice prices other lists under (planner/sizes/)."""
    return _with_key_orders(r, _optimize(r).strategies)


def plan(r: Resolved, chosen: SizeRecord | None = None) -> Plan:
    """The plan of ``r`` (with the decisions and figures of the size choice that chose its
    sizes, when ``chosen``), in named steps: optimize the strategies -> order the steps ->
    predict memory -> the budget (a budget below the largest graph alone is refused here too,
    after the schedule is priced: the floor is no budget that fits, and the fix names one that
    does) -> assemble the sealed plan."""
    b = _build(r, _optimize(r))
    ordered = _order(b)
    predicted = _predict(b, ordered.steps)
    _check_budget(b, predicted)
    return _assemble(b, ordered, predicted, chosen)
