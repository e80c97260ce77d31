"""The build pipeline: spec + rules + options -> a canonical, sealed plan.

What a build was asked is planner/build_options.py's; choosing sizes for a traffic
before the pipeline runs is planner/build.py's (planner/sizes.py prices lists with
this pipeline); writing and checking plan files is planner/plan_files.py's.

Pipeline: load the spec (embedded default or file) -> match rules per phase ->
memory workload (analytic or trace) -> check forced orders for conflicts ->
choose strategies (optimize.py) -> step graph and its order (graph.py) ->
simulate the ordered steps for the timeline -> Plan with decisions and digest.

Everything recorded in the plan is relative and sorted: the same inputs give
the same bytes on any machine (tests/test_determinism.py). In named steps
(:func:`build_plan`): resolve the inputs -> optimize the strategies -> order the
steps -> predict memory -> assemble the sealed plan.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING, cast

import msgspec

from capture_plan.schemas.codec import canonical_bytes, decode_trace, seal, sha256
from capture_plan.schemas.errors import ConstraintError, InputError
from capture_plan.schemas.files import read_input
from capture_plan.schemas.keys import needed_revision, parse_step_id
from capture_plan.schemas.limits import MODEL_MAX
from capture_plan.schemas.plan import (
    INPUTS_REVISION,
    SIZES_REVISION,
    Decision,
    DimensionSource,
    Inputs,
    ListCost,
    ModelUsed,
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
)
from capture_plan.schemas.spec import Phase, Spec, phase_model
from capture_plan.schemas.strategy import AXES, AllocatorMode, allocator_modes
from capture_plan.schemas.units import MiB, mib

from . import resources
from .build_options import (
    BuildOptions,
    build_record,
    check_paths_encode,
    command_for_cwd,
    normalized_command,
    output_path,
    relative,
)
from .device import Calibration, device_prediction, pools_after
from .dimensions import MOE, model_used, preset_sources
from .fidelity import fidelity
from .graph import StepGraph, build_steps, capture_order, check_acyclic, fixed_by_spec, phase_sequence
from .keys import capture_key, key_predictions, key_sequence, keyed_steps, piece_count, resolve_keys, uses_keys
from .optimize import MEMORY_AXES, SCREEN_SIZES, Problem, optimize, parse_pins
from .rules import Context, check_spec_rules, phase_rules, rule_text, satisfies
from .simulate import SimResult, pool_id, simulate
from .specs import default_spec, model_presets, read_spec_file
from .validate import decode_spec_sources
from .workload import Workload, workspace_bytes

if TYPE_CHECKING:
    from .sizes import SizesResult

__all__ = [
    "BuildOptions",
    "build_spec",
    "build_plan",
    "check_tp",
    "with_chosen",
]


def _spec(
    opts: BuildOptions,
) -> tuple[Spec, str, bytes, tuple[str, str, str | None] | None, dict[str, DimensionSource], dict[str, str]]:
    """(spec, its name, its bytes, (model config path, digest, model_type) or None, the source
    of every model dimension, the config key each dimension from a config was read from)."""
    if opts.spec is not None:
        # --speculative, --preset and --max-bs choose the embedded spec's phases and sizes; a spec
        # file lists its own, and merging the two would leave no one place that says what is
        # captured (--tp and --allocator do apply: they override the file's tp and allocator)
        pairs = [
            (flag, str(v))
            for flag, v in (("--speculative", opts.speculative), ("--preset", opts.preset), ("--max-bs", opts.max_bs))
            if v is not None
        ]
        if pairs:
            given = " and ".join(f"{flag} {v}" for flag, v in pairs)
            show = shlex.join(["planner", "spec", "show", *(a for pair in pairs for a in pair)])
            raise InputError(
                f"{given} choose the embedded spec's phases and sizes, and {opts.spec} lists its own",
                where=f"--spec {opts.spec}",
                fix=f"start a spec from `{show} > my.toml` and build with --spec my.toml, "
                "or write the phases and sizes into your spec",
            )
        from .hf_config import read_model_config  # only specs from files name a model config

        raw = read_spec_file(opts.spec)
        spec, sources = decode_spec_sources(
            raw,
            str(opts.spec),
            phase_kinds=resources.phase_kind_settings(),
            phase_axes=resources.phase_kind_axes(),
            presets=model_presets(),
        )
        base = output_path(opts).parent
        model, config, config_raw, config_keys = read_model_config(spec.model, opts.spec, str(opts.spec))
        used = None
        if config is not None:
            used = (relative(Path(config), base), sha256(config_raw), _model_type(config_raw))
        sources.update({f: "config" for f in MOE if f in config_keys})  # the MoE fields a config gives are its
        spec = msgspec.structs.replace(spec, model=model)
        return spec, relative(opts.spec, base), raw, used, sources, config_keys
    spec = default_spec(opts.speculative, opts.max_bs, opts.preset)
    return spec, "embedded:" + spec.name, canonical_bytes(spec), None, preset_sources(spec.model), {}


def build_spec(opts: BuildOptions, chosen: SizesResult | None = None) -> Spec:
    """The spec a build of ``opts`` plans (its phases and sizes), read without planning;
    with ``chosen``, the sizes chosen for a traffic in place of the spec's."""
    spec = _spec(opts)[0]
    return spec if chosen is None else with_chosen(spec, chosen)


