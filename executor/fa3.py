"""The FlashAttention-3 module this process can import, for the model code that calls FA3
directly (capture_plan.references' decode step, capture_plan.adapters' HFTarget with
``attention="fa3"``).

FA3 comes two ways: the official ``flash_attn_interface`` (built from the hopper/ folder of
Dao-AILab/flash-attention) and the ``fa3-fwd`` wheel's ``fa3_fwd_interface`` (forward only,
the same ``flash_attn_with_kvcache``). :data:`FA3_MODULES` is the order they are tried in,
the same list as planner/data/backends.toml ``[backends.fa3] modules`` (tests/test_adapters.py
checks the two agree).
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["FA3_MODULES", "load_fa3"]

#: importable FA3 interfaces, the official one first
FA3_MODULES = ("flash_attn_interface", "fa3_fwd_interface")


def load_fa3() -> ModuleType | None:
    """The first of :data:`FA3_MODULES` that imports, or None: FA3 is optional (its kernels
    need sm90 and a CUDA build), and a caller falls back or refuses, saying which."""
    for name in FA3_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None
