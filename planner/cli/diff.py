"""``planner diff A B``: what changes between two plans."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    app.command("diff")(diff)


def diff(a: Path = typer.Argument(..., help="Old plan."), b: Path = typer.Argument(..., help="New plan."),
         exit_code: bool = typer.Option(False, "--exit-code", help="Exit 1 when the plans differ (like git diff).")
         ) -> None:
    """Compare steps, strategies, decisions and predicted memory."""
    from planner.render import diff as render

    from ._common import read_plan

    text, differs = render(read_plan(a), read_plan(b), str(a), str(b))
    typer.echo(text)
    if differs and exit_code:
        raise typer.Exit(1)
