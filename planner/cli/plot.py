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
@option(
    "--label",
    "labels",
    multiple=True,
    metavar="list[str]",
    help="Name the plans in the legend and title, once per plan given, in order "
    "(default: each file, and the commit it was last committed in when git tracks it).",
)
def command(old, new, output, budget, labels) -> None:
    """Draw each pool's predicted memory per capture, phases as bands, baseline and budget as lines.

    Two plans are aligned by phase and batch size, and the title says which inputs changed."""
    from capture_plan.planner.report.plot import check_plot_path, plan_label, plot_plans

    from ._common import read_plan

    paths = [old] + ([new] if new is not None else [])
    if labels and len(labels) != len(paths):
        raise click.UsageError(f"--label given {len(labels)} time(s) for {len(paths)} plan(s): give one per plan")
    plans = [read_plan(p) for p in paths]
    check_plot_path(output, "-o")
    names = list(labels) or [plan_label(p) for p in paths]
    if len(names) == 2 and names[0] == names[1]:
        names = [f"{names[0]} (old)", f"{names[1]} (new)"]
    plot_plans(plans, output, budget_mib=budget, labels=names)
    click.echo(f"wrote {output}")
