"""Every item of the free device memory a capture takes, beside the pool.

An engine budgets capture from free device memory (``torch.cuda.mem_get_info``)
before it sizes its KV cache. Besides the graph pools (simulated) a capture
takes, measured on an H200 (torch 2.11):

* ``hoisted``: the plan's hoisted workspaces (from the plan's own steps);
* ``stream-workspace``: the capture stream's cuBLAS workspace, one per stream,
  kept for the process's life (``planner/data/devices.toml``, per compute
  capability);
* ``allocator-other``: other caching-allocator memory the capture leaves
  (the CUDA RNG's graph-safe state, allocated at the first capture, sits in a
  small segment of its own) -- measured;
* ``graph-exec``: driver memory outside the caching allocator that each
  instantiated graph takes. Measured on an H200 (driver 580.159.04): it is
  taken at instantiation (not while recording), grows with the graph's nodes
  (about 3 KB a node, ``planner/data/devices.toml [graph_exec_per_node]``),
  comes in 2 MiB steps, and the driver keeps it when a graph is destroyed:
  a later graph reuses it, so a process's figure is its high-water mark.
  From node counts (:func:`driver_after`) where the report counted them,
  else per graph and per phase.

The measured items come from a *calibration*: a capture report
(``GraphSet.write_report``) whose device view and per-step free memory the
executor measured on a named device and driver. They describe that device,
driver and the report's model code; an item nothing gives is ``unknown``
(None), never 0, and the total is unknown with it. A calibration read from a
file is bound to what it measured (:func:`check_applies`): its graphs' nodes and
warm-up scratch follow the model and backend, so a report of another backend or
model, or one that does not say which, is refused, not scaled.

What it does not model: memory a model's first eager run takes (CUDA loads
kernel modules lazily, outside the allocator): an engine has run its model
before it captures; nor a second process or the engine's own allocations.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import msgspec

from capture_plan.schemas.codec import decode_report
from capture_plan.schemas.errors import InputError
from capture_plan.schemas.files import read_input
from capture_plan.schemas.keys import parse_step_id
from capture_plan.schemas.limits import MAX_INT
from capture_plan.schemas.plan import DeviceCost, DevicePrediction, ModelUsed, Step, StepMemory
from capture_plan.schemas.units import DRIVER_CHUNK

from ..inputs.resources import data

if TYPE_CHECKING:  # reports are read only with --calibration (read_calibration): their types load then
    from capture_plan.schemas.report import CaptureReport

__all__ = [
    "Applies",
    "CaptureFigures",
    "Calibration",
    "read_calibration",
    "check_applies",
    "CALIBRATE",
    "calibration_from_report",
    "device_prediction",
    "capability_of",
    "peak",
    "pools_after",
    "taken_after",
    "graphs_after",
    "graph_exec",
    "per_node_figure",
    "node_figure",
    "driver_after",
    "nodes_at",
    "whole_chunks",
]


class Calibration(msgspec.Struct, frozen=True):
    """Device items measured in one capture report."""

    #: "NVIDIA H200 sm90, torch 2.11.0, driver 580.159.04"
    device: str
    #: "sm90", or "" when the report does not say
    capability: str
    #: bytes of driver memory per instantiated graph, per phase name and phase kind
    graph_exec_per_graph: dict[str, float] = {}
    #: other caching-allocator memory the capture left (besides pools, hoisted, the workspace);
    #: None when the device's workspace figure is unknown (it cannot be told apart)
    allocator_other: int | None = 0
    source: str = ""
    #: per phase name and kind: the largest scratch memory a warm-up of it took (its
    #: temporaries, returned when the warm-up ends); empty when the report does not say
    warmup_scratch: dict[str, int] = {}
    #: nodes of each recorded graph, per phase name and batch size (the report's
    #: graph_nodes); empty when the report did not count them
    graph_nodes: dict[str, dict[int, int]] = {}
    #: per phase name: (driver bytes, nodes) of the report's captures that counted their
    #: nodes; empty when it counted none
    graph_exec_counted: dict[str, tuple[int, int]] = {}
    #: measured nothing: ``planner build --device``'s estimate (planner/memory/graph_nodes.py),
    #: its graph-exec "estimated" and its allocator-other unknown
    estimated: bool = False

    @property
    def graph_exec_per_node(self) -> float | None:
        """Driver bytes per node the report's captures measured (their driver memory over
        their nodes: coarse for a few graphs, since the driver takes 2 MiB at a time);
        None when it counted no nodes."""
        nodes = sum(n for _, n in self.graph_exec_counted.values())
        return sum(b for b, _ in self.graph_exec_counted.values()) / nodes if nodes else None


def capability_of(device: str) -> str:
    """The "smXY" a report's device string names ("NVIDIA H200 sm90, torch 2.11" -> "sm90")."""
    m = re.search(r"\bsm(\d+)\b", device)
    return f"sm{m.group(1)}" if m else ""


