"""``capture_loop(plan)``: the plan's steps inside the engine's own capture loop.

Engines keep their capture loop -- its streams, TP barriers, buffer layouts,
dispatch keys and per-phase runners -- and let the plan decide what the loop
iterates and how each graph is recorded and held::

    with capture_loop(plan, stream=self.stream) as loop:
        for phase in loop.phases:                                         # the plan's phase order
            for bs in loop.sizes(phase):                                  # was: reversed(capture_bs)
                step = loop.step(phase, bs)
                with step.warmup():
                    for _ in range(step.warmups):                         # was: range(2)
                        forward(bs)
                graph = torch.cuda.CUDAGraph()
                with step.graph(graph):                                   # was: torch.cuda.graph(graph, pool)
                    out = forward(bs)
                self.outputs[(phase, bs)] = step.hold(out)                # keep, or a non-owning view
    graphs = loop.graphs                                                  # the same GraphSet as capture()

A :class:`LoopStep` gives the engine what the plan decided for one capture:
``pool`` (the handle of the plan's pool), ``stream`` (the step's stream),
``warmups`` (eager runs before the capture), ``workspace`` (the hoisted
workspace, or None) and ``outputs`` (the output policy); ``graph()`` records
into that pool on that stream, and ``hold()`` holds the outputs as the
policy says. ``capture(plan, target)`` is itself a user of this loop
(:mod:`capture_plan.executor.driver`), so the pools, steps and dispatch of an
engine's loop come out as ``capture()``'s, provided the engine allocates
inside ``graph()`` what its target would allocate inside ``run``.

What real engines capture (SGLang 0.5.23's and vLLM 0.33.0's runners in
``tests/engines/``): several graphs per size (``loop.step(phase, bs,
**labels)``: one graph key per step, ``loop.keys(phase)``); piecewise steps
(``step.pieces`` piece graphs, each in ``graph()`` then ``hold()``, the
engine's eager attention between them); pools the engine made
(``pools=``: a graph-pool handle or a ``torch.cuda.MemPool``; graphs recorded
into them outside the loop are counted apart in the report) and the streams
the plan declares (``streams=``: a micro-batch twin's); buffers a warm-up
allocates and the engine keeps, declared in the plan (``step.keeps``) and
checked; a declared partial profiling pass (``profiling=``), torn down at
``close()``; outputs that are None, and rows that are tokens or ragged slots.
``docs/executor.md`` says how each maps onto the engines.

Checks, each an :class:`ExecutorError` naming the plan step: a key the plan
does not hold, or one asked for out of the plan's order; a graph recorded
into another pool or on another stream than the step's; a piece count that
differs from the plan's; a warm-up that keeps more than the plan declares;
outputs the policy cannot hold (a structure without any tensor, anything but
tensors in tuples, lists, dicts and dataclasses, a tensor on another device,
rows that are no multiple of the batch unless held ``ragged``); a step left
unfinished; a loop that ends before the plan's last capture (a profiling
pass: before its last declared one). On any error
inside the ``with`` block every graph is released and the pools emptied, and
the error (a :class:`CaptureFailed` for one that is not the executor's own)
names the step. The engine's own references to graphs and kept outputs
would keep the pools' memory: ``on_failure`` is called first, for the engine
to drop them (SGLang's backend ``cleanup``).

The ``with`` block is ``open()`` and ``close()`` (or ``fail()``). Engines
whose runners capture at different times (SGLang's target runner, then its
EAGLE draft runners) share one loop through ``with loop.part():`` around
each runner's capture: the first part opens it, the one that holds the
plan's last capture closes it, an error in any releases all.
``docs/adoption.md`` has the diffs against SGLang's and vLLM's loops.

**The loop owns a capture step.** Everything one capture is made of lives
here: ``open`` primes the capture stream (:mod:`capture_plan.executor.streams`)
and freezes the collector; ``step()`` runs the plan's provision steps
(a hoisted workspace, allocated outside every graph pool) and hands the
engine a :class:`LoopStep`, whose ``warmup()`` runs warm-ups in a scratch
pool, ``graph()`` records one CUDA graph into the planned pool on the capture
stream and ``hold()`` holds the outputs as planned and makes the graph
servable; :class:`capture_plan.executor.measure.Measurements` records each
step's figures and writes the report. The pool is measured after every
capture against the plan's prediction (its segments in a memory snapshot,
:func:`capture_plan.executor.pool.one_pool_reserved`; one snapshot of every
pool at the end confirms the total). The steps
allocate in exactly the order the planner simulated: that is what makes its
predictions exact, so a change here that moves, adds or drops an allocation
changes what the plans predict.

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

Unlike ``torch.cuda.graph(...)``, it does not synchronize and empty the cache
at every capture (vLLM turns that off too): that per-capture overhead is most
of the capture time of the engines' loop. It never runs a full garbage
collection either: one costs about a second in a server process with ~10
million live objects, more than the capture. The collector's old objects are
frozen while capturing (``capture_plan.executor.heap``); ``GraphSet.release`` collects only
the young generations, and only if a pool is still held after every reference
was dropped. A dead reference cycle that holds CUDA memory from before
the capture stays reserved until the engine's next collection (that memory
is outside the graph pools: the plan's prediction does not depend on it).

``loop.start(body)`` runs the engine's loop ``body(loop)`` on a thread while
the engine serves from the GraphSet (background capture, as
``capture(..., background=True)``).

What it does not do: run the engine's warm-ups or forward (the engine does,
with its own buffers, barriers and stream), synchronize ranks between steps
(the engine's barriers do; the ranks' plans are checked to agree when
``torch.distributed`` is initialized), or check the stream of a graph
recorded outside ``graph()`` (``hold(out, graph=g)`` checks only its pool).
An engine runs its warm-ups at the capture's own size (``step.warmups`` runs):
where a plan warms a phase up once at its largest size and captures
smallest-first, the runs move to the first capture, which changes memory
outside the pools only. A driver that can run any size (``capture()``) runs
each of ``step.planned`` at its own size in ``step.warmup(of=...)``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
import traceback
from collections.abc import Callable, Iterator, Mapping

import torch

from capture_plan.schemas.keys import GraphKey, order_labels, step_labels
from capture_plan.schemas.plan import PhasePlan, Plan, Step

from .device import probe
from .distributed import is_distributed, rank0
from .errors import ExecutorError, capture_failed
from .graph_nodes import instantiate_kept
from .graphs import Captured, Fallback, GraphSet, dispatch_name
from .heap import Frozen
from .measure import Measurements
from .pool import AllocationRecorder, one_pool_reserved, pool_key, scratch_pool, weak_view
from .streams import capture_stream, prime_stream

__all__ = ["capture_loop", "CaptureLoop", "LoopStep", "Unattached", "PIECEWISE_KINDS"]


def _clear_frames(exc: BaseException | None) -> None:
    """Clear the frames of an exception and of every exception chained to it:
    they hold the partial capture's tensors and graphs."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


