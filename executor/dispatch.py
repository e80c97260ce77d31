"""O(1) replay dispatch: pad a runtime batch to the smallest captured size.

A list indexed by batch size, built once; a lookup is one bounds check and
one index, never a search. Torch-free.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from .errors import ExecutorError

__all__ = ["PadTable"]

T = TypeVar("T")


class PadTable(Generic[T]):
    """Maps n in [1, max(sizes)] to (padded size, entry of that size)."""

    __slots__ = ("phase", "sizes", "_table")

    def __init__(self, phase: str, entries: dict[int, T]):
        if not entries or min(entries) < 1:
            raise ExecutorError("capture sizes must be positive and non-empty", where=f"phase {phase}")
        self.phase = phase
        self.sizes = tuple(sorted(entries))
        table: list = [None] * (self.sizes[-1] + 1)
        it = iter(self.sizes)
        cur = next(it)
        for n in range(1, len(table)):
            if n > cur:
                cur = next(it)
            table[n] = (cur, entries[cur])
        self._table = table

    def __getitem__(self, n: int) -> tuple[int, T]:
        if 1 <= n < len(self._table):
            return self._table[n]
        raise ExecutorError(f"batch {n} is outside the captured sizes 1..{self.sizes[-1]}",
                            where=f"phase {self.phase}",
                            fix="capture a larger size (raise --max-bs) or run this batch eagerly")

    def padded(self, n: int) -> int:
        """The captured size a batch of ``n`` replays at."""
        return self[n][0]
