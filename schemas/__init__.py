"""Types shared by planner and executor: spec, plan, trace, report, errors.

Imports neither torch nor networkx: both sides depend on this package.
"""

from .errors import CapturePlanError, ConstraintError, DriftError, InputError
from .plan import (PLAN_REVISION, PLAN_VERSION, Alternative, Decision, Edge, Inputs, PhasePlan,
                   Plan, Prediction, Requires, Step, StepMemory, Strategy)
from .report import CaptureReport, StepMeasurement
from .spec import Choice, Model, Phase, Rule, Spec, When
from .trace import CaptureTrace, Event, Trace

__all__ = [
    "CapturePlanError", "ConstraintError", "DriftError", "InputError",
    "PLAN_REVISION", "PLAN_VERSION", "Alternative", "Decision", "Edge", "Inputs", "PhasePlan",
    "Plan", "Prediction", "Requires", "Step", "StepMemory", "Strategy",
    "CaptureReport", "StepMeasurement",
    "Choice", "Model", "Phase", "Rule", "Spec", "When",
    "CaptureTrace", "Event", "Trace",
]
