"""``planner sizes``: the capture sizes for a traffic, on the front of padding, memory and start-up."""

from __future__ import annotations

import click

from ._common import OUTPUT, PATH, Command, option
from .build import _BackendOption, _complete, _complete_backend


def _percent(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    """``5``, ``5%`` or ``0.5%``: a percentage of step time."""
    if value is None:
        return None
    from capture_plan.schemas.errors import InputError

    try:
        return float(value.strip().removesuffix("%"))
    except ValueError:
        raise InputError(
            f"{value!r} is not a percentage", where="--max-padding", fix="give a number of percent, e.g. 2%"
        ) from None


@click.command("sizes", cls=Command)
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
@option(
    "--traffic",
    type=PATH,
    required=True,
    metavar="path",
    help="Batch sizes the engine ran: size,count CSV (or phase,size,count), JSON {PHASE: {SIZE: COUNT}}, "
    "or a Prometheus scrape holding vllm:iteration_tokens_total.",
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
    help="Another engine's conventions for the embedded spec: vllm.",
    shell_complete=lambda ctx, param, incomplete: _complete("preset", incomplete),
)
@option("--max-bs", type=int, metavar="int", help="Largest capture size of the embedded spec.")
@option("--tp", type=int, metavar="int", help="Tensor-parallel size (per-rank memory and step time).")
@option(
    "--allocator",
    metavar="str",
    help="native or expandable segments.",
    shell_complete=lambda ctx, param, incomplete: _complete("allocator", incomplete),
)
@option("--trace", type=PATH, metavar="path", help="Allocation trace for exact graph memory (as planner build).")
@option(
    "--calibration",
    type=PATH,
    metavar="path",
    help="Capture report measured on the device: the device total of every list (as planner build).",
)
@option(
    "--phase",
    "phases",
    multiple=True,
    metavar="list[str]",
    help="The phase(s) traffic that names none is for (repeatable) [every phase].",
)
@option(
    "--metric",
    default="vllm:iteration_tokens_total",
    show_default=True,
    metavar="str",
    help="The histogram to read from a Prometheus scrape (it counts tokens per step).",
)
@option(
    "--max-size",
    type=int,
    metavar="int",
    help="The largest batch the engine schedules, always captured [the spec's largest size].",
)
@option(
    "--timing",
    type=PATH,
    metavar="path",
    help="Capture report with replay times (capture_plan.executor.timing.time_replays): measured step time "
    "per size [a roofline].",
)
@option("--device", metavar="str", help="Device of the roofline (planner/data/devices.toml) [NVIDIA H200].")
@option(
    "--context",
    type=int,
    default=1024,
    show_default=True,
    metavar="int",
    help="Tokens of KV cache each request reads, for the roofline.",
)
@option(
    "--budget-mib",
    type=float,
    metavar="float",
    help="Graph memory allowed: the device total with --calibration, else pool and hoisted [the spec's budget_mib].",
)
@option("--max-graphs", type=int, metavar="int", help="At most this many sizes per phase [as many as the spec has].")
@option(
    "--max-padding",
    callback=_percent,
    metavar="percent",
    help="Choose the fewest sizes that pad at most this much of the step time (e.g. 1%).",
)
@option("--upto", type=int, metavar="int", help="The front's largest count of sizes [64, or the spec's count].")
@option("--all", "every", is_flag=True, help="Print every count of sizes on the front, not a selection.")
@option(
    "--write-spec",
    type=OUTPUT,
    metavar="path",
    help="Write the spec with the chosen sizes (TOML) to build with planner build --spec.",
)
@option("--plot", type=OUTPUT, metavar="path", help="Also draw the front to this PNG (or .svg); needs matplotlib.")
def command(
    backend,
    traffic,
    ci,
    spec,
    speculative,
    preset,
    max_bs,
    tp,
    allocator,
    trace,
    calibration,
    phases,
    metric,
    max_size,
    timing,
    device,
    context,
    budget_mib,
    max_graphs,
    max_padding,
    upto,
    every,
    write_spec,
    plot,
) -> None:
    """Choose the capture sizes for a traffic, within a memory budget.

    Prints, per phase the traffic names, the best list of each count of sizes (the front: expected
    padding in % of step time against graph memory and capture count), the spec's list and SGLang's
    and vLLM's defaults priced alike, and the chosen list; --write-spec writes a spec with it."""
    from capture_plan.planner.build import BuildOptions
    from capture_plan.planner.sizes import SizesOptions, choose_sizes, render, write_spec as write

    opts = SizesOptions(
        build=BuildOptions(
            backend=backend,
            ci=ci,
            spec=spec,
            speculative=speculative,
            preset=preset,
            max_bs=max_bs,
            tp=tp,
            allocator=allocator,
            trace=trace,
            calibration=calibration,
        ),
        traffic=traffic,
        phases=tuple(phases),
        max_size=max_size,
        metric=metric,
        timing=timing,
        device=device,
        context=context,
        budget_mib=budget_mib,
        max_graphs=max_graphs,
        max_padding=max_padding,
        upto=upto,
        every=every,
    )
    if plot is not None:  # before computing: a refused --plot is one line, nothing printed
        from capture_plan.planner.plot import check_plot_path

        check_plot_path(plot)
    res = choose_sizes(opts)
    text = render(res)
    if plot is not None:
        from capture_plan.planner.size_plot import plot_front

        plot_front(res, plot)
        text += f"wrote {plot}\n"
    if write_spec is not None:
        cmd = write(res, opts, write_spec)
        text += f"wrote {write_spec}; build its plan with `{cmd}`\n"
    click.echo(text, nl=False)
