"""``planner simulate PLAN``: the predicted pool timeline, optionally plotted."""

from __future__ import annotations

import click

from ._common import OUTPUT, PATH, Command, argument, option


@click.command("simulate", cls=Command)
@argument("plan", "Plan file.", "path", type=PATH)
@option("--plot", type=OUTPUT, metavar="path", help="Also draw the timeline to this PNG.")
def command(plan, plot) -> None:
    """Print reserved and allocated pool bytes after every step."""
    from capture_plan.planner.report.render import timeline

    from ._common import read_plan

    p = read_plan(plan)
    if plot is not None:  # before printing: a refused --plot is one line on stderr, nothing on stdout
        from capture_plan.planner.report.plot import check_plot_path

        check_plot_path(plot)
    click.echo(timeline(p))
    if plot is not None:
        from capture_plan.planner.report.plot import plot_timeline

        plot_timeline(p, plot)
        click.echo(f"wrote {plot}")
