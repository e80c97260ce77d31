"""The one error root shared by planner and executor.

Every error raised on purpose is a ``CapturePlanError``: one line saying what
went wrong, where (file, JSON path, phase/size/step) and, when known, how to
fix it. The CLI prints ``str(err)`` and exits with ``err.exit_code``; anything
else that escapes is a bug (exit 3).
"""

from __future__ import annotations

__all__ = ["CapturePlanError", "InputError", "WrongKindError", "RecordMoreError", "ConstraintError", "DriftError"]


class CapturePlanError(Exception):
    """Root of all deliberate errors. ``exit_code`` 1 means "user error or drift"."""

    exit_code = 1
    #: options under which the failed command would pass, where one is known (``planner build
    #: --sizes auto`` names the command with them as the fix: ``--max-size 300``, ``--budget-mib 400``)
    retry: dict[str, object] | None = None

    def __init__(self, what: str, *, where: str | None = None, fix: str | None = None):
        self.what = what
        self.where = where
        self.fix = fix
        super().__init__(str(self))

    def __str__(self) -> str:
        text = f"{self.where}: {self.what}" if self.where else self.what
        if self.fix:
            text += f"; fix: {self.fix}"
        # One line, always: messages quote user input, which may hold newlines.
        return " ".join(text.split())


class InputError(CapturePlanError):
    """A spec, plan, trace, rule file or argument is malformed or inconsistent."""


class WrongKindError(InputError):
    """The file is not of the kind expected: a trace given as a plan, a JSON object of no known kind."""


class RecordMoreError(InputError):
    """A few-size trace cannot give every planned size of a phase: ``phase`` and ``sizes``
    name what to record besides what was (planner/memory/fitting.py), for a caller that records
    more and tries again (capture_plan.adapters.startup) instead of reading the message."""

    def __init__(self, what: str, *, phase: str, sizes: list[int], where: str | None = None, fix: str | None = None):
        self.phase = phase
        self.sizes = sorted(set(sizes))
        super().__init__(what, where=where, fix=fix)


class ConstraintError(CapturePlanError):
    """Rules, pins or budgets that no schedule can satisfy."""


class DriftError(CapturePlanError):
    """A checked-in plan differs from what the planner builds now."""

    #: whether `planner check --fix` can rebuild the plan (False: it records no build to rebuild from)
    fixable: bool = True
