"""``python -m capture_plan.references.calibrate PLAN REPORT``: a calibration report for a plan.

Captures ``PLAN`` on this machine's GPU with the reference model of the plan's own
dimensions (``Plan.inputs.model``: the decode reference, or the speculative reference for a
plan with draft phases, random weights) and writes the capture report, which names the
plan's backend and model: ``planner build ... --calibration REPORT`` then applies its device
figures to builds of that backend and model only (planner/memory/device.py ``check_applies``).

What it does not do: measure an engine's own model (its kernels differ: capture with the
engine's target and ``GraphSet.write_report``), or a plan without recorded dimensions
(revision < 4: build it again); speculative plans are captured as the EAGLE preset's
(3 draft steps, top-1), which a plan does not record.
"""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["target_for", "main"]


def target_for(plan):
    """The reference CaptureTarget of ``plan``'s model, sized for its largest capture size.
    Raises ValueError for a plan that records no model or whose phase kinds the references
    do not run."""
    import msgspec

    from capture_plan.schemas.spec import Model

    used = plan.inputs.model
    if isinstance(used, msgspec.UnsetType):
        raise ValueError(f"plan {plan.name!r} records no model dimensions (revision < 4): build it again")
    model = Model(name=used.name, **used.dimensions)
    max_bs = max(max(p.sizes) for p in plan.phases)
    kinds = {p.name: p.kind for p in plan.phases}
    if set(kinds.values()) <= {"decode", "target_verify"}:
        from capture_plan.references.decode import ReferenceConfig, ReferenceModel

        return ReferenceModel(ReferenceConfig(model=model, max_bs=max_bs), backend=plan.requires.backend)
    from capture_plan.references.speculative import PHASES, SpeculativeConfig, SpeculativeModel

    unknown = sorted(set(kinds.values()) - set(PHASES))
    if unknown:
        raise ValueError(f"the references run no phase of kind {', '.join(unknown)}")
    layers = {p.name: used.phases.get(p.name, {}).get("layers") for p in plan.phases if p.kind.startswith("draft")}
    cfg = SpeculativeConfig(
        model=model,
        draft_layers=next((n for n in layers.values() if n), 1),
        max_bs=max_bs,
        num_steps=3,  # the EAGLE preset's (a plan records no draft steps or top-k)
        topk=1,
        phases=kinds,
    )
    return SpeculativeModel(cfg, backend=plan.requires.backend)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m capture_plan.references.calibrate PLAN REPORT", file=sys.stderr)
        return 2
    from capture_plan.executor import capture, load_plan

    plan = load_plan(args[0])
    graphs = capture(plan, target_for(plan))
    graphs.write_report(Path(args[1]))
    print(f"{args[1]}: the capture report of {args[0]} on this device: build with --calibration {args[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
