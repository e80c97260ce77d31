"""``planner check``: are the checked-in plans what the planner builds now?"""

from __future__ import annotations

from pathlib import Path

import click

from ._common import PATH, Command, argument, option


@click.command("check", cls=Command)
@argument("paths", "Plan files or folders [plans/].", "list[Path]", many=True, type=PATH)
@option("--fix", is_flag=True, help="Rebuild stale plans in place instead of failing.")
def command(paths, fix) -> None:
    """Rebuild every plan from the command recorded in it and compare bytes (exit 1 on drift)."""
    from planner.check import check_paths

    for line in check_paths(list(paths) or [Path("plans")], fix=fix):
        click.echo(line)