def with_chosen(spec: Spec, chosen: SizesResult) -> Spec:
    """``spec`` capturing the sizes chosen for its traffic phases (the others keep theirs)."""
    lists = {c.phase: sorted(c.chosen.sizes) for c in chosen.phases}
    return msgspec.structs.replace(
        spec, phases=[msgspec.structs.replace(p, sizes=lists.get(p.name, p.sizes)) for p in spec.phases]
    )


def _model_type(config_raw: bytes) -> str | None:
    """The ``model_type`` of a config.json the reader already accepted."""
    mt = msgspec.json.decode(config_raw).get("model_type")
    return mt if isinstance(mt, str) else None


def _trace_path(opts: BuildOptions, spec: Spec) -> Path | None:
    if opts.trace is not None:
        return opts.trace
    if spec.trace is not None and opts.spec is not None:
        return opts.spec.parent / spec.trace
    return None


def _order_rule(rules, st: Strategy, pins: dict) -> str:
    forcing = [r.id for r in rules if r.require and all(c.order == st.order for c in r.require)]
    if forcing:
        return forcing[0]
    if "order" in pins:
        return f"--strategy order={st.order}"
    preferring = [r.id for r in rules if r.prefer is not None and r.prefer.order == st.order]
    meeting = [r.id for r in rules if r.require and any(c.order == st.order and satisfies(st, c) for c in r.require)]
    return (meeting or preferring or ["optimizer"])[0]


def check_tp(spec: Spec, tp: int, where: str = "--tp") -> None:
    """``tp`` (from ``where``: --tp, or the spec's ``tp``) divides the model's heads
    and MLP, and those of every phase with its own model (a draft is split across
    the same ranks)."""
    if tp < 1 or tp > MODEL_MAX["heads"]:
        raise InputError(
            f"must be 1..{MODEL_MAX['heads']}, got {tp}",
            where=where,
            fix="give the tensor-parallel size (GPUs per model replica)",
        )
    models = [(spec.model, where)] + [
        (phase_model(spec.model, p), f"{where} (phase {p.name!r}, its own model: $.phases[{i}].model)")
        for i, p in enumerate(spec.phases)
        if p.model is not msgspec.UNSET
    ]
    for m, at in models:
        bad = [f"{name}={v}" for name, v in (("heads", m.heads), ("intermediate", m.intermediate)) if v % tp]
        if m.kv_heads % tp and tp % m.kv_heads:  # KV heads may be replicated when tp > kv_heads
            bad.append(f"kv_heads={m.kv_heads}")
        if bad:
            raise InputError(
                f"tp={tp} does not divide {', '.join(bad)}",
                where=at,
                fix="use a tensor-parallel size that divides the model's heads and MLP",
            )


