"""``planner diff A B``: what changes between two plans."""

from __future__ import annotations

import click

from ._common import PATH, Command, argument, option


@click.command("diff", cls=Command)
@argument("a", "Old plan.", "path", type=PATH)
@argument("b", "New plan.", "path", type=PATH)
@option("--exit-code", is_flag=True, help="Exit 1 when the plans differ (like git diff).")
def command(a, b, exit_code) -> None:
    """Compare steps, strategies, decisions and predicted memory."""
    from planner.render import diff as render

    from ._common import read_plan

    text, differs = render(read_plan(a), read_plan(b), str(a), str(b))
    click.echo(text)
    if differs and exit_code:
        raise click.exceptions.Exit(1)
