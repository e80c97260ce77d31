"""``planner build``: write (or check) a plan."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from planner.resources import backend_names


def _complete_backend(incomplete: str) -> list[str]:
    return [n for n in backend_names() if n.startswith(incomplete)]


def register(app: typer.Typer) -> None:
    app.command("build")(build)


def build(
    backend: str = typer.Option(..., "--backend", "-b", autocompletion=_complete_backend,
                                help=f"Attention backend: {', '.join(backend_names())} (planner/data/backends.toml)."),
    ci: bool = typer.Option(False, "--ci", help="Apply the CI-only gates."),
    spec: Optional[Path] = typer.Option(None, "--spec", help="Spec file (TOML or JSON); default: the embedded spec."),
    speculative: Optional[str] = typer.Option(None, "--speculative", help="Add speculative phases: eagle."),
    max_bs: Optional[int] = typer.Option(None, "--max-bs", help="Largest capture size of the embedded spec [256]."),
    tp: Optional[int] = typer.Option(None, "--tp", help="Tensor-parallel size (per-rank memory)."),
    allocator: Optional[str] = typer.Option(None, "--allocator", help="native or expandable segments."),
    trace: Optional[Path] = typer.Option(None, "--trace", help="Allocation trace for exact predictions: executor.profile's JSON, "
                                         "or a torch.cuda.memory._dump_snapshot pickle."),
    strategy: List[str] = typer.Option([], "--strategy", "-s",
                                       help="Pin a choice: AXIS=VALUE or PHASE.AXIS=VALUE (repeatable)."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Plan path [plans/<backend>[-...][-ci].json]."),
    exact: bool = typer.Option(False, "--exact", help="Compare strategies on every size (default: phases with "
                               "more than 64 sizes are compared on 24 of them; the prediction is always exact)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Build and print the summary; write nothing."),
    check: bool = typer.Option(False, "--check", help="Build in memory and compare with the file; exit 1 on drift."),
    force: bool = typer.Option(False, "--force", help="Replace an output file that holds a plan built by another "
                               "command (default: refuse, so a what-if build never clobbers a checked-in plan)."),
) -> None:
    """Build a capture plan from the spec, rules and gates."""
    from planner.build import BuildOptions, build_plan, check_plan, output_path, write_plan
    from planner.render import summary

    opts = BuildOptions(backend=backend, ci=ci, spec=spec, speculative=speculative, max_bs=max_bs, tp=tp,
                        allocator=allocator, trace=trace, strategies=tuple(strategy), output=output, exact=exact)
    path = output_path(opts)
    if check:
        check_plan(opts)
        typer.echo(f"{path}: up to date")
        return
    plan = build_plan(opts)
    if not dry_run:
        write_plan(opts, plan, force=force)
    typer.echo(summary(plan, f"{path}{' (dry run, not written)' if dry_run else ''}"))
