"""A decoded plan's parts checked against each other (:func:`validate_plan`): what a
digest cannot prove, since a sealed plan may come from a buggy or hostile writer."""

from __future__ import annotations

import msgspec

from .conversion import _FIX
from .errors import InputError
from .keys import expand_labels, step_id, step_labels
from .plan import PhasePlan, Plan, Step, record_command


def validate_plan(plan: Plan, source: str) -> Plan:
    """Consistency a digest cannot prove (a sealed plan may come from a buggy or
    hostile writer): unique phases and step ids, steps indexed in order, every
    step's phase known, sizes among its phase's (listed once each), each step's
    id ``<op>/<phase>/<bs>`` (with its labels, :func:`capture_plan.schemas.keys.step_id`),
    captures one-to-one with the phases' graph keys (no key captured twice, none left
    out), edges between known steps, one timeline entry per step, and a build record
    that says the build ``command``, ``inputs`` and ``requires`` say
    (:func:`_record_agrees`). Graph keys
    (revision 3): a phase's variant axes and each axis's labels unique; a capture or
    warm-up step of a phase with variants has one label per axis, each the axis's,
    and no other step has labels; a capture step's ``pieces`` is its phase's; only
    warm-up steps keep bytes; ``predicted.keys``, when present, one per capture step
    in step order; a device prediction has items, and its total is their sum where every one is
    known, else none. The bounds of single fields (sizes 1..``MAX_BS``, tp >= 1, counts
    >= 0) are the plan types' own, checked when the plan is converted."""

    def bad(what: str, path: str) -> InputError:
        return InputError(what, where=f"{source}: {path}", fix=_FIX["plan"])

    phases: dict[str, set[int]] = {}
    by_name = {}
    for i, ph in enumerate(plan.phases):
        if ph.name in phases:
            raise bad(f"duplicate phase {ph.name!r}", f"$.phases[{i}].name")
        first: dict[int, int] = {}
        for j, bs in enumerate(ph.sizes):
            if bs in first:
                raise bad(
                    f"size {bs} listed twice (also $.phases[{i}].sizes[{first[bs]}])", f"$.phases[{i}].sizes[{j}]"
                )
            first[bs] = j
        _check_variants(ph, f"$.phases[{i}]", bad)
        phases[ph.name] = set(ph.sizes)
        by_name[ph.name] = ph
    ids: dict[str, int] = {}
    captured: set[tuple[str, int, tuple]] = set()
    for i, st in enumerate(plan.steps):
        path = f"$.steps[{i}]"
        if st.index != i:
            raise bad(f"step index {st.index} at position {i}", f"{path}.index")
        if st.phase not in phases:
            raise bad(f"unknown phase {st.phase!r}; phases are {sorted(phases)}", f"{path}.phase")
        # warm-ups and provisions run at a capture size too (every size, or the phase's largest)
        if st.bs not in phases[st.phase]:
            raise bad(f"size {st.bs} is not a capture size of phase {st.phase!r}", f"{path}.bs")
        ph = by_name[st.phase]
        _check_step_keys(ph, st, path, bad)
        labels = step_labels(ph, st)
        # the id is what edges, reports and logs name, so it must say what the step does;
        # unique ids that do then make every (op, key) unique: no key captured twice
        expected = step_id(st.op, st.phase, st.bs, labels)
        if st.id != expected:
            raise bad(f"step id {st.id!r} does not match its op, phase, size and labels ({expected!r})", f"{path}.id")
        if st.id in ids:
            what = "a graph key captured twice" if st.op == "capture" else "a step listed twice"
            raise bad(f"duplicate step id {st.id!r} (also $.steps[{ids[st.id]}]): {what}", f"{path}.id")
        ids[st.id] = i
        if st.op == "capture":
            captured.add((st.phase, st.bs, labels))
    for i, ph in enumerate(plan.phases):
        # a key never captured is padded past at replay or refused (the largest): not what the plan says
        axes = [] if ph.variants is msgspec.UNSET else [(a.name, a.labels) for a in ph.variants]
        combos = expand_labels(axes)
        missing = [(bs, c) for bs in ph.sizes for c in combos if (ph.name, bs, c) not in captured]
        if missing:
            if axes:
                shown = [step_id("capture", ph.name, bs, c) for bs, c in missing[:8]]
                what = "graph key(s) "
            else:
                shown = [str(bs) for bs, _ in missing[:8]]
                what = "size(s) "
            what += ", ".join(shown) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise bad(f"phase {ph.name!r} lists {what} that no capture step captures", f"$.phases[{i}].sizes")
    for i, e in enumerate(plan.edges):
        for end in ("src", "dst"):
            if getattr(e, end) not in ids:
                raise bad(f"edge to unknown step {getattr(e, end)!r}", f"$.edges[{i}].{end}")
    _record_agrees(plan, bad)
    timeline = plan.predicted.timeline
    if len(timeline) != len(plan.steps):
        raise bad(f"{len(timeline)} timeline entries for {len(plan.steps)} steps", "$.predicted.timeline")
    for i, m in enumerate(timeline):
        if m.step != i:
            raise bad(f"timeline entry for step {m.step} at position {i}", f"$.predicted.timeline[{i}].step")
    dev = plan.predicted.device
    if dev is not None:
        # render and the gates read the total as the items' sum, and an unknown total by the item
        # that is unknown: a sealed plan whose parts disagree crashed `planner show` (the fuzz)
        known = [c.bytes for c in dev.items if c.bytes is not None]
        if not dev.items:
            raise bad("a device prediction with no items", "$.predicted.device.items")
        if dev.total_bytes is None and len(known) == len(dev.items):
            raise bad("no device total although every item is known", "$.predicted.device.total_bytes")
        if dev.total_bytes is not None and (len(known) < len(dev.items) or dev.total_bytes != sum(known)):
            raise bad(
                f"device total {dev.total_bytes} is not the sum of its items, every one known",
                "$.predicted.device.total_bytes",
            )
    keys = plan.predicted.keys
    if keys:
        capture_ids = [s.id for s in plan.steps if s.op == "capture"]
        if len(keys) != len(capture_ids):
            raise bad(f"{len(keys)} key predictions for {len(capture_ids)} capture steps", "$.predicted.keys")
        for i, (k, sid) in enumerate(zip(keys, capture_ids)):
            if k.step != sid:
                raise bad(f"key prediction for {k.step!r} where {sid!r} is expected", f"$.predicted.keys[{i}].step")
    return plan


