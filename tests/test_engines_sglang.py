"""SGLang 0.5.23's capture (tests/engines/sglang_runner.py) adopted onto capture_loop, on CPU with CUDA faked.

The runner captures several graphs per size (LoRA x attention variants), the
target-verify graphs and the EAGLE draft runners' graphs, made at different
times, into the one global pool on the one global capture stream, through one
loop over the plan's graph keys; the version before the adoption (read back
from the same file) captures the same shapes without capture-plan; the
adoption's diff is counted from the source. Faults: a key the plan does not
hold, a pool or a stream the plan did not declare, a warm-up that keeps more
than declared: one ExecutorError naming the step and the fix, nothing
half-captured left behind.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from engine_checks import check_adoption  # noqa: E402
from engines import adoption, sglang_runner  # noqa: E402
from engines.harness import LORA, SGLangEngine, sglang_plan, sglang_runners, start_sglang  # noqa: E402
from engines.plans import build, keyed  # noqa: E402
from engines.toy import ToyModel  # noqa: E402

CPU = torch.device("cpu")
SIZES = [1, 2, 4, 8]
RUNNER = Path(sglang_runner.__file__)


def _plan(tmp_path, *, keeps=None):
    return sglang_plan(tmp_path, SIZES, keeps=keeps)


def _model(plan, fake):
    tokens = {p.name: p.tokens_per_request for p in plan.phases}
    return ToyModel(tokens, max_tokens=max(SIZES) * max(tokens.values()), fake=fake)


def _runners(module, model, reuse=False):
    return sglang_runners(module, model, SIZES, reuse)


def start(plan, model, **kw):
    return start_sglang(plan, model, SIZES, **kw)


def test_the_sglang_runner_captures_every_graph_key_through_one_loop(tmp_path, fake):
    plan = _plan(tmp_path)
    model = _model(plan, fake)
    loop, engine, runners = start(plan, model, target=model)
    gs = loop.graphs
    captures = [s for s in plan.steps if s.op == "capture"]
    assert len(engine.graphs) == len(gs.graphs) == len(captures) == 4 * 4 + 3 * 4  # 4 decode keys a size
    assert [m.id for m in gs.report.steps] == [s.id for s in plan.steps]
    # one global pool (the engine's), one global capture stream, shared by every runner
    assert list(gs.pools.values()) == [sglang_runner._global_pool] and fake.pools == 1
    assert fake.modes == ["global"] * len(captures)
    runs = sum(s.runs for s in plan.steps if s.op == "warmup")
    assert sum(r.backend.warmup_runs for r in runners) == runs == model.after_warmup  # post_warmup_hook after each
    assert runners[-1].phase == "decode" and runners[-1].lora_prepared == 2 * len(SIZES)
    # every key is dispatched by its labels, and replays what its graph computed
    model.x.normal_()
    for lora in ("lora", "nolora"):
        for att in ("a", "b"):
            labels = {"lora": lora, "attention": att}
            name = gs.variant("decode", **labels)
            assert name == f"decode/lora={lora},attention={att}"
            for n in (1, 3, 8):
                (out,) = gs.replay(name, n)
                assert torch.equal(out, model.expected("decode", n, labels)), (name, n)
            assert engine.outputs[("decode", 4, lora, att)].data_ptr() == gs.graphs[(name, 4)].outputs[0].data_ptr()
    (out,) = gs.replay("target_verify", 3)  # 4 tokens a request: sliced to 3 requests' 12 rows
    assert out.shape[0] == 12 and torch.equal(out, model.expected("target_verify", 12))
    engine.cleanup()
    gs.release()


def _spec():
    from capture_plan.references.planted import spec_toml

    return spec_toml(SIZES)


def test_reused_output_buffers_are_warm_up_kept_buffers_the_plan_declares(tmp_path, fake):
    """FullCudaGraphBackend(reuse_output_buffer=True) keeps the last warm-up's output
    past the warm-up and copies every graph's output into one buffer: the plan
    declares what each warm-up keeps, the loop lets it survive and checks it."""
    keeps = {bs: bs * 8 * 4 for bs in SIZES}  # the decode output: bs rows of 8 float32
    plan = keyed(build(tmp_path, _spec(), "warmup=every-size"), "decode", variants=LORA, keeps=keeps)
    model = _model(plan, fake)
    loop, engine, runners = start(plan, model, reuse=True, target=model)
    gs = loop.graphs
    buf = runners[-1].backend._output_buffer
    assert buf is not None and buf.shape == (8, 8)
    for cap in gs.graphs.values():  # every decode output is a view of the one buffer (outside the pool)
        if cap.key_phase == "decode":
            assert cap.outputs[0].data_ptr() == buf.data_ptr()
    assert gs.report.warmup_kept_bytes == sum(
        keeps[s.bs] for s in plan.steps if s.op == "warmup" and s.phase == "decode"
    )
    # (the copy into the buffer is the backend's own torch call, which the fake does not replay:
    # tests/test_gpu_engines.py checks the replayed values on the GPU)
    engine.cleanup()
    gs.release()


def test_the_version_before_the_adoption_captures_the_same_shapes_and_the_diff_is_counted(tmp_path, fake):
    plan = _plan(tmp_path)
    model = _model(plan, fake)
    loop, adopted, _ = start(plan, model)
    before = adoption.before_module(RUNNER, tmp_path, "sglang_runner_before")
    before.reset_globals()
    plain = SGLangEngine()
    for runner in sorted(_runners(before, model), key=lambda r: loop.phases.index(r.phase)):
        plain.runners.append(runner)
        runner.capture()
    assert list(plain.graphs) == list(adopted.graphs)  # the same shapes, in the same order
    assert sum(r.backend.warmup_runs for r in plain.runners) == 2 * len(plain.graphs)  # two warm-ups a shape
    model.x.normal_()
    for (phase, bs, lora, att), graph in plain.graphs.items():
        graph.replay()
        labels = {k: v for k, v in (("lora", lora), ("attention", att)) if v}
        rows = bs * model.tokens[phase]
        assert torch.equal(plain.outputs[(phase, bs, lora, att)], model.expected(phase, rows, labels))
    check_adoption(adoption, RUNNER, most=(16, 12))
    adopted.cleanup()
    plain.cleanup()
    loop.graphs.release()


def _gone(fake, engine) -> None:
    assert engine.graphs == {} and engine.outputs == {}
    gc.collect()
    assert fake.snapshot() == []


def _unknown_label(engine, runners):
    runners[-1].attention_labels = ("a", "c")


def _own_pool(engine, runners):
    for r in runners:
        r.backend._pool = torch.cuda.graph_pool_handle()


def _own_stream(engine, runners):
    sglang_runner._global_stream = torch.cuda.Stream()


def _runner_order(engine, runners):
    runners.reverse()


FAULTS = [
    (_unknown_label, r"CaptureLoop.step: attention='c' is not a label of phase 'decode' \(a, b\)", None),
    (_own_pool, r"records into pool \(0, 2\), not the plan's pool 'shared' \(0, 1\)", "capture/target_verify/8"),
    (_own_stream, r"records on stream .* not the capture stream", "capture/target_verify/8"),
    (
        _runner_order,
        r"asked for decode/8/lora=lora,attention=a out of the plan's order: the plan's next capture is target_verify/8",
        "capture/target_verify/8",
    ),
]


@pytest.mark.parametrize("configure,message,step", FAULTS, ids=[f[0].__name__.strip("_") for f in FAULTS])
def test_an_sglang_runner_that_breaks_the_plan_gets_one_error_naming_the_step(tmp_path, fake, configure, message, step):
    from capture_plan.executor import ExecutorError

    plan = _plan(tmp_path)
    model = _model(plan, fake)
    holder = {}

    def setup(engine, runners):
        holder["engine"] = engine
        configure(engine, runners)

    with pytest.raises(ExecutorError, match=message) as info:
        start(plan, model, configure=setup)
    text = str(info.value)
    assert len(text.splitlines()) == 1 and "fix: " in text
    if step is not None:
        assert f"({step})" in text, text
    _gone(fake, holder["engine"])


def test_a_warm_up_that_keeps_more_than_declared_is_one_error_naming_the_step(tmp_path, fake):
    from capture_plan.executor import ExecutorError

    keeps = {bs: bs * 8 * 4 - 4 for bs in SIZES}  # one float less than the output the backend keeps
    plan = keyed(build(tmp_path, _spec(), "warmup=every-size"), "decode", variants=LORA, keeps=keeps)
    model = _model(plan, fake)
    holder = {}
    with pytest.raises(ExecutorError, match=r"the warm-up kept 256 B past its block, more than the 252 B") as info:
        start(plan, model, reuse=True, configure=lambda e, r: holder.setdefault("engine", e))
    assert "(warmup/decode/8/lora=lora,attention=a)" in str(info.value) and "fix: " in str(info.value)
    _gone(fake, holder["engine"])
