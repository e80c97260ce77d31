"""The node count of a recorded CUDA graph, through the CUDA driver API.

What an instantiated graph takes from free device memory, outside the caching
allocator, grows with its nodes: measured on an H200 (driver 580.159.04,
torch 2.11), about 3 KB per node of a model's decode step, taken in 2 MiB
steps and kept by the driver after the graph is destroyed (a later graph
reuses it). So the executor counts each graph's nodes for the report
(``StepMeasurement.graph_nodes``); the planner turns counts into bytes
(``capture_plan.planner.device``).

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
import functools

import torch

__all__ = ["node_count", "instantiate_kept"]


@functools.cache
def _get_nodes():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    fn = lib.cuGraphGetNodes  # CUresult cuGraphGetNodes(CUgraph, CUgraphNode *nodes, size_t *numNodes)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
    fn.restype = ctypes.c_int
    return fn


def _raw(graph: torch.cuda.CUDAGraph) -> int | None:
    try:
        return graph.raw_cuda_graph()
    except (RuntimeError, AttributeError):  # recorded without keep_graph=True, or a torch without it
        return None


def node_count(graph: torch.cuda.CUDAGraph) -> int | None:
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
