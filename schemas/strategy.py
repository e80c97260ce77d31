"""Strategy vocabulary shared by spec, rules and plan.

Each strategy axis is a closed set of strings so that plans stay readable and
diffable; adding a value is a new plan revision.
"""

from __future__ import annotations

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

AXES = ("order", "outputs", "workspace", "pool", "warmup")
#: each axis's values, read from its type above (one source for the plan
#: schema, the optimizer's candidates, --strategy checks and shell completion)
AXIS_VALUES: dict[str, tuple[str, ...]] = {
    axis: get_args(values) for axis, values in zip(AXES, (Order, Outputs, Workspace, PoolMode, Warmup))
}


def allocator_modes() -> tuple[str, ...]:
    """The allocator modes a spec or ``--allocator`` may name."""
    return get_args(AllocatorMode)
