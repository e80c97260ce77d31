"""O(1) replay dispatch: pad a runtime batch to the smallest captured size.

A list indexed by batch size; a lookup is one bounds check and one index,
never a search. The table can grow while it is read: a background capture
adds sizes as their graphs land (``add``), and each landing rewrites only the
batches the new size now serves more tightly, so the whole capture costs
O(largest size) writes. Torch-free.

Thread safety: one writer (the capture thread) and any number of readers.
Every slot holds either None or a complete ``(size, entry)`` tuple and is
replaced by a single list store, so a reader sees the old or the new tuple,
never a mix; an old tuple stays valid (its graph is not destroyed until the
whole set is released).
"""

from __future__ import annotations

from typing import Generic, TypeVar

from capture_plan.schemas.keys import label_suffix

from .errors import ExecutorError

__all__ = ["PadTable", "dispatch_name"]

T = TypeVar("T")


def dispatch_name(phase: str, labels=(), piece: int | None = None) -> str:
    """The name a graph is dispatched by: the plan's phase; ``phase/axis=label,...``
    for a graph key with labels (``labels``: ``(axis, label)`` pairs in the phase's
    axis order, as the step id spells them); ``...#k`` for piece ``k`` of a
    piecewise capture. ``GraphSet.replay``, ``verify`` and a target's ``run`` and
    ``prepare`` get it as their ``phase``."""
    name = f"{phase}/{label_suffix(labels)}" if labels else phase
    return f"{name}#{piece}" if piece is not None else name


class PadTable(Generic[T]):
    """Maps n in [1, limit] to (padded size, entry of that size).

    ``limit`` is the largest batch the table will ever serve (the phase's
    largest planned size); it defaults to the largest size in ``entries``.
    Batches no captured size covers yet map to None (``get``) or raise
    (``[]``).
    """

    __slots__ = ("phase", "sizes", "_table")

    def __init__(self, phase: str, entries: dict[int, T], limit: int | None = None):
        if (not entries and limit is None) or (entries and min(entries) < 1):
            raise ExecutorError("capture sizes must be positive and non-empty", where=f"phase {phase}")
        top = max(entries, default=0)
        limit = top if limit is None else limit
        if limit < max(top, 1):
            raise ExecutorError(f"table limit {limit} is below the largest size {top}", where=f"phase {phase}")
        self.phase = phase
        #: the sizes captured so far, ascending
        self.sizes: tuple[int, ...] = ()
        self._table: list = [None] * (limit + 1)
        for bs in sorted(entries, reverse=True):  # largest first: every slot is written once
            self.add(bs, entries[bs])

    @property
    def limit(self) -> int:
        return len(self._table) - 1

    def add(self, bs: int, entry: T) -> range:
        """Serve the batches ``bs`` now pads most tightly; returns them.

        They are the n in (largest captured size below ``bs``, ``bs``]: for
        each, ``bs`` is now the smallest captured size >= n.
        """
        if not 1 <= bs <= self.limit:
            raise ExecutorError(f"size {bs} is outside 1..{self.limit}", where=f"phase {self.phase}")
        if bs in self.sizes:
            raise ExecutorError(f"size {bs} was already added", where=f"phase {self.phase}")
        below = max((s for s in self.sizes if s < bs), default=0)
        slot = (bs, entry)
        table = self._table
        served = range(below + 1, bs + 1)
        for n in served:
            table[n] = slot
        self.sizes = tuple(sorted((*self.sizes, bs)))
        return served

    def get(self, n: int) -> tuple[int, T] | None:
        """(padded size, entry), or None when no captured size covers ``n`` (yet)."""
        if 1 <= n < len(self._table):
            return self._table[n]
        return None

    def __getitem__(self, n: int) -> tuple[int, T]:
        if 1 <= n < len(self._table):
            slot = self._table[n]
            if slot is not None:
                return slot
            # only batches above every captured size are uncovered: the limit is planned, not captured yet
            got = f"1..{self.sizes[-1]}" if self.sizes else "none"
            raise ExecutorError(
                f"batch {n} has no captured graph yet (captured so far: {got}; planned up to {self.limit})",
                where=f"phase {self.phase}",
                fix="wait for the capture, or run this batch eagerly",
            )
        top = self.sizes[-1] if self.sizes else self.limit
        raise ExecutorError(
            f"batch {n} is outside the captured sizes 1..{top}",
            where=f"phase {self.phase}",
            fix="capture a larger size (raise --max-bs) or run this batch eagerly",
        )

    def padded(self, n: int) -> int:
        """The captured size a batch of ``n`` replays at."""
        return self[n][0]
