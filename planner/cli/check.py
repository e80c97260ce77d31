"""``planner check``: are the checked-in plans what the planner builds now?"""

from __future__ import annotations

from pathlib import Path

import click

from ._common import PATH, Command, argument, option


@click.command("check", cls=Command)
@argument("paths", "Plan files or folders [plans/].", "list[Path]", many=True, type=PATH)
@option("--fix", is_flag=True, help="Rebuild stale plans in place instead of failing.")
@option(
    "--require-exact",
    is_flag=True,
    help="Also exit 1 for a plan whose prediction is approximate for the "
    "captured model (analytic figures for a config.json or MoE model).",
)
def command(paths, fix, require_exact) -> None:
    """Rebuild every plan from the command recorded in it and compare bytes (exit 1 on drift).

    Each stale plan is one line on stderr: which recorded input changed, how far
    the prediction moved, and the command that rebuilds it; then one summary line.
    """
    from capture_plan.planner.report.check import StalePlans, check_paths

    paths = list(paths) or [Path("plans")]
    try:
        lines = check_paths(paths, fix=fix)
    except StalePlans as err:
        for line in err.ok:
            click.echo(line)
        if len(err.stale) == 1:  # its own line says it all
            only = err.stale[0]
            if getattr(only, "fixable", True):
                only.fix = f"{only.fix}, or `{err.fix_command}`" if only.fix else f"run `{err.fix_command}`"
            raise only from None
        for stale in err.stale:
            click.echo(f"planner: error: {stale}", err=True)
        raise
    for line in lines:
        click.echo(line)
    if require_exact:
        from capture_plan.planner.memory.fidelity import require_exact as require
        from capture_plan.planner.report.check import _plan_files

        from ._common import read_plan

        for path, _ in _plan_files(paths):
            require(read_plan(path), str(path))
