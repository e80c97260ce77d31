"""How the capture loop records a graph: the plan's pools and streams, one recording
into a pool on a stream with its measurement, and the observer of graphs recorded
into the engine's pools outside the loop.

:class:`Pools` holds the handle of each plan pool (the engine's, given to the loop, or
made at first use) and what each held so far: the bytes it held before the loop plus
what the loop's graphs grew it by. :func:`plan_streams` checks the engine's streams
against the plan's stream names. :func:`record` records one graph: the pool is measured
from its segments in a memory snapshot before and after (the device's reserved-bytes
counter also moves for allocations outside the pool meanwhile), and a graph the loop
made (``keep_graph=True``: :func:`new_graph`) is counted and instantiated there, so its
driver memory lands on the step that recorded it.

:class:`OutsideGraphs` counts graphs an engine records into its own pools outside the
loop while the loop is open (vLLM's encoder or speculator graphs, its piecewise
wrappers). Where torch has global capture hooks (``torch.cuda.graphs.
register_graph_capture_start_hook`` and ``register_graph_capture_end_hook``, torch 2.14
on: feature-detected, never by version) the observer registers both for the loop's open
time and removes them after (their ``RemovableHandle``): a graph whose capture began
outside the loop's own recording is counted when its capture ends, if a pool it holds
(``CUDAGraph.pools()``: one graph may hold several since torch 2.14, a ``use_mem_pool``
inside its capture) is one of the engine's. The pool is read at the end because torch
answers ``pool()`` only after a successful capture; a capture that fails is not counted.
torch 2.11 (the H200's) and 2.13 (the CPU tests') have no such hook
(``capture_begin`` calls the C++ graph directly and no callback is registered on the way):
there the observer wraps ``capture_begin`` on the class for the loop's open time and
restores it after, counting at the capture's start. Either way, where the loop records
itself it says so (:meth:`OutsideGraphs.own`), and that capture is not counted.

Unlike ``torch.cuda.graph(...)``, a recording does not synchronize and empty the cache
at every capture (vLLM turns that off too): that per-capture overhead is most
of the capture time of the engines' loop. It never runs a full garbage
collection either: one costs about a second in a server process with ~10
million live objects, more than the capture. The collector's old objects are
frozen while capturing (``capture_plan.executor.heap``); ``GraphSet.release`` collects only
the young generations, and only if a pool is still held after every reference
was dropped. A dead reference cycle that holds CUDA memory from before
the capture stays reserved until the engine's next collection (that memory
is outside the graph pools: the plan's prediction does not depend on it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping

import torch

from capture_plan.schemas.keys import PlanIndex
from capture_plan.schemas.plan import Plan, Step

from .errors import ExecutorError
from .graph_nodes import instantiate_kept, node_count
from .pool import AllocationRecorder, one_pool_reserved, pool_key

__all__ = [
    "Pools",
    "OutsideGraphs",
    "capture_hooks",
    "graph_pools",
    "Recording",
    "record",
    "new_graph",
    "plan_streams",
    "stream_of",
]


def new_graph() -> torch.cuda.CUDAGraph:
    """A graph that keeps its ``cudaGraph_t`` for the node count (torch 2.8 on); a plain
    one on an older torch, whose graphs are then not counted (graph_nodes None)."""
    try:
        return torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:  # torch < 2.8: no keep_graph
        return torch.cuda.CUDAGraph()


class Pools:
    """The plan's pools as the loop records into them: ``handles`` (pool name -> handle:
    the GraphSet's own dict, which it releases), the engine's among them, and per pool
    the bytes counted so far."""

    def __init__(self, plan: Plan, handles: dict, given: Mapping | None):
        #: the pools the plan's captures record into
        self.planned = PlanIndex.of(plan).pools
        self.handles = handles
        #: the engine's own objects behind its pools (a torch.cuda.MemPool): kept alive with the loop
        self.objects: list = []
        for name, handle in (given or {}).items():
            if name not in self.planned:
                raise ExecutorError(
                    f"pool {name!r} is not one of the plan's pools {sorted(self.planned)}",
                    where="capture_loop(pools=)",
                    fix="name the plan's pools",
                )
            if hasattr(handle, "id") and not isinstance(handle, tuple):  # a torch.cuda.MemPool: its id is the handle
                self.objects.append(handle)
                handle = handle.id
            self.handles[name] = handle
        #: the pools the engine made (graphs outside the loop may record into them too)
        self.engine = frozenset(pool_key(h) for h in self.handles.values())
        #: per pool: its bytes before the loop (an engine's pool may hold some) plus its graphs' growth
        self._counted: dict[str, int] = {}
        #: pools the loop made that nothing has captured into yet (they hold no segment)
        self._new: set[tuple[int, int]] = set()

    def named(self, name: str):
        """The handle of the plan's pool ``name`` (made now if no graph used it yet); an
        ExecutorError for a pool the plan does not have."""
        if name not in self.planned:
            raise ExecutorError(
                f"pool {name!r} is not in the plan", where="CaptureLoop.pool", fix=f"use one of {sorted(self.planned)}"
            )
        return self.handle(name)

    def handle(self, name: str):
        """The handle of the plan's pool ``name``, made at its first use."""
        pool = self.handles.get(name)
        if pool is None:
            pool = self.handles[name] = torch.cuda.graph_pool_handle()
            self._new.add(pool_key(pool))
        return pool

    def count_engine_pools(self) -> None:
        """What the engine's pools hold as the loop opens (made before it)."""
        for name, handle in self.handles.items():
            self._counted[name] = one_pool_reserved(handle)

    def counted(self, name: str) -> int:
        """Bytes the pool held before the loop plus what its graphs grew it by so far."""
        return self._counted.get(name, 0)

    def grew(self, name: str, nbytes: int) -> None:
        self._counted[name] = self._counted.get(name, 0) + nbytes

    def first_capture(self, pool) -> bool:
        """Whether nothing recorded into ``pool`` yet: torch keeps no private pool for a
        handle until its first ``capture_begin``, so such a pool is not asked (it holds nothing)."""
        key = pool_key(pool)
        fresh = key in self._new
        self._new.discard(key)
        return fresh


