"""The hand-written input: what to capture, for which model, under which rules.

Strict by design: unknown fields are rejected with their JSON path, so a typo
(``tokens_per_requst``) fails loudly instead of silently taking a default.
Every single-field bound is a msgspec constraint here, its number from
:mod:`capture_plan.schemas.limits` (so ``planner schema spec`` publishes it);
rules over several fields msgspec cannot express (duplicate sizes, unknown
phase references, heads a multiple of kv_heads, phase kinds and the settings
each accepts) live in :func:`capture_plan.planner.inputs.validate.validate_spec`.
"""

# No `from __future__ import annotations` here: msgspec reads a struct's annotations
# when it first converts to it, and an annotation kept as a string costs a compile()
# and an eval() there, for every spec type (the Quickstart build converts its embedded spec);
# evaluated with the class, they cost no more than that eval.

import inspect
from typing import TYPE_CHECKING, Annotated, Literal

import msgspec

from .build_flags import option_meta
from .key_fields import KeyFields
from .limits import (
    MAX_KEYS_PER_PHASE,
    MAX_LABELS_PER_AXIS,
    MAX_MIB,
    MAX_PHASES,
    MAX_PIECES,
    MAX_RULES,
    MAX_SIZES_PER_PHASE,
    MAX_TOKENS_PER_REQUEST,
    MAX_VARIANT_AXES,
    AxisName,
    BatchSize,
    Label,
    StreamName,
    dimension,
)
from .strategy import (
    AllocatorMode,
    ChoiceAxes,
    KeyOrder,
    OutputLifetime,
    PhaseKind,
    WarmupKeeps,
)

__all__ = [
    "SpecStruct",
    "Model",
    "PhaseModel",
    "PHASE_DIMENSIONS",
    "Phase",
    "When",
    "Choice",
    "Rule",
    "Spec",
    "Variants",
    "Pieces",
    "SPEC_VERSION",
    "phase_model",
]

SPEC_VERSION = 1

Positive = Annotated[int, msgspec.Meta(gt=0)]
#: tokens per request, draft steps, top-k: 1..MAX_TOKENS_PER_REQUEST
PerRequest = Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS_PER_REQUEST)]
#: library_mib: at most MAX_MIB (1 PiB)
MiBAmount = Annotated[float, msgspec.Meta(le=MAX_MIB)]
# each model dimension, 1..its MODEL_MAX bound
Layers = Annotated[int, dimension("layers")]
Hidden = Annotated[int, dimension("hidden")]
Heads = Annotated[int, dimension("heads")]
KvHeads = Annotated[int, dimension("kv_heads")]
HeadDim = Annotated[int, dimension("head_dim")]
Intermediate = Annotated[int, dimension("intermediate")]
Vocab = Annotated[int, dimension("vocab")]
DtypeBytes = Annotated[int, dimension("dtype_bytes")]
LogitsDtypeBytes = Annotated[int, dimension("logits_dtype_bytes")]
Experts = Annotated[int, dimension("experts")]
ExpertsPerToken = Annotated[int, dimension("experts_per_token")]
ExpertIntermediate = Annotated[int, dimension("expert_intermediate")]
SharedExpertIntermediate = Annotated[int, dimension("shared_expert_intermediate")]
# `$(?!\n)`: Python's `$` also matches before a trailing newline ("decode\n");
# the lookahead refuses that and reads the same in JSON Schema's dialect.
Name = Annotated[str, msgspec.Meta(pattern=r"^[a-z][a-z0-9_]*$(?!\n)", max_length=64)]
#: a phase's variant axes: axis name -> its labels, both in capture order (as written:
#: TOML and JSON tables keep their order). Which axes a phase kind can have is data
#: (planner/data/phase_kinds.toml ``axes``); labels unique per axis and the keys of a
#: phase (sizes x labels of every axis) at most MAX_KEYS_PER_PHASE are checked by
#: capture_plan.planner.inputs.validate.
Variants = Annotated[
    dict[AxisName, Annotated[list[Label], msgspec.Meta(min_length=1, max_length=MAX_LABELS_PER_AXIS)]],
    msgspec.Meta(
        min_length=1,
        max_length=MAX_VARIANT_AXES,
        extra_json_schema={"x-max-keys-per-phase": MAX_KEYS_PER_PHASE},
    ),
]
#: piece graphs per capture of a piecewise phase: a count, or "attention" (split at
#: every attention op: the phase's layers + 1 pieces, as vLLM's piecewise backend does)
Pieces = Annotated[int, msgspec.Meta(ge=1, le=MAX_PIECES)] | Literal["attention"]


