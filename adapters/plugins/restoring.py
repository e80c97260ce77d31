"""Start-up from a graph file instead of the plan's capture (``CAPTURE_PLAN_GRAPHS=FILE``):
what the engine plugins share, engine-neutral (issue 51).

The setting, with ``CAPTURE_PLAN_PLAN``, is decided once per process, at its first capture
(:func:`start`):

* FILE is there: the plan's graphs are restored from it
  (``capture_plan.executor.graph_restore.restore``) instead of captured. Where the restore
  refuses (another driver, a tensor missing or resized, a piecewise phase, ...: each reason one
  line) or fails, one WARNING names the first reason and the engine captures through the plan
  as it does without the setting. FILE is kept as it is: a file refused once is refused at every
  start-up until it is deleted (the next start-up then writes it again).
* FILE is not there: the engine captures through the plan, then FILE is written for the next
  start-up (:func:`save`), where a restore could take it: a file in which
  ``restore_checks.inspect_refusals`` finds a reason against the plan (a piecewise phase, an
  address outside every segment a restore relocates) is not written, and one WARNING says why.
  A save that fails is that WARNING too, never a failed start-up.

What happened is the start-up's :class:`Outcome` (``adoption.graphs.outcome``) and one INFO
line (or the WARNING).

The seam, through which an engine layer (``sglang.py``; ``vllm_restore.py``) restores instead
of capturing, each a thin layer over the engine's own objects:

1. At its capture hook, after the plan was checked: :func:`start` (None: no graph file). While
   ``start.collecting``, the engine's own capture loop runs, but where it would warm up and
   record a graph key the engine layer calls :meth:`GraphStart.collect` instead: the plan's key
   (dispatch name, size), the engine's own key (SGLang's backend and shape key, vLLM's manager
   and descriptor) and ``run``, the engine's own path to that key (its preparation and forward,
   run eagerly when called). Nothing is warmed up or recorded.
2. Once ``start.complete`` (every plan key collected; for engines whose runners capture one
   after another, in the last runner's capture): :func:`restore_collected`, with the engine's
   tensors by name (:func:`engine_tensors`) and its ranges of memory outside torch's allocator
   (``engine``: name -> (address, bytes), ``engine:NAME`` segments of the file). The restore
   runs ``run`` at a few keys to load the kernels (:class:`EngineRuns`, the restore's target).
   It returns the GraphSet, or None after the one WARNING (the engine layer then captures every
   collected key through the plan).
3. The engine layer hands each restored graph (``gs.graphs[key].graph``: ``replay()``,
   ``reset()``) and its outputs (:func:`outputs`: the engine's structure rebuilt around the
   restored tensors) to wherever the engine keeps them, then calls :func:`restored`.
4. After a capture where FILE was not there: :func:`save`.

Imports neither torch nor an engine until called.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from capture_plan.adapters.plugins.core import Adoption, log

__all__ = [
    "Outcome",
    "GraphStart",
    "EngineRuns",
    "start",
    "plan_key",
    "engine_tensors",
    "restore_collected",
    "not_restored",
    "outputs",
    "restored",
    "drop",
    "save",
    "ENGINE_STREAM",
    "name_recording_stream",
]

#: a graph key as the plan and a GraphSet name it: (dispatch name, size)
Key = tuple[str, int]
#: what a graph file calls the stream an engine records its own graphs on, where that is not
#: the plan's loop's stream (vLLM 0.34 makes one per capture): its cuBLAS workspace is ``engine/0``
ENGINE_STREAM = "engine"


@dataclass
class Outcome:
    """What a start-up did with its graph file: ``what`` "restored" or "captured" (``why``: why
    not restored); ``saved``: the file was written after the capture (``not_saved``: why not,
    where it was to be); the graphs, the seconds the restore took, the free memory it took
    (None: not measured), its ``RestoreReport``."""

    what: Literal["restored", "captured"]
    path: str
    why: str = ""
    saved: bool = False
    not_saved: str = ""
    graphs: int = 0
    seconds: float = 0.0
    took: int | None = None
    report: Any = None

    def line(self) -> str:
        """The plugin's report, one line."""
        if self.what == "restored":
            took = f", {self.took} B of free memory" if self.took is not None else ""
            return f"restored {self.graphs} graphs from {self.path} in {self.seconds:.3f} s{took}, instead of capturing"
        line = f"captured ({self.why})"
        if self.saved:
            line += f"; wrote {self.path} for the next start-up ({self.graphs} graphs)"
        elif self.not_saved:
            line += f"; {self.path} not written: {self.not_saved}"
        return line


