"""The torch-free side of ``capture_plan.executor.timing``: replay times put into a capture
report's capture steps, and the refusals before any replay (the GPU side: test_gpu_timing.py)."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

pytest.importorskip("torch")

from capture_plan.executor.errors import ExecutorError  # noqa: E402
from capture_plan.executor.timing import replay_times, time_replays, with_replay_times  # noqa: E402
from capture_plan.schemas.report import CaptureReport, StepMeasurement  # noqa: E402
from reports import capture_report  # noqa: E402


def _report() -> CaptureReport:
    ids = ["warmup/decode/8", "capture/decode/8", "capture/decode/4", "provision/verify/8", "capture/verify/8"]
    steps = [
        StepMeasurement(step=i, id=sid, reserved=0, predicted_reserved=0, seconds=0.1) for i, sid in enumerate(ids)
    ]
    return capture_report(None, steps, device="dev", torch="t", backend_module="m")


def test_replay_times_go_to_the_capture_steps_of_their_graphs():
    timed = with_replay_times(_report(), {("decode", 8): 2e-3, ("verify", 8): 5e-3})
    got = {m.id: m.replay_seconds for m in timed.steps}
    assert got == {
        "warmup/decode/8": msgspec.UNSET,  # a warm-up runs no graph
        "capture/decode/8": 2e-3,
        "capture/decode/4": msgspec.UNSET,  # not timed: left out, never 0
        "provision/verify/8": msgspec.UNSET,
        "capture/verify/8": 5e-3,
    }
    assert [m.seconds for m in timed.steps] == [m.seconds for m in _report().steps]


@pytest.mark.parametrize(
    ("graphs", "needle"),
    [
        (SimpleNamespace(done=False, lock_free=False, graphs={}, report=None), "still running"),
        (SimpleNamespace(done=True, lock_free=True, graphs={}, report=_report()), "holds no graphs"),
    ],
)
def test_timing_refuses_a_set_it_cannot_replay(graphs, needle):
    with pytest.raises(ExecutorError, match=needle):
        replay_times(graphs)  # pyright: ignore[reportArgumentType]


def test_time_replays_refuses_graphs_without_a_report():
    graphs = SimpleNamespace(done=True, lock_free=True, graphs={("decode", 1): object()}, report=None)
    with pytest.raises(ExecutorError, match="no capture report"):
        time_replays(graphs)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="runs must be >= 1"):
        replay_times(graphs, runs=0)  # pyright: ignore[reportArgumentType]


def test_a_keyed_step_gets_its_key_s_time_and_a_piecewise_step_its_pieces_sum():
    """Graphs are timed by dispatch name (``decode/lora=nolora``, ``piecewise#k``):
    each capture step of a graph key gets its own graph's time, a piecewise step the
    sum of its pieces' (one forward replays every piece)."""
    from capture_plan.schemas.report import StepMeasurement

    ids = ["capture/decode/8/lora=lora", "capture/decode/8/lora=nolora", "capture/piecewise/8"]
    report = msgspec.structs.replace(
        _report(),
        steps=[
            StepMeasurement(step=i, id=sid, reserved=0, predicted_reserved=0, seconds=0.0) for i, sid in enumerate(ids)
        ],
    )
    times = {
        ("decode/lora=lora", 8): 1e-3,
        ("decode/lora=nolora", 8): 2e-3,
        ("piecewise#0", 8): 3e-3,
        ("piecewise#1", 8): 4e-3,
    }
    got = {m.id: m.replay_seconds for m in with_replay_times(report, times).steps}
    assert got == {ids[0]: 1e-3, ids[1]: 2e-3, ids[2]: pytest.approx(7e-3)}
