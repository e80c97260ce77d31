"""The loop-shaped API and verify on engine-captured graphs, on a real GPU.

Run on the device: ``python -m pytest -m gpu -q tests/test_gpu_loop.py``.

The engine-shaped runner (tests/engine_shaped.py: its own stream, per-phase
runners, one backend, its own dispatch keys) captures through
``capture_loop`` what ``capture(plan, target)`` captures: the same pool
bytes, step by step, the same graphs and dispatch, and with planted bugs the
same faults. Graphs of a plain ``torch.cuda.graph`` loop, adopted, verify
clean and the planted speculative bugs are caught in them too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

SMALL = dict(layers=2, hidden=1024, heads=8, kv_heads=2, head_dim=128, intermediate=2048, vocab=32000)
SIZES = [1, 2, 4, 8, 16, 32]


def _facts(gs) -> dict:
    """What capture() and the loop must agree on."""
    from capture_plan.executor.pool import pool_reserved

    return dict(
        pool=gs.report.pool_bytes,
        pools=pool_reserved(gs.pools.values()),
        steps=[(m.id, m.reserved, m.predicted_reserved) for m in gs.report.steps],
        graphs=[(k, c.pool, c.held, c.rows_per_request) for k, c in gs.graphs.items()],
        dispatch={
            p: [gs.padded(p, n) for n in range(1, gs.table(p).sizes[-1] + 1)]
            for p in dict.fromkeys(q for q, _ in gs.graphs)
        },
        workspaces={p: w.numel() for p, w in gs.workspaces.items()},
    )


def _loop_equals_capture(plan, target) -> None:
    import torch

    from capture_plan.executor import capture, verify
    from engine_shaped import TargetModel, run_engine

    ref = capture(plan, target, progress=False)
    try:
        want = _facts(ref)
    finally:
        ref.release()
    loop, backend = run_engine(
        plan, TargetModel(target), torch.device("cuda", torch.cuda.current_device()), target=target
    )
    gs = loop.graphs
    try:
        got = _facts(gs)
        assert got == want
        assert got["pool"] > 0 and got["pool"] == got["pools"]
        _engine_replays_equal_eager(backend, gs, target)
        res = verify(gs, checks=("interleave", "scribble"))
        assert res.ok, res.summary()
    finally:
        backend.cleanup()  # the engine drops its graphs and outputs first: a kept one would hold the pool
        gs.release()


def _engine_replays_equal_eager(backend, gs, target) -> None:
    """The engine's own replays (its backend's graphs and the outputs it holds) equal eager runs.
    A function of its own: no loop variable outlives it to hold a graph (and its pool)."""
    import torch

    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    for (phase, bs), graph in backend.graphs.items():
        target.prepare(phase, bs, bs, gen)
        ws = gs.workspaces.get(phase)
        if ws is not None:
            target.refresh(phase, bs, bs, ws)
        graph.replay()
        mine = backend.outputs[(phase, bs)]
        mine = mine if isinstance(mine, tuple) else (mine,)
        ref_out = [t.clone() for t in gs.eager(phase, bs)]
        for a, b in zip(mine, ref_out):
            assert torch.equal(a[: b.shape[0]], b), (phase, bs)


def _reference_plan(tmp_path: Path, ci: bool):
    from capture_plan.planner import BuildOptions, build_plan

    text = "[model]\n" + "".join(f"{k} = {v}\n" for k, v in SMALL.items())
    for name, tpr in (("decode", 1), ("target_verify", 4)):
        text += f'\n[[phases]]\nname = "{name}"\nkind = "{name}"\nsizes = {SIZES}\ntokens_per_request = {tpr}\n'
    (tmp_path / "spec.toml").write_text(text)
    return build_plan(BuildOptions(backend="fa3", ci=ci, spec=tmp_path / "spec.toml"))


@pytest.mark.parametrize("ci", [True, False])
def test_engine_loop_equals_capture_on_the_reference(tmp_path, ci):
    from capture_plan.references.decode import ReferenceConfig, ReferenceModel
    from capture_plan.schemas.spec import Model

    model = ReferenceModel(
        ReferenceConfig(
            model=Model(**SMALL), max_bs=max(SIZES), max_seqlen=256, tokens={"decode": 1, "target_verify": 4}
        )
    )
    _loop_equals_capture(_reference_plan(tmp_path, ci), model)


@pytest.mark.parametrize("ci", [True, False])
def test_engine_loop_equals_capture_on_the_eagle_reference(tmp_path, ci):
    from test_gpu_speculative import make, plan_for

    _loop_equals_capture(plan_for(tmp_path, ci=ci), make())


@pytest.mark.parametrize("kind", ["llama", "mixtral", "qwen2_moe", "gemma2", "deepseek_v3"])  # + MLA
def test_engine_loop_equals_capture_on_a_transformers_model(tmp_path, kind):
    pytest.importorskip("transformers")
    from capture_plan.adapters.hf import HFTarget
    from capture_plan.planner import BuildOptions, build_plan
    from test_gpu_adapters import _model, _spec

    model, cfg = _model(kind)
    target = HFTarget(model, max_bs=32, max_seqlen=128)
    _loop_equals_capture(build_plan(BuildOptions(backend="torch", spec=_spec(tmp_path, cfg))), target)


def _plan_file(tmp_path: Path, strategies=()) -> Path:
    from capture_plan.planner import plan_bytes
    from test_gpu_speculative import plan_for

    path = tmp_path / "plan.json"
    path.write_bytes(plan_bytes(plan_for(tmp_path, strategies)))
    return path


def _blames_draft_decode(res: dict) -> bool:
    return all(f["graph"].startswith("draft_decode/") or "draft_decode/" in f["detail"] for f in res["faults"])


@pytest.mark.parametrize("bug", ["kv-indices-topk", "page-table-scatter"])
def test_planted_bugs_give_the_same_faults_through_the_loop_and_in_a_plain_loop(tmp_path, bug):
    """Through the loop: the very faults of ``capture()`` (the same pools and
    layout). In a plain torch.cuda.graph loop, adopted: caught too, every fault
    blaming a draft_decode graph (its layout differs, so do the faults)."""
    from capture_plan.references.planted import planted_run
    from engine_shaped import planted

    path = _plan_file(tmp_path)
    ours = planted_run(path, (bug,))
    assert ours.exit == 0 and ours.result is not None, ours.output
    loop = planted(path, (bug,), "loop")
    assert loop["exit"] == 0 and loop["result"] is not None, loop["output"]
    assert ours.result["faults"], ours.result["summary"]
    assert [(f["check"], f["graph"]) for f in loop["result"]["faults"]] == [
        (f["check"], f["graph"]) for f in ours.result["faults"]
    ], (loop["result"]["summary"], ours.result["summary"])
    plain = planted(path, (bug,), "plain")
    assert plain["exit"] == 0 and plain["result"] is not None, plain["output"]
    assert plain["result"]["faults"] and _blames_draft_decode(plain["result"]), plain["result"]["summary"]


def test_a_clean_plain_loop_verifies_clean_with_every_check(tmp_path):
    """No false positives on engine-captured graphs: interleave, scribble,
    footprint (from record_graphs) and the read-only guard."""
    from capture_plan.executor import adopt, record_graphs, verify
    from engine_shaped import plain_loop
    from test_gpu_speculative import make, plan_for

    plan = plan_for(tmp_path)
    target = make()
    with record_graphs() as rec:
        graphs, outputs, pool = plain_loop(target, {p.name: p.sizes for p in plan.phases})
    assert len(rec.graphs) == len(graphs) == len(rec.windows)
    gs = adopt(graphs, outputs, pool=pool, target=target, recorded=rec)
    try:
        assert all(c.window is not None and c.window.own for c in gs.graphs.values())
        res = verify(gs)
        assert res.ok, res.summary()
        assert set(res.checks) == {"interleave", "scribble", "footprint", "read-only"}
    finally:
        del outputs
        graphs.clear()
        gs.release()


def test_the_loop_with_the_allocation_history_verifies_clean_with_every_check(tmp_path):
    import torch

    from capture_plan.executor import verify
    from engine_shaped import TargetModel, run_engine
    from test_gpu_speculative import make, plan_for

    target = make()
    loop, backend = run_engine(
        plan_for(tmp_path),
        TargetModel(target),
        torch.device("cuda", torch.cuda.current_device()),
        target=target,
        record=True,
    )
    gs = loop.graphs
    try:
        res = verify(gs)
        assert res.ok, res.summary()
        assert "footprint" in res.checks
    finally:
        backend.cleanup()
        gs.release()


def _synthetic_plan(tmp_path: Path, name: str):
    from capture_plan.planner import BuildOptions, build_plan

    spec = tmp_path / f"{name}.toml"
    sizes = [1] if name == "prime" else [1, 2, 4, 8, 16]
    spec.write_text(f'[[phases]]\nname = "decode"\nkind = "decode"\nsizes = {sizes}\n')
    return build_plan(BuildOptions(backend="torch", spec=spec))


def _reverse(backend, runners):
    runners[0].sizes = [16, 8, 2, 4, 1]  # the engine's own order, wrong at the third step


def _no_tensor(backend, runners):
    backend.output_override = lambda out: (out, "logits") if out.shape[0] == 4 else out


@pytest.mark.parametrize("fault", ["raises", "order", "outputs"])
def test_a_failed_engine_loop_leaves_no_graph_memory_behind(tmp_path, fault):
    import torch

    from capture_plan.executor import ExecutorError
    from engine_shaped import TargetModel, run_engine
    from gpu_targets import Synthetic

    device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream()
    loop, backend = run_engine(
        _synthetic_plan(tmp_path, "prime"), TargetModel(Synthetic(max_bs=1)), device, stream=stream
    )  # the stream's cuBLAS workspace stays, on purpose
    backend.cleanup()
    loop.graphs.release()
    target = Synthetic(max_bs=16, fail=(4, ValueError("boom")) if fault == "raises" else None)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    # pools of earlier tests in this process (their leftovers are not this loop's: on the
    # H200 two 2 MiB segments of earlier tests' pools were still there when this ran)
    earlier = {tuple(s["segment_pool_id"]) for s in torch.cuda.memory_snapshot()}
    configure = {"raises": None, "order": _reverse, "outputs": _no_tensor}[fault]
    message = {
        "raises": r"capture/decode/4: phase decode, bs 4\).*ValueError: boom",
        "order": r"capture/decode/4\): the engine's loop asked for decode/2 out of the plan's order",
        "outputs": r"capture/decode/4\): output out\[1\] is a str",
    }[fault]
    with pytest.raises(ExecutorError, match=message):
        run_engine(_synthetic_plan(tmp_path, "plan"), TargetModel(target), device, stream=stream, configure=configure)
    pools = [
        (tuple(s["segment_pool_id"]), s["total_size"])
        for s in torch.cuda.memory_snapshot()
        if tuple(s["segment_pool_id"]) not in earlier | {(0, 0)}
    ]
    assert pools == [] and torch.cuda.memory_reserved() <= before, pools


def test_the_engine_loop_captures_in_the_background_while_replays_equal_eager(tmp_path):
    """loop.start(): the engine's loop on a capture thread; the serving thread
    replays meanwhile (each check in one exclusive block); the same pool, step
    by step, as capture() in the foreground; verify clean afterwards."""
    import random

    import torch

    from capture_plan.executor import capture, verify
    from capture_plan.references.decode import ReferenceConfig, ReferenceModel
    from capture_plan.schemas.spec import Model
    from engine_shaped import TargetModel, make_engine
    from test_gpu_background import _padded_to, _serving_stream

    model = ReferenceModel(ReferenceConfig(model=Model(**SMALL), max_bs=max(SIZES), max_seqlen=256))
    plan = _reference_plan(tmp_path, ci=True)
    rows = {"decode": 1, "target_verify": 4}
    fg = capture(plan, model, progress=False)
    fg_steps, fg_pool = [(m.id, m.reserved) for m in fg.report.steps], fg.report.pool_bytes
    fg.release()
    serve = _serving_stream()
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    rng = random.Random(0)
    bad, by_graph = [], 0
    loop, backend, runners = make_engine(
        plan, TargetModel(model), torch.device("cuda", torch.cuda.current_device()), target=model
    )
    with torch.cuda.stream(serve):
        for phase in rows:  # cuBLAS and FA3 on the serving stream before the capture starts
            model.run(phase, 4, None)
        gs = loop.start(lambda loop: [r.capture(loop) for r in runners])
        while not gs.done:
            phase, n = rng.choice(tuple(rows)), rng.randint(1, max(SIZES))
            with gs.exclusive():
                model.prepare(phase, n, max(SIZES), gen)
                res = gs.replay(phase, n)
                bs = _padded_to(res[0], n, rows[phase])
                got = res[0].clone()
                ref = model.run(phase, bs, None)
                if not torch.equal(got, ref[: n * rows[phase]]):
                    bad.append((phase, n, bs))
            by_graph += res[0]._base is not None
            del res, got, ref
        assert gs.wait(timeout=600)
    try:
        assert not bad, bad[:10]
        assert [(m.id, m.reserved) for m in gs.report.steps] == fg_steps and gs.report.pool_bytes == fg_pool
        res = verify(gs, checks=("interleave", "scribble"))
        assert res.ok, res.summary()
    finally:
        backend.cleanup()
        gs.release()
