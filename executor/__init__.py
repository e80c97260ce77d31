"""capture-plan executor: load a plan, capture exactly as planned, replay, verify.

Engine start-up::

    from capture_plan.executor import load_plan, capture
    plan = load_plan("plans/fa3-ci.json")
    graphs = capture(plan, target)         # target implements CaptureTarget
    out = graphs.replay("decode", n)

An engine that keeps its own capture loop iterates the plan's steps inside
it (``capture_loop``, :mod:`capture_plan.executor.loop`); graphs it captured without a
plan are checked through ``adopt`` (:mod:`capture_plan.executor.engine`) and ``verify``.
A start-up with a graph file an earlier one saved restores the graphs instead of capturing
them (``restore_or_capture``: :mod:`capture_plan.executor.graph_restore`).
``weak_view(t)`` is the non-owning output view the "view" policy holds, for
an engine's own capture code.

``load_plan`` and the dispatch table are torch-free; everything else imports
torch on first use. Never imports networkx, click or the planner.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from capture_plan.schemas import __version__

from . import errors
from .dispatch import PadTable
from .errors import *  # noqa: F403 (the errors: errors.__all__, exported below)
from .load import Environment, check_environment, load_plan

if TYPE_CHECKING:  # the lazy attributes (_LAZY), as type checkers and editors see them (never run)
    from .distributed import check_plan_agreement
    from .driver import capture
    from .engine import EngineFunctions, adopt, record_graphs
    from .graph_restore import restore, restore_or_capture
    from .graphs import GraphSet
    from .loop import CaptureLoop, LoopStep, capture_loop
    from .pool import weak_view
    from .profiling import profile, write_trace
    from .target import CaptureTarget
    from .verification import verify

__all__ = [
    "__version__",
    "load_plan",
    "Environment",
    "check_environment",
    "PadTable",
    "capture",
    "restore",
    "restore_or_capture",
    "GraphSet",
    "CaptureTarget",
    "verify",
    "profile",
    "write_trace",
    "check_plan_agreement",
    "capture_loop",
    "CaptureLoop",
    "LoopStep",
    "adopt",
    "EngineFunctions",
    "record_graphs",
    "weak_view",
]
__all__ += errors.__all__  # the executor's errors

_LAZY = {
    "capture": ".driver",
    "restore": ".graph_restore",
    "restore_or_capture": ".graph_restore",
    "GraphSet": ".graphs",
    "CaptureTarget": ".target",
    "verify": ".verification",
    "profile": ".profiling",
    "write_trace": ".profiling",
    "check_plan_agreement": ".distributed",
    "capture_loop": ".loop",
    "CaptureLoop": ".loop",
    "LoopStep": ".loop",
    "adopt": ".engine",
    "EngineFunctions": ".engine",
    "record_graphs": ".engine",
    "weak_view": ".pool",
}


def __getattr__(name: str):
    # torch-using parts load on first use so that load_plan works without torch.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'executor' has no attribute {name!r}")
