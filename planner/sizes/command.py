"""What ``planner sizes`` computes: the build resolved once (planner/schedule/resolve.py), its
sizes chosen for a traffic on it (:func:`~capture_plan.planner.sizes.sizes.choose`), and the plan
built with the chosen lists, whose figures are the ones reported for them.

``planner build --sizes auto`` composes the same steps in planner/build.py; the table and the
spec ``planner sizes`` writes are planner/sizes/output.py's.
"""

from __future__ import annotations

import msgspec

from capture_plan.schemas.spec import Spec

from ..schedule import pipeline
from ..schedule.resolve import resolve
from .sizes import SizesOptions, SizesResult, check_budget, choose

__all__ = ["choose_sizes"]


def _with_sizes(spec: Spec, lists: dict[str, list[int]]) -> Spec:
    """``spec`` capturing ``lists`` (phase -> sizes; a phase it does not name keeps its own)."""
    return msgspec.structs.replace(
        spec, phases=[msgspec.structs.replace(p, sizes=sorted(lists.get(p.name, p.sizes))) for p in spec.phases]
    )


def choose_sizes(opts: SizesOptions, *, worth: bool = False) -> SizesResult:
    """Everything ``planner sizes`` computes: each traffic phase's front, the engines'
    defaults priced alike, the chosen lists (:func:`~capture_plan.planner.sizes.sizes.choose`),
    and the plan built with them. With ``worth``, also why each chosen size is in (one more
    simulation per size)."""
    r = resolve(opts.build)
    choice = choose(r, opts, worth=worth)
    plan = pipeline.plan(r.with_sizes(choice.lists))
    if r.kv is not None:  # --engine: the chosen lists' graphs leave the engine unable to start
        r.kv.check_plan(plan.predicted.kv, r.kv.plan_sizes(plan))
    check_budget(choice, plan)
    device = plan.predicted.device
    calibrated = r.calibration is not None
    fid = plan.predicted
    return SizesResult(
        phases=choice.phases,
        traffic=choice.traffic,
        spec=_with_sizes(r.spec_read.source, choice.lists),
        plan=plan,
        memory_source=f"simulated ({fid.source} model, {fid.allocator} allocator) under the spec's schedule: "
        + "; ".join(f"{n} {st.label()}" for n, st in choice.schedule.items()),
        device_source=(
            f"device total: {device.device} ({'; '.join(f'{i.name} {i.provenance}' for i in device.items)})"
            if calibrated and device is not None
            else "device total: unknown (build with --calibration REPORT, a capture report measured on the device)"
        ),
        budget=choice.budget,
        notes=list(choice.traffic.notes) + ([fid.caveat] if fid.caveat else []),
    )