def _workload(
    opts: BuildOptions, spec: Spec, backend: resources.Backend, tp: int
) -> tuple[Workload, Path | None, str | None, str]:
    """The analytic model, or the recorded trace when one is given: JSON from
    capture_plan.executor.profile, or a pickle from torch.cuda.memory._dump_snapshot."""
    path = _trace_path(opts, spec)
    if path is None:
        return Workload.analytic(spec.model, spec.phases, backend, tp), None, None, ""
    raw = read_input(
        path,
        "trace",
        fix="record one on a GPU with `capture_plan.executor.profile` "
        "(docs/design.md: Few-size traces), or build without --trace for the analytic model",
    )
    from capture_plan.planner.snapshot import is_pickle, trace_from_snapshot  # only with a trace

    if is_pickle(raw):
        trace = trace_from_snapshot(raw, spec.phases, str(path))
    else:
        trace = decode_trace(raw, str(path))
    if trace.backend and trace.backend != opts.backend:
        raise InputError(
            f"trace was recorded with backend {trace.backend!r}, this build is for {opts.backend!r}",
            where=f"{path}: $.backend",
            fix=f"record a trace with {opts.backend}, or build for --backend {trace.backend}",
        )
    return Workload.from_trace(trace, spec.phases, str(path), spec.model), path, sha256(raw), trace.device


def _forced_orders(spec: Spec, rules: dict, pins: dict) -> dict[str, list[tuple[str, str]]]:
    """Orders demanded outright: by a rule whose every alternative names the same
    order, or by a pin. They become edges before anything is chosen, so two
    that disagree make a cycle, reported as the rules in conflict."""
    forced: dict[str, list[tuple[str, str]]] = {}
    for p in spec.phases:
        for r in rules[p.name]:
            orders = {c.order for c in r.require}
            if r.require and len(orders) == 1 and None not in orders:
                forced.setdefault(p.name, []).append((orders.pop(), r.id))
        pin = {**pins.get(None, {}), **pins.get(p.name, {})}.get("order")
        if pin:
            forced.setdefault(p.name, []).append((pin, f"--strategy order={pin}"))
    pre = StepGraph.empty()
    sizes = {p.name: p.sizes for p in spec.phases}
    for name, pairs in forced.items():
        for order, rule in pairs:
            pre.chain(name, [(bs, ()) for bs in capture_order(sizes[name], order)], rule)
    check_acyclic(pre.g)
    return forced


def _steps(
    sg: StepGraph, order: list[str], strategies: dict[str, Strategy], phases: dict, backend: resources.Backend
) -> list[Step]:
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


def _check_budget(r: _Resolved, opts: BuildOptions, sol, pred: _Predicted) -> None:
    """Refuse a plan over the spec's ``budget_mib``, naming the cheapest schedule
    the rules allow, per phase, at its real total. With ``--strategy`` pins that
    is the build without them (the alternatives a pinned build records are
    each priced with the other phases still pinned: their minimum named a
    schedule no build would make); without pins it is this plan."""
    spec = r.spec
    total = pred.sim.pool_bytes + pred.hoisted
    if spec.budget_mib is None or total <= spec.budget_mib * MiB:
        return
    where = f"{r.spec_source}: $.budget_mib"
    budget = spec.budget_mib * MiB
    floor = max(r.alone.values())
    if r.pins:
        free = msgspec.structs.replace(r, pins={}, forced=_forced_orders(spec, r.rules, {}))
        free_sol = _optimize(free, opts)
        free_pred = _predict(free, free_sol, _order(free, free_sol.strategies).steps)
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


