"""capture-plan planner: spec + rules -> predicted, reviewed capture plan.

CPU only; never imports torch (tests/test_no_torch.py). Library entry points:

- :func:`build_plan` / :class:`BuildOptions` -- what ``planner build`` does;
- :func:`check_plan` -- build in memory and compare with the file (drift);
- :class:`PoolSim` -- the caching-allocator simulator;
- :func:`default_spec` -- the embedded Llama-3-8B-shaped spec.

Attributes load on first use so that ``planner --help`` does not pay for
networkx.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the lazy attributes below, as type checkers and editors see them (never run)
    from .build import build_plan
    from .inputs.build_options import BuildOptions
    from .inputs.specs import default_spec
    from .memory.allocator import PoolSim
    from .report.plan_files import check_plan, plan_bytes

__all__ = ["BuildOptions", "build_plan", "check_plan", "plan_bytes", "PoolSim", "default_spec"]

_WHERE = {
    "BuildOptions": ".inputs.build_options",
    "build_plan": ".build",
    "check_plan": ".report.plan_files",
    "plan_bytes": ".report.plan_files",
    "PoolSim": ".memory.allocator",
    "default_spec": ".inputs.specs",
}


def __getattr__(name: str):
    if name == "__version__":  # one source: schemas.__version__ (pyproject reads it too)
        from capture_plan.schemas import __version__

        return __version__
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name], __name__), name)
    raise AttributeError(f"module 'planner' has no attribute {name!r}")
