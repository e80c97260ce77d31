"""``planner build``: write (or check) a plan."""

from __future__ import annotations

import click

from ._build_inputs import CHOICE, INPUTS, build_options
from ._common import Command, option


@click.command("build", cls=Command)
@build_options(
    *INPUTS,
    "sizes",
    *CHOICE,
    "strategies",
    option(
        "--require-exact",
        is_flag=True,
        help="Exit 1 if the prediction is approximate for the captured model "
        "(analytic figures for a config.json or MoE model: record a trace instead).",
    ),
    "output",
    "exact",
    option("--dry-run", is_flag=True, help="Build and print the summary; write nothing."),
    option("--check", is_flag=True, help="Build in memory and compare with the file; exit 1 on drift."),
    option(
        "--force",
        is_flag=True,
        help="Replace an output file that holds a plan built by another command "
        "(default: refuse, so a what-if build never clobbers a checked-in plan).",
    ),
)
def command(given, require_exact, dry_run, check, force) -> None:
    """Build a capture plan from the spec, rules and gates."""
    from capture_plan.planner.build import build_plan
    from capture_plan.planner.inputs.build_options import from_flat, output_path
    from capture_plan.planner.memory.fidelity import require_exact as require_exact_plan
    from capture_plan.planner.report.plan_files import check_plan, write_plan
    from capture_plan.planner.report.render import summary

    opts = from_flat(given)
    path = output_path(opts)
    if check:
        check_plan(opts, same_command=True)
        if require_exact:  # the file is exactly what the build gives
            from ._common import read_plan

            require_exact_plan(read_plan(path), str(path))
        click.echo(f"{path}: up to date")
        return
    plan = build_plan(opts)
    if require_exact:  # before writing: CI refuses the plan, and nothing is replaced
        require_exact_plan(plan, str(path))
    if not dry_run:
        write_plan(opts, plan, force=force)
    click.echo(summary(plan, f"{path}{' (dry run, not written)' if dry_run else ''}"))
