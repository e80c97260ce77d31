"""``planner plot OLD [NEW] -o FILE``: pool memory over the capture sequence, for a PR."""

from __future__ import annotations

import click

from ._common import OUTPUT, PATH, Command, argument, option


@click.command("plot", cls=Command)
@argument("old", "Plan to draw (the old one when NEW is given).", "path", type=PATH)
@argument("new", "New plan, drawn over OLD.", "path", required=False, type=PATH)
@option(
    "-o",
    "--output",
    type=OUTPUT,
    required=True,
    metavar="path",
    help="Image to write: .svg for SVG, PNG otherwise (an existing file that is no such image is refused).",
)
@option(
    "--budget",
    type=click.FloatRange(min=0, min_open=True),
    metavar="MiB",
    help="Draw this budget (MiB) as a line, e.g. the spec's budget_mib.",
)
def command(old, new, output, budget) -> None:
    """Draw each pool's predicted memory per capture, phases as bands, baseline and budget as lines."""
    from capture_plan.planner.plot import check_plot_path, plot_plans

    from ._common import read_plan

    plans = [read_plan(old)] + ([read_plan(new)] if new is not None else [])
    check_plot_path(output, "-o")
    plot_plans(plans, output, budget_mib=budget)
    click.echo(f"wrote {output}")
