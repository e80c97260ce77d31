"""The capture session: the parts every capture of a plan is made of, into a ``GraphSet``.

A :class:`CaptureSession` is what :func:`capture_plan.executor.loop.capture_loop`
(and ``capture(plan, target)``, its plan-driven user in
:mod:`capture_plan.executor.driver`) run the plan's steps with: ``provision``
allocates a hoisted workspace outside every graph pool; warm-ups run on the
capture stream in a scratch pool; ``recording`` records one CUDA graph into
the planned pool on the one capture stream; ``land`` holds the outputs as
planned (owning tensors, or non-owning views that let later captures reuse
the memory) and makes the graph servable; ``measure`` and ``finish`` write the
report. It measures the pool after every capture against the plan's
prediction (a snapshot of that pool alone after every capture; one memory
snapshot of every pool at the end confirms the total). The steps allocate in exactly the order the
planner simulated: that is what makes its predictions exact, so a change here
that moves, adds or drops an allocation changes what the plans predict.

**What capture leaves behind: the graphs, and nothing else.** After
``capture`` returns, the device holds the graph pools, the hoisted workspaces
and what the graphs need to run: the capture stream's cuBLAS workspace,
created before the first step in the ordinary allocator (outside every pool:
a first GEMM inside a capture would put it in the pool, and a first GEMM
inside a warm-up would put it in the warm-up's scratch memory). The
warm-ups' temporaries are *returned*, not reused: each warm-up step runs with
this thread's allocations routed into a scratch pool that is emptied and
destroyed when the step ends (:func:`capture_plan.executor.pool.scratch_pool`), so its
blocks do not stay cached on the capture stream, where nothing else could
reuse them. (Reusing them in the graph pool instead would change the pool's
contents the planner simulates.) This is safe while an engine serves (a
background capture) and for an engine that holds cached blocks of its own:
only the capture thread's allocations are routed, and only the scratch pool is
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
``capture`` stays reserved until the engine's next collection (that memory
is outside the graph pools: the plan's prediction does not depend on it).

``capture(..., background=True)`` returns at once and runs the same loop
on a thread while the engine serves: see :mod:`capture_plan.executor.background` for how
replays during capture work and what the target must allow.

What it does not do: choose anything. The order, pools, output holding,
workspaces and warm-ups are the plan's; a plan that is wrong for the target is
caught by ``verify``, not here.
"""

from __future__ import annotations

import contextlib
import logging
import time
import traceback
from collections.abc import Callable

import torch

from capture_plan.schemas.plan import Plan, Step
from capture_plan.schemas.report import CaptureReport, StepMeasurement
from capture_plan.schemas.units import mib

from .device import Probe, device_view, driver_version, probe
from .errors import ExecutorError, capture_failed
from .graph_nodes import instantiate_kept
from .graphs import Captured, Fallback, GraphSet
from .load import backend_module, current_environment
from .logs import log, rank_tag
from .pool import AllocationRecorder, in_pools, one_pool_reserved, pool_key, pool_usage, weak_view

__all__ = ["CaptureSession", "capture_failed", "capture_stream", "refuse_piecewise"]

#: the executor's capture stream of each device, made once per process: cuBLAS keeps a
#: workspace per (handle, stream) for the life of the process, so a new stream per
#: capture() would leave one more workspace behind every time
_streams: dict = {}


