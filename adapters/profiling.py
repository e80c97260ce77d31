"""The plan's answer to an engine's memory-profiling pass: a drop-in for vLLM's ``profile_cudagraph_memory``.

vLLM 0.33.0 (``v1/worker/gpu/cudagraph_utils.py`` ``profile_cudagraph_memory``)
captures the whole capture once more before the KV cache exists, into a
throwaway pool, FULL capped at the two largest descriptors, and extrapolates
the rest. A plan already holds the figure that pass estimates: every item of
the free device memory capture takes (pool, hoisted workspaces, the capture
stream's workspace, other allocator memory, the driver's graph memory,
buffers warm-ups keep), predicted per graph key.
:func:`profile_cudagraph_memory` returns it (``capture_plan.schemas.keys.capture_memory``)
and logs the items; an engine that still runs its pass (to warm compile
caches, say) declares it to the loop as a partial pass
(``capture_loop(plan, profiling={...})``, torn down when it closes).

What it does not do: measure. The figure is the plan's, as exact as the
plan's prediction (``plan.predicted.fidelity``); an unknown item (a device
never calibrated) makes it a lower bound, said in the log.
"""

from __future__ import annotations

import logging
from pathlib import Path

from capture_plan.schemas.keys import CaptureMemory, capture_memory
from capture_plan.schemas.plan import Plan

__all__ = ["profile_cudagraph_memory", "plan_of"]

log = logging.getLogger("capture_plan.adapters")


def plan_of(source) -> Plan:
    """A plan from a :class:`Plan`, a path to one, or an object with a ``plan``
    (``adapters.startup.predict_startup``'s prediction) or a ``capture_plan``
    attribute (an engine's runner that carries its plan)."""
    if isinstance(source, Plan):
        return source
    if isinstance(source, (str, Path)):
        from capture_plan.executor.load import load_plan

        return load_plan(source, check_env=False)
    for attr in ("plan", "capture_plan"):
        inner = getattr(source, attr, None)
        if inner is not None:
            return plan_of(inner)
    raise TypeError(f"no plan in {type(source).__name__}: pass plan= (a Plan or its path) or a startup prediction")


def profile_cudagraph_memory(runner=None, *, plan=None, prediction=None) -> int:
    """Bytes to reserve for the whole capture: vLLM's
    ``profile_cudagraph_memory(runner)`` with the plan's figure instead of a
    throwaway capture. ``prediction`` (``adapters.startup.predict_startup``'s,
    measured on this device) gives its ``total_bytes`` and items; otherwise
    the plan (``plan``, or the plan ``runner`` carries) gives its own. Logs the
    items at INFO (a warning when one is unknown: the figure is then a lower bound)."""
    if prediction is not None:
        items = ", ".join(f"{name} {nbytes} B" for name, nbytes in prediction.items.items())
        log.info("capture-plan: capture takes %d B (%s; predicted at start-up)", prediction.total_bytes, items)
        return int(prediction.total_bytes)
    memory: CaptureMemory = capture_memory(plan_of(plan if plan is not None else runner))
    items = ", ".join(f"{i.name} {i.bytes if i.bytes is not None else 'unknown'} B" for i in memory.items)
    level = logging.INFO if memory.complete else logging.WARNING
    log.log(
        level,
        "capture-plan: capture takes %d B%s (%s; %d graph keys, %s)",
        memory.bytes,
        "" if memory.complete else " at least: an item is unknown (calibrate the plan for this device)",
        items,
        len(memory.keys),
        memory.fidelity or "no fidelity recorded",
    )
    return memory.bytes
