"""``GraphSet``: the captured graphs of one plan, and their O(1) replay.

The capture loop (:mod:`capture_plan.executor.loop`, which ``capture(plan,
target)`` drives) fills a GraphSet step by step: each graph is added with :meth:`GraphSet.add` the moment it is
captured, and from then on ``replay(phase, n)`` serves it -- a table lookup,
the target's ``refresh`` for a hoisted workspace, the replay, the outputs
sliced to ``n`` requests.

Outputs are held as the plan says: owning tensors ("keep"), or non-owning
views ("view") that let later captures reuse the memory and are valid until
the next replay of any graph in the same pool (``replay_checked`` enforces
that). ``release`` returns the pools' memory without a full garbage
collection (``capture_plan.executor.heap``).

What it does not do: choose anything (the plan did), or check that graphs do
not corrupt each other (``verify`` does).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from capture_plan.schemas.keys import PlanIndex
from capture_plan.schemas.plan import Plan
from capture_plan.schemas.report import CaptureReport

from .dispatch import PadTable, dispatch_name
from .errors import ExecutorError, StaleOutputError
from .exec_update import SharedExecs, SharedGraph
from .heap import collect_young
from .logs import log, rank_tag
from .pool import Window, pool_reserved, pool_segments
from .target import CaptureTarget

__all__ = ["GraphSet", "Captured", "GuardedOutputs", "Fallback", "as_outputs", "dispatch_name", "slice_outputs"]

#: what a background capture does with a batch no captured graph fits yet:
#: "eager" runs ``target.run(phase, n, None)``, "wait" blocks until a graph
#: lands, "raise" raises; a callable ``(phase, n) -> outputs`` is the engine's
#: own eager path.
Fallback = str | Callable[[str, int], object]


def as_outputs(out) -> tuple[torch.Tensor, ...]:
    """What ``CaptureTarget.run`` returned, as a tuple of tensors (a TypeError if it is
    neither); None (a graph that writes into buffers and returns nothing) is ``()``."""
    if out is None:
        return ()
    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in out):
        return tuple(out)
    raise TypeError(f"CaptureTarget.run must return a tensor or a tuple of tensors, got {type(out).__name__}")


def slice_outputs(outputs: tuple[torch.Tensor, ...], rows: tuple[int, ...], n: int) -> tuple[torch.Tensor, ...]:
    """``outputs`` cut to ``n`` requests: output ``i`` to ``n * rows[i]`` rows, or
    whole where ``rows[i]`` is 0 (its rows are not per request: ragged verify slots,
    a buffer the engine cuts itself)."""
    return tuple(t[: n * r] if r else t for t, r in zip(outputs, rows))


@dataclass
class Captured:
    """One captured graph and how its outputs are held.

    ``phase`` is the graph's dispatch name (:func:`dispatch_name`: the plan's
    phase, with the key's labels and the piece number where it has them);
    ``key_phase``, ``labels`` and ``piece`` say what it is in the plan."""

    phase: str
    bs: int
    pool: str
    #: the recorded graph, or (a phase that shares executables) the graph replayed through its group's
    graph: torch.cuda.CUDAGraph | SharedGraph
    outputs: tuple[torch.Tensor, ...]
    held: str  # "keep" | "view"
    #: position in capture order (set by :meth:`GraphSet.add`)
    order: int = 0
    #: per n in 1..bs: outputs sliced to n requests (built once: dispatch stays O(1))
    sliced: list = field(default_factory=list)
    window: Window | None = None
    #: rows per request of each output (0: held whole); None: every output as the first
    rows: tuple[int, ...] | None = None
    #: the plan's phase ("" : ``phase`` itself), the key's (axis, label) pairs, the piece number
    key_phase: str = ""
    labels: tuple[tuple[str, str], ...] = ()
    piece: int | None = None

    @property
    def rows_per_request(self) -> int:
        """Rows of the first output per request (1 for a graph without outputs, or whose first
        output is held whole)."""
        return self.rows[0] if self.rows and self.rows[0] else 1

    @property
    def output_rows(self) -> tuple[int, ...]:
        """Rows per request of each output (``rows``, else every output as the first)."""
        return self.rows or (self.rows_per_request,) * len(self.outputs)


class GuardedOutputs:
    """Outputs of one replay that raise if read after their pool was replayed again."""

    __slots__ = ("_gs", "_pool", "_epoch", "_tensors", "_who")

    def __init__(self, gs: GraphSet, cap: Captured, tensors):
        self._gs, self._pool, self._tensors = gs, cap.pool, tensors
        self._epoch = gs.pool_replays(cap.pool)
        self._who = f"{cap.phase}/{cap.bs}"

    def get(self) -> tuple[torch.Tensor, ...]:
        if self._gs.pool_replays(self._pool) != self._epoch:
            raise StaleOutputError(
                f"outputs of graph {self._who} were overwritten: graph {self._gs.last_replayed(self._pool)} "
                f"replayed in the same pool ({self._pool}) after them",
                where=f"pool {self._pool}",
                fix="consume outputs before the next replay, or plan the phase with outputs=keep or pool=own",
            )
        return self._tensors


def _planned_sizes(plan: Plan) -> dict[str, list[int]]:
    """Per dispatch name (:func:`dispatch_name`) of the plan's graphs, their sizes."""
    index = PlanIndex.of(plan)
    sizes: dict[str, list[int]] = {}
    for s in plan.steps:
        if s.op == "capture":
            labels = index.labels(s) if s.phase in index.phases else ()
            pieces = s.pieces if isinstance(s.pieces, int) else None
            for k in range(pieces) if pieces is not None else (None,):
                sizes.setdefault(dispatch_name(s.phase, labels, k), []).append(s.bs)
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


