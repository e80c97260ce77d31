"""Two plans side by side, in words: the figures' changes, the text and Markdown of ``planner diff``,
its CI threshold, and why ``planner check`` calls a plan stale.

What is compared (the figures, inputs and decisions) is planner/report/compare.py's; this module
only writes it (see that module's docstring for how byte figures and folded rows read).
"""

from __future__ import annotations

from capture_plan.schemas.plan import Plan
from capture_plan.schemas.units import MiB, mib

from .compare import Figure, InputChange, PlanDiff, Unit, figures, input_changes, total

__all__ = [
    "bytes_text",
    "change_text",
    "moved",
    "input_text",
    "render_text",
    "render_markdown",
    "limit_text",
    "gate",
    "gated_on",
    "gate_verdict",
    "stale_reason",
]


def bytes_text(n: int, in_bytes: bool) -> str:
    """``n`` in bytes (``8,200 B``) or MiB (``1,520.0 MiB``); nothing is ``0 B``."""
    return f"{n:,} B" if in_bytes or n == 0 else mib(n)


def _signed(d: int, in_bytes: bool) -> str:
    sign = "+" if d >= 0 else "-"
    return sign + bytes_text(abs(d), in_bytes or abs(d) < MiB)


def change_text(old: int | None, new: int | None, unit: Unit = "bytes") -> str:
    """``old -> new (change, percent)``: bytes below 1 MiB exactly, MiB above,
    never two equal roundings for a real change."""
    if unit == "count":

        def show(v):
            return "(none)" if v is None else f"{v:,}"

        if old is None or new is None or old == new:
            return f"{show(old)} -> {show(new)}"
        return f"{show(old)} -> {show(new)} ({new - old:+,}, {_percent(new - old, old)})"
    values = [v for v in (old, new) if v is not None]
    in_bytes = max(values, default=0) < MiB
    missing = "unknown" if unit == "device-bytes" else "(none)"

    def show(v):
        return missing if v is None else bytes_text(v, in_bytes)

    if old is None or new is None or old == new:
        return f"{show(old)} -> {show(new)}"
    d = new - old
    # a change under 1 MiB is written in bytes, so two equal MiB roundings still show it
    return f"{show(old)} -> {show(new)} ({_signed(d, in_bytes)}, {_percent(d, old)})"


def _percent(d: int, old: int) -> str:
    """``d`` as a percentage of ``old``; a tiny one keeps two significant digits
    (``-0.00051%``), never "-0.0%"."""
    if not old:
        return "new"
    p = d * 100 / old
    return f"{p:+.1f}%" if abs(p) >= 0.1 else f"{p:+.2g}%"


def moved(a: Plan, b: Plan) -> str:
    """How far the prediction moved, in one clause: the total, then what else changed."""
    t = f"predicted total {change_text(total(a), total(b))}"
    others = [f for f in figures(a, b) if f.old != f.new and not f.label.startswith("total")]
    if total(a) == total(b) and not others:
        return "prediction unchanged"
    if total(a) == total(b):
        return (
            f"predicted total unchanged ({bytes_text(total(b), total(b) < MiB)}); "
            + f"{others[0].label} {change_text(others[0].old, others[0].new, others[0].unit)}"
        )
    return t


def input_text(c: InputChange) -> str:
    """One changed input as ``label: old -> new`` (a file whose digest changed: ``spec: my.toml
    (d488039a491f -> 4ef05cf04192)``; a value whose source changed: ``model vocab: 128256 (preset
    llama-3-8b -> spec)``)."""
    if c.label.startswith("sizes ") and c.old and c.new:
        return f"{c.label}: {c.old} -> {c.new} ({c.detail})" if c.detail else f"{c.label}: {c.old} -> {c.new}"
    if c.old and c.new and c.old.endswith(")") and c.new.endswith(")"):
        # the same file with other contents: "spec: my.toml (d488039a491f -> 4ef05cf04192)"
        name_a, _, digest_a = c.old[:-1].rpartition(" (")
        name_b, _, digest_b = c.new[:-1].rpartition(" (")
        if name_a == name_b:
            return f"{c.label}: {name_a} ({digest_a} -> {digest_b})"
    return f"{c.label}: {c.old or '(none)'} -> {c.new or '(none)'}"


def _folded(figures: list[Figure]) -> tuple[list[tuple[str, Figure]], list[str]]:
    """(rows, unknown): byte figures that read the same on both sides as one row
    labelled ``a = b = c`` (one change, one row), in first-seen order; and the
    labels of the figures no plan knows (both None), for one line."""
    rows: list[tuple[list[str], Figure]] = []
    same: dict[tuple[int | None, int | None], int] = {}
    unknown: list[str] = []
    for f in figures:
        if f.old is None and f.new is None:
            unknown.append(f.label)
            continue
        key = (f.old, f.new)
        if f.unit != "count" and None not in key and key in same:
            rows[same[key]][0].append(f.label)
            continue
        if f.unit != "count" and None not in key:
            same[key] = len(rows)
        rows.append(([f.label], f))
    return [(" = ".join(labels), f) for labels, f in rows], unknown


