"""What a restore refuses before it runs anything: pure checks of a graph file against a plan and a process.

``capture_plan.executor.graph_restore`` measures the process (:class:`Here`, made by its
``process_environment``) and asks :func:`restore_refusals` for every reason it cannot go on
before any kernel runs: what the file is valid for against the process
(``graph_validity.check_valid``: the plan's digest, the device, driver, torch, every kernel
library by digest, every named tensor by name and size, no address in a segment a restore
cannot relocate), and what :func:`file_refusals` reads from the file and the plan alone: the
plan's graph keys and pools against the file's, no piecewise phase, every pool segment a size
torch's allocator cuts (``restore_layout.layout_refusals``), every node one the rebuild makes
exactly (``graph_rebuild.rebuild_refusals``), every function attribute the file records one
the restore sets (``kernel_loading.function_refusals``), no stale argument word
(``graph_validity.stale_addresses``); and this driver's TMA encoding, one process.
:func:`inspect_refusals` is what ``python -m capture_plan.executor.graph_file inspect FILE
--plan PLAN`` prints: every refusal that needs no process. Each refusal is one line.

Torch-free where the caller passes the process in: tests make every refusal on the CPU
(tests/test_restore.py).
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field

import msgspec

from capture_plan.schemas.graph_file import GraphFile
from capture_plan.schemas.keys import PlanIndex
from capture_plan.schemas.plan import Plan

from .dispatch import dispatch_name
from .errors import ExecutorError
from .graph_flat import graph_builder
from .graph_rebuild import rebuild_refusals
from .graph_validity import GraphEnvironment, check_valid, stale_addresses
from .kernel_loading import function_refusals
from .restore_layout import layout_refusals

__all__ = [
    "Here",
    "plan_keys",
    "planned_workspaces",
    "plan_refusals",
    "file_refusals",
    "restore_refusals",
    "inspect_refusals",
]


@dataclass
class Here:
    """What this process offers a restore before any kernel runs: the device, its environment
    (pools and library workspaces still to come), its named tensors (the target's and the
    caller's), why this driver's TMA descriptors cannot be relocated ("": they can), its ranks,
    the engine's ranges (name -> (address, bytes) here: memory it owns outside torch's allocator)."""

    device: object
    env: GraphEnvironment
    tensors: dict[str, object] = field(default_factory=dict)
    tensor_map: str = ""
    ranks: int = 1
    engine: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: the seconds measuring it took, by part (``graph_restore.process_environment``)
    parts: dict[str, float] = field(default_factory=dict)


def plan_keys(plan: Plan) -> dict[tuple[str, int], str]:
    """(dispatch name, size) -> pool of every graph ``plan`` captures."""
    index = PlanIndex.of(plan)
    return {
        (dispatch_name(s.phase, index.labels(s) if s.phase in index.phases else ()), s.bs): s.pool
        for s in plan.steps
        if s.op == "capture"
    }


def planned_workspaces(plan: Plan) -> dict[str, int]:
    """The plan's hoisted workspaces as a graph file names them (``workspace.PHASE``) -> the
    bytes of the tensor a capture allocates for each (``CaptureLoop.setup``)."""
    return {f"workspace.{s.phase}": max(s.bytes, 1) for s in plan.steps if s.op == "provision"}


def plan_refusals(plan: Plan) -> list[str]:
    """One line per reason a restore refuses any file of ``plan``: its piecewise phases."""
    index = PlanIndex.of(plan)
    return [
        f"phase {p.name!r} records pieces between eager attention ops: a restore makes whole graphs, as capture() does"
        for p in plan.phases
        if index.piecewise(p.name)
    ]


def file_refusals(file: GraphFile, plan: Plan | None = None, parts: dict[str, float] | None = None) -> list[str]:
    """One line per reason a restore refuses ``file`` that the file alone shows (its pools'
    segment sizes, its nodes, its function records, stale argument words) and, with ``plan``,
    the plan against it (its graph keys and pools, piecewise phases: :func:`plan_refusals`).
    ``parts``: filled with the seconds of each (``plan``, ``layout``, ``nodes``, ``functions``,
    ``stale``)."""
    t = time.perf_counter()
    lap = _Lap(parts)
    out: list[str] = []
    if plan is not None:
        index = PlanIndex.of(plan)
        out += plan_refusals(plan)
        planned, saved = plan_keys(plan), {(g.phase, g.bs): g.pool for g in file.graphs}
        out += [f"the file lacks graph {p}/{b}, which the plan captures" for p, b in planned if (p, b) not in saved]
        for (p, b), pool in saved.items():
            if (p, b) not in planned:
                out.append(f"the file holds graph {p}/{b}, which the plan does not capture")
            elif pool != planned[(p, b)]:
                out.append(f"graph {p}/{b} was saved in pool {pool!r}; the plan captures it into {planned[(p, b)]!r}")
        pools: Collection[str] = index.pools
    else:
        pools = {s.owner for s in file.segments if s.kind == "pool"}
    t = lap("plan", t)
    out += layout_refusals(file, dict.fromkeys(pools))
    t = lap("layout", t)
    out += rebuild_refusals(file)
    t = lap("nodes", t)
    out += function_refusals(file)
    t = lap("functions", t)
    out += stale_addresses(file)
    lap("stale", t)
    return out


class _Lap:
    """``lap(name, since)``: the seconds since ``since`` into ``parts`` (where given) under
    ``name``; now."""

    def __init__(self, parts: dict[str, float] | None):
        self.parts = parts

    def __call__(self, name: str, since: float) -> float:
        now = time.perf_counter()
        if self.parts is not None:
            self.parts[name] = now - since
        return now


def restore_refusals(plan: Plan, file: GraphFile, here: Here, parts: dict[str, float] | None = None) -> list[str]:
    """One line per reason a restore of ``file`` for ``plan`` in the process ``here`` describes
    refuses before any kernel runs (module docstring, step 1); [] where it may go on.
    ``parts``: filled with the seconds of each check (``valid``: ``check_valid``; the others
    :func:`file_refusals`'s)."""
    t = time.perf_counter()
    out = check_valid(file, here.env, later=("library", "workspace", "pool"))
    _Lap(parts)("valid", t)
    try:  # the builder the rebuild will run, chosen now: a bad choice refuses before the loading runs
        graph_builder(log=False)
    except ExecutorError as err:
        out.append(f"{err.what} (fix: {err.fix})")
    out += file_refusals(file, plan, parts)
    if here.tensor_map:
        out.append(here.tensor_map)
    if here.ranks > 1:
        out.append(
            f"torch.distributed runs {here.ranks} ranks: a restore of tensor-parallel graphs is not built (each rank's "
            "communicator memory lies outside torch's allocator)"
        )
    return out


def inspect_refusals(file: GraphFile, plan: Plan | None = None) -> list[str]:
    """What a restore of ``file`` refuses that no process is needed to see (``python -m
    capture_plan.executor.graph_file inspect FILE --plan PLAN``): :func:`file_refusals`, the
    plan's digest, every address in a segment no restore relocates into."""
    v = file.valid_for
    own = GraphEnvironment(
        runtime=msgspec.structs.replace(v.runtime, plan_digest=plan.digest) if plan is not None else v.runtime,
        libraries={lib.name: lib.digest for lib in v.libraries},
    )
    return check_valid(file, own, later=("tensor", "workspace", "engine", "pool")) + file_refusals(file, plan)