class BackgroundJob(Protocol):
    """What a GraphSet uses of a background capture serving through it
    (:class:`capture_plan.executor.background.Background`, named here by what it does,
    not imported: that module imports this one)."""

    #: set when the capture thread has ended (every graph captured, failed or stopped)
    finished: threading.Event
    #: set when ``release`` asked the capture thread to stop
    stopping: threading.Event
    #: replays served while capturing: by a graph, by the fallback
    graph_replays: int
    fallback_runs: int
    #: seconds from capture() to the end of the capture thread (None while it runs)
    seconds: float | None

    def replay(self, gs: GraphSet, phase: str, n: int) -> tuple[torch.Tensor, ...]: ...

    def exclusive(self) -> contextlib.AbstractContextManager: ...

    def wait(self, gs: GraphSet, timeout: float | None) -> bool: ...

    def stop_and_join(self) -> None: ...


class GraphSet:
    """The graphs of one plan; ``replay(phase, n)`` is the hot path.

    ``replay`` runs the target's ``refresh`` for a hoisted workspace, then the
    graph of the smallest captured size >= n (a table lookup), and returns
    the outputs sliced to n requests. Outputs held through views are valid
    until the next replay of any graph in the same pool; ``replay_checked``
    returns outputs that enforce that.

    While a background capture runs (``capture(..., background=True)``),
    ``replay`` goes through :class:`capture_plan.executor.background.Background` (a lock and
    two CUDA events more; eager fallback where no graph fits yet); once every
    graph has landed it is the lock-free path again. ``graphs``, ``pools`` and
    ``report`` are complete only after ``wait()``.
    """

    def __init__(
        self,
        plan: Plan | None,
        target: CaptureTarget,
        device: torch.device | None = None,
        *,
        sizes: dict[str, list[int]] | None = None,
    ):
        #: the plan captured (None for graphs an engine captured without one: ``capture_plan.executor.engine.adopt``)
        self.plan = plan
        self.target = target
        #: the device whose pools hold the graphs
        self.device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.graphs: dict[tuple[str, int], Captured] = {}
        self.pools: dict[str, tuple[int, int]] = {}
        self.workspaces: dict[str, torch.Tensor] = {}
        self.report: CaptureReport | None = None
        #: (seconds since capture() was called, phase, bs) of every graph, as it landed
        self.timeline: list[tuple[float, str, int]] = []
        #: the background capture (None for a foreground one); kept after it ends for its numbers
        self.background: BackgroundJob | None = None
        #: what ``restore`` did where it made this set from a graph file
        #: (``capture_plan.executor.graph_restore.RestoreReport``); None for captured graphs
        self.restored: object | None = None
        self._planned = _planned_sizes(plan) if plan is not None else {p: sorted(v) for p, v in (sizes or {}).items()}
        self._tables: dict[str, PadTable] = {p: PadTable(p, {}, limit=v[-1]) for p, v in self._planned.items()}
        #: per dispatch name: the target's refresh and its phase's hoisted workspace (None: no workspace)
        self._refresh: dict[str, tuple[Callable, torch.Tensor] | None] = {}
        self._epoch: dict[str, int] = {}
        self._last: dict[str, str] = {}
        #: set while a background capture runs: replay goes through it
        self._bg: BackgroundJob | None = None
        #: why the tables are empty (released, or the capture failed)
        self._closed = ""
        #: the executables shared by phases the plan has reuse them (None until one does)
        self.shared: SharedExecs | None = None
        self._reuse = (
            frozenset(p.name for p in plan.phases if p.reuse == "exec-update") if plan is not None else frozenset()
        )

    # -- hot path ------------------------------------------------------------
    def replay(self, phase: str, n: int) -> tuple[torch.Tensor, ...]:
        if self._bg is not None:
            return self._bg.replay(self, phase, n)
        try:
            bs, cap = self._tables[phase][n]
        except KeyError:
            raise ExecutorError(
                f"no graphs for phase {phase!r}; captured: {sorted(self._tables)}{self._closed}",
                where="GraphSet.replay",
            ) from None
        refresh = self._refresh[phase]
        if refresh is not None:
            refresh[0](phase, n, bs, refresh[1])
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

    def pool_replays(self, pool: str) -> int:
        """How many replays in ``pool`` were noted (``replay_checked``, ``note_replay``)."""
        return self._epoch[pool]

    def last_replayed(self, pool: str) -> str:
        """``phase/bs`` of the graph replayed last in ``pool`` ("" before any)."""
        return self._last[pool]

    # -- eager reference ---------------------------------------------------
    def eager(self, phase: str, n: int) -> tuple[torch.Tensor, ...]:
        """The target run eagerly at the padded size, sliced like ``replay``."""
        bs, cap = self._tables[phase][n]
        ws = self.workspaces.get(cap.key_phase or cap.phase)
        if ws is not None:
            self.target.refresh(phase, n, bs, ws)
        out = as_outputs(self.target.run(phase, bs, ws))
        return slice_outputs(out, cap.rows or (cap.rows_per_request,) * len(out), n)

    def padded(self, phase: str, n: int) -> int:
        """The captured size a batch of ``n`` replays at (during a background
        capture: at the moment of the call; it only ever gets tighter)."""
        return self._tables[phase].padded(n)

    def table(self, phase: str) -> PadTable:
        """The phase's dispatch table: ``get(n)`` is the (size, graph) a batch
        of ``n`` replays on, ``sizes`` the sizes captured so far (it grows while
        a background capture runs). An ExecutorError for a phase the plan lacks."""
        table = self._tables.get(phase)
        if table is None:
            raise ExecutorError(
                f"no graphs for phase {phase!r}; planned: {sorted(self._tables)}", where="GraphSet.replay"
            )
        return table

    def variant(self, phase: str, *, piece: int | None = None, **labels: str) -> str:
        """The dispatch name of ``phase``'s graphs keyed by ``labels`` (piece
        ``piece`` of a piecewise capture): ``gs.replay(gs.variant("decode",
        lora="nolora"), n)``. With a plan the labels go in the phase's axis order
        (an ExecutorError for a label the phase does not have); without one in
        the order given."""
        pairs = tuple(labels.items())
        if self.plan is not None and labels:
            from capture_plan.schemas.keys import order_labels

            phase_plan = PlanIndex.of(self.plan).phases.get(phase)
            if phase_plan is None:
                raise ExecutorError(f"no phase {phase!r} in the plan", where="GraphSet.variant")
            try:
                pairs = order_labels(phase_plan, labels)
            except ValueError as err:
                raise ExecutorError(str(err), where="GraphSet.variant", fix="pass the phase's labels") from None
        return dispatch_name(phase, pairs, piece)

    def refresh_workspace(self, phase: str, n: int, bs: int) -> None:
        """What ``replay`` does before it launches graph ``phase``/``bs`` for ``n`` requests: the
        target's refresh of the phase's hoisted workspace (nothing without one). For a launch
        of the same graph made otherwise (a rebuilt executable: ``graph_rebuild``)."""
        refresh = self._refresh.get(phase)
        if refresh is not None:
            refresh[0](phase, n, bs, refresh[1])

    def replay_graph(self, phase: str, n: int, bs: int, cap: Captured) -> tuple[torch.Tensor, ...]:
        """What ``replay`` does once its lookup found ``(bs, cap)`` for ``n``:
        refresh a hoisted workspace, replay, outputs sliced to ``n``. For a
        background capture's replays; ``replay`` has these lines inline (one
        call less on the hot path)."""
        refresh = self._refresh[phase]
        if refresh is not None:
            refresh[0](phase, n, bs, refresh[1])
        cap.graph.replay()
        return cap.sliced[n]

    # -- background capture --------------------------------------------------
    def exclusive(self) -> contextlib.AbstractContextManager:
        """While a background capture runs: a block of the engine's own GPU work
        on the target's buffers (eager runs, input writes) that the capture
        thread's warm-ups must not interleave with; ``replay`` may be called
        inside. Otherwise it does nothing."""
        bg = self._bg
        return bg.exclusive() if bg is not None else contextlib.nullcontext()

    def serve_through(self, job: BackgroundJob | None) -> None:
        """Route ``replay`` and ``exclusive`` through a running background
        capture ``job`` (:class:`capture_plan.executor.background.Background`), or back to
        the lock-free path (None: its graphs have landed and its stream is drained)."""
        self._bg = job

    @property
    def lock_free(self) -> bool:
        """``replay`` is the lock-free path: no background capture is running."""
        return self._bg is None

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

        from capture_plan.schemas.codec import canonical_bytes
        from capture_plan.schemas.files import write_atomic

        if self.report is None:
            why = (
                "the capture is still running: wait() first"
                if not self.done
                else "the graphs were not captured by capture()"
            )
            raise ExecutorError(f"no report: {why}", where="GraphSet")
        write_atomic(Path(path), canonical_bytes(self.report))

    # -- executable reuse ----------------------------------------------------
    def reuses(self, phase: str) -> bool:
        """Whether the plan has ``phase``'s graphs share executables (``reuse = "exec-update"``)."""
        return phase in self._reuse

    def share(self, phase: str, name: str, graph: torch.cuda.CUDAGraph) -> torch.cuda.CUDAGraph | SharedGraph:
        """A just-recorded graph of a reuse phase (recorded without its instantiation): the
        graph replayed through its group's executable, or ``graph`` itself, instantiated now,
        where it shares none (the reason goes in the report)."""
        if self.shared is None:
            self.shared = SharedExecs()
        got = self.shared.adopt(phase, name, graph)
        if got is not None:
            return got
        try:
            graph.instantiate()
        except RuntimeError:  # an engine's own graph, recorded without keep_graph: torch instantiated it
            pass
        return graph

    def reuse_report(self):
        """What executable reuse did (``CaptureReport.reuse``); UNSET for a plan without it."""
        import msgspec

        from capture_plan.schemas.report import ExecReuse, ReuseGroup, ReuseRefusal

        if not self._reuse:
            return msgspec.UNSET
        shared = self.shared or SharedExecs()
        graphs = sum(sum(len(m) for _, m in g.groups) + len(g.alone) for g in shared.groups.values())
        return ExecReuse(
            graphs=graphs,
            instantiations=sum(g.instantiations for g in shared.groups.values()),
            groups=[
                ReuseGroup(phase=phase, graphs=list(members))
                for phase, g in sorted(shared.groups.items())
                for _, members in g.groups
            ],
            refusals=[
                ReuseRefusal(graph=name, reason=why)
                for _, g in sorted(shared.groups.items())
                for name, why in g.refusals
            ],
            clusters=shared.clusters,
        )

    # -- bookkeeping -------------------------------------------------------
    def add(self, cap: Captured) -> None:
        """Make a captured graph servable. Order matters for a concurrent
        ``replay``: everything it reads is in place before the table points at it."""
        cap.order = len(self.graphs)
        rows = cap.output_rows
        cap.sliced = [None] + [slice_outputs(cap.outputs, rows, n) for n in range(1, cap.bs + 1)]
        self.graphs[(cap.phase, cap.bs)] = cap
        self._epoch.setdefault(cap.pool, 0)
        self._last.setdefault(cap.pool, "")
        ws = self.workspaces.get(cap.key_phase or cap.phase)  # a key's workspace is its phase's
        self._refresh[cap.phase] = (self.target.refresh, ws) if ws is not None else None
        table = self._tables.get(cap.phase)
        if table is None:
            table = self._tables[cap.phase] = PadTable(cap.phase, {}, limit=cap.bs)
        table.add(cap.bs, cap)

    def release(self, *, reason: str = "") -> None:
        """Drop every graph, output and workspace and return the pools' memory.

        ``reason`` is what a later ``replay`` says about why there are no
        graphs (default: "released").

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
        self._closed = f" ({reason})" if reason else (self._closed or " (released)")
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
        if self.shared is not None:  # the device is done with them
            self.shared.close()
            self.shared = None
        torch.cuda.empty_cache()
        if pools and pool_segments(pools):
            found = collect_young()
            torch.cuda.empty_cache()
            left = pool_reserved(pools)
            if left:
                log.warning(
                    "capture-plan%s: %d B of released graph pools are still held after dropping every "
                    "graph (%d unreachable young objects collected): a tensor outside the GraphSet "
                    "(a kept output?) still uses them",
                    rank_tag(),
                    left,
                    found,
                )
