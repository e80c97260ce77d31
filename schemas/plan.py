"""The plan file: the reviewed, checked-in capture schedule.

Evolution rule: these structs change only by adding fields with defaults, which
bumps ``PLAN_REVISION``; anything incompatible bumps ``PLAN_VERSION``. Readers
ignore unknown fields so an older executor can load a newer revision, but
refuses a newer version. Sizes are integers (bytes) so that a plan's bytes are
identical on every machine. Every number is bounded below (a count, a byte
count or a size: >= 0; capture sizes 1..``MAX_BS``; tp >= 1) by its type, which
``planner schema plan`` publishes; how steps, phases and edges fit together is
checked by :func:`capture_plan.schemas.plan_check.validate_plan`.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

from .build_flags import BUILD_OPTIONS, BuildFlag, option_meta
from .key_fields import KeyFields
from .limits import MAX_PIECES, AxisName, BatchSize, Label, NonNegative, NonNegativeFloat
from .strategy import (
    AXES,
    AllocatorMode,
    KeyOrder,
    OutputLifetime,
    Outputs,
    PhaseKind,
    StrategyAxes,
    WarmupKeeps,
)

__all__ = [
    "PlanStruct",
    "Strategy",
    "PhasePlan",
    "VariantAxis",
    "Step",
    "Edge",
    "Alternative",
    "Decision",
    "StepMemory",
    "TraceSamples",
    "Prediction",
    "KvCost",
    "Inputs",
    "Requires",
    "Plan",
    "PLAN_VERSION",
    "PLAN_REVISION",
    "StepOp",
    "BuildRecord",
    "DeviceCost",
    "DevicePrediction",
    "KeyPrediction",
    "KEYS_REVISION",
    "INPUTS_REVISION",
    "SIZES_REVISION",
    "KINDS_REVISION",
    "REUSE_REVISION",
    "Reuse",
    "PIECEWISE_BEFORE_KINDS_REVISION",
    "SizeWorth",
    "ListCost",
    "SizeChoice",
    "Provenance",
    "Fidelity",
    "DimensionSource",
    "ModelUsed",
    "record_command",
    "BUILD_FLAGS",
]

PLAN_VERSION = 1
#: 2: ``inputs.build`` (the build's options, what ``planner check`` rebuilds from),
#: ``predicted.device`` (every item of the free device memory capture takes) and
#: ``predicted.fidelity`` / ``describes`` / ``caveat`` (which model code the figures describe)
#: 3: graph keys (``PhasePlan.variants``/``pieces``/``micro_batches``/``warmup_keeps``,
#: ``Step.labels``/``pieces``/``keeps``, ``Strategy.key_order``, ``predicted.keys``, the
#: ``warmup-kept`` device item). A plan that uses none of them is written as revision 2
#: (the lowest revision it needs), so plans without graph keys keep their bytes.
#: 4: ``inputs.model`` (the model dimensions the prediction used and where each came from) and
#: ``inputs.rules`` (every rule the build applied, in one line each): every plan built since
#: records them, so every plan is written as revision 4 at least.
#: 5: sizes chosen for a traffic (``planner build --sizes auto``): ``inputs.traffic`` /
#: ``traffic_digest`` and ``predicted.sizes``. A plan without them stays revision 4.
#: 6: ``PhasePlan.piecewise``: the property of a phase's kind its consumer reads (the kinds are
#: the planner's data, planner/data/phase_kinds.toml, which the executor does not read). Left
#: out where false: only a plan with a piecewise phase is revision 6.
#: 7: ``PhasePlan.reuse``: the phase's graphs share instantiated executables where their
#: structure matches (``"exec-update"``). Left out where unset: only a plan that decides reuse is 7.
PLAN_REVISION = 7
#: the revision graph keys need (see PLAN_REVISION)
KEYS_REVISION = 3
#: the revision the model and rules records need (see PLAN_REVISION)
INPUTS_REVISION = 4
#: the revision sizes chosen for a traffic need (see PLAN_REVISION)
SIZES_REVISION = 5
#: the revision that records a phase kind's properties (see PLAN_REVISION)
KINDS_REVISION = 6
#: the revision that records executable reuse (see PLAN_REVISION)
REUSE_REVISION = 7
#: how a phase's graphs may share executables: "exec-update" (one instantiation per group of
#: structurally identical graphs, switched with cuGraphExecUpdate; capture_plan.executor.exec_update)
Reuse = Literal["exec-update"]
#: the piecewise kinds of the plans before :data:`KINDS_REVISION`, which did not record the
#: property: history, frozen (a kind added since records it in the plan)
PIECEWISE_BEFORE_KINDS_REVISION = frozenset({"piecewise"})

StepOp = Literal["provision", "warmup", "capture"]
#: tensor-parallel ranks, tokens per request
Positive = Annotated[int, msgspec.Meta(ge=1)]


# Subclasses repeat frozen=True: msgspec inherits it, but a type checker reads
# a dataclass_transform class without it as not frozen (and refuses that).
class PlanStruct(msgspec.Struct, frozen=True, kw_only=True):
    """Base of every plan type: immutable, keyword-only, lenient about unknown
    fields (forward compatibility across revisions)."""


class Strategy(PlanStruct, StrategyAxes, frozen=True, kw_only=True):
    """The choice on every strategy axis for one phase (the axes: schemas/strategy.py)."""

    #: the order of graph keys of a phase with variants (revision 3); UNSET elsewhere
    #: (and read as "size-major")
    key_order: KeyOrder | msgspec.UnsetType = msgspec.UNSET

    def label(self) -> str:
        keys = "" if self.key_order is msgspec.UNSET else f" key_order={self.key_order}"
        return " ".join(f"{ax}={getattr(self, ax)}" for ax in AXES) + keys


class VariantAxis(PlanStruct, frozen=True, kw_only=True):
    """One variant axis of a phase: its name and labels, in capture order (a list,
    not a table: canonical bytes sort a table's keys, and the axis order is what
    step ids and ``Step.labels`` follow)."""

    name: AxisName
    labels: Annotated[list[Label], msgspec.Meta(min_length=1)]


# The graph-key fields (micro_batches, ...) are KeyFields' (schemas/key_fields.py), copied
# from the spec's phase where it sets them (UNSET, left out of the file, elsewhere).
class PhasePlan(PlanStruct, KeyFields, frozen=True, kw_only=True):
    name: str
    kind: PhaseKind
    sizes: Annotated[list[BatchSize], msgspec.Meta(min_length=1)]
    tokens_per_request: Positive
    output_lifetime: OutputLifetime
    strategy: Strategy
    #: pool id the phase captures into ("shared" or "phase:<name>")
    pool: str
    #: bytes of the hoisted workspace buffer, 0 when the workspace stays in the pool
    hoisted_bytes: NonNegative = 0
    # Graph keys (revision 3); UNSET fields are left out of the file.
    #: variant axes in declared order: each capture size is captured once per
    #: combination of labels (one graph key each)
    variants: list[VariantAxis] | msgspec.UnsetType = msgspec.UNSET
    #: piece graphs per capture (piecewise phases whose spec says so)
    pieces: Annotated[int, msgspec.Meta(ge=1, le=MAX_PIECES)] | msgspec.UnsetType = msgspec.UNSET
    #: what the phase's warm-ups allocate that the engine keeps (their steps' ``keeps``)
    warmup_keeps: WarmupKeeps | msgspec.UnsetType = msgspec.UNSET
    # The kind's properties a plan's consumer reads (revision 6; left out where false).
    #: the phase's graphs are pieces between eagerly run attention ops (vLLM's PIECEWISE):
    #: ``capture()`` refuses it, and a capture records ``pieces`` piece graphs
    piecewise: bool | msgspec.UnsetType = msgspec.UNSET
    #: executable reuse (revision 7): graphs of the phase whose structure matches share one
    #: instantiated executable; UNSET (left out of the file): every graph its own
    reuse: Reuse | msgspec.UnsetType = msgspec.UNSET


class Step(PlanStruct, frozen=True, kw_only=True):
    """One executor action. ``id`` is unique and stable: ``<op>/<phase>/<bs>``, and
    for a phase with variants ``<op>/<phase>/<bs>/<axis>=<label>,...`` (every axis,
    in the phase's declared order: :func:`capture_plan.schemas.keys.step_id`)."""

    index: NonNegative
    id: str
    op: StepOp
    phase: str
    bs: BatchSize
    pool: str = ""
    stream: str = "capture"
    outputs: Outputs | None = None
    #: eager runs for a warm-up step
    runs: NonNegative = 0
    #: bytes for a provision step (hoisted workspace, allocated outside the pool)
    bytes: NonNegative = 0
    # Graph keys (revision 3); UNSET fields are left out of the file.
    #: the step's label on each of its phase's variant axes, in the phase's axis
    #: order (capture and warm-up steps of a phase with variants)
    labels: list[Label] | msgspec.UnsetType = msgspec.UNSET
    #: piece graphs the capture records (its phase's ``pieces``)
    pieces: Annotated[int, msgspec.Meta(ge=1, le=MAX_PIECES)] | msgspec.UnsetType = msgspec.UNSET
    #: bytes this warm-up allocates that the engine keeps past it, outside every pool
    #: (its phase's ``warmup_keeps``); the executor lets them survive the warm-up
    keeps: NonNegative | msgspec.UnsetType = msgspec.UNSET


class Edge(PlanStruct, frozen=True, kw_only=True):
    """An ordering constraint between two steps and the rule that added it."""

    src: str
    dst: str
    rule: str


class Alternative(PlanStruct, frozen=True, kw_only=True):
    """A strategy the optimizer considered for a phase, with its predicted cost."""

    strategy: Strategy
    pool_bytes: NonNegative
    feasible: bool
    #: rule ids it would break (empty when feasible)
    violates: list[str] = []


class Decision(PlanStruct, frozen=True, kw_only=True):
    """Why a phase got its strategy: the rule or constraint, the choice, the reason."""

    phase: str
    rule: str
    constraint: str
    choice: str
    why: str
    alternatives: list[Alternative] = []
    #: sizes of the phase the alternatives were simulated on (fewer than the
    #: phase has: their bytes are screening estimates); 0 when not applicable
    sizes_compared: NonNegative = 0


class StepMemory(PlanStruct, frozen=True, kw_only=True):
    """Predicted pool state right after a step (bytes, all graph pools together)."""

    step: NonNegative
    reserved: NonNegative
    allocated: NonNegative


class TraceSamples(PlanStruct, frozen=True, kw_only=True):
    """Where a trace-based prediction's sizes of one phase came from."""

    #: planned sizes whose captures were recorded
    measured: list[BatchSize]
    #: planned sizes derived from the recorded ones (planner/memory/fitting.py)
    derived: list[BatchSize] = []


#: where a device item's figure comes from: the allocator simulation, the planner's
#: data (planner/data/devices.toml), a report measured on a named device, an estimate for a
#: device named without a report (``planner build --device``: graph-exec from node counts per
#: layer of the committed bench, planner/memory/graph_nodes.py), or nowhere yet
Provenance = Literal["simulated", "data", "measured", "unknown", "estimated"]
#: which model code the prediction describes: "recorded" (a trace of the model that is
#: captured: exact for it), "reference" (capture-plan's reference decode step and its
#: speculative phases, capture_plan.references.decode / capture_plan.references.speculative: exact for those), or
#: "approximate" (the reference's figures for a model it does not implement: a model
#: config.json that an engine or library implements its own way, or MoE dimensions)
Fidelity = Literal["recorded", "reference", "approximate"]


class DeviceCost(PlanStruct, frozen=True, kw_only=True, omit_defaults=True):
    """One item of the free device memory capture takes."""

    #: "pool", "hoisted", "stream-workspace", "allocator-other", "graph-exec", or
    #: "warmup-kept" (revision 3: what warm-ups allocate that the engine keeps)
    name: str
    #: None: unknown (never measured for this device): never read as zero
    bytes: NonNegative | None = None
    provenance: Provenance
    #: where the figure comes from, or how to get it when unknown
    source: str = ""


class KeyPrediction(PlanStruct, frozen=True, kw_only=True, omit_defaults=True):
    """The prediction for one graph key (one capture step), revision 3."""

    #: the capture step's id
    step: str
    #: bytes the key's graph (all its pieces) takes in a pool of its own, captured alone
    graph_bytes: NonNegative
    #: the pool's growth when this key is captured in the plan's order (0: it fit in
    #: what earlier captures left)
    added_bytes: NonNegative
    #: per piece of a piecewise capture: the bytes each piece graph keeps in the pool
    #: (its outputs and what it leaves allocated), in capture order; empty otherwise
    pieces: list[NonNegative] = []
    #: bytes its warm-up keeps outside the pool (the warm-up step's ``keeps``)
    kept_bytes: NonNegative = 0
    #: which model code the key's figures describe: "approximate" for a label the
    #: reference does not model (LoRA layers) when no trace recorded the key
    fidelity: Fidelity


class DevicePrediction(PlanStruct, frozen=True, kw_only=True, omit_defaults=True):
    """What an engine must reserve for capture: the pool plus every other item."""

    #: the device, driver and torch the measured items were measured on ("" when none)
    device: str = ""
    items: list[DeviceCost] = []
    #: the sum of the items; None while any item is unknown
    total_bytes: NonNegative | None = None
    #: the most free memory capture takes at any moment (a warm-up's temporaries on top of
    #: the pools so far): what must be free before capture; left out while unknown
    peak_bytes: NonNegative | None = None


class SizeWorth(PlanStruct, frozen=True, kw_only=True, omit_defaults=True):
    """Why one chosen size is in its list (``planner build --sizes auto``)."""

    size: BatchSize
    #: steps of the traffic that run this size's graph (they are above the next smaller size)
    steps: NonNegativeFloat
    #: the padding (% of the phase's unpadded step time) the list would add without this size;
    #: None for the largest size, which is always captured (no step runs eagerly)
    padding_saved: NonNegativeFloat | None = None
    #: graph memory (pool and hoisted workspaces) of the list without this size, the other phases
    #: at their chosen lists: the size adds the choice's ``pool_bytes`` less this (the allocator's
    #: reuse can make that 0, or below 0)
    pool_bytes_without: NonNegative = 0
    #: the graph memory a plan built for a device prices (its device total, or the device items
    #: known, graph-exec included) without this size; None where the build names no device
    device_bytes_without: NonNegative | None = None
    #: the KV tokens ``--engine`` is left without this size (None: no engine named)
    kv_tokens_without: NonNegative | None = None


class ListCost(PlanStruct, frozen=True, kw_only=True, omit_defaults=True):
    """A list of sizes priced like the chosen one: the spec's own, an engine's default."""

    label: str
    sizes: list[BatchSize]
    #: expected padding, % of the unpadded step time
    padding: NonNegativeFloat
    #: pool and hoisted workspaces, simulated under the plan's schedule
    pool_bytes: NonNegative
    #: the device total, when the build is calibrated
    device_bytes: NonNegative | None = None
    #: the KV tokens ``--engine`` is left with this list (None: no engine named)
    kv_tokens: NonNegative | None = None


class SizeChoice(PlanStruct, frozen=True, kw_only=True, omit_defaults=True):
    """A phase's capture sizes as chosen for the traffic, and what they cost (revision 5)."""

    phase: str
    #: steps the traffic counts for the phase
    steps: NonNegativeFloat
    #: expected padding of the chosen list, % of the unpadded step time
    padding: NonNegativeFloat
    #: whether padding is approximate (a roofline, or step times interpolated between measured sizes)
    approximate: bool
    #: where step times came from
    step_time: str
    #: why this count of sizes: the limit that chose it
    why: str
    #: graph memory (pool and hoisted workspaces) with every phase at its chosen list, simulated
    #: under the plan's schedule: what each size's ``pool_bytes_without`` is against
    pool_bytes: NonNegative
    #: the device total with every phase at its chosen list, when the build is calibrated
    device_bytes: NonNegative | None = None
    #: what each size's ``device_bytes_without`` is against (the device total, or the device items
    #: known, graph-exec included), and the KV tokens ``--engine`` is left (each None: not named)
    graph_bytes: NonNegative | None = None
    kv_tokens: NonNegative | None = None
    #: every chosen size, ascending, and why it is in
    sizes: list[SizeWorth] = []
    #: other lists priced alike: the spec's, SGLang's and vLLM's defaults
    against: list[ListCost] = []
    #: how the traffic was read, where that is not exact (a histogram's buckets spread within themselves)
    notes: list[str] = []


class KvCost(PlanStruct, frozen=True, kw_only=True, omit_defaults=True):
    """The plan's graph memory in KV tokens under one engine release on one device
    (``planner build --engine``: planner fit's rule, planner/fit/kv_price.py)."""

    #: the release, device and settings priced: "vllm==0.34.0 on NVIDIA H100 80GB HBM3 (max-model-len=8192)"
    engine: str
    #: the graph figure priced (None: unknown), and what it is
    graph_bytes: NonNegative | None
    graph: str
    #: KV tokens the engine is left with the plan's graphs (None: unknown), and with none
    kv_tokens: NonNegative | None
    kv_tokens_without_graphs: NonNegative
    #: fit's one line where the engine would not start with the plan's graphs
    overflow: str = ""


class Prediction(PlanStruct, frozen=True, kw_only=True, omit_defaults=True):
    # omit_defaults: fields added later are left out of plans that do not use
    # them, so plans built before they existed keep their bytes and digest.
    #: "analytic" (model dimensions) or "trace" (recorded allocation trace)
    source: Literal["analytic", "trace"]
    allocator: AllocatorMode
    #: peak reserved bytes of all graph pools together
    pool_bytes: NonNegative
    pools: dict[str, NonNegative]
    #: largest pool a single graph needs captured alone
    largest_graph_bytes: NonNegative
    #: bytes hoisted out of the pools (persistent workspaces)
    hoisted_bytes: NonNegative
    #: what the baseline (engines' hard-coded loop) would take, for comparison
    baseline_bytes: NonNegative
    warmup_runs: NonNegative
    timeline: list[StepMemory]
    #: per phase, for a trace-based prediction: sizes measured and sizes derived
    samples: dict[str, TraceSamples] = {}
    #: every item of the free device memory capture takes (revision 2)
    device: DevicePrediction | None = None
    fidelity: Fidelity | None = None
    #: the model code the figures describe, in words
    describes: str = ""
    #: for an approximate prediction: how far off it was measured to be for the nearest
    #: benchmarked architecture, and the commands that make it exact
    caveat: str = ""
    #: per graph key (capture step), in step order, for a plan with graph keys (revision 3)
    keys: list[KeyPrediction] = []
    #: per phase whose sizes were chosen for a traffic, the choice and its figures (revision 5)
    sizes: list[SizeChoice] = []
    #: the graph memory in KV tokens, where the build names an engine (``--engine``)
    kv: KvCost | None = None


_BUILD_RECORD_DOC = """\
The options ``planner build`` was given (``capture_plan.planner.inputs.build_options.BuildOptions``), as
``planner check`` rebuilds the plan from them: paths relative to the plan's
own folder, ``output`` only the file name and only when it is not the
default one. The one record of a build (``command`` is its text)."""


def _recorded(row: BuildFlag) -> tuple:
    """``row``'s field of :class:`BuildRecord`, as its kind records it: a switch true or false,
    a repeat's items as a list, a path as text (relative to the plan's folder), any other
    value as given, each bounded by the row and left out where not given (its default)."""
    if row.required:
        return (row.field, row.type)
    if row.kind == "switch":
        return (row.field, bool, False)
    if row.kind == "repeat":
        return (row.field, list[row.type], [])
    value: Any = row.type
    if row.bounds is not None:
        value = Annotated[value, option_meta(row.field)]
    return (row.field, value | None, None)


if TYPE_CHECKING:  # what type checkers see of the struct made below: the backend, and any option by name

    class BuildRecord(PlanStruct, frozen=True, kw_only=True, omit_defaults=True):
        backend: str

        def __init__(self, **options: Any) -> None: ...
        def __getattr__(self, name: str) -> Any: ...

else:
    # one field per row of the table of build options (schemas/build_flags.py): its type, bounds
    # and default are the row's, written once there
    BuildRecord = msgspec.defstruct(
        "BuildRecord",
        [_recorded(row) for row in BUILD_OPTIONS],
        bases=(PlanStruct,),
        module=__name__,
        frozen=True,
        kw_only=True,
        omit_defaults=True,
    )
    BuildRecord.__doc__ = inspect.cleandoc(_BUILD_RECORD_DOC)


#: where a model dimension came from: the spec's ``[model]``, its config.json, the preset it
#: names (or the embedded default model), or the element size's default (bf16, float32 logits)
DimensionSource = Literal["spec", "config", "preset", "default"]


class ModelUsed(PlanStruct, frozen=True, kw_only=True, omit_defaults=True):
    """The model dimensions the prediction used and where each came from (revision 4;
    ``capture_plan.planner.inputs.dimensions``)."""

    name: str
    #: dimension -> value: layers, hidden, heads, kv_heads, head_dim, intermediate, vocab,
    #: dtype_bytes, logits_dtype_bytes, and the MoE fields when given
    dimensions: dict[str, NonNegative]
    #: dimension -> where its value came from
    sources: dict[str, DimensionSource]
    #: the preset that "preset" sources name ("" when none does)
    preset: str = ""
    #: dimension -> the config.json key(s) a "config" source was read from
    config_keys: dict[str, str] = {}
    #: phase -> the dimensions its own model sets (the spec's ``[phases.model]``, and the
    #: phase's ``layers`` when it sets them: a draft's one layer)
    phases: dict[str, dict[str, NonNegative]] = {}


#: every option of a :class:`BuildRecord` but ``backend``, as ``planner build`` takes it, in the
#: order a recorded command lists them: (field, flag, kind), the rows of the one table of build
#: options (:data:`capture_plan.schemas.build_flags.BUILD_OPTIONS`, which says the kinds).
#: capture_plan.planner.inputs.build_options writes and reads the command from it, and
#: :func:`record_command` writes its text.
BUILD_FLAGS: tuple[tuple[str, str, str], ...] = tuple(
    (o.field, o.flag, o.kind) for o in BUILD_OPTIONS if o.field != "backend"
)


def record_command(rec: BuildRecord) -> list[str]:
    """The ``planner build`` command a build record is the text of: what a plan's
    ``command`` must be when it records ``inputs.build`` (``capture_plan.planner.inputs.build_options``
    writes both from this; ``capture_plan.schemas.plan_check.validate_plan`` refuses a plan
    whose two disagree, since ``show``/``diff`` read the command and ``check`` rebuilds
    from the record). Flags in :data:`BUILD_FLAGS`' order."""
    cmd = ["planner", "build", "--backend", rec.backend]
    for field, flag, kind in BUILD_FLAGS:
        value = getattr(rec, field)
        if kind == "switch":
            cmd += [flag] if value else []
        elif kind == "repeat":
            for item in value:
                cmd += [flag, str(item)]
        elif isinstance(value, float):
            cmd += [flag, f"{value:.0f}" if value.is_integer() else repr(value)]
        elif value is not None:
            cmd += [flag, str(value)]
    return cmd


class Inputs(PlanStruct, frozen=True, kw_only=True):
    """Everything the plan was derived from, without absolute paths."""

    spec: str
    spec_digest: str
    rules_digest: str
    backend: str
    ci: bool
    speculative: str | None = None
    max_bs: Annotated[int, option_meta("max_bs")] | None = None
    tp: Positive = 1
    strategies: list[str] = []
    trace: str | None = None
    trace_digest: str | None = None
    #: the spec's model config.json (left out of the file when there is none)
    model_config: str | msgspec.UnsetType = msgspec.UNSET
    model_config_digest: str | msgspec.UnsetType = msgspec.UNSET
    #: a capture report whose device view calibrates the measured device items
    calibration: str | msgspec.UnsetType = msgspec.UNSET
    calibration_digest: str | msgspec.UnsetType = msgspec.UNSET
    #: the traffic the sizes were chosen for (``--sizes auto``): relative to the plan's folder, and
    #: the sha256 of its bytes (revision 5)
    traffic: str | msgspec.UnsetType = msgspec.UNSET
    traffic_digest: str | msgspec.UnsetType = msgspec.UNSET
    #: the build's options: what ``planner check`` rebuilds from (revision 2)
    build: BuildRecord | msgspec.UnsetType = msgspec.UNSET
    #: the model dimensions the prediction used and their sources (revision 4)
    model: ModelUsed | msgspec.UnsetType = msgspec.UNSET
    #: rule id -> what the rule says (``capture_plan.planner.inputs.rules.rule_text``): the built-in
    #: rules and the spec's, so a changed rule is read by name (revision 4)
    rules: dict[str, str] | msgspec.UnsetType = msgspec.UNSET


class Requires(PlanStruct, frozen=True, kw_only=True):
    """Environment the plan is valid for; checked by ``capture_plan.executor.load_plan``."""

    backend: str
    #: importable modules providing the backend's kernels (any one suffices)
    modules: list[str]
    #: [major, minor]
    min_compute_capability: Annotated[list[NonNegative], msgspec.Meta(min_length=2, max_length=2)] = msgspec.field(
        default_factory=lambda: [8, 0]
    )
    torch: str = ">=2.4"
    tp: Positive = 1


class Plan(PlanStruct, frozen=True, kw_only=True):
    version: NonNegative = PLAN_VERSION
    revision: NonNegative = PLAN_REVISION
    name: str
    #: the normalized command that rebuilds this exact file
    command: list[str]
    inputs: Inputs
    requires: Requires
    phases: list[PhasePlan]
    steps: list[Step]
    edges: list[Edge]
    decisions: list[Decision]
    predicted: Prediction
    #: "sha256:<hex>" over the canonical bytes with digest set to ""
    digest: str = ""
