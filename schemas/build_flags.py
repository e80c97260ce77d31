"""The options of ``planner build``, one row each: the one table a build option lives in.

A row names the option's field (in ``capture_plan.planner.inputs.build_options.BuildOptions``,
a size-choice option in its nested ``SizeChoiceOptions``, and in
:class:`capture_plan.schemas.plan.BuildRecord`), its flag (what a recorded command spells),
its kind (how the command writes and reads its value) and its help text. From it are made:
the click options of ``planner build`` and ``planner sizes`` (planner/cli/_build_inputs.py;
the click details a kind does not say, such as shell completion, are that module's), the
plan's record of a build and its command text (:data:`capture_plan.schemas.plan.BUILD_FLAGS`,
``record_command``), and the options read back from either (planner/inputs/build_options.py).
``tests/test_build_options_table.py`` checks the table against ``BuildOptions``,
``BuildRecord`` and both commands.

Plain Python (no msgspec): ``planner --help`` imports the command modules, which make their
options from it. A new build option is a row here, a field of ``BuildOptions`` and of
``BuildRecord``, and its meaning in the pipeline.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["BuildFlag", "BUILD_OPTIONS", "SIZE_CHOICE", "BUILD_INPUTS"]


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


#: every option of ``planner build``, in the order a recorded command lists them (``backend``
#: first: the command always names it)
BUILD_OPTIONS: tuple[BuildFlag, ...] = (
    BuildFlag("backend", "--backend", "text", "Attention backend: {backends} (planner/data/backends.toml).", "-b"),
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
        "max_bs", "--max-bs", "int", "Largest capture size of the embedded spec [256; --preset vllm: 512 tokens]."
    ),
    BuildFlag("tp", "--tp", "int", "Tensor-parallel size (per-rank memory and step time)."),
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
    ),
    BuildFlag(
        "timing",
        "--timing",
        "path",
        "Capture report with replay times (capture_plan.executor.timing.time_replays): measured step time "
        "per size [a roofline].",
    ),
    BuildFlag("device", "--device", "text", "Device of the roofline (planner/data/devices.toml) [NVIDIA H200]."),
    BuildFlag("context", "--context", "int", "Tokens of KV cache each request reads, for the roofline [1024]."),
    BuildFlag(
        "budget_mib",
        "--budget-mib",
        "float",
        "Graph memory allowed: the device total with --calibration, else pool and hoisted [the spec's budget_mib].",
    ),
    BuildFlag("max_graphs", "--max-graphs", "int", "At most this many sizes per phase [as many as the spec has]."),
    BuildFlag(
        "max_padding",
        "--max-padding",
        "float",
        "Choose the fewest sizes that pad at most this much of the step time (e.g. 1%).",
    ),
    BuildFlag("output", "-o", "path", "Plan path [plans/<backend>[-...][-ci].json].", "--output"),
)

#: the options that say what a build plans (``planner build`` and ``planner sizes`` take them)
BUILD_INPUTS = ("backend", "ci", "spec", "speculative", "preset", "max_bs", "tp", "allocator", "trace", "calibration")
#: the options that choose sizes for a traffic (``planner sizes``, ``planner build --sizes auto``):
#: ``sizes`` ("auto"), then the fields of ``SizeChoiceOptions``
SIZE_CHOICE = (
    "sizes",
    "traffic",
    "traffic_phases",
    "metric",
    "max_size",
    "timing",
    "device",
    "context",
    "budget_mib",
    "max_graphs",
    "max_padding",
)
