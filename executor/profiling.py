"""``profile(plan, target)``: record real allocation traces for exact predictions.

Captures the plan once with the allocation history on, then writes, per
(phase, size), the ordered pool allocations and frees of its capture. Blocks
still alive when the capture ends are classified: an output of ``run`` is
``output``; anything else (cuBLAS's workspace, re-created at each capture) is
``library``. The planner's ``--trace`` (or a spec's ``trace``) consumes it.

Event sizes are the allocator's block sizes (already rounded), which the
simulator rounds again to the same value. The graphs are released afterwards.
"""

from __future__ import annotations

from pathlib import Path

import torch

from schemas.codec import canonical_bytes
from schemas.files import write_atomic
from schemas.plan import Plan
from schemas.trace import CaptureTrace, Event, Trace

from .graphs import capture
from .target import CaptureTarget

__all__ = ["profile", "write_trace"]


def profile(plan: Plan, target: CaptureTarget, *, progress: bool = False) -> Trace:
    gs = capture(plan, target, progress=progress, record=True)
    try:
        caps = [_capture_trace(cap) for cap in gs.graphs.values()]
        caps.sort(key=lambda c: (c.phase, c.bs))
        device = gs.report.device if gs.report else ""
        return Trace(device=f"{device} / torch {torch.__version__}", backend=plan.requires.backend, captures=caps)
    finally:
        gs.release()


def _capture_trace(cap) -> CaptureTrace:
    win = cap.window
    outputs = {t.untyped_storage().data_ptr() for t in cap.outputs}
    alive = {a for a, _ in win.alive_after}
    latest: dict[int, int] = {}  # address -> index of its latest alloc event
    events: list[Event] = []
    ids: dict[int, int] = {}  # live address -> allocation id (ids are never reused)
    next_id = 0
    for op, addr, size in win.events:
        if op == "alloc":
            ids[addr], next_id = next_id, next_id + 1
            latest[addr] = len(events)
            events.append(Event(op="alloc", id=ids[addr], size=size))
        else:
            events.append(Event(op="free", id=ids.pop(addr)))
            latest.pop(addr, None)
    for addr, i in latest.items():
        if addr in alive:
            e = events[i]
            events[i] = Event(op="alloc", id=e.id, size=e.size, kind="output" if addr in outputs else "library")
    return CaptureTrace(phase=cap.phase, bs=cap.bs, events=events)


def write_trace(trace: Trace, path: str | Path) -> None:
    """Write a trace in canonical form, atomically."""
    write_atomic(Path(path), canonical_bytes(trace))