def capture_stream(device) -> torch.cuda.Stream:
    """The stream every capture on ``device`` records on (one per device and process).

    Graphs captured on it bake in its cuBLAS workspace, which all of them share:
    replays of graphs from different GraphSets must not run at the same time on
    different streams (as replays within one GraphSet must not either)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" are one device
        device = torch.device("cuda", torch.cuda.current_device())
    key = str(device)
    stream = _streams.get(key)
    if stream is None:
        stream = _streams[key] = torch.cuda.Stream(device=device)
    return stream


def prime_stream(device, stream: torch.cuda.Stream | None = None) -> None:
    """Create ``stream``'s (default: the capture stream's) cuBLAS and cuBLASLt workspace,
    outside every pool.

    cuBLAS allocates a workspace per (handle, stream) at the stream's first
    GEMM and keeps it. The operands are allocated on the calling thread's
    stream without a kernel (a few bytes in blocks the engine's stream has
    cached) and filled on the capture stream, so that the capture stream
    gets no small segment of its own: the workspace is all this leaves.
    (Operands from a scratch pool left its 2 MiB segment behind: a pool
    destroyed while its blocks are alive keeps their segment cached.) In a
    process that has run no GEMM yet this also initializes cuBLAS, which took
    66 MiB outside the caching allocator on an H200."""
    stream = stream if stream is not None else capture_stream(device)
    mats = [
        (torch.empty(16, 16, device=device, dtype=dt), torch.empty(16, 16, device=device, dtype=dt))
        for dt in (torch.float32, torch.bfloat16)
    ]
    with torch.cuda.stream(stream):
        for a, out in mats:
            a.fill_(1)
            torch.addmm(a, a, a, out=out)
            torch.matmul(a, a, out=out)
        stream.synchronize()  # the operands are idle before they go back to their stream
    del mats, a, out  # pyright: ignore[reportPossiblyUnboundVariable]  # the loop ran: mats has two pairs


#: whether a capture by capture-plan has completed in this process: the first one
#: pays the driver's one-off graph-capture cost (the device view says which it was)
_captured_in_process = False


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _rank0(group=None) -> bool:
    return not _distributed() or torch.distributed.get_rank(group) == 0


def _clear_frames(exc: BaseException | None) -> None:
    """Clear the frames of an exception and of every exception chained to it:
    they hold the partial capture's tensors and graphs."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


