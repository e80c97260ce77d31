"""Background capture on a real GPU (marked ``gpu``; skipped where CUDA is absent).

Run on the device: ``python -m pytest -m gpu -q tests/test_gpu_background.py``.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

import pytest

from test_gpu_executor import _plan, small_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model():
    return small_model()


def _padded_to(out, n: int, rows: int) -> int:
    """The size a replay ran at: its outputs are views of the graph's bs-row
    outputs (an eager fallback's are not views: it ran at n)."""
    base = out._base
    return n if base is None else base.shape[0] // rows


def _serving_stream():
    """A stream of its own with cuBLAS already used on it (as capture() does for
    the calling thread): its workspace is then allocated before ``before``."""
    import torch

    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        a = torch.ones(16, 16, device="cuda")
        for t in (a, a.bfloat16()):
            torch.addmm(t, t, t)
            t @ t
    torch.cuda.synchronize()
    return s


@contextlib.contextmanager
def _serving(target=None):
    """The block runs on a fresh :func:`_serving_stream`, after the cache is
    emptied and ``target`` (if given) ran eagerly there once at batch 2, as a
    server does before it captures. Yields ``(stream, reserved bytes before that
    run)``: the stream for other threads, the bytes for :func:`_left_over`."""
    import torch

    from gpu_targets import prime_capture_stream

    serve = _serving_stream()
    with tempfile.TemporaryDirectory() as tmp:  # the capture stream's cuBLAS workspace stays, on purpose
        prime_capture_stream(Path(tmp), background=True)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    with torch.cuda.stream(serve):
        if target is not None:
            target.run("decode", 2, None)
        yield serve, before


def _left_over(before: int) -> list:
    """Segments beyond what was reserved before (empty: everything was returned)."""
    import torch

    torch.cuda.synchronize()
    if torch.cuda.memory_reserved() <= before:
        return []
    return [(tuple(s["segment_pool_id"]), s["total_size"], s["allocated_size"]) for s in torch.cuda.memory_snapshot()]


def test_replays_during_capture_equal_eager_pool_unchanged_verify_clean(tmp_path, model):
    import random

    import torch

    from capture_plan.executor import capture, verify

    plan = _plan(tmp_path, list(range(1, 65)), phases=("decode", "target_verify"))
    rows = {"decode": 1, "target_verify": 4}
    fg = capture(plan, model, progress=False)
    fg_steps = [(m.id, m.reserved) for m in fg.report.steps]
    fg_pool = fg.report.pool_bytes
    fg.release()

    serve = _serving_stream()
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    rng = random.Random(0)
    bad, by_graph, eager = [], 0, 0
    with torch.cuda.stream(serve):
        for phase in rows:  # cuBLAS and FA3 on the serving stream before the capture starts
            model.run(phase, 4, None)
        gs = capture(plan, model, progress=False, background=True)
        while not gs.done:
            phase = rng.choice(tuple(rows))
            n = rng.randint(1, 64)
            # the whole check in one exclusive block: no warm-up of the capture
            # thread between the replay and its eager reference
            with gs.exclusive():
                model.prepare(phase, n, 64, gen)
                res = gs.replay(phase, n)
                bs = _padded_to(res[0], n, rows[phase])
                got = tuple(t.clone() for t in res)
                ref = model.run(phase, bs, None)[: n * rows[phase]]
                if not torch.equal(got[0], ref):
                    bad.append((phase, n, bs))
            by_graph += res[0]._base is not None
            eager += res[0]._base is None
            del res, got, ref
        assert gs.wait(timeout=600)
    assert by_graph > 0, "no replay was served by a graph during the capture"
    assert not bad, bad[:10]
    # The last replays may race the end of the capture: the thread switches replays
    # to the lock-free path (not counted as served during the capture) just before
    # `done` turns true, so the loop can make replays in between; never a fallback.
    assert gs.background.fallback_runs == eager
    assert 0 <= by_graph - gs.background.graph_replays, (gs.background.graph_replays, by_graph)
    try:
        # the same pool, step by step, as the foreground capture
        assert [(m.id, m.reserved) for m in gs.report.steps] == fg_steps
        assert gs.report.pool_bytes == fg_pool
        assert [(p, b) for _, p, b in gs.timeline] == [(s.phase, s.bs) for s in plan.steps if s.op == "capture"]
        assert set(gs.progress().split("; ")) == {"decode 64/64 [1-64]", "target_verify 64/64 [1-64]"}
        res = verify(gs, checks=("interleave", "scribble"))
        assert res.ok, res.summary()
        out = gs.replay("decode", 3)  # the lock-free path again
        assert gs.lock_free and out[0].shape[0] == 3
        del out
    finally:
        gs.release()


def test_error_on_the_capture_thread_reaches_the_next_replay_with_the_step(tmp_path):
    from capture_plan.executor import CaptureFailed, ExecutorError, capture
    from gpu_targets import Gated

    plan = _plan(tmp_path, [1, 2, 4, 8, 16], backend="torch", ci=False)
    target = Gated(gate_bs=4, max_bs=16, fail=(4, ValueError("boom")))
    with _serving(target) as (_, before):
        gs = capture(plan, target, progress=False, background=True)
        assert target.reached.wait(60)
        (out,) = gs.replay("decode", 5)  # 16 and 8 landed; 4 is being captured
        assert _padded_to(out, 5, 1) == 8
        del out  # a view of a kept output holds its pool
        target.gate.set()
        with pytest.raises(CaptureFailed, match=r"capture/decode/4.*phase decode, bs 4.*ValueError: boom"):
            while True:
                gs.replay("decode", 1)
    assert _left_over(before) == []
    assert gs.graphs == {}
    with pytest.raises(ExecutorError, match="no graphs for phase 'decode'.*failed at capture/decode/4"):
        gs.replay("decode", 1)
    with pytest.raises(CaptureFailed, match="capture/decode/4"):
        gs.wait()


def test_error_reaches_wait(tmp_path):
    from capture_plan.executor import CaptureFailed, capture
    from gpu_targets import Synthetic

    plan = _plan(tmp_path, [1, 2, 4, 8, 16], backend="torch", ci=False)
    target = Synthetic(max_bs=16, fail=(2, RuntimeError("bad kernel")))
    with _serving() as (_, before):
        gs = capture(plan, target, progress=False, background=True)
        with pytest.raises(CaptureFailed, match=r"capture/decode/2.*RuntimeError: bad kernel"):
            gs.wait(timeout=120)
    assert _left_over(before) == []


def test_release_mid_capture_stops_the_thread_and_releases_everything(tmp_path):
    from capture_plan.executor import ExecutorError, capture
    from gpu_targets import Gated

    plan = _plan(tmp_path, list(range(1, 17)), backend="torch", ci=False)
    target = Gated(gate_bs=8, max_bs=16)
    with _serving(target) as (_, before):
        gs = capture(plan, target, progress=False, background=True)
        assert target.reached.wait(60)
        assert 0 < len(gs.graphs) < 16
        target.gate.set()
        gs.release()
    assert not gs.background.thread.is_alive()
    assert gs.graphs == {} and gs.pools == {}
    assert _left_over(before) == []
    with pytest.raises(ExecutorError, match="no graphs for phase 'decode'"):
        gs.replay("decode", 1)


def test_fallbacks_and_the_default_stream_refusal(tmp_path):
    import threading

    import torch

    from capture_plan.executor import ExecutorError, capture
    from gpu_targets import Gated

    plan = _plan(tmp_path, [1, 2, 4, 8, 16], backend="torch", ci=False)
    for fallback in ("raise", "wait", "eager", "callable"):
        target = Gated(gate_bs=16, max_bs=16)  # held at the first capture: no graph yet
        calls = []

        def mine(phase, n, target=target, calls=calls):
            calls.append(n)
            return (target.x[:n] * 2 + 1,)

        with _serving(target) as (serve, _):
            gs = capture(
                plan, target, progress=False, background=True, fallback=mine if fallback == "callable" else fallback
            )
            assert target.reached.wait(60)
            try:
                with torch.cuda.stream(torch.cuda.default_stream()):
                    with pytest.raises(ExecutorError, match="legacy default stream"):
                        gs.replay("decode", 3)
                with pytest.raises(ExecutorError, match="outside the captured sizes 1..16"):
                    gs.replay("decode", 17)
                if fallback == "raise":
                    with pytest.raises(ExecutorError, match="batch 3 has no captured graph yet"):
                        gs.replay("decode", 3)
                elif fallback == "wait":
                    got = []

                    def waiter(got=got, gs=gs):
                        with torch.cuda.stream(serve):  # streams are per thread
                            got.append(gs.replay("decode", 3)[0].clone())

                    t = threading.Thread(target=waiter)
                    t.start()
                    t.join(0.5)
                    assert t.is_alive() and not got  # blocked until a graph fits
                    target.gate.set()
                    t.join(60)
                    assert got and got[0].shape[0] == 3
                else:
                    (out,) = gs.replay("decode", 3)
                    assert out._base is None and torch.equal(out, target.x[:3] * 2 + 1)
                    assert calls == ([3] if fallback == "callable" else [])
            finally:
                target.gate.set()
                gs.wait(60)
                gs.release()


def test_capture_and_release_return_the_pool_without_a_full_collection(tmp_path, model, monkeypatch):
    """A full collection costs ~1 s in a server-sized heap: neither capture nor
    release may run one, and release must still return every pool segment."""
    import gc

    from capture_plan.executor import capture

    real, calls = gc.collect, []

    def spy(generation=2):
        calls.append(generation)
        return real(generation)

    from capture_plan.executor.pool import pool_reserved

    plan = _plan(tmp_path, [1, 2, 4, 8, 16, 32, 64])
    monkeypatch.setattr(gc, "collect", spy)
    gs = capture(plan, model, progress=False)
    pools = list(gs.pools.values())
    assert pool_reserved(pools) == gs.report.pool_bytes > 0
    out = gs.replay("decode", 5)
    del out
    gs.release()
    assert 2 not in calls, calls
    # every segment of the pools is gone (measured per pool: a new capture
    # stream's cuBLAS workspace lives outside them, for good)
    assert pool_reserved(pools) == 0
