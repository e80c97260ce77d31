"""Types shared by planner and executor: spec, plan, trace, report, errors.

Imports neither torch nor networkx: both sides depend on this package.
``__version__`` is the distribution's version (``capture_plan.__version__``).
"""

from capture_plan import __version__

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