# Subclasses repeat frozen=True: msgspec inherits it, but a type checker reads
# a dataclass_transform class without it as not frozen (and refuses that).
class SpecStruct(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Base of every spec type: strict, immutable, keyword-only."""


class Model(SpecStruct, frozen=True, kw_only=True):
    """Shape of the decoder whose decode step is captured (per tensor-parallel rank
    is derived from ``tp``; dimensions here are the full model's).

    A spec's ``[model]`` gives layers, hidden, heads, kv_heads, head_dim,
    intermediate and vocab, or names where those it leaves out come from:
    ``config`` (a Hugging Face config.json) or ``preset`` (``"llama-3-8b"``, the
    embedded default model); anything else is refused, naming the missing keys
    (``capture_plan.planner.inputs.dimensions``). The defaults below are that preset's,
    for specs built in code. ``dtype_bytes`` and ``logits_dtype_bytes`` left out
    are 2 and 4 (bf16 activations, float32 logits)."""

    name: str = "llama-3-8b"
    layers: Layers = 32
    hidden: Hidden = 4096
    heads: Heads = 32
    kv_heads: KvHeads = 8
    head_dim: HeadDim = 128
    intermediate: Intermediate = 14336
    vocab: Vocab = 128256
    #: bytes per activation element (bf16)
    dtype_bytes: DtypeBytes = 2
    #: bytes per logit element of the returned logits (float32)
    logits_dtype_bytes: LogitsDtypeBytes = 4
    # Fields below are UNSET unless given, and msgspec leaves UNSET fields out
    # of encoded specs: specs written before they existed keep their bytes.
    #: a Hugging Face config.json (relative to the spec file) giving the
    #: dimensions above; dimensions also listed here are refused as ambiguous
    config: str | msgspec.UnsetType = msgspec.UNSET
    #: a model preset giving the dimensions this table leaves out ("llama-3-8b")
    preset: str | msgspec.UnsetType = msgspec.UNSET
    #: mixture of experts: routed experts, experts per token, each expert's
    #: MLP width, and the shared expert's MLP width (Qwen2-MoE). Recorded for
    #: traces and reports; the analytic model does not model MoE routing.
    experts: Experts | msgspec.UnsetType = msgspec.UNSET
    experts_per_token: ExpertsPerToken | msgspec.UnsetType = msgspec.UNSET
    expert_intermediate: ExpertIntermediate | msgspec.UnsetType = msgspec.UNSET
    shared_expert_intermediate: SharedExpertIntermediate | msgspec.UnsetType = msgspec.UNSET


#: the dimensions a phase's own model may set (:class:`PhaseModel`): :class:`Model`'s, but
#: ``layers`` (the phase's own setting), its name, where it is read from and the MoE fields
PHASE_DIMENSIONS = (
    "hidden",
    "heads",
    "kv_heads",
    "head_dim",
    "intermediate",
    "vocab",
    "dtype_bytes",
    "logits_dtype_bytes",
)

_PHASE_MODEL_DOC = """Dimensions in which a phase's model differs from the spec's ``[model]``:
    a draft with its own hidden size or a smaller vocabulary (EAGLE-3 drafts
    have both). A field left out is the spec's. Layers are the phase's own
    ``layers`` setting, not repeated here. The analytic programs use these
    dimensions as they use ``[model]``'s; they do not model what is particular
    to a draft architecture (EAGLE-3's projection of three target hidden states
    into the draft, or a draft-to-target token map after the draft's top-k)."""

if TYPE_CHECKING:  # what type checkers see of the struct made below: any dimension, optional

    class PhaseModel(SpecStruct, frozen=True, kw_only=True):
        def __getattr__(self, name: str) -> int | msgspec.UnsetType: ...

else:
    # Model's fields, each optional (UNSET: the spec's): the dimensions are written out once,
    # in Model, with their types and bounds
    PhaseModel = msgspec.defstruct(
        "PhaseModel",
        [(f, Model.__annotations__[f] | msgspec.UnsetType, msgspec.UNSET) for f in PHASE_DIMENSIONS],
        bases=(SpecStruct,),
        module=__name__,
        frozen=True,
        kw_only=True,
    )
    PhaseModel.__doc__ = inspect.cleandoc(_PHASE_MODEL_DOC)


# The graph-key fields (micro_batches, ...) are KeyFields' (schemas/key_fields.py). Not in
# the docstring: msgspec publishes it in the JSON Schema.
class Phase(SpecStruct, KeyFields, frozen=True, kw_only=True):
    """One family of graphs, one per capture size."""

    name: Name
    kind: PhaseKind
    sizes: Annotated[list[BatchSize], msgspec.Meta(min_length=1, max_length=MAX_SIZES_PER_PHASE)]
    tokens_per_request: PerRequest = 1
    output_lifetime: OutputLifetime = "next-replay"
    #: phases whose captures must all come before this phase's
    after: list[Name] = []
    #: decoder layers this phase runs (EAGLE drafts run 1); default: the model's
    layers: Layers | None = None
    #: draft steps run inside one graph (draft_decode; EAGLE's num_steps)
    steps: PerRequest = 1
    #: candidates per request kept at every draft step (draft_decode; EAGLE's topk)
    topk: PerRequest = 1
    #: the phase's model where it differs from ``[model]`` (draft phases only);
    #: UNSET is left out of encoded specs, so specs without it keep their bytes
    model: PhaseModel | msgspec.UnsetType = msgspec.UNSET
    # Graph keys (plan revision 3). Each UNSET unless given, so specs and plans
    # without them keep their bytes.
    #: variant axes: several graphs per size, one per combination of labels
    #: (``variants = { lora = ["lora", "nolora"] }``); each is a graph key of the plan
    variants: Variants | msgspec.UnsetType = msgspec.UNSET
    #: piecewise kinds: the piece graphs each capture records (predicted per piece)
    pieces: Pieces | msgspec.UnsetType = msgspec.UNSET
    #: the stream the phase's graphs record on when it is not the capture stream
    #: (vLLM's micro-batch twin); the engine owns it and hands it to the executor
    stream: StreamName | msgspec.UnsetType = msgspec.UNSET
    #: what the phase's warm-up allocates that the engine keeps (a device item outside
    #: every pool, predicted per warm-up step)
    warmup_keeps: WarmupKeeps | msgspec.UnsetType = msgspec.UNSET
    #: a micro-batch twin of the named phase: each of this phase's graphs is captured
    #: right after that phase's graph of the same size and labels, in that phase's order
    #: (vLLM's ``_maybe_ubatch_twin``, captured after its FULL descriptor); its sizes are
    #: some of that phase's. UNSET unless given, so specs without it keep their bytes
    twin_of: Name | msgspec.UnsetType = msgspec.UNSET
    #: executable reuse (plan revision 7): the phase's graphs alike in structure share one
    #: instantiated executable, switched with cuGraphExecUpdate; UNSET (off) unless given
    reuse: Literal["exec-update"] | msgspec.UnsetType = msgspec.UNSET


class When(SpecStruct, frozen=True, kw_only=True):
    """Condition of a rule; an unset field matches anything."""

    backend: list[str] | None = None
    phase_kind: list[PhaseKind] | None = None
    #: tokens_per_request > 1 (varlen multi-token phases)
    multi_token: bool | None = None
    ci: bool | None = None
    output_lifetime: OutputLifetime | None = None


class Choice(SpecStruct, ChoiceAxes, frozen=True, kw_only=True):
    """A partial strategy: the axes it sets must hold, the others are free (the axes:
    schemas/strategy.py)."""

    #: the order of graph keys in a phase with variants; UNSET (not None) so that
    #: specs without it keep their bytes
    key_order: KeyOrder | msgspec.UnsetType = msgspec.UNSET


class Rule(SpecStruct, frozen=True, kw_only=True):
    """A rule or gate: when ``when`` matches a phase, at least one of ``require``
    must hold for it (none: no requirement), and ``prefer`` is its default."""

    id: Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9][a-z0-9_.-]*$(?!\n)")]
    why: str
    when: When = When()
    require: list[Choice] = []
    prefer: Choice | None = None


class Spec(SpecStruct, frozen=True, kw_only=True):
    """What to plan. ``budget_mib`` fails a build whose predicted pool exceeds it."""

    version: int = SPEC_VERSION
    name: str = "default"
    model: Model = Model()
    phases: Annotated[list[Phase], msgspec.Meta(min_length=1, max_length=MAX_PHASES)]
    tp: Positive = 1
    allocator: AllocatorMode = "native"
    #: the bounds of ``--budget-mib``'s row (schemas/build_flags.py): one bound for both
    budget_mib: Annotated[float, option_meta("budget_mib")] | None = None
    #: allocation trace (relative to the spec file) for exact predictions
    trace: str | None = None
    #: persistent library workspaces the first capture creates in the pool when
    #: the capture stream is cold (nothing ran on it before): 32 for cuBLAS on
    #: sm90 (measured, bench/results/cold-stream-*.json). The executor warms up
    #: on its capture stream, so its plans use 0.
    library_mib: Annotated[MiBAmount, msgspec.Meta(ge=0)] = 0
    #: extra rules, applied after the built-in ones
    rules: Annotated[list[Rule], msgspec.Meta(max_length=MAX_RULES)] = []


def phase_model(model: Model, phase: Phase) -> Model:
    """``model`` with ``phase``'s own dimensions (:class:`PhaseModel`) put in;
    ``model`` itself when the phase sets none."""
    if phase.model is msgspec.UNSET:
        return model
    own = {f: v for f, v in msgspec.structs.asdict(phase.model).items() if v is not msgspec.UNSET}
    return msgspec.structs.replace(model, **own) if own else model
