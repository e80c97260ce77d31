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
``pool`` (the handle of the plan's pool), ``stream`` (the capture stream),
``warmups`` (eager runs before the capture), ``workspace`` (the hoisted
workspace, or None) and ``outputs`` (the output policy); ``graph()`` records
into that pool on that stream, and ``hold()`` holds the outputs as the
policy says. ``capture(plan, target)`` is itself a user of this loop
(:mod:`capture_plan.executor.driver`), so the pools, steps and dispatch of an
engine's loop come out as ``capture()``'s, provided the engine allocates
inside ``graph()`` what its target would allocate inside ``run``.

Checks, each an :class:`ExecutorError` naming the plan step: a size or phase
asked for out of the plan's order; a graph recorded into another pool or on
another stream than the step's; outputs the policy cannot hold (no tensor,
anything but tensors in tuples, lists, dicts and dataclasses, a tensor on
another device, rows that are no multiple of the batch); a step left
unfinished; a loop that ends before the plan's last capture. On any error
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
from collections.abc import Callable, Iterator, Sequence

import torch

from capture_plan.schemas.plan import Plan, Step

from .device import probe
from .errors import ExecutorError, capture_failed
from .graphs import Fallback, GraphSet
from .heap import Frozen
from .pool import one_pool_reserved, pool_key, scratch_pool
from .session import CaptureSession, _distributed, _rank0, refuse_piecewise

