"""The engine side of the contract: what the executor needs from a model."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Union, runtime_checkable

from .errors import ExecutorError

if TYPE_CHECKING:
    import torch

__all__ = ["CaptureTarget", "Outputs", "Unattached"]

Outputs = Union["torch.Tensor", tuple["torch.Tensor", ...]]


@runtime_checkable
class CaptureTarget(Protocol):
    """A model the executor can capture, replay and verify.

    Constraints the executor relies on:

    * ``run`` reads its inputs only from the engine's own static buffers
      (allocated before capture, outside the graph pool) and returns the step's
      outputs, whose first dimension is ``bs * rows_per_request`` rows; the
      returned tensors are either allocated inside ``run`` (they live in the
      pool) or static buffers whose address never changes;
    * ``workspace`` is None when the plan keeps the backend's workspace in the
      pool; otherwise it is a uint8 buffer hoisted out of the pool, sized for
      the phase's largest batch, that ``run`` must use instead of allocating;
    * ``prepare`` writes random *valid* inputs for ``n`` requests, padded to
      ``bs``, into the static buffers (verification and tests);
    * ``refresh`` recomputes the hoisted workspace for the current inputs; it
      runs before every replay (FA3's scheduler metadata depends on sequence
      lengths) and is never captured.

    For ``capture(..., background=True)`` (serving while capturing; see
    ``capture_plan.executor.background``), also:

    * ``run`` may be called on two threads at once -- recording on the capture
      thread, eagerly on the serving thread as the fallback -- so it keeps no
      host-side state that one call changes and another reads;
    * warm-ups run on the engine's live static buffers, so ``run`` writes only
      memory that the next real step writes before reading it (padded rows
      write to a dummy KV slot);
    * the engine serves on a stream of its own (never the legacy default
      stream), makes no device-wide synchronization while the capture runs,
      has used cuBLAS on that stream before it starts, and wraps its own GPU
      work on these buffers outside ``replay`` in ``GraphSet.exclusive()``.
      ``run`` is never called eagerly on the capture stream while a graph is
      being recorded there: the executor owns that stream.
    """

    def run(self, phase: str, bs: int, workspace: torch.Tensor | None) -> Outputs: ...

    def prepare(self, phase: str, n: int, bs: int, generator: torch.Generator) -> None: ...

    def refresh(self, phase: str, n: int, bs: int, workspace: torch.Tensor) -> None: ...


class Unattached:
    """The target of a GraphSet whose graphs the engine's loop captured: it has
    no eager function. Replays of phases without a hoisted workspace work;
    an eager run (``verify``) or a hoisted workspace's refresh raise, saying
    what to pass."""

    def _missing(self, what: str, phase: str):
        raise ExecutorError(
            f"no {what} for phase {phase!r}: the engine's loop captured these graphs",
            where="GraphSet",
            fix="pass capture_loop(plan, target=...) an object with run, prepare "
            "and refresh (capture_plan.executor.engine.EngineFunctions wraps the engine's eager "
            "function)",
        )

    def run(self, phase, bs, workspace):
        self._missing("eager function", phase)

    def prepare(self, phase, n, bs, generator):
        self._missing("input preparation", phase)

    def refresh(self, phase, n, bs, workspace):
        self._missing("workspace refresh", phase)
