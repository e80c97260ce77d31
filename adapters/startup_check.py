"""The check of a start-up prediction against the capture that followed it.

:func:`confirm_startup` compares a capture's report with its :class:`StartupPrediction`
(step by step, the peak and the figure after capture, to :data:`OVER`/:data:`UNDER`)
and removes a cache entry the capture contradicts; :func:`measured_peak` reads a
report's peak as ``predict_startup`` predicts it. Both are public: engines import them
from :mod:`capture_plan.adapters.startup`, which re-exports them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from capture_plan.adapters.calibration_cache import CalibrationCache
from capture_plan.adapters.startup_figures import StartupPrediction
from capture_plan.schemas.errors import InputError

log = logging.getLogger("capture_plan.startup")

MiB = 2**20


@dataclass(frozen=True)
class StartupCheck:
    """A capture's measured drop against its start-up prediction (:func:`confirm_startup`)."""

    #: what the engine relied on held: no step took more than predicted, and the figure it
    #: budgeted (the peak) and the one left after capture are close (:data:`UNDER`, :data:`OVER`)
    ok: bool
    #: steps compared, those within ``max(2 MiB, 1%)`` either way, those that took more than
    #: predicted beyond :data:`UNDER`
    steps: int
    within: int
    above: int
    #: the step furthest off: (step id, predicted bytes, measured bytes); None without steps
    worst: tuple[str, int, int] | None
    #: (predicted, measured) bytes: the peak (what the KV cache was sized against) and after capture
    peak: tuple[int, int] = (0, 0)
    final: tuple[int, int] = (0, 0)
    #: whether the prediction's cache entry was removed because the capture contradicted it
    discarded: bool = False

    def describe(self) -> str:
        mib = 2**20
        text = (
            f"start-up prediction {'held' if self.ok else 'MISSED'}: peak {self.peak[0] / mib:.0f} MiB predicted, "
            f"{self.peak[1] / mib:.0f} measured; after capture {self.final[0] / mib:.0f}/{self.final[1] / mib:.0f}; "
            f"{self.within}/{self.steps} steps within 1% or 2 MiB, {self.above} took more than predicted"
        )
        if self.worst is not None:
            step, predicted, measured = self.worst
            text += f", worst {step}: predicted {predicted / mib:.0f} MiB, measured {measured / mib:.0f} MiB"
        return text + (" (its cache entry was removed: the next start-up records again)" if self.discarded else "")


#: how far a start-up prediction may be off and still hold (:func:`confirm_startup`): above
#: what the capture took, 1% or one 2 MiB driver step; below it (the unsafe side), 0.5% or
#: one step (the driver's late step, measured on an H200, is one)
OVER, UNDER, STEP = 0.01, 0.005, 2 * MiB


def measured_peak(report) -> int:
    """The most free memory a capture took at any moment, from its report: after each step,
    and during each warm-up its scratch (returned by the step's end) on top of what was
    taken before it or after it (what the warm-up itself keeps is there while its
    temporaries are)."""
    view = report.device_view
    top, prev = view.drop, 0
    for m in report.steps:
        if m.free is None:
            continue
        drop = view.free_before - m.free
        top = max(top, drop, max(prev, drop) + (m.scratch or 0))
        prev = drop
    return top


def _holds(predicted: int, measured: int) -> bool:
    if predicted >= measured:
        return predicted - measured <= max(STEP, OVER * measured)
    return measured - predicted <= max(STEP, UNDER * measured)


def confirm_startup(pred: StartupPrediction, report) -> StartupCheck:
    """Compare the report of the capture that followed ``pred`` (``GraphSet.report`` of a
    foreground capture of ``pred.plan``, in the same process) with the prediction.

    The prediction held when no step took more free memory than predicted (beyond 0.5% or
    2 MiB: :data:`UNDER`), and the peak (the figure the engine sized its KV cache against)
    and the figure after capture are within that below and 1% or 2 MiB above (:data:`OVER`).
    A step in between predicted higher than it took is on the safe side and does not fail
    it: a process that recorded nothing takes the graphs' driver memory in 2 MiB steps a
    step or two later than their nodes say (measured on an H200; docs/measurements.md), and
    catches up by the end. Where it did not hold, the prediction's cache entry (read or
    written; not one another start-up has written since) is removed, so that the next
    start-up records the model again, and a warning is logged: the engine sized its KV
    cache from that figure, and its margin is what covered the difference this time.
    Without per-step figures (the driver's figure per graph, or a report without free
    memory per step) the peak and the final figure alone are compared. A background
    capture's report is refused: the engine's own allocations meanwhile are in its
    figures."""
    view = report.device_view
    fix = "pass GraphSet.report of the foreground capture of pred.plan that followed the prediction"
    if view is None or view.background:
        what = (
            "has no device view" if view is None else "is of a background capture (the engine's allocations are in it)"
        )
        raise InputError(f"the capture report {what}", where="confirm_startup", fix=fix)
    if report.plan_digest != pred.plan.digest:
        raise InputError(
            f"the report is of plan {report.plan!r} ({report.plan_digest}), the prediction's is "
            f"{pred.plan.name!r} ({pred.plan.digest})",
            where="confirm_startup",
            fix=fix,
        )
    rows = [
        (m.id, pred.timeline[m.step], view.free_before - m.free)
        for m in report.steps
        if m.free is not None and pred.timeline and m.step < len(pred.timeline)
    ]
    final = (pred.final_bytes, view.drop)
    peak = (pred.pending_bytes, measured_peak(report))
    within = sum(abs(p - m) <= max(STEP, OVER * m) for _, p, m in rows)
    above = sum(m > p and not _holds(p, m) for _, p, m in rows)
    worst = max(rows, key=lambda r: abs(r[1] - r[2]), default=None)
    ok = not above and _holds(*peak) and _holds(*final)
    discarded = False
    if not ok and pred.cache_path is not None and pred.calibration is not None:
        discarded = CalibrationCache(pred.cache_path.parent).discard(pred.calibration.key, pred.calibration)
    check = StartupCheck(
        ok=ok, steps=len(rows), within=within, above=above, worst=worst, peak=peak, final=final, discarded=discarded
    )
    (log.info if ok else log.warning)(check.describe())
    return check