#: phase kinds whose graphs are pieces between eagerly-run attention ops (vLLM's PIECEWISE):
#: planner/data/phase_kinds.toml defines the kind; a step of one records its plan's ``pieces``
PIECEWISE_KINDS = frozenset({"piecewise"})


def _key(phase: PhasePlan, step: Step) -> GraphKey:
    """The graph key ``step`` (of ``phase``) captures (``schemas.keys.step_key``, the phase at hand)."""
    return GraphKey(
        phase=step.phase,
        bs=step.bs,
        labels=step_labels(phase, step),
        tokens=step.bs * phase.tokens_per_request,
        micro_batches=phase.micro_batches if isinstance(phase.micro_batches, int) else 1,
    )


def _text(phase: str, bs: int, labels) -> str:
    """``decode/8``, ``decode/8/lora=nolora``: a key as messages name it."""
    return dispatch_name(f"{phase}/{bs}", labels)


def _selected(plan: Plan, profiling: Mapping[str, int] | None) -> list[Step]:
    """The plan's steps a loop runs: all of them, or for a profiling pass the first
    ``profiling[phase]`` capture keys of each named phase (every key of the others),
    with the warm-ups before a kept capture and every provision step."""
    if profiling is None:
        return list(plan.steps)
    names = {p.name for p in plan.phases}
    unknown = sorted(set(profiling) - names)
    if unknown:
        raise ExecutorError(
            f"the profiling pass names phase {unknown[0]!r}, which the plan does not have",
            where="capture_loop(profiling=)",
            fix=f"name the plan's phases {sorted(names)}",
        )
    seen: dict[str, int] = {}
    keep: list[Step] = []
    warmups: list[Step] = []
    for s in plan.steps:
        if s.op == "warmup":
            warmups.append(s)
        elif s.op == "capture":
            seen[s.phase] = seen.get(s.phase, 0) + 1
            if seen[s.phase] <= profiling.get(s.phase, seen[s.phase]):
                keep += warmups + [s]
            warmups = []
        else:
            keep.append(s)
    return keep  # warm-ups after the last kept capture precede nothing the pass captures


class _Stopped(BaseException):
    """Ends the engine's loop on the capture thread after ``release()`` (a
    BaseException: an engine's ``except Exception`` does not swallow it)."""


class Unattached:
    """The target of a GraphSet whose graphs the engine's loop captured: it has
    no eager function. Replays of phases without a hoisted workspace work;
    an eager run (``verify``) or a hoisted workspace's refresh raise, saying
    what to pass."""

    def _missing(self, what: str, phase: str):
        raise ExecutorError(
            f"no {what} for phase {phase!r}: the engine's loop captured these graphs",
            where="GraphSet",
            fix="pass capture_loop(plan, target=...) an object with run, prepare "
            "and refresh (capture_plan.executor.engine.EngineFunctions wraps the engine's eager "
            "function)",
        )

    def run(self, phase, bs, workspace):
        self._missing("eager function", phase)

    def prepare(self, phase, n, bs, generator):
        self._missing("input preparation", phase)

    def refresh(self, phase, n, bs, workspace):
        self._missing("workspace refresh", phase)


def _new_graph() -> torch.cuda.CUDAGraph:
    """A graph that keeps its ``cudaGraph_t`` for the node count (torch 2.8 on); a plain
    one on an older torch, whose graphs are then not counted (graph_nodes None)."""
    try:
        return torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:  # torch < 2.8: no keep_graph
        return torch.cuda.CUDAGraph()


