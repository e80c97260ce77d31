"""Background capture's threading on CPU: CUDA replaced by a fake whose graphs
re-run the recorded call on replay. Checks the protocol (tables grow, fallbacks,
errors reach the caller with the step, release mid-capture), not CUDA itself:
the GPU tests do that (tests/test_gpu_background.py)."""

from __future__ import annotations

import contextlib
import threading

import pytest

torch = pytest.importorskip("torch")

from fake_cuda import (  # noqa: E402
    FakeStream,
    Target,
    decode_plan as _plan,  # noqa: E402
)


def _capture(plan, target, **kw):
    from capture_plan.executor import capture

    return capture(plan, target, progress=False, background=True, device=torch.device("cpu"), **kw)


def test_foreground_capture_refactored_into_steps_still_works(tmp_path, fake):
    from capture_plan.executor import CaptureFailed, capture

    plan = _plan(tmp_path, [1, 2, 4, 8, 16])
    target = Target(fake)
    gs = capture(plan, target, progress=False, device=torch.device("cpu"))
    assert gs.done and gs.wait() and gs.background is None
    assert fake.modes == ["global"] * 5
    assert [m.id for m in gs.report.steps] == [s.id for s in plan.steps]
    assert gs.progress() == "decode 5/5 [1-16]"
    target.prepare("decode", 3, 16, None)
    (out,) = gs.replay("decode", 3)
    assert out._base.shape[0] == 4 and torch.equal(out, target.x[:3] * 2 + 1)
    gs.release()
    with pytest.raises(CaptureFailed, match=r"capture/decode/4: phase decode, bs 4\).*ValueError: boom"):
        capture(plan, Target(fake, fail_at=4), progress=False, device=torch.device("cpu"))


def test_tables_grow_as_graphs_land_and_replays_equal_eager(tmp_path, fake):
    plan = _plan(tmp_path, [1, 2, 4, 8, 16])
    target = Target(fake, gate_at=4)
    serve = FakeStream(7)
    with torch.cuda.stream(serve):
        gs = _capture(plan, target)
        assert target.reached.wait(30)  # 16 and 8 landed, 4 is recording
        assert gs.padded("decode", 3) == 8 and gs.padded("decode", 9) == 16
        assert gs.progress() == "decode 2/5 [8-16]" and not gs.done
        target.prepare("decode", 5, 16, None)
        with gs.exclusive():
            (out,) = gs.replay("decode", 5)
        assert out.shape[0] == 5 and out._base.shape[0] == 8
        assert torch.equal(out, target.x[:5] * 2 + 1)
        target.gate.set()
        assert gs.wait(30)
    assert gs.done and gs.lock_free and gs.report is not None
    assert fake.modes == ["thread_local"] * 5
    assert [(p, b) for _, p, b in gs.timeline] == [("decode", b) for b in (16, 8, 4, 2, 1)]
    assert gs.padded("decode", 3) == 4 and gs.background.graph_replays == 1
    assert serve.waited and gs.background.served[7].records == 2  # replay + exclusive block
    # the background path reports its device view too, marked as such
    view = gs.report.device_view
    assert view is not None and view.background and {i.name for i in view.items} >= {"pool", "outside-allocator"}
    gs.release()


def test_eager_fallback_before_the_first_graph_and_default_stream_refused(tmp_path, fake):
    from capture_plan.executor import ExecutorError

    plan = _plan(tmp_path, [4, 8, 16])
    target = Target(fake, gate_at=16)
    with torch.cuda.stream(FakeStream(3)):
        gs = _capture(plan, target)
        assert target.reached.wait(30)
        target.prepare("decode", 3, 16, None)
        (out,) = gs.replay("decode", 3)
        assert out._base is None and torch.equal(out, target.x[:3] * 2 + 1)
        assert gs.background.fallback_runs == 1
        with pytest.raises(ExecutorError, match="batch 17 is outside the captured sizes 1..16"):
            gs.replay("decode", 17)
    with pytest.raises(ExecutorError, match="legacy default stream"):
        gs.replay("decode", 3)
    target.gate.set()
    gs.wait(30)
    gs.release()


@contextlib.contextmanager
def _held_at_16(tmp_path, fake, fallback: str):
    """The background capture of sizes 4, 8 and 16 (largest first) with ``fallback``, held
    while it captures 16 (nothing captured yet): the GraphSet and the target that holds it; on
    leaving, let go, waited for and released."""
    plan = _plan(tmp_path, [4, 8, 16])
    target = Target(fake, gate_at=16)
    with torch.cuda.stream(FakeStream(3)):
        gs = _capture(plan, target, fallback=fallback)
        assert target.reached.wait(30)
        yield gs, target
        target.gate.set()
        gs.wait(30)
        gs.release()