@dataclass
class GraphStart:
    """One process's start-up from the graph file at ``path``: ``restore`` (it was there at
    the first capture), the plan's graph keys (``keys``: key -> its pool), what the engine
    layer collected (per key its run and its own key), why the plan can never be restored
    (``unsavable``: its piecewise phases, its tensor-parallel size), the restored set and the
    outcome."""

    path: Path
    restore: bool
    keys: dict[Key, str]
    unsavable: list[str] = field(default_factory=list)
    runs: dict[Key, Callable[[], Any]] = field(default_factory=dict)
    native: dict[Key, Any] = field(default_factory=dict)
    #: per dispatch name: (how many output tensors, the function that rebuilds the engine's structure)
    shapes: dict[str, tuple[int, Callable]] = field(default_factory=dict)
    gs: Any = None
    outcome: Outcome | None = None

    @property
    def collecting(self) -> bool:
        """The engine's loop collects its keys (the file is there, nothing decided yet)."""
        return self.restore and self.outcome is None

    @property
    def restored(self) -> bool:
        """The graphs were restored from the file (and handed to the engine)."""
        return self.outcome is not None and self.outcome.what == "restored"

    @property
    def saving(self) -> bool:
        """The capture's graphs are to be written (the file was not there, the plan can be restored)."""
        return not self.restore and not self.unsavable

    @property
    def complete(self) -> bool:
        """Every graph key of the plan has been collected."""
        return self.keys.keys() <= self.runs.keys()

    def missing(self) -> list[str]:
        return [f"{name}/{bs}" for name, bs in self.keys if (name, bs) not in self.runs]

    def collect(self, key: Key, native: Any, run: Callable[[], Any]) -> None:
        """The engine's graph ``key`` (the plan's), its own key ``native`` and ``run``, its path
        to the key (preparation and forward), instead of its warm-ups and recording."""
        from capture_plan.executor.errors import ExecutorError

        if key not in self.keys:
            raise ExecutorError(
                f"the engine's loop asked for graph {key[0]}/{key[1]}, which the plan does not capture",
                where=f"graph file {self.path}",
                fix="build the plan for the engine's graphs (planner build ... -o PLAN)",
            )
        self.runs[key], self.native[key] = run, native


def plan_key(loop, phase: str, bs: int, labels: Mapping[str, str | None]) -> Key:
    """The plan's key (dispatch name, size) of the engine's graph of ``phase`` at ``bs`` with
    variant ``labels`` (axis -> label; None: no variant), as the loop's ``step`` names it."""
    from capture_plan.executor.dispatch import dispatch_name

    cursor = loop.cursor
    pairs = cursor.pairs(cursor.phase(phase, "restore"), {a: v for a, v in labels.items() if v is not None})
    return dispatch_name(phase, pairs), bs


def start(adoption: Adoption) -> GraphStart | None:
    """The process's start-up from its graph file (module docstring), made at the first call,
    after the plan was loaded and checked (``adoption.plan``); None without ``CAPTURE_PLAN_GRAPHS``
    or where the engine captures as it does (the plan refused, ``CAPTURE_PLAN_FALLBACK=engine``)."""
    s = adoption.graphs
    if s is None and adoption.settings.graphs is not None and adoption.plan is not None and not adoption.fallback:
        from capture_plan.executor.restore_checks import plan_keys, plan_refusals

        plan, path = adoption.plan, adoption.settings.graphs
        unsavable = plan_refusals(plan)
        if plan.requires.tp > 1:  # every rank would write the one file; each refuses it (restore_refusals)
            unsavable.append(
                f"the plan is for TP {plan.requires.tp}: a restore of tensor-parallel graphs is not built (each "
                "rank's communicator memory lies outside torch's allocator)"
            )
        s = adoption.graphs = GraphStart(path, path.is_file(), plan_keys(plan), unsavable)
    return s