def _reused_bytes(sims: dict, strategies: dict[str, Strategy], captures: list[tuple[str, int]]) -> int | None:
    """Pool bytes of ``captures`` under ``strategies`` if the optimizer already
    simulated exactly that (same captures in the same order, same memory axes;
    warm-ups and hazard tracking do not change the bytes); else None."""
    key = tuple(captures)
    for members, (seq, sim) in sims.items():
        if seq == key and all(_memory(st) == _memory(strategies[n]) for n, st in members):
            return sim.pool_bytes
    return None


def _memory(st: Strategy) -> tuple[str, ...]:
    return tuple(getattr(st, ax) for ax in MEMORY_AXES)


class _Resolved(msgspec.Struct, frozen=True):
    """Step 1 of a build: every input read, checked and matched to rules."""

    backend: resources.Backend
    spec: Spec
    #: the spec as the plan records it: relative to the plan's folder
    spec_name: str
    #: the spec as the user named it (relative to the cwd): where errors point
    spec_source: str
    spec_raw: bytes
    #: (path relative to the plan, digest, model_type)
    model_config: tuple[str, str, str | None] | None
    #: where each model dimension came from (capture_plan.planner.dimensions)
    model_sources: dict[str, DimensionSource]
    #: the config.json key each dimension from a config was read from
    model_config_keys: dict[str, str]
    tp: int
    allocator: AllocatorMode
    rules: dict[str, list]
    by_name: dict[str, Phase]
    pins: dict[str | None, dict[str, str]]
    workload: Workload
    trace_path: Path | None
    trace_digest: str | None
    #: the device the trace was recorded on ("" for the analytic model)
    traced_on: str
    library: int
    #: pool bytes of each phase's largest graph alone
    alone: dict[str, int]
    calibration: Calibration | None
    #: (path relative to the plan, digest) of the calibration report
    calibration_record: tuple[str, str] | None
    sequence: list[str]
    forced: dict[str, list[tuple[str, str]]]
    #: per phase with variant axes: (label combinations, key order, its rule) (planner/keys.py)
    keys: dict[str, tuple] = {}
    #: the sizes chosen for a traffic (``--sizes auto``; planner/sizes.py)
    chosen: SizesResult | None = None

    @property
    def expandable(self) -> bool:
        return self.allocator == "expandable"

    @property
    def protect(self) -> frozenset[str]:
        return frozenset(p.name for p in self.spec.phases if p.output_lifetime == "across-phases")


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


