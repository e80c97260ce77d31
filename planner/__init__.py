"""capture-plan planner: spec + rules -> predicted, reviewed capture plan.

CPU only; never imports torch (tests/test_no_torch.py). Library entry points:

- :func:`build_plan` / :class:`BuildOptions` -- what ``planner build`` does;
- :func:`check_plan` -- build in memory and compare with the file (drift);
- :class:`PoolSim` -- the caching-allocator simulator;
- :func:`default_spec` -- the embedded Llama-3-8B-shaped spec.
"""

from .allocator import PoolSim
from .build import BuildOptions, build_plan, check_plan, plan_bytes, write_atomic
from .specs import default_spec

__all__ = ["BuildOptions", "build_plan", "check_plan", "plan_bytes", "write_atomic", "PoolSim", "default_spec"]
