"""JSON Schemas of the shared types and the planner's data files, for editors and reviewers."""

from __future__ import annotations

import msgspec

from schemas.errors import InputError
from schemas.plan import Plan
from schemas.report import CaptureReport
from schemas.spec import Spec
from schemas.trace import Trace

from .resources import BackendsFile

__all__ = ["json_schema", "SCHEMAS"]

_TYPES = {"spec": Spec, "plan": Plan, "trace": Trace, "report": CaptureReport, "backends": BackendsFile}
#: what ``planner schema`` prints
SCHEMAS = tuple(_TYPES)


def json_schema(which: str = "all") -> str:
    if which == "all":
        obj = {k: msgspec.json.schema(t) for k, t in _TYPES.items()}
    elif which in _TYPES:
        obj = msgspec.json.schema(_TYPES[which])
    else:
        raise InputError(f"unknown schema {which!r}", where="planner schema", fix=f"use one of all, {', '.join(_TYPES)}")
    return msgspec.json.format(msgspec.json.encode(obj, order="sorted"), indent=2).decode()
