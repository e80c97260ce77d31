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
@option("--exit-code", is_flag=True, help="Exit 1 when the plans differ at all (like git diff).")
@option("--steps", is_flag=True, help="Also print the step-by-step diff.")
def command(old, new, fmt, fail_above, exit_code, steps) -> None:
    """Compare predicted memory (total, per pool, per phase, baseline, hoisted), inputs, decisions and steps."""
    from capture_plan.planner.report.compare import compare
    from capture_plan.planner.report.compare_text import gate, gate_verdict, render_markdown, render_text

    from ._common import read_plan

    if str(old) == str(new) == "-":
        from capture_plan.schemas.errors import InputError

        raise InputError(
            "both plans are standard input (-)", where="planner diff", fix="give one plan as -, the other as a file"
        )
    # a pipe or - as a plan: a reviewer types `planner diff <(git show HEAD:plans/x.json) plans/x.json`
    a, b = read_plan(old, stream=True), read_plan(new, stream=True)
    d = compare(a, b, str(old), str(new), where=str(new))
    failure = gate(a, b, fail_above, str(new)) if fail_above is not None else None
    if fmt == "markdown":
        verdict = None
        if fail_above is not None:
            verdict = (
                f"**Over the limit**: {failure.what}"
                if failure
                else f"Within the limit: {gate_verdict(a, b, fail_above).removeprefix('within ')}."
            )
        click.echo(render_markdown(d, steps=steps, verdict=verdict))
    else:
        click.echo(render_text(d, steps=steps))
        if fail_above is not None and failure is None and d.differs:  # identical plans: one line says so
            click.echo(f"gate: {gate_verdict(a, b, fail_above)}")
    if failure is not None:
        raise failure
    if exit_code and d.differs:
        raise click.exceptions.Exit(1)