def calibration_from_report(rep: CaptureReport, source: str, phases: dict[str, str]) -> Calibration:
    """Measured items from ``rep``; ``phases`` maps the report's phase names to kinds.

    Per capture step: the free-memory drop minus the allocator's growth over the
    step is the driver memory its graph took. Needs a report with a device
    view and per-step memory (executor 0.x of revision-2 plans on)."""
    from capture_plan.schemas.report import DEVICE_ITEMS

    view = rep.device_view
    fix = "capture the plan again with this capture-plan's executor and write its report (GraphSet.write_report)"
    if view is None or any(m.free is None or m.allocator_reserved is None for m in rep.steps):
        raise InputError("the report has no device view or per-step device memory", where=source, fix=fix)
    missing = [n for n in DEVICE_ITEMS if n not in {i.name for i in view.items}]
    if missing:  # an item the report does not give is unknown, never 0
        raise InputError(
            f"the report's device view lacks {', '.join(missing)}", where=f"{source}: $.device_view", fix=fix
        )
    per: dict[str, list[int]] = defaultdict(list)
    scratch: dict[str, int] = {}
    nodes: dict[str, dict[int, int]] = defaultdict(dict)
    counted: dict[str, tuple[int, int]] = {}
    prev_free, prev_res = None, None
    for i, m in enumerate(rep.steps):
        try:
            op, phase, bs, _ = parse_step_id(m.id)  # a graph key's labels: its phase's figures all the same
        except ValueError as err:
            raise InputError(str(err), where=f"{source}: $.steps[{i}].id", fix=fix) from None
        if op == "warmup" and m.scratch is not None:
            for key in (phase, f"kind:{phases.get(phase)}"):
                scratch[key] = max(scratch.get(key, 0), m.scratch)
        if op == "capture" and m.graph_nodes is not None:
            nodes[phase][bs] = m.graph_nodes
        if op == "capture" and prev_free is not None:
            # every step has free and allocator_reserved: checked above, where pyright cannot see it
            took = (prev_free - m.free) - (m.allocator_reserved - prev_res)  # pyright: ignore[reportOperatorIssue]
            if not 0 <= took <= MAX_INT:
                # free memory grew more than the allocator gave back (another process freed memory meanwhile),
                # or fell by more than a device holds: the step measured something besides its graph
                raise InputError(
                    f"capture step {m.id!r} took {took:,} B of device memory besides the allocator's "
                    "(free memory and the allocator's reserve moved apart: something else ran on the device)",
                    where=f"{source}: $.steps[{i}].free",
                    fix="capture the plan again on an otherwise idle device and write its report "
                    "(GraphSet.write_report)",
                )
            per[phase].append(took)
            if m.graph_nodes:
                b, n = counted.get(phase, (0, 0))
                counted[phase] = (b + took, n + m.graph_nodes)
        prev_free, prev_res = m.free, m.allocator_reserved
    if not per:
        raise InputError("the report has no capture step after another step to measure", where=source, fix=fix)
    graph_exec = {}
    for phase, deltas in sorted(per.items()):
        graph_exec[phase] = sum(deltas) / len(deltas)
        kind = phases.get(phase)
        if kind is not None:
            graph_exec.setdefault(f"kind:{kind}", sum(deltas) / len(deltas))
    workspace = data("devices.toml")["stream_workspace"].get(capability_of(rep.device))
    # without the device's workspace figure the workspace cannot be told from the rest of held
    other = (
        None
        if workspace is None
        else max(0, view.item("allocator-held") - workspace) + max(0, view.item("allocator-cached"))
    )
    device = rep.device + (f", driver {rep.driver}" if rep.driver else "")
    return Calibration(
        device=device,
        capability=capability_of(rep.device),
        graph_exec_per_graph=graph_exec,
        allocator_other=other,
        source=source,
        warmup_scratch=scratch,
        graph_nodes={k: dict(sorted(v.items())) for k, v in sorted(nodes.items())},
        graph_exec_counted=dict(sorted(counted.items())),
    )