class EngineRuns:
    """A restore's target: the engine's own run of each graph key (:meth:`GraphStart.collect`'s
    ``run``), eager or recorded as the restore runs it (``kernel_loading``). The first run of
    each dispatch name keeps the structure of its outputs (``shapes``), so that the restored
    outputs come back as the engine returns them (:func:`outputs`). No ``__dict__``:
    ``graph_env.named_tensors`` walks a target, and this one names nothing (the engine layer
    names the engine's tensors). A phase whose workspace the plan hoists is refused: the engine
    computes its own."""

    __slots__ = ("runs", "shapes", "device")

    def __init__(self, runs: Mapping[Key, Callable[[], Any]], shapes: dict, device):
        self.runs, self.shapes, self.device = runs, shapes, device

    def run(self, phase: str, bs: int, ws):
        from capture_plan.executor.errors import ExecutorError
        from capture_plan.executor.outputs import flatten

        if ws is not None:
            raise self._hoisted(phase, bs)
        run = self.runs.get((phase, bs))
        if run is None:
            raise ExecutorError(f"the engine's loop did not reach graph {phase}/{bs}", where="restore")
        out = run()
        if phase not in self.shapes:
            leaves, rebuild = flatten(out, f"graph {phase}/{bs}", self.device)
            self.shapes[phase] = (len(leaves), rebuild)
            del leaves
        return out

    def refresh(self, phase: str, n: int, bs: int, ws) -> None:
        raise self._hoisted(phase, bs)

    @staticmethod
    def _hoisted(phase: str, bs: int):
        from capture_plan.executor.errors import ExecutorError

        return ExecutorError(
            f"the plan hoists a workspace for graph {phase}/{bs}, which the engine computes itself",
            where="restore",
            fix="build the plan without hoisted workspaces for the engine",
        )


def engine_tensors(roots: Iterable[tuple[str, object]], device) -> dict[str, object]:
    """The engine's tensors on ``device``'s type by name: each root's (``graph_env.named_tensors``,
    its prefix the root's name), the first name found kept. The saving and the restoring start-up
    name them alike where they walk the same objects."""
    import torch

    from capture_plan.executor.graph_env import named_tensors

    found: dict[str, object] = {}
    kind = torch.device(device).type
    for prefix, root in roots:
        for name, t in named_tensors(root, prefix, device_type=kind).items():
            found.setdefault(name, t)
    return found


def _free(device) -> int | None:
    import torch

    try:
        return int(torch.cuda.mem_get_info(device)[0])
    except (RuntimeError, AssertionError):  # no device to ask (a CPU run): not measured
        return None


def restore_collected(
    start: GraphStart,
    plan,
    *,
    tensors: Mapping[str, object],
    engine: Mapping[str, tuple[int, int]],
    device,
):
    """The plan's graphs restored from the start-up's file with the engine's collected runs
    (module docstring, step 2): the GraphSet (``start.gs``), or None after one WARNING naming
    why (refused, or any failure of the restore: nothing of it is left)."""
    import torch

    from capture_plan.executor.errors import RestoreRefused
    from capture_plan.executor.graph_restore import restore
    from capture_plan.schemas.errors import CapturePlanError

    target = EngineRuns(start.runs, start.shapes, device)
    free = _free(device)
    t0 = time.perf_counter()
    gs, why = None, ""
    try:
        gs = restore(plan, target, start.path, device=device, tensors=tensors, engine=engine)
    except Exception as err:  # noqa: BLE001  # the restore let go of what it made: the plan's capture follows
        if isinstance(err, RestoreRefused) and err.where:
            why = f"{err.where}: {err.what}"
        else:
            text = str(err) if isinstance(err, CapturePlanError) else f"{type(err).__name__}: {err}"
            why = f"graph file {start.path}: not restored: {text}"
    if gs is None:
        # after the except block: the error being handled, its frames held the last of what the
        # restore made (a refused layout's segment tensors, its MemPool); gone with it, returned now
        torch.cuda.empty_cache()
        not_restored(start, why)
        return None
    seconds = time.perf_counter() - t0
    after = _free(device)
    took = free - after if free is not None and after is not None else None
    start.gs = gs
    report = gs.restored
    start.outcome = Outcome(
        "restored", str(start.path), graphs=len(gs.graphs), seconds=seconds, took=took, report=report
    )
    return gs


