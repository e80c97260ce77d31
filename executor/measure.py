"""What a capture measured: one figure per plan step, progress, and the capture report.

:class:`Measurements` is the capture loop's (:mod:`capture_plan.executor.loop`)
record keeper: ``step`` appends one :class:`StepMeasurement` per plan step
(the pools' growth so far against the plan's timeline, the free device
memory, a warm-up's scratch peak, a graph's node count), ``landed`` logs
progress as graphs land, ``report`` writes the :class:`CaptureReport` from
one snapshot of every pool (the authoritative figure) and the device view.
It measures; it runs nothing on the device.
"""

from __future__ import annotations

import logging
import time

import msgspec
import torch

from capture_plan.schemas.plan import Plan, Step
from capture_plan.schemas.report import CaptureReport, ReportModel, StepMeasurement
from capture_plan.schemas.units import mib

from .device import Probe, device_view, driver_version, probe
from .graphs import Captured, GraphSet
from .load import backend_module, current_environment
from .logs import log, rank_tag
from .pool import pool_usage

__all__ = ["Measurements"]

#: whether a capture by capture-plan has completed in this process: the first one
#: pays the driver's one-off graph-capture cost (the device view says which it was)
_captured_in_process = False


class Measurements:
    """Per-step figures of one capture and its report.

    ``show``: this process logs progress and the summary (rank 0 of the
    capture's group); ``bar``: a tqdm bar or None; ``t_start``: when the
    capture was asked for (``time.perf_counter``)."""

    def __init__(self, plan: Plan, device, *, bar, show: bool, t_start: float):
        self.plan, self.device, self.bar, self.show, self.t_start = plan, device, bar, show, t_start
        self.predicted = {m.step: m.reserved for m in plan.predicted.timeline}
        self.steps: list[StepMeasurement] = []
        #: bytes the graph pools grew by so far
        self.reserved = 0
        self.env = current_environment(tuple(plan.requires.modules))
        self.captures = sum(s.op == "capture" for s in plan.steps)
        #: the device before the first step (taken when the loop opens)
        self.before: Probe | None = None
        self.first_in_process = not _captured_in_process

    def step(self, step: Step, t0: float, *, scratch: int | None = None, nodes: int | None = None) -> None:
        """Record the measurement of ``step``, which began at ``t0`` (``time.perf_counter``)."""
        free, _ = torch.cuda.mem_get_info(self.device)  # no sync: the device's figure as of now
        self.steps.append(
            StepMeasurement(
                step=step.index,
                id=step.id,
                reserved=self.reserved,
                predicted_reserved=self.predicted.get(step.index, 0),
                seconds=time.perf_counter() - t0,
                free=int(free),
                allocator_reserved=int(torch.cuda.memory_reserved(self.device)),
                scratch=scratch,
                graph_nodes=nodes if step.op == "capture" else None,
            )
        )
        if self.bar is not None:
            self.bar.set_postfix_str(f"{step.id} free {free / 2**30:.1f} GiB", refresh=False)
            self.bar.update(1)

    def landed(self, gs: GraphSet, cap: Captured, background: bool) -> None:
        """Progress as graphs land: the first of each phase, every quarter, the last."""
        if not self.show:  # progress is rank 0's to tell
            return
        done = len(gs.timeline)
        first = len(gs.table(cap.phase).sizes) == 1
        # Background: an operator wants to know when serving gets graphs and how far it is.
        level = logging.INFO if background else logging.DEBUG
        quarter = max(self.captures // 4, 1)
        if first or done % quarter == 0 or done == self.captures:
            log.log(
                level,
                "capture-plan: %d/%d graphs in %.2f s%s; ready: %s",
                done,
                self.captures,
                time.perf_counter() - self.t_start,
                f" ({cap.phase} servable up to n={cap.bs})" if first else "",
                gs.progress(),
            )

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def report(
        self,
        gs: GraphSet,
        *,
        background: bool,
        outside_graphs: int = 0,
        kept: int | None = None,
        profiling: dict[str, int] | None = None,
    ) -> CaptureReport:
        """The exact pool snapshot, the device view and the report (after the last step).

        ``outside_graphs``: graphs recorded into the pools outside the loop (an
        engine's piecewise wrappers in its global pool): what the pools hold
        beyond the loop's own graphs is theirs, reported apart (``outside_bytes``),
        never as the loop's. ``kept``: bytes the warm-ups kept (None: none
        declared). ``profiling``: the keys a profiling pass captured per phase."""
        self.close_bar()
        plan = self.plan
        exact, pool_allocated = pool_usage(gs.pools.values())  # one snapshot: the authoritative figure
        reserved = self.reserved
        outside = msgspec.UNSET
        if outside_graphs:
            outside = max(exact - reserved, 0)
            exact = reserved
        if exact != reserved:
            log.warning(
                "capture-plan%s: per-step pool figures are approximate: counted %d B, the pools hold %d B "
                "(something else allocated during capture)",
                rank_tag(),
                reserved,
                exact,
            )
            reserved = exact
        elapsed = time.perf_counter() - self.t_start  # the whole call, from capture() on
        hoisted = sum(w.numel() for w in gs.workspaces.values())
        view = None
        if self.before is not None:
            global _captured_in_process
            _captured_in_process = True
            view = device_view(
                self.before,
                probe(self.device),
                pool_reserved=exact,
                pool_allocated=pool_allocated,
                hoisted=sum(w.untyped_storage().nbytes() for w in gs.workspaces.values()),
                first_in_process=self.first_in_process,
                background=background,
            )
        report = CaptureReport(
            plan=plan.name,
            plan_digest=plan.digest,
            device=self.env.describe(),
            torch=str(torch.__version__),
            backend_module=backend_module(plan, self.env.modules) or "",
            pool_bytes=reserved,
            predicted_pool_bytes=plan.predicted.pool_bytes,
            capture_seconds=elapsed,
            hoisted_bytes=hoisted,
            steps=self.steps,
            driver=driver_version(),
            device_view=view,
            outside_graphs=outside_graphs if outside_graphs else msgspec.UNSET,
            outside_bytes=outside,
            warmup_kept_bytes=kept if kept is not None else msgspec.UNSET,
            profiling=profiling if profiling is not None else msgspec.UNSET,
            # what a calibration from this report applies to (planner/memory/device.py binds it)
            backend=plan.requires.backend,
            model=msgspec.UNSET
            if isinstance(plan.inputs.model, msgspec.UnsetType)
            else ReportModel(dimensions=dict(plan.inputs.model.dimensions), phases=dict(plan.inputs.model.phases)),
            reuse=gs.reuse_report(),
        )
        if self.show:
            pred = plan.predicted.pool_bytes
            delta = f" ({(reserved - pred) / pred:+.1%})" if pred else ""
            log.info(
                "capture-plan: %d graphs of %s in %.2f s; pool %s MiB, predicted %s MiB%s%s",
                len(gs.graphs),
                plan.name,
                elapsed,
                mib(reserved, unit=False),
                mib(pred, unit=False),
                delta,
                f"; free device memory {mib(view.drop, unit=False)} MiB less" if view is not None else "",
            )
        return report
