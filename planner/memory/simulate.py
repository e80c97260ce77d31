"""Run a capture sequence through the allocator simulator.

Models what a capture does to its pool: blocks a capture frees are reusable
by the rest of it and by later captures in the same pool; at the end, outputs
held through views and all leftover temporaries are freed, kept outputs stay,
and ``library`` blocks (workspaces a library creates on first use, such as
cuBLAS's on a cold capture stream) stay for good. Warm-ups run eagerly outside
the pool and change nothing here. A hoisted workspace is not in the pool.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import msgspec

from capture_plan.schemas.plan import Strategy

from .core import Pool, new_pool
from .workload import Workload

__all__ = ["PoolSetup", "SimResult", "Simulation", "Tail", "simulate", "pool_id"]


def pool_id(phase: str, strategy: Strategy) -> str:
    return "shared" if strategy.pool == "shared" else f"phase:{phase}"


class SimResult(msgspec.Struct, frozen=True):
    #: peak reserved bytes of all pools together (reserved never falls)
    pool_bytes: int
    pools: dict[str, int]
    #: (reserved, allocated) of all pools together after each capture
    after_capture: list[tuple[int, int]]
    #: outputs that must outlive other phases' replays but lie in memory those
    #: replays write (see ``protect``); empty when safe
    hazards: Sequence[str] = ()


class PoolSetup(NamedTuple):
    """How a build's pools start and what they guard: the resolved build's (``Resolved.pools``).

    ``expandable``: the pools grow by expandable segments. ``protect``: phases whose outputs
    must survive replays of the other phases; their output blocks are checked against every
    block the other phases' graphs allocate (and so write on replay) in the same pool.
    ``library_bytes``: persistent library workspace the first capture creates in its pool
    (the capture stream is cold: nothing ran on it before)."""

    expandable: bool = False
    protect: frozenset[str] = frozenset()
    library_bytes: int = 0


#: native pools guarding nothing, no library workspace: a simulation's default
PLAIN = PoolSetup()


def simulate(
    captures: Iterable[tuple], strategies: dict[str, Strategy], workload: Workload, setup: PoolSetup = PLAIN
) -> SimResult:
    """Simulate ``captures`` in order: ``(phase, size)``, or ``(phase, size, labels)`` for a
    graph key with labels (its program where a trace recorded that key: Workload.program),
    in pools set up as ``setup`` says."""
    where = {q: pool_id(q, strategies[q]) for q in setup.protect if q in strategies}
    run = Simulation(workload, setup, where)
    for cap in captures:
        run.capture(cap[0], cap[1], strategies[cap[0]], *cap[2:])
    return run.result()


class Simulation:
    """Pools after a sequence of captures, resumable and copyable.

    :func:`simulate` is one of these run to the end. The optimizer keeps
    copies taken after a prefix of phases and resumes from them, so that
    strategies differing only in later phases never simulate the shared
    prefix again (a copy costs O(blocks), a capture O(its allocations)).
    """

    __slots__ = (
        "workload",
        "expandable",
        "protect",
        "library_bytes",
        "where",
        "pools",
        "touched",
        "outputs",
        "timeline",
    )

    def __init__(self, workload: Workload, setup: PoolSetup = PLAIN, where: dict[str, str] | None = None) -> None:
        """``where``: the pool each protected phase captures into, where known. A
        capture records the blocks it touches only when a protected phase other
        than its own shares its pool (or may: one ``where`` does not name) --
        only those blocks can overwrite protected outputs, and recording every
        block is a third of a speculative build's time."""
        self.workload = workload
        self.expandable, self.protect, self.library_bytes = setup
        self.where = where or {}
        self.pools: dict[str, Pool] = {}
        # (pool, phase) -> {(start, end)}: a set, as layers and captures reuse the same blocks
        self.touched: dict[tuple[str, str], set[tuple[int, int]]] = {}
        self.outputs: list[tuple[str, str, int, int, int]] = []  # (pool, phase, bs, start, end)
        self.timeline: list[tuple[int, int]] = []

    def copy(self) -> Simulation:
        twin = Simulation(self.workload, PoolSetup(self.expandable, self.protect, self.library_bytes), self.where)
        twin.pools = {k: p.copy() for k, p in self.pools.items()}
        twin.touched = {k: set(v) for k, v in self.touched.items()}
        twin.outputs = list(self.outputs)
        twin.timeline = list(self.timeline)
        return twin

    def state(self) -> tuple:
        """What the rest of a run depends on: each pool's :meth:`~capture_plan.planner.memory.allocator.PoolSim.state`
        (later captures free only their own blocks) and the library still to place."""
        return tuple(sorted((k, p.state()) for k, p in self.pools.items())), self.library_bytes

    def mark(self) -> tuple[int, int, frozenset]:
        """Where the run is now, for :meth:`since`."""
        return len(self.timeline), len(self.outputs), frozenset(self.touched)

    def since(self, mark: tuple[int, int, frozenset]) -> Tail:
        """What the captures after ``mark`` added, phases captured only after it.

        From an equal :meth:`state`, the same captures add exactly this
        again: the optimizer reuses it instead of simulating them.
        """
        t, o, keys = mark
        return Tail(
            timeline=tuple(self.timeline[t:]),
            outputs=tuple(self.outputs[o:]),
            touched={k: _union(v) for k, v in self.touched.items() if k not in keys},
            pools={k: p.peak_reserved for k, p in self.pools.items()},
        )

    def result_with(self, tail: Tail) -> SimResult:
        """The result of this run followed by ``tail`` (recorded from an equal state)."""
        timeline = self.timeline + list(tail.timeline)
        pools = {**{k: p.peak_reserved for k, p in self.pools.items()}, **tail.pools}
        return SimResult(
            pool_bytes=timeline[-1][0] if timeline else 0,
            pools=dict(sorted(pools.items())),
            after_capture=timeline,
            hazards=_overlaps({**self.touched, **tail.touched}, self.outputs + list(tail.outputs)),
        )

    def capture(self, phase: str, bs: int, st: Strategy, labels: tuple = ()) -> None:
        """One capture of ``phase`` at ``bs`` (and ``labels``, a graph key's) under ``st``, into its pool."""
        pid = pool_id(phase, st)
        pools = self.pools
        pool = pools.get(pid)
        if pool is None:
            pool = pools[pid] = new_pool(self.expandable)
        if self.library_bytes:
            pool.alloc(self.library_bytes)  # never freed
            self.library_bytes = 0
        if self.protect:
            outputs = [] if phase in self.protect else None
            if any(q != phase and self.where.get(q, pid) == pid for q in self.protect):
                spans = self.touched.setdefault((pid, phase), set())
            else:  # no other phase's outputs to overwrite here; run() records outputs only beside spans
                spans = None if outputs is None else set()
        else:
            spans = outputs = None
        prog = self.workload.program(phase, bs, hoisted=st.workspace == "hoisted", labels=labels)
        pool.capture(prog, st.outputs == "view", spans, outputs)
        if outputs:
            self.outputs.extend((pid, phase, bs, start, end) for start, end in outputs)
        self.timeline.append((sum(p.reserved for p in pools.values()), sum(p.allocated for p in pools.values())))

    def result(self) -> SimResult:
        timeline = self.timeline
        return SimResult(
            pool_bytes=timeline[-1][0] if timeline else 0,
            pools={k: p.peak_reserved for k, p in sorted(self.pools.items())},
            after_capture=list(timeline),
            hazards=_overlaps(self.touched, self.outputs),
        )


