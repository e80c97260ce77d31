"""``planner show PLAN``: the steps as a table."""

from __future__ import annotations

import click

from ._common import PATH, Command, argument


@click.command("show", cls=Command)
@argument("plan", "Plan file.", "path", type=PATH)
def command(plan) -> None:
    """Print the plan's summary and its steps with predicted pool memory, then the allocator
    core a check or rebuild of it here runs."""
    from capture_plan.planner.memory.core import core
    from capture_plan.planner.report.render import steps_table, summary

    from ._common import read_plan

    p = read_plan(plan)
    click.echo(summary(p, str(plan)))
    click.echo(steps_table(p))
    # a plan does not record the core that built it: either gives the same bytes
    click.echo(f"allocator core here: {core().describe()}; a check or rebuild runs it, and either core gives this plan")
