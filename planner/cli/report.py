"""``planner report FILE``: measured against predicted, step by step."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    app.command("report")(report)


def report(file: Path = typer.Argument(..., help="Capture report written by the executor."),
           plan: Optional[Path] = typer.Option(None, "--plan", help="Plan to check the report against.")) -> None:
    """Show a capture report beside its plan's predictions."""
    from planner.render import report_table

    from ._common import read_plan, read_report

    typer.echo(report_table(read_report(file), read_plan(plan) if plan is not None else None))
