"""``planner graph PLAN``: the step graph as Graphviz dot or Mermaid."""

from __future__ import annotations

import click

from ._common import PATH, Command, argument, option


@click.command("graph", cls=Command)
@argument("plan", "Plan file.", "path", type=PATH)
@option("--format", "-f", "fmt", default="dot", show_default=True, metavar="str", help="dot or mermaid.")
@option(
    "--phases",
    is_flag=True,
    help="One node per phase (its captures, size range, order and rules), edges "
    "between phases: legible for plans of hundreds of steps.",
)
def command(plan, fmt, phases) -> None:
    """Print the ordering graph, every edge labelled with its rule."""
    from capture_plan.planner.report.render import graph, graph_phases
    from capture_plan.schemas.errors import InputError

    render = graph_phases if phases else graph

    from ._common import read_plan

    if fmt not in ("dot", "mermaid"):
        raise InputError(f"unknown format {fmt!r}", where="--format", fix="use dot or mermaid")
    click.echo(render(read_plan(plan), fmt))
