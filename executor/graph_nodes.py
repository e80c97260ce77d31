"""Node counts and extra instantiations of recorded CUDA graphs, through the CUDA driver API.

What an instantiated graph takes from free device memory, outside the caching
allocator, grows with its nodes: measured on an H200 (driver 580.159.04,
torch 2.11, bench/graph_exec_bench.py), 2,748 to 3,029 bytes a node by model,
taken at instantiation (not while recording) in 2 MiB steps and kept by the
driver after the graph is destroyed (a later graph reuses it). So the
executor counts each graph's nodes for the report
(``StepMeasurement.graph_nodes``); the planner turns counts into bytes
(``capture_plan.planner.memory.device``).

Counting needs the graph itself, not only its instantiation: the loop records
into ``torch.cuda.CUDAGraph(keep_graph=True)`` and instantiates it right after
the count, inside the same step, so the driver memory lands on the step that
recorded it. Keeping the graph costs host memory only (torch holds the
``cudaGraph_t`` until the graph is reset).

What it does not do: count the nodes of a graph recorded without
``keep_graph`` (an engine's own ``CUDAGraph()``: None), or anything where
``libcuda.so.1`` cannot be loaded (None: unknown, never 0).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence

import torch

from . import libcuda

__all__ = ["node_count", "instantiate_kept", "ExecCopies"]


def _get_nodes():
    return libcuda.call("cuGraphGetNodes")


def _raw(graph: object) -> int | None:
    """The ``cudaGraph_t`` of a torch graph (or of a graph served through a shared
    executable: ``capture_plan.executor.exec_update.SharedGraph``); None where unreadable."""
    try:
        return graph.raw_cuda_graph()  # pyright: ignore[reportAttributeAccessIssue]  # duck-typed: see above
    except (RuntimeError, AttributeError):  # recorded without keep_graph=True, or a torch without it
        return None


def node_count(graph: object) -> int | None:
    """Nodes of ``graph`` (kernels, memsets, copies); None where it cannot be read."""
    raw, fn = _raw(graph), _get_nodes()
    if raw is None or fn is None:
        return None
    n = ctypes.c_size_t(0)
    # a null node array asks for the count alone
    return n.value if fn(ctypes.c_void_p(raw), None, ctypes.byref(n)) == 0 else None


def instantiate_kept(graph: torch.cuda.CUDAGraph) -> int | None:
    """For a graph recorded with ``keep_graph=True``: count its nodes, then
    instantiate it (torch would otherwise instantiate it at its first replay,
    and its driver memory would land there). Returns the count; a graph
    recorded without ``keep_graph`` is left as it is (None)."""
    if _raw(graph) is None:
        return None
    n = node_count(graph)
    graph.instantiate()
    return n


def _exec_calls():
    """(instantiate, destroy), or None without the driver."""
    got = libcuda.calls("cuGraphInstantiateWithFlags", "cuGraphExecDestroy")
    return None if isinstance(got, str) else (got["cuGraphInstantiateWithFlags"], got["cuGraphExecDestroy"])


def _context_binder() -> Callable[[], None]:
    """A call that makes the calling thread's current CUDA context current in the thread
    that runs it (a new thread has none, and the driver refuses its calls: CUresult
    201); a no-op where the driver or a current context is missing."""
    got = libcuda.calls("cuCtxGetCurrent", "cuCtxSetCurrent")
    if isinstance(got, str):
        return lambda: None
    ctx = ctypes.c_void_p()
    if got["cuCtxGetCurrent"](ctypes.byref(ctx)) != 0 or not ctx.value:
        return lambda: None
    set_current = got["cuCtxSetCurrent"]
    return lambda: set_current(ctx) and None


class ExecCopies:
    """Extra instantiations of kept graphs, every one alive until :meth:`close` destroys them.

    The driver takes each copy's memory and keeps it once the copy is destroyed, for
    the graphs instantiated later in the process: a start-up prediction instantiates
    the graphs it recorded as many times as the plan captures, all alive at once (a
    copy destroyed before the next is made would lend it its memory), and so measures
    the driver memory the whole capture will need, and takes it now
    (``capture_plan.adapters.startup``). Makes nothing where the graphs were not kept
    or ``libcuda.so.1`` cannot be loaded.

    Copies of several graphs are made on one thread per graph: an instantiation runs in
    the driver with the GIL released, and the driver instantiates different graphs
    side by side, taking the same memory as in turn (docs/measurements.md, "The first
    prediction's cost"). One graph is never instantiated from two threads at once (the
    driver does not synchronize access to a graph). Where ``done`` is asked after each copy the
    copies are made in turn: its answer depends on their order."""

    def __init__(self) -> None:
        self._made: list[ctypes.c_void_p] = []

    def add(self, graphs: Sequence[object], n: int, done: Callable[[int, int], bool] | None = None) -> tuple[int, int]:
        """Instantiate the kept ``graphs`` ``n`` times in turn (graph ``i`` gets copy
        ``i``, ``i + len``, ...); returns (copies made, their nodes). Stops at the first
        copy the driver refuses (out of memory), or once ``done(copies made, their
        nodes)``, asked after each copy, says so (a start-up that has measured enough:
        ``capture_plan.executor.node_bytes``)."""
        calls = _exec_calls()
        kept = [(raw, node_count(g) or 0) for g in graphs if (raw := _raw(g)) is not None]
        if calls is None or not kept or n <= 0:
            return 0, 0
        if done is None and len(kept) > 1:
            return self._side_by_side(calls[0], kept, n)
        inst, _ = calls
        made = nodes = 0
        for i in range(n):
            raw, count = kept[i % len(kept)]
            out = ctypes.c_void_p()
            if inst(ctypes.byref(out), ctypes.c_void_p(raw), 0) != 0:
                break
            self._made.append(out)
            made, nodes = made + 1, nodes + count
            if done is not None and done(made, nodes):
                break
        return made, nodes

    def _side_by_side(self, inst, kept: list[tuple[int, int]], n: int) -> tuple[int, int]:
        """:meth:`add`'s copies on one thread per graph, each making the copies it would
        make in turn; every thread stops once one copy is refused."""
        shares = [n // len(kept) + (1 if i < n % len(kept) else 0) for i in range(len(kept))]
        per_graph: list[list[ctypes.c_void_p]] = [[] for _ in kept]
        refused = threading.Event()
        bind = _context_binder()

        def copy(k: int) -> None:
            bind()
            raw = ctypes.c_void_p(kept[k][0])
            for _ in range(shares[k]):
                if refused.is_set():
                    return
                out = ctypes.c_void_p()
                if inst(ctypes.byref(out), raw, 0) != 0:
                    refused.set()
                    return
                per_graph[k].append(out)

        threads = [threading.Thread(target=copy, args=(k,), name=f"capture-plan-copy-{k}") for k in range(len(kept))]
        try:
            for t in threads:
                t.start()
        finally:  # every copy made is the caller's to destroy (close), whatever happened
            for t in threads:
                if t.ident is not None:  # started
                    t.join()
            for mine in per_graph:
                self._made.extend(mine)
        made = sum(len(mine) for mine in per_graph)
        nodes = sum(len(mine) * count for mine, (_, count) in zip(per_graph, kept))
        return made, nodes

    def close(self) -> None:
        """Destroy every copy (the driver keeps their memory for later graphs)."""
        calls = _exec_calls()
        while self._made:
            ex = self._made.pop()
            if calls is not None:
                calls[1](ex)
