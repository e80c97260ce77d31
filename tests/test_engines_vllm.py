"""vLLM 0.33.0's capture (tests/engines/vllm_runner.py) adopted onto capture_loop, on CPU with CUDA faked.

The manager captures PIECEWISE then FULL descriptors, each largest first, the
pieces recorded by the compiled model's wrappers with attention run eagerly
between them, FULL graphs after two forward builds, their outputs in the
persistent buffer the warm-up allocates, a micro-batch twin on its own stream,
all in vLLM's global pool; the profiling pass is a declared partial pass into a
throwaway pool, torn down after, answering with the plan's figure. The version
before the adoption (read back from the same file) captures the same
descriptors; the adoption's diff is counted from the source. Faults: a piece
count that differs from the plan's, a stream the plan did not declare, a
warm-up that keeps more than declared.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from engine_checks import check_adoption, speculator_graph  # noqa: E402
from engines import (  # noqa: E402
    adoption,
    harness,  # noqa: E402
    vllm_runner,
)
from engines.toy import ToyModel  # noqa: E402

SIZES = [1, 2, 4, 8]
RUNNER = Path(vllm_runner.__file__)
HIDDEN_BYTES = 8 * 8 * 4  # the persistent hidden_states: 8 tokens of 8 float32


def vllm_plan(tmp_path, *, pieces=3, keeps=HIDDEN_BYTES):
    return harness.vllm_plan(tmp_path, SIZES, pieces=pieces, keeps=keeps)


def start(plan, model, **kw):
    return harness.start_vllm(plan, model, SIZES, **kw)


def _model(fake):
    return ToyModel({"piecewise": 1, "full_decode": 1, "full_decode_ubatch": 1}, max_tokens=max(SIZES), fake=fake)


def test_the_vllm_manager_captures_pieces_then_full_graphs_through_one_loop(tmp_path, fake):
    plan = vllm_plan(tmp_path)
    model = _model(fake)
    loop, runner = start(plan, model)
    gs, manager = loop.graphs, runner.manager
    F, P = vllm_runner.CUDAGraphMode.FULL, vllm_runner.CUDAGraphMode.PIECEWISE
    # PIECEWISE then FULL, each largest first, each FULL descriptor's micro-batch twin right after it
    # (vLLM's _init_candidates); a FULL descriptor built twice (warm-up, then capture)
    assert [(d.cg_mode, d.num_tokens, d.num_ubatches, w) for d, w in manager.builds] == [
        (P, n, 1, True) for n in (8, 4, 2, 1)
    ] + [(F, n, u, w) for n in (8, 4, 2, 1) for u in ((1, 2) if n >= 2 else (1,)) for w in (True, False)]
    # three pieces a PIECEWISE key, one graph a FULL key; all in vLLM's global pool
    assert sorted(gs.graphs) == sorted(
        [(f"piecewise#{k}", n) for k in range(3) for n in SIZES]
        + [("full_decode", n) for n in SIZES]
        + [("full_decode_ubatch", n) for n in (2, 4, 8)]
    )
    assert [m.id for m in gs.report.steps] == [s.id for s in plan.steps]
    assert list(gs.pools.values()) == [vllm_runner._global_graph_pool] and fake.pools == 1
    # the micro-batch twin recorded on its stream, the rest on the manager's capture stream
    for desc, graph in manager.graphs.items():
        want = runner.ubatch_runner.capture_stream if desc.num_ubatches > 1 else runner.manager.capture_stream
        assert graph.stream == want, desc
    pieces = [gs.graphs[(f"piecewise#{k}", 8)] for k in range(3)]
    assert all(c.held == "view" and c.piece == k for k, c in enumerate(pieces))
    assert [c.graph for c in pieces] == [vllm_runner.entry(w, 8).cudagraph for w in manager.compiled.pieces]
    # the persistent buffer the first FULL warm-up allocated: kept, declared, and every FULL graph's output
    assert gs.report.warmup_kept_bytes == HIDDEN_BYTES == manager.hidden_states.untyped_storage().nbytes()
    model.x.normal_()
    for name in ("full_decode", "full_decode_ubatch"):
        for n in (2, 3, 8):
            (out,) = gs.replay(name, n)
            assert out.data_ptr() == manager.hidden_states.data_ptr()
            assert torch.allclose(out, model.expected_pieces(n), atol=1e-6), (name, n)
    manager.release()
    gs.release()


@pytest.mark.parametrize("observed_by", ["capture hooks", "capture_begin wrapper"])
def test_a_graph_made_outside_the_loop_into_the_global_pool_is_counted_apart(tmp_path, fake, monkeypatch, observed_by):
    """vLLM's speculator and encoder graphs record into the same global pool
    outside the manager's loop: the report counts them, not as the loop's. Both ways the
    loop observes them: torch 2.14's global capture hooks (the engines' torch; emulated on
    an older one) and, on a torch without them, a wrapper of ``capture_begin``. The fake
    ran no capture hooks once, so under torch 2.14 this test failed (outside_graphs unset)."""
    from capture_plan.executor import recording
    from fake_cuda import emulate_capture_hooks

    if observed_by == "capture hooks":
        emulate_capture_hooks(monkeypatch)
    else:
        monkeypatch.setattr(recording, "capture_hooks", lambda: None)
    plan = vllm_plan(tmp_path)
    model = _model(fake)
    outside = []
    loop, runner = start(plan, model, configure=speculator_graph(outside, lambda: fake.pool_tensor(64, 8)))
    report = loop.graphs.report
    assert report.outside_graphs == 1 and report.outside_bytes == 64 * 8 * 4
    assert report.pool_bytes == report.steps[-1].reserved  # the loop's own graphs' growth, not the speculator's
    runner.release()
    loop.graphs.release()


def test_the_profiling_pass_is_a_declared_partial_pass_answered_by_the_plan(tmp_path, fake):
    from capture_plan.executor import capture_loop
    from capture_plan.schemas.keys import capture_memory

    plan = vllm_plan(tmp_path)
    model = _model(fake)
    vllm_runner.reset_globals()
    ubatch = torch.cuda.Stream()
    runner = vllm_runner.GPUModelRunner(model, SIZES, ubatch_stream=ubatch)
    passes = []
    # FULL capped at the first 2 FULL descriptors (vLLM's samples, descs[:2]): the largest and,
    # right after it in vLLM's order, its micro-batch twin
    loop_for = harness.vllm_profiling(plan, runner, model, {"full_decode": 1, "full_decode_ubatch": 1}, passes)
    figure = vllm_runner.profile_cudagraph_memory(runner, loop_for)
    assert figure == capture_memory(plan).bytes > 0
    (loop,) = passes
    report = loop.graphs.report
    assert report.profiling == {"piecewise": 4, "full_decode": 1, "full_decode_ubatch": 1}
    full = [m.id for m in report.steps if m.id.startswith("capture/full")]
    assert full == ["capture/full_decode/8", "capture/full_decode_ubatch/8"]
    # torn down: no graph left, the throwaway pool empty, the engine's pools restored
    assert loop.graphs.graphs == {} and runner.manager.graphs == {}
    assert all(not w.concrete_cudagraph_entries for w in runner.manager.compiled.pieces)
    gc.collect()
    assert fake.snapshot() == []
    assert runner.manager.pool == vllm_runner.get_global_graph_pool() == (0, 1)
    # then the real capture, into the global pool
    real = capture_loop(
        plan,
        stream=runner.manager.capture_stream,
        streams={"ubatch": ubatch},
        pools={"shared": vllm_runner.get_global_graph_pool()},
        device=model.device,
    )
    with real:
        runner.capture_model(real)
    assert len(real.graphs.graphs) == 3 * 4 + 4 + 3
    runner.release()
    real.graphs.release()


def test_the_version_before_the_adoption_captures_the_same_descriptors_and_the_diff_is_counted(tmp_path, fake):
    plan = vllm_plan(tmp_path)
    model = _model(fake)
    loop, adopted = start(plan, model)
    before = adoption.before_module(RUNNER, tmp_path, "vllm_runner_before")
    before.reset_globals()
    runner = before.GPUModelRunner(model, SIZES, ubatch_stream=torch.cuda.Stream())
    # vLLM's own pass: its extrapolation. The fake's free memory never moves, so both samples are 0
    # and each of the 7 FULL graphs after the first costs the 1 MiB floor
    estimate = before.profile_cudagraph_memory(runner)
    assert estimate == (7 - 1) * before.MIB and runner.manager.graphs == {}
    runner.capture_model()
    # the same descriptors in the same order: vLLM's puts each micro-batch twin right after its FULL
    # descriptor, and so does the plan's (twin_of), which the adopted manager follows
    fields = lambda descs: [(int(d.cg_mode), d.num_tokens, d.num_reqs, d.num_ubatches) for d in descs]  # noqa: E731
    assert fields(runner.manager.graphs) == fields(adopted.manager.graphs)  # two modules: two descriptor classes
    assert [(d.num_tokens, d.num_ubatches) for d in runner.manager.graphs] == [
        (8, 1),
        (8, 2),
        (4, 1),
        (4, 2),
        (2, 1),
        (2, 2),
        (1, 1),
    ]
    assert [sorted(e.num_tokens for e in w.concrete_cudagraph_entries) for w in runner.manager.compiled.pieces] == [
        [1, 2, 4, 8]
    ] * 3
    model.x.normal_()
    for desc, graph in runner.manager.graphs.items():
        graph.replay()
        got = runner.manager.hidden_states[: desc.num_tokens]
        assert torch.allclose(got, model.expected_pieces(desc.num_tokens), atol=1e-6), desc
    # the model manager, the piece wrappers and the speculator's managers (EAGLE's draft prefill and decode)
    check_adoption(adoption, RUNNER, most=(33, 25))
    runner.release()
    adopted.release()
    loop.graphs.release()


def _gone(fake, runner) -> None:
    assert runner.manager.graphs == {} and all(not w.concrete_cudagraph_entries for w in runner.manager.compiled.pieces)
    gc.collect()
    assert fake.snapshot() == []


@pytest.mark.parametrize(
    "pieces,message",
    [
        (
            4,
            r"step 1 \(capture/piecewise/8\): the engine's loop moved on to piecewise/4 after 3 of the step's 4 pieces",
        ),
        (2, r"step 1 \(capture/piecewise/8\): the engine records a piece more than the 2 the plan's step has"),
    ],
)
def test_a_piece_count_that_differs_from_the_plans_is_one_error_naming_the_step(tmp_path, fake, pieces, message):
    from capture_plan.executor import ExecutorError

    plan = vllm_plan(tmp_path, pieces=pieces)
    model = _model(fake)
    holder = {}
    with pytest.raises(ExecutorError, match=message) as info:
        start(plan, model, configure=lambda r, s: holder.setdefault("runner", r))
    assert "fix: rebuild the plan with" in str(info.value)
    _gone(fake, holder["runner"])


def test_a_stream_or_pool_the_plan_did_not_declare_is_one_error(tmp_path, fake):
    from capture_plan.executor import ExecutorError

    plan = vllm_plan(tmp_path)
    model = _model(fake)
    with pytest.raises(ExecutorError, match=r"capture_loop\(streams=\): stream 'dbo' is not one the plan declares"):
        start(plan, model, configure=lambda r, s: s.update(dbo=torch.cuda.Stream()))
    holder = {}

    def no_twin_stream(runner, streams):
        holder["runner"] = runner
        streams.clear()

    with pytest.raises(
        ExecutorError, match=r"step 11 \(capture/full_decode_ubatch/8\): the plan records this step on stream"
    ):
        start(plan, model, configure=no_twin_stream)
    _gone(fake, holder["runner"])

    def other_pool(runner, streams):
        holder["runner"] = runner
        runner.manager.pool = torch.cuda.graph_pool_handle()

    with pytest.raises(
        ExecutorError, match=r"\(capture/full_decode/8\): the engine records into pool \(0, \d+\), not the plan's"
    ):
        start(plan, model, configure=other_pool)
    _gone(fake, holder["runner"])


def test_a_warm_up_keeping_more_than_declared_names_the_step_and_the_fix(tmp_path, fake):
    from capture_plan.executor import ExecutorError

    plan = vllm_plan(tmp_path, keeps=HIDDEN_BYTES // 2)
    model = _model(fake)
    holder = {}
    with pytest.raises(
        ExecutorError, match=r"warmup/piecewise/8\): the warm-up kept 256 B past its block, more than the 128 B"
    ) as info:
        start(plan, model, configure=lambda r, s: holder.setdefault("runner", r))
    assert "fix: free what the warm-up does not keep, or rebuild the plan with what it keeps" in str(info.value)
    _gone(fake, holder["runner"])


def test_a_plan_the_planner_built_from_the_engine_s_spec_runs_through_the_manager(tmp_path, fake):
    """The spec says what vLLM captures (pieces, a micro-batch twin on its own stream
    and micro-batches, warm-up-kept outputs) and the planner expands it; the adopted
    manager captures it as planned."""
    from engines.plans import build

    spec = (
        harness.vllm_spec(SIZES)
        .replace('kind = "piecewise"\n', 'kind = "piecewise"\npieces = 3\n')
        .replace(
            'name = "full_decode_ubatch"\nkind = "full"\n',
            'name = "full_decode_ubatch"\nkind = "full"\nstream = "ubatch"\nmicro_batches = 2\n',
        )
    )
    plan = build(tmp_path, spec, "warmup=every-size", "outputs=view")
    assert [s.pieces for s in plan.steps if s.op == "capture" and s.phase == "piecewise"] == [3] * len(SIZES)
    model = _model(fake)
    loop, runner = start(plan, model)
    gs = loop.graphs
    assert len(gs.graphs) == 3 * len(SIZES) + len(SIZES) + len(SIZES) - 1
    assert [m.id for m in gs.report.steps] == [s.id for s in plan.steps]
    runner.release()
    gs.release()
