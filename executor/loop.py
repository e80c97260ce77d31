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

**The loop owns a capture step**, its parts in modules by concern:
:mod:`~capture_plan.executor.cursor` (torch-free: which plan step runs next, the
warm-ups pending before a capture, the checks on the key the engine asks for, a
profiling pass's share of the steps), :mod:`~capture_plan.executor.step` (one
:class:`LoopStep`: warm-ups in a scratch pool, the recording, the outputs held),
:mod:`~capture_plan.executor.recording` (pools, streams, one recording measured, the
observer of graphs recorded outside the loop) and :mod:`~capture_plan.executor.outputs`
(the outputs' tensors and rows). This module is the loop: ``open`` primes the
capture stream (:mod:`capture_plan.executor.streams`) and freezes the collector;
``step()`` runs the plan's provision steps (a hoisted workspace, allocated outside
every graph pool) and hands the engine a :class:`LoopStep`;
:class:`capture_plan.executor.measure.Measurements` records each step's figures and
writes the report. The steps allocate in exactly the order the planner simulated:
that is what makes its predictions exact, so a change here that moves, adds or drops
an allocation changes what the plans predict.

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
import time
import traceback
from collections.abc import Callable, Iterator, Mapping

import torch

from capture_plan.schemas.keys import GraphKey
from capture_plan.schemas.plan import Plan, Step

from .cursor import Cursor, key_text
from .device import probe
from .distributed import is_distributed, rank0
from .errors import ExecutorError, capture_failed
from .graphs import Captured, Fallback, GraphSet
from .heap import Frozen
from .measure import Measurements
from .pool import AllocationRecorder
from .recording import OutsideGraphs, Pools, plan_streams, record
from .step import LoopStep
from .streams import capture_stream, prime_streams
from .target import Unattached

__all__ = ["capture_loop", "CaptureLoop", "LoopStep", "Unattached"]


