"""``planner report FILE``: measured against predicted, step by step."""

from __future__ import annotations

import click

from ._common import PATH, Command, argument, option


@click.command("report", cls=Command)
@argument("file", "Capture report written by the executor.", "path", type=PATH)
@option("--plan", type=PATH, metavar="path", help="Plan to check the report against.")
def command(file, plan) -> None:
    """Show a capture report beside its plan's predictions."""
    from planner.render import report_table

    from ._common import read_plan, read_report

    click.echo(report_table(read_report(file), read_plan(plan) if plan is not None else None))