def _resolve(opts: BuildOptions, chosen: SizesResult | None) -> _Resolved:
    """Read spec, trace and data; check tp, allocator and budget floor; order the phases."""
    check_paths_encode(opts)
    backend = resources.backend(opts.backend)
    spec, spec_name, spec_raw, model_config, sources, config_keys = _spec(opts)
    if chosen is not None:
        spec = with_chosen(spec, chosen)
    spec_source = str(opts.spec) if opts.spec is not None else spec_name
    tp = opts.tp if opts.tp is not None else spec.tp
    check_tp(spec, tp, "--tp" if opts.tp is not None else f"{spec_source}: $.tp")
    if not output_path(opts).name:
        raise InputError(f"{str(output_path(opts))!r} names no file", where="-o", fix="give a plan file name")
    allocator = spec.allocator if opts.allocator is None else opts.allocator
    if allocator not in allocator_modes():
        raise InputError(
            f"unknown allocator mode {allocator!r}", where="--allocator", fix=f"use {' or '.join(allocator_modes())}"
        )
    allocator = cast(AllocatorMode, allocator)  # one of allocator_modes(), checked above
    ctx = Context(backend=opts.backend, ci=opts.ci)
    check_spec_rules(spec.rules, list(resources.builtin_rules()), resources.backend_names(), spec_source)
    all_rules = list(resources.builtin_rules()) + list(spec.rules)
    rules = {p.name: phase_rules(all_rules, p, ctx) for p in spec.phases}
    # in the order the plan records them (sorted): the optimizer lists broken pins in
    # pin order, so the order typed would change the bytes and `planner check` would call them stale
    pins = parse_pins(sorted(set(opts.strategies)), [p.name for p in spec.phases])
    workload, trace_path, trace_digest, traced_on = _workload(opts, spec, backend, tp)
    calibration, calibration_record = _calibration(opts, spec, traced_on, model_used(spec, sources, config_keys))

    library = int(spec.library_mib * MiB)
    alone = {
        p.name: simulate(
            [(p.name, max(p.sizes))], {p.name: Strategy()}, workload, allocator == "expandable", library_bytes=library
        ).pool_bytes
        for p in spec.phases
    }
    # a budget below the largest graph alone is refused after the schedule is priced
    # (_check_budget): the floor is no budget that fits, and the fix names one that does
    return _Resolved(
        backend=backend,
        spec=spec,
        spec_name=spec_name,
        spec_source=spec_source,
        spec_raw=spec_raw,
        model_config=model_config,
        model_sources=sources,
        model_config_keys=config_keys,
        tp=tp,
        allocator=allocator,
        rules=rules,
        by_name={p.name: p for p in spec.phases},
        pins=pins,
        workload=workload,
        trace_path=trace_path,
        trace_digest=trace_digest,
        traced_on=traced_on,
        library=library,
        alone=alone,
        calibration=calibration,
        calibration_record=calibration_record,
        sequence=phase_sequence(spec.phases, alone, spec_source),
        forced=_forced_orders(spec, rules, pins),
        keys=resolve_keys(spec.phases, rules),
        chosen=chosen,
    )


def _calibration(opts: BuildOptions, spec: Spec, traced_on: str, model: ModelUsed):
    """The calibration report's measured device items, and how the plan records it.

    Refused when the trace the prediction comes from was recorded on another
    device: the items would describe another machine than the pool; and when the
    report measured another backend or model than ``model`` (device.check_applies)."""
    if opts.calibration is None:
        return None, None
    from .device import read_calibration

    shown, recorded = str(opts.calibration), relative(opts.calibration, output_path(opts).parent)
    without = command_for_cwd(msgspec.structs.replace(opts, calibration=None))
    cal, raw = read_calibration(
        opts.calibration, shown, {p.name: p.kind for p in spec.phases}, recorded, applies=(opts.backend, model, without)
    )
    if traced_on and cal.device.split(" sm")[0] not in traced_on:
        raise InputError(
            f"calibration was measured on {cal.device!r}, the trace recorded on {traced_on!r}",
            where=f"--calibration {shown}",
            fix="calibrate with a report from the device the trace was recorded on",
        )
    return cal, (recorded, sha256(raw))


def _optimize(r: _Resolved, opts: BuildOptions):
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
            screen=None if opts.exact else SCREEN_SIZES,
            keys=r.keys,
        )
    )


def _order(r: _Resolved, strategies: dict[str, Strategy]) -> _Ordered:
    names = [p.name for p in r.spec.phases]
    pins = r.pins
    order_rule = {n: _order_rule(r.rules[n], strategies[n], {**pins.get(None, {}), **pins.get(n, {})}) for n in names}
    warm_rule = {n: next((x.id for x in r.rules[n] if any(c.warmup for c in x.require)), "warmup") for n in names}
    hoist_rule = {
        n: next((x.id for x in r.rules[n] if any(c.workspace == "hoisted" for c in x.require)), "optimizer")
        for n in names
    }
    sg = build_steps(r.by_name, r.sequence, strategies, order_rule, warm_rule, hoist_rule, r.forced, r.keys)
    order = sg.order()
    steps = _steps(sg, order, strategies, r.by_name, r.backend)
    if any(uses_keys(p) for p in r.spec.phases):
        labels = {sid: sg.g.nodes[sid]["labels"] for sid in order}
        steps = keyed_steps(steps, labels, r.by_name, r.spec.model, r.workload)
    return _Ordered(graph=sg, order=order, steps=steps)


