"""A start-up calibration: what one start-up prediction measured, kept for the next start-up.

``capture_plan.adapters.startup.predict_startup(cache=...)`` writes one after it
has recorded a model, and reads it back on a later start-up of the same model
on the same device, driver, torch and backend instead of recording again
(``capture_plan.adapters.calibration_cache``). Everything in it is the
figure of a process that has captured nothing yet: what a later start-up
will pay, since it records nothing before it captures.

Strict (unknown fields refused) and versioned: a cache entry of another
revision is recorded again, never read loosely.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from .limits import NonNegative
from .plan import Plan

__all__ = ["STARTUP_VERSION", "StartupCalibration"]

#: bump when a field's meaning changes: entries of another version are recorded again
STARTUP_VERSION = 1


class StartupCalibration(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """What a start-up recording measured, in a fresh process's terms.

    The timeline a later start-up predicts is ``plan``'s pools after each step,
    plus ``stream_workspace`` from the capture's start, less the capture stream's
    cuBLAS workspace that start-up made when it primed the stream, plus
    ``allocator_other`` from the first capture on (the RNG state's segment), plus
    ``driver``. Written only from a process's first capture: the driver reuses
    released graphs' memory, so a later one's driver figures are not a fresh
    process's.
    """

    format: Literal["capture-plan.startup-calibration"] = "capture-plan.startup-calibration"
    version: int = STARTUP_VERSION
    #: what it was measured for (model, device, driver, torch, backend, schedule, ...):
    #: a start-up whose key differs in any of them records again
    key: dict[str, str]
    #: the plan built from the recording: the capture follows it
    plan: Plan
    #: sizes recorded per phase
    recorded: dict[str, list[int]]
    #: allocator memory outside the pools held after the recording: the capture stream's
    #: workspace and what the target made and kept
    stream_workspace: NonNegative
    #: allocator memory outside the pools left cached by the recording (the RNG state's segment)
    allocator_other: NonNegative
    #: the graphs' driver memory after each of ``plan.steps``, in a fresh process; None when
    #: the nodes were not counted (then ``graph_exec_per_graph`` is the figure)
    driver: list[NonNegative] | None
    #: driver bytes per graph, per phase, where ``driver`` is None
    graph_exec_per_graph: dict[str, float] = {}
    #: the largest scratch a warm-up of each phase took (its temporaries, returned after it)
    warmup_scratch: dict[str, NonNegative] = {}
    #: how the driver figure was made (StartupPrediction.graph_exec)
    graph_exec: str = ""
    #: the device the measurement names ("NVIDIA H200 sm90, torch 2.11.0+cu130, driver 580.159.04")
    device: str = ""
