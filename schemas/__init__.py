"""Types shared by planner and executor: spec, plan, trace, report, errors.

Imports neither torch nor networkx: both sides depend on this package.
``__version__`` is the distribution's version (pyproject.toml reads it from here).
"""

__version__ = "0.1.0"

from .errors import CapturePlanError, ConstraintError, DriftError, InputError
from .plan import (
                   PLAN_REVISION,
                   PLAN_VERSION,
                   Alternative,
                   Decision,
                   Edge,
                   Inputs,
                   PhasePlan,
                   Plan,
                   Prediction,
                   Requires,
                   Step,
                   StepMemory,
                   Strategy,
)
from .report import CaptureReport, StepMeasurement
from .spec import Choice, Model, Phase, Rule, Spec, When
from .trace import CaptureTrace, Event, Trace

__all__ = [
    "__version__",
    "CapturePlanError", "ConstraintError", "DriftError", "InputError",
    "PLAN_REVISION", "PLAN_VERSION", "Alternative", "Decision", "Edge", "Inputs", "PhasePlan",
    "Plan", "Prediction", "Requires", "Step", "StepMemory", "Strategy",
    "CaptureReport", "StepMeasurement",
    "Choice", "Model", "Phase", "Rule", "Spec", "When",
    "CaptureTrace", "Event", "Trace",
]
