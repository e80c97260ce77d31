"""``planner build``: write (or check) a plan."""

from __future__ import annotations

import click

from ._common import OUTPUT, PATH, Command, option


def _complete_backend(incomplete: str) -> list[str]:
    from capture_plan.planner.resources import backend_names

    return [n for n in backend_names() if n.startswith(incomplete)]


def _complete(what: str, incomplete: str) -> list[str]:
    """Values of --speculative (presets.toml's [speculative] tables), --preset (capture_plan.planner.specs.preset_names)
    or --allocator (capture_plan.schemas.strategy)."""
    if what == "speculative":
        from capture_plan.planner.specs import speculative_names as names
    elif what == "preset":
        from capture_plan.planner.specs import preset_names as names
    else:
        from capture_plan.schemas.strategy import allocator_modes as names
    return [n for n in names() if n.startswith(incomplete)]


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


class _BackendOption(click.Option):
    """``--backend``: its help names the backends of planner/data/backends.toml,
    read only when the help is shown (``planner --help`` reads no data)."""

    def get_help_record(self, ctx: click.Context):
        from capture_plan.planner.resources import backend_names

        self.help = f"Attention backend: {', '.join(backend_names())} (planner/data/backends.toml)."
        return super().get_help_record(ctx)


@click.command("build", cls=Command)
@option(
    "--backend",
    "-b",
    "backend",
    cls=_BackendOption,
    required=True,
    metavar="str",
    help="",
    shell_complete=lambda ctx, param, incomplete: _complete_backend(incomplete),
)
@option("--ci", is_flag=True, help="Apply the CI-only gates.")
@option("--spec", type=PATH, metavar="path", help="Spec file (TOML or JSON); default: the embedded spec.")
@option(
    "--speculative",
    metavar="str",
    help="Add speculative phases: eagle.",
    shell_complete=lambda ctx, param, incomplete: _complete("speculative", incomplete),
)
@option(
    "--preset",
    metavar="str",
    help="Another engine's conventions for the embedded spec: vllm (planner/data/presets_vllm.toml); default SGLang's.",
    shell_complete=lambda ctx, param, incomplete: _complete("preset", incomplete),
)
@option(
    "--max-bs",
    type=int,
    metavar="int",
    help="Largest capture size of the embedded spec [256; --preset vllm: 512 tokens].",
)
@option("--tp", type=int, metavar="int", help="Tensor-parallel size (per-rank memory).")
@option(
    "--allocator",
    metavar="str",
    help="native or expandable segments.",
    shell_complete=lambda ctx, param, incomplete: _complete("allocator", incomplete),
)
@option(
    "--trace",
    type=PATH,
    metavar="path",
    help="Allocation trace for exact predictions: "
    "capture_plan.executor.profile's JSON, or a torch.cuda.memory._dump_snapshot pickle.",
)
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
    "--calibration",
    type=PATH,
    metavar="path",
    help="Capture report measured on the device (GraphSet."
    "write_report): the plan's measured device items (graph memory outside the pool).",
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
    backend,
    ci,
    spec,
    speculative,
    preset,
    max_bs,
    tp,
    allocator,
    trace,
    strategy,
    calibration,
    require_exact,
    output,
    exact,
    dry_run,
    check,
    force,
) -> None:
    """Build a capture plan from the spec, rules and gates."""
    from capture_plan.planner.build import BuildOptions, build_plan, check_plan, output_path, write_plan
    from capture_plan.planner.fidelity import require_exact as require_exact_plan
    from capture_plan.planner.render import summary

    opts = BuildOptions(
        backend=backend,
        ci=ci,
        spec=spec,
        speculative=speculative,
        max_bs=max_bs,
        tp=tp,
        allocator=allocator,
        trace=trace,
        strategies=tuple(strategy),
        output=output,
        exact=exact,
        calibration=calibration,
        preset=preset,
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