def plan_streams(
    plan: Plan, stream: torch.cuda.Stream, given: Mapping[str, torch.cuda.Stream] | None
) -> dict[str, torch.cuda.Stream]:
    """The plan's stream names and the engine's streams ("capture": ``stream``); an
    ExecutorError for a name the plan does not declare."""
    declared = sorted(PlanIndex.of(plan).streams)
    for name in given or {}:
        if name not in declared:
            raise ExecutorError(
                f"stream {name!r} is not one the plan declares {declared}",
                where="capture_loop(streams=)",
                fix="name the plan's streams (a phase's stream in its spec)",
            )
    return {"capture": stream, **(given or {})}


def stream_of(streams: Mapping[str, torch.cuda.Stream], step: Step) -> torch.cuda.Stream:
    """The stream the plan records ``step`` on (the engine's stream of that name)."""
    stream = streams.get(step.stream)
    if stream is None:
        raise ExecutorError(
            f"the plan records this step on stream {step.stream!r}, which the loop was not given",
            where=f"step {step.index} ({step.id})",
            fix=f"capture_loop(plan, streams={{{step.stream!r}: <the engine's stream>}})",
        )
    return stream


def capture_hooks():
    """torch's global (start, end) capture-hook registrations, or None on a torch without them
    (before 2.14). Each takes ``fn(graph)`` and returns a handle whose ``remove()`` undoes it."""
    start = getattr(torch.cuda.graphs, "register_graph_capture_start_hook", None)
    end = getattr(torch.cuda.graphs, "register_graph_capture_end_hook", None)
    return (start, end) if callable(start) and callable(end) else None


def graph_pools(graph) -> list:
    """Every pool a graph that ended its capture holds: ``pools()`` (torch 2.14 on: its own
    and those a ``use_mem_pool`` inside the capture added), else its one ``pool()``."""
    pools = getattr(graph, "pools", None)
    return [*pools()] if callable(pools) else [graph.pool()]  # pyright: ignore[reportGeneralTypeIssues]


