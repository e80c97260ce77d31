"""``capture(plan, target)``: execute a plan's steps on the GPU; ``GraphSet`` replays.

What it does, step by step as planned: ``provision`` allocates a hoisted
workspace outside every graph pool; ``warmup`` runs the target eagerly on the
capture stream; ``capture`` records one CUDA graph into the planned pool on
the one capture stream, then holds the outputs as planned (owning tensors, or
non-owning views that let later captures reuse the memory). It measures the
pool after every capture against the plan's prediction (from the device's
reserved-bytes counter; one memory snapshot at the end confirms the total).

Unlike ``torch.cuda.graph(...)``, it does not synchronize and empty the cache
at every capture (vLLM turns that off too): that per-capture overhead is most
of the capture time of the engines' loop. It never runs a full garbage
collection either: one costs about a second in a server process with ~10
million live objects, more than the capture. The collector's old objects are
frozen while capturing (``executor.heap``); ``release`` collects only the
young generations, and only if a pool is still held after every reference
was dropped. A dead reference cycle that holds CUDA memory from before
``capture`` stays reserved until the engine's next collection (that memory
is outside the graph pools: the plan's prediction does not depend on it).

``capture(..., background=True)`` returns at once and captures on a thread
while the engine serves: see :mod:`executor.background` for how replays
during capture work and what the target must allow.

What it does not do: choose anything. The order, pools, output holding,
workspaces and warm-ups are the plan's; a plan that is wrong for the target is
caught by ``verify``, not here.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Union

import torch

from schemas.plan import Plan
from schemas.report import CaptureReport, StepMeasurement

from .dispatch import PadTable
from .errors import CaptureFailed, ExecutorError, StaleOutputError
from .heap import Frozen, collect_young
from .load import backend_module, current_environment
from .pool import AllocationRecorder, Window, pool_reserved, pool_segments, weak_view
from .target import CaptureTarget

__all__ = ["capture", "GraphSet", "Captured", "GuardedOutputs", "Fallback"]

log = logging.getLogger("capture_plan.executor")

#: what a background capture does with a batch no captured graph fits yet:
#: "eager" runs ``target.run(phase, n, None)``, "wait" blocks until a graph
#: lands, "raise" raises; a callable ``(phase, n) -> outputs`` is the engine's
#: own eager path.
Fallback = Union[str, Callable[[str, int], object]]


def _as_tuple(out) -> tuple[torch.Tensor, ...]:
    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in out):
        return tuple(out)
    raise TypeError(f"CaptureTarget.run must return a tensor or a tuple of tensors, got {type(out).__name__}")


@dataclass
class Captured:
    """One captured graph and how its outputs are held."""

    phase: str
    bs: int
    pool: str
    graph: torch.cuda.CUDAGraph
    outputs: tuple[torch.Tensor, ...]
    held: str  # "keep" | "view"
    rows_per_request: int
    #: position in capture order
    order: int = 0
    #: per n in 1..bs: outputs sliced to n requests (built once: dispatch stays O(1))
    sliced: list = field(default_factory=list)
    window: Window | None = None


class GuardedOutputs:
    """Outputs of one replay that raise if read after their pool was replayed again."""

    __slots__ = ("_gs", "_pool", "_epoch", "_tensors", "_who")

    def __init__(self, gs: "GraphSet", cap: Captured, tensors):
        self._gs, self._pool, self._tensors = gs, cap.pool, tensors
        self._epoch = gs._epoch[cap.pool]
        self._who = f"{cap.phase}/{cap.bs}"

    def get(self) -> tuple[torch.Tensor, ...]:
        now = self._gs._epoch[self._pool]
        if now != self._epoch:
            last = self._gs._last[self._pool]
            raise StaleOutputError(
                f"outputs of graph {self._who} were overwritten: graph {last} replayed in the same pool "
                f"({self._pool}) after them", where=f"pool {self._pool}",
                fix="consume outputs before the next replay, or plan the phase with outputs=keep or pool=own")
        return self._tensors


def _planned_sizes(plan: Plan) -> dict[str, list[int]]:
    sizes: dict[str, list[int]] = {}
    for s in plan.steps:
        if s.op == "capture":
            sizes.setdefault(s.phase, []).append(s.bs)
    return {p: sorted(v) for p, v in sizes.items()}


def _ranges(got: tuple[int, ...], planned: list[int]) -> str:
    """Captured sizes as runs of consecutive planned sizes: ``1-8,16,24-256``."""
    have = set(got)
    runs: list[list[int]] = []
    prev_in = False
    for s in planned:
        if s in have:
            if prev_in:
                runs[-1][1] = s
            else:
                runs.append([s, s])
        prev_in = s in have
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


class GraphSet:
    """The graphs of one plan; ``replay(phase, n)`` is the hot path.

    ``replay`` runs the target's ``refresh`` for a hoisted workspace, then the
    graph of the smallest captured size >= n (a table lookup), and returns
    the outputs sliced to n requests. Outputs held through views are valid
    until the next replay of any graph in the same pool; ``replay_checked``
    returns outputs that enforce that.

    While a background capture runs (``capture(..., background=True)``),
    ``replay`` goes through :class:`executor.background.Background` (a lock and
    two CUDA events more; eager fallback where no graph fits yet); once every
    graph has landed it is the lock-free path again. ``graphs``, ``pools`` and
    ``report`` are complete only after ``wait()``.
    """

    def __init__(self, plan: Plan, target: CaptureTarget):
        self.plan = plan
        self.target = target
        self.graphs: dict[tuple[str, int], Captured] = {}
        self.pools: dict[str, tuple[int, int]] = {}
        self.workspaces: dict[str, torch.Tensor] = {}
        self.report: CaptureReport | None = None
        #: (seconds since capture() was called, phase, bs) of every graph, as it landed
        self.timeline: list[tuple[float, str, int]] = []
        #: the background capture (None for a foreground one); kept after it ends for its numbers
        self.background = None
        self._planned = _planned_sizes(plan)
        self._tables: dict[str, PadTable] = {p: PadTable(p, {}, limit=v[-1]) for p, v in self._planned.items()}
        self._refresh: dict[str, Callable | None] = {}
        self._epoch: dict[str, int] = {}
        self._last: dict[str, str] = {}
        #: set while a background capture runs: replay goes through it
        self._bg = None
        #: why the tables are empty (released, or the capture failed)
        self._closed = ""

    # -- hot path ------------------------------------------------------------
    def replay(self, phase: str, n: int) -> tuple[torch.Tensor, ...]:
        if self._bg is not None:
            return self._bg.replay(self, phase, n)
        try:
            bs, cap = self._tables[phase][n]
        except KeyError:
            raise ExecutorError(f"no graphs for phase {phase!r}; captured: {sorted(self._tables)}{self._closed}",
                                where="GraphSet.replay") from None
        refresh = self._refresh[phase]
        if refresh is not None:
            refresh(phase, n, bs, self.workspaces[phase])
        cap.graph.replay()
        return cap.sliced[n]

    def replay_checked(self, phase: str, n: int) -> GuardedOutputs:
        _, cap = self._tables[phase][n]
        out = self.replay(phase, n)
        if cap.held == "view":
            self.note_replay(cap)
        return GuardedOutputs(self, cap, out)

    def note_replay(self, cap: Captured) -> None:
        """Record a replay made outside ``replay_checked`` (used by verify)."""
        self._epoch[cap.pool] += 1
        self._last[cap.pool] = f"{cap.phase}/{cap.bs}"

    # -- eager reference ---------------------------------------------------
    def eager(self, phase: str, n: int) -> tuple[torch.Tensor, ...]:
        """The target run eagerly at the padded size, sliced like ``replay``."""
        bs, cap = self._tables[phase][n]
        ws = self.workspaces.get(phase)
        if ws is not None:
            self.target.refresh(phase, n, bs, ws)
        out = _as_tuple(self.target.run(phase, bs, ws))
        return tuple(t[: n * cap.rows_per_request] for t in out)

    def padded(self, phase: str, n: int) -> int:
        """The captured size a batch of ``n`` replays at (during a background
        capture: at the moment of the call; it only ever gets tighter)."""
        return self._tables[phase].padded(n)

    # -- background capture --------------------------------------------------
    def exclusive(self) -> contextlib.AbstractContextManager:
        """While a background capture runs: a block of the engine's own GPU work
        on the target's buffers (eager runs, input writes) that the capture
        thread's warm-ups must not interleave with; ``replay`` may be called
        inside. Otherwise it does nothing."""
        bg = self._bg
        return bg.exclusive() if bg is not None else contextlib.nullcontext()

    @property
    def done(self) -> bool:
        """The capture has ended: every graph captured, or it failed or was
        released (always true for a foreground capture)."""
        return self.background is None or self.background.finished.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a background capture has captured every graph.

        Returns False if ``timeout`` seconds passed first. A failure of the
        capture thread is raised here (the set is released first), as a
        :class:`CaptureFailed` naming the step, like a foreground capture's;
        a set released before its capture finished raises ExecutorError.
        """
        if self.background is None:
            return True
        return self.background.wait(self, timeout)

    def progress(self) -> str:
        """Which sizes are ready, per phase: ``decode 12/36 [168-256]``."""
        parts = []
        for phase, planned in self._planned.items():
            table = self._tables.get(phase)
            got = table.sizes if table is not None else ()
            ready = f" [{_ranges(got, planned)}]" if got else ""
            parts.append(f"{phase} {len(got)}/{len(planned)}{ready}")
        return "; ".join(parts)

    def write_report(self, path) -> None:
        """Write the capture report (``planner report PATH`` shows it beside the plan)."""
        from pathlib import Path

        from schemas.codec import canonical_bytes
        from schemas.files import write_atomic

        if self.report is None:
            why = "the capture is still running: wait() first" if not self.done \
                else "the graphs were not captured by capture()"
            raise ExecutorError(f"no report: {why}", where="GraphSet")
        write_atomic(Path(path), canonical_bytes(self.report))

    # -- bookkeeping -------------------------------------------------------
    def _add(self, cap: Captured) -> None:
        """Make a captured graph servable. Order matters for a concurrent
        ``replay``: everything it reads is in place before the table points at it."""
        rows = cap.rows_per_request
        cap.sliced = [None] + [tuple(t[: n * rows] for t in cap.outputs) for n in range(1, cap.bs + 1)]
        self.graphs[(cap.phase, cap.bs)] = cap
        self._epoch.setdefault(cap.pool, 0)
        self._last.setdefault(cap.pool, "")
        self._refresh[cap.phase] = self.target.refresh if cap.phase in self.workspaces else None
        table = self._tables.get(cap.phase)
        if table is None:
            table = self._tables[cap.phase] = PadTable(cap.phase, {}, limit=cap.bs)
        table.add(cap.bs, cap)

    def release(self) -> None:
        """Drop every graph, output and workspace and return the pools' memory.

        A running background capture is stopped first (it finishes the step it
        is in). A pool's segments are returned only once every graph captured
        into it is destroyed (a reset is not enough on torch 2.11) and no
        tensor uses them, so no reference to a graph may outlive this method --
        not even a loop variable. If a pool is still held after that, the
        young generations are collected (a dead cycle made during capture);
        anything still holding it then is a live reference outside the set (a
        kept output the engine holds), and a warning says how many bytes.
        Must not run concurrently with ``replay``.
        """
        job = self.background
        if job is not None:
            job.stop_and_join()
        self._bg = None
        self._closed = self._closed or " (released)"
        pools = list(self.pools.values())
        while self.graphs:
            _, cap = self.graphs.popitem()
            cap.graph.reset()
            del cap
        self._tables.clear()
        self._refresh.clear()
        self.workspaces.clear()
        self.pools.clear()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        if pools and pool_segments(pools):
            found = collect_young()
            torch.cuda.empty_cache()
            left = pool_reserved(pools)
            if left:
                log.warning("capture-plan: %d B of released graph pools are still held after dropping every "
                            "graph (%d unreachable young objects collected): a tensor outside the GraphSet "
                            "(a kept output?) still uses them", left, found)


