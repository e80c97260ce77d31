"""``predict_startup``: what the whole capture will take, measured on the engine's own model.

One call an engine makes after loading its weights (and its eager profiling
run) and before it allocates its KV cache::

    from capture_plan.adapters.startup import predict_startup
    from capture_plan.planner import BuildOptions

    pred = predict_startup(target, BuildOptions(backend="fa3", ci=True),
                           cache=folder, model_key=key)   # cache: optional, see below
    free, _ = torch.cuda.mem_get_info()
    kv_bytes = free - pred.pending_bytes - margin   # the engine's own margin
    ... allocate the KV cache ...
    graphs = capture_plan.executor.capture(pred.plan, target)
    confirm_startup(pred, graphs.report)   # drops a cache entry the capture contradicts

It builds the plan (analytic, for the schedule), records a few sizes per
phase of the target (``capture_plan.executor.profiling.record``, default 3: the
smallest, median and largest), plans again from that trace
(``planner/memory/fitting.py`` derives every other size exactly; a phase whose
recorded sizes do not line up is recorded again with the sizes the fitter
names, never guessed), and adds what the recording measured outside the pool:
the capture stream's cuBLAS workspace, other allocator memory (the RNG state's
segment, made at the first capture), and the driver memory of the graphs.

The driver memory is measured for the whole plan, not extrapolated: the
recorded graphs are instantiated again until each phase has as many
as the plan captures, every copy alive at once, then destroyed. Measured on an
H200: the driver takes a graph's memory at instantiation (2,748 to 3,029 bytes
a node, by model, in 2 MiB steps) and keeps it after the graph is destroyed,
for the graphs instantiated later, so that memory is taken now and the capture
reuses it. The bytes per node of each phase come from it, and each planned
graph's node count from the recorded ones (``planner/memory/device.py``: linear
between recorded sizes).
The copies are made on a thread of their own while the plan is built from the recorded
trace (CPU work: the instantiations run in the driver with the GIL released), a phase's
copies on one thread per recorded graph (``ExecCopies``: the driver instantiates different
graphs side by side), and awaited before anything reads the device again. Every copy is
made by default. A phase's copies can be stopped early (``copy_error``, off by default:
None) once every reading so far bounds its bytes per node so that the copies not made
would be predicted within that budget (``capture_plan.executor.node_bytes``);
``shortcuts`` says why. Off because it does not hold on the device: on an H200 the
reference's copies stopped after 15 of 33 at a 1 MiB budget and 7 of the capture's 37
steps then fell outside 1% or 2 MiB (bench/results/device-2026-12-04-startup-split.json):
a graph's driver memory lands in 2 MiB steps at its own instantiation, so the copies not
made shift every later step, not only the total.

``total_bytes`` is what the whole capture takes from free memory in a process
that has captured nothing yet; ``pending_bytes`` what it will still take from
free memory now, at its peak (a warm-up's temporaries on top of the pools
captured before it): the pools, the allocator memory outside them that the
recording returned and the capture takes again (measured: the RNG state's
segment on an H200, not a buffer the model made once and keeps), and any
driver memory beyond what is held already. The KV cache: free memory minus the weights (already
allocated) minus ``pending_bytes`` minus the engine's own margin.

Accuracy, measured on an H200 for seven models (bench/device_bench.py,
docs/measurements.md): the peak, the figure after capture and the
whole-capture figure within 2 MiB of what the capture then took.
Time of a start-up that records, on the same H200, with the engine's checked-in plan as
``schedule``: docs/measurements.md, "The first prediction's cost" (generated from the
bench's JSON). Its floor is three recorded captures per phase (``torch.topk``'s scratch is
a basis of the fitter: ``planner/memory/scratch_shapes.py``) and one instantiation of every
planned graph's worth of nodes (the driver memory measured whole, on its own thread beside
the build from the trace). ``timings`` says where each prediction's went.

With ``cache`` (a folder) and ``model_key``, what a start-up measured is kept
(``capture_plan.adapters.calibration_cache``: keyed by the model, device, driver,
torch, backend, spec, schedule and capture-plan) and a later start-up of the same
key reads it instead of recording: 0.014 to 0.070 s on the H200, 1.6% to 5.7% of
the capture after it (docs/measurements.md). Its figures are a fresh process's
(the driver holds no graph memory yet); it makes and primes the capture stream
and empties the cache, as a recording would. :func:`confirm_startup` compares the
capture with the prediction and removes an entry the capture contradicts.

Side effects on the process: the caching allocator's cache is emptied (the
recording's release empties it anyway: the engine's cached free blocks go back
to the driver), and the driver keeps the graph copies' memory for the capture.

Layering: this module imports the planner and the executor; neither imports
it. The executor stays torch-only for an engine that takes a checked-in plan.

What it does not do: predict for another process or device, or for memory
the engine allocates itself meanwhile; capture (the caller does, with
``pred.plan``, which is the schedule the prediction simulated).
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import msgspec
import torch

from capture_plan.adapters.calibration_cache import CalibrationCache, calibration_key
from capture_plan.adapters.startup_check import StartupCheck, confirm_startup, measured_peak
from capture_plan.adapters.startup_figures import (
    StartupPrediction,
    _driver,
    _Figures,
    _figures,
    captures_per_phase,
    copy_budget,
)
from capture_plan.executor import write_trace
from capture_plan.executor.profiling import record
from capture_plan.executor.streams import capture_stream, prime_stream
from capture_plan.planner import BuildOptions, build_plan
from capture_plan.planner.build import build_spec
from capture_plan.planner.memory.core import core
from capture_plan.planner.memory.device import calibration_from_report
from capture_plan.schemas.errors import InputError, RecordMoreError
from capture_plan.schemas.keys import PlanIndex
from capture_plan.schemas.plan import Plan
from capture_plan.schemas.spec import Spec
from capture_plan.schemas.startup import StartupCalibration
from capture_plan.schemas.trace import default_samples

#: the start-up prediction's public face: engines import these from here (docs/executor.md); the
#: result type and the check live in startup_figures and startup_check
__all__ = ["StartupPrediction", "StartupCheck", "predict_startup", "confirm_startup", "measured_peak"]

log = logging.getLogger("capture_plan.startup")


def predict_startup(
    target,
    options: BuildOptions,
    *,
    schedule: Plan | None = None,
    sizes: dict[str, list[int]] | None = None,
    device=None,
    progress: bool = False,
    max_rounds: int = 4,
    cache: str | Path | None = None,
    model_key: str | None = None,
    copy_error: float | None = None,
) -> StartupPrediction:
    """Record a few sizes of ``target``, plan from them and return what capture will take.

    ``options``: the build the engine would run (``planner build``'s options;
    its ``trace`` is replaced by the recording). ``schedule``: the plan the
    recording follows (its phases, sizes and capture steps), e.g. the engine's
    checked-in plan of the same build; default: built from ``options`` without a
    trace (the analytic build: 0.04 s for a decode plan, 1.7 s for EAGLE's four
    phases on a CPU), and refused when its phases are not the build's.
    ``sizes``: sizes to record per phase instead of the default three (phases
    left out get the default).

    ``cache``: a folder of start-up calibrations
    (:mod:`capture_plan.adapters.calibration_cache`). With one, ``model_key``
    (the engine's name for its model code, config and dtype) is required; a
    calibration measured for the same key is read instead of recording (no graph is
    captured: the capture stream is made and primed, as a recording would), and one
    this start-up records is written there (only in a process that had captured
    nothing before: the driver reuses released graphs' memory, so its figures would
    not be a fresh process's; a failed write is logged, never raised). Call
    :func:`confirm_startup` with the capture's report: it removes an entry the
    capture contradicts.

    ``copy_error``: the bytes by which the driver memory of the copies not made may be
    off: the phase's copies stop once its bytes per node are bounded that well
    (``capture_plan.executor.node_bytes``; the reason is in ``shortcuts``); the capture
    then takes the rest of the driver memory, as predicted. Only where one phase needs
    copies (:func:`copy_budget`; a refusal's reason is in ``shortcuts["copies"]``). None,
    the default: every copy the plan's captures need (the figure measured whole; a budget
    was measured to leave steps outside 1% or 2 MiB: this module's docstring).
    """
    t0 = time.perf_counter()
    timings: defaultdict[str, float] = defaultdict(float)
    device = torch.device(device) if device is not None else None  # None: the current CUDA device
    spec = None  # the options' spec, read once for the schedule's check and the cache's key
    if schedule is None:
        schedule = build_plan(msgspec.structs.replace(options, trace=None))
    else:
        spec = build_spec(options)
        _check_schedule(schedule, options, spec)
    timings["schedule"] += time.perf_counter() - t0
    store, key = None, None
    if cache is not None:
        t = time.perf_counter()
        store = CalibrationCache(cache)
        key = calibration_key(model_key or "", schedule, options, device, spec=spec)
        entry = store.load(key)
        timings["cache"] += time.perf_counter() - t
        if entry is not None:
            log.info("start-up calibration read from %s (measured on %s)", store.path(key), entry.device)
            made = _as_recorded(device)
            # nothing was recorded, so the driver holds no graph memory yet; of the allocator
            # memory the recording held, the capture stream's workspace was made just now, and
            # the capture makes the rest (what the target makes and keeps: 1 MiB for Qwen2)
            t = time.perf_counter()
            early = max(0, entry.stream_workspace - made)
            figures = _figures(entry, held=0, early=early, late=entry.allocator_other)
            timings["predict"] += time.perf_counter() - t
            return _result(entry, figures, t0, timings, "cache", store.path(key))
    with tempfile.TemporaryDirectory(prefix="capture-plan-startup-") as folder:
        plan, rounds, chosen, copies, kept, refused = _record_and_build(
            target, options, schedule, sizes, device, progress, max_rounds, Path(folder), timings, copy_error
        )
    t_predict = time.perf_counter()
    kinds = PlanIndex.of(plan).kinds
    cals = [calibration_from_report(rep, "the startup recording", kinds) for rep in rounds]
    view = rounds[0].device_view
    assert view is not None  # calibration_from_report refuses a report without one
    # Allocator memory outside the pools the capture will take again: what the recording grew
    # outside them (the capture stream's workspace, the RNG state's segment, what the target
    # made) less what it left reserved (the workspace is kept for the process's life; on an
    # H200 the RNG segment is returned when the graphs are released, but a Qwen2-MoE model
    # kept its 2 MiB; measured, not assumed)
    workspace = max(0, view.item("allocator-held"))
    cached = max(0, view.item("allocator-cached"))
    grown = workspace + cached
    # a target that freed memory it held before the recording reads as less kept: never more
    # than the recording grew
    fixed_now = min(grown, max(0, grown - max(0, kept)))
    assert copies is not None  # the first round's recording
    driver, held, how = _driver(plan, cals, copies)
    entry = StartupCalibration(
        key=key or {},
        plan=plan,
        recorded={n: list(v) for n, v in sorted(chosen.items())},
        stream_workspace=workspace,
        allocator_other=cached,
        driver=driver,
        # no node counts (a torch without keep_graph, no libcuda): per graph, every graph's
        # memory counted as pending (on the safe side: the driver holds the recorded graphs' already)
        graph_exec_per_graph={} if driver is not None else dict(cals[0].graph_exec_per_graph),
        warmup_scratch=dict(cals[0].warmup_scratch),
        graph_exec=how if driver is not None else "per graph, as the recorded graphs measured it (2 MiB steps)",
        device=cals[0].device,
    )
    # The driver keeps the memory of the recorded graphs, destroyed since, for the graphs to
    # come: it is not taken again. The allocator memory taken again rides on the figures from
    # the first capture on (a warm-up before it does not have it).
    figures = _figures(entry, held=held, early=0, late=fixed_now)
    timings["predict"] += time.perf_counter() - t_predict
    path = None
    if store is not None and key is not None:
        if not view.first_in_process:
            # the driver reused the memory of graphs this process captured and released
            # before: the recording's driver figures are not a fresh process's
            log.info("start-up calibration not written: this process had captured graphs before the recording")
        else:
            path = store.store(entry)
    shortcuts = {f"copies:{k}": v for k, v in sorted(copies.settled.items())}
    if refused:
        shortcuts["copies"] = refused
    return _result(entry, figures, t0, timings, "recorded", path, shortcuts)


def _result(
    entry: StartupCalibration,
    figures: _Figures,
    t0: float,
    timings: dict[str, float],
    source: str,
    path: Path | None,
    shortcuts: dict[str, str] | None = None,
) -> StartupPrediction:
    return StartupPrediction(
        plan=entry.plan,
        total_bytes=figures.total,
        pending_bytes=figures.pending,
        final_bytes=figures.final,
        items=figures.items,
        recorded={n: list(v) for n, v in entry.recorded.items()},
        seconds=time.perf_counter() - t0,
        timeline=figures.timeline,
        graph_exec=entry.graph_exec,
        timings={k: round(v, 4) for k, v in timings.items()},
        source=source,
        cache_path=path,
        calibration=entry,
        shortcuts=dict(shortcuts or {}),
        allocator_core=core().describe() if source == "recorded" else "",
    )


def _record_and_build(
    target, options, schedule, sizes, device, progress, max_rounds, folder: Path, timings, copy_error=None
):
    """Recording rounds until the fitter has what it needs: (the plan built from the last
    round's trace, every round's report, the sizes recorded per phase, the first recording,
    and the caching allocator's memory that recording left reserved after it released its
    graphs and emptied the cache: the capture stream's workspace, a buffer the target made
    and keeps, a segment still in use)."""
    want = {p.name: sorted(set((sizes or {}).get(p.name, []))) for p in schedule.phases}
    rounds: list = []
    counts = captures_per_phase(schedule)
    copies, kept, last, refused, budget = None, 0, None, "", None
    plan: Plan | None = None
    for _ in range(max_rounds):
        chosen = {p.name: want[p.name] or default_samples(p.sizes) for p in schedule.phases}
        first = not rounds
        if first:
            budget, refused = copy_budget(counts, captures_per_phase(schedule, chosen), copy_error)
        # The first round instantiates its graphs again until each phase has as many as the
        # plan captures: the driver memory the capture will need is measured, and taken now
        # (the driver keeps it for the graphs to come).
        t = time.perf_counter()
        reserved = _reserved_emptied(device) if first else 0
        # The first round's copies are made on a thread of their own while the plan is built
        # from its trace (CPU only): the instantiations run in the driver, the build in Python
        rec = record(
            schedule,
            target,
            sizes=chosen,
            progress=progress,
            instantiate=counts if first else None,
            device=device,
            copy_error=budget if first else None,
            background=first,
        )
        more: RecordMoreError | None = None
        done = False
        try:  # from here on the copies are awaited whatever happens
            timings["record"] += time.perf_counter() - t
            trace, report = rec.trace, rec.report
            # The first round's report measures what a fresh process pays: later rounds find the
            # capture stream's workspace made and the driver holding the earlier graphs' memory.
            assert report is not None  # a foreground capture has its report once capture() returns
            rounds.append(report)
            if first:
                copies = rec
            trace_path = folder / "trace.json"
            t = time.perf_counter()
            write_trace(trace, trace_path)
            timings["write"] += time.perf_counter() - t
            t = time.perf_counter()
            try:
                plan = build_plan(msgspec.structs.replace(options, trace=trace_path))
            except RecordMoreError as err:
                more = err
            timings["build"] += time.perf_counter() - t
            done = True
        finally:
            if first:  # the copies done and the recorded graphs released before anything else uses the device
                t_wait = time.perf_counter()
                try:
                    rec.wait()
                except Exception:
                    if done:
                        raise
                    # the build's own error is the one to see; the copies' is logged with it
                    log.exception("start-up prediction: the graph copies failed too")
                timings["record.copies.waited"] += time.perf_counter() - t_wait
                # what the first recording left reserved once it released its graphs (and emptied the cache)
                kept = _reserved_emptied(device) - reserved
            for part, spent in rec.seconds.items():
                timings[f"record.{part}"] += spent
        if more is None:
            break
        # the fitter names the sizes to record
        last, name = more, more.phase
        if name not in chosen:  # a phase the schedule does not have: not the build's schedule
            raise more
        grown = sorted(set(chosen[name]) | set(more.sizes))
        if grown == chosen[name]:  # the fitter asks for what was recorded: record the whole phase
            grown = sorted(PlanIndex.of(schedule).phase(name).sizes)
            if grown == chosen[name]:
                raise more
        want[name] = grown
    else:
        phase = last.phase if last is not None else "?"
        raise InputError(
            f"phase {phase!r}: the recorded sizes did not give every planned size after {max_rounds} rounds "
            f"({last.what if last is not None else ''})",
            where="predict_startup",
            fix=f"pass sizes={{{phase!r}: [...]}} with every planned size of that phase, or more max_rounds",
        ) from last
    assert plan is not None  # the loop breaks only once a plan is built
    return plan, rounds, chosen, copies, kept, refused


def _as_recorded(device) -> int:
    """Leave the process as a recording would have, without recording: the executor's
    capture stream made and primed, the caching allocator's cache emptied. Returns the
    bytes the priming added to the allocator's reserved memory (the capture stream's
    cuBLAS workspace; 0 off CUDA, the tests' fake, or where the stream was primed before).

    A process's first stream besides the default one makes torch's pool of streams (70 MiB
    of free memory outside the caching allocator on an H200), and its first GEMM
    initializes cuBLAS (66 MiB) before the capture stream's workspace is made (32 MiB;
    ``capture_plan.executor.streams.prime_stream``). The capture report sees neither of the
    first two (the capture makes its stream before it reads free memory, and an engine's
    eager run has made GEMMs), and the engine must find all three gone before it sizes
    its KV cache, not during the capture. The cache is emptied as the recording's release
    empties it (the calibration's figures are of a capture that starts with it empty).
    A stream primed before (a second prediction in one process) reads as 0 made, and the
    workspace is then counted as still to take: on the safe side."""
    if device is not None and device.type != "cuda":
        return 0
    dev = device if device is not None else torch.device("cuda", torch.cuda.current_device())
    before = _reserved_emptied(dev)
    prime_stream(dev, capture_stream(dev))
    return max(0, _reserved_emptied(dev) - before)


def _reserved_emptied(device) -> int:
    """The caching allocator's reserved bytes on ``device`` once its cache is emptied: what
    live tensors hold. The recording's release empties the cache (the engine's cached
    blocks too), so both ends of the measurement are taken emptied."""
    if device is not None and device.type != "cuda":  # a recording off CUDA (tests' fake): nothing cached
        return 0
    with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved(device)


def _check_schedule(schedule: Plan, options: BuildOptions, spec: Spec) -> None:
    """Refuse a schedule that is not of the build ``options`` name (another backend, other
    phases or sizes): its recording could not give that build's captures. ``spec``: the
    options' spec (``build_spec(options)``)."""
    theirs = {p.name: sorted(p.sizes) for p in schedule.phases}
    ours = {p.name: sorted(p.sizes) for p in spec.phases}
    if schedule.requires.backend != options.backend or theirs != ours:

        def named(backend: str, phases: dict[str, list[int]]) -> str:
            return f"{backend}: " + ", ".join(f"{n} ({len(v)} sizes)" for n, v in phases.items())

        raise InputError(
            f"the schedule {schedule.name!r} is {named(schedule.requires.backend, theirs)}; the build from "
            f"these options is {named(options.backend, ours)}",
            where="predict_startup(schedule=...)",
            fix="pass the plan built with these options (planner build), or no schedule",
        )
