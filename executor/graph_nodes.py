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
from .errors import ExecutorError

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


#: the CUresult of an instantiation the driver refuses for want of memory: the copies stop
#: there (what they took is measured); any other failure is an error, never a short count
_OUT_OF_MEMORY = 2


def _instantiated(code: int, graph: int) -> bool:
    """Whether an instantiation's ``code`` made a copy: False where the driver is out of
    memory; an ExecutorError for any other failure."""
    if code == 0:
        return True
    if code == _OUT_OF_MEMORY:
        return False
    raise ExecutorError(
        f"instantiating a copy of graph {graph:#x} failed with CUresult {code}",
        where="start-up prediction: the graph copies",
        fix="check the device with `nvidia-smi` and start again: only out of memory (CUresult 2) ends the "
        "copies short, any other failure is the driver's",
    )


def _context_binder() -> Callable[[], None]:
    """A call that makes the calling thread's current CUDA context current in the thread
    that runs it (a new thread has none, and the driver refuses its calls: CUresult
    201), raising an ExecutorError if the driver refuses; a no-op where the driver or a
    current context is missing (the caller's own calls would fail the same way)."""
    got = libcuda.calls("cuCtxGetCurrent", "cuCtxSetCurrent")
    if isinstance(got, str):
        return lambda: None
    ctx = ctypes.c_void_p()
    if got["cuCtxGetCurrent"](ctypes.byref(ctx)) != 0 or not ctx.value:
        return lambda: None
    set_current = got["cuCtxSetCurrent"]

    def bind() -> None:
        code = set_current(ctx)
        if code != 0:
            raise ExecutorError(
                f"a copying thread could not make the caller's CUDA context current (CUresult {code})",
                where="start-up prediction: the graph copies",
                fix="check the device with `nvidia-smi` and start again; predict_startup(copy_error=...) makes "
                "the copies in turn, on the caller's thread",
            )

    return bind


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
    side by side. That they take the driver memory they take in turn is a measurement
    (an H200, driver 580: bench/copies_bench.py, docs/measurements.md "The graph copies,
    in turn and side by side"), which the start-up prediction's exactness rests on: a
    new driver is measured again there. One graph is never instantiated from two threads
    at once (the driver does not synchronize access to a graph). Where ``done`` is asked
    after each copy the copies are made in turn: its answer depends on their order."""

    def __init__(self) -> None:
        self._made: list[ctypes.c_void_p] = []

    def add(self, graphs: Sequence[object], n: int, done: Callable[[int, int], bool] | None = None) -> tuple[int, int]:
        """Instantiate the kept ``graphs`` ``n`` times, graph ``i`` getting copies ``i``,
        ``i + len``, ... as in turn (side by side, one thread per distinct graph, unless
        ``done`` is given); returns (copies made, their nodes). Stops once the driver
        refuses a copy for want of memory (side by side: the copies under way on other
        threads still finish), or once ``done(copies made, their nodes)``, asked after each
        copy, says so (a start-up that has measured enough:
        ``capture_plan.executor.node_bytes``). Any other failure is an ExecutorError, the
        copies made so far kept for :meth:`close`."""
        calls = _exec_calls()
        kept = [(raw, node_count(g) or 0) for g in graphs if (raw := _raw(g)) is not None]
        if calls is None or not kept or n <= 0:
            return 0, 0
        if done is None and len({raw for raw, _ in kept}) > 1:
            return self._side_by_side(calls[0], kept, n)
        inst, _ = calls
        made = nodes = 0
        for i in range(n):
            raw, count = kept[i % len(kept)]
            out = ctypes.c_void_p()
            if not _instantiated(inst(ctypes.byref(out), ctypes.c_void_p(raw), 0), raw):
                break
            self._made.append(out)
            made, nodes = made + 1, nodes + count
            if done is not None and done(made, nodes):
                break
        return made, nodes

    def _side_by_side(self, inst, kept: list[tuple[int, int]], n: int) -> tuple[int, int]:
        """:meth:`add`'s copies on one thread per distinct graph, each making the copies
        its graph gets in turn; every thread stops once one copy is refused or fails, and
        a failure is raised here once every thread is joined."""
        share: dict[int, int] = {}  # per distinct graph, in first-seen order: its copies in turn
        count: dict[int, int] = {}
        for i in range(n):
            raw, nodes = kept[i % len(kept)]
            share[raw] = share.get(raw, 0) + 1
            count[raw] = nodes
        made: dict[int, list[ctypes.c_void_p]] = {raw: [] for raw in share}
        stop = threading.Event()
        errors: list[BaseException] = []
        bind = _context_binder()

        def copy(raw: int) -> None:
            try:
                bind()
                for _ in range(share[raw]):
                    if stop.is_set():
                        return
                    out = ctypes.c_void_p()
                    if not _instantiated(inst(ctypes.byref(out), ctypes.c_void_p(raw), 0), raw):
                        stop.set()
                        return
                    made[raw].append(out)
            except BaseException as err:  # raised on the caller's thread, after the join
                errors.append(err)
                stop.set()

        threads = [threading.Thread(target=copy, args=(raw,), name="capture-plan-copy") for raw in share]
        try:
            for t in threads:
                t.start()
        except BaseException:
            stop.set()  # the threads already started stop at their next copy
            raise
        finally:  # every copy made is the caller's to destroy (close), whatever happened
            for t in threads:
                if t.ident is not None:  # started
                    t.join()
            for mine in made.values():
                self._made.extend(mine)
        if errors:
            raise errors[0]
        return sum(len(m) for m in made.values()), sum(len(m) * count[raw] for raw, m in made.items())

    def close(self) -> None:
        """Destroy every copy (the driver keeps their memory for later graphs)."""
        calls = _exec_calls()
        while self._made:
            ex = self._made.pop()
            if calls is not None:
                calls[1](ex)