#: how a calibration of a plan's own backend and model is made (the fix of a calibration refused;
#: ``{build}``: the build without --calibration, where the caller knows it)
CALIBRATE = (
    "build this plan without --calibration{build}, capture it on the device and write its report "
    "(`python -m capture_plan.references.calibrate PLAN REPORT` runs the reference model of the plan's "
    "dimensions; an engine's own model: GraphSet.write_report), then build with --calibration REPORT"
)


def _backend_of(rep: CaptureReport, known: dict) -> str | None:
    """The backend a report measured: its own word, the calibrations table's, else the backend
    whose kernel module it loaded (None: none, or several, do)."""
    if isinstance(rep.backend, str):
        return rep.backend
    if "backend" in known:
        return known["backend"]
    from ..inputs.resources import backends

    names = [name for name, b in backends().items() if rep.backend_module and rep.backend_module in b.modules]
    return names[0] if len(names) == 1 else None


def _model_changes(measured: dict, built: dict, prefix: str = "") -> list[str]:
    """``layers 32 -> 80``: each dimension the report's model and the build's give differently."""
    out = []
    for key in sorted(set(measured) | set(built)):
        a, b = measured.get(key), built.get(key)
        if a != b:
            out.append(f"{prefix}{key} {'unset' if a is None else a} -> {'unset' if b is None else b}")
    return out


class Applies(NamedTuple):
    """What a calibration report must have measured to apply to a build: the build's backend
    and model; ``build``: the command that builds the plan without the calibration (the
    fix's first step), where known."""

    backend: str
    model: ModelUsed
    build: str | None = None


def check_applies(rep: CaptureReport, digest: str, source: str, applies: Applies) -> None:
    """Refuse a calibration report that measured another backend or model than the build's.

    Its driver memory follows its graphs' nodes and its warm-ups' scratch the model's
    tensors: a report of a 32-layer model says nothing of an 80-layer one, and no figure is
    scaled here. What it measured comes from the report (``backend``, ``model``: written
    by the executor), else from ``planner/data/calibrations.toml`` (reports written before,
    by their SHA-256 ``digest``); a report that says neither is refused too. ``build``: the
    command that builds the plan without the calibration (the fix's first step), where known."""
    backend, model, build = applies
    fix = CALIBRATE.format(build=f" (`{build}`)" if build else "")
    known = data("calibrations.toml").get("reports", {}).get(digest, {})
    measured_backend = _backend_of(rep, known)
    if measured_backend is None:
        raise InputError(
            f"the report does not say which attention backend it measured (kernel module {rep.backend_module!r})",
            where=f"{source}: $.backend",
            fix=fix,
        )
    if measured_backend != backend:
        raise InputError(
            f"the calibration measured backend {measured_backend!r}, this build is for {backend!r}",
            where=f"{source}: $.backend",
            fix=fix,
        )
    if isinstance(rep.model, msgspec.UnsetType):
        if "dimensions" not in known:
            raise InputError(
                "the report does not say which model it measured (written before capture reports named "
                "their model), so its graph memory cannot be bound to this build's",
                where=f"{source}: $.model",
                fix=fix,
            )
        dims, phases = known["dimensions"], known.get("phases", {})
    else:
        dims, phases = rep.model.dimensions, rep.model.phases
    changes = _model_changes(dims, model.dimensions)
    for name in sorted(set(phases) | set(model.phases)):
        changes += _model_changes(phases.get(name, {}), model.phases.get(name, {}), f"phase {name} ")
    if changes:
        raise InputError(
            f"the calibration measured another model than this build's ({', '.join(changes)}): its graphs' "
            "driver memory and warm-up scratch follow the model and are not scaled",
            where=f"{source}: $.model",
            fix=fix,
        )


