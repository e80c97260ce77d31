"""``python -m capture_plan.planner`` is the ``planner`` command."""

from .cli import script

script()
