"""Text renderings of plans and reports: tables, explanations, diffs, graphs.

Pure functions from schema objects to strings; the CLI prints them. Kept free
of networkx so ``planner show`` stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from capture_plan.schemas.key_fields import KEY_FIELDS, approximate_fields
from capture_plan.schemas.keys import PlanIndex, label_suffix
from capture_plan.schemas.plan import Plan, Step
from capture_plan.schemas.units import mib

from ..inputs.dimensions import dimensions_text

if TYPE_CHECKING:  # a report is shown by `planner report`, not by a build: its types load with it
    from capture_plan.schemas.report import CaptureReport

__all__ = [
    "summary",
    "model_lines",
    "steps_table",
    "explain",
    "diff",
    "graph",
    "graph_phases",
    "timeline",
    "report_table",
]


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]

    def fmt(r: list[str]) -> str:
        return "  ".join(
            str(x).rjust(w) if i and str(x)[:1].isdigit() else str(x).ljust(w)
            for i, (x, w) in enumerate(zip(r, widths))
        ).rstrip()

    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def summary(plan: Plan, path: str) -> str:
    p = plan.predicted
    caps = sum(s.op == "capture" for s in plan.steps)
    ratio = p.baseline_bytes / p.pool_bytes if p.pool_bytes else float("inf")
    lines = [
        f"{path}: {caps} captures in {len(plan.phases)} phase(s), {p.warmup_runs} warm-up run(s); "
        f"predicted pool {mib(p.pool_bytes, unit=False)} MiB ({p.source}, {p.allocator} allocator), "
        f"largest graph alone {mib(p.largest_graph_bytes, unit=False)} MiB, hoisted {p.hoisted_bytes} B; "
        f"baseline loop {mib(p.baseline_bytes, unit=False)} MiB ({ratio:.1f}x)"
    ]
    for ph in plan.phases:
        lines.append(f"  {ph.name}: {ph.strategy.label()} ({ph.pool} pool)")
    lines += [f"  {line}" for line in model_lines(plan)]
    lines += device_lines(plan)
    derived = {n: s for n, s in p.samples.items() if s.derived}
    if derived:
        lines.append(
            "  trace sizes: "
            + "; ".join(f"{n} measured {s.measured}, {len(s.derived)} derived" for n, s in sorted(derived.items()))
        )
    return "\n".join(lines)


def model_lines(plan: Plan) -> list[str]:
    """The model dimensions the prediction used and where each came from (revision 4;
    an older plan does not record them, and says so)."""
    used = plan.inputs.model
    if isinstance(used, msgspec.UnsetType):
        return [f"model: dimensions not recorded (plan revision {plan.revision}; rebuild it to record them)"]
    config = plan.inputs.model_config
    return dimensions_text(used, config if isinstance(config, str) else None)


def _item_mib(b: int | None) -> str:
    return "unknown" if b is None else mib(b, unit=False)


def device_lines(plan: Plan) -> list[str]:
    """What an engine must reserve for capture, item by item, and which model code the figures describe."""
    p = plan.predicted
    out = []
    dev = p.device
    if dev is not None:
        parts = ", ".join(f"{i.name} {_item_mib(i.bytes)}" for i in dev.items)
        if dev.total_bytes is not None and dev.peak_bytes is not None:
            out.append(
                f"  reserve for capture: {mib(dev.peak_bytes, unit=False)} MiB of free device memory (the "
                f"peak, a warm-up on top of the pools so far); {mib(dev.total_bytes, unit=False)} MiB stay "
                f"taken after capture on {dev.device} ({parts})"
            )
        elif dev.total_bytes is not None:
            out.append(
                f"  reserve for capture: {mib(dev.total_bytes, unit=False)} MiB of free device memory "
                f"on {dev.device} ({parts}); the warm-ups' peak is unknown (the calibration report "
                "measured no warm-up scratch)"
            )
        else:
            unknown = [i for i in dev.items if i.bytes is None]
            out.append(f"  reserve for capture: unknown ({parts} MiB); {unknown[0].name}: {unknown[0].source}")
    kv = p.kv
    if kv is not None:  # built with --engine: the graph memory in that release's KV tokens
        if kv.kv_tokens is None or kv.graph_bytes is None:
            out.append(f"  KV tokens under {kv.engine}: unknown ({kv.graph})")
        else:
            cost = kv.kv_tokens_without_graphs - kv.kv_tokens
            out.append(
                f"  KV tokens under {kv.engine}: {kv.kv_tokens:,} with these graphs ({mib(kv.graph_bytes)}, "
                f"{kv.graph}), {kv.kv_tokens_without_graphs:,} with none: the graphs cost {cost:,}"
                + (f"; the engine would not start: {kv.overflow}" if kv.overflow else "")
            )
    if p.fidelity == "approximate":
        out.append(f"  {p.caveat}")
    elif p.fidelity == "reference":
        out.append(f"  figures describe {p.describes}: exact for that code; for your engine's model, record a trace")
    elif p.fidelity == "recorded":
        out.append(f"  figures are exact for {p.describes}")
    if p.fidelity != "approximate":
        out += _approximate_keys(plan)
    return out


def _approximate_keys(plan: Plan) -> list[str]:
    """Why a plan's approximate graph keys are: a label the reference does not model
    (LoRA layers), or a key field the prediction does not model (schemas/key_fields.py's
    ``KEY_FIELDS``, their words): a micro-batched graph, such as vLLM's DBO twin of a FULL
    graph (``twin_of``: named from the plan's ``twin_of:<twin>`` edges), predicted as one batch."""
    keys, index = plan.predicted.keys, PlanIndex.of(plan)
    fields = {ph.name: [(KEY_FIELDS[n], v) for n, v in approximate_fields(ph).items()] for ph in plan.phases}
    fields = {name: facts for name, facts in fields.items() if facts}
    rough: dict[str, list[str]] = {}  # "" (labels) or a phase with such a key field -> its approximate keys
    for k in keys:
        if k.fidelity == "approximate":
            phase = index.steps[k.step].phase
            rough.setdefault(phase if phase in fields else "", []).append(k.step)
    twin_of: dict[str, str] = {}  # twin -> the phase whose graphs it is the twin of
    for e in plan.edges:
        twin = e.rule.removeprefix("twin_of:")
        if twin != e.rule:
            ends = {index.steps[e.src].phase, index.steps[e.dst].phase} - {twin}
            twin_of.update((twin, end) for end in ends)
    out = []
    for phase, steps in rough.items():
        head = f"  graph keys: {len(steps)} of {len(keys)} approximate (e.g. {steps[0]}): "
        if not phase:
            out.append(
                head + "a label the reference does not model, predicted with its size's program "
                "(planner/data/phase_kinds.toml [axes])"
            )
            continue
        facts, parent = fields[phase], twin_of.get(phase)
        runs = " and ".join(f.graphs.format(v) for f, v in facts)
        what = (
            f"{phase} holds the micro-batch twins of {parent}'s graphs (vLLM's DBO twin: its graphs {runs}, "
            f"captured right after {parent}'s graph of its size)"
            if parent
            else f"{phase}'s graphs {runs}"
        )
        if plan.predicted.source != "analytic":
            unmodelled = " and ".join(f.unmodelled for f, _ in facts)
            how = f"from the trace's {phase} captures, approximate: the planner does not model {unmodelled}"
        elif parent:
            how = f"as {parent}'s graph of that size: the reference runs the batch whole, not split"
        else:
            how = " and ".join(f.approximate for f, _ in facts)
        out.append(f"{head}{what}, each predicted {how}")
    return out


def _key(index: PlanIndex, s: Step) -> str:
    """A step's labels (as its id spells them) and pieces for a table ("" for a step without them);
    ``index``: its plan's."""
    labels = label_suffix(index.labels(s))
    parts = [labels] if labels else []
    parts += [] if s.pieces is msgspec.UNSET else [f"{s.pieces} pieces"]
    return " ".join(parts)


def _step_lines(plan: Plan) -> list[str]:
    """Each step of ``plan`` on one line, as a diff of two plans' steps compares them."""
    index = PlanIndex.of(plan)
    return [
        f"{s.op} {s.phase} {s.bs}{' ' + k if (k := _key(index, s)) else ''} {s.pool} {s.outputs or '-'}"
        for s in plan.steps
    ]


def steps_table(plan: Plan) -> str:
    tl = {m.step: m for m in plan.predicted.timeline}
    index = PlanIndex.of(plan)
    keyed = any(_key(index, s) for s in plan.steps)  # the key column only where a step has labels or pieces
    rows = [
        [
            str(s.index),
            s.op,
            s.phase,
            str(s.bs),
            *([_key(index, s) or "-"] if keyed else []),
            s.pool or "-",
            s.outputs or "-",
            mib(tl[s.index].reserved, unit=False),
            mib(tl[s.index].allocated, unit=False),
        ]
        for s in plan.steps
    ]
    head = ["#", "op", "phase", "bs", *(["key"] if keyed else []), "pool", "outputs", "reserved MiB", "allocated MiB"]
    return _table(head, rows)


def explain(plan: Plan, head: str | None = None) -> str:
    """Every decision with its alternatives, and every ordering edge. ``head`` is
    the first line (``planner explain`` gives the command runnable from the cwd);
    by default the name and the command as recorded (relative to the plan's folder)."""
    out = [head or f"plan {plan.name} ({' '.join(plan.command)})", "", "decisions:"]
    for d in plan.decisions:
        out.append(f"- [{d.phase}] {d.rule}: {d.choice}")
        out.append(f"    constraint: {d.constraint}")
        out.append(f"    why: {d.why}")
        if d.alternatives:
            out.append("    alternatives (predicted pool MiB):")
            for a in d.alternatives:
                mark = "ok " if a.feasible else "no "
                extra = "" if a.feasible else f"  breaks {', '.join(a.violates)}"
                out.append(f"      {mark}{mib(a.pool_bytes, unit=False):>10}  {a.strategy.label()}{extra}")
    out += ["", "ordering edges (step -> step: rule):"]
    out += [f"- {e.src} -> {e.dst}: {e.rule}" for e in plan.edges]
    from ..memory.exec_reuse import reuse_lines

    return "\n".join(out + reuse_lines(plan))


def diff(a: Plan, b: Plan, name_a: str, name_b: str) -> tuple[str, bool]:
    """Steps, strategies, decisions and predictions that differ; (text, differs)."""
    import difflib  # only `planner diff` and `check` show a diff: a build does not import it

    out: list[str] = []
    pa, pb = a.predicted, b.predicted
    for label, x, y in [
        ("pool", pa.pool_bytes, pb.pool_bytes),
        ("hoisted", pa.hoisted_bytes, pb.hoisted_bytes),
        ("largest graph", pa.largest_graph_bytes, pb.largest_graph_bytes),
        ("warm-up runs", pa.warmup_runs, pb.warmup_runs),
    ]:
        if x != y:
            unit = "" if label == "warm-up runs" else " MiB"
            fx, fy = (str(x), str(y)) if not unit else (mib(x, unit=False), mib(y, unit=False))
            pct = f" ({(y - x) / x:+.1%})" if x else ""
            out.append(f"predicted {label}: {fx}{unit} -> {fy}{unit}{pct}")
    sa = {p.name: p.strategy.label() for p in a.phases}
    sb = {p.name: p.strategy.label() for p in b.phases}
    for name in sorted(set(sa) | set(sb)):
        if sa.get(name) != sb.get(name):
            out.append(f"phase {name}: {sa.get(name, '(absent)')} -> {sb.get(name, '(absent)')}")
    da = [f"[{d.phase}] {d.rule}: {d.choice}" for d in a.decisions]
    db = [f"[{d.phase}] {d.rule}: {d.choice}" for d in b.decisions]
    out += [
        ln
        for ln in difflib.unified_diff(da, db, f"{name_a} decisions", f"{name_b} decisions", lineterm="", n=0)
        if not ln.startswith("@@")
    ]
    ta, tb = _step_lines(a), _step_lines(b)
    out += [ln for ln in difflib.unified_diff(ta, tb, f"{name_a} steps", f"{name_b} steps", lineterm="", n=1)]
    if not out:
        return f"{name_a} and {name_b}: no differences in steps, decisions or predictions", False
    return "\n".join(out), True


def _dot_string(text: str) -> str:
    """``text`` as a quoted Graphviz string: a plan's name is its file's name
    (``-o 'a"b.json'``), which may hold quotes, backslashes or newlines."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def graph(plan: Plan, fmt: str) -> str:
    ids = {s.id: f"s{s.index}" for s in plan.steps}
    if fmt == "dot":
        lines = [f"digraph {_dot_string(plan.name)} {{", "  rankdir=LR;"]
        lines += [f"  {ids[s.id]} [label={_dot_string(s.id)}];" for s in plan.steps]
        lines += [f"  {ids[e.src]} -> {ids[e.dst]} [label={_dot_string(e.rule)}];" for e in plan.edges]
        return "\n".join(lines + ["}"])
    lines = ["flowchart LR"]
    lines += [f'  {ids[s.id]}["{s.id}"]' for s in plan.steps]
    lines += [f"  {ids[e.src]} -->|{e.rule}| {ids[e.dst]}" for e in plan.edges]
    return "\n".join(lines)


def _phase_nodes(plan: Plan) -> tuple[list[tuple[str, list[str]]], list[tuple[str, str, str]]]:
    """The phase-level view: per phase (in capture order) its label lines, and the
    edges between phases with the rules that order them. A phase's chain of
    steps is one node: its captures (count, first and last size, the rule that
    orders them), pool, provisions and warm-ups with their rules."""
    phase_of = {s.id: s.phase for s in plan.steps}
    op_of = {s.id: s.op for s in plan.steps}
    inner: dict[str, dict[str, list[str]]] = {}
    between: dict[tuple[str, str], list[str]] = {}
    for e in plan.edges:
        a, b = phase_of[e.src], phase_of[e.dst]
        if a == b:
            rules = inner.setdefault(a, {}).setdefault(f"{op_of[e.src]}>{op_of[e.dst]}", [])
            if e.rule not in rules:
                rules.append(e.rule)
        else:
            rules = between.setdefault((a, b), [])
            if e.rule not in rules:
                rules.append(e.rule)
    order = list(dict.fromkeys(s.phase for s in plan.steps))
    by_name = {ph.name: ph for ph in plan.phases}
    nodes = []
    for name in order:
        ph = by_name[name]
        caps = [s.bs for s in plan.steps if s.phase == name and s.op == "capture"]
        rules = inner.get(name, {})
        chain = ", ".join(rules.get("capture>capture", [])) or "-"
        lines = [
            name,
            f"{len(caps)} captures, bs {caps[0]} \u2192 {caps[-1]}" if caps else "no captures",
            f"order {ph.strategy.order} ({chain})",
            f"pool {ph.pool}, outputs {ph.strategy.outputs}",
        ]
        for op, what in (("provision", "hoisted workspace"), ("warmup", "warm-up")):
            n = sum(1 for s in plan.steps if s.phase == name and s.op == op)
            if n:
                rule = ", ".join(rules.get(f"{op}>capture", [])) or "-"
                lines.append(f"{n} {what}{'s' if n > 1 and op == 'warmup' else ''} ({rule})")
        nodes.append((name, lines))
    edges = [(a, b, ", ".join(r)) for (a, b), r in between.items()]
    return nodes, edges


def graph_phases(plan: Plan, fmt: str) -> str:
    """The phase-level graph (``planner graph --phases``): one node per phase, an
    edge per ordered pair of phases, labelled with the rules that order them."""
    nodes, edges = _phase_nodes(plan)
    ids = {name: f"p{i}" for i, (name, _) in enumerate(nodes)}
    if fmt == "dot":
        out = [
            f"digraph {_dot_string(plan.name)} {{",
            "  rankdir=LR;",
            '  node [shape=box, style="rounded", fontname="Helvetica", fontsize=11];',
            '  edge [fontname="Helvetica", fontsize=10];',
        ]
        for name, lines in nodes:
            # \l ends each line left-aligned; each line escaped on its own
            label = '"' + "".join(_dot_string(line)[1:-1] + "\\l" for line in lines) + '"'
            out.append(f"  {ids[name]} [label={label}];")
        out += [f"  {ids[a]} -> {ids[b]} [label={_dot_string(rule)}];" for a, b, rule in edges]
        return "\n".join(out + ["}"])
    out = ["flowchart LR"]
    for name, lines in nodes:
        text = "<br/>".join(line.replace('"', "#quot;") for line in lines)
        out.append(f'  {ids[name]}["{text}"]')
    out += [f"  {ids[a]} -->|{rule}| {ids[b]}" for a, b, rule in edges]
    return "\n".join(out)


def timeline(plan: Plan) -> str:
    steps = {s.index: s for s in plan.steps}
    rows = [
        [str(m.step), steps[m.step].id, mib(m.reserved, unit=False), mib(m.allocated, unit=False)]
        for m in plan.predicted.timeline
    ]
    return _table(["#", "step", "reserved MiB", "allocated MiB"], rows) + (
        f"\npeak reserved {mib(plan.predicted.pool_bytes, unit=False)} MiB"
    )


def report_table(report: CaptureReport, plan: Plan | None = None) -> str:
    rows = []
    for m in report.steps:
        delta = (m.reserved - m.predicted_reserved) / m.predicted_reserved if m.predicted_reserved else 0.0
        rows.append(
            [
                str(m.step),
                m.id,
                mib(m.predicted_reserved, unit=False),
                mib(m.reserved, unit=False),
                f"{delta:+.1%}",
                f"{m.seconds * 1e3:.1f}",
            ]
        )
    head = (
        f"report for {report.plan} on {report.device} (torch {report.torch}, {report.backend_module}); "
        f"capture {report.capture_seconds:.2f} s"
    )
    if plan is not None and plan.digest != report.plan_digest:
        head += f"\nwarning: report was made from plan digest {report.plan_digest}, not {plan.digest}"
    tot = report.predicted_pool_bytes
    err = (report.pool_bytes - tot) / tot if tot else 0.0
    lines = [
        head,
        _table(["#", "step", "predicted MiB", "measured MiB", "delta", "ms"], rows),
        f"pool: predicted {mib(tot, unit=False)} MiB, measured {mib(report.pool_bytes, unit=False)} MiB ({err:+.1%})",
    ]
    from ..memory.exec_reuse import report_reuse_lines

    return "\n".join(lines + device_comparison(report, plan) + report_reuse_lines(report, plan))


def device_comparison(report: CaptureReport, plan: Plan | None) -> list[str]:
    """The report's device view, item by item, beside the plan's device items."""
    view = report.device_view
    if view is None:
        return ["device: the report has no device view (written by an older executor)"]
    measured = {i.name: i.bytes for i in view.items}
    # the report's items, as the plan names them (the workspace is the allocator-held part that
    # the plan's data names; the rest of held and cached is allocator-other)
    predicted = {}
    if plan is not None and plan.predicted.device is not None:
        predicted = {i.name: i.bytes for i in plan.predicted.device.items}
    ws = predicted.get("stream-workspace")
    held = measured.get("allocator-held", 0)
    rows_m = {
        "pool": measured.get("pool", 0),
        "hoisted": measured.get("hoisted", 0),
        "stream-workspace": min(held, ws) if ws is not None else held,
        "allocator-other": held - (min(held, ws) if ws is not None else held) + measured.get("allocator-cached", 0),
        "graph-exec": measured.get("outside-allocator", 0),
    }
    rows = []
    for name, got in rows_m.items():
        want = predicted.get(name) if predicted else None
        delta = "" if want is None or not want else f"{(got - want) / want:+.1%}"
        rows.append([name, _item_mib(want) if predicted else "-", mib(got, unit=False), delta or "-"])
    # predicted is non-empty only where plan and its device prediction are there
    total = plan.predicted.device.total_bytes if predicted else None  # pyright: ignore[reportOptionalMemberAccess]
    rows.append(
        [
            "free memory drop",
            _item_mib(total) if predicted else "-",
            mib(view.drop, unit=False),
            f"{(view.drop - total) / total:+.1%}" if total else "-",
        ]
    )
    first = "first capture of its process" if view.first_in_process else "not the first capture of its process"
    return [
        f"device view ({'background' if view.background else 'foreground'}, {first}; "
        f"{report.device}{', driver ' + report.driver if report.driver else ''}):",
        _table(["item", "predicted MiB", "measured MiB", "delta"], rows),
    ]