def read_calibration(
    path: Path, phases: dict[str, str], recorded: str, applies: Applies | None = None
) -> tuple[Calibration, bytes]:
    """``path`` as the user gave it (errors name it so); ``recorded``: as the plan records it;
    ``applies``: what the report must have measured (:func:`check_applies`)."""
    shown = str(path)
    raw = read_input(path, "report", fix="give a capture report written by GraphSet.write_report")
    rep = decode_report(raw, shown)
    if applies is not None:
        from capture_plan.schemas.codec import sha256

        check_applies(rep, sha256(raw), shown, applies)
    cal = calibration_from_report(rep, shown, phases)
    return Calibration(
        device=cal.device,
        capability=cal.capability,
        graph_exec_per_graph=cal.graph_exec_per_graph,
        allocator_other=cal.allocator_other,
        source=recorded,
        warmup_scratch=cal.warmup_scratch,
        graph_nodes=cal.graph_nodes,
        graph_exec_counted=cal.graph_exec_counted,
    ), raw


def _lookup(table: dict, phase: str, kinds: dict[str, str]):
    return table.get(phase, table.get(f"kind:{kinds.get(phase)}"))


def pools_after(steps: list[Step], timeline: list[StepMemory]) -> list[int]:
    """After each step: the pools' predicted bytes plus the workspaces hoisted so far
    (provision steps allocate them, outside the pools)."""
    out, hoisted = [], 0
    for s, m in zip(steps, timeline):
        hoisted += s.bytes if s.op == "provision" else 0
        out.append(m.reserved + hoisted)
    return out


def peak(steps: list[Step], taken: list[float], scratch: dict[str, int], kinds: dict[str, str]) -> int | None:
    """The most free memory the capture takes at any moment: after each step, and during
    each warm-up (what was taken before it plus its ``scratch``). ``taken``: the free memory
    taken before the first step, then after each step (:func:`taken_after`). None when a
    warm-up's scratch is unknown."""
    top = max([0.0, *taken[1:]])
    for s, before in zip(steps, taken):
        if s.op == "warmup":
            sc = _lookup(scratch, s.phase, kinds)
            if sc is None:
                return None
            top = max(top, before + sc)
    return int(round(top))


def taken_after(pool_after: list[int], fixed: int, graphs: Sequence[float]) -> list[float]:
    """The free memory a capture has taken before its first step (``fixed`` bytes), then after
    each: the pools' bytes (:func:`pools_after`), ``fixed`` and the graphs' driver memory so
    far (:func:`graphs_after`, or :func:`driver_after`): what :func:`peak` reads."""
    return [fixed] + [after + fixed + g for after, g in zip(pool_after, graphs)]


