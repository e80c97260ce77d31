"""``profile(plan, target)``: record real allocation traces for exact predictions.

Captures the plan (by default only three sizes per phase: the smallest, the
median and the largest; the planner derives the others, planner/memory/fitting.py)
once with the allocation history on, then writes, per recorded (phase, size),
the ordered pool allocations and frees of its capture. What a capture
requests does not depend on what was captured before it, so a subset of the
plan's steps records the same events as the whole plan would. Blocks
still alive when the capture ends are classified: an output of ``run`` is
``output``; anything else (cuBLAS's workspace, re-created at each capture) is
``library``. The planner's ``--trace`` (or a spec's ``trace``) consumes it.

Event sizes are the requested bytes of the history's entries (a 4-byte
tensor records 4); the simulator rounds them as the allocator does. The
graphs are released afterwards.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, overload

import msgspec
import torch

from capture_plan.schemas.codec import canonical_bytes
from capture_plan.schemas.files import write_atomic
from capture_plan.schemas.keys import PlanIndex
from capture_plan.schemas.plan import Plan
from capture_plan.schemas.report import CaptureReport
from capture_plan.schemas.trace import CaptureTrace, Event, Trace, default_samples

from .driver import capture
from .graph_nodes import ExecCopies, node_count
from .node_bytes import NodeBytes
from .target import CaptureTarget

__all__ = ["profile", "record", "Recording", "write_trace", "subset_plan"]

Sizes = str | Mapping[str, list]


def _chosen(plan: Plan, sizes: Sizes) -> dict[str, set[int]]:
    if sizes == "all":
        return {p.name: set(p.sizes) for p in plan.phases}
    if sizes == "default":
        return {p.name: set(default_samples(p.sizes)) for p in plan.phases}
    if isinstance(sizes, str):
        raise ValueError(f"sizes must be 'default', 'all' or {{phase: [sizes]}}, got {sizes!r}")
    out = {}
    for p in plan.phases:
        want = set(sizes.get(p.name, default_samples(p.sizes)))
        unknown = want - set(p.sizes)
        if unknown:
            raise ValueError(f"phase {p.name!r} has no planned sizes {sorted(unknown)}; planned: {p.sizes}")
        out[p.name] = want
    unknown_phases = set(sizes) - set(PlanIndex.of(plan).phases)
    if unknown_phases:
        raise ValueError(f"unknown phases {sorted(unknown_phases)}")
    return out


def subset_plan(plan: Plan, sizes: Sizes = "default") -> Plan:
    """``plan`` restricted to the chosen captures, in the planned order.

    Provision steps stay; a warm-up stays when its size is captured or when
    the phase warms up once for all sizes. The digest is the original plan's
    (the subset is never written or loaded as a plan). Executable reuse is taken out:
    the recording instantiates each graph on its own, which is what its driver memory
    per node is measured from, so a start-up prediction of a plan with reuse counts an
    executable per graph (an upper bound where the capture then shares).
    """
    chosen = _chosen(plan, sizes)
    once = {p.name for p in plan.phases if p.strategy.warmup != "every-size"}
    steps = [
        s
        for s in plan.steps
        if s.op == "provision" or s.bs in chosen[s.phase] or (s.op == "warmup" and s.phase in once)
    ]
    index = {s.index: i for i, s in enumerate(steps)}
    timeline = [msgspec.structs.replace(m, step=index[m.step]) for m in plan.predicted.timeline if m.step in index]
    return msgspec.structs.replace(
        plan,
        steps=[msgspec.structs.replace(s, index=i) for i, s in enumerate(steps)],
        phases=[
            msgspec.structs.replace(p, sizes=[b for b in p.sizes if b in chosen[p.name]], reuse=msgspec.UNSET)
            for p in plan.phases
        ],
        predicted=msgspec.structs.replace(plan.predicted, timeline=timeline),
    )


@dataclass(frozen=True)
class Recording:
    """What :func:`record` measured: the trace, the capture report of the recorded
    captures, and the driver memory the recorded graphs' copies took (``instantiate``).

    A recording made with ``background=True`` returns before its copies are made:
    ``copies``, ``settled`` and the "copies" and "release" ``seconds`` are filled in by
    then, and the recorded graphs released, only once :meth:`wait` returns."""

    trace: Trace
    report: CaptureReport | None
    #: per phase: the copies instantiated beside its recorded graphs, their nodes, and the
    #: free memory they took outside the caching allocator (the driver keeps it after they
    #: were destroyed, for the graphs instantiated later in the process)
    copies: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    #: where the time went: "capture" (the recorded captures, their warm-ups included; split
    #: into "capture.warmup", "capture.graphs" and "capture.other" from the report's steps),
    #: "trace" (reading the allocation history), "copies" (the extra instantiations),
    #: "release" (releasing the graphs and pools, filled in as the recording returns)
    seconds: dict[str, float] = field(default_factory=dict)
    #: per phase whose copies stopped before ``instantiate`` asked (``copy_error``): why
    #: (the per-node figure's bounds and the error they leave on the copies not made)
    settled: dict[str, str] = field(default_factory=dict)
    #: the copies still being made (``background``): joined by :meth:`wait`
    _pending: _Background | None = field(default=None, compare=False, repr=False)

    def wait(self) -> Recording:
        """Block until the copies are made and the recorded graphs released (at once for a
        recording made in the foreground); re-raises what the copies raised. Returns self."""
        if self._pending is not None:
            self._pending.join()
        return self


class _Background:
    """The copies made on a thread of their own while the caller goes on (the start-up
    prediction builds its plan from the trace meanwhile: CPU work, no CUDA).

    The instantiations run in the driver with the GIL released (ctypes), so they overlap
    the caller's Python; the interpreter's switch interval is lowered while any copies run
    (and put back when the last of them is joined) so that the copying thread, back from
    each instantiation, gets the GIL within half a millisecond rather than the default 5."""

    #: the switch interval (s) while the copies run: a copy takes milliseconds in the driver
    SWITCH_INTERVAL = 0.0005
    _lock = threading.Lock()
    #: backgrounds started and not joined yet, and the interval the first of them found
    _running = 0
    _saved = 0.0

    def __init__(self, work: Callable[[], None]) -> None:
        self._error: BaseException | None = None
        self._joined = False

        def run() -> None:
            try:
                work()
            except BaseException as err:  # re-raised by join(), on the caller's thread
                self._error = err

        self._thread = threading.Thread(target=run, name="capture-plan-copies", daemon=True)
        self._enter()
        try:
            self._thread.start()
        except BaseException:
            self._leave()
            raise

    @classmethod
    def _enter(cls) -> None:
        with cls._lock:
            if cls._running == 0:
                cls._saved = sys.getswitchinterval()
                sys.setswitchinterval(min(cls._saved, cls.SWITCH_INTERVAL))
            cls._running += 1

    @classmethod
    def _leave(cls) -> None:
        with cls._lock:
            cls._running -= 1
            if cls._running == 0:
                sys.setswitchinterval(cls._saved)

    def join(self) -> None:
        """Wait for the work; re-raises what it raised (every time it is asked)."""
        try:
            self._thread.join()
        finally:
            if not self._joined and not self._thread.is_alive():
                self._joined = True
                self._leave()
        if self._error is not None:
            raise self._error


def record(
    plan: Plan,
    target: CaptureTarget,
    *,
    sizes: Sizes = "default",
    progress: bool = False,
    instantiate: Mapping[str, int] | None = None,
    device: torch.device | None = None,
    copy_error: float | None = None,
    background: bool = False,
) -> Recording:
    """Capture the chosen sizes of ``plan`` with the allocation history on (``sizes`` as
    :func:`profile`'s) and return their trace and report.

    ``instantiate``: per phase, how many graphs should be instantiated in all: the
    phase's recorded graphs are instantiated again (side by side, one thread per graph; in
    turn with ``copy_error``) until the phase has that many, every copy of every phase
    alive at once, then the copies are destroyed
    (``capture_plan.executor.graph_nodes.ExecCopies``). The driver keeps their
    memory for the graphs the process instantiates later, so ``copies[phase]``'s bytes
    measure the driver memory of a capture of that many graphs, taken now. ``device``: as
    ``capture``'s (None: the current CUDA device).

    ``background``: make the copies (and release the recorded graphs) on a thread of
    their own and return as soon as the trace is read: call :meth:`Recording.wait`
    before reading ``copies`` or using the device again (the copies' free-memory figures
    would count anything the caller allocates meanwhile). The copies' figures are the
    same as in the foreground: the thread is the only one using the device.

    ``copy_error``: stop a phase's copies early once its bytes per node are known well
    enough that the copies not made, predicted from the figure so far, would be off by at
    most this many bytes (``capture_plan.executor.node_bytes.NodeBytes.settled``: the
    driver's 2 MiB steps bound each reading; it never settles on readings no single
    per-node figure explains). ``settled`` says which phases stopped and why; the driver
    then holds only the copies made. None: every copy ``instantiate`` asks for."""
    t0 = time.perf_counter()
    gs = capture(subset_plan(plan, sizes), target, progress=progress, record=True, device=device)
    seconds = {"capture": time.perf_counter() - t0, **_step_seconds(gs.report)}
    try:
        t0 = time.perf_counter()
        caps = [_capture_trace(cap) for cap in gs.graphs.values()]
        caps.sort(key=lambda c: (c.phase, c.bs))
        name = gs.report.device if gs.report else ""
        # some kernels' scratch depends on the SM count (torch.topk's: planner/memory/scratch_shapes.py)
        cuda_sms = gs.device.type == "cuda"
        sms = torch.cuda.get_device_properties(gs.device).multi_processor_count if cuda_sms else None
        trace = Trace(
            device=f"{name} / torch {torch.__version__}",
            backend=plan.requires.backend,
            multiprocessors=sms,
            captures=caps,
        )
        seconds["trace"] = time.perf_counter() - t0
    except BaseException:
        gs.release()
        raise
    copies: dict[str, tuple[int, int, int]] = {}
    settled: dict[str, str] = {}

    def finish() -> None:
        t_release = None
        try:
            t0 = time.perf_counter()
            _copy(gs, instantiate or {}, copy_error, copies, settled)
            seconds["copies"] = time.perf_counter() - t0
            t_release = time.perf_counter()
        finally:
            gs.release()
            if t_release is not None:  # the dict the Recording holds: its release is timed too
                seconds["release"] = time.perf_counter() - t_release

    if not background:
        finish()
        pending = None
    else:
        try:
            pending = _Background(finish)
        except BaseException:  # no thread: nothing else will release the graphs
            gs.release()
            raise
    return Recording(trace=trace, report=gs.report, copies=copies, seconds=seconds, settled=settled, _pending=pending)


def _copy(gs, instantiate: Mapping[str, int], copy_error, copies: dict, settled: dict) -> None:
    """Make ``instantiate``'s copies of ``gs``'s recorded graphs (:func:`record`), every
    phase's alive together, then destroy them; fills ``copies`` and ``settled``."""
    held = ExecCopies()
    # the driver API and the free-memory figures act on the current device, which a thread
    # of its own does not share with its caller: make it the capture's
    cuda = gs.device.type == "cuda"
    on_device = torch.cuda.device(gs.device) if cuda else contextlib.nullcontext()
    with on_device:
        try:  # every phase's copies alive together: a destroyed copy would lend its memory to the next
            for phase, want in sorted(instantiate.items()):
                mine = [cap.graph for cap in gs.graphs.values() if cap.phase == phase]
                torch.cuda.synchronize()
                free0, res0 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()

                def taken_now(free0=free0, res0=res0) -> int:
                    torch.cuda.synchronize()
                    return (free0 - torch.cuda.mem_get_info()[0]) - (torch.cuda.memory_reserved() - res0)

                done = None
                if copy_error is not None:
                    done = _settles(phase, want - len(mine), _largest(mine), copy_error, taken_now, settled)
                made, nodes = held.add(mine, want - len(mine), done)
                copies[phase] = (made, nodes, max(0, taken_now()))
        finally:
            held.close()


