"""Types shared by planner and executor: spec, plan, trace, report, errors.

Imports neither torch nor networkx: both sides depend on this package.
``__version__`` is the distribution's version (``capture_plan.__version__``).
"""

import importlib
from typing import TYPE_CHECKING

from capture_plan import __version__

if TYPE_CHECKING:  # the lazy attributes below, as type checkers and editors see them (never run)
    from .errors import CapturePlanError, ConstraintError, DriftError, InputError
    from .plan import (
        PLAN_REVISION,
        PLAN_VERSION,
        Alternative,
        Decision,
        Edge,
        Inputs,
        KeyPrediction,
        PhasePlan,
        Plan,
        Prediction,
        Requires,
        Step,
        StepMemory,
        Strategy,
        VariantAxis,
    )
    from .report import CaptureReport, StepMeasurement
    from .spec import Choice, Model, Phase, Rule, Spec, When
    from .trace import CaptureTrace, Event, Trace

__all__ = [
    "__version__",
    "CapturePlanError",
    "ConstraintError",
    "DriftError",
    "InputError",
    "PLAN_REVISION",
    "PLAN_VERSION",
    "Alternative",
    "Decision",
    "Edge",
    "Inputs",
    "KeyPrediction",
    "PhasePlan",
    "Plan",
    "Prediction",
    "Requires",
    "Step",
    "StepMemory",
    "Strategy",
    "VariantAxis",
    "CaptureReport",
    "StepMeasurement",
    "Choice",
    "Model",
    "Phase",
    "Rule",
    "Spec",
    "When",
    "CaptureTrace",
    "Event",
    "Trace",
]

#: each attribute's module: loaded on first use, so that a command loads only the types it
#: uses (importing capture_plan.schemas.errors runs this file: an eager import here built
#: every schema's classes, the reports' among them, for every command)
_WHERE = {
    "CapturePlanError": ".errors",
    "ConstraintError": ".errors",
    "DriftError": ".errors",
    "InputError": ".errors",
    "PLAN_REVISION": ".plan",
    "PLAN_VERSION": ".plan",
    "Alternative": ".plan",
    "Decision": ".plan",
    "Edge": ".plan",
    "Inputs": ".plan",
    "KeyPrediction": ".plan",
    "PhasePlan": ".plan",
    "Plan": ".plan",
    "Prediction": ".plan",
    "Requires": ".plan",
    "Step": ".plan",
    "StepMemory": ".plan",
    "Strategy": ".plan",
    "VariantAxis": ".plan",
    "CaptureReport": ".report",
    "StepMeasurement": ".report",
    "Choice": ".spec",
    "Model": ".spec",
    "Phase": ".spec",
    "Rule": ".spec",
    "Spec": ".spec",
    "When": ".spec",
    "CaptureTrace": ".trace",
    "Event": ".trace",
    "Trace": ".trace",
}


def __dir__() -> list[str]:
    """The module's names and the lazy ones (``dir()``, editors' and ``help()``'s listings)."""
    return sorted({*globals(), *_WHERE})


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
