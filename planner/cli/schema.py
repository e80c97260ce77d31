"""``planner schema``: JSON Schema of the spec and the plan."""

from __future__ import annotations

import click

from ._common import Command, argument


@click.command("schema", cls=Command)
@argument(
    "which",
    "spec, plan, trace, report, backends, phase-kinds, fit or all.",
    "str",
    required=False,
    default="all",
    shell_complete=lambda ctx, param, incomplete: [
        n
        for n in ("all", "spec", "plan", "trace", "report", "backends", "phase-kinds", "fit")
        if n.startswith(incomplete)
    ],
)
def command(which) -> None:
    """Print the JSON Schema (spec: the input you write; plan: the file the planner writes;
    backends: planner/data/backends.toml; phase-kinds: planner/data/phase_kinds.toml)."""
    from capture_plan.planner.inputs.schema import json_schema

    click.echo(json_schema(which))
