"""``capture(plan, target)``: the plan's own loop over :func:`capture_plan.executor.loop.capture_loop`.

``capture`` is a user of the loop-shaped API like any engine: it iterates the
plan's captures (every graph key: the target's ``run``, ``refresh`` and
``prepare`` get the key's dispatch name, ``decode/lora=nolora``, as their
phase), runs each planned warm-up at its own size inside
``step.warmup(of=...)``, computes a hoisted workspace before recording
(``step.eager()``), records ``target.run`` in ``step.graph()`` and holds the
outputs with ``step.hold()``. So an engine loop adopted onto ``capture_loop``
gets the same pools, per-step figures and dispatch as ``capture()`` by
construction, where it allocates inside ``graph()`` what the target allocates
inside ``run``. :mod:`capture_plan.executor.loop` owns every part of a capture
step, and documents what capture leaves behind and why it does not
synchronize per graph; this module only drives it.

With ``torch.distributed`` initialized the ranks exchange their status before
every plan step (:class:`capture_plan.executor.distributed.StepSync`, on a
gloo side group), so that a failure on one rank fails every rank at the same
step instead of hanging the others in a collective.
"""

from __future__ import annotations

import sys
import time

import torch

from capture_plan.schemas.keys import PlanIndex
from capture_plan.schemas.plan import Plan

from .background import check_options
from .distributed import is_distributed, rank0
from .errors import ExecutorError
from .graphs import Fallback, GraphSet, as_outputs, dispatch_name
from .loop import CaptureLoop
from .pool import in_pools
from .target import CaptureTarget

__all__ = ["capture"]


def _progress(steps, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm  # pyright: ignore[reportMissingModuleSource]  # typeshed has its stubs
    except ImportError:  # progress is a nicety; tqdm is in the executor extra
        return None
    return tqdm(total=len(steps), desc="capture", unit="step", file=sys.stderr, dynamic_ncols=True)


def run_plan(loop: CaptureLoop, target: CaptureTarget) -> None:
    """Every capture of ``loop``'s plan, in plan order, with ``target`` as the model."""
    #: output addresses of each (key, bs)'s last warm-up run
    warm_ptrs: dict[tuple[str, int], list[int]] = {}
    index = loop.cursor.index

    def name(s) -> str:  # the target is called with the key's dispatch name (the phase without labels)
        return dispatch_name(s.phase, index.labels(s))

    for s in loop.plan.steps:
        if s.op != "capture":
            continue  # provision steps run inside loop.step(), warm-ups below
        step = loop.step(s.phase, s.bs, **dict(index.labels(s)))
        ws = step.workspace
        for w in step.planned:
            with step.warmup(of=w):
                for _ in range(max(w.runs, 1)):
                    if ws is not None:
                        target.refresh(name(w), w.bs, w.bs, ws)
                    outs = as_outputs(target.run(name(w), w.bs, ws))
                # bound: the loop runs at least once
                warm_ptrs[(name(w), w.bs)] = [t.data_ptr() for t in outs]  # pyright: ignore[reportPossiblyUnboundVariable]
                del outs  # pyright: ignore[reportPossiblyUnboundVariable]
        if ws is not None:
            with step.eager():  # writes the workspace replays read: ordered against them
                target.refresh(name(s), s.bs, s.bs, ws)  # outside the graph, by design
        with step.graph():
            outs = as_outputs(target.run(name(s), s.bs, ws))
        _check_static_outputs(step.where, warm_ptrs.get((name(s), s.bs)), outs, loop.gs.pools.values())
        step.hold(outs)
        del outs


def refuse_piecewise(plan: Plan) -> None:
    """An ExecutorError naming the first phase of ``plan`` whose graphs are pieces:
    ``target.run`` records one whole graph, and the pieces are the engine's
    piecewise wrappers' to record, through ``capture_loop``."""
    index = PlanIndex.of(plan)
    for p in plan.phases:
        if index.piecewise(p.name):  # the plan records its kind's property (schemas.keys.PlanIndex)
            raise ExecutorError(
                f"phase {p.name!r} is {p.kind!r}: its graphs are pieces between eager attention ops, and capture() "
                "records one whole graph per step through target.run",
                where="capture",
                fix="record the pieces with the engine's piecewise wrappers inside capture_loop(plan) (each piece "
                "in step.graph(), held by step.hold()), or capture the full phases alone with a plan built without it",
            )


def _check_static_outputs(where: str, before: list[int] | None, outs, pools) -> None:
    """An output outside the pool must be the static buffer the warm-up returned."""
    for i, (t, p) in enumerate(zip(outs, before or ())):
        if t.data_ptr() != p and not in_pools(t.data_ptr(), pools):
            raise ExecutorError(
                f"output {i} moved from {p:#x} (warm-up) to {t.data_ptr():#x} (capture) outside the graph pool: "
                "replays would write where the engine does not read",
                where=where,
                fix="return the same static buffer every call, or allocate the output inside run()",
            )


def capture(
    plan: Plan,
    target: CaptureTarget,
    *,
    progress: bool = True,
    record: bool = False,
    device: torch.device | None = None,
    group=None,
    background: bool = False,
    fallback: Fallback = "eager",
) -> GraphSet:
    """Capture ``plan``'s graphs of ``target``; see the module docstring.

    With ``torch.distributed`` initialized, ``group`` (default: the world) is
    the tensor-parallel group whose ranks must agree on the plan and fail
    together (see capture_plan.executor.distributed).

    ``record=True`` keeps each graph's allocation footprint (needed by
    ``verify``'s footprint guard and by ``profile``); it slows capture down.
    On any error every partial graph is released and the pools emptied, and a
    :class:`CaptureFailed` names the step, phase and size.

    ``background=True`` returns the GraphSet at once and captures on a thread
    in plan order; ``replay`` serves from the first graph of each phase on and
    ``fallback`` says what it does before (see :mod:`capture_plan.executor.background` for
    the constraints on the target and the serving thread). Not with
    ``torch.distributed`` nor with ``record=True``.

    Progress and the summary go to the ``capture_plan.executor`` logger
    (rank 0 of ``group`` only; the summary at INFO, per-quarter progress at
    DEBUG, at INFO in the background); ``progress`` adds a tqdm bar on stderr
    in the foreground, on rank 0. Warnings come from every rank, naming it.
    Plans with a piecewise phase are refused (:func:`refuse_piecewise`).
    """
    t_start = time.perf_counter()
    distributed = is_distributed()
    refuse_piecewise(plan)
    check_options(background=background, record=record, fallback=fallback, distributed=distributed)
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    bar = _progress(plan.steps, progress and rank0(group) and not background)
    loop = CaptureLoop(plan, device=device, target=target, record=record, group=group, progress=bar, t_start=t_start)
    if background:
        return loop.start(lambda lp: run_plan(lp, target), fallback=fallback)
    if not distributed:
        with loop:
            run_plan(loop, target)
        return loop.graphs
    from .distributed import StepSync

    sync = StepSync(group)
    loop.on_step = lambda step: sync.before()
    with loop:  # open() checks that the ranks agree on the plan
        try:
            run_plan(loop, target)
        except BaseException as err:  # every rank raises, naming this one's step (Ctrl-C too: none hangs)
            cur = loop.running
            sync.fail(cur.id if cur else "start", cur.index if cur else -1, err)
        sync.before()  # the end: every rank got through
    return loop.graphs