def _walk(x, path: str, where: str, device: torch.device, leaves: list):
    """Append the tensors of ``x`` to ``leaves``; return a function that rebuilds ``x``.

    A module-level function, not a closure over ``leaves``: a recursive nested
    function is a reference cycle that would keep the engine's outputs alive
    until the next collection (and the collector is frozen while capturing),
    so "view" outputs would not be reused by the next capture. The rebuilders
    hold types and leaf indices, never the engine's tensors."""
    if isinstance(x, torch.Tensor):
        if x.device.type != device.type:
            raise ExecutorError(
                f"output {path} is on {x.device}, not {device}: a replay never writes it",
                where=where,
                fix="return the tensors the graph computes on the device",
            )
        leaves.append(x)
        i = len(leaves) - 1
        return lambda held: held[i]
    if x is None:
        return lambda held: None
    kind = type(x)
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a named tuple
        fields = x._fields  # pyright: ignore[reportAttributeAccessIssue]  # hasattr above
        parts = [_walk(v, f"{path}.{k}", where, device, leaves) for k, v in zip(fields, x)]
        return lambda held: kind(*(p(held) for p in parts))
    if isinstance(x, (tuple, list)):
        parts = [_walk(v, f"{path}[{i}]", where, device, leaves) for i, v in enumerate(x)]
        return lambda held: kind(p(held) for p in parts)
    if isinstance(x, dict):
        fields = {k: _walk(v, f"{path}[{k!r}]", where, device, leaves) for k, v in x.items()}
        return lambda held: {k: p(held) for k, p in fields.items()}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        fields = {
            f.name: _walk(getattr(x, f.name), f"{path}.{f.name}", where, device, leaves) for f in dataclasses.fields(x)
        }
        template = copy.copy(x)  # its other fields; the tensor fields are replaced on every rebuild
        for name in fields:
            object.__setattr__(template, name, None)

        def rebuild(held):
            new = copy.copy(template)
            for k, p in fields.items():
                object.__setattr__(new, k, p(held))  # frozen dataclasses too
            return new

        return rebuild
    raise ExecutorError(
        f"output {path} is a {kind.__name__}: the output policy holds tensors",
        where=where,
        fix="return tensors, or tuples, lists, dicts or dataclasses of them (None allowed)",
    )


def _flatten(out, where: str, device: torch.device):
    """The tensors of ``out`` in order, and a function that rebuilds ``out`` from
    replacements for them; an ExecutorError for anything the policy cannot hold.
    ``None`` is a graph that returns nothing (it writes into the engine's buffers):
    no tensors; a structure without any tensor is refused (an engine's mistake)."""
    if out is None:
        return (), lambda held: None
    leaves: list[torch.Tensor] = []
    try:
        rebuild = _walk(out, "out", where, device, leaves)
    except ExecutorError:
        leaves.clear()  # the error's frames keep this list: let go of the outputs now
        raise
    if not leaves:
        raise ExecutorError(
            "the step's outputs hold no tensor: a graph that returns nothing cannot be replayed for its results",
            where=where,
            fix="return the output tensors the engine reads, or hold(None) for a graph that writes into buffers",
        )
    return tuple(leaves), rebuild


