"""``planner build``: write (or check) a plan."""

from __future__ import annotations

import click

from ._build_inputs import build_inputs, size_choice
from ._common import OUTPUT, Command, option


def _complete_strategy(incomplete: str) -> list[str]:
    """``AXIS=VALUE`` pins (capture_plan.schemas.strategy.AXIS_VALUES); after ``PHASE.``, the same with that prefix."""
    from capture_plan.schemas.strategy import AXIS_VALUES

    phase, dot, rest = incomplete.rpartition(".")
    head = phase + dot
    return [
        head + f"{axis}={value}"
        for axis, values in AXIS_VALUES.items()
        for value in values
        if f"{axis}={value}".startswith(rest)
    ]


@click.command("build", cls=Command)
@build_inputs
@option(
    "--sizes",
    type=click.Choice(["auto"]),
    metavar="str",
    help="auto: capture the sizes chosen for --traffic (as planner sizes chooses them) instead of the spec's.",
)
@size_choice(traffic_required=False)
@option(
    "--strategy",
    "-s",
    "strategy",
    multiple=True,
    metavar="list[str]",
    shell_complete=lambda ctx, param, incomplete: _complete_strategy(incomplete),
    help="Pin a choice: AXIS=VALUE or PHASE.AXIS=VALUE (repeatable).",
)
@option(
    "--require-exact",
    is_flag=True,
    help="Exit 1 if the prediction is approximate for the captured model "
    "(analytic figures for a config.json or MoE model: record a trace instead).",
)
@option("-o", "--output", type=OUTPUT, metavar="path", help="Plan path [plans/<backend>[-...][-ci].json].")
@option(
    "--exact",
    is_flag=True,
    help="Compare strategies on every size (default: phases with more than 64 sizes "
    "are compared on 24 of them; the prediction is always exact).",
)
@option("--dry-run", is_flag=True, help="Build and print the summary; write nothing.")
@option("--check", is_flag=True, help="Build in memory and compare with the file; exit 1 on drift.")
@option(
    "--force",
    is_flag=True,
    help="Replace an output file that holds a plan built by another command "
    "(default: refuse, so a what-if build never clobbers a checked-in plan).",
)
def command(
    build,
    sizes,
    traffic,
    phases,
    metric,
    max_size,
    timing,
    device,
    context,
    budget_mib,
    max_graphs,
    max_padding,
    strategy,
    require_exact,
    output,
    exact,
    dry_run,
    check,
    force,
) -> None:
    """Build a capture plan from the spec, rules and gates."""
    import msgspec

    from capture_plan.planner.build import build_plan
    from capture_plan.planner.inputs.build_options import output_path
    from capture_plan.planner.memory.fidelity import require_exact as require_exact_plan
    from capture_plan.planner.report.plan_files import check_plan, write_plan
    from capture_plan.planner.report.render import summary

    opts = msgspec.structs.replace(
        build,
        strategies=tuple(strategy),
        output=output,
        exact=exact,
        sizes=sizes,
        traffic=traffic,
        traffic_phases=tuple(phases),
        metric=metric,
        max_size=max_size,
        timing=timing,
        device=device,
        context=context,
        budget_mib=budget_mib,
        max_graphs=max_graphs,
        max_padding=max_padding,
    )
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