class OutsideGraphs:
    """Counts graphs recorded into ``pools`` (pool keys) outside the loop while it
    observes (see the module docstring: torch's capture hooks where it has them, else a
    wrapper of ``capture_begin`` on the class)."""

    def __init__(self, pools: frozenset):
        self.pools = pools
        #: graphs recorded into the pools outside the loop
        self.count = 0
        self._own = False
        self._undo: Callable[[], None] | None = None
        #: graphs whose capture began outside the loop's own recording and has not ended yet
        self._begun: dict[int, object] = {}
        #: the first error the capture-end hook met (torch swallows a hook's errors)
        self._error: Exception | None = None

    @contextlib.contextmanager
    def own(self):
        """The loop's own ``capture_begin`` runs in this block: not counted."""
        self._own = True
        try:
            yield
        finally:
            self._own = False

    def start(self) -> None:
        """Observe from now (only where the engine gave the loop its pools; once)."""
        if not self.pools or self._undo is not None:
            return
        hooks = capture_hooks()
        if hooks is not None:
            self._start_hooks(*hooks)
            return
        cls = torch.cuda.CUDAGraph
        if not isinstance(cls, type):
            return
        begin = cls.capture_begin

        def capture_begin(graph, *args, **kwargs):
            pool = kwargs.get("pool", args[0] if args else None)
            if not self._own and pool is not None and pool_key(pool) in self.pools:
                self.count += 1
            return begin(graph, *args, **kwargs)

        setattr(cls, "capture_begin", capture_begin)  # noqa: B010  # a wrapper of the method, not its signature
        self._undo = lambda: setattr(cls, "capture_begin", begin)  # noqa: B010

    def _start_hooks(self, on_start, on_end) -> None:
        def began(graph) -> None:
            # capture is live here: no CUDA work, and torch answers no pool() yet
            if not self._own:
                self._begun[id(graph)] = graph

        def ended(graph) -> None:
            if self._begun.pop(id(graph), None) is None:
                return
            # torch runs global hooks under `except Exception: pass` (torch/cuda/graphs.py:
            # _run_global_hooks, 2.14): an error here would leave the count short unsaid, so it
            # is kept and raised by stop()
            try:
                if any(pool_key(p) in self.pools for p in graph_pools(graph)):
                    self.count += 1
            except Exception as err:  # noqa: BLE001  # any: torch would swallow it
                if self._error is None:
                    self._error = err

        handles = [on_start(began), on_end(ended)]

        def undo() -> None:
            for handle in handles:
                handle.remove()
            self._begun.clear()

        self._undo = undo

    def stop(self) -> None:
        """Stop observing (the hooks removed, or the class's own method back). Raises
        ExecutorError where the capture-end hook could not read a graph's pools: the count
        would be short."""
        undo, self._undo = self._undo, None
        if undo is not None:
            undo()
        err, self._error = self._error, None
        if err is not None:
            raise ExecutorError(
                f"a graph recorded outside the loop could not be counted: its pools did not read ({err!r}); "
                "the capture-gap check would be short"
            ) from err


class Recording:
    """What :func:`record` measured once its block ended."""

    grown = 0
    nodes: int | None = None


@contextlib.contextmanager
def record(
    g: torch.cuda.CUDAGraph,
    pool,
    stream: torch.cuda.Stream,
    *,
    pools: Pools,
    mode: str,
    recorder: AllocationRecorder | None = None,
    outside: OutsideGraphs | None = None,
    instantiate: bool = True,
):
    """Record ``g`` into ``pool`` on ``stream`` while the block runs, in CUDA's capture
    error ``mode``. ``instantiate=False`` (a phase that shares executables) counts a kept
    graph's nodes and leaves its instantiation to the caller (``GraphSet.share``).

    Yields a :class:`Recording` that holds the bytes the pool grew by and the graph's
    node count once the block has ended. A block that raises leaves no partial graph
    behind: the graph is reset (it would hold its pool). ``recorder`` cuts the
    allocation history at the recording's bounds; ``outside`` is told the capture is the loop's."""
    with torch.cuda.stream(stream):
        if recorder is not None:
            recorder.begin()
        # The pool itself is measured (its segments in a snapshot): the device's
        # reserved-bytes counter also moves for allocations outside the pool meanwhile (the
        # CUDA RNG's graph-safe state at a pool's first capture, the serving thread in the
        # background), and the per-step figures are what the plan's timeline is checked against.
        reserved_before = 0 if pools.first_capture(pool) else one_pool_reserved(pool)
        rec = Recording()
        with outside.own() if outside is not None else contextlib.nullcontext():
            g.capture_begin(pool=pool, capture_error_mode=mode)
        try:
            yield rec
        except BaseException:
            try:
                g.capture_end()
            except Exception:  # the capture is already invalid; the original error matters
                pass
            g.reset()  # a partial graph holds its pool: release it so the pool can be emptied
            if recorder is not None:
                recorder.end()
            raise
        g.capture_end()
        # a graph the loop made (keep_graph=True) is counted and instantiated here, so its
        # driver memory lands on this step; an engine's own graph was instantiated by torch
        rec.nodes = instantiate_kept(g) if instantiate else node_count(g)
        rec.grown = one_pool_reserved(pool) - reserved_before
        if recorder is not None:
            recorder.end()
