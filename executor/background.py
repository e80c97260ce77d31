"""Serve while capturing: ``capture(plan, target, background=True)``.

``capture`` returns the GraphSet at once; a thread ("capture-plan") runs the
plan's steps in order, capturing with CUDA's ``thread_local`` capture error
mode so that the engine's threads may keep launching work. Each graph is
servable the moment it lands: the phase's dispatch table grows
(:class:`capture_plan.executor.dispatch.PadTable.add`), so with a largest-first plan every
batch size is servable after the phase's first graph (padded up to it), and
padding gets tighter as smaller sizes land. Until a phase has a graph that
fits, ``replay`` does what ``fallback`` says: run the target eagerly at n
("eager", the default), block until one lands ("wait"), raise ("raise"), or
call the engine's own ``fallback(phase, n)``.

How replays and the capture thread stay out of each other's way: capturing
executes nothing, but the steps around it do -- provisioning, warm-ups and the
refresh of a hoisted workspace run the target eagerly on the capture stream,
on the engine's static buffers. Those run under a lock that ``replay`` takes
too, and the streams are ordered with CUDA events both ways (the capture
stream waits for the last replay on every serving stream; each serving stream
waits for the last eager step), so a replay never overlaps them on the GPU.
Once every graph has landed and the capture stream is drained, ``replay`` is
the lock-free path again.

Constraints while a background capture runs (measured on an H200: a graph
captured on one thread while another thread replayed 81 graphs of the same
pool, all correct, under exactly these conditions):

* the serving thread replays (and runs eagerly) on a stream of its own, never
  on the legacy default stream (``replay`` raises if it is), and makes no
  device-wide synchronization (``torch.cuda.synchronize()``,
  ``torch.cuda.empty_cache()``, ``cudaDeviceSynchronize`` in a library): it
  would wait on, or break, the capture;
* cuBLAS is initialized on every thread that runs work during the capture,
  on the stream it runs on, before the capture starts (its first use inside a
  capture invalidates it): ``capture`` does this for the calling thread's
  current stream; run the model eagerly once on any other serving stream first;
* ``target.run`` may be called on two threads at once (recording on the
  capture thread, eagerly on the serving thread for the fallback), so it keeps
  no host-side state that one call changes and another reads;
* warm-ups run on the engine's live static buffers: ``run`` must only write
  memory that the next real step writes before it reads it (the usual engine
  contract: padded rows write to a dummy KV slot);
* the engine's own GPU work on the target's buffers outside ``replay`` (an
  eager prefill, writing the next step's inputs, reading outputs) runs inside
  ``with graphs.exclusive():`` so that no warm-up of the capture thread lands
  in the middle of it (``replay`` itself may be called inside);
* one capture per process at a time; not with ``torch.distributed`` (each
  rank would interleave warm-ups and replays differently, and the collectives
  in them would hang) and not with ``record=True``.

Errors: a failure on the capture thread stops it; the caller's next
``replay`` or ``wait`` releases the set and raises it as a
:class:`CaptureFailed` naming the step. ``release`` during the capture stops
the thread after its current step, then releases everything.

What it does not do: make replays as fast during capture as after. The
capture thread runs Python (the model's ``run`` while recording) and competes
for the GIL; ``bench/startup_bench.py`` measures the throughput both ways. Nor
does it order RNG state shared through torch's default CUDA generator between
graphs captured and replayed concurrently (the reference model draws none).
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch

from capture_plan.schemas.plan import Plan, Step

from .errors import ExecutorError, capture_failed
from .graphs import Captured, Fallback, GraphSet, as_outputs
from .logs import log
from .measure import Measurements

__all__ = ["Background", "check_options"]

_WAIT = object()


class Runner(Protocol):
    """What a :class:`Background` uses of the capture loop whose steps its thread runs
    (:class:`capture_plan.executor.loop.CaptureLoop`, named here by what it does, not
    imported: the loop imports this module when it starts one)."""

    device: torch.device
    plan: Plan
    t_start: float
    stream: torch.cuda.Stream
    gs: GraphSet
    figures: Measurements
    #: the plan step running (or that failed)
    running: Step | None
    #: wraps the loop's eager GPU work (set here: ordered against the serving thread's replays)
    guard: Callable[[], contextlib.AbstractContextManager]
    #: called with each graph as it lands (set here)
    on_land: Callable[[Captured], None] | None

    def finish(self) -> None: ...

    def abort(self, failure: BaseException | None) -> None: ...


class Background:
    """A capture running on a thread, and how ``GraphSet.replay`` serves meanwhile."""

    def __init__(self, runner: Runner, fallback, heap, body):
        #: the capture loop whose steps the thread runs (None once the thread has ended)
        self.runner: Runner | None = runner
        #: what the thread runs: the capture loop (``capture_plan.executor.loop``, driven by
        #: ``capture()`` or by the engine's own loop); True once every step ran, False when it stopped early
        self.body = body
        self.device = runner.device
        self.fallback = fallback
        self.heap = heap
        self.lock = threading.RLock()  # re-entered by replay inside exclusive()
        #: notified when a graph lands and when the capture ends
        self.landed = threading.Condition()
        self.stopping = threading.Event()
        self.finished = threading.Event()
        self.failure: BaseException | None = None
        self.failed_step = None
        #: every step ran and the report is written
        self.completed = False
        #: the capture thread is waiting for the lock
        self.waiting = 0
        self.plan = runner.plan
        self.t_start = runner.t_start
        self.stream = runner.stream
        self.default_stream = torch.cuda.default_stream(self.device)
        #: per serving stream: an event recorded after its last replay
        self.served: dict[int, torch.cuda.Event] = {}
        #: recorded on the capture stream after each eager step
        self.eager_done = torch.cuda.Event()
        #: replays served while capturing: by a graph, by the fallback
        self.graph_replays = 0
        self.fallback_runs = 0
        #: seconds from capture() to the end of the capture thread
        self.seconds: float | None = None
        runner.guard = self.eager
        runner.on_land = self._on_land
        self.thread = threading.Thread(target=self._main, name="capture-plan", daemon=True)

    def start(self) -> None:
        _live.add(self)
        self.thread.start()

    # -- the capture thread --------------------------------------------------
    @contextlib.contextmanager
    def eager(self):
        """Around the capture thread's eager GPU work: after every replay so far, before any later one."""
        self.waiting += 1  # see _yield: a serving loop would otherwise take the lock again and again first
        try:
            self.lock.acquire()
        finally:
            self.waiting -= 1
        try:
            for ev in self.served.values():
                self.stream.wait_event(ev)
            yield
            self.eager_done.record(self.stream)
        finally:
            self.lock.release()

    def _yield(self) -> None:
        """Let a waiting capture thread have the lock first.

        Python's locks are not fair: a serving loop that releases the lock and
        takes it again microseconds later would keep the capture thread's
        warm-up waiting indefinitely, and no graph would land."""
        if self.waiting and not self._held_here():
            while self.waiting and not self.finished.is_set():
                time.sleep(50e-6)

    def _on_land(self, cap) -> None:
        with self.landed:
            self.landed.notify_all()

    def _main(self) -> None:
        torch.cuda.set_device(self.device)
        runner, body = self.runner, self.body
        # cleared only at the end of this, the thread's one run
        assert runner is not None and body is not None
        failure: BaseException | None = None
        completed = False
        try:
            completed = body()
            if completed:
                runner.finish()
        except BaseException as err:  # reaches the caller on its next replay or wait
            failure = err
        finally:
            self.heap.thaw()
        if failure is not None:
            runner.abort(failure)
            with self.lock:  # no replay is in flight from here on; the next one raises
                self.failure, self.failed_step = failure, runner.running
            log.error(
                "capture-plan: background capture failed at %s: %s: %s",
                runner.running.id if runner.running else "start",
                type(failure).__name__,
                failure,
            )
        elif completed:
            self.completed = True
            gs = runner.gs
            gs.serve_through(None)  # the capture stream is drained: replays take the lock-free path from here on
            if runner.figures.show:
                log.info(
                    "capture-plan: served %d replays by graphs and %d by the fallback while capturing",
                    self.graph_replays,
                    self.fallback_runs,
                )
        else:
            runner.abort(None)
        self.seconds = time.perf_counter() - self.t_start
        # The thread no longer needs the set; a stored failure's traceback keeps
        # this frame, so its locals must not hold the set either.
        self.runner = self.body = runner = body = gs = None  # noqa: F841
        self.finished.set()
        with self.landed:
            self.landed.notify_all()
        _live.discard(self)

    # -- the serving side ----------------------------------------------------
    def _served(self, stream) -> torch.cuda.Event:
        key = stream.cuda_stream
        ev = self.served.get(key)
        if ev is None:
            ev = self.served[key] = torch.cuda.Event()
        return ev

    def _serving_stream(self):
        stream = torch.cuda.current_stream(self.device)
        if stream == self.default_stream:
            raise ExecutorError(
                "GPU work on the legacy default stream while a background capture runs",
                where="GraphSet.replay",
                fix="serve under torch.cuda.stream(s) with a stream of your own",
            )
        return stream

    @contextlib.contextmanager
    def exclusive(self):
        """The engine's own GPU work on the target's buffers, ordered against the capture thread's eager steps."""
        self._yield()
        with self.lock:
            stream = self._serving_stream()
            stream.wait_event(self.eager_done)
            yield
            self._served(stream).record(stream)

    def replay(self, gs: GraphSet, phase: str, n: int) -> tuple[torch.Tensor, ...]:
        while True:
            self._yield()
            with self.lock:
                if self.failure is not None:
                    break
                if self.stopping.is_set():
                    raise ExecutorError("replay after release", where="GraphSet.replay")
                table = gs.table(phase)
                stream = self._serving_stream()
                stream.wait_event(self.eager_done)
                slot = table.get(n)
                out = _WAIT
                if slot is not None:
                    out = gs.replay_graph(phase, n, *slot)
                    self.graph_replays += 1
                elif not 1 <= n <= table.limit or self.fallback == "raise":
                    table[n]  # raises: outside the plan, or not captured yet
                elif self.fallback == "eager":
                    out = as_outputs(gs.target.run(phase, n, None))
                    self.fallback_runs += 1
                elif callable(self.fallback):
                    out = self.fallback(phase, n)
                    self.fallback_runs += 1
                if out is not _WAIT:
                    self._served(stream).record(stream)
                    return out  # pyright: ignore[reportReturnType]  # not the _WAIT sentinel: the outputs
            # "wait": block outside the lock (the capture thread takes it for its eager steps)
            if self._held_here():
                raise ExecutorError(
                    "fallback='wait' inside exclusive() would wait for a capture thread that needs the lock it holds",
                    where="GraphSet.replay",
                    fix="replay outside exclusive(), or use another fallback",
                )
            with self.landed:
                # table bound now (B023): the predicate runs only inside this wait
                self.landed.wait_for(
                    lambda table=table: self.finished.is_set() or self.stopping.is_set() or table.get(n) is not None
                )
            if self.finished.is_set() and self.failure is None and not self.stopping.is_set():
                return gs.replay(phase, n)
        self._raise(gs)

    def wait(self, gs: GraphSet, timeout: float | None) -> bool:
        if not self.finished.wait(timeout):
            return False
        if self.failure is not None:
            self._raise(gs)
        if not self.completed:
            raise ExecutorError("the graph set was released before its capture finished", where="GraphSet.wait")
        return True

    def _raise(self, gs: GraphSet):
        self.finished.wait()  # the failed thread is winding down and needs no lock any more
        failure, step = self.failure, self.failed_step
        assert failure is not None  # called once the capture failed
        gs.release(reason=f"the background capture failed at {step.id if step else 'start'}")
        raise capture_failed(failure, step, self.plan, self.device)

    def _held_here(self) -> bool:
        owned = getattr(self.lock, "_is_owned", None)  # CPython's RLock says whether this thread holds it
        return bool(owned and owned())

    def stop_and_join(self) -> None:
        """Stop after the current step and wait for the thread (from any other thread)."""
        if self._held_here() and not self.finished.is_set():
            raise ExecutorError(
                "release() inside exclusive() while the capture runs would wait for a capture "
                "thread that needs the lock it holds",
                where="GraphSet.release",
                fix="leave the exclusive() block first",
            )
        self.stopping.set()
        with self.landed:
            self.landed.notify_all()
        if threading.current_thread() is not self.thread and self.thread.ident is not None:
            self.thread.join()


#: running background captures, stopped at interpreter exit (a daemon thread
#: killed mid-capture would leave CUDA state half-made)
_live: set[Background] = set()


def _stop_all() -> None:
    for job in list(_live):
        job.stop_and_join()


atexit.register(_stop_all)


def check_options(*, background: bool, record: bool, fallback: Fallback, distributed: bool) -> None:
    """An ExecutorError for a combination of capture options that cannot work."""
    if background and distributed:
        raise ExecutorError(
            "background capture is not supported with torch.distributed: each rank's warm-ups "
            "and replays would interleave differently and the collectives in them would hang",
            where="capture",
            fix="capture in the foreground (background=False)",
        )
    if background and record:
        raise ExecutorError(
            "record=True cannot be combined with background=True: the allocation history would "
            "mix the serving thread's allocations into the graphs' footprints",
            where="capture",
            fix="record in a foreground capture (verify, profile)",
        )
    if background and not (fallback in ("eager", "wait", "raise") or callable(fallback)):
        raise ExecutorError(
            f"unknown fallback {fallback!r}",
            where="capture",
            fix='use "eager", "wait", "raise" or a callable (phase, n) -> outputs',
        )