def _step_seconds(report: CaptureReport | None) -> dict[str, float]:
    """Where the recorded capture's time went, from its report's steps: "capture.warmup"
    (the warm-ups' eager runs), "capture.graphs" (the graphs' captures and instantiations)
    and "capture.other" (the rest: making the stream and pools, the history, the report)."""
    if report is None:
        return {}
    warm = sum(m.seconds for m in report.steps if m.id.startswith("warmup/"))
    graphs = sum(m.seconds for m in report.steps if m.id.startswith("capture/"))
    return {
        "capture.warmup": warm,
        "capture.graphs": graphs,
        "capture.other": max(0.0, report.capture_seconds - warm - graphs),
    }


def _largest(graphs) -> int:
    """The most nodes of one of ``graphs`` (0 where none can be counted)."""
    return max((node_count(g) or 0 for g in graphs), default=0)


def _settles(
    phase: str, want: int, per_copy: int, budget: float, taken_now: Callable[[], int], settled: dict[str, str]
) -> Callable[[int, int], bool] | None:
    """The ``done`` test of a phase's copies (``ExecCopies.add``): after each copy, read
    what the copies took and stop once the ``want - made`` copies left, each at most
    ``per_copy`` nodes, would be predicted within ``budget`` bytes; records the reason in
    ``settled``. None (every copy) where the recorded graphs' nodes cannot be counted."""
    if per_copy <= 0 or want <= 0:
        return None
    bounds = NodeBytes()

    def done(made: int, nodes: int) -> bool:
        bounds.add(nodes, max(0, taken_now()))
        left = (want - made) * per_copy
        if made >= want or not bounds.settled(left, budget):
            return False
        settled[phase] = (
            f"{made} of {want} copies: {bounds.describe()}, so the {want - made} not made "
            f"(at most {left} nodes) are predicted within {bounds.error(left) / 2**20:.2f} MiB"
        )
        return True

    return done