def _predict(r: _Resolved, sol, steps: list[Step]) -> _Predicted:
    """The steps simulated exactly as ordered, at every size (the optimizer's
    simulation when it ran the same captures), and the engines' loop."""
    strategies = sol.strategies
    captures = tuple(capture_key(s.phase, s.bs, parse_step_id(s.id)[3]) for s in steps if s.op == "capture")
    seen = sol.sims.get(tuple((n, strategies[n]) for n in r.sequence))
    sim = (
        seen[1]
        if seen is not None and seen[0] == captures
        else simulate(captures, strategies, r.workload, r.expandable, r.protect, r.library)
    )
    if sim.hazards:  # the optimizer never picks such a schedule; this guards the step order
        raise ConstraintError(
            sim.hazards[0],
            where="planned step order",
            fix="report this as a bug (`planner --debug` shows where); pin another order with -s meanwhile",
        )
    baseline = resources.baseline()
    base_st = {n: Strategy(**{ax: getattr(baseline, ax) for ax in AXES}) for n in r.sequence}
    order = baseline.order
    assert order is not None  # rules.toml's baseline sets every axis
    # the engines' loop captures every graph key too: per size, every variant
    base_seq = [
        capture_key(n, bs, labels)
        for n in r.sequence
        for bs, labels in key_sequence(
            capture_order(r.by_name[n].sizes, order), r.keys.get(n, ([()],))[0], "size-major"
        )
    ]
    baseline_bytes = _reused_bytes(sol.sims, base_st, base_seq)
    if baseline_bytes is None:
        baseline_bytes = simulate(base_seq, base_st, r.workload, r.expandable, library_bytes=r.library).pool_bytes
    hoisted = sum(s.bytes for s in steps if s.op == "provision")
    return _Predicted(sim=sim, baseline_bytes=baseline_bytes, hoisted=hoisted)


def _phase_plan_keys(r: _Resolved, name: str) -> dict:
    """The graph-key fields of one phase's PhasePlan (none for a phase without them), and
    the properties of its kind that the plan records for its consumer."""
    p, out = r.by_name[name], {}
    if p.variants is not msgspec.UNSET:
        out["variants"] = [VariantAxis(name=a, labels=list(v)) for a, v in p.variants.items()]
    n = piece_count(p, r.spec.model)
    if n is not None:
        out["pieces"] = n
    if p.micro_batches is not msgspec.UNSET:
        out["micro_batches"] = p.micro_batches
    if p.warmup_keeps is not msgspec.UNSET:
        out["warmup_keeps"] = p.warmup_keeps
    if resources.phase_kinds()[p.kind].piecewise:  # the kind's property its consumer reads (revision 6)
        out["piecewise"] = True
    if p.reuse is not msgspec.UNSET:  # executable reuse (revision 7); its module loads only then
        from .exec_reuse import reuse_fields

        out |= reuse_fields(p)
    return out


def _with_key_order(st: Strategy, keys: tuple | None) -> Strategy:
    return st if keys is None else msgspec.structs.replace(st, key_order=keys[1])


def _key_order_decisions(r: _Resolved) -> list[Decision]:
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


def _step_time_source(opts: BuildOptions, text: str, plan_folder: Path) -> str:
    """Where step times came from, as a plan records it: a timing report by its path relative
    to the plan (the report names it as the user gave it, relative to the cwd)."""
    return f"measured replay times in {relative(opts.timing, plan_folder)}" if opts.timing is not None else text