def whole_chunks(nbytes: float) -> int:
    """``nbytes`` of driver memory as the driver takes it: rounded up to whole
    :data:`DRIVER_CHUNK` steps."""
    return -(-int(round(nbytes)) // DRIVER_CHUNK) * DRIVER_CHUNK


def per_node_figure(capability: str) -> int | None:
    """Driver bytes per graph node on devices of ``capability`` ("sm90"), from
    ``planner/data/devices.toml [graph_exec_per_node]``; None where none is listed."""
    return data("devices.toml").get("graph_exec_per_node", {}).get(capability)


def nodes_at(recorded: dict[int, int], bs: int) -> float:
    """The nodes of a graph of batch size ``bs`` from the counts ``recorded`` at
    other sizes of the same phase: the count itself where recorded, else linear
    between the nearest recorded sizes (a kernel that changes with the size changes
    the count by a few nodes of ~900; the plans' sizes lie within the recorded
    ones), the nearest count outside them."""
    if bs in recorded:
        return float(recorded[bs])
    xs = sorted(recorded)
    lo = max((x for x in xs if x < bs), default=None)
    hi = min((x for x in xs if x > bs), default=None)
    if lo is None or hi is None:
        return float(recorded[hi if lo is None else lo])  # pyright: ignore[reportArgumentType]  # one of them is set
    return recorded[lo] + (recorded[hi] - recorded[lo]) * (bs - lo) / (hi - lo)


def driver_after(
    steps: list[Step], nodes: dict[str, dict[int, int]], per_node: float | dict[str, float], held: int = 0
) -> list[int] | None:
    """The graphs' driver memory taken from free memory after each step: their
    nodes so far times ``per_node`` (one figure, or one per phase), in whole
    :data:`DRIVER_CHUNK` steps, less ``held`` bytes the driver already holds from
    graphs destroyed earlier in the process (it reuses them). None when a captured
    phase has no node counts or no figure."""
    out, total = [], 0.0
    for s in steps:
        if s.op == "capture":
            rec = nodes.get(s.phase)
            cost = per_node.get(s.phase) if isinstance(per_node, dict) else per_node
            if not rec or cost is None:
                return None
            total += nodes_at(rec, s.bs) * cost
        out.append(max(0, whole_chunks(total) - held))
    return out


def graphs_after(steps: list[Step], per_graph: dict[str, float], kinds: dict[str, str]) -> list[float] | None:
    """The driver memory of the graphs captured so far, after each step, at ``per_graph``
    bytes a graph (per phase, or per ``kind:NAME``); None when a captured phase's figure is
    unknown."""
    out, total = [], 0.0
    for s in steps:
        if s.op == "capture":
            g = _lookup(per_graph, s.phase, kinds)
            if g is None:
                return None
            total += g
        out.append(total)
    return out


def graph_exec(steps: list[Step], per_graph: dict[str, float], kinds: dict[str, str]) -> float | None:
    """The driver memory of every graph the steps capture; None when a phase's figure is unknown."""
    after = graphs_after(steps, per_graph, kinds)
    return None if after is None else after[-1] if after else 0.0


class CaptureFigures(msgspec.Struct, frozen=True, kw_only=True):
    """What the simulation predicts of a capture, that the device items are built on."""

    #: the pools' peak and the hoisted workspaces' bytes
    pool: int
    hoisted: int
    #: the steps captured, in order
    steps: list[Step]
    #: the pools' bytes after each step (:func:`pools_after`; None: not known, no peak)
    pool_after: list[int] | None = None
    #: bytes the warm-ups allocate that the engine keeps, outside every pool (the
    #: ``warmup-kept`` item; None: the plan declares none, and has no such item)
    kept: int | None = None


def device_prediction(
    figures: CaptureFigures, kinds: dict[str, str], calibration: Calibration | None
) -> DevicePrediction:
    """The plan's device items and their total (None while one is unknown), from the
    simulation's ``figures`` and the device's ``calibration``.

    ``kinds`` maps the plan's phases to their kinds: a calibration measured on
    a plan with other phase names still gives the graph-exec figure of a phase
    of the same kind."""
    pool, hoisted, steps = figures.pool, figures.hoisted, figures.steps
    pool_after, kept = figures.pool_after, figures.kept
    how = "build with --calibration REPORT (a capture report of this plan measured on the device)"
    items = [
        DeviceCost(name="pool", bytes=pool, provenance="simulated", source="allocator simulation"),
        DeviceCost(name="hoisted", bytes=hoisted, provenance="simulated", source="the plan's provision steps"),
    ]
    if kept is not None:
        items.append(
            DeviceCost(name="warmup-kept", bytes=kept, provenance="simulated", source="the plan's warm-up steps' keeps")
        )
    if calibration is None:
        items += [
            DeviceCost(name=n, provenance="unknown", source=f"not measured for any device: {how}")
            for n in ("stream-workspace", "allocator-other", "graph-exec")
        ]
        return DevicePrediction(items=items)
    ws = data("devices.toml")["stream_workspace"].get(calibration.capability)
    items.append(
        DeviceCost(
            name="stream-workspace",
            bytes=ws,
            provenance="data" if ws is not None else "unknown",
            source=f"planner/data/devices.toml [stream_workspace] {calibration.capability}"
            if ws is not None
            else f"no figure for {calibration.capability or 'this device'} in "
            "planner/data/devices.toml [stream_workspace]: measure it and add it",
        )
    )
    items.append(
        DeviceCost(
            name="allocator-other",
            bytes=calibration.allocator_other,
            provenance="measured" if calibration.allocator_other is not None else "unknown",
            source=f"{calibration.source} ({calibration.device})"
            if calibration.allocator_other is not None
            else f"not estimated: {how}"
            if calibration.estimated
            else "the calibration's device has no workspace figure to tell it apart",
        )
    )
    per_graph = calibration.graph_exec_per_graph
    total = graph_exec(steps, per_graph, kinds)
    driver, node_source = _from_nodes(steps, calibration)
    if driver is not None:
        items.append(
            DeviceCost(
                name="graph-exec",
                bytes=driver[-1] if driver else 0,
                provenance="estimated" if calibration.estimated else "measured",
                source=f"{calibration.source} ({calibration.device}): {node_source}",
            )
        )
    elif calibration.estimated:  # no nodes per layer for the model, or no per-node figure for the device
        why = "no node count for its model" if not calibration.graph_nodes else "no per-node figure for the device"
        items.append(DeviceCost(name="graph-exec", provenance="unknown", source=f"{calibration.source}: {why}: {how}"))
    elif total is None:
        missing = sorted({s.phase for s in steps if s.op == "capture" and _lookup(per_graph, s.phase, kinds) is None})
        items.append(
            DeviceCost(
                name="graph-exec",
                provenance="unknown",
                source=f"{calibration.source} measured no phase like {', '.join(missing)}: {how}",
            )
        )
    else:
        items.append(
            DeviceCost(
                name="graph-exec",
                bytes=int(round(total)),
                provenance="measured",
                source=f"{calibration.source} ({calibration.device}): per graph, per phase",
            )
        )
    known = [i.bytes for i in items if i.bytes is not None]
    total = sum(known) if len(known) == len(items) else None
    top: int | None = None
    if total is not None and pool_after is not None and calibration.warmup_scratch:
        # the workspace and other allocator memory; pool_after holds the pools and hoisted bytes
        # (a known total: every item's bytes are known, graph-exec's too)
        graph_bytes = next(i.bytes for i in items if i.name == "graph-exec")
        fixed = total - pool - hoisted - graph_bytes  # warmup-kept counted from the start: an upper bound  # pyright: ignore[reportOperatorIssue]
        graphs = driver if driver is not None else graphs_after(steps, per_graph, kinds)
        if graphs is not None:
            top = peak(steps, taken_after(pool_after, fixed, graphs), calibration.warmup_scratch, kinds)
    largest = max([i.bytes or 0 for i in items] + [total or 0, top or 0])
    if largest > MAX_INT:  # a plan holds no number past 2**53 (schemas/codec.py): it would not read back
        raise InputError(
            f"the calibration predicts {largest:,} B of device memory, more than any device holds",
            where=calibration.source,
            fix="capture the plan again on an otherwise idle device and write its report (GraphSet.write_report)",
        )
    return DevicePrediction(
        device=calibration.device,
        items=items,
        total_bytes=total,
        # top is set only where total is known
        **({"peak_bytes": max(top, total)} if top is not None and total is not None else {}),
    )


def node_figure(calibration: Calibration) -> tuple[float | None, str]:
    """Driver bytes per node for ``calibration``'s device and where the figure comes
    from: the device table's, else what the calibration's own captures measured."""
    listed = per_node_figure(calibration.capability)
    if listed is not None:
        table = f"planner/data/devices.toml [graph_exec_per_node] {calibration.capability}"
        return float(listed), f"{listed} B a node ({table})"
    if calibration.graph_exec_per_node is not None:
        return calibration.graph_exec_per_node, (
            f"{calibration.graph_exec_per_node:.0f} B a node, measured on the calibration's own graphs "
            "(coarse: the driver takes 2 MiB at a time)"
        )
    return None, ""


def _from_nodes(steps: list[Step], calibration: Calibration) -> tuple[list[int] | None, str]:
    """The graphs' driver memory after each step from the calibration's node counts, or
    (None, "") when it counted none for some captured phase or no per-node figure is known."""
    if not calibration.graph_nodes:
        return None, ""
    per_node, where = node_figure(calibration)
    if per_node is None:
        return None, ""
    driver = driver_after(steps, calibration.graph_nodes, per_node)
    if driver is None:
        return None, ""
    counted = "estimated per graph" if calibration.estimated else "as counted there"
    return driver, f"the graphs' nodes {counted}, {where}, in 2 MiB steps"