class Tail(msgspec.Struct, frozen=True):
    """The captures after a :meth:`Simulation.mark`: their timeline entries,
    protected outputs, touched spans (as unions, all that hazards need) and
    the pools' peaks at the end."""

    timeline: tuple
    outputs: tuple
    touched: dict
    pools: dict

    def then(self, later: Tail) -> Tail:
        return Tail(
            self.timeline + later.timeline, self.outputs + later.outputs, {**self.touched, **later.touched}, later.pools
        )


def _union(spans) -> set[tuple[int, int]]:
    starts, ends = _merged(spans)
    return set(zip(starts, ends))


def _merged(spans) -> tuple[list[int], list[int]]:
    """Union of spans as parallel (starts, ends) lists, sorted and disjoint."""
    starts: list[int] = []
    ends: list[int] = []
    for a, b in sorted(spans):
        if ends and a <= ends[-1]:
            if b > ends[-1]:
                ends[-1] = b
        else:
            starts.append(a)
            ends.append(b)
    return starts, ends


def _overlaps(touched, outputs) -> list[str]:
    """Protected outputs overlapping blocks that other phases' graphs write."""
    found: list[str] = []
    unions: dict[tuple[str, str], tuple[list[int], list[int]]] = {}
    for pid, phase, bs, start, end in outputs:
        key = (pid, phase)
        if key not in unions:
            unions[key] = _merged([s for (p, ph), lst in touched.items() if p == pid and ph != phase for s in lst])
        starts, ends = unions[key]
        i = bisect.bisect_left(starts, end) - 1  # last span starting before this output ends
        if i >= 0 and ends[i] > start:
            found.append(
                f"{phase}/{bs} output [{start:#x}, {end:#x}) lies in blocks another phase's graphs "
                f"write on replay (pool {pid})"
            )
    return found