@overload
def profile(
    plan: Plan,
    target: CaptureTarget,
    *,
    sizes: Sizes = "default",
    progress: bool = False,
    with_report: Literal[False] = False,
) -> Trace: ...
@overload
def profile(
    plan: Plan, target: CaptureTarget, *, sizes: Sizes = "default", progress: bool = False, with_report: Literal[True]
) -> tuple[Trace, CaptureReport | None]: ...
def profile(
    plan: Plan, target: CaptureTarget, *, sizes: Sizes = "default", progress: bool = False, with_report: bool = False
) -> Trace | tuple[Trace, CaptureReport | None]:
    """Record the allocation trace of ``plan``'s captures of the chosen sizes.

    ``sizes``: ``"default"`` (smallest, median and largest of each phase),
    ``"all"``, or ``{phase: [sizes]}`` (phases left out get the default).
    ``with_report``: return ``(trace, report)``, the capture report of the
    recorded captures (its device view and per-step device memory measure what
    the graphs take outside the pool: ``capture_plan.adapters.startup``).
    """
    rec = record(plan, target, sizes=sizes, progress=progress)
    return (rec.trace, rec.report) if with_report else rec.trace


def _capture_trace(cap) -> CaptureTrace:
    win = cap.window
    outputs = {t.untyped_storage().data_ptr() for t in cap.outputs}
    alive = {a for a, _ in win.alive_after}
    latest: dict[int, int] = {}  # address -> index of its latest alloc event
    events: list[Event] = []
    ids: dict[int, int] = {}  # live address -> allocation id (ids are never reused)
    next_id = 0
    for op, addr, size in win.events:
        if op == "alloc":
            ids[addr], next_id = next_id, next_id + 1
            latest[addr] = len(events)
            events.append(Event(op="alloc", id=ids[addr], size=size))
        else:
            events.append(Event(op="free", id=ids.pop(addr)))
            latest.pop(addr, None)
    for addr, i in latest.items():
        if addr in alive:
            e = events[i]
            events[i] = Event(op="alloc", id=e.id, size=e.size, kind="output" if addr in outputs else "library")
    return CaptureTrace(phase=cap.phase, bs=cap.bs, events=events)


def write_trace(trace: Trace, path: str | Path) -> None:
    """Write a trace in canonical form, atomically."""
    write_atomic(Path(path), canonical_bytes(trace))
