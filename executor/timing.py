"""Replay time per captured graph: what ``planner sizes`` weighs padding with.

:func:`replay_times` replays every graph of a captured :class:`GraphSet` a few
times and takes the median of each graph's replays, timed with CUDA events on
the current stream; :func:`with_replay_times` puts those figures into the
capture report's capture steps (``StepMeasurement.replay_seconds``), and
:func:`time_replays` does both and keeps the timed report on the set, so that
``GraphSet.write_report`` writes it. ``planner sizes --timing REPORT`` reads
them as the step time of each size (planner/sizes/step_time.py).

A replay here is ``GraphSet.replay(phase, bs)``: the target's ``refresh`` for a
hoisted workspace, then the graph, on whatever the engine's static inputs hold
(the last ``prepare``). That is the time a step of ``bs`` requests takes as a
graph, not as much the time a batch of fewer requests padded to ``bs`` takes
in an engine that shortens the padded rows' work (their sequence lengths).

What it does not do: time eager runs, time anything during a background
capture (it refuses: replays would contend with the capture), or keep outputs
valid: each replay overwrites the outputs a pool's graphs share, so time the
graphs before serving from them.
"""

from __future__ import annotations

import statistics

import msgspec
import torch

from capture_plan.schemas.report import CaptureReport

from .errors import ExecutorError
from .graphs import GraphSet

__all__ = ["replay_times", "with_replay_times", "time_replays"]


def replay_times(graphs: GraphSet, *, runs: int = 20, warmup: int = 3) -> dict[tuple[str, int], float]:
    """The median seconds of one replay of each graph in ``graphs``, per (phase, size).

    Each graph is replayed ``warmup`` times untimed (the first replay of a graph
    uploads it to the device), then ``runs`` times, each between two CUDA events
    and synchronized on, so one replay's time is not mixed with the next one's
    launch. Graphs are timed one after another, in sorted (phase, size) order."""
    if runs < 1 or warmup < 0:
        raise ValueError(f"runs must be >= 1 and warmup >= 0, got runs={runs}, warmup={warmup}")
    if not graphs.done or not graphs.lock_free:
        raise ExecutorError(
            "the capture is still running", where="replay_times", fix="call graphs.wait() first, then time the replays"
        )
    if not graphs.graphs:
        raise ExecutorError(
            "the set holds no graphs (released, or the capture failed)",
            where="replay_times",
            fix="time the graphs of a capture() that succeeded, before release()",
        )
    out: dict[tuple[str, int], float] = {}
    with torch.cuda.device(graphs.device):
        start = torch.cuda.Event(enable_timing=True)  # on the graphs' device, as the replays
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        for phase, bs in sorted(graphs.graphs):
            for _ in range(warmup):
                graphs.replay(phase, bs)
            seconds = []
            for _ in range(runs):
                start.record()
                graphs.replay(phase, bs)
                end.record()
                end.synchronize()
                seconds.append(start.elapsed_time(end) / 1000.0)  # elapsed_time is in milliseconds
            out[(phase, bs)] = statistics.median(seconds)
    return out


def with_replay_times(report: CaptureReport, times: dict[tuple[str, int], float]) -> CaptureReport:
    """``report`` with ``replay_seconds`` set on each capture step that ``times`` has
    a figure for (``times`` keyed by the graphs' dispatch names: a step
    ``capture/PHASE/SIZE[/LABELS]`` is its key's graph, or the sum of its pieces'
    ``...#k``); other steps as they were."""
    from capture_plan.schemas.keys import parse_step_id

    from .graphs import dispatch_name

    steps = []
    for m in report.steps:
        try:
            op, phase, bs, labels = parse_step_id(m.id)
        except ValueError:
            steps.append(m)
            continue
        t = None
        if op == "capture":
            name = dispatch_name(phase, labels)
            t = times.get((name, bs))
            pieces = [v for (n, b), v in times.items() if b == bs and n.rpartition("#")[0] == name]
            if t is None and pieces:
                t = sum(pieces)
        steps.append(msgspec.structs.replace(m, replay_seconds=t) if t is not None else m)
    return msgspec.structs.replace(report, steps=steps)


def time_replays(graphs: GraphSet, *, runs: int = 20, warmup: int = 3) -> CaptureReport:
    """Time every graph's replay (:func:`replay_times`) and put the figures into the
    set's capture report, which ``graphs.write_report(path)`` then writes: the
    report ``planner sizes --timing`` reads. Returns the timed report."""
    if graphs.done and graphs.report is None:
        raise ExecutorError(
            "the set has no capture report (graphs an engine captured itself)",
            where="time_replays",
            fix="capture with capture(plan, target), or use replay_times() for the figures alone",
        )
    times = replay_times(graphs, runs=runs, warmup=warmup)  # refuses a capture still running
    assert graphs.report is not None  # done, and checked above
    timed = graphs.report = with_replay_times(graphs.report, times)
    return timed
