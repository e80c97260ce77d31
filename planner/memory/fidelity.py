"""Which model code a plan's figures describe, and how far they may be from the engine's.

The analytic programs (planner/memory/analytic.py) emit the allocations of
capture-plan's own reference decode step and its speculative phases
(``capture_plan.references.decode``, ``capture_plan.references.speculative``): for those the prediction
is exact. An engine or a library implements a real model its own way (its
attention over the whole cache, copies of repeated KV heads, its MoE
routing), so for a model given by its ``config.json``, or for MoE dimensions
the reference does not implement, the same figures are approximate: measured
for transformers' implementations they were 77-89% low and 107-154% high
(``planner/data/accuracy.toml``). A plan predicted from a trace recorded of
the captured model is exact for it.
"""

from __future__ import annotations

import msgspec

from capture_plan.schemas.plan import Fidelity
from capture_plan.schemas.spec import Model

from ..inputs.resources import data

__all__ = ["fidelity", "REFERENCE", "TRACE_COMMANDS"]

REFERENCE = (
    "capture-plan's reference decode step and its speculative phases (capture_plan.references), "
    "from the model's dimensions"
)
#: the few-size trace that makes a prediction exact for the engine's own model
TRACE_COMMANDS = (
    "record a few sizes of your own model on the GPU: `capture_plan.executor.profile(plan, target)` then "
    "`capture_plan.executor.write_trace(trace, 'trace.json')`, and build with `--trace trace.json` "
    "(or `capture_plan.adapters.startup.predict_startup(target, options)` at engine start-up)"
)


def _nearest(model_type: str | None, moe: bool) -> tuple[str, dict]:
    rows = data("accuracy.toml")["measured"]
    if model_type is not None:
        for name, row in rows.items():
            if model_type in row["families"]:
                return name, row
    for name, row in rows.items():  # unknown family: the MoE row for MoE, else the first dense one
        if bool(row.get("moe")) == moe or (moe and "moe" in name):
            return name, row
    return next(iter(rows.items()))


def fidelity(
    source: str, model: Model, config: tuple[str, str, str | None] | None, describes_trace: str = ""
) -> tuple[Fidelity, str, str]:
    """(fidelity, describes, caveat) of a plan predicted from ``source`` ("analytic" or "trace").

    ``config``: the ``config.json`` the dimensions came from, as the build read it (its path,
    digest and ``model_type``), None where they did not."""
    from_config, model_type = config is not None, config[2] if config is not None else None
    if source == "trace":
        return "recorded", f"the recorded trace {describes_trace}".rstrip(), ""
    moe = not isinstance(model.experts, msgspec.UnsetType)
    if not from_config and not moe:
        return "reference", REFERENCE, ""
    name, row = _nearest(model_type, moe)
    why = (
        f"model {model_type!r} from its config.json" if from_config else "MoE dimensions"
    ) + ", which the reference does not implement as an engine does"
    caveat = (
        f"approximate: the figures describe the reference, not the engine's code ({why}); for the nearest "
        f"benchmarked architecture, {name} in transformers, the analytic pool was {row['error']:+.0%} off "
        f"({row['predicted_mib']} MiB predicted, {row['measured_mib']} measured); to make it exact, " + TRACE_COMMANDS
    )
    return "approximate", REFERENCE, caveat


def require_exact(plan, where: str) -> None:
    """``--require-exact``: refuse a plan whose figures are approximate for the captured model.

    What it catches: builds from a ``config.json`` or with MoE dimensions (the
    analytic figures were measured 77-154% off for transformers' code). A spec
    that types a real model's dimensions into ``[model]`` is "reference" and
    passes: the planner cannot tell it from the reference step it describes."""
    from capture_plan.schemas.errors import ConstraintError

    if plan.predicted.fidelity == "approximate":
        raise ConstraintError(
            "the prediction is approximate: " + plan.predicted.caveat.removeprefix("approximate: "),
            where=where,
            fix="build from a trace of the engine's own model "
            "(capture_plan.executor.profile, then --trace), or drop --require-exact",
        )
