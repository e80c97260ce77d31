"""The device view of a capture: free memory before and after, itemized.

An engine sizes its KV cache from free device memory, so what it must budget
for capture is the drop in ``torch.cuda.mem_get_info``'s free figure, not only
the graph pools. The drop splits into what the caching allocator reserved
(the pools, hoisted workspaces, the capture stream's cuBLAS workspace, free
blocks left cached) and what was taken outside it (driver memory: the
process's first graph capture pays a one-off cost there). Nothing here
allocates.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from capture_plan.schemas.report import DeviceItem, DeviceView

from . import libcuda

__all__ = ["Probe", "probe", "device_view", "driver_version"]


@dataclass(frozen=True)
class Probe:
    """The device's free bytes and the caching allocator's counters at one moment."""

    free: int
    reserved: int
    allocated: int


def probe(device) -> Probe:
    free, _ = torch.cuda.mem_get_info(device)
    return Probe(
        free=int(free),
        reserved=int(torch.cuda.memory_reserved(device)),
        allocated=int(torch.cuda.memory_allocated(device)),
    )


def device_view(
    before: Probe,
    after: Probe,
    *,
    pool_reserved: int,
    pool_allocated: int,
    hoisted: int,
    first_in_process: bool,
    background: bool,
) -> DeviceView:
    """Itemize ``before.free - after.free``.

    The pools' segments are all new (a capture session creates its pools), so
    the rest of the allocator's growth is memory outside them: what is still
    allocated there (hoisted workspaces, the capture stream's cuBLAS
    workspace, a buffer the target made and kept) and what is cached free.
    Whatever the free figure dropped by beyond the allocator's growth was
    taken outside the caching allocator. A negative remainder (memory another
    process or the engine gave back meanwhile) is reported as it is.
    """
    grown = after.reserved - before.reserved
    held = after.allocated - before.allocated - pool_allocated
    drop = before.free - after.free
    other_held = held - hoisted
    items = [
        DeviceItem(
            name="pool",
            bytes=pool_reserved,
            cause="segments of the graph pools: the graphs' memory, as the planner simulates it",
        ),
        DeviceItem(name="hoisted", bytes=hoisted, cause="workspaces the plan hoists out of the pools"),
        DeviceItem(
            name="allocator-held",
            bytes=other_held,
            cause="allocated outside the pools and still in use: the capture stream's cuBLAS/cuBLASLt "
            "workspace (one per stream that runs GEMMs), and anything the target allocated and kept",
        ),
        DeviceItem(
            name="allocator-cached",
            bytes=grown - pool_reserved - held,
            cause="free blocks left cached in the ordinary allocator (capture returns its warm-ups' "
            "memory: expected 0; in the background the engine's own cached growth counts here)",
        ),
        DeviceItem(
            name="outside-allocator",
            bytes=drop - grown,
            cause=(
                "driver memory outside the caching allocator, including the one-off cost of the "
                "process's first graph capture"
                if first_in_process
                else "driver memory outside the caching allocator (an earlier capture in this process "
                "already paid the first-capture cost)"
            ),
        ),
    ]
    return DeviceView(
        free_before=before.free,
        free_after=after.free,
        drop=drop,
        items=items,
        first_in_process=first_in_process,
        background=background,
    )


def driver_version() -> str:
    """The NVIDIA kernel driver's version ("580.95.05"), else the CUDA driver API's ("13.0"), else ""."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        for word in text.split():
            parts = word.split(".")
            if len(parts) >= 2 and all(p.isdigit() for p in parts):
                return word
    except OSError:
        pass
    get, v = libcuda.call("cuDriverGetVersion"), ctypes.c_int()
    if get is not None and get(ctypes.byref(v)) == 0:
        return f"{v.value // 1000}.{v.value % 1000 // 10}"
    return ""
