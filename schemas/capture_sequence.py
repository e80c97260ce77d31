"""The capture sequence: what a build captures, in the order it captures it, as one value.

One :class:`Capture` per graph key, in capture order: its phase, size and labels (the graph
key, :mod:`capture_plan.schemas.keys`), the pool it captures into, the stream it records on,
and the eager warm-up run right before it. The planner builds it once per set of strategies
(capture_plan.planner.schedule.sequence.capture_sequence: the only place that orders a
phase's sizes and graph keys); the optimizer simulates it, the step graph orders its steps
by it, the prediction and the per-key predictions read it, and size choice prices lists
with it. It is what a consumer that needs per-phase, per-size capture lists with their
graph keys reads (pricing graph memory per capture size; a graph file keyed by the same
steps): :meth:`CaptureSequence.phase`, :attr:`CaptureSequence.sizes`,
:attr:`Capture.id`.

Not part of the plan file: a plan records its steps (whose capture steps are this sequence's
captures, in this order); this value is the planner's, and torch-free so that an executor
may build or read one too.
"""

from __future__ import annotations

import msgspec

from .keys import step_id

__all__ = ["Labels", "Capture", "CaptureSequence", "capture_key"]

#: a graph key's ``(axis, label)`` pairs in the phase's axis order
Labels = tuple[tuple[str, str], ...]


def capture_key(phase: str, bs: int, labels: Labels = ()) -> tuple:
    """A capture as the simulator takes it: ``(phase, size)``, with the labels of a graph
    key that has them (so captures without labels are what they were before graph keys)."""
    return (phase, bs, labels) if labels else (phase, bs)


class Capture(msgspec.Struct, frozen=True, kw_only=True):
    """One graph captured: its graph key, where it goes and what runs before it."""

    phase: str
    bs: int
    #: the graph key's labels, ``(axis, label)`` in the phase's axis order (empty without variants)
    labels: Labels = ()
    #: the pool it captures into ("shared" or "phase:<name>")
    pool: str = "shared"
    #: the stream it records on when not the capture stream (the phase's ``stream``)
    stream: str | None = None
    #: the size of the eager warm-up run right before it (every-size: its own; once-per-phase:
    #: the phase's largest, before the phase's first capture), None where none runs
    warmup: int | None = None

    @property
    def id(self) -> str:
        """Its capture step's id (``capture/decode/64``, with ``/axis=label,...``)."""
        return step_id("capture", self.phase, self.bs, self.labels)

    @property
    def key(self) -> tuple:
        """The simulator's key of it (:func:`capture_key`)."""
        return capture_key(self.phase, self.bs, self.labels)


class CaptureSequence(msgspec.Struct, frozen=True):
    """Every capture of a build (or of one pool's phases), in capture order."""

    captures: tuple[Capture, ...]
    #: each phase's capture sizes in capture order, each once (a size with several graph keys
    #: at its first): what a plan records as the phase's sizes
    sizes: dict[str, tuple[int, ...]]

    @classmethod
    def of(cls, captures: tuple[Capture, ...]) -> CaptureSequence:
        """The sequence of ``captures`` (in capture order)."""
        sizes: dict[str, dict[int, None]] = {}
        for c in captures:
            sizes.setdefault(c.phase, {})[c.bs] = None
        return cls(captures, {name: tuple(seen) for name, seen in sizes.items()})

    @property
    def keys(self) -> tuple[tuple, ...]:
        """The simulator's keys, in capture order."""
        return tuple(c.key for c in self.captures)

    @property
    def ids(self) -> tuple[str, ...]:
        """The capture steps' ids, in capture order."""
        return tuple(c.id for c in self.captures)

    def phase(self, name: str) -> tuple[Capture, ...]:
        """``name``'s captures, in capture order."""
        return tuple(c for c in self.captures if c.phase == name)
