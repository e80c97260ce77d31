"""``planner simulate PLAN``: the predicted pool timeline, optionally plotted."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    app.command("simulate")(simulate)


def simulate(plan: Path = typer.Argument(..., help="Plan file."),
             plot: Optional[Path] = typer.Option(None, "--plot", help="Also draw the timeline to this PNG.")) -> None:
    """Print reserved and allocated pool bytes after every step."""
    from planner.render import timeline

    from ._common import read_plan

    p = read_plan(plan)
    typer.echo(timeline(p))
    if plot is not None:
        from planner.plot import plot_timeline

        plot_timeline(p, plot)
        typer.echo(f"wrote {plot}")
