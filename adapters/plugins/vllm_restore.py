"""The vLLM plugin's start-up from a graph file (``CAPTURE_PLAN_GRAPHS``: :mod:`.restoring`),
a thin layer over vLLM's own objects.

vLLM captures every graph in one ``GPUModelRunner.capture_model``: the model's manager, then
the speculator's. Where the file is there, :func:`capture_model` runs vLLM's ``capture_model``
with each manager's ``capture`` collecting instead of capturing (:func:`collect`): per
descriptor the plan's key, the manager and descriptor, and the run ``create_forward_fn(desc,
warmup=False)(CUDAGraphMode.NONE)`` (vLLM's preparation of the descriptor's batch, then its
forward). In the capture of the last manager, inside vLLM's own capture context (its dummy
LoRAs set up, its graph-capture context entered), the graphs are restored, each one handed to
its manager (``manager.graphs[desc]``: vLLM replays it and resets it as its own); the FULL
graphs return through vLLM's persistent buffers (the model's hidden states, the speculator's),
tensors the restore relocates by name, so no output is handed over. Refused, every collected
manager's capture runs through the plan there, in vLLM's order, with one WARNING.

What a restore needs of vLLM besides: the persistent hidden states, which vLLM makes at its
first warm-up, made by one warm-up at the largest descriptor before the restore (as a routed
capture's first warm-up makes them); the runner's tensors by name (``runner.``...); the memory
vLLM owns outside torch's allocator that graphs point into (:func:`engine_memory`).

Where the file is not there, the capture that writes it keeps vLLM's graphs readable
(:func:`kept_graphs`): vLLM makes them itself (``torch.cuda.CUDAGraph()``), and torch keeps a
graph's nodes for the driver to read only with ``keep_graph=True``; each is instantiated once
recorded, as torch does at the end of a capture without it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from capture_plan.adapters.plugins import restoring

__all__ = ["Collecting", "capture_model", "collect", "engine_memory", "kept_graphs"]


@dataclass
class Collecting:
    """vLLM's capture while its managers collect: the runner, the plugin's routed
    ``CudaGraphManager.capture`` (``vllm.capture_routed``: what a refused restore captures each
    manager with), and each manager's ``capture`` call (manager, ``create_forward_fn``, its
    other arguments) in vLLM's order."""

    runner: Any
    capture: Callable[..., Any]
    managers: list[tuple] = field(default_factory=list)


def engine_memory(runner) -> dict[str, tuple[int, int]]:
    """The memory vLLM owns outside torch's allocator that its graphs point into, name ->
    (address, bytes): the extensible KV cache's reservation (vLLM 0.34, on by default on CUDA:
    a cuMem address range mapped in part while graphs are captured, at other addresses in
    another process), read as ``runner.extensible_kv_cache.buffer._buffer``'s ``base_ptr``
    and ``reserved_size`` (read in the 0.34.0 wheel: vllm/v1/worker/gpu/model_runner.py sets
    ``extensible_kv_cache``, vllm/v1/worker/extensible_kv_cache.py ``ExtensibleKVCache.buffer``
    is an ``ExtensibleTensor``, vllm/utils/extensible_tensor.py its ``_buffer`` a
    ``_VirtualBuffer`` with both; not a hook row of the release files: an engine without them
    declares nothing, and an argument into the range is then an ``outside`` segment that
    every restore refuses)."""
    kv = getattr(runner, "extensible_kv_cache", None)
    buf = getattr(getattr(kv, "buffer", None), "_buffer", None)
    base, size = getattr(buf, "base_ptr", 0), getattr(buf, "reserved_size", 0)
    if isinstance(base, int) and isinstance(size, int) and base and size > 0:
        return {"extensible_kv_cache": (base, size)}
    return {}