def _clear_frames(exc: BaseException | None) -> None:
    """Clear the frames of an exception and of every exception chained to it:
    they hold the partial capture's tensors and graphs."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


class _Stopped(BaseException):
    """Ends the engine's loop on the capture thread after ``release()`` (a
    BaseException: an engine's ``except Exception`` does not swallow it)."""


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
        #: a declared partial pass (an engine's memory-profiling pass): per phase, how many of
        #: its first keys it captures (phases not named: all), into pools torn down at the end
        self.profiling = dict(profiling) if profiling is not None else None
        #: where the loop stands in the plan: the next step, the keys it captures
        self.cursor = Cursor(plan, self.profiling)
        #: the plan's pools: their handles (the GraphSet's), the engine's, what each held
        self.pools = Pools(plan, self.gs.pools, pools)
        #: the stream every graph records on: the engine's, or the executor's one per device
        self.stream: torch.cuda.Stream = stream if stream is not None else capture_stream(self.device)
        #: the plan's stream names and the engine's streams ("capture": ``stream``)
        self.streams: dict[str, torch.cuda.Stream] = plan_streams(plan, self.stream, streams)
        #: bytes the warm-ups kept past their blocks (checked against the plan's ``keeps``)
        self.kept = 0
        #: graphs recorded into the loop's pools outside the loop (an engine's piecewise
        #: wrappers, its encoder graphs), and the bytes the pools grew by outside the loop's graphs
        self.outside = OutsideGraphs(self.pools.engine)
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
        self.current: LoopStep | None = None
        self._heap: Frozen | None = None
        self._done = self._failed = False
        self.figures.captures = self.cursor.captures

    @property
    def run_steps(self) -> list[Step]:
        """The plan's steps this loop runs (all of them, but for a profiling pass)."""
        return self.cursor.run_steps

    @property
    def engine_pools(self) -> frozenset:
        """The pools the engine made (graphs outside the loop may record into them too)."""
        return self.pools.engine

    @property
    def outside_graphs(self) -> int:
        """Graphs recorded into the engine's pools outside the loop (its piecewise wrappers, its encoder graphs)."""
        return self.outside.count

    def pool(self, name: str):
        """The handle of the plan's pool ``name`` (made now if no graph used it
        yet): for an engine that sets up its pool before its loop."""
        return self.pools.named(name)

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
        return self.cursor.phases

    def keys(self, phase: str | None = None) -> list[GraphKey]:
        """The phase's graph keys (every phase's, without ``phase``) in the
        plan's order (a profiling pass: the ones it captures): phase, size,
        labels, tokens, micro-batches. An engine that keys graphs its own way
        (vLLM's descriptors) iterates its keys in this order."""
        return self.cursor.keys(phase)

    def sizes(self, phase: str) -> list[int]:
        """The phase's capture sizes in the plan's order (what the engine's loop
        iterates; each once, however many graph keys it has)."""
        return self.cursor.sizes(phase)

    def labels(self, phase: str, bs: int) -> list[dict[str, str]]:
        """The labels of the phase's keys at size ``bs``, in the plan's order
        (SGLang's loop: per size, per LoRA variant, per attention variant)."""
        return self.cursor.labels(phase, bs)

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
        cursor = self.cursor
        pp = cursor.phase(phase, "CaptureLoop.step")
        pairs = cursor.pairs(pp, labels)
        cur = self.current
        if cur is not None and not cur.landed:
            raise self._unheld(cur, f"the engine's loop moved on to {key_text(phase, bs, pairs)}")
        cursor.check(pp, bs, pairs)
        provisions, warmups, s = cursor.upcoming()
        for p in provisions:  # the warm-ups: the engine runs them at the capture, measured when it has
            self.setup(p)
        t0 = time.perf_counter()  # after the provisions, which setup() measured as steps of their own
        if s is None:
            raise ExecutorError(
                f"the engine's loop asked for {key_text(phase, bs, pairs)}, but the plan's captures are all made",
                where="CaptureLoop.step",
                fix="iterate loop.keys(phase)",
            )
        self.running = s
        key = cursor.take(s, phase, bs, pairs)
        self.current = LoopStep(self, s, key, t0, warmups)
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

    def recording(self, g: torch.cuda.CUDAGraph, pool, stream: torch.cuda.Stream, *, instantiate: bool = True):
        """Record ``g`` into ``pool`` on ``stream`` while the block runs
        (:func:`capture_plan.executor.recording.record`: the pool's growth and the
        graph's node count measured; a block that raises leaves no partial graph)."""
        pools, mode, recorder, outside = self.pools, self.mode, self.recorder, self.outside
        return record(
            g, pool, stream, pools=pools, mode=mode, recorder=recorder, outside=outside, instantiate=instantiate
        )

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
            self.pools.count_engine_pools()  # the engine's own pools, made before the loop
            prime_streams(self.device, self.streams)  # each one's cuBLAS workspace, outside every pool
            self.outside.start()
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
        return self.cursor.unfinished()

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
        for s in self.cursor.rest():  # setup steps after the last capture (none in built plans)
            self.setup(s)
        torch.cuda.synchronize(self.device)
        self.finish()
        self._done = True
        return self.gs

    def finish(self) -> None:
        """The allocation windows and the report, after the last step; a
        profiling pass's graphs torn down (the engine's ``on_failure`` first,
        to drop its references)."""
        self.outside.stop()
        report = self.figures.report(
            self.gs,
            background=self.mode != "global",
            outside_graphs=self.outside_graphs,
            kept=self.kept if any(isinstance(s.keeps, int) for s in self.run_steps) else None,
            profiling=self.cursor.profiled() if self.profiling is not None else None,
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

    def abort(self, failure: BaseException | None) -> None:
        """Stop the progress bar, the recorder and the outside-graph observer, drop the failure's frames."""
        self.outside.stop()
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
            self.pools.count_engine_pools()
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
        prime_streams(self.device, self.streams)  # as open() does, on the capture thread
        self.outside.start()
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
        for s in self.cursor.rest():
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
        return (self.current is None or self.current.landed) and not self.cursor.left()

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
