"""``planner check``: are the checked-in plans what the planner builds now?"""

from __future__ import annotations

from pathlib import Path
from typing import List

import typer


def register(app: typer.Typer) -> None:
    app.command("check")(check)


def check(paths: List[Path] = typer.Argument(None, help="Plan files or folders [plans/]."),
          fix: bool = typer.Option(False, "--fix", help="Rebuild stale plans in place instead of failing.")) -> None:
    """Rebuild every plan from the command recorded in it and compare bytes (exit 1 on drift)."""
    from planner.check import check_paths

    for line in check_paths(paths or [Path("plans")], fix=fix):
        typer.echo(line)
