"""Engine adapters: CaptureTargets for code this project did not write.

They sit above the executor (they may import it; the executor never imports
them, tests/test_no_torch.py keeps that true) and each imports its engine or
library only when used.

- :class:`capture_plan.adapters.hf.HFTarget` -- a transformers causal LM's decode step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the lazy attribute, as type checkers and editors see it (never run)
    from .hf import HFTarget

__all__ = ["HFTarget"]


def __getattr__(name: str):
    if name == "HFTarget":
        from .hf import HFTarget

        return HFTarget
    raise AttributeError(f"module 'adapters' has no attribute {name!r}")
