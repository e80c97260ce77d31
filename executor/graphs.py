"""``capture(plan, target)``: execute a plan's steps on the GPU; ``GraphSet`` replays.

What it does, step by step as planned: ``provision`` allocates a hoisted
workspace outside every graph pool; ``warmup`` runs the target eagerly on the
capture stream; ``capture`` records one CUDA graph into the planned pool on
the one capture stream, then holds the outputs as planned (owning tensors, or
non-owning views that let later captures reuse the memory). It measures the
pool after every capture against the plan's prediction (from the device's
reserved-bytes counter; one memory snapshot at the end confirms the total).

Unlike ``torch.cuda.graph(...)``, it does not synchronize, collect garbage and
empty the cache at every capture (vLLM turns that off too): once before the
first capture is enough, and that per-capture overhead is most of the capture
time of the engines' loop.

What it does not do: choose anything. The order, pools, output holding,
workspaces and warm-ups are the plan's; a plan that is wrong for the target is
caught by ``verify``, not here.
"""

from __future__ import annotations

import gc
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch

from schemas.plan import Plan
from schemas.report import CaptureReport, StepMeasurement

from .dispatch import PadTable
from .errors import CaptureFailed, ExecutorError, StaleOutputError
from .load import backend_module, current_environment
from .pool import AllocationRecorder, Window, pool_reserved, pool_segments, weak_view
from .target import CaptureTarget

__all__ = ["capture", "GraphSet", "Captured", "GuardedOutputs"]


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


