"""Capture report: what the executor measured against what the plan predicted."""

from __future__ import annotations

import msgspec

__all__ = ["ReportStruct", "StepMeasurement", "CaptureReport"]


class ReportStruct(msgspec.Struct, frozen=True, kw_only=True):
    """Base of report types (lenient: reports are read across revisions)."""


class StepMeasurement(ReportStruct, kw_only=True):
    step: int
    id: str
    #: measured reserved bytes of the plan's pools after the step
    reserved: int
    predicted_reserved: int
    seconds: float


class CaptureReport(ReportStruct, kw_only=True):
    plan: str
    plan_digest: str
    device: str
    torch: str
    backend_module: str
    pool_bytes: int
    predicted_pool_bytes: int
    capture_seconds: float
    hoisted_bytes: int = 0
    steps: list[StepMeasurement] = []
