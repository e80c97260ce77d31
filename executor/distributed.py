"""Tensor-parallel safety: ranks prove they run the same plan, and fail together.

``check_plan_agreement`` exchanges every rank's plan digest, ``--ci`` flag,
planned TP size and environment fingerprint before the first collective; on
any difference every rank raises the same error naming the ranks and what
differs. ``StepSync`` runs one small status exchange before every plan step,
so a rank that fails makes every other rank raise (naming the rank and the
step) instead of waiting in a collective the failed rank never joins.

Works on any torch.distributed backend; status exchanges use
``all_gather_object`` on a side gloo group and are bounded by the process
group's timeout (set it at ``init_process_group``). What it cannot do:
interrupt a rank already blocked inside a collective issued by the model
itself -- that rank is freed by the group's timeout, after which its error
joins the exchange, so every rank raises within that timeout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch.distributed as dist

from capture_plan.schemas.plan import Plan

from .errors import CaptureFailed, EnvironmentMismatch, ExecutorError
from .load import backend_module, current_environment

__all__ = ["check_plan_agreement", "StepSync", "run_synchronized", "fingerprint", "is_distributed", "rank0"]


def is_distributed() -> bool:
    """``torch.distributed`` is available and initialized in this process."""
    return dist.is_available() and dist.is_initialized()


def rank0(group=None) -> bool:
    """This process tells progress: not distributed, or rank 0 of ``group``."""
    return not is_distributed() or dist.get_rank(group) == 0


def _require(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise ExecutorError(
            "torch.distributed is not initialized",
            where="check_plan_agreement",
            fix="call torch.distributed.init_process_group first, or capture without a group",
        )
    return dist.get_rank(group), dist.get_world_size(group)


def fingerprint(plan: Plan) -> dict[str, str]:
    """What must be equal on every rank, besides the plan."""
    env = current_environment(tuple(plan.requires.modules))
    return {"device": env.describe(), "backend module": backend_module(plan, env.modules) or "(none)"}


def check_plan_agreement(plan: Plan, group=None, *, env: dict[str, str] | None = None) -> None:
    """Raise the same :class:`EnvironmentMismatch` on every rank unless all agree."""
    rank, world = _require(group)
    mine = {
        "plan digest": plan.digest,
        "ci": str(plan.inputs.ci),
        "planned tp": str(plan.requires.tp),
        **(env if env is not None else fingerprint(plan)),
    }
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    problems = []
    for key in sorted({k for d in everyone for k in d}):
        groups: dict[str, list[int]] = {}
        for r, d in enumerate(everyone):
            groups.setdefault(d.get(key, "(missing)"), []).append(r)
        if len(groups) > 1:
            problems.append(
                f"{key} differs: "
                + "; ".join(f"ranks {rs}: {v}" for v, rs in sorted(groups.items(), key=lambda kv: kv[1]))
            )
    tps = {d["planned tp"] for d in everyone}
    if len(tps) == 1 and int(next(iter(tps))) != world:
        problems.append(f"the plan is for tp={next(iter(tps))} but the group has {world} ranks")
    if problems:
        raise EnvironmentMismatch(
            "ranks disagree: " + " | ".join(problems),
            where=f"rank {rank} of {world}",
            fix="give every rank the same plan file, flags and software",
        )


class StepSync:
    """One status exchange per plan step; a failure anywhere fails every rank.

    Exchanges run on a separate gloo group: they never interleave with the
    model's own collectives on ``group`` (which may be NCCL, and may be the one
    that broke).
    """

    def __init__(self, group=None):
        self.rank, self.world = _require(group)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        self.side = dist.new_group(ranks=ranks, backend="gloo")

    def _exchange(self, status: tuple | None) -> None:
        everyone: list = [None] * self.world
        dist.all_gather_object(everyone, status, group=self.side)
        failures = sorted((s[1], r, s[0], s[2]) for r, s in enumerate(everyone) if s is not None)
        if failures:
            # Every failing rank is named, earliest step first: the first is
            # usually the cause, later ones (collective time-outs) its echo.
            text = "; ".join(f"rank {r} failed at step {i} ({sid}): {msg}" for i, r, sid, msg in failures)
            raise CaptureFailed(
                text,
                where=f"rank {self.rank} of {self.world}",
                fix=f"see rank {failures[0][1]}'s error; every rank stopped",
            )

    def before(self) -> None:
        """All ranks are fine so far (raises if any reported a failure)."""
        self._exchange(None)

    def fail(self, step_id: str, index: int, err: BaseException) -> None:
        """Report this rank's failure at a step; always raises."""
        self._exchange((step_id, index, f"{type(err).__name__}: {' '.join(str(err).split())}"))


def run_synchronized(steps: Iterable, do_step: Callable, group=None) -> None:
    """Run ``do_step(step)`` for each step with a status exchange before each and at the end."""
    sync = StepSync(group)
    step = None
    for step in steps:
        sync.before()
        try:
            do_step(step)
        except BaseException as err:
            sync.fail(step.id, step.index, err)
    sync.before()
