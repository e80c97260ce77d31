"""Executable reuse as a plan decision: which phases decide it, and what it saves.

A spec's phase may set ``reuse = "exec-update"``: the executor then instantiates one
executable per group of the phase's graphs whose node structure matches and switches
it with ``cuGraphExecUpdate`` before each replay
(``capture_plan.executor.exec_update``). Off by default: a plan without it has no
``reuse`` field and keeps its bytes; a plan with it is revision 7.

What it saves is the graphs' driver memory (graph-exec, ``planner/memory/device.py``: taken at
instantiation, about 3 KB a node) and instantiation time. Which graphs of a phase share
a structure is not known before a capture: a size whose GEMM or attention kernel
differs starts a group of its own. So a build states the bounds (one executable per
phase at best, one per graph at worst), and a capture report of the plan captured with
reuse (``CaptureReport.reuse``: its groups and the nodes of every graph) gives the
figures: :func:`forecast` with that report, which ``planner report`` shows.

Refused: reuse on a piecewise phase (its pieces are the engine's graphs, recorded
between eager ops; the executor does not share them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from capture_plan.schemas.errors import InputError
from capture_plan.schemas.keys import parse_step_id
from capture_plan.schemas.plan import Plan
from capture_plan.schemas.units import mib

from ..inputs.resources import phase_kinds
from .device import whole_chunks

if TYPE_CHECKING:
    from capture_plan.schemas.report import CaptureReport
    from capture_plan.schemas.spec import Phase

__all__ = ["reuse_fields", "PhaseReuse", "forecast", "reuse_lines", "report_reuse_lines"]


def reuse_fields(phase: Phase) -> dict:
    """The ``PhasePlan`` field a spec phase's ``reuse`` gives (none where unset); an
    InputError for a piecewise phase."""
    if phase.reuse is msgspec.UNSET:
        return {}
    if phase_kinds()[phase.kind].piecewise:
        raise InputError(
            f"phase {phase.name!r} is piecewise ({phase.kind}): its piece graphs are the engine's "
            "and share no executable",
            where=f"[[phases]] {phase.name}: reuse",
            fix=f"remove reuse from phase {phase.name!r}",
        )
    return {"reuse": phase.reuse}


class PhaseReuse(msgspec.Struct, frozen=True, kw_only=True):
    """One reuse phase: its graphs and executables, without and with reuse."""

    phase: str
    graphs: int
    #: executables with reuse: measured (a report's groups), else None (between 1 and ``graphs``)
    instantiations: int | None = None
    #: the graphs' driver memory without and with reuse (None: the report counted no nodes
    #: or no per-node figure is known)
    driver_without: int | None = None
    driver_with: int | None = None
    #: where the figures come from, and why the phase decides reuse
    source: str = ""


def _nodes(report: CaptureReport) -> dict[str, int]:
    """``phase/bs`` -> nodes of every graph the report counted (its capture steps)."""
    out = {}
    for m in report.steps:
        op, phase, bs, labels = parse_step_id(m.id)
        if op == "capture" and m.graph_nodes is not None and not labels:
            out[f"{phase}/{bs}"] = m.graph_nodes
    return out


def forecast(plan: Plan, report: CaptureReport | None = None, per_node: float | None = None) -> list[PhaseReuse]:
    """Per phase the plan has reuse: graphs and executables, and with ``report`` (a capture
    of the plan with reuse) and ``per_node`` (driver bytes a node: ``planner/memory/device.py``'s
    figure) the driver memory without and with reuse, in whole 2 MiB steps."""
    reuse = [p for p in plan.phases if p.reuse is not msgspec.UNSET]
    captures: dict[str, int] = {}
    for s in plan.steps:
        if s.op == "capture":
            captures[s.phase] = captures.get(s.phase, 0) + 1
    measured = report.reuse if report is not None and report.reuse is not msgspec.UNSET else None
    nodes = _nodes(report) if report is not None else {}
    out = []
    for p in reuse:
        n = captures.get(p.name, 0)
        if measured is None:
            out.append(
                PhaseReuse(
                    phase=p.name,
                    graphs=n,
                    source="not captured with reuse yet: between 1 and one executable per graph",
                )
            )
            continue
        groups = [g.graphs for g in measured.groups if g.phase == p.name]
        alone = [r.graph for r in measured.refusals if r.graph.startswith(f"{p.name}/")]
        grouped = {m for g in groups for m in g}
        alone = [a for a in alone if a not in grouped]
        execs = len(groups) + len(alone)
        first = [g[0] for g in groups] + alone
        every = [m for g in groups for m in g] + alone
        known = per_node is not None and all(m in nodes for m in every)
        cost = per_node or 0.0
        out.append(
            PhaseReuse(
                phase=p.name,
                graphs=n,
                instantiations=execs,
                driver_without=whole_chunks(sum(nodes[m] for m in every) * cost) if known else None,
                driver_with=whole_chunks(sum(nodes[m] for m in first) * cost) if known else None,
                source="measured: the report's reuse groups and graph nodes"
                + ("" if known else " (nodes or the per-node figure unknown: driver memory not given)"),
            )
        )
    return out


def reuse_lines(plan: Plan, report: CaptureReport | None = None, per_node: float | None = None) -> list[str]:
    """The reuse decisions in words, for ``planner explain`` and ``planner report`` (none
    for a plan without reuse)."""
    rows = forecast(plan, report, per_node)
    if not rows:
        return []
    out = ["", "executable reuse (reuse = exec-update: graphs alike in structure share one executable):"]
    for r in rows:
        execs = (
            f"{r.instantiations} executables for {r.graphs} graphs"
            if r.instantiations is not None
            else f"1 to {r.graphs} executables for {r.graphs} graphs"
        )
        drv = ""
        if r.driver_without is not None and r.driver_with is not None:
            drv = f"; graph-exec {mib(r.driver_with)} with reuse, {mib(r.driver_without)} without"
        out.append(f"- [{r.phase}] {execs}{drv} ({r.source})")
        out.append(
            "    why: the spec's phase sets reuse; a graph whose structure differs (kernel, block, launch "
            "attribute, node type, edges) is instantiated alone, its reason in the capture report"
        )
    return out


def report_reuse_lines(report: CaptureReport, plan: Plan | None) -> list[str]:
    """What reuse did in a capture (``planner report``): the report's own figures, and with
    the plan the driver memory without and with reuse (the device table's per-node figure)."""
    got = report.reuse
    if got is msgspec.UNSET:
        return []
    out = [
        "",
        f"executable reuse: {got.instantiations} executables for {got.graphs} graphs "
        f"({len(got.groups)} shared groups, {len(got.refusals)} graphs refused a group)",
    ]
    if got.clusters:  # the device's cluster probe: why clustered kernels were (not) shared
        out.append(f"  cluster probe: {got.clusters}")
    out += [f"  refused {r.graph}: {r.reason}" for r in got.refusals[:20]]
    if len(got.refusals) > 20:
        out.append(f"  ... (+{len(got.refusals) - 20} more)")
    if plan is not None:
        from .device import capability_of, per_node_figure

        rest = reuse_lines(plan, report, per_node_figure(capability_of(report.device)))
        out += rest[2:] if rest else []
    return out