class GraphSet:
    """The graphs of one plan; ``replay(phase, n)`` is the hot path.

    ``replay`` runs the target's ``refresh`` for a hoisted workspace, then the
    graph of the smallest captured size >= n (a table lookup), and returns
    the outputs sliced to n requests. Outputs held through views are valid
    until the next replay of any graph in the same pool; ``replay_checked``
    returns outputs that enforce that.
    """

    def __init__(self, plan: Plan, target: CaptureTarget):
        self.plan = plan
        self.target = target
        self.graphs: dict[tuple[str, int], Captured] = {}
        self.pools: dict[str, tuple[int, int]] = {}
        self.workspaces: dict[str, torch.Tensor] = {}
        self.report: CaptureReport | None = None
        self._tables: dict[str, PadTable] = {}
        self._refresh: dict[str, Callable | None] = {}
        self._epoch: dict[str, int] = {}
        self._last: dict[str, str] = {}

    # -- hot path ------------------------------------------------------------
    def replay(self, phase: str, n: int) -> tuple[torch.Tensor, ...]:
        try:
            bs, cap = self._tables[phase][n]
        except KeyError:
            raise ExecutorError(f"no graphs for phase {phase!r}; captured: {sorted(self._tables)}",
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
        return self._tables[phase].padded(n)

    def write_report(self, path) -> None:
        """Write the capture report (``planner report PATH`` shows it beside the plan)."""
        from pathlib import Path

        from schemas.codec import canonical_bytes
        from schemas.files import write_atomic

        if self.report is None:
            raise ExecutorError("no report: the graphs were not captured by capture()", where="GraphSet")
        write_atomic(Path(path), canonical_bytes(self.report))

    # -- bookkeeping -------------------------------------------------------
    def _add(self, cap: Captured) -> None:
        self.graphs[(cap.phase, cap.bs)] = cap
        self._epoch.setdefault(cap.pool, 0)

    def _finish(self) -> None:
        for phase in {p for p, _ in self.graphs}:
            entries = {bs: cap for (p, bs), cap in self.graphs.items() if p == phase}
            for cap in entries.values():
                rows = cap.rows_per_request
                cap.sliced = [None] + [tuple(t[: n * rows] for t in cap.outputs) for n in range(1, cap.bs + 1)]
            self._tables[phase] = PadTable(phase, entries)
            self._refresh[phase] = self.target.refresh if phase in self.workspaces else None

    def release(self) -> None:
        """Drop every graph, output and workspace and return the pools' memory.

        A pool's segments are returned only once every graph captured into it
        is destroyed (a reset is not enough on torch 2.11), so no reference to
        a graph may outlive this method -- not even a loop variable.
        """
        while self.graphs:
            _, cap = self.graphs.popitem()
            cap.graph.reset()
            del cap
        self._tables.clear()
        self.workspaces.clear()
        self.pools.clear()
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


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


def capture(plan: Plan, target: CaptureTarget, *, progress: bool = True, record: bool = False,
            device: torch.device | None = None, group=None) -> GraphSet:
    """Capture ``plan``'s graphs of ``target``; see the module docstring.

    With ``torch.distributed`` initialized, ``group`` (default: the world) is
    the tensor-parallel group whose ranks must agree on the plan and fail
    together (see executor.distributed).

    ``record=True`` keeps each graph's allocation footprint (needed by
    ``verify``'s footprint guard and by ``profile``); it slows capture down.
    On any error every partial graph is released and the pools emptied, and a
    :class:`CaptureFailed` names the step, phase and size.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from .distributed import check_plan_agreement

        check_plan_agreement(plan, group)
    device = device or torch.device("cuda", torch.cuda.current_device())
    gs = GraphSet(plan, target)
    show = progress and _rank0(group)
    bar = _progress(plan.steps, show)
    env = current_environment(tuple(plan.requires.modules))
    stream = torch.cuda.Stream(device=device)
    recorder = AllocationRecorder() if record else None
    predicted = {m.step: m.reserved for m in plan.predicted.timeline}
    measurements: list[StepMeasurement] = []
    warm_ptrs: dict[tuple[str, int], list[int]] = {}
    reserved = 0
    torch.cuda.synchronize(device)
    gc.collect()
    t_start = time.perf_counter()
    current = [None]
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()

    def do_step(step) -> None:
        nonlocal reserved
        current[0] = step
        t0 = time.perf_counter()
        if step.op == "provision":
            gs.workspaces[step.phase] = torch.zeros(max(step.bytes, 1), dtype=torch.uint8, device=device)
        elif step.op == "warmup":
            ws = gs.workspaces.get(step.phase)
            with torch.cuda.stream(stream):
                for _ in range(max(step.runs, 1)):
                    if ws is not None:
                        target.refresh(step.phase, step.bs, step.bs, ws)
                    outs = _as_tuple(target.run(step.phase, step.bs, ws))
            warm_ptrs[(step.phase, step.bs)] = [t.data_ptr() for t in outs]
            del outs
            stream.synchronize()
        else:
            reserved += _capture_one(gs, step, target, stream, recorder, warm_ptrs)
        measurements.append(StepMeasurement(step=step.index, id=step.id, reserved=reserved,
                                            predicted_reserved=predicted.get(step.index, 0),
                                            seconds=time.perf_counter() - t0))
        if bar is not None:
            free, _ = torch.cuda.mem_get_info(device)
            bar.set_postfix_str(f"{step.id} free {free / 2**30:.1f} GiB", refresh=False)
            bar.update(1)

    failure: BaseException | None = None
    try:
        if distributed:
            from .distributed import run_synchronized

            run_synchronized(plan.steps, do_step, group)
        else:
            for step in plan.steps:
                do_step(step)
        torch.cuda.synchronize(device)
    except BaseException as err:
        failure = err
    if failure is not None:
        # Clean up outside the except clause, once nothing on this stack
        # refers to the partial capture: the traceback's frames hold its
        # tensors and graphs, and a pool is only returned when no graph and
        # no tensor uses it any more.
        if bar is not None:
            bar.close()
        if recorder is not None:
            recorder.stop()
        traceback.clear_frames(failure.__traceback__)
        gs.release()
        if not isinstance(failure, Exception):  # KeyboardInterrupt and friends: released, then re-raised
            raise failure
        step = current[0]
        where = f"step {step.index} ({step.id}: phase {step.phase}, bs {step.bs})" if step else "before the first step"
        if isinstance(failure, torch.OutOfMemoryError):
            free, _ = torch.cuda.mem_get_info(device)
            raise CaptureFailed(f"CUDA out of memory; the plan predicted a pool of {plan.predicted.pool_bytes} B "
                                f"and {free} B are free now that the partial graphs were released", where=where,
                                fix="free memory before capture (smaller KV cache) or plan fewer sizes") from failure
        if isinstance(failure, ExecutorError):
            raise failure
        raise CaptureFailed(f"{type(failure).__name__}: {failure}; all partial graphs were released",
                            where=where) from failure
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - t_start
    exact = pool_reserved(gs.pools.values())  # one snapshot: the authoritative figure
    if exact != reserved:
        print(f"capture-plan: per-step pool figures are approximate: counted {reserved} B, the pools hold "
              f"{exact} B (something else allocated during capture)", file=sys.stderr)
        reserved = exact
    if recorder is not None:
        for cap, win in zip([c for c in gs.graphs.values()], recorder.stop()):
            cap.window = win
    gs._finish()
    gs.report = CaptureReport(
        plan=plan.name, plan_digest=plan.digest, device=env.describe(), torch=str(torch.__version__),
        backend_module=backend_module(plan, env.modules) or "", pool_bytes=reserved,
        predicted_pool_bytes=plan.predicted.pool_bytes, capture_seconds=elapsed,
        hoisted_bytes=sum(w.numel() for w in gs.workspaces.values()), steps=measurements)
    if show:
        pred = plan.predicted.pool_bytes
        delta = f" ({(reserved - pred) / pred:+.1%})" if pred else ""
        print(f"capture-plan: {len(gs.graphs)} graphs of {plan.name} in {elapsed:.2f} s; pool "
              f"{reserved / 2**20:,.1f} MiB, predicted {pred / 2**20:,.1f} MiB{delta}", file=sys.stderr)
    return gs


def _capture_one(gs: GraphSet, step, target: CaptureTarget, stream, recorder, warm_ptrs) -> int:
    """Capture one step; returns the bytes its pool grew by."""
    pool = gs.pools.get(step.pool)
    if pool is None:
        pool = gs.pools[step.pool] = torch.cuda.graph_pool_handle()
    ws = gs.workspaces.get(step.phase)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        if ws is not None:
            target.refresh(step.phase, step.bs, step.bs, ws)  # outside the graph, by design
        if recorder is not None:
            recorder.begin()
        # Between capture_begin and capture_end every allocation goes to the
        # pool, so the device's reserved-bytes delta is the pool's growth: a
        # cheap counter instead of a full memory snapshot per step.
        reserved_before = torch.cuda.memory_reserved()
        g.capture_begin(pool=pool)
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
        grown = torch.cuda.memory_reserved() - reserved_before
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


def _in_pool(t: torch.Tensor, gs: GraphSet) -> bool:
    ptr = t.data_ptr()
    return any(a <= ptr < a + s for a, s in pool_segments(gs.pools.values()))
