"""Strategy vocabulary shared by spec, rules and plan.

Each strategy axis is a closed set of strings so that plans stay readable and
diffable; adding a value is a new plan revision.
"""

from __future__ import annotations

from typing import Literal

__all__ = [
    "Order", "Outputs", "Workspace", "PoolMode", "Warmup", "PhaseKind",
    "OutputLifetime", "AllocatorMode", "AXES", "AXIS_VALUES",
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
AXIS_VALUES: dict[str, tuple[str, ...]] = {
    "order": ("largest-first", "smallest-first"),
    "outputs": ("keep", "view"),
    "workspace": ("pool", "hoisted"),
    "pool": ("shared", "own"),
    "warmup": ("every-size", "once-per-phase"),
}