def test_raise_and_wait_fallbacks(tmp_path, fake):
    from capture_plan.executor import ExecutorError

    with _held_at_16(tmp_path, fake, "raise") as (gs, _):
        with pytest.raises(ExecutorError, match="batch 3 has no captured graph yet"):
            gs.replay("decode", 3)

    got = []

    def waiter(gs):
        with torch.cuda.stream(FakeStream(4)):
            got.append(gs.replay("decode", 3))

    with _held_at_16(tmp_path, fake, "wait") as (gs, target):
        t = threading.Thread(target=waiter, args=(gs,))
        t.start()
        t.join(0.3)
        assert t.is_alive() and not got
        target.gate.set()
        t.join(30)
        assert got and got[0][0]._base is not None


def test_error_reaches_the_next_replay_then_wait_with_the_step(tmp_path, fake):
    from capture_plan.executor import CaptureFailed, ExecutorError

    plan = _plan(tmp_path, [1, 2, 4, 8, 16])
    target = Target(fake, fail_at=4, gate_at=4)
    with torch.cuda.stream(FakeStream(3)):
        gs = _capture(plan, target)
        assert target.reached.wait(30)
        gs.replay("decode", 2)  # served by graph 8
        target.gate.set()
        gs.background.finished.wait(30)
        with pytest.raises(CaptureFailed, match=r"capture/decode/4: phase decode, bs 4\).*ValueError: boom"):
            gs.replay("decode", 2)
        assert gs.graphs == {} and gs.pools == {}
        with pytest.raises(ExecutorError, match="failed at capture/decode/4"):
            gs.replay("decode", 2)
        with pytest.raises(CaptureFailed, match="capture/decode/4"):
            gs.wait()


def test_release_mid_capture_stops_after_the_current_step(tmp_path, fake):
    plan = _plan(tmp_path, list(range(1, 17)))
    target = Target(fake, gate_at=12)
    with torch.cuda.stream(FakeStream(3)):
        gs = _capture(plan, target)
        assert target.reached.wait(30)
        stopper = threading.Thread(target=gs.release)
        stopper.start()
        gs.background.stopping.wait(30)
        target.gate.set()
        stopper.join(30)
    assert not stopper.is_alive() and not gs.background.thread.is_alive()
    assert gs.graphs == {} and gs.progress() == "decode 0/16"
    assert [b for _, _, b in gs.timeline] == [16, 15, 14, 13, 12]  # nothing after the step it was in
    assert gs.report is None and gs.done
    from capture_plan.executor import ExecutorError

    with pytest.raises(ExecutorError, match="released before its capture finished"):
        gs.wait()


def test_background_refuses_record_and_unknown_fallback(tmp_path, fake):
    from capture_plan.executor import ExecutorError

    plan = _plan(tmp_path, [1, 2])
    with pytest.raises(ExecutorError, match="record=True cannot be combined with background=True"):
        _capture(plan, Target(fake), record=True)
    with pytest.raises(ExecutorError, match="unknown fallback 'later'"):
        _capture(plan, Target(fake), fallback="later")


def test_blocking_calls_inside_exclusive_are_refused_not_deadlocked(tmp_path, fake):
    from capture_plan.executor import ExecutorError

    with _held_at_16(tmp_path, fake, "wait") as (gs, _):
        with gs.exclusive():
            with pytest.raises(ExecutorError, match="fallback='wait' inside exclusive"):
                gs.replay("decode", 3)
            with pytest.raises(ExecutorError, match=r"release\(\) inside exclusive"):
                gs.release()


def test_capture_and_release_never_run_a_full_collection(tmp_path, fake, monkeypatch):
    import gc

    real, calls = gc.collect, []

    def spy(generation=2):
        calls.append(generation)
        return real(generation)

    monkeypatch.setattr(gc, "collect", spy)
    plan = _plan(tmp_path, [1, 2, 4, 8, 16])
    with torch.cuda.stream(FakeStream(3)):
        gs = _capture(plan, Target(fake))
        assert gs.wait(30)
    gs.release()
    assert 2 not in calls, calls
    assert gc.get_freeze_count() == 0  # the heap was thawed by the capture thread


def test_a_busy_serving_loop_does_not_starve_the_capture_thread(tmp_path, fake):
    """The serving side takes the lock for every replay; the capture thread's
    warm-up needs it too and must get it although the loop never pauses."""
    plan = _plan(tmp_path, [1, 2, 4, 8, 16])
    target = Target(fake)
    spins = 0
    with torch.cuda.stream(FakeStream(3)):
        gs = _capture(plan, target)
        while not gs.done and spins < 200_000:
            with gs.exclusive():
                gs.replay("decode", 3)
            spins += 1
    assert gs.done, f"capture still running after {spins} replays"
    assert gs.wait(30)
    gs.release()
