"""``planner graph PLAN``: the step graph as Graphviz dot or Mermaid."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    app.command("graph")(graph)


def graph(plan: Path = typer.Argument(..., help="Plan file."),
          fmt: str = typer.Option("dot", "--format", "-f", help="dot or mermaid.")) -> None:
    """Print the ordering graph, every edge labelled with its rule."""
    from schemas.errors import InputError
    from planner.render import graph as render

    from ._common import read_plan

    if fmt not in ("dot", "mermaid"):
        raise InputError(f"unknown format {fmt!r}", where="--format", fix="use dot or mermaid")
    typer.echo(render(read_plan(plan), fmt))
