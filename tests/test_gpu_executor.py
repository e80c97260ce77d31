"""Executor on a real GPU (marked ``gpu``; skipped where CUDA is absent).

Run on the device: ``python -m pytest -m gpu -q``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

MiB = 2**20
SMALL = dict(layers=2, hidden=1024, heads=8, kv_heads=2, head_dim=128, intermediate=2048, vocab=32000)


def _spec(tmp_path: Path, sizes, phases=("decode",), **model) -> Path:
    m = {**SMALL, **model}
    text = "[model]\n" + "".join(f"{k} = {v}\n" for k, v in m.items())
    for name in phases:
        kind = name
        tpr = 4 if name == "target_verify" else 1
        text += f'\n[[phases]]\nname = "{name}"\nkind = "{kind}"\nsizes = {list(sizes)}\ntokens_per_request = {tpr}\n'
    path = tmp_path / "spec.toml"
    path.write_text(text)
    return path


def _plan(tmp_path, sizes, backend="fa3", ci=True, phases=("decode",), strategies=(), trace=None, **model):
    from capture_plan.planner import BuildOptions, build_plan

    return build_plan(
        BuildOptions(
            backend=backend,
            ci=ci,
            spec=_spec(tmp_path, sizes, phases, **model),
            strategies=tuple(strategies),
            trace=trace,
        )
    )


def small_model():
    """The reference model at SMALL, batches up to 64 (tests/test_gpu_background.py's too)."""
    from capture_plan.references.decode import ReferenceConfig, ReferenceModel
    from capture_plan.schemas.spec import Model

    return ReferenceModel(ReferenceConfig(model=Model(**SMALL), max_bs=64, max_seqlen=256))


@pytest.fixture(scope="module")
def model():
    return small_model()


def test_capture_follows_plan_and_replays_equal_eager(tmp_path, model):
    from capture_plan.executor import capture, verify

    plan = _plan(tmp_path, [1, 2, 4, 8, 16, 32, 64], phases=("decode", "target_verify"))
    tv = next(p for p in plan.phases if p.name == "target_verify")
    assert tv.strategy.workspace == "hoisted" or tv.strategy.order == "smallest-first"
    gs = capture(plan, model, progress=False)
    try:
        planned = [(s.phase, s.bs) for s in plan.steps if s.op == "capture"]
        assert list(gs.graphs) == planned
        assert [m.id for m in gs.report.steps] == [s.id for s in plan.steps]
        from capture_plan.executor.pool import pool_reserved

        # the cheap per-step counter adds up to what the pools really hold
        assert gs.report.steps[-1].reserved == gs.report.pool_bytes == pool_reserved(gs.pools.values())
        gs.write_report(tmp_path / "report.json")
        from capture_plan.planner.cli import main

        assert main(["report", str(tmp_path / "report.json")]) == 0
        res = verify(gs, checks=("interleave", "scribble"), rounds=2)
        assert res.ok, res.summary()
        assert res.replays >= 3 * len(planned)
    finally:
        gs.release()


def test_verify_has_no_false_positives_with_footprint_guard(tmp_path, model):
    from gpu_targets import assert_verifies_clean

    assert_verifies_clean(_plan(tmp_path, [1, 4, 8, 16, 32]), model)


def test_measured_pool_close_to_prediction_and_to_trace(tmp_path, model):
    from capture_plan.executor import capture, profile, write_trace
    from capture_plan.planner import BuildOptions, build_plan

    plan = _plan(tmp_path, [1, 2, 4, 8, 16, 32, 64])
    gs = capture(plan, model, progress=False)
    measured = gs.report.pool_bytes
    gs.release()
    trace = profile(plan, model)
    path = tmp_path / "trace.json"
    write_trace(trace, path)
    tplan = build_plan(BuildOptions(backend="fa3", ci=True, spec=_spec(tmp_path, [1, 2, 4, 8, 16, 32, 64]), trace=path))
    assert tplan.predicted.source == "trace"
    gs = capture(tplan, model, progress=False)
    try:
        # from a trace of this model: exact, to the byte, after every step (docs/measurements.md)
        steps = {m.step: m.reserved for m in gs.report.steps}
        assert [(m.step, steps[m.step]) for m in tplan.predicted.timeline] == [
            (m.step, m.reserved) for m in tplan.predicted.timeline
        ]
        assert tplan.predicted.pool_bytes == gs.report.pool_bytes
    finally:
        gs.release()
    # analytic, from the reference model's dimensions: within 10% (docs/measurements.md says so)
    assert abs(plan.predicted.pool_bytes - measured) / measured <= 0.10, (plan.predicted.pool_bytes, measured)


def test_footprint_guard_catches_out_of_bounds_write(tmp_path):
    from capture_plan.executor import capture, verify
    from gpu_targets import Synthetic

    plan = _plan(tmp_path, [1, 2, 4, 8, 16], backend="torch", ci=False)
    target = Synthetic(max_bs=16, oob=(8, 16 * MiB, 4 * MiB))
    gs = capture(plan, target, progress=False, record=True)
    try:
        res = verify(gs, checks=("footprint",))
        assert not res.ok
        fault = res.faults[0]
        assert fault.graph == "decode/8" and fault.check == "footprint"
        assert fault.nbytes == 4 * MiB
    finally:
        gs.release()
    clean = capture(plan, Synthetic(max_bs=16), progress=False, record=True)
    try:
        assert verify(clean, checks=("footprint", "scribble", "interleave")).ok
    finally:
        clean.release()


def test_reading_a_view_output_after_its_pool_replayed_is_caught(tmp_path):
    from capture_plan.executor import StaleOutputError, capture
    from gpu_targets import Synthetic

    plan = _plan(tmp_path, [1, 2, 4, 8, 16], backend="torch", ci=False, strategies=["outputs=view"])
    assert plan.phases[0].strategy.outputs == "view"
    gs = capture(plan, Synthetic(max_bs=16), progress=False)
    try:
        a = gs.replay_checked("decode", 16)
        a.get()  # fine right after its replay
        gs.replay_checked("decode", 3)
        with pytest.raises(StaleOutputError, match="decode/16.*decode/4"):
            a.get()
    finally:
        gs.release()


def test_failure_mid_capture_names_step_and_releases_everything(tmp_path):
    import torch

    from capture_plan.executor import CaptureFailed, capture
    from gpu_targets import Synthetic, prime_capture_stream

    plan = _plan(tmp_path, [1, 2, 4, 8, 16], backend="torch", ci=False)
    target = Synthetic(max_bs=16, fail=(4, ValueError("boom")))
    prime_capture_stream(tmp_path)  # the capture stream's cuBLAS workspace stays, on purpose
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    with pytest.raises(CaptureFailed, match=r"capture/decode/4.*phase decode, bs 4.*ValueError: boom"):
        capture(plan, target, progress=False)
    # every partial graph and the pool it held are gone: nothing beyond the
    # target's own buffers is reserved any more
    left = [(tuple(s["segment_pool_id"]), s["total_size"], s["allocated_size"]) for s in torch.cuda.memory_snapshot()]
    assert torch.cuda.memory_reserved() <= before, left


def test_out_of_memory_mid_capture_reports_predicted_and_free(tmp_path):
    import torch

    from capture_plan.executor import CaptureFailed, capture
    from gpu_targets import Synthetic

    class Hog(Synthetic):
        def run(self, phase, bs, ws):
            if bs == 4 and torch.cuda.is_current_stream_capturing():
                torch.empty(1 << 50, dtype=torch.uint8, device="cuda")  # 1 PiB
            return super().run(phase, bs, ws)

    plan = _plan(tmp_path, [1, 2, 4, 8, 16], backend="torch", ci=False)
    with pytest.raises(CaptureFailed, match=r"out of memory.*predicted a pool of \d+ B and \d+ B are free"):
        capture(plan, Hog(max_bs=16), progress=False)


def test_outputs_that_move_outside_the_pool_are_refused(tmp_path):
    from capture_plan.executor import ExecutorError, capture
    from gpu_targets import Synthetic

    plan = _plan(tmp_path, [1, 2, 4, 8, 16], backend="triton", ci=False)  # warm-up at every size
    with pytest.raises(ExecutorError, match="moved from .* outside the graph pool"):
        capture(plan, Synthetic(max_bs=16, moving=True), progress=False)


def test_replay_pads_and_rejects_beyond_largest(tmp_path):
    from capture_plan.executor import ExecutorError, capture
    from gpu_targets import Synthetic

    plan = _plan(tmp_path, [1, 2, 4, 8, 16], backend="torch", ci=False)
    gs = capture(plan, Synthetic(max_bs=16), progress=False)
    try:
        (out,) = gs.replay("decode", 5)
        assert out.shape[0] == 5 and gs.padded("decode", 5) == 8
        with pytest.raises(ExecutorError, match="batch 17 is outside the captured sizes 1..16"):
            gs.replay("decode", 17)
    finally:
        gs.release()


def test_hoisted_fa3_metadata_matches_in_kernel_metadata(model):
    import torch

    if model.fa3 is None:
        pytest.skip("FA3 not importable")
    gen = torch.Generator(device="cuda")
    ws = torch.zeros(4096, dtype=torch.uint8, device="cuda")
    for seed in range(10):
        gen.manual_seed(seed)
        bs = 1 + seed * 6
        model.prepare("target_verify", bs, bs, gen)
        model.refresh("target_verify", bs, bs, ws)
        hoisted = model.run("target_verify", bs, ws)
        plain = model.run("target_verify", bs, None)
        assert torch.equal(hoisted, plain), seed


def test_sdpa_fallback_captures_and_verifies(tmp_path):
    from capture_plan.executor import capture, verify
    from capture_plan.references.decode import ReferenceConfig, ReferenceModel
    from capture_plan.schemas.spec import Model

    m = ReferenceModel(ReferenceConfig(model=Model(**SMALL), max_bs=16, max_seqlen=128), backend="torch")
    plan = _plan(tmp_path, [1, 2, 4, 8, 16], backend="torch", ci=False, phases=("decode", "target_verify"))
    gs = capture(plan, m, progress=False)
    try:
        assert verify(gs, checks=("interleave",)).ok
    finally:
        gs.release()


def test_tensor_parallel_reference_captures_with_nccl_inside_the_graph(tmp_path):
    """One rank with NCCL: the agreement check, per-step sync and an all-reduce
    inside every captured graph (the 2-GPU run needs a machine with 2 GPUs)."""
    import subprocess
    import sys

    spec = _spec(tmp_path, [1, 2, 4, 8])
    script = f"""
import os, torch, torch.distributed as dist
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29511")
dist.init_process_group("nccl", rank=0, world_size=1)
torch.cuda.set_device(0)
from capture_plan.planner import BuildOptions, build_plan
from capture_plan.executor import capture, verify
from capture_plan.references.decode import ReferenceConfig, ReferenceModel
plan = build_plan(BuildOptions(backend="fa3", ci=True, spec=__import__("pathlib").Path({str(spec)!r}), tp=1))
from capture_plan.schemas.spec import Model
m = ReferenceModel(ReferenceConfig(model=Model(**{SMALL!r}), max_bs=8, max_seqlen=128), tp_group=dist.group.WORLD)
gs = capture(plan, m, progress=False)
res = verify(gs, checks=("interleave",))
print("RESULT", len(gs.graphs), res.ok, res.summary())
gs.release()
dist.destroy_process_group()
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RESULT 4 True" in r.stdout, r.stdout + r.stderr[-2000:]


def test_a_primed_stream_s_gemms_of_every_dtype_take_no_memory_and_the_priming_runs_bf16_only():
    """The capture stream is primed before the first capture so that no cuBLAS workspace
    lands in a graph's pool: ``prime_stream`` makes the workspace of a stream no GEMM has
    run on, and after it a GEMM of any dtype on that stream allocates nothing. The
    priming itself runs bfloat16 GEMMs only: a float32 GEMM added nothing to the
    workspace and made a model that runs none load cuBLAS's float32 kernels at every
    start-up prediction. (A GEMM with a one-dimensional bias is left out: the priming
    does not make what it adds, prime_stream's docstring.)"""
    import ctypes

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from capture_plan.executor import libcuda
    from capture_plan.executor.streams import prime_stream

    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize()
    # a stream of the driver's, new: torch's own streams come from a pool of 32 that other
    # tests (and the capture stream) have run GEMMs on, whose workspace exists already
    create, raw = libcuda.call("cuStreamCreate"), ctypes.c_void_p()
    assert create is not None and create(ctypes.byref(raw), 1) == 0  # CU_STREAM_NON_BLOCKING, as torch's
    stream = torch.cuda.ExternalStream(raw.value, device=dev)  # kept for the process: cuBLAS keys its workspace by it
    seen: list[tuple[str, torch.dtype]] = []

    class Gemms(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__
            if name.startswith(("addmm", "mm", "bmm", "matmul")):
                seen.append((name, args[1].dtype))
            return func(*args, **(kwargs or {}))

    before = torch.cuda.memory_reserved(dev)
    with Gemms():
        prime_stream(dev, stream)
    # the new stream's workspace, made here (more than the 2 MiB segment the operands could take)
    assert torch.cuda.memory_reserved(dev) - before > 2 * MiB
    assert seen and {dt for _, dt in seen} == {torch.bfloat16}, seen
    operands = {dt: torch.ones(64, 64, device=dev, dtype=dt) for dt in (torch.float32, torch.bfloat16, torch.float16)}
    outs = {dt: torch.empty(64, 64, device=dev, dtype=dt) for dt in operands}
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved(dev)
    with torch.cuda.stream(stream):
        for dt, a in operands.items():
            torch.addmm(a, a, a, out=outs[dt])
            torch.matmul(a, a, out=outs[dt])
        stream.synchronize()
    assert torch.cuda.memory_reserved(dev) == before  # the workspace was there for every dtype
