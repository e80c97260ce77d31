"""A capture report for the tests that read one (schemas/report.py's ``CaptureReport``): the
fields a test does not look at are filled in once, here, so each test names only those it checks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from capture_plan.schemas.report import CaptureReport, StepMeasurement


def capture_report(planned: Any = None, steps: Sequence[StepMeasurement] = (), **fields: Any) -> CaptureReport:
    """A report of the plan ``planned`` (its name and digest; none: "p" and "d") measured on an H200 with
    torch 2.11 and no backend module, nothing reserved, one second of capture, with ``steps``;
    ``fields`` in place of any of those, and the report's other fields."""
    base: dict[str, Any] = {
        "plan": planned.name if planned is not None else "p",
        "plan_digest": planned.digest if planned is not None else "d",
        "device": "NVIDIA H200 sm90",
        "torch": "2.11",
        "backend_module": "",
        "pool_bytes": 0,
        "predicted_pool_bytes": 0,
        "capture_seconds": 1.0,
        "steps": list(steps),
    }
    return CaptureReport(**{**base, **fields})


def report_json(steps: Sequence[StepMeasurement] = (), **fields: Any) -> dict[str, Any]:
    """:func:`capture_report` of no plan as its JSON file holds it, for the tests that change a
    field to a value the report's type refuses and decode it: one byte of pool, predicted
    and measured, unless ``fields`` say otherwise."""
    return msgspec.to_builtins(capture_report(None, steps, **{"pool_bytes": 1, "predicted_pool_bytes": 1, **fields}))
