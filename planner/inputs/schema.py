"""JSON Schemas of the shared types and the planner's data files, for editors and reviewers."""

from __future__ import annotations

from typing import Any

import msgspec

from capture_plan.schemas.errors import InputError
from capture_plan.schemas.fit import FitResult
from capture_plan.schemas.plan import Plan
from capture_plan.schemas.report import CaptureReport
from capture_plan.schemas.spec import Spec
from capture_plan.schemas.trace import Trace

from .resources import BackendsFile, PhaseKindsFile, phase_kinds

__all__ = ["json_schema", "SCHEMAS"]

_TYPES = {
    "spec": Spec,
    "plan": Plan,
    "trace": Trace,
    "report": CaptureReport,
    "backends": BackendsFile,
    "phase-kinds": PhaseKindsFile,
    "fit": FitResult,
}
#: what ``planner schema`` prints
SCHEMAS = tuple(_TYPES)

# Where a phase kind's name sits in each schema ($defs type, property, then the
# keys down to the string). The shared types accept any name (the kinds are
# planner data the executor does not read); the planner's schemas list the
# kinds of planner/data/phase_kinds.toml, so an editor completes them.
_KIND_FIELDS = {
    "spec": (("Phase", "kind"), ("When", "phase_kind", "anyOf", 0, "items")),
    "plan": (("PhasePlan", "kind"),),
}


def _model_required(schema: dict[str, Any]) -> None:
    """A spec's ``[model]`` gives every dimension, or names a config or a preset for
    the rest (capture_plan.planner.inputs.dimensions): msgspec cannot say so, JSON Schema can."""
    from .dimensions import REQUIRED

    node = schema["$defs"]["Model"]
    node["anyOf"] = [{"required": ["config"]}, {"required": ["preset"]}, {"required": list(REQUIRED)}]


def _schema(which: str) -> dict[str, Any]:
    schema = msgspec.json.schema(_TYPES[which])
    if which == "spec":
        _model_required(schema)
    kinds = phase_kinds()
    for def_name, prop, *path in _KIND_FIELDS.get(which, ()):
        node = schema["$defs"][def_name]["properties"][prop]
        for key in path:
            node = node[key]
        node.clear()
        node.update(
            {
                "enum": list(kinds),
                "description": "a phase kind (planner/data/phase_kinds.toml): "
                + "; ".join(f"{name}: {kind.description}" for name, kind in kinds.items()),
            }
        )
    return schema


def json_schema(which: str = "all") -> str:
    if which == "all":
        obj = {k: _schema(k) for k in _TYPES}
    elif which in _TYPES:
        obj = _schema(which)
    else:
        raise InputError(
            f"unknown schema {which!r}", where="planner schema", fix=f"use one of all, {', '.join(_TYPES)}"
        )
    return msgspec.json.format(msgspec.json.encode(obj, order="sorted"), indent=2).decode()