def capture_model(h, runner, loop, start: restoring.GraphStart, capture: Callable[..., Any]):
    """``GPUModelRunner.capture_model`` where the graph file is there: vLLM's capture with every
    routed manager collecting (:func:`collect`: the last restores, or captures them all with
    ``capture``, the plugin's routed manager capture); what vLLM measured its capture took.
    Where vLLM's managers did not reach every key of the plan, nothing was decided inside: one
    WARNING, and vLLM's capture through the plan."""
    h.collecting = Collecting(runner, capture)
    try:
        out = h.capture_model(runner, profile_only=False)
    finally:
        h.collecting = None
    if start.outcome is None:
        missing = start.missing()
        restoring.not_restored(
            start,
            f"graph file {start.path}: not restored: vLLM's managers did not reach {len(missing)} of the plan's graphs "
            f"({', '.join(missing[:3])})",
        )
        with loop.part():
            out = h.capture_model(runner, profile_only=False)
    return out


def _run(create_forward_fn, desc):
    """One run of a descriptor as vLLM records it: its recording build, run in mode NONE."""
    return create_forward_fn(desc, warmup=False)(type(desc.cg_mode).NONE)


def collect(h, manager, route: dict, create_forward_fn, args: tuple, kwargs: dict) -> None:
    """``CudaGraphManager.capture`` while vLLM's capture collects: each routed descriptor's
    key and run, nothing warmed up or recorded; the model manager's persistent hidden states
    made by one warm-up at its largest descriptor (vLLM makes them at its first warm-up); in
    the manager whose keys complete the plan's, the restore, or every collected manager's
    capture through the plan."""
    import torch

    from capture_plan.executor.dispatch import dispatch_name

    c, start = h.collecting, h.adoption.graphs
    c.managers.append((manager, create_forward_fn, args, kwargs))
    for desc, k in route.items():
        start.collect(
            (dispatch_name(k.phase, k.labels), k.bs), (manager, desc), functools.partial(_run, create_forward_fn, desc)
        )
    if isinstance(manager, h.model_manager_cls) and getattr(manager, "hidden_states", None) is None and route:
        largest = max(route, key=lambda d: d.num_tokens)
        with torch.cuda.stream(h.adoption.loop.stream):  # as the first step's warm-up: the loop's stream
            create_forward_fn(largest, True)(type(largest.cg_mode).NONE)
    if start.complete:
        _restore_or_capture(h, c, start)


def _restore_or_capture(h, c: Collecting, start: restoring.GraphStart) -> None:
    adoption = h.adoption
    loop = adoption.loop
    tensors = restoring.engine_tensors([("runner", c.runner)], loop.device)
    gs = restoring.restore_collected(
        start, adoption.plan, tensors=tensors, engine=engine_memory(c.runner), device=loop.device
    )
    if gs is not None:
        try:
            for key, (manager, desc) in start.native.items():
                manager.graphs[desc] = gs.graphs[key].graph
        except Exception as err:  # noqa: BLE001  # nothing of the restored set is kept: captured instead
            for manager, *_ in c.managers:
                manager.release_graphs()
            restoring.drop(start, err)
        else:
            restoring.restored(start, "vLLM")
            return
    h.collecting = None  # the managers' captures route through the plan now
    with loop.part():
        for manager, create_forward_fn, args, kwargs in c.managers:
            c.capture(h, manager, create_forward_fn, *args, **kwargs)


@contextlib.contextmanager
def kept_graphs():
    """While the block runs, ``torch.cuda.CUDAGraph()`` makes graphs with ``keep_graph=True``
    (module docstring); the caller instantiates each once recorded."""
    import torch

    base = torch.cuda.CUDAGraph
    by_init = base.__new__ is object.__new__  # a class taking keep_graph in __init__ alone (tests/fake_cuda.py's)

    class Kept(base):  # pyright: ignore[reportGeneralTypeIssues]  # torch's class, read at run time
        """torch's ``CUDAGraph`` takes ``keep_graph`` in ``__new__`` (its Python side) and in its
        binding's ``__init__`` (the C++ graph): both given True, whatever the caller passes."""

        def __new__(cls, *args, **kwargs):
            return object.__new__(cls) if by_init else base.__new__(cls, keep_graph=True)  # pyright: ignore[reportCallIssue]

        def __init__(self, *args, **kwargs):
            super().__init__(keep_graph=True)  # pyright: ignore[reportCallIssue]

    torch.cuda.CUDAGraph = Kept  # pyright: ignore[reportAttributeAccessIssue]
    try:
        yield
    finally:
        torch.cuda.CUDAGraph = base  # pyright: ignore[reportAttributeAccessIssue]
