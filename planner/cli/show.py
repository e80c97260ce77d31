"""``planner show PLAN``: the steps as a table."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    app.command("show")(show)


def show(plan: Path = typer.Argument(..., help="Plan file.")) -> None:
    """Print the plan's summary and its steps with predicted pool memory."""
    from planner.render import steps_table, summary

    from ._common import read_plan

    p = read_plan(plan)
    typer.echo(summary(p, str(plan)))
    typer.echo(steps_table(p))
