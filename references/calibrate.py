"""``python -m capture_plan.references.calibrate PLAN REPORT``: a calibration report for a plan.

Captures ``PLAN`` on this machine's GPU with the reference model of the plan's own
dimensions (``Plan.inputs.model``: the decode reference, or the speculative reference for a
plan with draft phases, random weights) and writes the capture report, which names the
plan's backend and model: ``planner build ... --calibration REPORT`` then applies its device
figures to builds of that backend and model only (planner/memory/device.py ``check_applies``).

It runs on the GPU the plan is for. Checked before anything is captured, each one line and
exit 1 (``calibrate: error: ...``): the plan reads and names its dimensions and phase kinds
the references run; ``REPORT``'s folder exists; this machine has torch and a CUDA device, of
the plan's compute capability, torch and backend kernels (``capture_plan.executor.load``'s
check, strict here: a report of another device or backend would calibrate the wrong one). The
fix of a machine without a CUDA device is the same command on the GPU machine.

What it does not do: measure an engine's own model (its kernels differ: capture with the
engine's target and ``GraphSet.write_report``), or a plan without recorded dimensions
(revision < 4: build it again); speculative plans are captured as the EAGLE preset's
(3 draft steps, top-1), which a plan does not record.
"""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["target_for", "check_runnable", "check_machine", "calibrate", "main"]


def _decode_only(plan) -> bool:
    return {p.kind for p in plan.phases} <= {"decode", "target_verify"}


def check_runnable(plan) -> None:
    """ValueError where the references cannot run ``plan``: it records no model dimensions, or
    has phase kinds the references do not run (where torch is there to read them from).
    Checked before the device: needs no GPU."""
    import msgspec

    if isinstance(plan.inputs.model, msgspec.UnsetType):
        raise ValueError(f"plan {plan.name!r} records no model dimensions (revision < 4): build it again")
    import importlib.util

    if _decode_only(plan) or importlib.util.find_spec("torch") is None:
        return  # without torch the speculative reference cannot be read: check_machine refuses that
    from capture_plan.references.speculative import PHASES

    unknown = sorted({p.kind for p in plan.phases} - set(PHASES))
    if unknown:
        raise ValueError(f"the references run no phase of kind {', '.join(unknown)}")


def target_for(plan):
    """The reference CaptureTarget of ``plan``'s model, sized for its largest capture size.
    Raises ValueError for a plan that records no model or whose phase kinds the references
    do not run (:func:`check_runnable`)."""
    from capture_plan.schemas.spec import Model

    check_runnable(plan)
    used = plan.inputs.model
    model = Model(name=used.name, **used.dimensions)
    max_bs = max(max(p.sizes) for p in plan.phases)
    kinds = {p.name: p.kind for p in plan.phases}
    if _decode_only(plan):
        from capture_plan.references.decode import ReferenceConfig, ReferenceModel

        return ReferenceModel(ReferenceConfig(model=model, max_bs=max_bs), backend=plan.requires.backend)
    from capture_plan.references.speculative import SpeculativeConfig, SpeculativeModel

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


def _needs(plan) -> str:
    """What the machine needs, in words: the plan's requirements."""
    req = plan.requires
    cap = ".".join(map(str, req.min_compute_capability))
    return (
        f"a CUDA GPU of compute capability >= {cap}, torch {req.torch} and backend {req.backend}'s kernels "
        f"(any of {', '.join(req.modules)})"
    )


def check_machine(plan, plan_path: str, report: str, environment=None) -> None:
    """:class:`~capture_plan.executor.errors.EnvironmentMismatch` (one line, the command to run on
    the GPU machine as its fix) where this machine cannot capture ``plan``: no torch, no CUDA
    device, or the plan's requirements unmet (``environment``: the probe, for tests)."""
    import importlib.util

    from capture_plan.executor.errors import EnvironmentMismatch
    from capture_plan.executor.load import check_environment, current_environment

    rerun = (
        f"run `python -m capture_plan.references.calibrate {plan_path} {report}` on a machine with {_needs(plan)}, "
        f"then build with --calibration {report}"
    )
    if environment is None and importlib.util.find_spec("torch") is None:
        raise EnvironmentMismatch(
            "capturing a calibration report needs torch and a CUDA device; this Python has no torch",
            where=plan_path,
            fix=rerun + " (the executor's dependencies there: pip install torch numpy tqdm)",
        )
    env = environment if environment is not None else current_environment(tuple(plan.requires.modules))
    if env.capability == (0, 0):
        raise EnvironmentMismatch(
            f"capturing a calibration report needs a CUDA device; this machine has none (torch {env.torch})",
            where=plan_path,
            fix=rerun,
        )
    problems = check_environment(plan, env)
    if problems:
        raise EnvironmentMismatch(
            f"this machine cannot capture the plan for its calibration: {'; '.join(problems)}",
            where=plan_path,
            fix=rerun,
        )


def calibrate(plan_path: str, report: str) -> Path:
    """The capture report of ``plan_path`` on this machine's GPU, written to ``report``; every
    check first (:func:`check_runnable`, the report's folder, :func:`check_machine`), so that
    a refusal loses nothing and costs no capture."""
    from capture_plan.executor.load import load_plan
    from capture_plan.schemas.errors import InputError

    plan = load_plan(plan_path, check_env=False)
    try:
        check_runnable(plan)
    except ValueError as err:
        raise InputError(str(err), where=plan_path, fix=f"planner build ... -o {plan_path} with this planner") from None
    out = Path(report)
    if not out.parent.is_dir():
        raise InputError(f"the report's folder {out.parent} is not there", where=report, fix=f"mkdir -p {out.parent}")
    check_machine(plan, plan_path, report)
    from capture_plan.executor import capture

    graphs = capture(plan, target_for(plan))
    graphs.write_report(out)
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m capture_plan.references.calibrate PLAN REPORT", file=sys.stderr)
        return 2
    from capture_plan.schemas.errors import CapturePlanError

    try:
        calibrate(args[0], args[1])
    except CapturePlanError as err:
        print(f"calibrate: error: {err}", file=sys.stderr)
        return err.exit_code
    print(f"{args[1]}: the capture report of {args[0]} on this device: build with --calibration {args[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
