"""The engine-faithful runners (tests/engines) on a real GPU: SGLang 0.5.23's and vLLM 0.33.0's
capture adopted onto capture_loop, their graphs replayed against the model run eagerly and verified.

Run on the device: ``python -m pytest -m gpu -q tests/test_gpu_engines.py``.

What the CPU tests cannot see: real pools (the global pool's bytes against
the loop's per-step figures), real warm-up allocations (the persistent and
reused output buffers the plan declares, measured by the allocator), real
piece graphs whose inputs are the piece before's outputs in the pool, and
verify's checks on every key and piece.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

SIZES = [1, 2, 4, 8, 16, 32]
HIDDEN = 256


def _device():
    import torch

    return torch.device("cuda", torch.cuda.current_device())


def _sglang(tmp_path, **kw):
    from engines.harness import SGLangTarget, sglang_plan, start_sglang
    from engines.toy import ToyModel

    plan = sglang_plan(tmp_path, SIZES, keeps=kw.pop("keeps", None))
    tokens = {p.name: p.tokens_per_request for p in plan.phases}
    model = ToyModel(tokens, max_tokens=max(SIZES) * max(tokens.values()), hidden=HIDDEN, device=_device())
    loop, engine, runners = start_sglang(plan, model, SIZES, target=SGLangTarget(model), **kw)
    return plan, model, loop, engine, runners


def test_the_sglang_runner_s_graph_keys_replay_right_and_verify_clean(tmp_path):

    from capture_plan.executor import verify
    from capture_plan.executor.pool import pool_reserved
    from engine_checks import check_every_key
    from engines import sglang_runner

    plan, model, loop, engine, runners = _sglang(tmp_path, record=True)
    gs = loop.graphs
    try:
        assert len(gs.graphs) == sum(s.op == "capture" for s in plan.steps)
        assert list(gs.pools.values()) == [sglang_runner._global_pool]
        report = gs.report
        assert report.pool_bytes > 0 and report.pool_bytes == pool_reserved(gs.pools.values())
        assert report.pool_bytes == report.steps[-1].reserved  # the per-step figures add up to the pool
        check_every_key(gs, model, (1, 5, 32), exact=False)
        result = verify(gs)
        assert result.ok, result.summary()
    finally:
        engine.cleanup()
        gs.release()


def test_sglang_s_reused_output_buffer_is_declared_kept_and_measured(tmp_path):
    import torch

    keeps = {bs: bs * HIDDEN * 4 for bs in SIZES}  # the decode output each warm-up keeps until the buffer is made
    plan, model, loop, engine, runners = _sglang(tmp_path, reuse=True, keeps=keeps)
    gs = loop.graphs
    try:
        buf = runners[-1].backend._output_buffer
        assert buf is not None and buf.shape == (max(SIZES), HIDDEN)
        assert gs.report.warmup_kept_bytes == sum(
            keeps[s.bs] for s in plan.steps if s.op == "warmup" and s.phase == "decode"
        )
        model.x.normal_()
        labels = {"lora": "lora", "attention": "b"}
        (out,) = gs.replay(gs.variant("decode", **labels), 7)
        assert out.data_ptr() == buf.data_ptr()
        torch.testing.assert_close(out, model.expected("decode", 7, labels))
    finally:
        engine.cleanup()
        gs.release()


def _vllm(tmp_path, **kw):
    from engines.harness import start_vllm, vllm_plan
    from engines.toy import ToyModel

    keeps = max(SIZES) * HIDDEN * 4  # hidden_states: the largest descriptor's tokens
    plan = vllm_plan(tmp_path, SIZES, keeps=keeps)
    tokens = {"piecewise": 1, "full_decode": 1, "full_decode_ubatch": 1}
    model = ToyModel(tokens, max_tokens=max(SIZES), hidden=HIDDEN, device=_device())
    loop, runner = start_vllm(plan, model, SIZES, verified=True, **kw)
    return plan, model, loop, runner, keeps


def test_the_vllm_manager_s_pieces_and_full_graphs_replay_right_and_verify_clean(tmp_path):
    import torch

    from capture_plan.executor import verify
    from capture_plan.executor.pool import pool_reserved

    plan, model, loop, runner, keeps = _vllm(tmp_path, record=True)
    gs = loop.graphs
    try:
        assert len(gs.graphs) == 3 * len(SIZES) + len(SIZES) + len(SIZES) - 1
        report = gs.report
        assert report.warmup_kept_bytes == keeps == runner.manager.hidden_states.untyped_storage().nbytes()
        assert report.pool_bytes > 0 and report.pool_bytes == pool_reserved(gs.pools.values())
        model.x.normal_()
        for name in ("full_decode", "full_decode_ubatch"):
            for n in (2, 9, 32):
                (out,) = gs.replay(name, n)
                torch.testing.assert_close(out, model.expected_pieces(n))
        # the pieces read their inputs from the pool (what the piece before wrote): scribbling the
        # pool before a replay changes what they read by design, so the scribble check is left out
        result = verify(gs, checks=("interleave", "footprint"))
        assert result.ok, result.summary()
    finally:
        runner.release()
        gs.release()


def test_a_vllm_graph_made_outside_the_loop_is_counted_apart(tmp_path):
    import torch

    from engine_checks import speculator_graph

    outside = []
    speculator = speculator_graph(outside, lambda: torch.ones(1 << 20, device="cuda"))
    plan, model, loop, runner, _ = _vllm(tmp_path, configure=speculator)
    report = loop.graphs.report
    try:
        assert report.outside_graphs == 1 and report.outside_bytes >= 4 << 20
        assert report.pool_bytes == report.steps[-1].reserved
    finally:
        outside.clear()
        runner.release()
        loop.graphs.release()


def test_the_vllm_profiling_pass_answers_with_the_plan_and_leaves_nothing(tmp_path):
    import torch

    from capture_plan.executor.pool import pool_reserved
    from capture_plan.schemas.keys import capture_memory
    from engines import harness, vllm_runner
    from engines.toy import ToyModel

    plan = harness.vllm_plan(tmp_path, SIZES, keeps=max(SIZES) * HIDDEN * 4)
    tokens = {"piecewise": 1, "full_decode": 1, "full_decode_ubatch": 1}
    model = ToyModel(tokens, max_tokens=max(SIZES), hidden=HIDDEN, device=_device())
    vllm_runner.reset_globals()
    runner = vllm_runner.GPUModelRunner(model, SIZES, ubatch_stream=torch.cuda.Stream())
    passes = []
    figure = vllm_runner.profile_cudagraph_memory(
        # vLLM's 2 FULL samples: the largest FULL descriptor and its micro-batch twin right after it
        runner,
        harness.vllm_profiling(plan, runner, model, {"full_decode": 1, "full_decode_ubatch": 1}, passes),
    )
    (loop,) = passes
    assert figure == capture_memory(plan).bytes > 0
    assert loop.graphs.report.profiling == {"piecewise": len(SIZES), "full_decode": 1, "full_decode_ubatch": 1}
    assert loop.graphs.report.pool_bytes > 0
    torch.cuda.synchronize()
    (throwaway,) = loop.engine_pools
    assert pool_reserved([throwaway]) == 0  # torn down: the throwaway pool holds nothing
    assert runner.manager.graphs == {} and all(not w.concrete_cudagraph_entries for w in runner.manager.compiled.pieces)
