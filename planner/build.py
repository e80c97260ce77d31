"""``planner build``: the plan of a build's options (planner/build_options.py).

The sizes chosen for a traffic first, when asked (``--sizes auto``: planner/sizes.py,
which prices its lists with the pipeline), then the pipeline (planner/pipeline.py:
resolve, optimize, order, predict, assemble). Writing and checking plan files is
planner/plan_files.py's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from capture_plan.schemas.errors import CapturePlanError
from capture_plan.schemas.plan import BUILD_FLAGS, Plan
from capture_plan.schemas.spec import Spec

from .inputs.build_options import SIZE_CHOICE, BuildOptions, check_size_choice, command_for_cwd, without_size_choice
from .schedule import pipeline
from .schedule.pipeline import check_tp

if TYPE_CHECKING:
    from .sizes.sizes import SizesResult

__all__ = ["BuildOptions", "build_plan", "build_spec", "check_tp"]


def build_plan(opts: BuildOptions) -> Plan:
    """Everything ``planner build`` does except writing the file: the sizes chosen for the
    traffic when ``opts`` asks (``--sizes auto``), then the pipeline."""
    return pipeline.build_plan(opts, _chosen(opts))


def build_spec(opts: BuildOptions) -> Spec:
    """The spec a build of ``opts`` plans (its phases and sizes; with ``--sizes auto``, the
    sizes chosen for the traffic), read without planning: what a plan of another build is
    checked against (capture_plan.adapters.startup)."""
    return pipeline.build_spec(opts, _chosen(opts))


def _chosen(opts: BuildOptions) -> SizesResult | None:
    """The sizes chosen for ``opts.traffic`` (planner/sizes.py), or None when the build captures
    the spec's. An error of the choice's own inputs (the traffic, the timing report, a limit no
    list meets) names, as its fix, the command that passes: with the option that would
    (``--max-size``, ``--budget-mib``, ``--max-padding``), or capturing the spec's own sizes."""
    plain = without_size_choice(opts)
    if opts == plain:
        return None
    check_size_choice(opts)
    pipeline.build_spec(plain)  # the spec's own errors, as a build without the choice gives them
    from .sizes.sizes import for_build  # only --sizes auto reads traffic

    ours = [str(p) for p in (opts.traffic, opts.timing) if p is not None]
    ours += [flag for field, flag, _kind in BUILD_FLAGS if field in SIZE_CHOICE]
    try:
        return for_build(opts)
    except CapturePlanError as err:
        if err.retry is None and not (err.where or "").startswith(tuple(ours)):
            raise
        if err.retry is not None:
            err.fix = f"{err.fix}: `{command_for_cwd(msgspec.structs.replace(opts, **err.retry))}`"
        else:
            err.fix = f"{err.fix}; or capture the spec's sizes: `{command_for_cwd(plain)}`"
        raise
