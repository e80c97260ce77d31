"""Strategy vocabulary shared by spec, rules and plan.

Each strategy axis is a closed set of strings so that plans stay readable and
diffable; adding a value is a new plan revision.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = [
    "Order", "Outputs", "Workspace", "PoolMode", "Warmup", "PhaseKind",
    "OutputLifetime", "AllocatorMode", "AXES", "AXIS_VALUES", "allocator_modes",
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
PhaseKind = Literal["decode", "target_verify", "draft_decode", "draft_extend"]
#: "next-replay": the engine consumes the outputs before the next replay of any
#: graph in the same pool. "across-phases": they must survive other phases' replays.
OutputLifetime = Literal["next-replay", "across-phases"]
AllocatorMode = Literal["native", "expandable"]

AXES = ("order", "outputs", "workspace", "pool", "warmup")
#: each axis's values, read from its type above (one source for the plan
#: schema, the optimizer's candidates, --strategy checks and shell completion)
AXIS_VALUES: dict[str, tuple[str, ...]] = {
    axis: get_args(values) for axis, values in zip(AXES, (Order, Outputs, Workspace, PoolMode, Warmup))}


def allocator_modes() -> tuple[str, ...]:
    """The allocator modes a spec or ``--allocator`` may name."""
    return get_args(AllocatorMode)
