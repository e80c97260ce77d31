"""Plans with graph keys for the engine-faithful runners.

The planner expands a spec's variants itself once it does (issue 28's planner
side); until then :func:`keyed` makes the same plan shape from a built plan:
each capture step of a phase becomes one step per label combination (per size,
every combination: SGLang's size-major order), a warm-up before every capture
one before every key's, a once-per-phase warm-up the first key's labels, a
piecewise phase gets its piece count, a phase its stream and micro-batches,
warm-up steps their kept bytes. Step ids, indices, edges and the timeline are
renumbered so that ``validate_plan`` accepts the
result (checked here); the timeline repeats each original step's figure for
every key made from it (the predictions are the planner's to make per key).
"""

from __future__ import annotations

import msgspec

from capture_plan.schemas.keys import expand_labels, step_id
from capture_plan.schemas.plan import Plan, VariantAxis
from capture_plan.schemas.plan_check import validate_plan


def keyed(
    plan: Plan,
    phase: str,
    *,
    variants: dict[str, list[str]] | None = None,
    pieces: int | None = None,
    stream: str | None = None,
    micro_batches: int | None = None,
    keeps: dict[int, int] | None = None,
) -> Plan:
    """``plan`` with ``phase`` keyed as the arguments say: ``variants`` (axis ->
    labels), ``pieces`` per capture, the ``stream`` its steps record on,
    ``micro_batches``, and ``keeps`` (size -> bytes its warm-up keeps)."""
    axes = list((variants or {}).items())
    combos = expand_labels(axes)
    steps, ids, timeline = [], {}, []
    by_index = {m.step: m for m in plan.predicted.timeline}
    todo = list(plan.steps)
    for i, s in enumerate(todo):
        nxt = todo[i + 1] if i + 1 < len(todo) else None
        per_key = s.op == "warmup" and nxt is not None and (nxt.op, nxt.phase, nxt.bs) == ("capture", s.phase, s.bs)
        if s.phase != phase or s.op == "provision":
            out = [(s, ())]
        elif per_key:  # a warm-up before every capture: before every key's
            out = [(t, c) for c in combos for t in (s, nxt)]
        elif s.op == "warmup":  # once for the phase: with its first key's labels
            out = [(s, combos[0])]
        elif i and todo[i - 1].op == "warmup" and (todo[i - 1].phase, todo[i - 1].bs) == (s.phase, s.bs):
            continue  # emitted with its warm-up
        else:
            out = [(s, c) for c in combos]
        for orig, labels in out:
            fields = {}
            if orig.phase == phase and orig.op != "provision":
                if labels:
                    fields["labels"] = [label for _, label in labels]
                if stream is not None:
                    fields["stream"] = stream
                if orig.op == "capture" and pieces is not None:
                    fields["pieces"] = pieces
                if orig.op == "warmup" and keeps and orig.bs in keeps:
                    fields["keeps"] = keeps[orig.bs]
            index = len(steps)
            # another phase's step keeps its id (labels a call before gave it)
            sid = step_id(orig.op, orig.phase, orig.bs, labels) if orig.phase == phase else orig.id
            new = msgspec.structs.replace(orig, index=index, id=sid, **fields)
            ids.setdefault(orig.id, new.id)
            steps.append(new)
            timeline.append(msgspec.structs.replace(by_index[orig.index], step=index))
    phases = []
    for p in plan.phases:
        if p.name == phase:
            extra = {}
            if axes:
                extra["variants"] = [VariantAxis(name=a, labels=list(ls)) for a, ls in axes]
            if pieces is not None:
                extra["pieces"] = pieces
            if micro_batches is not None:
                extra["micro_batches"] = micro_batches
            if keeps:
                extra["warmup_keeps"] = "outputs"
            p = msgspec.structs.replace(p, **extra)
        phases.append(p)
    edges = [msgspec.structs.replace(e, src=ids.get(e.src, e.src), dst=ids.get(e.dst, e.dst)) for e in plan.edges]
    predicted = msgspec.structs.replace(plan.predicted, timeline=timeline, keys=[])
    out = msgspec.structs.replace(plan, phases=phases, steps=steps, edges=edges, predicted=predicted)
    validate_plan(out, "tests/engines/plans.keyed")
    return out


def build(tmp_path, spec: str, *strategies: str, backend: str = "fa3") -> Plan:
    """A plan built from ``spec`` (TOML text), outputs kept unless ``strategies`` say otherwise,
    for ``tmp_path/plan.json`` (where :func:`engines.plugged.plan_file` writes it): the plan
    records its spec relative to that folder, as ``planner build -o`` does, not to wherever
    pytest runs from (a fix command read from the record must work from any clone)."""
    from capture_plan.planner import BuildOptions, build_plan

    path = tmp_path / "spec.toml"
    path.write_text(spec)
    pinned = any(s.startswith("outputs=") for s in strategies)
    strategies = strategies if pinned else ("outputs=keep", *strategies)
    opts = BuildOptions(backend=backend, spec=path, strategies=tuple(strategies), output=tmp_path / "plan.json")
    return build_plan(opts)


def calibrated(plan, item_bytes: int = 10 * 2**20):
    """``plan`` with every device item it does not know set to ``item_bytes``, labelled
    ``estimated``: a figure the test sets, not one measured (a calibration from a capture
    report would give measured ones). Its whole-capture figure is then complete, so vLLM's
    estimate can be answered and the capture checked against it."""
    import msgspec

    from capture_plan.schemas.codec import seal

    items = [
        i if i.bytes is not None else msgspec.structs.replace(i, bytes=item_bytes, provenance="estimated")
        for i in plan.predicted.device.items
    ]
    device = msgspec.structs.replace(plan.predicted.device, items=items, total_bytes=sum(i.bytes for i in items))
    return seal(msgspec.structs.replace(plan, predicted=msgspec.structs.replace(plan.predicted, device=device)))
