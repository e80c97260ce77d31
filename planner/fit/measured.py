"""fit's optional inputs from capture-plan's own files: a plan (``--plan``: its capture
sizes and phases, its predicted pool) and a calibration (``--calibration``: a capture
report measured on the device, as ``planner build --calibration`` takes it).

Both are read by the planner's existing readers (planner/memory/device.py's
read_calibration, planner/report/check.py's check_report_plan); this module only turns
what they give into fit's figures, and refuses a file that describes another model or
device than fit's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import msgspec

from capture_plan.schemas.errors import InputError
from capture_plan.schemas.fit import FitItem
from capture_plan.schemas.plan import Plan

from .inputs import PlanGraphs
from .model import FitModel
from .refusal import Refusal
from .tables import MiB, device

__all__ = ["plan_graphs", "calibration_graph"]

#: the dimensions a plan's model and fit's must agree on (the pool follows them)
_DIMENSIONS = ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "dtype_bytes")


def plan_graphs(plan: Plan, source: str, model: FitModel) -> PlanGraphs:
    """The plan's graphs: its sizes (every phase's), its capture steps and its predicted
    pool (pool + hoisted workspaces). Refused when the plan's model differs from ``model``
    in a dimension the pool follows."""
    used = plan.inputs.model
    if not isinstance(used, msgspec.UnsetType):
        ours = msgspec.structs.asdict(model)
        changes = [
            f"{k} {used.dimensions[k]} -> {ours[k]}"
            for k in _DIMENSIONS
            if k in used.dimensions and used.dimensions[k] != ours[k]
        ]
        if changes:
            raise InputError(
                f"plan {plan.name!r} was built for model {used.name!r}, not {model.name!r} ({', '.join(changes)})",
                where=f"--plan {source}",
                fix=f"give --model the plan's model ({used.preset or used.name}), or build a plan for this model",
            )
    sizes = sorted({s for p in plan.phases for s in p.sizes})
    graphs = sum(1 for s in plan.steps if s.op == "capture")
    pool = plan.predicted.pool_bytes + plan.predicted.hoisted_bytes
    from capture_plan.planner.inputs.specs import speculative_kinds

    return PlanGraphs(
        name=plan.name,
        sizes=sizes,
        graphs=graphs,
        pool_bytes=pool,
        source=source,
        backend=plan.requires.backend,
        speculative=any(p.kind in speculative_kinds() for p in plan.phases),
    )


def calibration_graph(
    path: Path, device_name: str, plan: Plan | None, plan_source: str, check_plan: Callable[..., None]
) -> FitItem:
    """Graph memory as the calibration report measured it on the device: the pool, the
    hoisted workspaces, graph-exec (the driver's memory outside the allocator) and the
    other allocator memory the capture held (the stream's workspaces): status
    ``measured``, its error bar the driver's 2 MiB granularity or 1%. Refused when the
    report was measured on another device than ``device_name``, or, with ``plan``, was
    not captured from that plan (``check_plan``: planner/report/check.py's check_report_plan,
    handed down by the caller: the report layer sits above fit, which sizes and builds price
    KV tokens with)."""
    from capture_plan.planner.memory.device import read_calibration
    from capture_plan.schemas.codec import decode_report, sha256
    from capture_plan.schemas.report import DEVICE_ITEMS

    shown = str(path)
    phases = {} if plan is None else {p.name: p.kind for p in plan.phases}
    cal, raw = read_calibration(path, phases, shown)
    dev_name, _ = device(device_name)
    measured_on = cal.device.split(" sm")[0]
    if measured_on != dev_name:
        what, where = (
            f"the calibration was measured on {cal.device!r}, not on --device {dev_name!r}",
            f"--calibration {shown}",
        )
        leave = " (or leave --calibration out: fit estimates the graph memory)"
        try:
            near = device(measured_on)[0]
        except InputError:
            raise InputError(what, where=where, fix=f"capture on {dev_name} and give its report{leave}") from None
        # a Refusal: planner fit renders its change as this command on the device measured
        raise Refusal(what, where=where, hint=f"fit for the device it measured{leave}", changes={"device": near})
    rep = decode_report(raw, shown)
    if plan is not None:
        check_plan(rep, plan, shown, plan_source, sha256(raw))
    view = rep.device_view
    assert view is not None  # read_calibration refuses a report without one
    parts = {name: view.item(name) for name in DEVICE_ITEMS}
    b = sum(parts.values())
    shown_parts = {
        "pool": parts["pool"],
        "hoisted": parts["hoisted"],
        "graph-exec": parts["outside-allocator"],
        "workspaces": parts["allocator-held"] + parts["allocator-cached"],
    }
    detail = " + ".join(f"{k} {v / MiB:.1f} MiB" for k, v in shown_parts.items())
    return FitItem(
        "graph memory", b, max(2 * MiB, b // 100), "measured", f"calibration {shown} ({cal.device}): {detail}"
    )