def _progress(steps, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # progress is a nicety; tqdm is in the executor extra
        return None
    return tqdm(total=len(steps), desc="capture", unit="step", file=sys.stderr, dynamic_ncols=True)


def _rank0(group=None) -> bool:
    return not (torch.distributed.is_available() and torch.distributed.is_initialized()) \
        or torch.distributed.get_rank(group) == 0


def _clear_frames(exc: BaseException | None) -> None:
    """Clear the frames of an exception and of every exception chained to it:
    they hold the partial capture's tensors and graphs."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def _capture_failed(failure: BaseException, step, plan: Plan, device) -> BaseException:
    """The error to raise for a capture that stopped at ``step`` (partial graphs already released)."""
    where = f"step {step.index} ({step.id}: phase {step.phase}, bs {step.bs})" if step else "before the first step"
    if isinstance(failure, ExecutorError):
        return failure
    if isinstance(failure, torch.OutOfMemoryError):
        free, _ = torch.cuda.mem_get_info(device)
        err = CaptureFailed(f"CUDA out of memory; the plan predicted a pool of {plan.predicted.pool_bytes} B "
                            f"and {free} B are free now that the partial graphs were released", where=where,
                            fix="free memory before capture (smaller KV cache) or plan fewer sizes")
    else:
        err = CaptureFailed(f"{type(failure).__name__}: {failure}; all partial graphs were released", where=where)
    err.__cause__ = failure
    err.__suppress_context__ = True
    return err


class _Steps:
    """Runs a plan's steps into a GraphSet, on the calling thread or a background one.

    ``eager`` wraps every step that executes work on the GPU outside a graph
    (provision, warm-up, the refresh before a capture): a no-op in the
    foreground, the ordering against concurrent replays in the background.
    """

    def __init__(self, gs: GraphSet, plan: Plan, target: CaptureTarget, device, *, record: bool, bar, show: bool,
                 t_start: float, mode: str = "global"):
        self.gs, self.plan, self.target, self.device = gs, plan, target, device
        self.bar, self.show, self.t_start, self.mode = bar, show, t_start, mode
        self.stream = torch.cuda.Stream(device=device)
        self.recorder = AllocationRecorder() if record else None
        self.predicted = {m.step: m.reserved for m in plan.predicted.timeline}
        self.measurements: list[StepMeasurement] = []
        self.warm_ptrs: dict[tuple[str, int], list[int]] = {}
        self.reserved = 0
        self.current = None
        self.eager: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        self.on_land: Callable[[Captured], None] | None = None
        self.env = current_environment(tuple(plan.requires.modules))
        self.captures = sum(s.op == "capture" for s in plan.steps)

    def step(self, step) -> None:
        self.current = step
        gs, target, stream = self.gs, self.target, self.stream
        t0 = time.perf_counter()
        if step.op == "provision":
            with self.eager(), torch.cuda.stream(stream) if self.mode != "global" else contextlib.nullcontext():
                gs.workspaces[step.phase] = torch.zeros(max(step.bytes, 1), dtype=torch.uint8, device=self.device)
        elif step.op == "warmup":
            ws = gs.workspaces.get(step.phase)
            with self.eager(), torch.cuda.stream(stream):
                for _ in range(max(step.runs, 1)):
                    if ws is not None:
                        target.refresh(step.phase, step.bs, step.bs, ws)
                    outs = _as_tuple(target.run(step.phase, step.bs, ws))
            self.warm_ptrs[(step.phase, step.bs)] = [t.data_ptr() for t in outs]
            del outs
            stream.synchronize()
        else:
            self.reserved += _capture_one(gs, step, target, stream, self.recorder, self.warm_ptrs, self.eager,
                                          self.mode)
            gs.timeline.append((time.perf_counter() - self.t_start, step.phase, step.bs))
            self._landed(gs.graphs[(step.phase, step.bs)])
        self.measurements.append(StepMeasurement(step=step.index, id=step.id, reserved=self.reserved,
                                                 predicted_reserved=self.predicted.get(step.index, 0),
                                                 seconds=time.perf_counter() - t0))
        if self.bar is not None:
            free, _ = torch.cuda.mem_get_info(self.device)
            self.bar.set_postfix_str(f"{step.id} free {free / 2**30:.1f} GiB", refresh=False)
            self.bar.update(1)

    def _landed(self, cap: Captured) -> None:
        if self.on_land is not None:
            self.on_land(cap)
        done = len(self.gs.timeline)
        first = len(self.gs._tables[cap.phase].sizes) == 1
        # Background: an operator wants to know when serving gets graphs and how far it is.
        level = logging.INFO if self.mode != "global" and self.show else logging.DEBUG
        quarter = max(self.captures // 4, 1)
        if first or done % quarter == 0 or done == self.captures:
            log.log(level, "capture-plan: %d/%d graphs in %.2f s%s; ready: %s", done, self.captures,
                    time.perf_counter() - self.t_start,
                    f" ({cap.phase} servable up to n={cap.bs})" if first else "", self.gs.progress())

    def run(self, *, should_stop: Callable[[], bool] | None = None, distributed: bool = False, group=None) -> bool:
        """Every step, in plan order; False if ``should_stop`` said so between steps. Raises what a step raised."""
        if distributed:
            from .distributed import run_synchronized

            run_synchronized(self.plan.steps, self.step, group)
        else:
            for step in self.plan.steps:
                if should_stop is not None and should_stop():
                    return False
                self.step(step)
        if self.mode == "global":
            torch.cuda.synchronize(self.device)
        else:  # a device-wide sync would wait for the engine's serving work too
            self.stream.synchronize()
        return True

    def abort(self, failure: BaseException | None) -> None:
        """Stop the progress bar and the recorder, drop the failure's frames."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.recorder is not None:
            self.recorder.close()  # reading the history could raise and hide the real failure
            self.recorder = None
        _clear_frames(failure)

    def finish(self) -> None:
        """The exact pool snapshot, allocation windows and the report."""
        gs, plan = self.gs, self.plan
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        exact = pool_reserved(gs.pools.values())  # one snapshot: the authoritative figure
        reserved = self.reserved
        if exact != reserved:
            log.warning("capture-plan: per-step pool figures are approximate: counted %d B, the pools hold %d B "
                        "(something else allocated during capture)", reserved, exact)
            reserved = exact
        if self.recorder is not None:
            for cap, win in zip([c for c in gs.graphs.values()], self.recorder.stop()):
                cap.window = win
            self.recorder = None
        elapsed = time.perf_counter() - self.t_start  # the whole call, from capture() on
        gs.report = CaptureReport(
            plan=plan.name, plan_digest=plan.digest, device=self.env.describe(), torch=str(torch.__version__),
            backend_module=backend_module(plan, self.env.modules) or "", pool_bytes=reserved,
            predicted_pool_bytes=plan.predicted.pool_bytes, capture_seconds=elapsed,
            hoisted_bytes=sum(w.numel() for w in gs.workspaces.values()), steps=self.measurements)
        if self.show:
            pred = plan.predicted.pool_bytes
            delta = f" ({(reserved - pred) / pred:+.1%})" if pred else ""
            log.info("capture-plan: %d graphs of %s in %.2f s; pool %s MiB, predicted %s MiB%s", len(gs.graphs),
                     plan.name, elapsed, f"{reserved / 2**20:,.1f}", f"{pred / 2**20:,.1f}", delta)


def _init_cublas(device) -> None:
    """Create this thread's cuBLAS and cuBLASLt handles and workspace on its current stream.

    A thread's first cuBLAS call creates its handle, which must not happen while
    another thread captures (it invalidates the capture)."""
    for dt in (torch.float32, torch.bfloat16):
        a = torch.ones(16, 16, device=device, dtype=dt)
        torch.addmm(a, a, a)
        a @ a


def capture(plan: Plan, target: CaptureTarget, *, progress: bool = True, record: bool = False,
            device: torch.device | None = None, group=None, background: bool = False,
            fallback: Fallback = "eager") -> GraphSet:
    """Capture ``plan``'s graphs of ``target``; see the module docstring.

    With ``torch.distributed`` initialized, ``group`` (default: the world) is
    the tensor-parallel group whose ranks must agree on the plan and fail
    together (see executor.distributed).

    ``record=True`` keeps each graph's allocation footprint (needed by
    ``verify``'s footprint guard and by ``profile``); it slows capture down.
    On any error every partial graph is released and the pools emptied, and a
    :class:`CaptureFailed` names the step, phase and size.

    ``background=True`` returns the GraphSet at once and captures on a thread
    in plan order; ``replay`` serves from the first graph of each phase on and
    ``fallback`` says what it does before (see :mod:`executor.background` for
    the constraints on the target and the serving thread). Not with
    ``torch.distributed`` nor with ``record=True``.

    Progress goes to the ``capture_plan.executor`` logger (rank 0; a tqdm bar
    too in the foreground when ``progress``).
    """
    t_start = time.perf_counter()
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if background and distributed:
        raise ExecutorError("background capture is not supported with torch.distributed: each rank's warm-ups "
                            "and replays would interleave differently and the collectives in them would hang",
                            where="capture", fix="capture in the foreground (background=False)")
    if background and record:
        raise ExecutorError("record=True cannot be combined with background=True: the allocation history would "
                            "mix the serving thread's allocations into the graphs' footprints",
                            where="capture", fix="record in a foreground capture (verify, profile)")
    if background and not (fallback in ("eager", "wait", "raise") or callable(fallback)):
        raise ExecutorError(f"unknown fallback {fallback!r}", where="capture",
                            fix='use "eager", "wait", "raise" or a callable (phase, n) -> outputs')
    if distributed:
        from .distributed import check_plan_agreement

        check_plan_agreement(plan, group)
    device = device or torch.device("cuda", torch.cuda.current_device())
    gs = GraphSet(plan, target)
    show = _rank0(group)
    bar = _progress(plan.steps, progress and show and not background)
    runner = _Steps(gs, plan, target, device, record=record, bar=bar, show=show and progress, t_start=t_start,
                    mode="thread_local" if background else "global")
    torch.cuda.synchronize(device)
    heap = Frozen().__enter__()
    if background:
        from .background import Background

        try:
            _init_cublas(device)
            gs.background = Background(runner, device, fallback, heap)
        except BaseException:
            heap.thaw()
            raise
        gs._bg = gs.background
        gs.background.start()
        return gs
    failure: BaseException | None = None
    try:
        runner.run(distributed=distributed, group=group)
    except BaseException as err:
        failure = err
    finally:
        heap.thaw()
    if failure is not None:
        # Clean up outside the except clause, once nothing on this stack
        # refers to the partial capture: the traceback's frames hold its
        # tensors and graphs, and a pool is only returned when no graph and
        # no tensor uses it any more.
        runner.abort(failure)
        gs.release()
        if not isinstance(failure, Exception):  # KeyboardInterrupt and friends: released, then re-raised
            raise failure
        raise _capture_failed(failure, runner.current, plan, device)
    runner.finish()
    return gs


def _capture_one(gs: GraphSet, step, target: CaptureTarget, stream, recorder, warm_ptrs, eager=contextlib.nullcontext,
                 mode: str = "global") -> int:
    """Capture one step; returns the bytes its pool grew by.

    ``mode`` is CUDA's capture error mode: "global" (foreground) also fails the
    capture if any other thread makes an unsafe call meanwhile; "thread_local"
    (background) lets the engine's threads keep launching work.
    """
    pool = gs.pools.get(step.pool)
    if pool is None:
        pool = gs.pools[step.pool] = torch.cuda.graph_pool_handle()
    ws = gs.workspaces.get(step.phase)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        if ws is not None:
            with eager():  # writes the workspace replays read: ordered against them
                target.refresh(step.phase, step.bs, step.bs, ws)  # outside the graph, by design
        if recorder is not None:
            recorder.begin()
        # Between capture_begin and capture_end every allocation on the capture
        # stream goes to the pool, so the device's reserved-bytes delta is the
        # pool's growth: a cheap counter instead of a full memory snapshot per
        # step. In the background the serving thread may allocate meanwhile,
        # so there the pool itself is measured.
        exact = mode != "global"
        reserved_before = _pool_bytes(pool) if exact else torch.cuda.memory_reserved()
        g.capture_begin(pool=pool, capture_error_mode=mode)
        try:
            outs = _as_tuple(target.run(step.phase, step.bs, ws))
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
        grown = (_pool_bytes(pool) if exact else torch.cuda.memory_reserved()) - reserved_before
        if recorder is not None:
            recorder.end()
    rows, rem = divmod(outs[0].shape[0], step.bs) if outs[0].dim() else (1, 0)
    if rem:
        raise ExecutorError(f"output has {outs[0].shape[0]} rows, not a multiple of bs {step.bs}",
                            where=f"step {step.index} ({step.id})")
    before = warm_ptrs.get((step.phase, step.bs))
    if before is not None:
        for i, (t, p) in enumerate(zip(outs, before)):
            if t.data_ptr() != p and not _in_pool(t, gs):
                raise ExecutorError(
                    f"output {i} moved from {p:#x} (warm-up) to {t.data_ptr():#x} (capture) outside the graph pool: "
                    "replays would write where the engine does not read", where=f"step {step.index} ({step.id})",
                    fix="return the same static buffer every call, or allocate the output inside run()")
    held = step.outputs or "keep"
    kept = tuple(weak_view(t) for t in outs) if held == "view" else outs
    del outs
    gs._add(Captured(phase=step.phase, bs=step.bs, pool=step.pool, graph=g, outputs=kept, held=held,
                     rows_per_request=rows, order=len(gs.graphs)))
    return grown


def _pool_bytes(pool) -> int:
    """Reserved bytes of one pool: from a snapshot of that pool alone where
    torch can take one (``mempool_id``), else of the whole allocator."""
    want = tuple(int(x) for x in pool)
    try:
        segs = torch.cuda.memory_snapshot(mempool_id=pool)
    except Exception:  # a torch without per-pool snapshots (TypeError), or one that refuses this pool
        segs = []
    mine = [s["total_size"] for s in segs
            if s.get("segment_pool_id") is not None and tuple(int(x) for x in s["segment_pool_id"]) == want]
    # nothing found (a new pool, or a snapshot that does not say its pool): ask the whole allocator
    return sum(mine) if mine else pool_reserved([pool])


def _in_pool(t: torch.Tensor, gs: GraphSet) -> bool:
    ptr = t.data_ptr()
    return any(a <= ptr < a + s for a, s in pool_segments(gs.pools.values()))
