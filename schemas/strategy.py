"""Strategy vocabulary shared by spec, rules and plan, and the one declaration of the strategy axes.

Each strategy axis is a closed set of strings so that plans stay readable and
diffable; adding a value is a new plan revision.

The axes are the fields of :class:`StrategyAxes` (each with the value a plan's strategy has
where nothing chose another) and, all optional, of :class:`ChoiceAxes` (what a rule requires
or prefers): a plan's :class:`~capture_plan.schemas.plan.Strategy` and a spec's
:class:`~capture_plan.schemas.spec.Choice` are made of them, and :data:`AXES`,
:data:`AXIS_VALUES` (``--strategy`` pins and their completion) and :data:`MEMORY_AXES` (what
the optimizer searches) are read from them. A new axis is a field of both here (tests prove
it reaches the rules, the pins, the optimizer and the plan); what it does to memory is the
simulator's.
"""

# No `from __future__ import annotations`: the axes' values are read from the classes'
# annotations (AXIS_VALUES), and msgspec would compile string annotations again.
from typing import Annotated, Literal, get_args

import msgspec

__all__ = [
    "Order",
    "Outputs",
    "Workspace",
    "PoolMode",
    "Warmup",
    "PhaseKind",
    "KeyOrder",
    "WarmupKeeps",
    "PhaseSetting",
    "PHASE_SETTINGS",
    "OutputLifetime",
    "AllocatorMode",
    "AXES",
    "AXIS_VALUES",
    "MEMORY_AXES",
    "RULE_ONLY_AXES",
    "StrategyAxes",
    "ChoiceAxes",
    "allocator_modes",
]

#: Capture order of the sizes inside one phase.
Order = Literal["largest-first", "smallest-first"]
#: How the executor holds a graph's outputs after capture: owning tensors that
#: pin their pool blocks, or non-owning views that let later captures reuse them.
Outputs = Literal["keep", "view"]
#: Where a backend's per-call workspace lives: inside the graph pool, or in one
#: buffer hoisted out of it at the phase's maximum size before any capture.
Workspace = Literal["pool", "hoisted"]
#: One pool shared by every phase, or a private pool for this phase.
PoolMode = Literal["shared", "own"]
#: Eager warm-up runs before capture: at every size, or once at the phase's
#: largest size before its first capture.
Warmup = Literal["every-size", "once-per-phase"]
#: The order of a phase's graph keys when it declares variant axes:
#: "size-major": per size (in the phase's size order), every variant (labels in the
#: order the spec lists them; SGLang's ``_capture_one_stream``); "variant-major": per
#: variant, every size. Not a strategy axis the optimizer searches (it does not
#: change which blocks a graph takes, only their order): a rule or a pin sets it.
KeyOrder = Literal["size-major", "variant-major"]
#: What a phase's warm-up allocates that the engine keeps past it (outside every
#: graph pool): "outputs": the graph's output buffers at the phase's first (largest)
#: key, reused by every later key (vLLM's persistent FULL outputs made by
#: ``store_capture_output``; SGLang's reused output buffers).
WarmupKeeps = Literal["outputs"]
#: A phase kind's name. The kinds are data (planner/data/phase_kinds.toml),
#: not a closed set here, so that a kind allocating like an existing one is
#: added by that file alone and these types (which the executor shares
#: without the planner) do not change: the planner checks a spec's kinds
#: against the file (:func:`capture_plan.planner.inputs.validate.validate_spec` is given them). A
#: plan's kind is whatever the planner accepted.
PhaseKind = Annotated[str, msgspec.Meta(pattern=r"^[a-z][a-z0-9_]*$(?!\n)", max_length=64)]
#: The per-phase settings of a spec that only some phase kinds give a meaning
#: (each kind lists those it accepts in planner/data/phase_kinds.toml).
PhaseSetting = Literal["steps", "topk", "layers", "model", "pieces", "micro_batches", "twin_of"]
PHASE_SETTINGS: tuple[str, ...] = get_args(PhaseSetting)
#: "next-replay": the engine consumes the outputs before the next replay of any
#: graph in the same pool. "across-phases": they must survive other phases' replays.
OutputLifetime = Literal["next-replay", "across-phases"]
AllocatorMode = Literal["native", "expandable"]


class StrategyAxes(msgspec.Struct, frozen=True, kw_only=True):
    """Every strategy axis, each at the value a strategy has where nothing chose another."""

    order: Order = "largest-first"
    outputs: Outputs = "keep"
    workspace: Workspace = "pool"
    pool: PoolMode = "shared"
    warmup: Warmup = "every-size"


class ChoiceAxes(msgspec.Struct, frozen=True, kw_only=True):
    """Every strategy axis, optional: the axes a partial strategy (a rule's ``require`` or
    ``prefer``) sets must hold, the others (None) are free. The fields of
    :class:`StrategyAxes` (tests/test_strategy_axes.py checks it)."""

    order: Order | None = None
    outputs: Outputs | None = None
    workspace: Workspace | None = None
    pool: PoolMode | None = None
    warmup: Warmup | None = None


AXES: tuple[str, ...] = StrategyAxes.__struct_fields__
#: each axis's values, read from its type above (one source for the plan
#: schema, the optimizer's candidates, --strategy checks and shell completion)
AXIS_VALUES: dict[str, tuple[str, ...]] = {axis: get_args(StrategyAxes.__annotations__[axis]) for axis in AXES}
#: the axes chosen by the rules alone, never searched: warm-ups cost no pool memory (the
#: fewest the rules allow; planner/schedule/optimize.py)
RULE_ONLY_AXES = ("warmup",)
#: the axes that change which blocks a graph takes: the optimizer searches them
MEMORY_AXES: tuple[str, ...] = tuple(axis for axis in AXES if axis not in RULE_ONLY_AXES)


def allocator_modes() -> tuple[str, ...]:
    """The allocator modes a spec or ``--allocator`` may name."""
    return get_args(AllocatorMode)
