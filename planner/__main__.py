"""``python -m capture_plan.planner`` is the ``planner`` command."""

import sys

from .cli import main

sys.exit(main())
