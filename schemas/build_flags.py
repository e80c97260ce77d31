"""The options of ``planner build``, one row each: the one table a build option lives in.

A row names the option's field (in ``capture_plan.planner.inputs.build_options.BuildOptions``,
a size-choice option in its nested ``SizeChoiceOptions``, and in
:class:`capture_plan.schemas.plan.BuildRecord`), its flag (what a recorded command spells),
its kind (how the command writes and reads its value), its help text, its bounds and whether
it is required. From it are made: the click options of ``planner build`` and ``planner sizes``
(planner/cli/_build_inputs.py; the click details a kind does not say, such as shell
completion, are that module's), the plan's record of a build (``BuildRecord``: one field per
row, its type, bounds and default the row's) and its command text
(:data:`capture_plan.schemas.plan.BUILD_FLAGS`, ``record_command``), and the options read back
from either (planner/inputs/build_options.py). ``tests/test_build_options_table.py`` checks
the table against ``BuildOptions``, the record and both commands.

Plain Python (no msgspec): ``planner --help`` imports the command modules, which make their
options from it. A new build option is a row here, a field of ``BuildOptions``, and its
meaning in the pipeline.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, cast

__all__ = [
    "Bounds",
    "BuildFlag",
    "BUILD_OPTIONS",
    "BUILD_FLAG",
    "SIZE_CHOICE",
    "BUILD_INPUTS",
    "out_of_bounds",
    "msgspec_bounds",
    "option_meta",
]


class Bounds(NamedTuple):
    """The values an option accepts: from ``lo`` to ``hi`` (None: unbounded on that side;
    ``*_open``: the bound itself excluded), and what a value outside them is told. A bound
    may name a constant of :mod:`capture_plan.schemas.limits` ("MAX_BS"), read when used, so
    that this table stays plain Python. The one bound of its option: the commands' checks
    (``--tp``'s in ``check_tp``), :class:`~capture_plan.schemas.plan.BuildRecord`'s field and
    the spec's field of the same name read it (:func:`out_of_bounds`, :func:`msgspec_bounds`)."""

    lo: float | str | None
    hi: float | str | None
    lo_open: bool = False
    hi_open: bool = False
    #: what a value below ``lo`` (or not a number) is told; ``{v}`` the value, ``{lo}``, ``{hi}``
    below: str = ""
    #: what a value above ``hi`` is told (default: ``below``'s text)
    above: str = ""
    #: what an infinite or NaN value is told (default: as any other value out of range)
    nonfinite: str = ""

    def limits(self) -> tuple[float | None, float | None]:
        """(lo, hi) with named constants read from :mod:`capture_plan.schemas.limits`."""
        return _value(self.lo), _value(self.hi)


def _value(bound: float | str | None) -> float | None:
    if not isinstance(bound, str):
        return bound
    from . import limits  # only when a named bound is used: `planner --help` imports no msgspec

    return getattr(limits, bound)


class BuildFlag(NamedTuple):
    """One option of ``planner build``."""

    field: str
    #: the flag as a recorded command spells it
    flag: str
    #: "switch" (a flag alone, when true), "repeat" (the flag once per item), "path" (a path;
    #: relative to the plan's folder in its record), "int", "float" or "text" (one value)
    kind: str
    help: str
    #: the flag's other spelling, if any (``-b``; ``--output`` beside ``-o``)
    other: str = ""
    #: the values it accepts (None: any its type holds)
    bounds: Bounds | None = None
    #: every command and record names it (``backend``); else it may be left out, as its default
    required: bool = False

    @property
    def type(self) -> type:
        """The Python type of one value (a repeat's items; a path's as the record spells it)."""
        return _TYPES[self.kind]

    @property
    def default(self) -> object:
        """Its value when not given: False for a switch, none for a repeat, else None (the
        spec's, the preset's or the command's own default: each row's help says which)."""
        return {"switch": False, "repeat": ()}.get(self.kind)


_TYPES: dict[str, type] = {"switch": bool, "repeat": str, "path": str, "int": int, "float": float, "text": str}


#: every option of ``planner build``, in the order a recorded command lists them (``backend``
#: first: the command always names it)
BUILD_OPTIONS: tuple[BuildFlag, ...] = (
    BuildFlag(
        "backend",
        "--backend",
        "text",
        "Attention backend: {backends} (planner/data/backends.toml).",
        "-b",
        required=True,
    ),
    BuildFlag("ci", "--ci", "switch", "Apply the CI-only gates."),
    BuildFlag("spec", "--spec", "path", "Spec file (TOML or JSON); default: the embedded spec."),
    BuildFlag("speculative", "--speculative", "text", "Add speculative phases: eagle."),
    BuildFlag(
        "preset",
        "--preset",
        "text",
        "Another engine's conventions: vllm (planner/data/presets_vllm.toml): its phases and sizes for the embedded "
        "spec's model, or for --spec's; default SGLang's.",
    ),
    BuildFlag(
        "max_bs",
        "--max-bs",
        "int",
        "Largest capture size of the embedded spec [256; --preset vllm: 512 tokens].",
        bounds=Bounds(1, "MAX_BS", below="must be {lo:g}..{hi:g}, got {v}"),
    ),
    BuildFlag(
        "tp",
        "--tp",
        "int",
        "Tensor-parallel size (per-rank memory and step time).",
        bounds=Bounds(1, "MAX_TP", below="must be {lo:g}..{hi:g}, got {v}"),
    ),
    BuildFlag("allocator", "--allocator", "text", "native or expandable segments."),
    BuildFlag(
        "trace",
        "--trace",
        "path",
        "Allocation trace for exact predictions: "
        "capture_plan.executor.profile's JSON, or a torch.cuda.memory._dump_snapshot pickle.",
    ),
    BuildFlag(
        "calibration",
        "--calibration",
        "path",
        "Capture report measured on the device (GraphSet.write_report): the plan's measured device items "
        "(graph memory outside the pool).",
    ),
    BuildFlag(
        "exact",
        "--exact",
        "switch",
        "Compare strategies on every size (default: phases with more than 64 sizes "
        "are compared on 24 of them; the prediction is always exact).",
    ),
    BuildFlag("strategies", "--strategy", "repeat", "Pin a choice: AXIS=VALUE or PHASE.AXIS=VALUE (repeatable).", "-s"),
    BuildFlag(
        "sizes",
        "--sizes",
        "text",
        "auto: capture the sizes chosen for --traffic (as planner sizes chooses them) instead of the spec's.",
    ),
    BuildFlag(
        "traffic",
        "--traffic",
        "path",
        "Batch sizes the engine ran: size,count CSV (or phase,size,count; columns named in a header in any "
        "order; one size a line, each a step; , ; or tab), JSON {PHASE: {SIZE: COUNT}}, "
        "or a Prometheus scrape holding vllm:iteration_tokens_total.",
    ),
    BuildFlag(
        "traffic_phases", "--phase", "repeat", "The phase(s) traffic that names none is for (repeatable) [every phase]."
    ),
    BuildFlag(
        "metric",
        "--metric",
        "text",
        "The histogram to read from a Prometheus scrape (it counts tokens per step) [vllm:iteration_tokens_total].",
    ),
    BuildFlag(
        "max_size",
        "--max-size",
        "int",
        "The largest batch the engine schedules, always captured [the spec's largest size].",
        bounds=Bounds(1, "MAX_BS", below="must be {lo:g}..{hi:g}, got {v}"),
    ),
    BuildFlag(
        "timing",
        "--timing",
        "path",
        "Capture report with replay times (capture_plan.executor.timing.time_replays): measured step time "
        "per size [a roofline].",
    ),
    BuildFlag(
        "device",
        "--device",
        "text",
        "The target device (torch's name, or words of exactly one: H100; planner/data/fit_devices.toml, "
        "devices.toml [roofline]): the plan's device items estimated for it "
        "(graph-exec from the bench's nodes per layer; without --calibration), and the roofline of --sizes auto "
        "[no device items; roofline NVIDIA H200].",
    ),
    BuildFlag(
        "engine",
        "--engine",
        "text",
        "The engine release the plan is deployed with (ENGINE==VERSION, as planner fit takes it): the plan's graph "
        "memory priced in KV tokens on --device (or the calibration's) by that release's sizing rule, recorded for "
        "explain, diff --fail-above-kv-tokens and --min-kv-tokens [none].",
    ),
    BuildFlag(
        "engine_flags",
        "--engine-flag",
        "repeat",
        "One of --engine's own settings as NAME=VALUE, under the engine's flag name as planner fit takes it (e.g. "
        "gpu-memory-utilization=0.9, max-model-len=8192; repeatable) [the release's defaults].",
    ),
    BuildFlag(
        "context",
        "--context",
        "int",
        "Tokens of KV cache each request reads, for the roofline [1024].",
        # the planner's bound; planner sizes also bounds it by the model config's window
        bounds=Bounds(1, "MAX_CONTEXT", below="must be 1..{hi:,.0f}, the planner's bound, got {v}"),
    ),
    BuildFlag(
        "budget_mib",
        "--budget-mib",
        "float",
        "Graph memory allowed: the device total with --calibration, else pool and hoisted [the spec's budget_mib].",
        bounds=Bounds(
            0,
            "MAX_MIB",
            lo_open=True,
            hi_open=True,
            below="must be more than 0 MiB, got {v:g}",
            above="must be below 2**30 MiB (1 PiB, more than any device holds), got {v:g}",
            nonfinite="must be a finite number of MiB, got {v:g}",
        ),
    ),
    BuildFlag(
        "max_graphs",
        "--max-graphs",
        "int",
        "At most this many sizes per phase [as many as the spec has].",
        bounds=Bounds(1, None, below="must be {lo:g} or more, got {v}"),
    ),
    BuildFlag(
        "max_padding",
        "--max-padding",
        "float",
        "Choose the fewest sizes that pad at most this much of the step time (e.g. 1%).",
        bounds=Bounds(0, 1e6, hi_open=True, below="must be a percentage from 0 to below 1e6, got {v:g}"),
    ),
    BuildFlag(
        "min_kv_tokens",
        "--min-kv-tokens",
        "int",
        "The fewest KV tokens the chosen sizes may leave on the device under --engine (planner fit's rule with the "
        "lists' graph memory), beside the memory budget [no floor].",
        bounds=Bounds(1, "MAX_INT", below="must be 1..{hi:.0f} tokens, got {v}"),
    ),
    BuildFlag("output", "-o", "path", "Plan path [plans/<backend>[-...][-ci].json].", "--output"),
)

#: each option's row, by its field
BUILD_FLAG: dict[str, BuildFlag] = {row.field: row for row in BUILD_OPTIONS}


def out_of_bounds(field: str, value: float | None) -> str | None:
    """What ``value`` of option ``field`` is told when its row's bounds refuse it (None: the
    value is accepted, or not given)."""
    bounds = BUILD_FLAG[field].bounds
    if bounds is None or value is None:
        return None
    lo, hi = bounds.limits()
    text = {"v": value, "lo": lo, "hi": hi}
    if bounds.nonfinite and not math.isfinite(value):
        return bounds.nonfinite.format(**text)
    # written so that NaN is outside: every comparison with it is false
    if lo is not None and not (lo < value if bounds.lo_open else lo <= value):
        return bounds.below.format(**text)
    if hi is not None and not (value < hi if bounds.hi_open else value <= hi):
        return (bounds.above or bounds.below).format(**text)
    return None


def msgspec_bounds(field: str) -> dict[str, float]:
    """Option ``field``'s bounds as ``msgspec.Meta`` keywords (``gt``, ``ge``, ``lt``, ``le``):
    what a record's or a spec's field of that option declares."""
    bounds = BUILD_FLAG[field].bounds
    if bounds is None:
        return {}
    lo, hi = bounds.limits()
    out: dict[str, float] = {}
    if lo is not None:
        out["gt" if bounds.lo_open else "ge"] = lo
    if hi is not None:
        out["lt" if bounds.hi_open else "le"] = hi
    return out


def option_meta(field: str) -> Any:
    """Option ``field``'s bounds as one ``msgspec.Meta``: what the plan's record of the option
    and a spec's field of the same name declare (msgspec imported here only: the struct
    modules that call this import it anyway)."""
    import msgspec

    # Meta's overloads take one lower and one upper keyword, as msgspec_bounds gives
    return cast(Any, msgspec.Meta)(**msgspec_bounds(field))


#: the options that say what a build plans (``planner build`` and ``planner sizes`` take them)
BUILD_INPUTS = (
    "backend",
    "ci",
    "spec",
    "speculative",
    "preset",
    "max_bs",
    "tp",
    "allocator",
    "trace",
    "calibration",
    "device",
    "engine",
    "engine_flags",
)
#: the options that choose sizes for a traffic (``planner sizes``, ``planner build --sizes auto``):
#: ``sizes`` ("auto"), then the fields of ``SizeChoiceOptions``
SIZE_CHOICE = (
    "sizes",
    "traffic",
    "traffic_phases",
    "metric",
    "max_size",
    "timing",
    "context",
    "budget_mib",
    "max_graphs",
    "max_padding",
    "min_kv_tokens",
)
