"""The options that say what a build plans, shared by ``planner build`` and ``planner sizes``.

:func:`build_inputs` adds them to a command (one definition, one help text each) and
hands the command one ``build`` argument, a :class:`capture_plan.planner.inputs.build_options.BuildOptions`,
made when the command runs (``planner --help`` imports no planner module).
:func:`size_choice` adds the options that choose capture sizes for a traffic
(``planner sizes``, and ``planner build --sizes auto``).
"""

from __future__ import annotations

import functools

import click

from ._common import PATH, option

__all__ = ["build_inputs", "size_choice", "BackendOption", "complete", "complete_backend", "BUILD_INPUTS"]

#: the parameters :func:`build_inputs` adds, folded into the command's ``build`` argument
BUILD_INPUTS = ("backend", "ci", "spec", "speculative", "preset", "max_bs", "tp", "allocator", "trace", "calibration")
#: the parameters :func:`size_choice` adds
SIZE_CHOICE = ("traffic", "phases", "max_size", "metric", "timing", "device", "context", "budget_mib", "max_graphs")


def complete_backend(incomplete: str) -> list[str]:
    from capture_plan.planner.inputs.resources import backend_names

    return [n for n in backend_names() if n.startswith(incomplete)]


def complete(what: str, incomplete: str) -> list[str]:
    """Values of --speculative (presets.toml's [speculative] tables), --preset
    (capture_plan.planner.inputs.specs.preset_names) or --allocator (capture_plan.schemas.strategy)."""
    if what == "speculative":
        from capture_plan.planner.inputs.specs import speculative_names as names
    elif what == "preset":
        from capture_plan.planner.inputs.specs import preset_names as names
    else:
        from capture_plan.schemas.strategy import allocator_modes as names
    return [n for n in names() if n.startswith(incomplete)]


class BackendOption(click.Option):
    """``--backend``: its help names the backends of planner/data/backends.toml,
    read only when the help is shown (``planner --help`` reads no data)."""

    def get_help_record(self, ctx: click.Context):
        from capture_plan.planner.inputs.resources import backend_names

        self.help = f"Attention backend: {', '.join(backend_names())} (planner/data/backends.toml)."
        return super().get_help_record(ctx)


def percent(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
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


_INPUTS = [
    option(
        "--backend",
        "-b",
        "backend",
        cls=BackendOption,
        required=True,
        metavar="str",
        help="",
        shell_complete=lambda ctx, param, incomplete: complete_backend(incomplete),
    ),
    option("--ci", is_flag=True, help="Apply the CI-only gates."),
    option("--spec", type=PATH, metavar="path", help="Spec file (TOML or JSON); default: the embedded spec."),
    option(
        "--speculative",
        metavar="str",
        help="Add speculative phases: eagle.",
        shell_complete=lambda ctx, param, incomplete: complete("speculative", incomplete),
    ),
    option(
        "--preset",
        metavar="str",
        help="Another engine's conventions for the embedded spec: vllm (planner/data/presets_vllm.toml); "
        "default SGLang's.",
        shell_complete=lambda ctx, param, incomplete: complete("preset", incomplete),
    ),
    option(
        "--max-bs",
        type=int,
        metavar="int",
        help="Largest capture size of the embedded spec [256; --preset vllm: 512 tokens].",
    ),
    option("--tp", type=int, metavar="int", help="Tensor-parallel size (per-rank memory and step time)."),
    option(
        "--allocator",
        metavar="str",
        help="native or expandable segments.",
        shell_complete=lambda ctx, param, incomplete: complete("allocator", incomplete),
    ),
    option(
        "--trace",
        type=PATH,
        metavar="path",
        help="Allocation trace for exact predictions: "
        "capture_plan.executor.profile's JSON, or a torch.cuda.memory._dump_snapshot pickle.",
    ),
    option(
        "--calibration",
        type=PATH,
        metavar="path",
        help="Capture report measured on the device (GraphSet.write_report): the plan's measured device items "
        "(graph memory outside the pool).",
    ),
]


def build_inputs(fn):
    """Add the build-input options to a click command; the command gets them as one
    ``build`` argument (a BuildOptions with only these fields set)."""

    @functools.wraps(fn)
    def run(**kw):
        from capture_plan.planner.inputs.build_options import BuildOptions

        return fn(build=BuildOptions(**{k: kw.pop(k) for k in BUILD_INPUTS}), **kw)

    for opt in reversed(_INPUTS):
        run = opt(run)
    return run


def size_choice(*, traffic_required: bool):
    """The options that choose capture sizes for a traffic (planner/sizes.py's SizesOptions)."""
    opts = [
        option(
            "--traffic",
            type=PATH,
            required=traffic_required,
            metavar="path",
            help="Batch sizes the engine ran: size,count CSV (or phase,size,count), JSON {PHASE: {SIZE: COUNT}}, "
            "or a Prometheus scrape holding vllm:iteration_tokens_total.",
        ),
        option(
            "--phase",
            "phases",
            multiple=True,
            metavar="list[str]",
            help="The phase(s) traffic that names none is for (repeatable) [every phase].",
        ),
        option(
            "--metric",
            metavar="str",
            help="The histogram to read from a Prometheus scrape (it counts tokens per step) "
            "[vllm:iteration_tokens_total].",
        ),
        option(
            "--max-size",
            type=int,
            metavar="int",
            help="The largest batch the engine schedules, always captured [the spec's largest size].",
        ),
        option(
            "--timing",
            type=PATH,
            metavar="path",
            help="Capture report with replay times (capture_plan.executor.timing.time_replays): measured step time "
            "per size [a roofline].",
        ),
        option("--device", metavar="str", help="Device of the roofline (planner/data/devices.toml) [NVIDIA H200]."),
        option(
            "--context",
            type=int,
            metavar="int",
            help="Tokens of KV cache each request reads, for the roofline [1024].",
        ),
        option(
            "--budget-mib",
            type=float,
            metavar="float",
            help="Graph memory allowed: the device total with --calibration, else pool and hoisted "
            "[the spec's budget_mib].",
        ),
        option(
            "--max-graphs", type=int, metavar="int", help="At most this many sizes per phase [as many as the spec has]."
        ),
        option(
            "--max-padding",
            callback=percent,
            metavar="percent",
            help="Choose the fewest sizes that pad at most this much of the step time (e.g. 1%).",
        ),
    ]

    def add(fn):
        for opt in reversed(opts):
            fn = opt(fn)
        return fn

    return add
