"""Keeping Python's garbage collector off the start-up path.

A full ``gc.collect()`` walks every live object: about 1.2 s in a server
process holding ~10 million of them (tokenizer, request state, model
metadata), twice the whole capture of a 32-layer model. So the executor never
runs one. Instead:

* ``Frozen`` moves every object alive when capture starts into the
  collector's permanent generation (``gc.freeze``, O(1)) and back afterwards
  (``gc.unfreeze``, O(1)): automatic collections triggered while capturing
  then only look at objects created since. Objects that die meanwhile are
  still freed by reference counting; only dead *cycles* among the frozen
  objects wait until the next collection after the thaw.
* ``collect_young`` collects the young generations only (objects created
  recently: bounded by the collector's thresholds, not by the heap), for the
  one place something must be freed: ``GraphSet.release``, where a graph or
  output caught in a dead reference cycle would keep its pool's segments.

What it does not do: disable the collector, or undo a freeze the engine made
itself -- if the heap was already frozen when capture started, or more was
frozen while it ran, the executor leaves the permanent generation alone.
"""

from __future__ import annotations

import gc
import threading

__all__ = ["Frozen", "collect_young"]

_lock = threading.Lock()


class Frozen:
    """``gc.freeze()`` for the duration of a capture; may be left on another thread."""

    __slots__ = ("_froze",)

    def __init__(self):
        self._froze: int | None = None

    def __enter__(self) -> Frozen:
        with _lock:
            # An engine that froze its heap already manages the collector itself.
            if gc.isenabled() and gc.get_freeze_count() == 0:
                gc.freeze()
                self._froze = gc.get_freeze_count()
        return self

    def __exit__(self, *exc) -> None:
        self.thaw()

    def thaw(self) -> None:
        with _lock:
            froze, self._froze = self._froze, None
            # More frozen than we froze: the engine froze too, keep its choice.
            if froze is not None and gc.get_freeze_count() <= froze:
                gc.unfreeze()


def collect_young() -> int:
    """Collect generations 0 and 1; returns the number of unreachable objects found."""
    return gc.collect(1)