def not_restored(start: GraphStart, why: str) -> None:
    """The one WARNING of a start-up whose file is not restored (``why``: the first reason),
    its outcome "captured"; the engine layer captures through the plan next."""
    log.warning(
        "capture-plan: %s; capturing through the plan instead (%s is kept: delete it for the next start-up to "
        "write it again)",
        why,
        start.path,
    )
    start.outcome = Outcome("captured", str(start.path), why=why)


def outputs(start: GraphStart, key: Key):
    """The restored outputs of graph ``key`` as the engine's run returned them (the structure
    of the first run of its dispatch name, around the restored tensors)."""
    from capture_plan.executor.errors import ExecutorError

    cap = start.gs.graphs[key]
    shape = start.shapes.get(key[0])
    if shape is None or shape[0] != len(cap.outputs):
        have = "no run" if shape is None else f"a run returning {shape[0]} tensors"
        raise ExecutorError(
            f"graph {key[0]}/{key[1]} was saved with {len(cap.outputs)} output tensors, and {have} of its phase here",
            where=f"graph file {start.path}",
        )
    return shape[1](cap.outputs)


def restored(start: GraphStart, who: str) -> None:
    """The restored graphs are the engine's (``who``): the INFO line (the outcome's)."""
    assert start.outcome is not None
    log.info("capture-plan: %s %s", who, start.outcome.line())


def drop(start: GraphStart, err: BaseException) -> None:
    """The restored set could not be handed to the engine (``err``): released, one WARNING,
    and the engine layer captures through the plan next."""
    gs, start.gs = start.gs, None
    if gs is not None:
        gs.release(reason="the engine could not take the restored graphs")
    not_restored(start, f"graph file {start.path}: the engine could not take the restored graphs: {err}")


def name_recording_stream() -> None:
    """The current stream, on which the engine is about to record a graph the start-up saves,
    named :data:`ENGINE_STREAM` (``streams.name_stream``): the file names its cuBLAS
    workspace, which a restore makes again on a stream of its own
    (``streams.workspace_streams``). Without it the graphs point into an unnamed segment, and
    the save is refused (a restore could not relocate it: measured on an H200 with the
    vLLM 0.34-shaped runner)."""
    import torch

    from capture_plan.executor.streams import name_stream

    name_stream(torch.cuda.current_stream(), ENGINE_STREAM)


def save(
    start: GraphStart,
    plan,
    gs,
    *,
    tensors: Mapping[str, object],
    engine: Mapping[str, tuple[int, int]],
    who: str,
) -> None:
    """After a capture through the plan where the file was not there: the captured set ``gs``
    written to the file (``graph_file.save_graphs``, named as :func:`restore_collected` names
    them), where a restore could take it (``inspect_refusals`` against the plan: nothing),
    else one WARNING naming the first reason and nothing written. Never raises."""
    from capture_plan.executor.graph_file import encode, save_graphs
    from capture_plan.executor.restore_checks import inspect_refusals
    from capture_plan.schemas.files import write_atomic

    outcome = start.outcome = Outcome("captured", str(start.path), why=f"{start.path} was not there yet")
    refused = list(start.unsavable)
    if not refused:
        try:
            file = save_graphs(gs, plan, None, None, tensors, engine=engine)
            refused = inspect_refusals(file, plan)
            if not refused:
                write_atomic(start.path, encode(file))
                outcome.saved, outcome.graphs = True, len(file.graphs)
        except Exception as err:  # noqa: BLE001  # the graphs are captured and serve: a save never fails the start-up
            refused = [f"{type(err).__name__}: {err}"]
    if refused:
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        outcome.not_saved = f"a restore would refuse it: {refused[0]}{more}"
        log.warning("capture-plan: %s %s", who, outcome.line())
    else:
        log.info("capture-plan: %s %s", who, outcome.line())
