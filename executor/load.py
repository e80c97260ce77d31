"""``load_plan``: read a plan at engine start-up and check it fits this machine.

Torch-free on purpose (the environment is passed in or probed lazily), so that
plan validation runs in CPU-only CI. Checks, in order: the file reads and
decodes (a regular file under the plan size limit); version (newer is
refused with the fix); digest (tampering, truncation); consistency
(``capture_plan.schemas.plan_check.validate_plan``: steps, edges, timeline, tp); environment
fingerprint: compute capability, torch version, backend kernels importable. A mismatch is an error
for plans built with ``--ci`` (CI must run exactly what was reviewed) and a
warning otherwise. The tensor-parallel size is checked against the actual
group by ``capture`` (``capture_plan.executor.distributed.check_plan_agreement``), which
knows the group; a process's world may be larger (data parallelism).
"""

from __future__ import annotations

import importlib.util
import warnings
from dataclasses import dataclass
from pathlib import Path

from capture_plan.schemas.codec import decode_plan
from capture_plan.schemas.files import read_input
from capture_plan.schemas.keys import PlanIndex
from capture_plan.schemas.plan import Plan

from .errors import EnvironmentMismatch

__all__ = ["Environment", "load_plan", "current_environment", "check_environment", "backend_module"]


@dataclass(frozen=True)
class Environment:
    """What the executor runs on; compared with a plan's ``requires``."""

    device: str
    capability: tuple[int, int]
    torch: str
    modules: frozenset[str]

    def describe(self) -> str:
        return f"{self.device} sm{self.capability[0]}{self.capability[1]}, torch {self.torch}"


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def _torch_ok(spec: str, version: str) -> bool:
    """Supports ">=X.Y" and ">=X.Y,<A.B" ranges (all the plan writes)."""
    v = _version_tuple(version)
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        op, ver = (clause[:2], clause[2:]) if clause[:2] in (">=", "<=", "==") else (clause[:1], clause[1:])
        t = _version_tuple(ver)
        ok = {">=": v >= t, "<=": v <= t, "==": v[: len(t)] == t, ">": v > t, "<": v < t}.get(op)
        if not ok:
            return False
    return True


def backend_module(plan: Plan, modules: frozenset[str]) -> str | None:
    return next((m for m in plan.requires.modules if m in modules), None)


def current_environment(modules: tuple[str, ...] = ()) -> Environment:
    """Probe this process: GPU 0 of torch.cuda, torch's version, importable modules."""
    import torch

    found = frozenset(m for m in modules if importlib.util.find_spec(m) is not None)
    if not torch.cuda.is_available():
        return Environment("no CUDA device", (0, 0), str(torch.__version__), found)
    cap = torch.cuda.get_device_capability()
    return Environment(torch.cuda.get_device_name(), (cap[0], cap[1]), str(torch.__version__), found)


def check_environment(plan: Plan, env: Environment) -> list[str]:
    """Every way ``env`` does not fit ``plan`` (empty: it fits)."""
    req = plan.requires
    problems = []
    if env.capability < tuple(req.min_compute_capability):
        problems.append(
            f"needs compute capability >= {req.min_compute_capability[0]}.{req.min_compute_capability[1]}"
            f", this is {env.device} ({env.capability[0]}.{env.capability[1]})"
        )
    if not _torch_ok(req.torch, env.torch):
        problems.append(f"needs torch {req.torch}, this is {env.torch}")
    if backend_module(plan, env.modules) is None:
        problems.append(f"backend {req.backend} kernels not importable (any of {', '.join(req.modules)})")
    return problems


def load_plan(path: str | Path, *, env: Environment | None = None, check_env: bool = True) -> Plan:
    """Load, validate and environment-check a plan file.

    ``env`` defaults to probing this process (imports torch). Does not import
    networkx, click or the planner.
    """
    path = Path(path)
    plan = decode_plan(read_input(path, "plan"), str(path))
    if check_env:
        env = env if env is not None else current_environment(tuple(plan.requires.modules))
        problems = check_environment(plan, env)
        if problems:
            text = "; ".join(problems)
            if plan.inputs.ci:
                raise EnvironmentMismatch(
                    f"plan does not fit this machine: {text}",
                    where=str(path),
                    fix="rebuild the plan for this machine, or run where it was planned for",
                )
            warnings.warn(f"{path}: plan does not fit this machine: {text}", stacklevel=2)
    PlanIndex.of(plan)  # its one index, built once: the loop, the GraphSet and the plugins ask it
    return plan