def _size_choices(opts: BuildOptions, chosen: SizesResult) -> list[SizeChoice]:
    """The sizes chosen per phase and their figures, as the plan records them (``predicted.sizes``)."""
    folder = output_path(opts).parent
    return [
        SizeChoice(
            phase=c.phase,
            steps=round(c.steps, 6),
            padding=round(c.chosen.padding, 6),
            approximate=c.chosen.approximate,
            step_time=_step_time_source(opts, c.time_source, folder),
            why=c.why,
            pool_bytes=c.worth_pool_bytes,
            device_bytes=c.worth_device_bytes,
            sizes=c.worth,
            against=[
                ListCost(
                    label=row.label,
                    sizes=list(row.sizes),
                    padding=round(row.padding, 6),
                    pool_bytes=row.pool_bytes,
                    device_bytes=row.device_bytes,
                )
                for row in [c.current, *c.defaults]
            ],
            notes=list(chosen.traffic.notes),
        )
        for c in chosen.phases
    ]


def _added(n: int) -> str:
    """Bytes a size adds to the list's graph memory, in words (the allocator's reuse can make it
    nothing, or less than nothing)."""
    return f"it adds {mib(n)}" if n >= 0 else f"it saves {mib(-n)} (the allocator reuses its blocks)"


def _graph_memory(pool: int, device: int | None) -> str:
    return f"graph memory {mib(pool)}" + (f", device total {mib(device)}" if device is not None else "")


def _size_decisions(opts: BuildOptions, chosen: SizesResult) -> list[Decision]:
    """Per phase whose sizes were chosen: the choice against the spec's list and the engines'
    defaults, then one decision per size saying why it is in (``planner explain``; ``planner diff``
    shows the sizes that came and went, each with its why)."""
    from .size_front import size_runs  # only `--sizes auto` (a build of fixed sizes never loads it)

    out = []
    folder = output_path(opts).parent
    traffic = relative(opts.traffic, folder) if opts.traffic is not None else ""
    for c in chosen.phases:
        row = c.chosen
        mark = "~" if row.approximate else ""
        against = "; ".join(
            f"{d.label} ({len(d.sizes)} sizes): padding {mark}{d.padding:.2f}%, "
            + _graph_memory(d.pool_bytes, d.device_bytes)
            for d in [c.current, *c.defaults]
        )
        notes = "".join(f"; {n}" for n in chosen.traffic.notes)
        out.append(
            Decision(
                phase=c.phase,
                rule="sizes-auto",
                constraint=f"traffic {traffic} ({chosen.traffic.digest[:19]}): {c.steps:,.0f} steps; "
                f"largest size {c.top} always captured; budget {chosen.budget}{notes}",
                choice=f"{len(row.sizes)} sizes: {size_runs(row.sizes)}",
                why=f"{c.why}: padding {mark}{row.padding:.2f}% of step time "
                f"({_step_time_source(opts, c.time_source, folder)}), "
                f"{_graph_memory(c.worth_pool_bytes, c.worth_device_bytes)}; "
                f"against {against}",
            )
        )
        sizes = sorted(row.sizes)
        for i, w in enumerate(c.worth):
            low = sizes[i - 1] + 1 if i else 1
            runs = f"{w.steps:,.6g} steps of sizes {low}..{w.size}" if low < w.size else f"{w.steps:,.6g} steps"
            if w.padding_saved is None:
                why = "the largest size the engine schedules: always captured, so no step runs eagerly"
            else:
                why = (
                    f"without it they run the graph of {sizes[i + 1]}: padding {mark}+{w.padding_saved:.3f}% "
                    "of step time"
                )
            out.append(
                Decision(
                    phase=c.phase,
                    rule=f"sizes-auto {w.size}",
                    constraint=f"{runs} run its graph",
                    choice=f"capture {w.size}",
                    why=f"{why}; {_added(c.worth_pool_bytes - w.pool_bytes_without)} of graph memory",
                )
            )
    return out