_UNLISTED = "other recorded detail differs (a decision's alternatives or reasons): `planner explain` each plan"


def render_text(d: PlanDiff, *, steps: bool = False) -> str:
    """The diff for a terminal: changed figures (those equal on both sides in one
    line), inputs, decisions, steps."""
    if not d.differs:
        return f"{d.old_name} and {d.new_name}: no differences in inputs, steps, decisions or predictions"
    out = [f"{d.old_name} -> {d.new_name}"]
    if d.changed_figures:
        out.append("predicted:")
        out += [f"  {label}: {change_text(f.old, f.new, f.unit)}" for label, f in _folded(d.changed_figures)[0]]
    elif d.inputs:
        out.append(f"predicted: unchanged (total {bytes_text(d.figures[0].new or 0, (d.figures[0].new or 0) < MiB)})")
    if d.inputs:
        out.append("inputs:")
        out += [f"  {input_text(c)}" for c in d.inputs]
    if d.decisions:
        out.append("decisions:")
        for c in d.decisions:
            out.append(f"  [{c.phase}] {c.old or '(none)'} -> {c.new or '(none)'}")
            if c.new_why or c.old_why:
                out.append(f"    why: {c.new_why}" if c.new_why else f"    why it was: {c.old_why}")
    if d.steps:
        out += d.steps
    if d.unlisted:
        out.append(_UNLISTED)
    if steps and d.step_lines:
        out += d.step_lines
    return "\n".join(out)


def _md(text: str) -> str:
    # a table cell: pipes would end it, newlines the row
    return " ".join(text.replace("|", "\\|").split())


def render_markdown(d: PlanDiff, *, steps: bool = False, verdict: str | None = None) -> str:
    """The diff as a Markdown PR comment: a table of every figure (changed ones
    bold), then inputs, decisions and steps as lists."""
    head = f"### Capture plan `{_md(d.new_name)}` vs `{_md(d.old_name)}`"
    out = [head, ""]
    if verdict:
        out += [verdict, ""]
    if not d.differs:
        return "\n".join(out + ["No differences in inputs, steps, decisions or predictions."])
    if d.unlisted:
        out += [_md(_UNLISTED[0].upper() + _UNLISTED[1:]) + ".", ""]
    out += ["| figure | old | new | change |", "| --- | ---: | ---: | ---: |"]
    rows, unknown = _folded(d.figures)
    for label, f in rows:
        if f.old == f.new:
            if f.unit != "count":
                cell = (
                    ("unknown" if f.unit == "device-bytes" else "-")
                    if f.old is None
                    else bytes_text(f.old, f.old < MiB)
                )
            else:
                cell = "-" if f.old is None else f"{f.old:,}"
            out.append(f"| {_md(label)} | {cell} | {cell} | |")
            continue
        text = change_text(f.old, f.new, f.unit)
        old, _, rest = text.partition(" -> ")
        new, _, change = rest.partition(" (")
        out.append(f"| **{_md(label)}** | {old} | {new} | **{change.rstrip(')')}** |")
    if unknown:
        out += ["", _md(f"Unknown in both plans (never measured for this device): {', '.join(unknown)}.")]
    if not d.changed_figures:
        out += ["", "The prediction is unchanged."]
    if d.inputs:
        out += ["", "**Inputs that differ**", ""]
        out += [f"- {_md(input_text(c))}" for c in d.inputs]
    if d.decisions:
        out += ["", "**Decisions that changed**", ""]
        for c in d.decisions:
            out.append(f"- `{_md(c.phase)}`: {_md(c.old or '(none)')} → {_md(c.new or '(none)')}")
            if c.new_why or c.old_why:
                out.append(f"  - why: {_md(c.new_why)}" if c.new_why else f"  - why it was: {_md(c.old_why)}")
    if d.steps:
        out += ["", "**Steps**: " + _md("; ".join(d.steps).removeprefix("steps: "))]
    if steps and d.step_lines:
        out += ["", "<details><summary>step diff</summary>", "", "```diff"] + d.step_lines + ["```", "", "</details>"]
    return "\n".join(out)


def limit_text(threshold: tuple[str, float]) -> str:
    kind, amount = threshold
    return f"{amount:g}%" if kind == "percent" else bytes_text(int(amount), amount < MiB)


