"""Which allocator core this process runs: the compiled one (planner/memory/_core.pyx, an
optional extension) or the pure-Python :class:`~capture_plan.planner.memory.allocator.PoolSim`.

Both simulate the same rules (planner/memory/allocator.py's docstring; tests/test_allocator_core.py
compares them op by op), so the choice changes speed only, never a plan. :data:`CORE_ENV`
forces one; ``planner --version`` says which runs and why.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

from capture_plan.schemas.errors import InputError
from capture_plan.schemas.extension import Extension

from .allocator import PoolSim

if TYPE_CHECKING:
    from typing import TypeAlias

    from ._core import Pool as CompiledPool

__all__ = ["Pool", "Core", "CORE_ENV", "core", "new_pool"]


#: A pool of either core: :class:`PoolSim`, or the compiled ``_core.Pool``
#: (planner/memory/_core.pyx) with the same surface, ints for block handles.
Pool: TypeAlias = "PoolSim | CompiledPool"


#: ``python`` runs :class:`PoolSim` even where the compiled core is built;
#: ``compiled`` requires the compiled core (an error where it did not load);
#: unset or ``auto``: the compiled core where it loads, else PoolSim.
CORE_ENV = "CAPTURE_PLAN_ALLOCATOR_CORE"


class Core(NamedTuple):
    """The allocator core this process runs: ``name`` (``compiled`` or
    ``python``), the pool class, and why, when it is the Python one."""

    name: str
    pool: type
    why: str = ""

    def describe(self) -> str:
        return f"{self.name} ({self.why})" if self.why else self.name


#: the compiled core, told by :data:`CORE_ENV`
_EXTENSION = Extension(
    f"{__package__}._core", "allocator core", CORE_ENV, "python", "the Python core gives the same plans", InputError
)


@functools.cache
def core() -> Core:
    """The core, chosen once per process: the compiled one (an optional
    extension, built at install time where a C compiler exists) unless
    :data:`CORE_ENV` says ``python`` or it did not load. Both simulate the
    same rules (tests/test_allocator_core.py compares them op by op), so the
    choice changes speed only, never a plan. A fallback logs one INFO line
    (:class:`~capture_plan.schemas.extension.Extension`).
    """
    compiled, why = _EXTENSION.load()
    return Core("python", PoolSim, why) if compiled is None else Core("compiled", compiled.Pool)


def new_pool(expandable: bool = False, addresses: Iterator[int] | None = None) -> Pool:
    """A new pool of the core this process runs (:func:`core`)."""
    return core().pool(expandable=expandable, addresses=addresses)
