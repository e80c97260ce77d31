"""Executor errors: all are :class:`capture_plan.schemas.errors.CapturePlanError`.

Torch-free when imported (``executor``'s package imports it, and ``load_plan``
works without torch); :func:`capture_failed` imports torch when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from capture_plan.schemas.errors import CapturePlanError

if TYPE_CHECKING:
    from capture_plan.schemas.plan import Plan, Step

#: the errors, which the package exports as they are (``capture_failed``, the capture drivers'
#: helper, is theirs alone)
__all__ = [
    "ExecutorError",
    "EnvironmentMismatch",
    "CaptureFailed",
    "StaleOutputError",
    "VerificationFailed",
    "RestoreRefused",
]


class ExecutorError(CapturePlanError):
    """Root of executor errors."""


class EnvironmentMismatch(ExecutorError):
    """The plan was built for another GPU, torch or backend."""


class CaptureFailed(ExecutorError):
    """Capture stopped at a step; every partial graph was released."""


class StaleOutputError(ExecutorError):
    """A non-owning output was read after another replay in its pool overwrote it."""


class VerificationFailed(ExecutorError):
    """verify() found a graph that corrupts another or reads what it must not."""


class RestoreRefused(ExecutorError):
    """A graph file cannot be restored here (``capture_plan.executor.graph_restore``): the message is
    the first reason, ``reasons`` all of them; nothing of the restore is left behind, so a
    start-up captures instead. ``made``: the restore had allocated device memory before it
    refused (returned to torch's cache as the error goes)."""

    def __init__(self, reasons: list[str], *, where: str | None = None, fix: str | None = None, made: bool = False):
        self.reasons = list(reasons)
        self.made = made
        more = f" (and {len(reasons) - 1} more)" if len(reasons) > 1 else ""
        super().__init__(f"not restored: {reasons[0]}{more}", where=where, fix=fix)


def capture_failed(failure: BaseException, step: Step | None, plan: Plan, device) -> BaseException:
    """The error to raise for a capture that stopped at ``step`` (partial graphs already released).

    An :class:`ExecutorError` is returned as it is; anything else becomes a
    :class:`CaptureFailed` naming the step, chained to ``failure``. Used by
    every capture driver (``capture_plan.executor.loop``, ``capture_plan.executor.background``,
    ``capture_plan.executor.loop``), which is why it lives here and not in one of them.
    """
    # torch only here: the failure came from a capture, so torch is loaded already
    import torch

    where = f"step {step.index} ({step.id}: phase {step.phase}, bs {step.bs})" if step else "before the first step"
    if isinstance(failure, ExecutorError):
        return failure
    if isinstance(failure, torch.OutOfMemoryError):
        free, _ = torch.cuda.mem_get_info(device)
        err = CaptureFailed(
            f"CUDA out of memory; the plan predicted a pool of {plan.predicted.pool_bytes} B "
            f"and {free} B are free now that the partial graphs were released",
            where=where,
            fix="free memory before capture (smaller KV cache) or plan fewer sizes",
        )
    else:
        err = CaptureFailed(f"{type(failure).__name__}: {failure}; all partial graphs were released", where=where)
    err.__cause__ = failure
    err.__suppress_context__ = True
    return err