__all__ = ["capture_loop", "CaptureLoop", "LoopStep", "Unattached"]


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
    replacements for them; an ExecutorError for anything the policy cannot hold."""
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
            fix="return the output tensors the engine reads",
        )
    return tuple(leaves), rebuild


class LoopStep:
    """One capture step of the plan, as the engine's loop runs it.

    Attributes: ``phase``, ``bs``, ``index`` and ``id`` (the plan step),
    ``pool`` (the pool's handle) and ``pool_name``, ``stream`` (record on it;
    ``graph()`` does), ``warmups`` (eager runs the plan wants before this
    capture: 0 when the phase was warmed up already), ``workspace`` (the
    phase's hoisted workspace, or None: compute it before recording and before
    every replay) and ``outputs`` ("keep" or "view").
    """

    def __init__(self, loop: CaptureLoop, step: Step, warmups: int, t0: float, pending: Sequence[Step] = ()):
        session = loop.session
        self._loop, self._session, self.plan_step, self._t0 = loop, session, step, t0
        self.phase, self.bs, self.index, self.id = step.phase, step.bs, step.index, step.id
        self.pool_name = step.pool
        self.pool = session.pool(step.pool)
        self.stream = session.stream
        self.warmups = warmups
        self.workspace = loop.gs.workspaces.get(step.phase)
        self.outputs = step.outputs or "keep"
        #: the graph recorded by ``graph()``, until ``hold()``
        self.recorded: torch.cuda.CUDAGraph | None = None
        self._grown = 0
        #: ``hold()`` has made the graph servable
        self.landed = False
        #: the plan's warm-up steps before this capture (each with its phase, bs and runs), in order
        self.planned: tuple[Step, ...] = tuple(pending)
        #: those not yet recorded: measured once the engine's warm-ups ran
        self._pending = list(pending)

    @property
    def where(self) -> str:
        return f"step {self.index} ({self.id})"

    def _error(self, what: str, fix: str = "") -> ExecutorError:
        return ExecutorError(what, where=self.where, fix=fix)

    @contextlib.contextmanager
    def warmup(self, of: Step | None = None):
        """A block for the engine's warm-up runs: on the capture stream, their
        temporaries in a scratch pool that is returned at the end (so they
        stay cached nowhere). Optional: warm-ups outside it work, and leave
        their blocks cached on whatever stream ran them.

        ``of``: one of :attr:`planned`, for a driver that runs each planned
        warm-up at its own size (``capture()`` does): the block is that step
        alone. Without it the block is all of this capture's planned warm-ups."""
        session = self._session
        if of is not None and of not in self._pending:
            raise self._error(f"{of.id} is not a warm-up of this step still to run", "pass one of step.planned")
        mine = [of] if of is not None else list(self._pending)
        for w in mine:
            self._loop.before_step(w)
        if of is not None:
            session.current = of
        with session.eager(), torch.cuda.stream(self.stream), scratch_pool(session.device) as scratch:
            yield
            self.stream.synchronize()  # the scratch pool's blocks are idle before it is emptied
        session.current = self.plan_step
        self._measure_warmups(scratch.reserved, mine)

    def _measure_warmups(self, scratch: int | None, steps: list[Step] | None = None) -> None:
        """Record the plan's warm-up ``steps`` of this capture (default: all not yet
        recorded): the first carries the warm-ups' scratch peak (what a
        calibration's peak reads), none if the engine ran them outside
        ``warmup()``. A later ``warmup()`` block of the step, its steps
        recorded, measures nothing."""
        session = self._session
        steps = list(self._pending) if steps is None else steps
        if steps and scratch is None:  # run outside warmup(): exchanged now (distributed)
            for w in steps:
                self._loop.before_step(w)
        for k, w in enumerate(steps):
            session.scratch = scratch if k == 0 else None
            session.measure(w, self._t0)
            self._pending.remove(w)
        session.scratch = None
        self._t0 = time.perf_counter()  # the capture's own time starts after its warm-ups

    @contextlib.contextmanager
    def eager(self):
        """A block of the engine's own eager GPU work for this step outside
        its warm-ups (computing a hoisted workspace before recording), on the
        capture stream. In a background capture it is ordered against the
        serving thread's replays, as warm-ups are; in the foreground it only
        sets the stream."""
        with self._session.eager(), torch.cuda.stream(self.stream):
            yield

    @contextlib.contextmanager
    def graph(self, cuda_graph: torch.cuda.CUDAGraph | None = None, *, pool=None, stream=None):
        """Record ``cuda_graph`` (a new one if None; the block receives it) into
        the step's pool on the capture stream, like ``torch.cuda.graph`` but
        without its device synchronization, cache flush and collection per
        capture. ``pool`` and ``stream``, if given, must be the step's (an
        engine that passes its own keeps its call as it was); a block that
        raises leaves no partial graph."""
        if self.recorded is not None or self.landed:
            raise self._error("the step recorded its graph already", "one graph() per step")
        if pool is not None and pool_key(pool) != pool_key(self.pool):
            raise self._error(
                f"the engine records into pool {pool_key(pool)}, not the plan's pool {self.pool_name!r} "
                f"{pool_key(self.pool)}",
                "pass step.pool (or leave pool out)",
            )
        if stream is not None and stream != self.stream:
            raise self._error(
                f"the engine records on stream {stream}, not the capture stream {self.stream}: "
                "captures sharing a pool reuse memory only on one stream",
                "pass step.stream (or leave stream out), or give capture_loop(stream=) the engine's",
            )
        self._measure_warmups(None)  # warm-ups the engine ran outside warmup(), if any
        self._loop.before_step(self.plan_step)
        # keep_graph: the session counts the graph's nodes before it instantiates it (graph_nodes)
        g = cuda_graph if cuda_graph is not None else _new_graph()
        with self._session.recording(g, self.pool) as grown:
            yield g
        self.recorded, self._grown = g, grown[0]

    def hold(self, outputs, *, graph: torch.cuda.CUDAGraph | None = None):
        """Hold the step's outputs as the policy says and make its graph
        servable; returns ``outputs`` with every tensor replaced by what the
        engine should keep: the tensor itself ("keep"), or a non-owning view
        of it ("view"), valid until the next replay of any graph in the pool.

        With "view" the engine must drop its own references to the returned
        tensors before the next step (returning from its capture function
        does), or their memory is not reused. ``graph``: a graph the engine
        recorded itself, without ``graph()`` (its pool is checked; its stream
        cannot be)."""
        session = self._session
        if self.landed:
            raise self._error("the step's outputs are held already", "one hold() per step")
        if graph is not None:
            if self.recorded is not None:
                raise self._error("hold(graph=) after graph(): the step recorded its graph already")
            self._adopt(graph)
        if self.recorded is None:
            raise self._error("hold() before the graph was recorded", "record it in `with step.graph(g):` first")
        self._measure_warmups(None)  # a graph the engine recorded itself (hold(graph=)): no graph() ran
        leaves, rebuild = _flatten(outputs, self.where, session.device)
        rows = session.rows_per_request(self.plan_step, leaves)
        kept = session.land(self.plan_step, self.recorded, leaves, rows, self._grown)
        del leaves
        self._loop.grew(self.pool_name, self._grown)
        self.recorded, self.landed = None, True
        session.measure(self.plan_step, self._t0)
        return rebuild(kept)

    def _adopt(self, graph) -> None:
        """A graph recorded by the engine's own call: its pool must be the step's."""
        if self._session.recorder is not None:
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


