"""Two plans side by side: the figures, inputs and decisions a reviewer reads.

Used by ``planner diff OLD NEW`` (text or Markdown, a CI threshold) and by
``planner check``, which says per stale plan which recorded input changed and
how far the prediction moved; planner/report/compare_text.py writes them.

A figure is one row of :data:`FIGURES`, ``(label, getter, unit)``: the getter
takes a plan and returns a number, a ``{name: number}`` dict (one row per
name: per pool, per phase) or None where the plan has no such figure (an
older revision). Adding a figure is adding a row. Inputs are rows of
:data:`INPUTS` the same way (a getter returning text or None).

Byte figures are written so that a real change never reads "0.0 -> 0.0":
a pair of values both under 1 MiB, and any change under 1 MiB, in bytes
(``1,520.0 MiB -> 1,520.0 MiB (-8,200 B, -0.00051%)``, ``8,200 B -> 0 B``),
otherwise MiB with one decimal; a percentage under 0.1% keeps two
significant digits.

Every recorded input that changed is named with its old and new value: the
model's dimensions and where each came from (``inputs.model``, revision 4),
each phase's sizes and settings, backend, tp, allocator, and the digests of
the files (spec, model config, rules, trace). A plan of an older revision
records no dimensions: they read "not recorded" on its side, in one row.

A Markdown table folds the figures that read the same on both sides into one
row (with one pool, one phase and nothing hoisted the total, the pools' peak,
the pool and the phase's growth are one number: one change is one bold row),
and lists the figures unknown on both sides (device items never measured) in
one line.

What this does not do: re-read the spec or the model config (a change to a
field the plan does not record shows as the file's digest changing), or name
which built-in rule changed (the rules are recorded as one digest; the
decisions they made are compared).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from typing import Literal, cast

import msgspec

from capture_plan.schemas.plan import Decision, Plan

from ..inputs.dimensions import ELEMENT_SIZES, MOE, REQUIRED

#: the order a model's dimensions are listed in
DIMENSION_ORDER = REQUIRED + ELEMENT_SIZES + MOE

__all__ = [
    "FIGURES",
    "INPUTS",
    "Figure",
    "InputChange",
    "DecisionChange",
    "PlanDiff",
    "compare",
    "figures",
    "total",
    "input_changes",
]

#: "device-bytes": bytes where None means unknown (a device item never measured), not absent
Unit = Literal["bytes", "count", "device-bytes"]


def total(plan: Plan) -> int:
    """What the plan takes: every graph pool at its peak plus the hoisted workspaces."""
    return plan.predicted.pool_bytes + plan.predicted.hoisted_bytes


def _phase_growth(plan: Plan) -> dict[str, int]:
    """Per phase, how much the pools grew during its captures (the timeline is
    all pools together, so the phases' figures add up to the peak)."""
    grown: dict[str, int] = {ph.name: 0 for ph in plan.phases}
    before = 0
    reserved = {m.step: m.reserved for m in plan.predicted.timeline}
    for s in plan.steps:
        if s.op == "capture":
            grown[s.phase] = grown.get(s.phase, 0) + reserved[s.index] - before
            before = reserved[s.index]
    return grown


#: (label, getter, unit): every figure ``planner diff`` compares, in the order it prints them
FIGURES: list[tuple[str, Callable[[Plan], int | Mapping[str, int | None] | None], Unit]] = [
    ("total (pools + hoisted)", total, "bytes"),
    ("pools at peak", lambda p: p.predicted.pool_bytes, "bytes"),
    ("pool", lambda p: dict(p.predicted.pools), "bytes"),
    ("phase adds", _phase_growth, "bytes"),
    ("largest graph alone", lambda p: p.predicted.largest_graph_bytes, "bytes"),
    ("engines' loop baseline", lambda p: p.predicted.baseline_bytes, "bytes"),
    ("hoisted", lambda p: p.predicted.hoisted_bytes, "bytes"),
    ("captures", lambda p: sum(s.op == "capture" for s in p.steps), "count"),
    ("warm-up runs", lambda p: p.predicted.warmup_runs, "count"),
    # revision 2: what capture takes from free device memory (None while unknown: never read as 0)
    ("device: reserve (peak)", lambda p: p.predicted.device.peak_bytes if p.predicted.device else None, "device-bytes"),
    (
        "device: taken after capture",
        lambda p: p.predicted.device.total_bytes if p.predicted.device else None,
        "device-bytes",
    ),
    (
        "device item",
        lambda p: {i.name: i.bytes for i in p.predicted.device.items} if p.predicted.device else None,
        "device-bytes",
    ),
]


def _digest(d: str | msgspec.UnsetType | None) -> str:
    return d.split(":", 1)[-1][:12] if d else "-"


def _config(p: Plan) -> str | None:
    i = p.inputs
    if i.model_config is msgspec.UNSET:
        return None
    return f"{i.model_config} ({_digest(i.model_config_digest)})"


def _model(p: Plan) -> dict[str, str] | None:
    """Every model dimension as ``value (source)``, and each phase's own ones."""
    used = p.inputs.model
    if isinstance(used, msgspec.UnsetType):
        return None

    def src(f: str) -> str:
        s = used.sources.get(f, "spec")
        if s == "preset":
            return f"preset {used.preset}"
        if s == "config":
            key = used.config_keys.get(f)
            return f"config {p.inputs.model_config}" + (f": {key}" if key else "")
        return s

    out = {"name": used.name}
    out.update({f: f"{used.dimensions[f]} ({src(f)})" for f in DIMENSION_ORDER if f in used.dimensions})
    for phase, dims in used.phases.items():
        out.update({f"{phase}.{f}": f"{dims[f]} (the phase's)" for f in DIMENSION_ORDER if f in dims})
    return out


def _phase_settings(p: Plan) -> dict[str, str]:
    return {
        ph.name: f"{ph.kind}, {_n(ph.tokens_per_request, 'token')} per request, outputs read {ph.output_lifetime}"
        for ph in p.phases
    }


def _sizes(sizes: list[int]) -> str:
    s = sorted(sizes)
    return f"{len(s)} sizes {s[0]}..{s[-1]}" if s else "no sizes"


#: (label, getter): the recorded inputs ``planner diff`` and ``planner check`` compare
INPUTS: list[tuple[str, Callable[[Plan], str | dict[str, str] | None]]] = [
    # relative to the plan's folder; a plan's name is its -o (or the default one), so the command says both
    ("command", lambda p: " ".join(p.command)),
    ("spec", lambda p: f"{p.inputs.spec} ({_digest(p.inputs.spec_digest)})"),
    ("model config", _config),
    ("model", _model),
    ("backend", lambda p: p.inputs.backend),
    ("ci", lambda p: str(p.inputs.ci).lower()),
    ("speculative", lambda p: p.inputs.speculative or "none"),
    ("tp", lambda p: str(p.inputs.tp)),
    ("allocator", lambda p: p.predicted.allocator),
    ("prediction", lambda p: p.predicted.source),
    ("trace", lambda p: f"{p.inputs.trace} ({_digest(p.inputs.trace_digest)})" if p.inputs.trace else None),
    ("pins", lambda p: " ".join(f"-s {s}" for s in p.inputs.strategies) or "none"),
    ("rules", lambda p: _digest(p.inputs.rules_digest)),
    ("rule", lambda p: dict(p.inputs.rules) if isinstance(p.inputs.rules, dict) else None),
    ("sizes", lambda p: {ph.name: _sizes(ph.sizes) for ph in p.phases}),
    ("phase", _phase_settings),
    ("plan revision", lambda p: str(p.revision)),
    (
        "calibration",
        lambda p: (
            f"{p.inputs.calibration} ({_digest(p.inputs.calibration_digest)})"
            if isinstance(p.inputs.calibration, str)
            else None
        ),
    ),
    ("fidelity", lambda p: p.predicted.fidelity),
    (
        "traffic",
        lambda p: (
            f"{p.inputs.traffic} ({_digest(p.inputs.traffic_digest)})" if isinstance(p.inputs.traffic, str) else None
        ),
    ),
]


class Figure(msgspec.Struct, frozen=True):
    label: str
    old: int | None
    new: int | None
    unit: Unit


class InputChange(msgspec.Struct, frozen=True):
    label: str
    old: str | None
    new: str | None
    #: for "sizes": the sizes added and removed
    detail: str = ""


class DecisionChange(msgspec.Struct, frozen=True):
    phase: str
    old: str | None
    new: str | None
    old_why: str = ""
    new_why: str = ""


class PlanDiff(msgspec.Struct, frozen=True):
    old_name: str
    new_name: str
    #: every figure, changed or not (a table shows them all; text only the changed)
    figures: list[Figure]
    inputs: list[InputChange]
    decisions: list[DecisionChange]
    #: "steps: 73 -> 73 (...)" and which phases' capture order changed, when any
    steps: list[str]
    #: the unified diff of the step lists (``planner diff --steps``)
    step_lines: list[str]
    #: the plans differ only where no row looks (a decision's alternatives or reasons): not the same plan
    unlisted: bool = False

    @property
    def differs(self) -> bool:
        return bool(self.changed_figures or self.inputs or self.decisions or self.steps or self.unlisted)

    @property
    def changed_figures(self) -> list[Figure]:
        return [f for f in self.figures if f.old != f.new]


def _expand(plan: Plan, label: str, getter) -> dict[str, int | None]:
    value = getter(plan)
    if isinstance(value, dict):
        return {f"{label} {k}": v for k, v in value.items()}
    return {label: value}


def figures(a: Plan, b: Plan) -> list[Figure]:
    out = []
    for label, getter, unit in FIGURES:
        xa, xb = _expand(a, label, getter), _expand(b, label, getter)
        for key in list(xa) + [k for k in xb if k not in xa]:
            out.append(Figure(label=key, old=xa.get(key), new=xb.get(key), unit=unit))
    return out


def _size_detail(a: list[int], b: list[int]) -> str:
    added, removed = sorted(set(b) - set(a)), sorted(set(a) - set(b))
    parts = []
    for sign, got in (("+", added), ("-", removed)):
        if got:
            shown = ", ".join(map(str, got[:8])) + (f", ... ({len(got)} in all)" if len(got) > 8 else "")
            parts.append(f"{sign}[{shown}]")
    return " ".join(parts)


def input_changes(a: Plan, b: Plan) -> list[InputChange]:
    """The recorded inputs that differ between ``a`` and ``b``, in :data:`INPUTS` order."""
    out = []
    sizes_a = {ph.name: ph.sizes for ph in a.phases}
    sizes_b = {ph.name: ph.sizes for ph in b.phases}
    for label, getter in INPUTS:
        va, vb = getter(a), getter(b)
        if isinstance(va, dict) != isinstance(vb, dict) and label in _RECORDED_SINCE:
            # one side does not record it (an older revision): one row, not one per name
            row, sep = _RECORDED_SINCE[label]
            old, new = (
                "not recorded" if v is None else sep.join(f"{k} {x}" for k, x in cast(dict, v).items())
                for v in (va, vb)
            )
            out.append(InputChange(label=row, old=old, new=new))
        elif isinstance(va, dict) or isinstance(vb, dict):
            # a getter that returns a dict returns one (or None) for both plans
            va, vb = cast(dict, va or {}), cast(dict, vb or {})
            for name in list(va) + [n for n in vb if n not in va]:
                # two size lists can read the same ("36 sizes 1..256") and still differ
                same_sizes = label != "sizes" or sorted(sizes_a.get(name, [])) == sorted(sizes_b.get(name, []))
                if va.get(name) != vb.get(name) or not same_sizes:
                    detail = _size_detail(sizes_a.get(name, []), sizes_b.get(name, [])) if label == "sizes" else ""
                    out.append(InputChange(label=f"{label} {name}", old=va.get(name), new=vb.get(name), detail=detail))
        elif va != vb:
            out.append(InputChange(label=label, old=va, new=vb))
    return out


#: inputs a plan records since a revision: the label of their one row against an older plan,
#: and what separates the names in it (a rule's text holds commas and semicolons)
_RECORDED_SINCE = {"model": ("model dimensions", ", "), "rule": ("rules applied", " | ")}


def _decisions(a: Plan, b: Plan) -> list[DecisionChange]:
    """Per phase, the decisions whose choice changed, matched by the rule that made them."""

    def keyed(p: Plan) -> dict[tuple[str, str], Decision]:
        return {(d.phase, d.rule): d for d in p.decisions}

    da, db = keyed(a), keyed(b)
    out = []
    for key in list(db) + [k for k in da if k not in db]:
        o, n = da.get(key), db.get(key)
        if o is not None and n is not None and o.choice == n.choice:
            continue
        out.append(
            DecisionChange(
                phase=key[0],
                old=f"{o.rule}: {o.choice}" if o else None,
                new=f"{n.rule}: {n.choice}" if n else None,
                old_why=o.why if o else "",
                new_why=n.why if n else "",
            )
        )
    return out


def _steps(a: Plan, b: Plan, name_a: str, name_b: str) -> tuple[list[str], list[str]]:
    def key(s) -> str:
        return f"{s.op} {s.phase} {s.bs} {s.pool or '-'} {s.outputs or '-'}"

    ta, tb = [key(s) for s in a.steps], [key(s) for s in b.steps]
    lines = list(difflib.unified_diff(ta, tb, f"{name_a} steps", f"{name_b} steps", lineterm="", n=1))
    if not lines:
        return [], []

    def counts(p: Plan) -> str:
        ops = [s.op for s in p.steps]
        return (
            f"{len(ops)} ({_n(ops.count('capture'), 'capture')}, {_n(ops.count('warmup'), 'warm-up')}, "
            f"{_n(ops.count('provision'), 'provision')})"
        )

    summary = [
        f"steps: {counts(a)} -> {counts(b)}"
        if counts(a) != counts(b)
        else f"steps: {counts(b)} in both, not the same (--steps shows how)"
    ]

    def captured(p: Plan) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for s in p.steps:
            if s.op == "capture":
                out.setdefault(s.phase, []).append(s.bs)
        return out

    ca, cb = captured(a), captured(b)
    reordered = [n for n in cb if n in ca and sorted(ca[n]) == sorted(cb[n]) and ca[n] != cb[n]]
    if reordered:
        summary.append("capture order changed in " + ", ".join(reordered))
    seq_a = list(dict.fromkeys(s.phase for s in a.steps if s.op == "capture"))
    seq_b = list(dict.fromkeys(s.phase for s in b.steps if s.op == "capture"))
    if seq_a != seq_b:
        summary.append(f"phase order: {' -> '.join(seq_a)} => {' -> '.join(seq_b)}")
    return summary, lines


def _n(k: int, what: str) -> str:
    return f"{k} {what}" + ("" if k == 1 else "s")


def compare(a: Plan, b: Plan, name_a: str, name_b: str, *, where: str | None = None) -> PlanDiff:
    """Everything that differs from ``a`` (old) to ``b`` (new). Plans of
    different versions (incompatible layouts) are an InputError at ``where``."""
    if a.version != b.version:
        from capture_plan.schemas.errors import InputError

        raise InputError(
            f"plans of different versions ({name_a}: {a.version}, {name_b}: {b.version}) cannot be compared",
            where=where or name_b,
            fix="rebuild the older one with this capture-plan and diff again",
        )
    summary, lines = _steps(a, b, name_a, name_b)
    d = PlanDiff(
        old_name=name_a,
        new_name=name_b,
        figures=figures(a, b),
        inputs=input_changes(a, b),
        decisions=_decisions(a, b),
        steps=summary,
        step_lines=lines,
    )
    if not d.differs and msgspec.structs.replace(a, digest="") != msgspec.structs.replace(b, digest=""):
        return msgspec.structs.replace(d, unlisted=True)
    return d