class LoopStep:
    """One capture step of the plan (one graph key), as the engine's loop runs it.

    Attributes: ``phase``, ``bs``, ``labels`` (axis -> label, empty without
    variants), ``key`` (the :class:`~capture_plan.schemas.keys.GraphKey`, with
    ``tokens`` and ``micro_batches``), ``index`` and ``id`` (the plan step),
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

    def __init__(self, loop: CaptureLoop, step: Step, key: GraphKey, warmups: int, t0: float, pending=()):
        self._loop, self.plan_step, self._t0, self.key = loop, step, t0, key
        self.phase, self.bs, self.index, self.id = step.phase, step.bs, step.index, step.id
        self.labels: dict[str, str] = dict(key.labels)
        self.pool_name = step.pool
        self.pool = loop.handle(step.pool)
        self.stream = loop.stream_of(step)
        self.warmups = warmups
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
        #: the plan's warm-up steps before this capture (each with its phase, bs and runs), in order
        self.planned: tuple[Step, ...] = tuple(pending)
        declared = [w.keeps for w in self.planned if isinstance(w.keeps, int)]
        self.keeps: int | None = sum(declared) if declared else None
        #: those not yet recorded: measured once the engine's warm-ups ran
        self._pending = list(pending)

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
        if of is not None and of not in self._pending:
            raise self._error(f"{of.id} is not a warm-up of this step still to run", "pass one of step.planned")
        mine = [of] if of is not None else list(self._pending)
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
        steps = list(self._pending) if steps is None else steps
        if steps and outside:  # run outside warmup(): exchanged now (distributed)
            for w in steps:
                loop.before_step(w)
        for k, w in enumerate(steps):
            loop.figures.step(w, self._t0, scratch=scratch if k == 0 else None)
            self._pending.remove(w)
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
        g = cuda_graph if cuda_graph is not None else _new_graph()
        with self._loop.recording(g, self.pool, self.stream) as rec:
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
        leaves, rebuild = _flatten(outputs, self.where, loop.device)
        rows = self._rows(leaves, ragged)
        piece = self.held_pieces if self.pieces is not None else None
        kept = self._land(leaves, rows, piece)
        del leaves
        self.recorded = None
        if piece is not None:
            self.held_pieces += 1
            if self.held_pieces < self.pieces:  # pyright: ignore[reportOperatorIssue]  # pieces set: piece is not None
                return outputs
        loop.grew(self.pool_name, self._grown)
        loop.figures.reserved += self._grown
        self.landed = True
        name = dispatch_name(self.phase, self.key.labels)
        loop.gs.timeline.append((time.perf_counter() - loop.t_start, name, self.bs))
        loop.landed(loop.gs.graphs[(dispatch_name(self.phase, self.key.labels, piece), self.bs)])
        loop.figures.step(self.plan_step, self._t0, nodes=self._nodes)
        return outputs if piece is not None else rebuild(kept)

    def _rows(self, outs: tuple[torch.Tensor, ...], ragged: bool) -> tuple[int, ...]:
        """Rows per request of each output: its rows over ``bs`` (0: held whole:
        a 0-dim output, or with ``ragged`` one whose rows are no multiple of it;
        without ``ragged`` that is an ExecutorError naming the step)."""
        rows = []
        for i, t in enumerate(outs):
            per, rem = divmod(t.shape[0], self.bs) if t.dim() else (0, 0)
            if rem and not ragged:
                which = "output" if i == 0 else f"output {i}"
                raise self._error(
                    f"{which} has {t.shape[0]} rows, not a multiple of bs {self.bs}",
                    "return per-request or per-token rows, or hold(out, ragged=True) for slots held whole",
                )
            rows.append(0 if rem else per)
        return tuple(rows)

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
        gs.add(
            Captured(
                phase=dispatch_name(self.phase, self.key.labels, piece),
                bs=self.bs,
                pool=self.pool_name,
                graph=self.recorded,
                outputs=kept,
                held=held,
                rows_per_request=rows[0] if rows and rows[0] else 1,
                order=len(gs.graphs),
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
        self._grown = one_pool_reserved(self.pool) - self._loop.counted(self.pool_name)


class _Recording:
    """What :meth:`CaptureLoop.recording` measured once its block ended."""

    grown = 0
    nodes: int | None = None


class CaptureLoop:
    """The plan's steps, driven by the engine's loop; see the module docstring.

    Use it as a context manager: entering primes the capture stream (its
    cuBLAS workspace outside every pool) and freezes the collector's old
    objects; a clean exit checks that every planned capture was made, then
    writes the report (``graphs.report``); an error releases everything.

    ``guard`` wraps every block that executes work on the GPU outside a graph
    (provision, warm-ups, the refresh before a capture): nothing in the
    foreground, the ordering against concurrent replays in the background.
    ``mode`` is CUDA's capture error mode: "global" (foreground) also fails
    the capture if any other thread makes an unsafe call meanwhile;
    "thread_local" (background) lets the engine's threads keep launching work.
    """

    def __init__(
        self,
        plan: Plan,
        *,
        device=None,
        stream: torch.cuda.Stream | None = None,
        pools: dict | None = None,
        target=None,
        record: bool = False,
        group=None,
        on_failure: Callable[[], None] | None = None,
        progress=None,
        t_start: float | None = None,
        streams: Mapping[str, torch.cuda.Stream] | None = None,
        profiling: Mapping[str, int] | None = None,
    ):
        self.t_start = t_start if t_start is not None else time.perf_counter()
        self.plan, self.group, self.on_failure = plan, group, on_failure
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.gs = GraphSet(plan, target if target is not None else Unattached(), self.device)
        self._phase_plans = {p.name: p for p in plan.phases}
        #: a declared partial pass (an engine's memory-profiling pass): per phase, how many of
        #: its first keys it captures (phases not named: all), into pools torn down at the end
        self.profiling = dict(profiling) if profiling is not None else None
        #: the plan's steps this loop runs (all of them, but for a profiling pass)
        self.run_steps: list[Step] = _selected(plan, self.profiling)
        planned = {s.pool for s in plan.steps if s.op == "capture"}
        #: the engine's own objects behind its pools (a torch.cuda.MemPool): kept alive with the loop
        self._pool_objects: list = []
        for name, handle in (pools or {}).items():
            if name not in planned:
                raise ExecutorError(
                    f"pool {name!r} is not one of the plan's pools {sorted(planned)}",
                    where="capture_loop(pools=)",
                    fix="name the plan's pools",
                )
            if hasattr(handle, "id") and not isinstance(handle, tuple):  # a torch.cuda.MemPool: its id is the handle
                self._pool_objects.append(handle)
                handle = handle.id
            self.gs.pools[name] = handle
        #: the pools the engine made (graphs outside the loop may record into them too)
        self.engine_pools = frozenset(pool_key(h) for h in self.gs.pools.values())
        #: per pool: its bytes before the loop (an engine's pool may hold some) plus its graphs' growth
        self._counted: dict[str, int] = {}
        #: the stream every graph records on: the engine's, or the executor's one per device
        self.stream: torch.cuda.Stream = stream if stream is not None else capture_stream(self.device)
        declared = sorted({s.stream for s in plan.steps if s.op in ("capture", "warmup")} | {"capture"})
        for name in streams or {}:
            if name not in declared:
                raise ExecutorError(
                    f"stream {name!r} is not one the plan declares {declared}",
                    where="capture_loop(streams=)",
                    fix="name the plan's streams (a phase's stream in its spec)",
                )
        #: the plan's stream names and the engine's streams ("capture": ``stream``)
        self.streams: dict[str, torch.cuda.Stream] = {"capture": self.stream, **(streams or {})}
        #: bytes the warm-ups kept past their blocks (checked against the plan's ``keeps``)
        self.kept = 0
        #: graphs recorded into the loop's pools outside the loop (an engine's piecewise
        #: wrappers, its encoder graphs), and the bytes the pools grew by outside the loop's graphs
        self.outside_graphs = 0
        self._own = False
        self._observer: tuple | None = None
        self.recorder = AllocationRecorder() if record else None
        self.figures = Measurements(plan, self.device, bar=progress, show=rank0(group), t_start=self.t_start)
        self.mode = "global"
        self.guard: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        #: called with each graph as it lands (the background capture's serving side)
        self.on_land: Callable[[Captured], None] | None = None
        #: called before each plan step runs (``capture()`` exchanges the ranks' status there)
        self.on_step: Callable[[Step], None] | None = None
        #: the plan step running (or that failed)
        self.running: Step | None = None
        #: pools this loop made that nothing has captured into yet (they hold no segment)
        self._new_pools: set[tuple[int, int]] = set()
        #: index of the next plan step to run
        self._next = 0
        self.current: LoopStep | None = None
        self._heap: Frozen | None = None
        self._done = self._failed = False
        self._phases = list(dict.fromkeys(s.phase for s in self.run_steps if s.op == "capture"))
        #: (phase, bs, labels) of every key the loop captures, for step()'s check
        self._held = {(s.phase, s.bs, tuple(s.labels or ())) for s in self.run_steps if s.op == "capture"}
        self.figures.captures = len(self._held)

    def pool(self, name: str):
        """The handle of the plan's pool ``name`` (made now if no graph used it
        yet): for an engine that sets up its pool before its loop."""
        if name not in {s.pool for s in self.plan.steps if s.op == "capture"}:
            raise ExecutorError(
                f"pool {name!r} is not in the plan",
                where="CaptureLoop.pool",
                fix=f"use one of {sorted({s.pool for s in self.plan.steps if s.op == 'capture'})}",
            )
        return self.handle(name)

    def stream_of(self, step: Step) -> torch.cuda.Stream:
        """The stream the plan records ``step`` on (the engine's stream of that name)."""
        stream = self.streams.get(step.stream)
        if stream is None:
            raise ExecutorError(
                f"the plan records this step on stream {step.stream!r}, which the loop was not given",
                where=f"step {step.index} ({step.id})",
                fix=f"capture_loop(plan, streams={{{step.stream!r}: <the engine's stream>}})",
            )
        return stream

    def handle(self, name: str):
        """The handle of the plan's pool ``name``, made at its first use."""
        pool = self.gs.pools.get(name)
        if pool is None:
            pool = self.gs.pools[name] = torch.cuda.graph_pool_handle()
            self._new_pools.add(pool_key(pool))
        return pool

    @property
    def graphs(self) -> GraphSet:
        """The GraphSet, once the ``with`` block has ended cleanly."""
        if not self._done:
            raise ExecutorError(
                "the capture loop has not finished",
                where="CaptureLoop.graphs",
                fix="read graphs after the `with capture_loop(...)` block",
            )
        return self.gs

    # -- the engine's loop -------------------------------------------------
    @property
    def phases(self) -> list[str]:
        """The plan's phases in the order it captures them. Per-phase loops
        follow the plan only while each phase's captures are contiguous, as in
        the plans the planner builds but for a micro-batch twin's (``twin_of``:
        interleaved with its phase; iterate :meth:`keys` for those); ``step()``
        refuses anything else."""
        return list(self._phases)

    def _phase(self, phase: str, where: str):
        if phase not in self._phases:
            raise ExecutorError(
                f"phase {phase!r} is not in the plan; it captures {self._phases}",
                where=where,
                fix="name the phase as the plan does",
            )
        return self._phase_plans[phase]

    def keys(self, phase: str | None = None) -> list[GraphKey]:
        """The phase's graph keys (every phase's, without ``phase``) in the
        plan's order (a profiling pass: the ones it captures): phase, size,
        labels, tokens, micro-batches. An engine that keys graphs its own way
        (vLLM's descriptors) iterates its keys in this order."""
        if phase is not None:
            self._phase(phase, "CaptureLoop.keys")
        return [
            _key(self._phase_plans[s.phase], s)
            for s in self.run_steps
            if s.op == "capture" and (phase is None or s.phase == phase)
        ]

    def sizes(self, phase: str) -> list[int]:
        """The phase's capture sizes in the plan's order (what the engine's loop
        iterates; each once, however many graph keys it has)."""
        self._phase(phase, "CaptureLoop.sizes")
        return list(dict.fromkeys(s.bs for s in self.run_steps if s.op == "capture" and s.phase == phase))

    def labels(self, phase: str, bs: int) -> list[dict[str, str]]:
        """The labels of the phase's keys at size ``bs``, in the plan's order
        (SGLang's loop: per size, per LoRA variant, per attention variant)."""
        return [dict(k.labels) for k in self.keys(phase) if k.bs == bs]

    def steps(self, phase: str) -> Iterator[LoopStep]:
        """``step(...)`` for every key of ``keys(phase)``."""
        for k in self.keys(phase):
            yield self.step(phase, k.bs, **dict(k.labels))

    def step(self, phase: str, bs: int, **labels: str) -> LoopStep:
        """Begin the plan's next capture, which must be the graph key ``phase``
        at ``bs`` with ``labels`` (one per variant axis of the phase).

        The plan's provision steps before it run now (the workspace is
        allocated outside every pool); its warm-up steps become the step's
        ``warmups``. Raises ExecutorError naming the plan's step when the
        engine asks for a key the plan does not hold, another key than the
        next, or left the previous step unfinished."""
        if self._heap is None:
            raise ExecutorError(
                "the capture loop is not open", where="CaptureLoop.step", fix="use `with capture_loop(plan) as loop:`"
            )
        job = self.gs.background
        if job is not None and job.stopping.is_set():
            raise _Stopped()  # released while capturing in the background: the engine's loop ends here
        pp = self._phase(phase, "CaptureLoop.step")
        try:
            pairs = order_labels(pp, labels)
        except ValueError as err:
            axes = ", ".join(f"{a.name}=..." for a in pp.variants) if isinstance(pp.variants, list) else ""
            raise ExecutorError(
                str(err), where="CaptureLoop.step", fix=f"loop.step({phase!r}, bs{', ' + axes if axes else ''})"
            ) from None
        want = _text(phase, bs, pairs)
        cur = self.current
        if cur is not None and not cur.landed:
            raise self._unheld(cur, f"the engine's loop moved on to {want}")
        if pp.kind in PIECEWISE_KINDS and not isinstance(pp.pieces, int):
            raise ExecutorError(
                f"phase {phase!r} is {pp.kind!r} but the plan does not say how many piece graphs a capture records",
                where="CaptureLoop.step",
                fix='rebuild the plan with the phase\'s pieces (pieces = N or "attention" in its spec)',
            )
        steps = self.run_steps
        if (phase, bs, tuple(lbl for _, lbl in pairs)) not in self._held:
            have = self.keys(phase)
            raise ExecutorError(
                f"the plan holds no graph key {want}; phase {phase} has {len(have)} keys, sizes {self.sizes(phase)}",
                where="CaptureLoop.step",
                fix="iterate loop.keys(phase) (or loop.sizes(phase) and loop.labels(phase, bs))",
            )
        t0 = time.perf_counter()
        warmups, i, pending = 0, self._next, []
        while i < len(steps) and steps[i].op != "capture":
            s = steps[i]
            if s.op == "warmup":  # the engine runs it: at the capture, below; measured when it has
                warmups += max(s.runs, 1)
                pending.append(s)
            else:
                self.setup(s)
            i += 1
        if i == len(steps):
            raise ExecutorError(
                f"the engine's loop asked for {want}, but the plan's captures are all made",
                where="CaptureLoop.step",
                fix="iterate loop.keys(phase)",
            )
        s = steps[i]
        self.running = s
        key = _key(self._phase_plans[s.phase], s)
        if (key.phase, key.bs, key.labels) != (phase, bs, pairs):
            raise ExecutorError(
                f"the engine's loop asked for {want} out of the plan's order: the plan's next "
                f"capture is {_text(key.phase, key.bs, key.labels)}",
                where=f"step {s.index} ({s.id})",
                fix=f"iterate loop.keys(phase) (loop.sizes(phase)), the phases in the plan's order {self._phases}",
            )
        self._next = i + 1
        self.current = LoopStep(self, s, key, warmups, t0, pending)
        return self.current

    def _unheld(self, cur: LoopStep, what: str) -> ExecutorError:
        """The error for a step left before its outputs (every piece's) were held."""
        if cur.pieces is not None and cur.held_pieces:
            return ExecutorError(
                f"{what} after {cur.held_pieces} of the step's {cur.pieces} pieces: the engine's piece count "
                "differs from the plan's",
                where=cur.where,
                fix=f"rebuild the plan with pieces = {cur.held_pieces} in the phase's spec (the engine's splits)",
            )
        return ExecutorError(
            f"{what} before the step's outputs were held",
            where=cur.where,
            fix="record the graph in step.graph() and call step.hold() before the next step",
        )

    def before_step(self, step: Step) -> None:
        """About to run the plan's ``step``: the hook ``on_step``, if any."""
        if self.on_step is not None:
            self.on_step(step)

    def counted(self, pool_name: str) -> int:
        """Bytes the pool held before the loop plus what its graphs grew it by so far."""
        return self._counted.get(pool_name, 0)

    def grew(self, pool_name: str, nbytes: int) -> None:
        self._counted[pool_name] = self._counted.get(pool_name, 0) + nbytes

    # -- the parts of a step -------------------------------------------------
    def setup(self, step: Step) -> None:
        """Run a plan step that is no capture's (a provision) and measure it."""
        self.before_step(step)
        self.running = step
        t0 = time.perf_counter()
        if step.op in ("warmup", "capture"):  # they run with the capture they precede
            raise ExecutorError(
                f"a {step.op} step after the plan's last capture: nothing follows it",
                where=f"step {step.index} ({step.id})",
                fix="rebuild the plan (planner builds end with a capture)",
            )
        if step.op != "provision":  # the plan decoder admits only StepOp; a new op needs a branch here
            raise ExecutorError(
                f"unknown step op {step.op!r}",
                where=f"step {step.index} ({step.id})",
                fix="upgrade capture-plan's executor to one that knows this op",
            )
        # The phase's hoisted workspace, outside every graph pool. On a background capture's
        # thread the current stream is the legacy default stream, whose work synchronizes
        # with every other stream: use the capture stream.
        on_stream = torch.cuda.stream(self.stream) if self.mode != "global" else contextlib.nullcontext()
        with self.guard(), on_stream:
            self.gs.workspaces[step.phase] = torch.zeros(max(step.bytes, 1), dtype=torch.uint8, device=self.device)
        self.figures.step(step, t0)

    @contextlib.contextmanager
    def recording(self, g: torch.cuda.CUDAGraph, pool, stream: torch.cuda.Stream):
        """Record ``g`` into ``pool`` on ``stream`` while the block runs.

        Yields a :class:`_Recording` that holds the bytes the pool grew by and
        the graph's node count once the block has ended. A block that raises
        leaves no partial graph behind: the graph is reset (it would hold its pool)."""
        recorder = self.recorder
        with torch.cuda.stream(stream):
            if recorder is not None:
                recorder.begin()
            # The pool itself is measured (its segments in a snapshot): the device's
            # reserved-bytes counter also moves for allocations outside the pool meanwhile (the
            # CUDA RNG's graph-safe state at a pool's first capture, the serving thread in the
            # background), and the per-step figures are what the plan's timeline is checked against.
            key = pool_key(pool)
            # a pool nothing captured into yet holds nothing, and is not asked: torch keeps no
            # private pool for the handle until its first capture_begin
            fresh = key in self._new_pools
            self._new_pools.discard(key)
            reserved_before = 0 if fresh else one_pool_reserved(pool)
            rec = _Recording()
            self._own = True  # this capture is the loop's: the outside-graph observer leaves it out
            try:
                g.capture_begin(pool=pool, capture_error_mode=self.mode)
            finally:
                self._own = False
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
            rec.nodes = instantiate_kept(g)
            rec.grown = one_pool_reserved(pool) - reserved_before
            if recorder is not None:
                recorder.end()

    def landed(self, cap: Captured) -> None:
        """A graph became servable: tell the serving side and the log."""
        if self.on_land is not None:
            self.on_land(cap)
        self.figures.landed(self.gs, cap, background=self.mode != "global")

    # -- the with block ------------------------------------------------------
    def open(self) -> CaptureLoop:
        """Begin: prime the capture stream, freeze the collector's old objects
        (what entering the ``with`` block does)."""
        if self._heap is not None or self._done or self._failed:
            raise ExecutorError(
                "the capture loop was opened already", where="CaptureLoop.open", fix="one capture_loop per capture"
            )
        if is_distributed():
            from .distributed import check_plan_agreement

            check_plan_agreement(self.plan, self.group)
        torch.cuda.synchronize(self.device)
        self.figures.before = probe(self.device)
        self._heap = Frozen().__enter__()
        try:
            for name, handle in self.gs.pools.items():  # the engine's own pools, made before the loop
                self._counted[name] = one_pool_reserved(handle)
            for stream in dict.fromkeys(self.streams.values()):  # each one's cuBLAS workspace, outside every pool
                prime_stream(self.device, stream)
            self._observe()
        except BaseException:
            self._thaw()
            raise
        return self

    def _thaw(self) -> None:
        heap, self._heap = self._heap, None
        if heap is not None:
            heap.thaw()

    def _unfinished(self) -> ExecutorError | None:
        cur = self.current
        if cur is not None and not cur.landed:
            if cur.pieces is not None and cur.held_pieces:
                return self._unheld(cur, "the engine's loop ended")
            return ExecutorError(
                "the engine's loop ended inside the step: its outputs were never held",
                where=cur.where,
                fix="call step.hold() after step.graph()",
            )
        left = [s for s in self.run_steps[self._next :] if s.op == "capture"]
        if left:
            s = left[0]
            return ExecutorError(
                f"the engine's loop ended with {len(left)} of the plan's captures not made",
                where=f"step {s.index} ({s.id})",
                fix=f"capture every size of loop.sizes(phase) for the phases {self._phases}",
            )
        return None

    def close(self) -> GraphSet:
        """End cleanly: check that every planned capture was made, write the
        report, return the GraphSet (what leaving the ``with`` block does).
        Raises, everything released, if a capture is missing."""
        if self._done:
            return self.gs
        failure = self._unfinished()
        if failure is not None:
            raise self.fail(failure)
        self._thaw()
        for s in self.run_steps[self._next :]:  # setup steps after the last capture (none in built plans)
            self.setup(s)
        torch.cuda.synchronize(self.device)
        self.finish()
        self._done = True
        return self.gs

    def _observe(self) -> None:
        """Count graphs recorded into the engine's pools outside the loop (an
        engine's piecewise wrappers, its encoder graphs) while the loop is open:
        ``torch.cuda.CUDAGraph.capture_begin`` is wrapped for that time (only
        when the engine gave the loop its pools; undone by ``_unobserve``)."""
        cls = torch.cuda.CUDAGraph
        if not self.engine_pools or not isinstance(cls, type) or self._observer is not None:
            return
        begin = cls.capture_begin
        loop = self

        def capture_begin(graph, *args, **kwargs):
            pool = kwargs.get("pool", args[0] if args else None)
            if not loop._own and pool is not None and pool_key(pool) in loop.engine_pools:
                loop.outside_graphs += 1
            return begin(graph, *args, **kwargs)

        setattr(cls, "capture_begin", capture_begin)  # noqa: B010  # a wrapper of the method, not its signature
        self._observer = (cls, begin)

    def _unobserve(self) -> None:
        observer, self._observer = self._observer, None
        if observer is not None:
            cls, begin = observer
            setattr(cls, "capture_begin", begin)  # noqa: B010

    def finish(self) -> None:
        """The allocation windows and the report, after the last step; a
        profiling pass's graphs torn down (the engine's ``on_failure`` first,
        to drop its references)."""
        self._unobserve()
        report = self.figures.report(
            self.gs,
            background=self.mode != "global",
            outside_graphs=self.outside_graphs,
            kept=self.kept if any(isinstance(s.keeps, int) for s in self.run_steps) else None,
            profiling=self._profiled() if self.profiling is not None else None,
        )
        if self.recorder is not None:
            for cap, win in zip(list(self.gs.graphs.values()), self.recorder.stop()):
                cap.window = win
            self.recorder = None
        self.gs.report = report
        if self.profiling is not None:
            self.current = None
            if self.on_failure is not None:
                self.on_failure()
            self.gs.release(reason="the profiling pass ended: its graphs were torn down")

    def _profiled(self) -> dict[str, int]:
        """Per phase, the graph keys this profiling pass captured."""
        counts: dict[str, int] = {}
        for s in self.run_steps[: self._next]:
            if s.op == "capture":
                counts[s.phase] = counts.get(s.phase, 0) + 1
        return counts

    def abort(self, failure: BaseException | None) -> None:
        """Stop the progress bar, the recorder and the outside-graph observer, drop the failure's frames."""
        self._unobserve()
        self.figures.close_bar()
        if self.recorder is not None:
            self.recorder.close()  # reading the history could raise and hide the real failure
            self.recorder = None
        _clear_frames(failure)

    def fail(self, failure: BaseException) -> BaseException:
        """Release everything after ``failure`` (the engine's ``on_failure``
        first) and return the error to raise: the executor's own as it is,
        another exception as a :class:`CaptureFailed` naming the step."""
        self._thaw()
        self._failed = True
        self._release(failure)
        if not isinstance(failure, Exception):  # KeyboardInterrupt and friends: released, then re-raised
            return failure
        return capture_failed(failure, self.running, self.plan, self.device)

    # -- serving while the engine's loop captures -----------------------------
    def start(self, body: Callable[[CaptureLoop], None], *, fallback: Fallback = "eager") -> GraphSet:
        """Run the engine's capture loop ``body(loop)`` on a thread and return
        the GraphSet at once: it serves each graph as it lands, and ``fallback``
        before (as ``capture(..., background=True)``; :mod:`capture_plan.executor.background`
        has the constraints on the engine). ``body`` is the loop of the ``with``
        block (``loop.step``, ``step.graph``, ``step.hold``); its eager GPU work
        on shared buffers goes inside ``step.warmup()`` or ``step.eager()``.
        Errors reach the caller through ``replay`` or ``wait`` as a
        CaptureFailed naming the step (``on_failure`` called, everything
        released); ``release()`` stops the loop at its next ``step()``.
        Not with ``record=True`` nor ``torch.distributed``; ``fallback="eager"``
        needs ``capture_loop(target=)``."""
        from .background import Background, check_options
        from .streams import init_cublas

        if self._heap is not None or self._done or self._failed:
            raise ExecutorError(
                "the capture loop was opened already", where="CaptureLoop.start", fix="one capture_loop per capture"
            )
        try:
            check_options(
                background=True, record=self.recorder is not None, fallback=fallback, distributed=is_distributed()
            )
        except ExecutorError:
            if self.recorder is not None:
                self.recorder.close()
                self.recorder = None
            raise
        self.mode = "thread_local"  # the engine's threads keep launching work meanwhile
        torch.cuda.synchronize(self.device)
        self.figures.before = probe(self.device)
        self._heap = heap = Frozen().__enter__()
        try:
            for name, handle in self.gs.pools.items():
                self._counted[name] = one_pool_reserved(handle)
            init_cublas(self.device)
            job = Background(self, fallback, heap, body=lambda: self._background(body))
        except BaseException:
            self._thaw()
            raise
        self.gs.background = job
        self.gs.serve_through(job)
        job.start()
        return self.gs

    def _background(self, body) -> bool:
        """The capture thread: the engine's loop, then what ``close`` checks;
        True once every step ran (the thread writes the report), False if stopped."""
        for stream in dict.fromkeys(self.streams.values()):
            prime_stream(self.device, stream)
        self._observe()
        try:
            body(self)
            failure = self._unfinished()
            if failure is not None:
                raise failure
        except _Stopped:
            self._drop()
            return False
        except BaseException:
            self._drop()  # the Background releases the set and raises it at the caller
            raise
        for s in self.run_steps[self._next :]:
            self.setup(s)
        self.stream.synchronize()  # a device-wide sync would wait for the serving work too
        self._done = True
        return True

    def __enter__(self) -> CaptureLoop:
        return self.open()

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None:
            self.close()
            return False
        err = self.fail(exc)
        if err is exc:
            return False
        raise err

    @property
    def complete(self) -> bool:
        """Every planned capture has been made and held."""
        return (self.current is None or self.current.landed) and not any(
            s.op == "capture" for s in self.run_steps[self._next :]
        )

    @contextlib.contextmanager
    def part(self):
        """One runner's share of the plan, for engines whose phases are captured
        by runners made at different times (SGLang's target and EAGLE draft
        runners): opens the loop at the first, closes it when the plan's last
        capture is held, and on an error releases everything and raises it
        as the ``with`` block would. Captures outside every part are not
        guarded; a loop whose parts never complete the plan stays open until
        ``close()`` says which step is missing."""
        if self._heap is None and not self._done:
            self.open()
        try:
            yield self
        except BaseException as exc:
            err = self.fail(exc)
            if err is exc:
                raise
            raise err from exc
        if self.complete and not self._done:
            self.close()

    def _drop(self) -> None:
        """The step's unheld graph reset, the engine's references dropped (``on_failure``)."""
        cur = self.current
        if cur is not None and cur.recorded is not None:
            cur.recorded.reset()
            cur.recorded = None
        self.current = None
        if self.on_failure is not None:
            self.on_failure()

    def _release(self, failure: BaseException) -> None:
        """Nothing half-captured left behind: the engine drops its references,
        every graph is reset and the pools are emptied."""
        self._drop()
        self.abort(failure)
        self.gs.release(reason="the capture loop failed")


def capture_loop(plan: Plan, **kw) -> CaptureLoop:
    """A :class:`CaptureLoop` over ``plan``; keywords as for it: ``device``,
    ``stream`` (the engine's capture stream; default the executor's one per
    device), ``pools`` (the engine's handles for the plan's pool names),
    ``target`` (run/prepare/refresh for ``GraphSet.eager`` and ``verify``),
    ``record`` (the allocation history, for ``verify``'s footprint check),
    ``group`` (the tensor-parallel group), ``on_failure`` (drop the engine's
    references to graphs and outputs: after a failure, and when a profiling
    pass is torn down), ``streams`` (the engine's streams for the plan's
    stream names other than "capture": a micro-batch twin) and ``profiling``
    (a declared partial pass: per phase, how many of its first keys it
    captures, into pools torn down when the loop closes)."""
    return CaptureLoop(plan, **kw)
