"""The figures of a start-up prediction: its result type and the arithmetic that turns a
calibration into them (:mod:`capture_plan.adapters.startup` records, then calls them).

:class:`StartupPrediction` is what ``predict_startup`` returns. The rest is pure: what
the capture takes after each step (:func:`_timeline`), at its peak (:func:`_peak`), the
graphs' driver memory from the recording's node counts and copies (:func:`_driver`),
the whole set of figures of a calibration (:func:`_figures`), and the ``copy_error`` a
recording may stop its copies at (:func:`copy_budget`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from capture_plan.executor.profiling import Recording
from capture_plan.planner.memory.device import (
    Calibration,
    driver_after,
    graphs_after,
    node_figure,
    peak,
    pools_after,
    taken_after,
    whole_chunks,
)
from capture_plan.schemas.keys import PlanIndex
from capture_plan.schemas.plan import Plan
from capture_plan.schemas.startup import StartupCalibration

MiB = 2**20


#: a ``copy_error`` of half a driver step (2 MiB): meant to leave the prediction within the
#: 2 MiB it is held to at every step; measured not to (:mod:`capture_plan.adapters.startup`'s
#: docstring), so not the default
COPY_ERROR = 1 * MiB


@dataclass(frozen=True)
class StartupPrediction:
    """The plan capture will follow and the bytes it will take on this device."""

    plan: Plan
    #: free device memory the whole capture takes (a process that captured nothing yet)
    total_bytes: int
    #: what it will still take from free memory now: subtract this before sizing the KV cache
    pending_bytes: int
    #: what the capture will have taken from free memory (from now) when it returns
    final_bytes: int = 0
    #: total_bytes by item: pool, hoisted, stream-workspace, allocator-other, graph-exec
    items: dict[str, int] = field(default_factory=dict)
    #: sizes recorded per phase (by the start-up that measured the calibration, for a cached one)
    recorded: dict[str, list[int]] = field(default_factory=dict)
    seconds: float = 0.0
    #: what the capture will have taken from free memory (from now) after each of
    #: ``plan.steps``, between warm-ups; empty when the driver's figure is per graph
    timeline: list[int] = field(default_factory=list)
    #: how the graph-exec item was made
    graph_exec: str = ""
    #: where ``seconds`` went: "schedule" (the analytic build that picks the sizes to record),
    #: "cache" (looking the calibration up, reading it), "record" (every recording round's
    #: captures: "record.capture", itself split into "record.capture.warmup", ".graphs" and
    #: ".other", and "record.trace"), "write" (writing the trace), "build" (the builds from the
    #: recorded traces: the planner's optimizer on the allocator core ``allocator_core`` names),
    #: "record.copies.waited" (the wait for the first round's copies once its build was done),
    #: "predict" (the rest). "record.copies" and "record.release" are the copies' thread's own
    #: time: it runs beside "write" and "build", so it is not a part of ``seconds`` on its own.
    timings: dict[str, float] = field(default_factory=dict)
    #: "recorded" (this start-up recorded the model) or "cache" (a calibration an earlier
    #: start-up measured, read from ``cache_path``)
    source: str = "recorded"
    #: the cache entry read or written; None without a cache
    cache_path: Path | None = None
    #: what was measured, in a fresh process's terms (what ``cache`` keeps)
    calibration: StartupCalibration | None = None
    #: the shortcuts this start-up took, by name ("copies:PHASE": a phase's driver memory
    #: measured from fewer copies than the plan captures), each with its reason
    shortcuts: dict[str, str] = field(default_factory=dict)
    #: the planner's allocator core the builds ran on (``compiled``, or ``python (why)``:
    #: about 6 times slower, bench/results/build-2026-12-02-startup.json; ``pip install -e .``
    #: builds the compiled one where a C compiler and Cython exist)
    allocator_core: str = ""


@dataclass(frozen=True)
class _Figures:
    total: int
    pending: int
    final: int
    items: dict[str, int]
    timeline: list[int]


def _figures(entry: StartupCalibration, *, held: int, early: int, late: int) -> _Figures:
    """What the capture of ``entry.plan`` takes: in all (a fresh process), and from now.

    ``held``: driver bytes the driver holds now for graphs to come (the recording's copies);
    ``early``: allocator bytes outside the pools the capture takes from its start (the
    capture stream's workspace, in a process that has not recorded), ``late``: those it
    takes from its first capture on (the RNG state's segment)."""
    plan = entry.plan
    kinds = PlanIndex.of(plan).kinds
    after = pools_after(plan.steps, plan.predicted.timeline)
    items = {
        "pool": plan.predicted.pool_bytes,
        "hoisted": plan.predicted.hoisted_bytes,
        "stream-workspace": entry.stream_workspace,
        "allocator-other": entry.allocator_other,
        "graph-exec": 0,
    }
    if entry.driver is None:
        graphs = graphs_after(plan.steps, entry.graph_exec_per_graph, kinds)
        items["graph-exec"] = int(round(graphs[-1] if graphs else 0))
        top = (
            None
            if graphs is None
            else peak(plan.steps, taken_after(after, early + late, graphs), entry.warmup_scratch, kinds)
        )
        final = items["pool"] + items["hoisted"] + early + late + items["graph-exec"]
        timeline: list[int] = []
    else:
        items["graph-exec"] = entry.driver[-1] if entry.driver else 0
        timeline = _timeline(plan, after, early, late, [max(0, d - held) for d in entry.driver])
        top = _peak(plan, kinds, entry.warmup_scratch, timeline)
        final = timeline[-1] if timeline else 0
    pending = max(final, top) if top is not None else final
    return _Figures(
        total=sum(items.values()), pending=max(0, pending), final=max(0, final), items=items, timeline=timeline
    )


def captures_per_phase(plan: Plan, sizes: Mapping[str, list[int]] | None = None) -> dict[str, int]:
    """The graphs ``plan`` captures per phase, one per capture step: a size per graph key
    (every label combination of a phase with variant axes), not a size alone; with
    ``sizes``, those of the phase's sizes it names only (what a recording of them makes)."""
    out = {p.name: 0 for p in plan.phases}
    for s in plan.steps:
        if s.op == "capture" and (sizes is None or s.bs in sizes[s.phase]):
            out[s.phase] += 1
    return out


def copy_budget(counts: dict[str, int], recorded: dict[str, int], copy_error: float | None) -> tuple[float | None, str]:
    """The ``copy_error`` the recording may stop copies at, and why not (an empty reason
    where it may, or where none was asked). ``counts``: graphs the plan captures per
    phase; ``recorded``: the graphs the recording captures per phase.

    One phase needing copies: its copies not made are off by at most the budget at every
    step (the capture reuses the held memory before it takes more, so a step within the
    held copies takes nothing, as predicted). Two or more: refused. A step where one
    phase has gone past its copies while another has not used all of its own mixes both
    phases' figures, and the second's is off by up to its last reading's driver step over
    its held nodes, whatever the budget: only every copy makes those steps exact."""
    if copy_error is None:
        return None, ""
    need = sorted(n for n, c in counts.items() if c > recorded.get(n, 0))
    if len(need) > 1:
        return None, (
            f"every copy made: {len(need)} phases need copies ({', '.join(need)}), and a stop in one would leave "
            "the steps where another has not used its copies off by up to a driver step"
        )
    return copy_error, ""


def _timeline(plan: Plan, after: list[int], early: int, late: int, driver: list[int]) -> list[int]:
    """The free memory the capture will have taken after each step: the pools (and
    hoisted workspaces) so far, the allocator memory outside them it takes from its
    start (``early``: the capture stream's cuBLAS workspace, which the executor makes
    before the first step) and from its first capture on (``late``: the RNG state's
    segment), and the graphs' driver memory not held already."""
    first = next((i for i, st in enumerate(plan.steps) if st.op == "capture"), len(plan.steps))
    return [a + early + (late if i >= first else 0) + d for i, (a, d) in enumerate(zip(after, driver))]


def _peak(plan: Plan, kinds: dict[str, str], scratch: dict[str, int], timeline: list[int]) -> int | None:
    """The most the capture takes at any moment: after each step (``timeline``), and during
    each warm-up: its scratch on top of what was taken before it, or after it where the
    warm-up itself took more (what it keeps is there while its temporaries are; as
    :func:`measured_peak` reads a report). None when a warm-up's scratch is unknown."""
    top, before = max(timeline, default=0), 0
    for s, now in zip(plan.steps, timeline):
        if s.op == "warmup":
            sc = scratch.get(s.phase, scratch.get(f"kind:{kinds.get(s.phase)}"))
            if sc is None:
                return None
            top = max(top, max(before, now) + sc)
        before = now
    return top


def _driver(plan: Plan, cals: list[Calibration], first: Recording) -> tuple[list[int] | None, int, str]:
    """The plan's graphs' driver memory after each step in a fresh process, the bytes
    the driver holds now for graphs to come, and how the figure was made; (None, 0, "")
    without node counts for every phase. ``cals``: each recording round's calibration,
    the first round's first (``first`` is that round's recording).

    Where the recording instantiated its graphs as often as the plan captures, the bytes
    per node are this model's on this device, measured (their driver memory over their
    nodes), and the driver holds all of it now. Otherwise the device table's figure, and
    the driver holds what the recorded graphs took."""
    nodes: dict[str, dict[int, int]] = {}
    for c in cals:  # the node counts every round recorded
        for phase, by_size in c.graph_nodes.items():
            nodes.setdefault(phase, {}).update(by_size)
    if not all(nodes.get(p.name) for p in plan.phases):
        return None, 0, ""
    recorded = cals[0].graph_exec_counted  # per phase: driver bytes and nodes of the recorded graphs
    planned = captures_per_phase(plan)
    counted = Counter(c.phase for c in first.trace.captures)
    # every copy a phase needed was made (a phase recorded whole needs none): the figures are measured
    # or a phase's copies stopped where its bytes per node were bounded well enough (settled):
    # the driver holds what they took, and the capture takes the rest as predicted
    made_all = first.copies and all(
        first.copies.get(name, (0, 0, 0))[0] >= planned[name] - counted[name] or name in first.settled
        for name in planned
    )
    if made_all and all(recorded.get(name, (0, 0))[1] + first.copies.get(name, (0, 0, 0))[1] for name in planned):
        per_node, held = {}, 0
        for name in planned:
            _, n, taken = first.copies.get(name, (0, 0, 0))
            b, k = recorded.get(name, (0, 0))
            per_node[name] = (b + taken) / (k + n)
            held += b + taken
        made = sum(c for c, _, _ in first.copies.values())
        where = (
            "bytes a node per phase ("
            + ", ".join(f"{k} {v:.0f}" for k, v in sorted(per_node.items()))
            + f") as the recorded graphs, instantiated {made} times more, took on this device"
        )
        if first.settled:
            where += " (copies stopped early: " + "; ".join(f"{k} {v}" for k, v in sorted(first.settled.items())) + ")"
    else:
        listed, where = node_figure(cals[0])
        if listed is None:
            return None, 0, ""
        per_node = listed
        held = whole_chunks(sum(k for _, k in recorded.values()) * listed)
    driver = driver_after(plan.steps, nodes, per_node)
    if driver is None:
        return None, 0, ""
    return driver, max(0, held), f"the recorded graphs' nodes, {where}, in 2 MiB steps"