class CaptureLoop:
    """The plan's steps, driven by the engine's loop; see the module docstring.

    Use it as a context manager: entering primes the capture stream (its
    cuBLAS workspace outside every pool) and freezes the collector's old
    objects; a clean exit checks that every planned capture was made, then
    writes the report (``graphs.report``); an error releases everything.
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
    ):
        self.t_start = t_start if t_start is not None else time.perf_counter()
        self.plan, self.group, self.on_failure = plan, group, on_failure
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.gs = GraphSet(plan, target if target is not None else Unattached(), self.device)
        planned = {s.pool for s in plan.steps if s.op == "capture"}
        for name, handle in (pools or {}).items():
            if name not in planned:
                raise ExecutorError(
                    f"pool {name!r} is not one of the plan's pools {sorted(planned)}",
                    where="capture_loop(pools=)",
                    fix="name the plan's pools",
                )
            self.gs.pools[name] = handle
        #: per pool: its bytes before the loop (an engine's pool may hold some) plus its graphs' growth
        self._counted: dict[str, int] = {}
        self.session = CaptureSession(
            self.gs, self.device, record=record, bar=progress, show=_rank0(group), t_start=self.t_start
        )
        if stream is not None:
            self.session.stream = stream
        #: called before each plan step runs (``capture()`` exchanges the ranks' status there)
        self.on_step: Callable[[Step], None] | None = None
        #: index of the next plan step to run
        self._next = 0
        self.current: LoopStep | None = None
        self._heap: Frozen | None = None
        self._done = self._failed = False
        self._phases = list(dict.fromkeys(s.phase for s in plan.steps if s.op == "capture"))

    @property
    def stream(self) -> torch.cuda.Stream:
        """The stream every graph records on."""
        return self.session.stream

    def pool(self, name: str):
        """The handle of the plan's pool ``name`` (made now if no graph used it
        yet): for an engine that sets up its pool before its loop."""
        if name not in {s.pool for s in self.plan.steps if s.op == "capture"}:
            raise ExecutorError(
                f"pool {name!r} is not in the plan",
                where="CaptureLoop.pool",
                fix=f"use one of {sorted({s.pool for s in self.plan.steps if s.op == 'capture'})}",
            )
        return self.session.pool(name)

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
        the plans the planner builds; ``step()`` refuses anything else."""
        return list(self._phases)

    def sizes(self, phase: str) -> list[int]:
        """The phase's capture sizes in the plan's order (what the engine's loop iterates)."""
        if phase not in self._phases:
            raise ExecutorError(
                f"phase {phase!r} is not in the plan; it captures {self._phases}",
                where="CaptureLoop.sizes",
                fix="name the phase as the plan does",
            )
        return [s.bs for s in self.plan.steps if s.op == "capture" and s.phase == phase]

    def steps(self, phase: str) -> Iterator[LoopStep]:
        """``step(phase, bs)`` for every size of ``sizes(phase)``."""
        for bs in self.sizes(phase):
            yield self.step(phase, bs)

    def step(self, phase: str, bs: int) -> LoopStep:
        """Begin the plan's next capture, which must be ``phase`` at ``bs``.

        The plan's provision steps before it run now (the workspace is
        allocated outside every pool); its warm-up steps become the step's
        ``warmups``. Raises ExecutorError naming the plan's step when the
        engine asks for another phase or size, or left the previous step unfinished."""
        if self._heap is None:
            raise ExecutorError(
                "the capture loop is not open", where="CaptureLoop.step", fix="use `with capture_loop(plan) as loop:`"
            )
        job = self.gs.background
        if job is not None and job.stopping.is_set():
            raise _Stopped()  # released while capturing in the background: the engine's loop ends here
        cur = self.current
        if cur is not None and not cur.landed:
            raise ExecutorError(
                f"the engine's loop moved on to {phase}/{bs} before the step's outputs were held",
                where=cur.where,
                fix="record the graph in step.graph() and call step.hold() before the next step",
            )
        if phase not in self._phases:
            raise ExecutorError(
                f"phase {phase!r} is not in the plan; it captures {self._phases}",
                where="CaptureLoop.step",
                fix="name the phase as the plan does",
            )
        refuse_piecewise(self.plan, (phase,), where="CaptureLoop.step")
        steps, session = self.plan.steps, self.session
        t0 = time.perf_counter()
        warmups, i, pending = 0, self._next, []
        while i < len(steps) and steps[i].op != "capture":
            s = steps[i]
            if s.op == "warmup":  # the engine runs it: at the capture, below; measured when it has
                warmups += max(s.runs, 1)
                pending.append(s)
            else:
                self.before_step(s)
                session.step(s)
            i += 1
        if i == len(steps):
            raise ExecutorError(
                f"the engine's loop asked for {phase}/{bs}, but the plan's captures are all made",
                where="CaptureLoop.step",
                fix="iterate loop.sizes(phase)",
            )
        s = steps[i]
        session.current = s
        if (s.phase, s.bs) != (phase, bs):
            raise ExecutorError(
                f"the engine's loop asked for {phase}/{bs} out of the plan's order: the plan's next "
                f"capture is {s.phase}/{s.bs}",
                where=f"step {s.index} ({s.id})",
                fix=f"iterate loop.sizes(phase), the phases in the plan's order {self._phases}",
            )
        self._next = i + 1
        self.current = LoopStep(self, s, warmups, t0, pending)
        return self.current

    def before_step(self, step: Step) -> None:
        """About to run the plan's ``step``: the hook ``on_step``, if any."""
        if self.on_step is not None:
            self.on_step(step)

    def counted(self, pool_name: str) -> int:
        """Bytes the pool held before the loop plus what its graphs grew it by so far."""
        return self._counted.get(pool_name, 0)

    def grew(self, pool_name: str, nbytes: int) -> None:
        self._counted[pool_name] = self._counted.get(pool_name, 0) + nbytes

    # -- the with block ------------------------------------------------------
    def open(self) -> CaptureLoop:
        """Begin: prime the capture stream, freeze the collector's old objects
        (what entering the ``with`` block does)."""
        if self._heap is not None or self._done or self._failed:
            raise ExecutorError(
                "the capture loop was opened already", where="CaptureLoop.open", fix="one capture_loop per capture"
            )
        if _distributed():
            from .distributed import check_plan_agreement

            check_plan_agreement(self.plan, self.group)
        torch.cuda.synchronize(self.device)
        self.session.before = probe(self.device)
        self._heap = Frozen().__enter__()
        try:
            for name, handle in self.gs.pools.items():  # the engine's own pools, made before the loop
                self._counted[name] = one_pool_reserved(handle)
            self.session.prime()
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
            return ExecutorError(
                "the engine's loop ended inside the step: its outputs were never held",
                where=cur.where,
                fix="call step.hold() after step.graph()",
            )
        left = [s for s in self.plan.steps[self._next :] if s.op == "capture"]
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
        for s in self.plan.steps[self._next :]:  # setup steps after the last capture (none in built plans)
            self.before_step(s)
            self.session.step(s)
        torch.cuda.synchronize(self.device)
        self.session.finish()
        self._done = True
        return self.gs

    def fail(self, failure: BaseException) -> BaseException:
        """Release everything after ``failure`` (the engine's ``on_failure``
        first) and return the error to raise: the executor's own as it is,
        another exception as a :class:`CaptureFailed` naming the step."""
        self._thaw()
        self._failed = True
        self._release(failure)
        if not isinstance(failure, Exception):  # KeyboardInterrupt and friends: released, then re-raised
            return failure
        return capture_failed(failure, self.session.current, self.plan, self.device)

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
        from .background import Background
        from .session import _check_options, _init_cublas

        if self._heap is not None or self._done or self._failed:
            raise ExecutorError(
                "the capture loop was opened already", where="CaptureLoop.start", fix="one capture_loop per capture"
            )
        try:
            _check_options(
                background=True, record=self.session.recorder is not None, fallback=fallback, distributed=_distributed()
            )
        except ExecutorError:
            if self.session.recorder is not None:
                self.session.recorder.close()
                self.session.recorder = None
            raise
        self.session.mode = "thread_local"  # the engine's threads keep launching work meanwhile
        torch.cuda.synchronize(self.device)
        self.session.before = probe(self.device)
        self._heap = heap = Frozen().__enter__()
        try:
            for name, handle in self.gs.pools.items():
                self._counted[name] = one_pool_reserved(handle)
            _init_cublas(self.device)
            job = Background(self.session, self.device, fallback, heap, body=lambda: self._background(body))
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
        self.session.prime()
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
        for s in self.plan.steps[self._next :]:
            self.before_step(s)
            self.session.step(s)
        self.session.stream.synchronize()  # a device-wide sync would wait for the serving work too
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
            s.op == "capture" for s in self.plan.steps[self._next :]
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
        self.session.abort(failure)
        self.gs.release(reason="the capture loop failed")


def capture_loop(plan: Plan, **kw) -> CaptureLoop:
    """A :class:`CaptureLoop` over ``plan``; keywords as for it: ``device``,
    ``stream`` (the engine's capture stream; default the executor's one per
    device), ``pools`` (the engine's handles for the plan's pool names),
    ``target`` (run/prepare/refresh for ``GraphSet.eager`` and ``verify``),
    ``record`` (the allocation history, for ``verify``'s footprint check),
    ``group`` (the tensor-parallel group) and ``on_failure``."""
    return CaptureLoop(plan, **kw)