class CaptureSession:
    """Runs a plan's steps into a GraphSet, on the calling thread or a background one.

    ``step`` dispatches each plan step to the method named for its op
    (:attr:`OPS`), then records the step's measurement. ``eager`` wraps every
    step that executes work on the GPU outside a graph (provision, warm-up,
    the refresh before a capture): a no-op in the foreground, the ordering
    against concurrent replays in the background. ``mode`` is CUDA's capture
    error mode: "global" (foreground) also fails the capture if any other
    thread makes an unsafe call meanwhile; "thread_local" (background) lets
    the engine's threads keep launching work. ``show``: this process logs
    progress and the summary (rank 0 of the capture's group).
    """

    def __init__(self, gs: GraphSet, device, *, record: bool, bar, show: bool, t_start: float, mode: str = "global"):
        # a session runs a plan: GraphSets without one (engine.adopt's) never get here
        assert gs.plan is not None
        self.gs, self.plan, self.target, self.device = gs, gs.plan, gs.target, device
        self.bar, self.show, self.t_start, self.mode = bar, show, t_start, mode
        self.stream = capture_stream(device)
        self.recorder = AllocationRecorder() if record else None
        self.predicted = {m.step: m.reserved for m in self.plan.predicted.timeline}
        self.measurements: list[StepMeasurement] = []
        #: output addresses of each (phase, bs)'s last warm-up run
        self.warm_ptrs: dict[tuple[str, int], list[int]] = {}
        #: bytes the graph pools grew by so far
        self.reserved = 0
        #: the step running (or that failed)
        self.current: Step | None = None
        self.eager: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        self.on_land: Callable[[Captured], None] | None = None
        self.env = current_environment(tuple(self.plan.requires.modules))
        self.captures = sum(s.op == "capture" for s in self.plan.steps)
        #: the device before the first step (taken by ``capture``)
        self.before: Probe | None = None
        #: the last warm-up's peak scratch memory, until its step is measured
        self.scratch: int | None = None
        #: the last recorded graph's node count, until its step is measured (None: not counted)
        self.nodes: int | None = None
        #: pools this session made that nothing has captured into yet (they hold no segment)
        self.new_pools: set[tuple[int, int]] = set()
        self.first_in_process = not _captured_in_process

    # -- one method per step op ---------------------------------------------
    def provision(self, step: Step) -> None:
        """Allocate the phase's hoisted workspace, outside every graph pool."""
        # On a background capture's thread the current stream is the legacy default
        # stream, whose work synchronizes with every other stream: use the capture stream.
        with self.eager(), torch.cuda.stream(self.stream) if self.mode != "global" else contextlib.nullcontext():
            self.gs.workspaces[step.phase] = torch.zeros(max(step.bytes, 1), dtype=torch.uint8, device=self.device)

    #: the ops of ``capture_plan.schemas.plan.StepOp`` the session runs itself; ``warmup`` and
    #: ``capture`` steps are the loop's (:class:`capture_plan.executor.loop.LoopStep`), where the
    #: driver (``capture()``) or the engine's loop does the work
    OPS: dict[str, Callable[[CaptureSession, Step], None]] = {"provision": provision}

    # -- the parts of a capture step ------------------------------------------
    def pool(self, name: str):
        """The handle of the plan's pool ``name``, made at its first capture."""
        pool = self.gs.pools.get(name)
        if pool is None:
            pool = self.gs.pools[name] = torch.cuda.graph_pool_handle()
            self.new_pools.add(pool_key(pool))
        return pool

    @contextlib.contextmanager
    def recording(self, g: torch.cuda.CUDAGraph, pool):
        """Record ``g`` into ``pool`` on the capture stream while the block runs.

        Yields a one-element list that holds the bytes the pool grew by once
        the block has ended. A block that raises leaves no partial graph
        behind: the graph is reset (it would hold its pool)."""
        recorder = self.recorder
        with torch.cuda.stream(self.stream):
            if recorder is not None:
                recorder.begin()
            # The pool itself is measured (a snapshot of that pool alone): the device's
            # reserved-bytes counter also moves for allocations outside the pool meanwhile (the
            # CUDA RNG's graph-safe state at a pool's first capture, the serving thread in the
            # background), and the per-step figures are what the plan's timeline is checked against.
            key = pool_key(pool)
            # a pool nothing captured into yet holds nothing, and is not asked: torch keeps no
            # private pool for the handle until its first capture_begin
            fresh = key in self.new_pools
            self.new_pools.discard(key)
            reserved_before = 0 if fresh else one_pool_reserved(pool)
            grown = [0]
            g.capture_begin(pool=pool, capture_error_mode=self.mode)
            try:
                yield grown
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
            self.nodes = instantiate_kept(g)
            grown[0] = one_pool_reserved(pool) - reserved_before
            if recorder is not None:
                recorder.end()

    def rows_per_request(self, step: Step, outs: tuple[torch.Tensor, ...]) -> int:
        """Output rows per request: the first output's rows over ``step.bs`` (an
        ExecutorError naming the step if they are no multiple of it)."""
        rows, rem = divmod(outs[0].shape[0], step.bs) if outs[0].dim() else (1, 0)
        if rem:
            raise ExecutorError(
                f"output has {outs[0].shape[0]} rows, not a multiple of bs {step.bs}",
                where=f"step {step.index} ({step.id})",
            )
        return rows

    def land(
        self, step: Step, graph: torch.cuda.CUDAGraph, outs: tuple[torch.Tensor, ...], rows: int, grown: int
    ) -> tuple[torch.Tensor, ...]:
        """Hold a recorded graph's outputs as planned and make it servable; returns the held outputs.

        With ``outputs = "view"`` the held outputs do not keep the memory: the
        caller drops ``outs`` before the next capture, or it stays allocated."""
        gs = self.gs
        held = step.outputs or "keep"
        kept = tuple(weak_view(t) for t in outs) if held == "view" else outs
        del outs
        gs.add(
            Captured(
                phase=step.phase,
                bs=step.bs,
                pool=step.pool,
                graph=graph,
                outputs=kept,
                held=held,
                rows_per_request=rows,
                order=len(gs.graphs),
            )
        )
        self.reserved += grown
        gs.timeline.append((time.perf_counter() - self.t_start, step.phase, step.bs))
        self._landed(gs.graphs[(step.phase, step.bs)])
        return kept

    def check_static_outputs(self, step: Step, outs) -> None:
        """An output outside the pool must be the static buffer the warm-up returned."""
        before = self.warm_ptrs.get((step.phase, step.bs))
        if before is None:
            return
        for i, (t, p) in enumerate(zip(outs, before)):
            if t.data_ptr() != p and not in_pools(t.data_ptr(), self.gs.pools.values()):
                raise ExecutorError(
                    f"output {i} moved from {p:#x} (warm-up) to {t.data_ptr():#x} (capture) outside the graph pool: "
                    "replays would write where the engine does not read",
                    where=f"step {step.index} ({step.id})",
                    fix="return the same static buffer every call, or allocate the output inside run()",
                )

    def _landed(self, cap: Captured) -> None:
        if self.on_land is not None:
            self.on_land(cap)
        if not self.show:  # progress is rank 0's to tell
            return
        done = len(self.gs.timeline)
        first = len(self.gs.table(cap.phase).sizes) == 1
        # Background: an operator wants to know when serving gets graphs and how far it is.
        level = logging.INFO if self.mode != "global" else logging.DEBUG
        quarter = max(self.captures // 4, 1)
        if first or done % quarter == 0 or done == self.captures:
            log.log(
                level,
                "capture-plan: %d/%d graphs in %.2f s%s; ready: %s",
                done,
                self.captures,
                time.perf_counter() - self.t_start,
                f" ({cap.phase} servable up to n={cap.bs})" if first else "",
                self.gs.progress(),
            )

    # -- the whole plan ------------------------------------------------------
    def step(self, step: Step) -> None:
        """Run one plan step and record its measurement."""
        self.current = step
        t0 = time.perf_counter()
        op = self.OPS.get(step.op)
        if op is None and step.op in ("warmup", "capture"):  # they run with the capture they precede
            raise ExecutorError(
                f"a {step.op} step after the plan's last capture: nothing follows it",
                where=f"step {step.index} ({step.id})",
                fix="rebuild the plan (planner builds end with a capture)",
            )
        if op is None:  # the plan decoder admits only StepOp; a new op needs a method here
            raise ExecutorError(
                f"unknown step op {step.op!r}",
                where=f"step {step.index} ({step.id})",
                fix="upgrade capture-plan's executor to one that knows this op",
            )
        op(self, step)
        self.measure(step, t0)

    def measure(self, step: Step, t0: float) -> None:
        """Record the measurement of ``step``, which began at ``t0`` (``time.perf_counter``)."""
        free, _ = torch.cuda.mem_get_info(self.device)  # no sync: the device's figure as of now
        scratch, self.scratch = self.scratch, None
        nodes, self.nodes = self.nodes, None
        self.measurements.append(
            StepMeasurement(
                step=step.index,
                id=step.id,
                reserved=self.reserved,
                predicted_reserved=self.predicted.get(step.index, 0),
                seconds=time.perf_counter() - t0,
                free=int(free),
                allocator_reserved=int(torch.cuda.memory_reserved(self.device)),
                scratch=scratch,
                graph_nodes=nodes if step.op == "capture" else None,
            )
        )
        if self.bar is not None:
            self.bar.set_postfix_str(f"{step.id} free {free / 2**30:.1f} GiB", refresh=False)
            self.bar.update(1)

    def prime(self) -> None:
        """Create the capture stream's cuBLAS and cuBLASLt workspace (:func:`prime_stream`)."""
        prime_stream(self.device, self.stream)

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
        exact, pool_allocated = pool_usage(gs.pools.values())  # one snapshot: the authoritative figure
        reserved = self.reserved
        if exact != reserved:
            log.warning(
                "capture-plan%s: per-step pool figures are approximate: counted %d B, the pools hold %d B "
                "(something else allocated during capture)",
                rank_tag(),
                reserved,
                exact,
            )
            reserved = exact
        if self.recorder is not None:
            for cap, win in zip([c for c in gs.graphs.values()], self.recorder.stop()):
                cap.window = win
            self.recorder = None
        elapsed = time.perf_counter() - self.t_start  # the whole call, from capture() on
        hoisted = sum(w.numel() for w in gs.workspaces.values())
        view = None
        if self.before is not None:
            global _captured_in_process
            _captured_in_process = True
            view = device_view(
                self.before,
                probe(self.device),
                pool_reserved=exact,
                pool_allocated=pool_allocated,
                hoisted=sum(w.untyped_storage().nbytes() for w in gs.workspaces.values()),
                first_in_process=self.first_in_process,
                background=self.mode != "global",
            )
        gs.report = CaptureReport(
            plan=plan.name,
            plan_digest=plan.digest,
            device=self.env.describe(),
            torch=str(torch.__version__),
            backend_module=backend_module(plan, self.env.modules) or "",
            pool_bytes=reserved,
            predicted_pool_bytes=plan.predicted.pool_bytes,
            capture_seconds=elapsed,
            hoisted_bytes=hoisted,
            steps=self.measurements,
            driver=driver_version(),
            device_view=view,
        )
        if self.show:
            pred = plan.predicted.pool_bytes
            delta = f" ({(reserved - pred) / pred:+.1%})" if pred else ""
            log.info(
                "capture-plan: %d graphs of %s in %.2f s; pool %s MiB, predicted %s MiB%s%s",
                len(gs.graphs),
                plan.name,
                elapsed,
                mib(reserved, unit=False),
                mib(pred, unit=False),
                delta,
                f"; free device memory {mib(view.drop, unit=False)} MiB less" if view is not None else "",
            )


def _init_cublas(device) -> None:
    """Create this thread's cuBLAS and cuBLASLt handles and workspace on its current stream.

    A thread's first cuBLAS call creates its handle, which must not happen while
    another thread captures (it invalidates the capture)."""
    for dt in (torch.float32, torch.bfloat16):
        a = torch.ones(16, 16, device=device, dtype=dt)
        torch.addmm(a, a, a)
        a @ a  # pyright: ignore[reportUnusedExpression]  # run for the cuBLASLt handle it creates


#: phase kinds whose graphs are pieces between eagerly-run attention ops (vLLM's PIECEWISE):
#: the executor records one whole graph per capture step, which would be a different graph
#: from the one the plan's figures describe. planner/data/phase_kinds.toml defines the kind.
PIECEWISE_KINDS = frozenset({"piecewise"})


def refuse_piecewise(plan: Plan, phases=None, where: str = "capture") -> None:
    """An ExecutorError naming the first phase of ``plan`` (of ``phases``, if given)
    whose kind is captured in pieces: its graphs are the engine's piecewise
    backend's to capture (the plan predicts their pool), not the executor's."""
    for p in plan.phases:
        if p.kind in PIECEWISE_KINDS and (phases is None or p.name in phases):
            raise ExecutorError(
                f"phase {p.name!r} is {p.kind!r}: its graphs are pieces between eager attention ops, and the "
                "executor records one whole graph per capture",
                where=where,
                fix="capture piecewise phases with the engine's own piecewise backend (vLLM's), the plan predicting "
                "their pool; capture the full phases alone with a plan built without them",
            )


def _check_options(*, background: bool, record: bool, fallback: Fallback, distributed: bool) -> None:
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
