"""``planner sizes``: the capture sizes for a traffic, on the front of padding, memory and start-up."""

from __future__ import annotations

import click

from ._build_inputs import CHOICE, INPUTS, build_options
from ._common import OUTPUT, Command, option


@click.command("sizes", cls=Command)
@build_options(
    *INPUTS,
    *((f, {"required": True}) if f == "traffic" else f for f in CHOICE),
    option("--upto", type=int, metavar="int", help="The front's largest count of sizes [64, or the spec's count]."),
    option("--all", "every", is_flag=True, help="Print every count of sizes on the front, not a selection."),
    option(
        "--write-spec",
        type=OUTPUT,
        metavar="path",
        help="Write the spec with the chosen sizes (TOML) to build with planner build --spec.",
    ),
    option("--plot", type=OUTPUT, metavar="path", help="Also draw the front to this PNG (or .svg); needs matplotlib."),
)
def command(given, upto, every, write_spec, plot) -> None:
    """Choose the capture sizes for a traffic, within a memory budget.

    Prints, per phase the traffic names, the best list of each count of sizes (the front: expected
    padding in % of step time against graph memory and capture count), the spec's list and SGLang's
    and vLLM's defaults priced alike, and the chosen list; --write-spec writes a spec with it."""
    from capture_plan.planner.inputs.build_options import from_flat, retry_fix, sizes_run, without_size_choice
    from capture_plan.planner.sizes.command import choose_sizes
    from capture_plan.planner.sizes.output import render, write_spec as write
    from capture_plan.planner.sizes.sizes import SizesOptions
    from capture_plan.schemas.errors import CapturePlanError

    build = from_flat({**given, "sizes": "auto"})
    assert build.sizes is not None  # --traffic is required
    opts = SizesOptions(build=without_size_choice(build), choice=build.sizes, upto=upto, every=every)
    if plot is not None:  # before computing: a refused --plot is one line, nothing printed
        from capture_plan.planner.report.plot import check_plot_path

        check_plot_path(plot)
    own = [*(("--upto", str(upto)) if upto is not None else ()), *(("--all",) if every else ())]
    own += [w for flag, path in (("--write-spec", write_spec), ("--plot", plot)) if path for w in (flag, str(path))]
    with sizes_run(build.sizes, own):  # a refusal's command is this planner sizes command, changed
        try:
            res = choose_sizes(opts)
        except CapturePlanError as err:
            retry_fix(err, build)  # a size-choice option that would pass: the command with it
            raise
    text = render(res)
    if plot is not None:
        from capture_plan.planner.report.size_plot import plot_front

        plot_front(res, plot)
        text += f"wrote {plot}\n"
    if write_spec is not None:
        cmd = write(res, opts, write_spec)
        text += f"wrote {write_spec}; build its plan with `{cmd}`\n"
    click.echo(text, nl=False)
