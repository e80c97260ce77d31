"""``planner report FILE``: measured against predicted, step by step."""

from __future__ import annotations

import click

from ._common import PATH, Command, argument, option


@click.command("report", cls=Command)
@argument("file", "Capture report written by the executor.", "path", type=PATH)
@option(
    "--plan",
    type=PATH,
    metavar="path",
    help="Plan to check the report against (exit 1 if the report was captured from another plan).",
)
@option(
    "--require-exact",
    is_flag=True,
    help="With --plan: exit 1 if the plan's prediction is approximate for the captured model.",
)
def command(file, plan, require_exact) -> None:
    """Show a capture report beside its plan's predictions."""
    from capture_plan.planner.report.render import report_table

    from ._common import read_plan, read_report

    rep = read_report(file)
    p = read_plan(plan) if plan is not None else None
    if require_exact:
        from capture_plan.schemas.errors import InputError

        if p is None:
            raise InputError(
                "--require-exact needs the plan the report was captured from",
                where="--require-exact",
                fix="add --plan PLAN",
            )
        from capture_plan.planner.memory.fidelity import require_exact as require

        require(p, str(plan))
    if p is not None:  # exit 1, not a warning: CI runs this to check a report against its plan
        from capture_plan.planner.report.check import check_report_plan
        from capture_plan.schemas.codec import sha256
        from capture_plan.schemas.files import read_input

        check_report_plan(rep, p, str(file), str(plan), sha256(read_input(file, "report")))
    click.echo(report_table(rep, p))
