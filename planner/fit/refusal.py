"""fit's refusals of its inputs, each with the change under which they are taken.

A :class:`Refusal` is an :class:`InputError` that knows its fix as data: ``changes`` maps an
engine flag (fit's name, planner/data/fit_flags.toml), ``tp``, ``engine`` or ``device`` to its
new value (None: leave the flag out). Each command renders the change as a whole command line
of its own: ``planner fit`` its own command (planner/cli/fit.py, through
:meth:`.inputs.FitRequest.changed`), a build ``planner build``'s with ``--engine-flag NAME=VALUE``
(:mod:`.kv_price`). Used as a library, the fix reads as the change's flags (a verified fix back
as changes: :func:`.flags.changes_of`).
"""

from __future__ import annotations

from capture_plan.schemas.errors import InputError

__all__ = ["Refusal", "INPUTS", "as_flags"]

#: the inputs a change may name besides the engine's flags
INPUTS = ("tp", "engine", "device")


def as_flags(changes: dict[str, object]) -> str:
    """``changes`` as fit's flags (``--max-model-len 4096``; a flag left out as ``without --NAME``)."""
    words = [f"--{k} {v}" if v is not None else f"without --{k}" for k, v in changes.items() if v is not True]
    return " ".join(words + [f"--{k}" for k, v in changes.items() if v is True])


class Refusal(InputError):
    """A refused input and the ``changes`` under which fit takes it; ``hint`` says what the
    change is (the fix reads ``HINT: CHANGE``, a command rendering it in its own words)."""

    def __init__(self, what: str, *, where: str, hint: str, changes: dict[str, object]) -> None:
        self.hint = hint
        self.changes = dict(changes)
        super().__init__(what, where=where, fix=f"{hint}: {as_flags(changes)}")
