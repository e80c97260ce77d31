"""``planner check``: are the checked-in plans what the planner builds now?"""

from __future__ import annotations

from pathlib import Path

import click

from ._common import PATH, Command, argument, option


@click.command("check", cls=Command)
@argument("paths", "Plan files or folders [plans/].", "list[Path]", many=True, type=PATH)
@option("--fix", is_flag=True, help="Rebuild stale plans in place instead of failing.")
@option("--require-exact", is_flag=True, help="Also exit 1 for a plan whose prediction is approximate for the "
        "captured model (analytic figures for a config.json or MoE model).")
def command(paths, fix, require_exact) -> None:
    """Rebuild every plan from the command recorded in it and compare bytes (exit 1 on drift)."""
    from planner.check import check_paths

    paths = list(paths) or [Path("plans")]
    for line in check_paths(paths, fix=fix):
        click.echo(line)
    if require_exact:
        from planner.check import _plan_files
        from planner.fidelity import require_exact as require

        from ._common import read_plan

        for path, _ in _plan_files(paths):
            require(read_plan(path), str(path))