def gated_on(a: Plan, b: Plan) -> tuple[str, int, int]:
    """What ``planner diff --fail-above`` compares: ``(label, old, new)``. The device total
    (every item of the free memory capture takes, graph-exec included) where both plans know
    theirs (built with --calibration), else the device items both know where graph-exec is
    among them (built with --device: allocator-other unknown, graph-exec estimated), else the
    pools and hoisted workspaces, the one figure every plan has (the label says which, and why)."""
    da, db = a.predicted.device, b.predicted.device
    ta = da.total_bytes if da is not None else None
    tb = db.total_bytes if db is not None else None
    if ta is not None and tb is not None:
        return "device total (graph-exec included)", ta, tb
    # built with --device (no calibration): allocator-other is unknown, graph-exec estimated;
    # the items both plans know, graph-exec among them, still see what a size costs
    ka = {i.name: i.bytes for i in da.items if i.bytes is not None} if da is not None else {}
    kb = {i.name: i.bytes for i in db.items if i.bytes is not None} if db is not None else {}
    both = [n for n in ka if n in kb]
    if "graph-exec" in both:
        unknown = sorted({i.name for d in (da, db) if d is not None for i in d.items} - set(both))
        label = f"device items known in both plans ({' + '.join(both)}; unknown: {', '.join(unknown) or 'none'})"
        return label, sum(ka[n] for n in both), sum(kb[n] for n in both)
    missing = "either plan" if ta is None and tb is None else "the old plan" if ta is None else "the new plan"
    return f"predicted total (pools + hoisted; no device total in {missing})", total(a), total(b)


def gate(a: Plan, b: Plan, threshold: tuple[str, float], where: str):
    """The DriftError to raise when ``b``'s figure grew from ``a``'s by more than
    ``threshold`` (``("percent", 5.0)`` or ``("bytes", n)``); None when within. The figure
    is :func:`gated_on`'s: the device total where both plans have one, else pools + hoisted.
    Growth from a total of 0 is over any percentage."""
    from capture_plan.schemas.errors import DriftError

    label, old, new = gated_on(a, b)
    grown = new - old
    kind, amount = threshold
    over = grown > amount if kind == "bytes" else grown > 0 and (old == 0 or grown * 100 > amount * old)
    if not over:
        return None
    return DriftError(
        f"{label} grew {change_text(old, new)}, above --fail-above {limit_text(threshold)}",
        where=where,
        fix="make the plan cheaper, or raise --fail-above if the growth is intended",
    )


def gate_verdict(a: Plan, b: Plan, threshold: tuple[str, float]) -> str:
    """The gate's result within the limit, in one line: the figure it gated on and its change."""
    label, old, new = gated_on(a, b)
    return f"within --fail-above {limit_text(threshold)}: {label} {change_text(old, new)}"


def stale_reason(old: Plan, new: Plan) -> str:
    """Why a checked-in plan ``old`` differs from the rebuild ``new``, in one
    clause: every recorded input that changed, with its old and new value, or
    that none did (the planner's code or data tables predict differently), and
    how far the prediction moved, also when it did not."""
    changes = input_changes(old, new)
    if changes:
        why = "changed: " + ", ".join(input_text(c) for c in changes)
    else:
        why = "no recorded input changed (this planner's code or data tables predict differently)"
    return f"{why}; {moved(old, new)}"


def kv_gated_on(a: Plan, b: Plan, paths: tuple[str, str]) -> tuple[str, int, int]:
    """What ``planner diff --fail-above-kv-tokens`` compares: ``(label, old tokens, new tokens)``,
    the KV tokens each plan's build recorded under its ``--engine`` on its device (planner
    fit's rule over the plan's graph memory). Both plans must record them: the caller refuses a
    plan that does not first (planner/report/check.py's ``check_kv_recorded``, whose fix names
    the build that records them; check.py imports this module)."""
    old, new = a.predicted.kv, b.predicted.kv
    if old is None or new is None or old.kv_tokens is None or new.kv_tokens is None:
        raise ValueError(f"both plans must record KV tokens ({paths[0]}, {paths[1]}): check_kv_recorded first")
    if old.engine != new.engine:  # tokens of two engines, devices or settings: no like-for-like cost
        from capture_plan.schemas.errors import InputError

        raise InputError(
            f"the plans price KV tokens under different engines, devices or settings: {old.engine} "
            f"({paths[0]}) and {new.engine} ({paths[1]})",
            where="--fail-above-kv-tokens",
            fix=f"rebuild {paths[0]} with the --engine, --device and --engine-flag options "
            f"`planner show {paths[1]}` records, then diff again",
        )
    return f"KV tokens under {new.engine}", old.kv_tokens, new.kv_tokens


def kv_gate(a: Plan, b: Plan, tokens: int, paths: tuple[str, str]):
    """The DriftError to raise when ``b`` leaves more than ``tokens`` fewer KV tokens than ``a``
    (:func:`kv_gated_on`); None when within. More tokens never fails."""
    from capture_plan.schemas.errors import DriftError

    label, old, new = kv_gated_on(a, b, paths)
    if old - new <= tokens:
        return None
    return DriftError(
        f"{label}: {old:,} -> {new:,} ({new - old:+,}), the new plan's graphs cost more than "
        f"--fail-above-kv-tokens {tokens:,}",
        where=paths[1],
        fix="capture fewer sizes (planner build --sizes auto --min-kv-tokens N), or raise --fail-above-kv-tokens "
        "if the cost is intended",
    )


def kv_gate_verdict(a: Plan, b: Plan, tokens: int, paths: tuple[str, str]) -> str:
    label, old, new = kv_gated_on(a, b, paths)
    return f"within --fail-above-kv-tokens {tokens:,}: {label}: {old:,} -> {new:,} ({new - old:+,})"