def _check_variants(ph: PhasePlan, path: str, bad) -> None:
    """A phase's variant axes: names unique, each axis's labels unique."""
    if ph.variants is msgspec.UNSET:
        return
    names: dict[str, int] = {}
    for a, axis in enumerate(ph.variants):
        if axis.name in names:
            raise bad(f"variant axis {axis.name!r} listed twice", f"{path}.variants[{a}].name")
        names[axis.name] = a
        seen: set[str] = set()
        for j, label in enumerate(axis.labels):
            if label in seen:
                raise bad(f"label {label!r} listed twice", f"{path}.variants[{a}].labels[{j}]")
            seen.add(label)


def _check_step_keys(ph: PhasePlan, st: Step, path: str, bad) -> None:
    """A step's graph-key fields against its phase (see :func:`validate_plan`)."""
    axes = [] if ph.variants is msgspec.UNSET else ph.variants
    keyed = st.op in ("capture", "warmup") and bool(axes)
    if st.labels is msgspec.UNSET:
        if keyed:
            raise bad(f"no labels for phase {ph.name!r}'s variant axes", f"{path}.labels")
    elif not keyed:
        why = f"phase {ph.name!r} has no variant axes" if not axes else f"a {st.op} step has no graph key"
        raise bad(f"labels on a step that takes none ({why})", f"{path}.labels")
    elif len(st.labels) != len(axes):
        raise bad(f"{len(st.labels)} labels for {len(axes)} variant axes", f"{path}.labels")
    else:
        for j, (label, axis) in enumerate(zip(st.labels, axes)):
            if label not in axis.labels:
                raise bad(f"{label!r} is not a label of axis {axis.name!r}", f"{path}.labels[{j}]")
    want_pieces = ph.pieces if st.op == "capture" else msgspec.UNSET
    if st.pieces != want_pieces:
        what = f"phase {ph.name!r} records {ph.pieces} pieces" if want_pieces is not msgspec.UNSET else "no pieces"
        raise bad(f"pieces = {st.pieces} where the plan says {what}", f"{path}.pieces")
    if st.keeps is not msgspec.UNSET and (st.op != "warmup" or ph.warmup_keeps is msgspec.UNSET):
        raise bad(f"a {st.op} step keeps bytes only a warm-up of a phase with warmup_keeps keeps", f"{path}.keeps")


def _record_agrees(plan: Plan, bad) -> None:
    """A plan that records its build (``inputs.build``, revision 2) says the same in
    the fields that repeat it: ``command`` is the record's text
    (:func:`capture_plan.schemas.plan.record_command`), and the backend, ``--ci``,
    ``--speculative``, pins, ``--tp`` and ``--calibration`` the record holds are the
    ones ``inputs`` and ``requires`` name. ``show`` and ``diff`` read those fields while
    ``planner check --fix`` rebuilds from the record: a plan whose two disagree (edited
    and sealed again) would be shown as one build and rebuilt as another."""
    rec = plan.inputs.build
    if isinstance(rec, msgspec.UnsetType):
        return
    recorded = " ".join(record_command(rec))
    if plan.command != record_command(rec):
        raise bad(
            f"`command` is `{' '.join(map(str, plan.command))}` but `inputs.build` records `{recorded}`",
            "$.command",
        )
    pairs: list[tuple[str, object, object]] = [
        ("$.inputs.backend", plan.inputs.backend, rec.backend),
        ("$.requires.backend", plan.requires.backend, rec.backend),
        ("$.inputs.ci", plan.inputs.ci, rec.ci),
        ("$.inputs.speculative", plan.inputs.speculative, rec.speculative),
        ("$.inputs.strategies", plan.inputs.strategies, rec.strategies),
        ("$.requires.tp", plan.requires.tp, plan.inputs.tp),
    ]
    if rec.tp is not None:
        pairs.append(("$.inputs.tp", plan.inputs.tp, rec.tp))
    calibration = None if isinstance(plan.inputs.calibration, msgspec.UnsetType) else plan.inputs.calibration
    pairs.append(("$.inputs.calibration", calibration, rec.calibration))
    for path, value, wanted in pairs:
        if value != wanted:
            raise bad(f"says {value!r} but the build it records (`{recorded}`) says {wanted!r}", path)
