"""One capture step of the plan as the engine's loop runs it (:class:`LoopStep`): its
warm-ups, its recording into the planned pool on the planned stream, and its outputs
held as planned. :mod:`capture_plan.executor.loop` makes one per graph key
(``loop.step(phase, bs, **labels)``) and owns what the steps share (:class:`StepHost`).

A step gives the engine what the plan decided for one capture:
``pool`` (the handle of the plan's pool), ``stream`` (the step's stream),
``warmups`` (eager runs before the capture), ``workspace`` (the hoisted
workspace, or None) and ``outputs`` (the output policy); ``graph()`` records
into that pool on that stream, and ``hold()`` holds the outputs as the
policy says. ``capture(plan, target)`` is itself a user of this loop
(:mod:`capture_plan.executor.driver`), so the pools, steps and dispatch of an
engine's loop come out as ``capture()``'s, provided the engine allocates
inside ``graph()`` what its target would allocate inside ``run``.

**What capture leaves behind: the graphs, and nothing else.** Once the loop
closes, the device holds the graph pools, the hoisted workspaces and what the
graphs need to run: the capture stream's cuBLAS workspace, created before the
first step in the ordinary allocator (outside every pool: a first GEMM inside
a capture would put it in the pool, and a first GEMM inside a warm-up would
put it in the warm-up's scratch memory). The warm-ups' temporaries are
*returned*, not reused: each warm-up block runs with this thread's
allocations routed into a scratch pool that is emptied and destroyed when the
block ends (:func:`capture_plan.executor.pool.scratch_pool`), so its blocks do
not stay cached on the capture stream, where nothing else could reuse them.
(Reusing them in the graph pool instead would change the pool's contents the
planner simulates.) This is safe while an engine serves (a background
capture) and for an engine that holds cached blocks of its own: only the
capture thread's allocations are routed, and only the scratch pool is
emptied, never the engine's cache. The report's ``device_view`` itemizes the
free device memory capture took (``capture_plan.executor.device``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Protocol

import torch

from capture_plan.schemas.keys import GraphKey
from capture_plan.schemas.plan import Step

from .cursor import Warmups
from .dispatch import dispatch_name
from .errors import ExecutorError
from .graphs import Captured, GraphSet
from .measure import Measurements
from .outputs import flatten, rows_per_request
from .pool import AllocationRecorder, one_pool_reserved, pool_key, scratch_pool, weak_view
from .recording import Pools, Recording, new_graph, stream_of

__all__ = ["LoopStep", "StepHost"]


class StepHost(Protocol):
    """What a :class:`LoopStep` uses of its loop (:class:`capture_plan.executor.loop.CaptureLoop`,
    named here by what it does, not imported: the loop imports this module)."""

    gs: GraphSet
    device: torch.device
    figures: Measurements
    pools: Pools
    streams: dict[str, torch.cuda.Stream]
    recorder: AllocationRecorder | None
    #: the plan step running (or that failed)
    running: Step | None
    #: bytes the warm-ups kept past their blocks
    kept: int
    t_start: float
    guard: Callable[[], contextlib.AbstractContextManager]

    def before_step(self, step: Step) -> None: ...

    def recording(
        self, g: torch.cuda.CUDAGraph, pool, stream: torch.cuda.Stream, *, instantiate: bool = True
    ) -> contextlib.AbstractContextManager[Recording]: ...

    def landed(self, cap: Captured) -> None: ...


class LoopStep:
    """One capture step of the plan (one graph key), as the engine's loop runs it.

    Attributes: ``phase``, ``bs``, ``labels`` (axis -> label, empty without
    variants), ``key`` (the :class:`~capture_plan.schemas.keys.GraphKey`, with
    ``tokens`` and the graph-key ``fields``: ``key.value("micro_batches")``, ...), ``index`` and
    ``id`` (the plan step),
    ``pool`` (the pool's handle) and ``pool_name``, ``stream`` (record on it;
    ``graph()`` does: the step's stream as the plan names it, a micro-batch
    twin's included), ``warmups`` (eager runs the plan wants before this
    capture: 0 when the phase was warmed up already), ``keeps`` (bytes its
    warm-ups may allocate and keep, None where the plan declares none),
    ``workspace`` (the phase's hoisted workspace, or None: compute it before
    recording and before every replay), ``outputs`` ("keep" or "view") and
    ``pieces`` (piece graphs the step records, None for one whole graph).

    A piecewise step (``pieces``: vLLM's PIECEWISE, whose compiled pieces run
    between eagerly-run attention ops) records each piece in its own
    ``graph()`` block followed by its ``hold()``, into the step's pool on the
    step's stream, with the engine's eager work between them; the step is
    complete once it has held as many pieces as the plan says.
    """

    def __init__(self, loop: StepHost, step: Step, key: GraphKey, t0: float, pending=()):
        self._loop, self.plan_step, self._t0, self.key = loop, step, t0, key
        self.phase, self.bs, self.index, self.id = step.phase, step.bs, step.index, step.id
        self.labels: dict[str, str] = dict(key.labels)
        self.pool_name = step.pool
        self.pool = loop.pools.handle(step.pool)
        self.stream = stream_of(loop.streams, step)
        #: the plan's warm-ups before this capture, each recorded once run
        self._warmups = Warmups(pending)
        #: eager runs the plan wants before this capture (0 when the phase was warmed up already)
        self.warmups = self._warmups.runs
        #: the plan's warm-up steps before this capture (each with its phase, bs and runs), in order
        self.planned: tuple[Step, ...] = self._warmups.planned
        #: bytes its warm-ups may allocate and keep, None where the plan declares none
        self.keeps: int | None = self._warmups.keeps
        self.workspace = loop.gs.workspaces.get(step.phase)
        self.outputs = step.outputs or "keep"
        self.pieces: int | None = step.pieces if isinstance(step.pieces, int) else None
        #: the graph recorded by ``graph()``, until ``hold()``
        self.recorded: torch.cuda.CUDAGraph | None = None
        self._grown = 0
        #: the recorded graph's node count, until the step is measured (None: not counted)
        self._nodes: int | None = None
        #: ``hold()`` has made the graph (every piece) servable
        self.landed = False
        #: pieces held so far (a piecewise step)
        self.held_pieces = 0
        #: the plan has the phase's whole graphs share executables (pieces never do)
        self.shares = self.pieces is None and loop.gs.reuses(step.phase)
        #: what replays the step's graph once held: the graph, or (``shares``) the graph
        #: through its group's executable; an engine that replays its own object swaps this in
        self.served: object | None = None

    @property
    def where(self) -> str:
        return f"step {self.index} ({self.id})"

    def _error(self, what: str, fix: str = "") -> ExecutorError:
        return ExecutorError(what, where=self.where, fix=fix)

    @contextlib.contextmanager
    def warmup(self, of: Step | None = None):
        """A block for the engine's warm-up runs, on the step's stream.

        Their temporaries go to a scratch pool that is returned at the end (so
        they stay cached nowhere). Where the plan declares that the step's
        warm-ups keep buffers (``keeps``: vLLM's persistent output buffers,
        SGLang's reused output buffer), the block runs in the ordinary
        allocator instead, so that what the engine keeps survives it, and
        measures what it kept (the device's allocated bytes across the block:
        in a background capture the serving thread's allocations meanwhile
        count too): more than declared is an ExecutorError naming the warm-up
        step (everything released). Optional: warm-ups outside it
        work, unchecked, and leave their blocks cached on whatever stream ran them.

        ``of``: one of :attr:`planned`, for a driver that runs each planned
        warm-up at its own size (``capture()`` does): the block is that step
        alone. Without it the block is all of this capture's planned warm-ups."""
        loop = self._loop
        mine = self._warmups.select(of, self.where)
        for w in mine:
            loop.before_step(w)
        if of is not None:
            loop.running = of
        declared = [w.keeps for w in mine if isinstance(w.keeps, int)]
        if declared:
            allowed = sum(declared)
            self.stream.synchronize()
            before = torch.cuda.memory_allocated(loop.device)
            with loop.guard(), torch.cuda.stream(self.stream):
                yield
                self.stream.synchronize()
            kept = torch.cuda.memory_allocated(loop.device) - before
            loop.running = self.plan_step
            if kept > allowed:
                w = mine[0]
                raise ExecutorError(
                    f"the warm-up kept {kept} B past its block, more than the {allowed} B the plan declares it keeps",
                    where=f"step {w.index} ({w.id})",
                    fix="free what the warm-up does not keep, or rebuild the plan with what it keeps "
                    '(warmup_keeps = "outputs" in the phase\'s spec, from a trace of this model)',
                )
            loop.kept += max(kept, 0)
            self._measure_warmups(None, mine)
            return
        with loop.guard(), torch.cuda.stream(self.stream), scratch_pool(loop.device) as scratch:
            yield
            self.stream.synchronize()  # the scratch pool's blocks are idle before it is emptied
        loop.running = self.plan_step
        self._measure_warmups(scratch.reserved, mine)

    def _measure_warmups(self, scratch: int | None, steps: list[Step] | None = None, *, outside: bool = False) -> None:
        """Record the plan's warm-up ``steps`` of this capture (default: all not yet
        recorded): the first carries the warm-ups' scratch peak (what a
        calibration's peak reads), none if the engine ran them outside
        ``warmup()`` (``outside``) or kept buffers past them. A later
        ``warmup()`` block of the step, its steps recorded, measures nothing."""
        loop = self._loop
        steps = list(self._warmups.pending) if steps is None else steps
        if steps and outside:  # run outside warmup(): exchanged now (distributed)
            for w in steps:
                loop.before_step(w)
        if not steps:
            # nothing to record: the capture's own time, which graph() and hold() ask this
            # too, runs on from its warm-ups (resetting it here left only hold()'s in it)
            return
        for k, w in enumerate(steps):
            loop.figures.step(w, self._t0, scratch=scratch if k == 0 else None)
        self._warmups.done(steps)
        self._t0 = time.perf_counter()  # the capture's own time starts after its warm-ups

    @contextlib.contextmanager
    def eager(self):
        """A block of the engine's own eager GPU work for this step outside
        its warm-ups (computing a hoisted workspace before recording, building
        the capture's forward, the attention between pieces), on the step's
        stream. In a background capture it is ordered against the serving
        thread's replays, as warm-ups are; in the foreground it only sets the stream."""
        with self._loop.guard(), torch.cuda.stream(self.stream):
            yield

    @contextlib.contextmanager
    def graph(self, cuda_graph: torch.cuda.CUDAGraph | None = None, *, pool=None, stream=None):
        """Record ``cuda_graph`` (a new one if None; the block receives it) into
        the step's pool on the step's stream, like ``torch.cuda.graph`` but
        without its device synchronization, cache flush and collection per
        capture. ``pool`` and ``stream``, if given, must be the step's (an
        engine that passes its own keeps its call as it was); a block that
        raises leaves no partial graph. A piecewise step records its next piece."""
        if self.recorded is not None:
            raise self._error("the step recorded a graph that is not held yet", "call step.hold() after each graph()")
        if self.landed and self.pieces is not None:
            raise self._error(
                f"the engine records a piece more than the {self.pieces} the plan's step has",
                f"rebuild the plan with the engine's piece count (pieces in the phase's spec; it says {self.pieces})",
            )
        if self.landed:
            raise self._error("the step recorded its graph already", "one graph() per step")
        if pool is not None and pool_key(pool) != pool_key(self.pool):
            raise self._error(
                f"the engine records into pool {pool_key(pool)}, not the plan's pool {self.pool_name!r} "
                f"{pool_key(self.pool)}",
                "pass step.pool (or leave pool out), or give capture_loop(pools=) the engine's pool",
            )
        if stream is not None and stream != self.stream:
            raise self._error(
                f"the engine records on stream {stream}, not the {self.plan_step.stream} stream {self.stream}: "
                "captures sharing a pool reuse memory only on one stream",
                "pass step.stream (or leave stream out), or give capture_loop(stream=, streams=) the engine's",
            )
        if self.held_pieces == 0:
            self._measure_warmups(None, outside=True)  # warm-ups the engine ran outside warmup(), if any
            self._loop.before_step(self.plan_step)
        # keep_graph: the loop counts the graph's nodes before it instantiates it (graph_nodes)
        g = cuda_graph if cuda_graph is not None else new_graph()
        with self._loop.recording(g, self.pool, self.stream, instantiate=not self.shares) as rec:
            yield g
        self.recorded = g
        self._grown += rec.grown
        if rec.nodes is not None:
            self._nodes = (self._nodes or 0) + rec.nodes

    def hold(self, outputs, *, graph: torch.cuda.CUDAGraph | None = None, ragged: bool = False):
        """Hold the step's outputs as the policy says and make its graph
        servable; returns ``outputs`` with every tensor replaced by what the
        engine should keep: the tensor itself ("keep"), or a non-owning view
        of it ("view"), valid until the next replay of any graph in the pool.

        ``outputs`` may be None: a graph that writes into the engine's buffers
        and returns nothing. Each output is sliced per request on replay where
        its rows are a multiple of ``bs`` (tokens: ``bs * tokens_per_request``
        rows); ``ragged=True`` holds the others whole (ragged verify's slots),
        which are an ExecutorError otherwise.

        A piece of a piecewise step is held as a non-owning view whatever the
        policy (what vLLM's piece wrappers keep of every piece's output:
        ``weak_ref_tensors``, vllm/compilation/cuda_graph.py
        ``CUDAGraphWrapper.__call__``), and ``outputs`` come back unchanged:
        the engine's forward goes on with them.

        With "view" the engine must drop its own references to the returned
        tensors before the next step (returning from its capture function
        does), or their memory is not reused. ``graph``: a graph the engine
        recorded itself, without ``graph()`` (its pool is checked; its stream
        cannot be)."""
        loop = self._loop
        if self.landed and self.pieces is not None:  # a piece the engine recorded itself (hold(graph=))
            raise self._error(
                f"the engine records a piece more than the {self.pieces} the plan's step has",
                f"rebuild the plan with the engine's piece count (pieces in the phase's spec; it says {self.pieces})",
            )
        if self.landed:
            raise self._error("the step's outputs are held already", "one hold() per step")
        if graph is not None:
            if self.recorded is not None:
                raise self._error("hold(graph=) after graph(): the step recorded its graph already")
            self._adopt(graph)
        if self.recorded is None:
            raise self._error("hold() before the graph was recorded", "record it in `with step.graph(g):` first")
        self._measure_warmups(None, outside=True)  # a graph the engine recorded itself (hold(graph=)): no graph() ran
        leaves, rebuild = flatten(outputs, self.where, loop.device)
        rows = rows_per_request(leaves, self.bs, ragged, self.where)
        piece = self.held_pieces if self.pieces is not None else None
        kept = self._land(leaves, rows, piece)
        del leaves
        self.recorded = None
        if piece is not None:
            self.held_pieces += 1
            if self.held_pieces < self.pieces:  # pyright: ignore[reportOperatorIssue]  # pieces set: piece is not None
                return outputs
        loop.pools.grew(self.pool_name, self._grown)
        loop.figures.reserved += self._grown
        self.landed = True
        name = dispatch_name(self.phase, self.key.labels)
        loop.gs.timeline.append((time.perf_counter() - loop.t_start, name, self.bs))
        loop.landed(loop.gs.graphs[(dispatch_name(self.phase, self.key.labels, piece), self.bs)])
        loop.figures.step(self.plan_step, self._t0, nodes=self._nodes)
        return outputs if piece is not None else rebuild(kept)

    def _land(self, outs: tuple[torch.Tensor, ...], rows: tuple[int, ...], piece: int | None):
        """Hold the recorded graph's outputs as planned and make it servable;
        returns the held outputs. With ``outputs = "view"`` (and for a piece)
        the held outputs do not keep the memory: the caller drops ``outs``
        before the next capture, or it stays allocated."""
        gs = self._loop.gs
        assert self.recorded is not None  # hold() checked
        held = "view" if piece is not None else self.outputs
        kept = tuple(weak_view(t) for t in outs) if held == "view" else outs
        del outs
        name = dispatch_name(self.phase, self.key.labels, piece)
        # a phase that shares executables: the graph joins a group's (or is instantiated now,
        # on this step, where it shares none)
        graph = gs.share(self.phase, f"{name}/{self.bs}", self.recorded) if self.shares else self.recorded
        self.served = graph
        gs.add(
            Captured(
                phase=name,
                bs=self.bs,
                pool=self.pool_name,
                graph=graph,
                outputs=kept,
                held=held,
                rows=rows,
                key_phase=self.phase,
                labels=self.key.labels,
                piece=piece,
            )
        )
        return kept

    def _adopt(self, graph) -> None:
        """A graph recorded by the engine's own call: its pool must be the step's."""
        if self._loop.recorder is not None:
            raise self._error(
                "record=True needs the graph recorded in `with step.graph(g):` (the allocation "
                "history is cut at its bounds)",
                "record through step.graph()",
            )
        got = pool_key(graph.pool())
        if got != pool_key(self.pool):
            graph.reset()  # nothing half-captured: it holds the wrong pool
            raise self._error(
                f"the engine recorded into pool {got}, not the plan's pool {self.pool_name!r} {pool_key(self.pool)}",
                "record with pool=step.pool",
            )
        self.recorded = graph
        # what the pool holds now, less what it held before this step's graph
        self._grown = one_pool_reserved(self.pool) - self._loop.pools.counted(self.pool_name)
