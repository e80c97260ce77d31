"""Allocation programs: what one capture allocates and frees, as typed ops.

A program is a sequence of :class:`Alloc` and :class:`Free` ops, in the order
the capture issues them, split into a prologue, a body repeated once per
decoder layer (or draft step) and an epilogue (:class:`Program`). The
analytic model (planner/memory/analytic.py) and the trace fitter
(planner/memory/fitting.py) build programs; planner/memory/simulate.py runs them.

The allocator's inner loop does not see these ops: :attr:`Program.runnable`
converts each section once (the property caches it) into the compact
``(nbytes, id)`` pairs :meth:`capture_plan.planner.memory.allocator.PoolSim.run` takes, so typed
ops cost nothing per simulated capture. That compact form is the only place
a free is written as a negative size (:data:`capture_plan.planner.memory.allocator.FREE`).

Not checked here: that a free names a live id, or that ids are unique within
a section (the builders and ``Workload.from_trace`` guarantee both).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import msgspec

from capture_plan.schemas.trace import Event, EventKind

from .allocator import CARRY, FREE  # the compact form's ids: the allocator core runs programs

__all__ = ["Alloc", "Free", "Op", "CARRY", "Program", "Runnable", "ops_from_events"]


class Alloc(msgspec.Struct, frozen=True, gc=False, tag="alloc"):
    """Allocate ``size`` bytes (``size >= 0``; the allocator rounds it) as block ``id``."""

    size: int
    id: int
    #: what the block is: a temporary, an output the step returns, the
    #: backend's per-call workspace, or a library's once-per-process workspace
    kind: EventKind = "temp"


class Free(msgspec.Struct, frozen=True, gc=False, tag="free"):
    """Free block ``id``; a free of an id that is not live does nothing (the
    body's first free of ``CARRY`` when the first input is no pool block)."""

    id: int


#: one op of a program
Op = Alloc | Free


def ops_from_events(events: Iterable[Event]) -> tuple[Op, ...]:
    """A recorded capture's events as ops (same ids, same order)."""
    return tuple(Alloc(e.size, e.id, e.kind) if e.op == "alloc" else Free(e.id) for e in events)


class Program(msgspec.Struct, frozen=True, dict=True):
    """One capture's allocations as the simulator runs them.

    ``prologue``, then ``body`` ``repeats`` times (one decoder layer), then
    ``epilogue``. The block with id ``carry_in`` (allocated in the prologue)
    enters the first repetition as id :data:`CARRY`; each repetition frees it
    and allocates ``carry_out``, which enters the next one (and the epilogue)
    as ``CARRY``. ``carry_in=None``: the first repetition's input is no pool
    block (a static buffer of the engine). ``carry_kind``: the kind of the
    block the last repetition carries out, when the step returns it (the body
    allocates it as a temporary). Ids inside the body are reused by every
    repetition. A recorded trace is folded where a layer repeats
    (planner/memory/layers.py), else all prologue.
    """

    prologue: tuple[Op, ...]
    body: tuple[Op, ...] = ()
    repeats: int = 0
    epilogue: tuple[Op, ...] = ()
    carry_in: int | None = CARRY
    carry_out: int = CARRY
    carry_kind: EventKind | None = None
    #: ids of body allocations after which a piece graph of a piecewise capture ends
    #: (the eager attention call runs there); empty for a capture of one graph
    splits: tuple[int, ...] = ()

    @functools.cached_property
    def runnable(self) -> Runnable:
        """The sections as :meth:`capture_plan.planner.memory.allocator.PoolSim.run` takes them, and each id's
        kind (built once)."""
        sections = (self.prologue, self.body, self.epilogue)
        kinds = {op.id: op.kind for section in sections for op in section if type(op) is Alloc}
        pairs = [
            tuple((op.size, op.id) if type(op) is Alloc else (FREE, op.id) for op in section) for section in sections
        ]
        outputs = [
            frozenset(op.id for op in section if type(op) is Alloc and op.kind == "output") for section in sections
        ]
        # three pairs, three output sets: pyright cannot count a list's items in a call
        return Runnable(*pairs, kinds, *outputs)  # pyright: ignore[reportCallIssue]

    def without_workspace(self) -> Program:
        """This program less the backend workspace's allocations and their
        frees (a hoisted workspace lives outside the pool)."""
        return Program(
            prologue=_without_workspace(self.prologue),
            body=_without_workspace(self.body),
            repeats=self.repeats,
            epilogue=_without_workspace(self.epilogue),
            carry_in=self.carry_in,
            carry_out=self.carry_out,
            carry_kind=self.carry_kind,
            splits=self.splits,
        )

    def flatten(self) -> list[Event]:
        """Every event in order as the simulator runs them, ids made unique (for tests,
        inspection and analytic traces): one id space for every section (a free of an id
        not live does nothing: an epilogue may free a prologue block), the body's ids
        reused by each repetition, the carried block entering each as ``CARRY``."""
        out: list[Event] = []
        live: dict[int, int] = {}  # id in the program -> unique id of its live block
        at: dict[int, int] = {}  # unique id -> index of its alloc event

        def emit(ops) -> None:
            for op in ops:
                if type(op) is Alloc:
                    n = len(at)
                    live[op.id], at[n] = n, len(out)
                    out.append(Event(op="alloc", id=n, size=op.size, kind=op.kind))
                elif (u := live.pop(op.id, None)) is not None:  # a free of no block: carry_in=None's input
                    out.append(Event(op="free", id=u))

        emit(self.prologue)
        carried = live.pop(self.carry_in, None) if self.repeats and self.carry_in is not None else None
        for _ in range(self.repeats):
            if carried is not None:
                live[CARRY] = carried
            emit(self.body)
            carried = live.pop(self.carry_out, None)
        if self.repeats and carried is not None:
            if self.carry_kind:
                e = out[at[carried]]
                out[at[carried]] = Event(op="alloc", id=e.id, size=e.size, kind=self.carry_kind)
            live[CARRY] = carried
        emit(self.epilogue)
        return out


class Runnable(msgspec.Struct, frozen=True):
    """A program in :meth:`capture_plan.planner.memory.allocator.PoolSim.run`'s compact form."""

    #: ``(nbytes, id)`` pairs, ``nbytes == FREE`` for a free
    prologue: tuple
    body: tuple
    epilogue: tuple
    #: allocation id -> kind ("temp", "output", "workspace", "library")
    kinds: dict
    prologue_outputs: frozenset
    body_outputs: frozenset
    epilogue_outputs: frozenset


def _without_workspace(ops: tuple[Op, ...]) -> tuple[Op, ...]:
    """``ops`` less workspace allocations and their frees (ids are unique within a section)."""
    ws = {op.id for op in ops if type(op) is Alloc and op.kind == "workspace"}
    return tuple(op for op in ops if op.id not in ws) if ws else ops
