"""``planner build``: the plan of a build's options (planner/inputs/build_options.py).

The build is resolved once (planner/schedule/resolve.py: the spec parsed and validated, the
trace and reports read); the sizes chosen for a traffic on it, when asked (``--sizes auto``:
planner/sizes/, which prices its lists on the resolved build in memory and writes the
decisions the plan records); then the pipeline, once, for the plan (planner/schedule/pipeline.py).
Writing and checking plan files is planner/report/plan_files.py's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from capture_plan.schemas.errors import CapturePlanError
from capture_plan.schemas.plan import BUILD_FLAGS, Plan
from capture_plan.schemas.spec import Spec

from .inputs.build_options import (
    SIZE_CHOICE,
    BuildOptions,
    fix_command,
    retry_fix,
    without_size_choice,
)
from .schedule import pipeline
from .schedule.read import read_spec
from .schedule.resolve import check_tp, resolve

__all__ = ["BuildOptions", "build_plan", "build_spec", "check_tp"]


def build_plan(opts: BuildOptions) -> Plan:
    """Everything ``planner build`` does except writing the file: the build resolved once, the
    sizes chosen for the traffic when ``opts`` asks (``--sizes auto``), then the pipeline."""
    if opts.sizes is None:
        r = resolve(opts)
        plan = pipeline.plan(r)
        if r.kv is not None:  # --engine: a plan whose graphs leave the engine unable to start is refused
            r.kv.check_plan(plan.predicted.kv, r.kv.plan_sizes(plan))
        return plan
    from .sizes.record import size_record  # only --sizes auto reads traffic
    from .sizes.sizes import check_budget, for_build

    r = resolve(opts)
    with _choice_errors(opts):
        choice = for_build(r, worth=True)
    plan = pipeline.plan(r.with_sizes(choice.lists), size_record(choice, r))
    if r.kv is not None:
        r.kv.check_plan(plan.predicted.kv, r.kv.plan_sizes(plan))
    with _choice_errors(opts):
        check_budget(choice, plan)
    return plan


def build_spec(opts: BuildOptions) -> Spec:
    """The spec a build of ``opts`` plans (its phases and sizes; with ``--sizes auto``, the
    sizes chosen for the traffic), read without planning: what a plan of another build is
    checked against (capture_plan.adapters.startup)."""
    if opts.sizes is None:
        return read_spec(opts).spec
    from .sizes.sizes import for_build  # only --sizes auto reads traffic

    r = resolve(opts)
    with _choice_errors(opts):  # the sizes chosen for the traffic on the resolved build
        choice = for_build(r, worth=False)
    return r.with_sizes(choice.lists).spec


@contextlib.contextmanager
def _choice_errors(opts: BuildOptions) -> Iterator[None]:
    """An error of the choice's own inputs (the traffic, the timing report, a limit no list
    meets) names, as its fix, the command that passes: with the option that would
    (``--max-size``, ``--budget-mib``, ``--max-padding``), or capturing the spec's own sizes."""
    assert opts.sizes is not None  # a build that chooses its sizes
    ours = [str(p) for p in (opts.sizes.traffic, opts.sizes.timing) if p is not None]
    ours += [flag for field, flag, _kind in BUILD_FLAGS if field in SIZE_CHOICE]
    try:
        yield
    except CapturePlanError as err:
        if err.retry is None and not (err.where or "").startswith(tuple(ours)):
            raise
        if not retry_fix(err, opts):
            plain = without_size_choice(opts)
            spec_sizes = f"capture the spec's sizes: `{fix_command(plain)}`"
            err.fix = f"{err.fix}; or {spec_sizes}" if err.fix else spec_sizes
        raise
