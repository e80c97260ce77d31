"""How exactly a phase's graph-exec bytes per node are known from the copies made so far.

A start-up prediction measures the driver memory of the graphs it will capture
by instantiating its recorded graphs again (``capture_plan.executor.graph_nodes.ExecCopies``,
``capture_plan.executor.profiling.record(instantiate=...)``). The driver takes that
memory in steps of :data:`STEP` (2 MiB, measured on an H200), so a reading after
``n`` nodes' worth of copies that took ``t`` bytes says only that the bytes per node
``p`` satisfy ``|t - p*n| < STEP`` (the first step may have been partly taken before
the copies). Every reading narrows the interval of ``p``; the prediction then uses
``t/n`` (the figure the existing formula uses, which cancels the error of the bytes
held now) and is off, for the nodes not instantiated, by at most
``max(t/n - lo, hi - t/n)`` a node.

:class:`NodeBytes` keeps that interval and says when the copies not yet made would
add less than a budget of error (:meth:`NodeBytes.settled`): the copies can stop
there. It refuses (never settles) while the readings are inconsistent with a
per-node figure (an interval that is empty: the driver's memory is not linear in
nodes here, so only every copy measures it), or before :data:`MIN_READINGS`
readings that took memory.

Torch-free: the readings come from the caller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from capture_plan.schemas.units import DRIVER_CHUNK

__all__ = ["STEP", "MIN_READINGS", "NodeBytes"]

#: the driver's step when it takes graph-exec memory (schemas.units, shared with the planner)
STEP = DRIVER_CHUNK
#: readings that took memory before the figure may count as settled: one reading cannot
#: show the figure stable (a copy that happened to end on a step boundary looks exact)
MIN_READINGS = 3


@dataclass
class NodeBytes:
    """Bounds of one phase's driver bytes per node, from cumulative readings of its copies."""

    step: int = STEP
    lo: float = 0.0
    hi: float = math.inf
    #: (nodes, bytes taken), cumulative, one per reading
    readings: list[tuple[int, int]] = field(default_factory=list)

    def add(self, nodes: int, taken: int) -> None:
        """A reading: ``nodes`` instantiated in all so far took ``taken`` bytes in all."""
        self.readings.append((nodes, taken))
        if nodes > 0:
            self.lo = max(self.lo, (taken - self.step) / nodes)
            self.hi = min(self.hi, (taken + self.step) / nodes)

    @property
    def consistent(self) -> bool:
        """Whether one per-node figure explains every reading (the interval is not empty)."""
        return self.lo <= self.hi

    def error(self, remaining_nodes: int) -> float:
        """The most the bytes of ``remaining_nodes`` more nodes, predicted at the last
        reading's bytes per node, can be off; inf before a reading or when inconsistent."""
        if not self.readings or not self.consistent or math.isinf(self.hi):
            return math.inf
        nodes, taken = self.readings[-1]
        if nodes <= 0:
            return math.inf
        est = taken / nodes
        return max(est - self.lo, self.hi - est, 0.0) * max(0, remaining_nodes)

    def settled(self, remaining_nodes: int, budget: float) -> bool:
        """Whether the copies can stop: the readings are consistent, at least
        :data:`MIN_READINGS` of them took memory, and the nodes still to instantiate
        (``remaining_nodes``: an upper bound) would be predicted within ``budget`` bytes."""
        if remaining_nodes <= 0:
            return True
        if sum(t > 0 for _, t in self.readings) < MIN_READINGS:
            return False
        return self.error(remaining_nodes) <= budget

    def describe(self) -> str:
        """The interval, in bytes a node, for the prediction's reason."""
        if not self.consistent:
            return f"readings inconsistent with one figure ({self.lo:.0f} > {self.hi:.0f} B a node)"
        return f"{self.lo:.0f} to {self.hi:.0f} B a node over {len(self.readings)} readings"
