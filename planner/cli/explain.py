"""``planner explain PLAN``: every decision and ordering edge, with its rule."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    app.command("explain")(explain)


def explain(plan: Path = typer.Argument(..., help="Plan file.")) -> None:
    """Explain each decision (with rejected alternatives and their cost) and each edge."""
    from planner.render import explain as render

    from ._common import read_plan

    typer.echo(render(read_plan(plan)))
