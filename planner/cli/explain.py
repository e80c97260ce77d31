"""``planner explain PLAN``: every decision and ordering edge, with its rule."""

from __future__ import annotations

import click

from ._common import PATH, Command, argument


@click.command("explain", cls=Command)
@argument("plan", "Plan file.", "path", type=PATH)
def command(plan) -> None:
    """Explain each decision (with rejected alternatives and their cost) and each edge."""
    from capture_plan.planner.report.render import explain as render

    from ._common import read_plan

    p = read_plan(plan)
    click.echo(render(p, _head(p, plan)))


def _head(p, path) -> str:
    """The first line: the command that rebuilds the plan, runnable from the
    current directory. A plan records its command relative to its own folder
    (so that it is the same in every clone); where that command cannot be read
    back (a newer planner's option), it is shown as recorded, with the folder to
    run it in."""
    import os
    from pathlib import Path

    from capture_plan.planner.inputs.build_options import command_for_cwd, options_from_command
    from capture_plan.planner.report.check import recorded_options
    from capture_plan.schemas.errors import CapturePlanError

    try:
        opts = recorded_options(p, path)
    except CapturePlanError:
        # a revision-1 plan: its text, read back where it holds only the options a build records
        opts = options_from_command(list(p.command), Path(path))
        if opts is None:
            folder = os.path.dirname(str(path)) or "."
            return f"plan {p.name}, recorded command (its paths relative to {folder}): {' '.join(p.command)}"
    return f"plan {p.name}, rebuilt from here by: {command_for_cwd(opts)}"
