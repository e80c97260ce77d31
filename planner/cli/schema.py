"""``planner schema``: JSON Schema of the spec and the plan."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    app.command("schema")(schema)


def schema(which: str = typer.Argument("all", help="spec, plan, trace, report or all.")) -> None:
    """Print the JSON Schema (spec: the input you write; plan: the file the planner writes)."""
    from planner.schema import json_schema

    typer.echo(json_schema(which))
