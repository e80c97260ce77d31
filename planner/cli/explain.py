"""``planner explain PLAN``: every decision and ordering edge, with its rule."""

from __future__ import annotations

import click

from ._common import PATH, Command, argument


@click.command("explain", cls=Command)
@argument("plan", "Plan file.", "path", type=PATH)
def command(plan) -> None:
    """Explain each decision (with rejected alternatives and their cost) and each edge."""
    from planner.render import explain as render

    from ._common import read_plan

    click.echo(render(read_plan(plan)))