def _assemble(opts: BuildOptions, r: _Resolved, sol, ordered: _Ordered, pred: _Predicted) -> Plan:
    """Step 5: the Plan, sealed with its digest."""
    strategies, steps, spec, by_name = sol.strategies, ordered.steps, r.spec, r.by_name
    decisions = ([_phase_order_decision(spec, r.sequence, r.alone)] if len(r.sequence) > 1 else []) + sol.decisions
    if r.chosen is not None:
        decisions += _size_decisions(opts, r.chosen)
    if r.keys:
        decisions += _key_order_decisions(r)
        strategies = {
            n: msgspec.structs.replace(st, key_order=r.keys[n][1]) if n in r.keys else st
            for n, st in strategies.items()
        }
    output = output_path(opts)
    timeline = _timeline(steps, pred.sim.after_capture)
    fid, describes, caveat = fidelity(
        r.workload.source,
        spec.model,
        r.model_config is not None,
        r.model_config[2] if r.model_config else None,
        f"{relative(r.trace_path, output.parent)} ({r.traced_on})" if r.trace_path else "",
    )
    plan = Plan(
        name=output.stem,
        command=normalized_command(opts),
        inputs=Inputs(
            spec=r.spec_name,
            spec_digest=sha256(r.spec_raw),
            rules_digest=resources.rules_digest(),
            backend=opts.backend,
            ci=opts.ci,
            speculative=opts.speculative,
            max_bs=max(max(p.sizes) for p in spec.phases),
            tp=r.tp,
            strategies=sorted(set(opts.strategies)),
            trace=relative(r.trace_path, output.parent) if r.trace_path is not None else None,
            trace_digest=r.trace_digest,
            **({"model_config": r.model_config[0], "model_config_digest": r.model_config[1]} if r.model_config else {}),
            **(
                {"calibration": r.calibration_record[0], "calibration_digest": r.calibration_record[1]}
                if r.calibration_record
                else {}
            ),
            **(
                {"traffic": relative(opts.traffic, output.parent), "traffic_digest": r.chosen.traffic.digest}
                if r.chosen is not None and opts.traffic is not None
                else {}
            ),
            build=build_record(opts),
            model=model_used(spec, r.model_sources, r.model_config_keys),
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
                sizes=capture_order(by_name[n].sizes, strategies[n].order),
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
            device=device_prediction(
                pred.sim.pool_bytes,
                pred.hoisted,
                steps,
                {p.name: p.kind for p in spec.phases},
                r.calibration,
                pools_after(steps, timeline),
                kept=sum(s.keeps for s in steps if s.keeps is not msgspec.UNSET)  # pyright: ignore[reportArgumentType]
                if any(s.keeps is not msgspec.UNSET for s in steps)
                else None,
            ),
            fidelity=fid,
            describes=describes,
            caveat=caveat,
            keys=key_predictions(steps, timeline, by_name, strategies, spec.model, r.workload, r.expandable, fid)
            if any(uses_keys(p) for p in spec.phases)
            else [],
            sizes=_size_choices(opts, r.chosen) if r.chosen is not None else [],
        ),
    )
    # the lowest revision the plan needs: plans without graph keys keep their bytes
    # every plan built now records its model and rules (revision 4), graph keys or not
    base = SIZES_REVISION if r.chosen is not None else INPUTS_REVISION
    return seal(msgspec.structs.replace(plan, revision=needed_revision(plan, base=base)))


def build_plan(opts: BuildOptions, chosen: SizesResult | None = None) -> Plan:
    """The plan of ``opts`` (capturing the sizes ``chosen`` for a traffic, when given: see
    planner/build.py), in named steps: resolve the inputs -> optimize the strategies ->
    order the steps -> predict memory -> assemble the sealed plan."""
    resolved = _resolve(opts, chosen)
    sol = _optimize(resolved, opts)
    ordered = _order(resolved, sol.strategies)
    predicted = _predict(resolved, sol, ordered.steps)
    _check_budget(resolved, opts, sol, predicted)
    return _assemble(opts, resolved, sol, ordered, predicted)
