"""``planner diff OLD NEW``: what changes between two plans, for a terminal or a PR comment."""

from __future__ import annotations

import click

from ._common import PATH, Command, argument, option


class Threshold(click.ParamType):
    """``--fail-above``: a percentage of the old total (``5``, ``5%``) or an
    amount (``64MiB``, ``1GiB``, ``8200B``). Anything else is a usage error
    (exit 2, click's message)."""

    name = "threshold"
    _UNITS = {"b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        text = str(value).strip().lower()
        unit = next((u for u in sorted(self._UNITS, key=len, reverse=True) if text.endswith(u)), None)
        number = text[: -len(unit)] if unit else text.removesuffix("%")
        try:
            amount = float(number)
        except ValueError:
            amount = float("nan")
        if not amount >= 0 or amount == float("inf"):
            self.fail(f"{value!r} is not a percentage (5, 5%) or an amount (64MiB, 8200B)", param, ctx)
        return ("bytes", int(amount * self._UNITS[unit])) if unit else ("percent", amount)


def _tokens(value: str | None) -> int | None:
    """``--fail-above-kv-tokens``: a whole count of tokens, 0 or more (``1,000`` and ``1_000`` too)."""
    if value is None:
        return None
    from capture_plan.schemas.errors import InputError

    text = str(value).strip().replace(",", "").replace("_", "")
    if not text.isdigit() or not text.isascii():
        raise InputError(
            f"{value!r:.40} is not a count of KV tokens",
            where="--fail-above-kv-tokens",
            fix="give a whole number of tokens, e.g. --fail-above-kv-tokens 4096",
        )
    return int(text)


@click.command("diff", cls=Command)
@argument("old", "Old plan (e.g. the base branch's; a pipe, or - for standard input).", "path", type=PATH)
@argument("new", "New plan (a pipe, or - for standard input).", "path", type=PATH)
@option(
    "--format",
    "-f",
    "fmt",
    type=click.Choice(["text", "markdown"]),
    default="text",
    show_default=True,
    metavar="str",
    help="text, or markdown for a PR comment.",
)
@option(
    "--fail-above",
    type=Threshold(),
    metavar="pct|amount",
    help="Exit 1 when the device total (graph-exec included; plans built with --calibration or --device) "
    "grows by more than this, else the predicted total (pools + hoisted): a percentage of the old total "
    "(5, 5%) or an amount (64MiB, 8200B). Shrinking never fails; the output says which total it gated on.",
)
@option(
    "--fail-above-kv-tokens",
    "fail_kv",
    callback=lambda ctx, param, value: _tokens(value),
    metavar="int",
    help="Exit 1 when the new plan leaves more than this many fewer KV tokens than the old under the engine "
    "release and device each was built for (planner build --engine ENGINE==VERSION with --device or "
    "--calibration: planner fit's rule over the plan's graph memory, graph-exec included); 0 fails any cost. "
    "Beside --fail-above or alone; the output says the figure it gated on.",
)
@option("--exit-code", is_flag=True, help="Exit 1 when the plans differ at all (like git diff).")
@option("--steps", is_flag=True, help="Also print the step-by-step diff.")
def command(old, new, fmt, fail_above, fail_kv, exit_code, steps) -> None:
    """Compare predicted memory (total, per pool, per phase, baseline, hoisted), inputs, decisions and steps."""
    from capture_plan.planner.report.compare import compare
    from capture_plan.planner.report.compare_text import (
        gate,
        gate_verdict,
        kv_gate,
        kv_gate_verdict,
        render_markdown,
        render_text,
    )

    from ._common import read_plan

    if str(old) == str(new) == "-":
        from capture_plan.schemas.errors import InputError

        raise InputError(
            "both plans are standard input (-)", where="planner diff", fix="give one plan as -, the other as a file"
        )
    # a pipe or - as a plan: a reviewer types `planner diff <(git show HEAD:plans/x.json) plans/x.json`
    a, b = read_plan(old, stream=True), read_plan(new, stream=True)
    d = compare(a, b, str(old), str(new), where=str(new))
    paths = (str(old), str(new))
    if fail_kv is not None:
        from capture_plan.planner.report.check import check_kv_recorded

        check_kv_recorded(a, paths[0])
        check_kv_recorded(b, paths[1])
    failure = gate(a, b, fail_above, str(new)) if fail_above is not None else None
    kv_failure = kv_gate(a, b, fail_kv, paths) if fail_kv is not None else None
    if fmt == "markdown":
        verdicts = []
        if fail_above is not None:
            verdicts.append(
                f"**Over the limit**: {failure.what}"
                if failure
                else f"Within the limit: {gate_verdict(a, b, fail_above).removeprefix('within ')}."
            )
        if fail_kv is not None:
            verdicts.append(
                f"**Over the limit**: {kv_failure.what}"
                if kv_failure
                else f"Within the limit: {kv_gate_verdict(a, b, fail_kv, paths).removeprefix('within ')}."
            )
        click.echo(render_markdown(d, steps=steps, verdict=" ".join(verdicts) or None))
    else:
        click.echo(render_text(d, steps=steps))
        if fail_above is not None and failure is None and d.differs:  # identical plans: one line says so
            click.echo(f"gate: {gate_verdict(a, b, fail_above)}")
        if fail_kv is not None and kv_failure is None and d.differs:
            click.echo(f"gate: {kv_gate_verdict(a, b, fail_kv, paths)}")
    failure = failure or kv_failure
    if failure is not None:
        raise failure
    if exit_code and d.differs:
        raise click.exceptions.Exit(1)
