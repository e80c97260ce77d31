"""The engine plugins (capture_plan.adapters.plugins) on the engine-faithful runners of
tests/engines/, as the engines ship them (the version before the adoption, placed under
the engines' module paths in this process: tests/engines/plugged.py), on CPU with CUDA
faked (tests/fake_cuda.py).

SGLang 0.5.23: the target's decode runner with LoRA x attention variants, the target in
verify mode and EAGLE's draft runners, each capture_session -> _capture_one_stream ->
capture_one_shape -> FullCudaGraphBackend.capture_one (2 warm-ups, the recording through
``device_module.graph``), made one after another into one loop. vLLM 0.33.0:
GPUModelRunner.capture_model -> ModelCudaGraphManager.capture (PIECEWISE pieces through
CUDAGraphWrapper, uniform-decode FULL graphs, their micro-batch twins on the micro-batch
runner's stream, LoRA capture cases) -> the EAGLE speculator's draft prefill and draft
decode managers; GPUModelRunner.profile_cudagraph_memory.

Checked: disabled, nothing changes; an unknown release, a missing plan, a plan for another
TP size or for other graphs, or in an order the engine cannot follow, is refused with one
line before the first graph (or, where chosen, the engine captures as it does, with a
warning); enabled, the engine's own loop captures every graph in the plan's order, into
the plan's pool, its outputs held, each graph replaying what the model computes, and the
loop's report is complete; a fault inside the engine's capture leaves no graph behind.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from capture_plan.adapters.plugins import core, live, sglang as sgl_plugin, vllm as vllm_plugin
from capture_plan.adapters.plugins.hooks import hook

# before the engines' runners, which import torch: a machine without it skips, naming it
torch = pytest.importorskip("torch")

from engine_checks import check_every_key  # noqa: E402
from engines import harness  # noqa: E402
from engines.plugged import loops_on_cpu, plan_file, sglang_release, vllm_release  # noqa: E402
from engines.toy import ToyModel  # noqa: E402

SIZES = [1, 2, 4, 8]
HIDDEN_BYTES = 8 * 8 * 4  # vLLM's persistent hidden_states: 8 tokens of 8 float32


@pytest.fixture
def cuda(fake, monkeypatch):
    """The fake CUDA, the plugins' loops on the CPU."""
    loops_on_cpu(monkeypatch)
    return fake


# -- SGLang 0.5.23 ------------------------------------------------------------------------------


def _sgl_model(plan, fake):
    tokens = {p.name: p.tokens_per_request for p in plan.phases}
    return ToyModel(tokens, max_tokens=max(SIZES) * max(tokens.values()), fake=fake)


def _plugged_sglang(monkeypatch, tmp_path, sizes=SIZES, *, fallback: str | None = None, **plan_options):
    """SGLang's release with the plugin registered for a plan of ``sizes`` (``plan_options``:
    harness.sglang_plan's), written where ``CAPTURE_PLAN_PLAN`` names it (and
    ``CAPTURE_PLAN_FALLBACK`` set to ``fallback`` where given): the release's module and the plan."""
    module = sglang_release(monkeypatch, tmp_path)
    plan = harness.sglang_plan(tmp_path, sizes, **plan_options)
    monkeypatch.setenv(core.ENV_PLAN, str(plan_file(tmp_path, plan)))
    if fallback is not None:
        monkeypatch.setenv(core.ENV_FALLBACK, fallback)
    sgl_plugin.register()
    return module, plan


def test_disabled_the_sglang_plugin_changes_nothing(cuda, monkeypatch, tmp_path):
    module = sglang_release(monkeypatch, tmp_path)
    plan = harness.sglang_plan(tmp_path, SIZES)
    classes = [module.DecodeCudaGraphRunner, module.FullCudaGraphBackend]
    before = [dict(vars(c)) for c in classes]
    monkeypatch.delenv(core.ENV_PLAN, raising=False)
    sgl_plugin.register()
    assert [dict(vars(c)) for c in classes] == before
    engine = harness.plugged_sglang_start(module, plan, _sgl_model(plan, cuda), SIZES)
    # SGLang's own order: per runner, sizes largest first, per LoRA variant, per attention variant
    decode = next(r for r in engine.runners if r.phase == "decode")
    assert list(decode.backend._graphs)[:4] == [(8, lv, av) for lv in ("lora", "nolora") for av in ("a", "b")]
    assert sum(r.backend.warmup_runs for r in engine.runners) == 2 * len(engine.graphs)
    engine.cleanup()


@pytest.mark.parametrize("order", ["largest-first", "smallest-first"])
def test_sglang_captures_every_graph_key_through_the_plan(cuda, monkeypatch, tmp_path, order):
    module, plan = _plugged_sglang(monkeypatch, tmp_path, strategies=(f"order={order}",))
    adoption = module.FullCudaGraphBackend.__capture_plan__
    model = _sgl_model(plan, cuda)
    engine = harness.plugged_sglang_start(module, plan, model, SIZES)
    gs = adoption.loop.graphs  # the loop closed with the plan's last capture (the last runner's)
    assert [m.id for m in gs.report.steps] == [s.id for s in plan.steps]
    # the engine's own loops, in the plan's order: each runner's graphs in its backend, in that order
    captures = [s for s in plan.steps if s.op == "capture"]
    assert len(engine.graphs) == len(gs.graphs) == len(captures) == 4 * 4 + 3 * 4
    for runner in engine.runners:
        want = [s.bs for s in captures if s.phase == runner.phase]
        assert [k[0] for k in runner.backend._graphs] == want, runner.phase
        assert runner.capture_bs == SIZES  # the engine's list is left as it was
    # into the plan's pool, on the engine's one capture stream
    (pool,) = gs.pools.values()
    assert all(g.pool() == pool for g in engine.graphs.values())
    assert all(g.stream == module._global_stream for g in engine.graphs.values())
    # every key dispatched by its labels replays what the engine's graph computes
    check_every_key(gs, model, (1, 3, 8))
    (out,) = gs.replay("draft_extend", 3)
    assert torch.equal(out, model.expected("draft_extend", 12))
    engine.cleanup()
    gs.release()


def test_sglang_a_plan_for_another_tp_size_refuses_the_first_capture_in_one_line(cuda, monkeypatch, tmp_path):
    module = sglang_release(monkeypatch, tmp_path)
    plan = harness.sglang_plan(tmp_path, SIZES)
    path = plan_file(tmp_path, plan)
    monkeypatch.setenv(core.ENV_PLAN, str(path))
    sgl_plugin.register()
    model = _sgl_model(plan, cuda)
    runner = module.DecodeCudaGraphRunner(model, SIZES)
    runner.model_runner = type("ModelRunner", (), {"tp_size": 2, "model_config": None})()
    with pytest.raises(core.PluginRefused) as err:
        runner.capture()
    line = str(err.value)
    assert "\n" not in line and f"{core.ENV_PLAN}={path}" in line
    assert "it is for TP 1, sglang runs TP 2" in line and "CAPTURE_PLAN_FALLBACK=engine" in line
    assert runner.backend._graphs == {} and runner.backend.warmup_runs == 0  # nothing captured


def test_sglang_falls_back_to_its_own_capture_with_a_warning_where_chosen(cuda, monkeypatch, tmp_path, caplog):
    module, plan = _plugged_sglang(monkeypatch, tmp_path, fallback="engine")
    runner = module.DecodeCudaGraphRunner(_sgl_model(plan, cuda), SIZES)
    runner.model_runner = type("ModelRunner", (), {"tp_size": 2, "model_config": None})()
    with caplog.at_level(logging.WARNING, logger="capture_plan.plugins"):
        runner.capture()
    assert [k[0] for k in runner.backend._graphs] == [8, 4, 2, 1]  # SGLang's own capture, whole
    assert "capturing as sglang does (CAPTURE_PLAN_FALLBACK=engine)" in caplog.text
    runner.backend.cleanup()


def test_sglang_a_runner_whose_sizes_are_not_the_plans_is_refused(cuda, monkeypatch, tmp_path):
    module, plan = _plugged_sglang(monkeypatch, tmp_path)
    runner = module.DecodeCudaGraphRunner(_sgl_model(plan, cuda), [*SIZES, 16])
    with pytest.raises(core.PluginRefused, match=r"the decode runner captures sizes \[1, 2, 4, 8, 16\], the plan"):
        runner.capture()


def test_sglang_a_plan_for_other_sizes_stops_start_up_before_the_weights_load(cuda, monkeypatch, tmp_path):
    """The configured decode sizes are published before the model runner loads the
    weights: a plan that no request pool's size makes SGLang's is refused there, in one
    line naming the plan, the sizes that differ and the commands that make them agree."""
    module = sglang_release(monkeypatch, tmp_path)
    plan = harness.sglang_plan(tmp_path, SIZES)
    path = plan_file(tmp_path, plan)
    monkeypatch.setenv(core.ENV_PLAN, str(path))
    monkeypatch.chdir(tmp_path)
    sgl_plugin.register()
    loaded = []
    monkeypatch.setattr(module.ModelRunner, "load_model", lambda self: loaded.append(self))
    phases = "target_verify, draft_decode, draft_extend, decode"
    for configured, says in (
        ([1, 2, 8, 16], "the plan captures 4, SGLang does not"),  # a size SGLang is not configured with
        ([1, 2, 4], "the plan captures 8, SGLang does not"),  # above SGLang's largest
        ([1, 2, 4, 6, 8, 16], "SGLang captures 6, the plan does not"),  # one among the plan's
    ):
        module.publish(configured)  # --cuda-graph-bs-decode
        with pytest.raises(core.PluginRefused, match=f": {phases}: {says}; fix: ") as err:
            module.ModelRunner(_sgl_model(plan, cuda), max_running_requests=64)
        assert loaded == []  # refused before the weights
    line = str(err.value)
    assert "\n" not in line and line.startswith(
        f"{core.ENV_PLAN}={path}: the plan's sizes are not SGLang's (its decode sizes 1, 2, 4, 6, 8, 16): "
        f"{phases}: SGLang captures 6, the plan does not; fix: start SGLang with --cuda-graph-bs-decode 1 2 4 8, "
        f"or set the sizes of {phases} in spec.toml to [1, 2, 4, 6, 8, 16] and rebuild it: `planner build "
    )
    # the fix, as the line says: the spec's sizes set to SGLang's, the command run where SGLang starts
    spec = tmp_path / "spec.toml"
    spec.write_text(spec.read_text().replace("sizes = [1, 2, 4, 8]", "sizes = [1, 2, 4, 6, 8, 16]"))
    command = re.fullmatch(r".*and rebuild it: `(planner build .* -o plan\.json --force)`", line)[1]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    module.ModelRunner(_sgl_model(plan, cuda), max_running_requests=64)
    assert len(loaded) == 1


def test_sglang_names_the_rebuild_of_a_plan_of_the_embedded_spec(cli, tmp_path):
    """SGLang's default list up to another size: the recorded build with --max-bs; another
    list: the embedded spec written out, its sizes set, built from it. Each command works."""
    from capture_plan.schemas.codec import decode_plan

    def plan():
        return decode_plan((tmp_path / "p.json").read_bytes(), "p.json")

    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}

    def sh(command: str) -> None:
        done = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stderr

    assert cli("build", "-b", "fa3", "--max-bs", "8", "-o", "p.json")[0] == 0
    fix = sgl_plugin.rebuild_fix(plan(), Path("p.json"), [1, 2, 4, 8, 12, 16])
    assert fix == (
        "start SGLang with --cuda-graph-bs-decode 1 2 4 8, or rebuild it with SGLang's: "
        "`planner build --backend fa3 --max-bs 16 -o p.json --force`"
    )
    sh(fix.split("`")[1])
    assert plan().phases[0].sizes == [16, 12, 8, 4, 2, 1]
    fix = sgl_plugin.rebuild_fix(plan(), Path("p.json"), [1, 2, 4, 8, 16])
    assert fix == (
        "start SGLang with --cuda-graph-bs-decode 1 2 4 8 12 16, or write the spec (planner spec show > "
        "sglang-spec.toml), set the sizes of decode there to [1, 2, 4, 8, 16] and rebuild it: "
        "`planner build --backend fa3 --spec sglang-spec.toml -o p.json --force`"
    )
    sh("planner spec show > sglang-spec.toml")
    spec = tmp_path / "sglang-spec.toml"
    spec.write_text(re.sub(r"sizes = \[[^\]]*\]", "sizes = [1, 2, 4, 8, 16]", spec.read_text()))
    sh(fix.split("`")[1])
    assert plan().phases[0].sizes == [16, 8, 4, 2, 1]
    # sizes chosen for a traffic: SGLang takes the plan's
    traffic = Path(__file__).parent / "data" / "traffic-skewed.csv"
    assert cli("build", "-b", "fa3", "--ci", "--sizes", "auto", "--traffic", str(traffic), "-o", "a.json")[0] == 0
    auto = decode_plan((tmp_path / "a.json").read_bytes(), "a.json")
    chosen = " ".join(map(str, sorted(auto.phases[0].sizes)))
    fix = sgl_plugin.rebuild_fix(auto, Path("a.json"), [1, 2, 4, 8, 16])
    assert fix == f"start SGLang with --cuda-graph-bs-decode {chosen} (the plan's, chosen for its traffic)"


def test_sglang_leaves_to_the_capture_what_the_request_pool_decides(cuda, monkeypatch, tmp_path):
    """Before the KV cache, a plan of the configured sizes up to one of them may be SGLang's
    (a request pool of that size clamps its list there): it passes the early check, and the
    capture's check compares the runners' final list."""
    # SGLang's [1, 2, 4, 8, 16] clamped to a pool of 6
    module, plan = _plugged_sglang(monkeypatch, tmp_path, [1, 2, 4, 6])
    module.publish([1, 2, 4, 8, 16])
    model = _sgl_model(plan, cuda)
    runner = module.ModelRunner(model, max_running_requests=6)
    assert runner.weights_loaded and runner.capture_bs() == [1, 2, 4, 6]
    engine = harness.plugged_sglang_start(module, plan, model, runner.capture_bs())
    assert len(engine.graphs) == sum(s.op == "capture" for s in plan.steps)
    engine.cleanup()
    # a larger pool: the runners capture 8 too, which only the capture's check sees (as it
    # sees a list that a PD role switch, ensure_decode_cuda_graphs, rewrote after start-up)
    module.reset_globals()
    sizes = module.ModelRunner(model, max_running_requests=64).capture_bs()
    with pytest.raises(
        core.PluginRefused, match=r"the decode runner captures sizes \[1, 2, 4, 8, 16\], the plan \[1, 2"
    ):
        module.DecodeCudaGraphRunner(model, sizes).capture()


def test_sglang_a_list_its_request_pool_clamped_is_not_fixed_by_the_sizes_sglang_has(cuda, monkeypatch, tmp_path):
    """SGLang started with the plan's sizes, its request pool (6) below the largest: the runners
    capture [1, 2, 4, 6]. The capture's refusal must not tell the user to start SGLang with the
    plan's sizes (it was: the pool clamps them again); the rebuild it names makes them agree."""
    module, plan = _plugged_sglang(monkeypatch, tmp_path)
    module.publish(SIZES)  # --cuda-graph-bs-decode 1 2 4 8: the plan's, and the early check passes
    model = _sgl_model(plan, cuda)
    sizes = module.ModelRunner(model, max_running_requests=6).capture_bs()
    assert sizes == [1, 2, 4, 6]
    module.reset_globals()
    with pytest.raises(core.PluginRefused) as err:
        module.DecodeCudaGraphRunner(model, sizes).capture()
    line = str(err.value)
    assert "the decode runner captures sizes [1, 2, 4, 6], the plan [1, 2, 4, 8]" in line
    assert "--cuda-graph-bs-decode" not in line, line
    assert "to [1, 2, 4, 6] and rebuild it" in line
    # a runner left with no size (an alignment filtered them all) is refused in one line too
    with pytest.raises(core.PluginRefused, match=r"the decode runner captures sizes \[\], the plan \[1, 2, 4, 8\]"):
        module.DecodeCudaGraphRunner(model, []).capture()


@pytest.mark.parametrize(
    ("alignment", "backend", "refused"),
    [(1, "full", True), (2, "full", False), (1, "breakable", False), (1, "disabled", False)],
    ids=["checked", "aligned", "breakable", "disabled"],
)
def test_sglang_checks_sizes_early_only_for_full_decode_graphs_aligned_by_1(
    cuda, monkeypatch, tmp_path, alignment, backend, refused
):
    """An alignment above 1 (two-batch overlap, attention TP gathers) makes a runner's
    width enter its list: left to the capture's check; breakable or disabled decode graphs
    are not the plugin's to route."""
    module, plan = _plugged_sglang(monkeypatch, tmp_path)
    module.publish([1, 3, 5], alignment=alignment, backend=backend)
    with pytest.raises(core.PluginRefused) if refused else contextlib.nullcontext():
        assert module.ModelRunner(_sgl_model(plan, cuda), max_running_requests=64).weights_loaded


def test_sglang_a_plan_for_other_sizes_falls_back_before_the_weights_where_chosen(cuda, monkeypatch, tmp_path, caplog):
    module, plan = _plugged_sglang(monkeypatch, tmp_path, fallback="engine")
    module.publish([1, 2, 3, 4, 8])
    model = _sgl_model(plan, cuda)
    with caplog.at_level(logging.WARNING, logger="capture_plan.plugins"):
        runner = module.ModelRunner(model, max_running_requests=64)
    assert runner.weights_loaded
    assert "SGLang captures 3, the plan does not" in caplog.text and "capturing as sglang does" in caplog.text
    module.reset_globals()
    decode = module.DecodeCudaGraphRunner(model, runner.capture_bs())
    decode.capture()  # SGLang's own capture, whole
    assert [k[0] for k in decode.backend._graphs] == [8, 4, 3, 2, 1]
    decode.backend.cleanup()


def test_sglang_a_failure_inside_the_engines_capture_leaves_no_graph(cuda, monkeypatch, tmp_path):
    from capture_plan.executor import CaptureFailed

    module, plan = _plugged_sglang(monkeypatch, tmp_path)
    model = _sgl_model(plan, cuda)
    forward = model.forward

    def failing(phase, bs, labels=None):
        if phase == "decode" and bs == 4 and cuda.recording is not None:
            raise ValueError("boom")
        return forward(phase, bs, labels)

    model.forward = failing
    engine = harness.SGLangEngine()
    with pytest.raises(CaptureFailed, match=r"capture/decode/4/lora=lora,attention=a") as err:
        module.reset_globals()
        harness.capture_in_plan_order(engine, harness.sglang_runners(module, model, SIZES), plan)
    assert "boom" in str(err.value)
    assert engine.graphs == {} and engine.outputs == {}  # every backend's cleanup ran
    gc.collect()
    assert cuda.snapshot() == []


def _missing_plan(mp, tmp):
    mp.setenv(core.ENV_PLAN, str(tmp / "gone.json"))


def _invalid_plan(mp, tmp):
    (tmp / "bad.json").write_text("{")
    mp.setenv(core.ENV_PLAN, str(tmp / "bad.json"))


@pytest.mark.parametrize(
    ("setup", "says"),
    [
        (_missing_plan, "the plan file is not there"),
        (_invalid_plan, "the plan cannot be used"),
    ],
    ids=["missing-plan", "invalid-plan"],
)
def test_registration_refuses_start_up_with_one_line(cuda, monkeypatch, tmp_path, setup, says):
    module = sglang_release(monkeypatch, tmp_path)
    monkeypatch.setenv(core.ENV_PLAN, str(plan_file(tmp_path, harness.sglang_plan(tmp_path, SIZES))))
    setup(monkeypatch, tmp_path)
    before = dict(vars(module.FullCudaGraphBackend))
    with pytest.raises(SystemExit) as exit_:
        sgl_plugin.register()
    line = str(exit_.value.code)
    assert line.startswith("capture-plan: ") and says in line and "\n" not in line and "; fix: " in line
    assert dict(vars(module.FullCudaGraphBackend)) == before  # nothing installed
    monkeypatch.setenv(core.ENV_FALLBACK, "engine")
    sgl_plugin.register()  # the operator chose the engine's capture: a warning, nothing installed
    assert dict(vars(module.FullCudaGraphBackend)) == before


def test_vllm_whose_objects_are_not_its_releases_captures_as_it_does_with_one_warning(
    cuda, monkeypatch, tmp_path, caplog
):
    """vLLM reporting 0.34.0 with 0.33.0's objects (CudaGraphManager.capture without
    ``stream``): the live check finds the moved row, the plugin installs nothing and vLLM
    starts, capturing as it does, after one WARNING naming the row; CAPTURE_PLAN_STRICT=1
    stops the start-up with that line instead."""
    module = vllm_release(monkeypatch, tmp_path)
    monkeypatch.setenv(core.ENV_PLAN, str(plan_file(tmp_path, harness.vllm_plan(tmp_path, SIZES))))
    monkeypatch.setattr(core, "installed", lambda dist: "0.34.0")
    before = dict(vars(module.CudaGraphManager))
    with caplog.at_level(logging.INFO, logger="capture_plan.plugins"):
        vllm_plugin.register()
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and "\n" not in record.getMessage()
    assert "vllm 0.34.0: the hook points moved (vllm 0.34.0 row vllm.v1.worker.gpu.cudagraph_utils:" in record.message
    assert "CudaGraphManager.capture: is (self, create_forward_fn" in record.message
    assert "fix: pip install --force-reinstall vllm==0.34.0" in record.message
    assert "capturing as vllm does (CAPTURE_PLAN_STRICT=1 stops instead)" in record.message
    assert dict(vars(module.CudaGraphManager)) == before  # nothing installed
    monkeypatch.setenv(core.ENV_STRICT, "1")
    with pytest.raises(SystemExit) as exit_:
        vllm_plugin.register()
    line = str(exit_.value.code)
    assert line.startswith("capture-plan: the installed vllm: vllm 0.34.0: the hook points moved") and "\n" not in line
    assert dict(vars(module.CudaGraphManager)) == before


def test_a_bad_fallback_setting_is_one_line():
    with pytest.raises(core.PluginRefused, match="CAPTURE_PLAN_FALLBACK='maybe' is neither 'refuse' nor 'engine'"):
        core.settings({core.ENV_PLAN: "p.json", core.ENV_FALLBACK: "maybe"})
    assert core.settings({}) is None and core.settings({core.ENV_PLAN: " "}) is None


# -- vLLM 0.33.0 ---------------------------------------------------------------------------------


def _vllm_model(fake):
    return ToyModel({"piecewise": 1}, max_tokens=max(SIZES) * harness.DRAFT_QUERY, fake=fake)


def _vllm_runner(module, model, *, loras=None, draft=False):
    return harness.vllm_runner_of(module, model, SIZES, loras=loras, draft=model if draft else None)


def _vllm_refused(module, plan, cuda, monkeypatch, tmp_path):
    """vLLM (``module``) with the plugin registered for ``plan``, whose capture the plugin
    refuses: the runner, and the refusal's one line."""
    monkeypatch.setenv(core.ENV_PLAN, str(plan_file(tmp_path, plan)))
    vllm_plugin.register()
    runner = _vllm_runner(module, _vllm_model(cuda))
    with pytest.raises(core.PluginRefused) as err:
        runner.capture_model()
    return runner, str(err.value)


def _classes(module):
    return [module.CudaGraphManager, module.GPUModelRunner, module.CUDAGraphWrapper]


def test_disabled_the_vllm_plugin_changes_nothing(vllm, cuda, monkeypatch, tmp_path):
    module = vllm_release(monkeypatch, tmp_path, version=vllm)
    before = [dict(vars(c)) for c in _classes(module)]
    monkeypatch.delenv(core.ENV_PLAN, raising=False)
    vllm_plugin.register()
    assert [dict(vars(c)) for c in _classes(module)] == before
    runner = _vllm_runner(module, _vllm_model(cuda))
    runner.capture_model()
    # vLLM's own order: PIECEWISE, then FULL, each largest first, a twin right after its descriptor
    F = module.CUDAGraphMode.FULL
    assert [(d.num_tokens, d.num_ubatches) for d in runner.cudagraph_manager.graphs] == [
        (8, 1), (8, 2), (4, 1), (4, 2), (2, 1), (2, 2), (1, 1)
    ]  # fmt: skip
    assert all(d.cg_mode == F for d in runner.cudagraph_manager.graphs)
    runner.release()


def _draft_decode(module, sizes=SIZES):
    """The draft decode manager's request sizes where the release has its own grid (vLLM
    0.34.0: up to max_num_seqs, the fake runner's largest size), else None (the sizes)."""
    grid = getattr(module, "decode_cudagraph_capture_grid", None)
    return grid(max(sizes)) if grid is not None else None


def _kv_sized_before_capture(runner):
    """The runner with the KV cache sized before capture (vLLM 0.34.0 with the extensible KV
    cache off; 0.33.0 always): vLLM then asks for its estimate, and the plan answers it."""
    config = getattr(runner, "cache_config", None)
    if config is not None:
        config.enable_extensible_kv_cache = False
    return runner


def _vllm_routed(vllm, cuda, monkeypatch, tmp_path, *, loras=None, draft=False, **plan_kw):
    module = vllm_release(monkeypatch, tmp_path, version=vllm)
    labels = [str(n) for n in loras] if loras else None
    plan = harness.vllm_plan(
        tmp_path, SIZES, keeps=HIDDEN_BYTES, loras=labels, draft=draft, draft_decode=_draft_decode(module), **plan_kw
    )
    monkeypatch.setenv(core.ENV_PLAN, str(plan_file(tmp_path, plan)))
    vllm_plugin.register()
    model = _vllm_model(cuda)
    runner = _vllm_runner(module, model, loras=loras, draft=draft)
    return module, plan, model, runner


def test_vllm_routes_a_plan_whose_draft_phases_keep_the_managers_order(vllm, cuda, monkeypatch, tmp_path):
    """At the GPU test's sizes the optimizer, free to order phases by pool cost, put the draft
    decode FULL graphs before the draft prefill's, an order vLLM cannot follow (each speculator
    manager in turn): the plugin refused the plan. The spec's ``after`` states vLLM's order."""
    sizes = [1, 2, 4, 8, 16, 32]
    module = vllm_release(monkeypatch, tmp_path, version=vllm)
    plan = harness.vllm_plan(tmp_path, sizes, loras=["0", "1"], draft=True, draft_decode=_draft_decode(module, sizes))
    monkeypatch.setenv(core.ENV_PLAN, str(plan_file(tmp_path, plan)))
    vllm_plugin.register()
    model = ToyModel({"piecewise": 1}, max_tokens=max(sizes) * harness.DRAFT_QUERY, fake=cuda)
    runner = harness.vllm_runner_of(module, model, sizes, loras=[0, 1], draft=model)
    runner.capture_model()
    gs = module.CudaGraphManager.__capture_plan__.loop.graphs
    assert [m.id for m in gs.report.steps] == [s.id for s in plan.steps]
    runner.release()


def test_vllm_routes_pieces_full_graphs_twins_lora_and_the_speculator_through_the_plan(
    vllm, cuda, monkeypatch, tmp_path
):
    module, plan, model, runner = _vllm_routed(vllm, cuda, monkeypatch, tmp_path, loras=[0, 1], draft=True)
    # the planner's LoRA plan (spec `variants = { loras = [...] }`), the axis the plugin labels
    axes = {p.name: [a.name for a in p.variants] for p in plan.phases if p.variants}
    assert axes == {"piecewise": ["loras"], "full_decode": ["loras"], "full_decode_ubatch": ["loras"]}
    runner.capture_model()
    adoption = module.CudaGraphManager.__capture_plan__
    gs = adoption.loop.graphs  # closed: every plan key captured by vLLM's own managers
    assert [m.id for m in gs.report.steps] == [s.id for s in plan.steps]
    manager, spec = runner.cudagraph_manager, runner.speculator
    # every graph the managers hold is one of the loop's, in the plan's pool
    full = {(d.num_tokens, d.num_active_loras, d.num_ubatches) for d in manager.graphs}
    assert full == {(n, lo, ub) for n in SIZES for lo in (0, 1) for ub in (1, 2) if ub == 1 or n >= 2}
    assert {d.num_tokens for d in spec.prefill_cudagraph_manager.graphs} == {3, 6}
    assert {d.num_tokens for d in spec.decode_cudagraph_manager.graphs} == set(_draft_decode(module) or SIZES)
    (pool,) = gs.pools.values()
    everything = [*manager.graphs.values(), *spec.prefill_cudagraph_manager.graphs.values()]
    everything += [
        e.cudagraph for w in module.CUDAGraphWrapper._all_instances for e in w.concrete_cudagraph_entries.values()
    ]
    assert len(everything) == len(gs.graphs) - len(spec.decode_cudagraph_manager.graphs)
    assert all(g.pool() == pool for g in everything)
    assert manager.pool == module.get_global_graph_pool() != pool  # vLLM's own, restored after
    # a twin recorded on the micro-batch runner's stream, the rest on vLLM's capture stream
    for desc, graph in manager.graphs.items():
        want = runner.ubatch_runner.capture_stream if desc.num_ubatches > 1 else manager.capture_stream
        assert graph.stream == want, desc
    # three pieces a PIECEWISE key (the model's and the draft's), held as views
    for lo in ("0", "1"):
        for k in range(3):
            cap = gs.graphs[(f"piecewise/loras={lo}#{k}", 8)]
            assert cap.held == "view" and cap.graph is module.entry(manager.compiled.pieces[k], 8, int(lo)).cudagraph
    assert all((f"draft_prefill_piecewise#{k}", 8) in gs.graphs for k in range(3))
    # the persistent hidden states: the first warm-up's (declared, measured), every FULL graph's output
    assert gs.report.warmup_kept_bytes == HIDDEN_BYTES == manager.hidden_states.untyped_storage().nbytes()
    model.x.normal_()
    for name in ("full_decode/loras=0", "full_decode/loras=1", "full_decode_ubatch/loras=1"):
        for n in (2, 3, 8):
            (out,) = gs.replay(name, n)
            assert out.data_ptr() == manager.hidden_states.data_ptr()
            assert torch.allclose(out, model.expected_pieces(n), atol=1e-6), (name, n)
    # the LoRA capture hook ran per descriptor build with its LoRA count
    assert {lo for lo, _, _ in manager.lora_calls} == {0, 1}
    # the draft's graphs write into the speculator's buffer
    gs.replay("draft_decode_full_decode", 4)
    assert torch.allclose(spec.draft_tokens[:4], model.expected_pieces(4), atol=1e-6)
    runner.release()
    gs.release()


def test_vllm_follows_a_plan_that_captures_smallest_first(vllm, cuda, monkeypatch, tmp_path):
    module, plan, model, runner = _vllm_routed(vllm, cuda, monkeypatch, tmp_path, order=("order=smallest-first",))
    runner.capture_model()
    manager = runner.cudagraph_manager
    P = module.CUDAGraphMode.PIECEWISE
    # the plan's order within each mode (vLLM's is largest first); with 0.33.0 one warm-up at
    # the largest first, as it sizes its persistent hidden states from its first warm-up;
    # 0.34.0 sizes them up front for the widest descriptor, so no warm-up is added
    warm = [(d.cg_mode, d.num_tokens) for d, w in manager.builds if w]
    first = [(P, 8)] if vllm == "0.33.0" else []
    assert warm[: len(first) + 4] == [*first, (P, 1), (P, 2), (P, 4), (P, 8)]
    # each micro-batch twin right after its FULL graph (twin_of), as vLLM captures them
    assert [d.num_tokens for d in manager.graphs] == [1, 2, 2, 4, 4, 8, 8]
    gs = module.CudaGraphManager.__capture_plan__.loop.graphs
    # that warm-up runs inside the first step's warm-up block: the persistent buffer is measured
    assert gs.report.warmup_kept_bytes == HIDDEN_BYTES == manager.hidden_states.untyped_storage().nbytes()
    model.x.normal_()
    (out,) = gs.replay("full_decode", 3)
    assert torch.allclose(out, model.expected_pieces(3), atol=1e-6)
    runner.release()
    gs.release()


def test_vllm_names_a_mixed_full_graphs_twin_for_its_descriptor(vllm, cuda, monkeypatch, tmp_path):
    """vLLM's FULL mode captures mixed FULL graphs, each with a micro-batch twin whose
    uniform_token_count _maybe_ubatch_twin sets: the twin is full_mixed_ubatch (twin_of
    full_mixed), not a uniform-decode twin."""
    from engines.plans import build

    module = vllm_release(monkeypatch, tmp_path, version=vllm)
    spec = (
        f'[[phases]]\nname = "full_mixed"\nkind = "full"\nsizes = {SIZES}\n'
        '[[phases]]\nname = "full_mixed_ubatch"\nkind = "full"\nsizes = [2, 4, 8]\ntwin_of = "full_mixed"\n'
        'stream = "ubatch"\nmicro_batches = 2\n'
    )
    plan = build(tmp_path, spec, "warmup=every-size", "outputs=view")
    monkeypatch.setenv(core.ENV_PLAN, str(plan_file(tmp_path, plan)))
    vllm_plugin.register()
    model = _vllm_model(cuda)
    module.reset_globals()
    runner = module.GPUModelRunner(
        model, SIZES, ubatch_stream=torch.cuda.Stream(), cudagraph_mode=module.FULL_MIXED_ONLY
    )
    twins = [d for d in runner.cudagraph_manager._capture_descs[module.CUDAGraphMode.FULL] if d.num_ubatches > 1]
    assert twins and all(d.uniform_token_count is not None for d in twins)  # as vLLM sets them
    runner.capture_model()
    gs = module.CudaGraphManager.__capture_plan__.loop.graphs
    assert [m.id for m in gs.report.steps] == [s.id for s in plan.steps]
    manager = runner.cudagraph_manager
    assert [(d.num_tokens, d.num_ubatches) for d in manager.graphs] == [
        (8, 1), (8, 2), (4, 1), (4, 2), (2, 1), (2, 2), (1, 1)
    ]  # fmt: skip
    for desc, graph in manager.graphs.items():
        want = runner.ubatch_runner.capture_stream if desc.num_ubatches > 1 else manager.capture_stream
        assert graph.stream == want, desc
    model.x.normal_()
    for name in ("full_mixed", "full_mixed_ubatch"):
        (out,) = gs.replay(name, 3)
        assert torch.allclose(out, model.expected_pieces(3), atol=1e-6), name
    runner.release()
    gs.release()


def test_the_runners_desc_key_names_every_descriptor_as_the_plugin_does(vllm, cuda, monkeypatch, tmp_path):
    """tests/engines/vllm_runner.desc_key (the adopted runner's, which must not import the
    plugin: the runner stands in for the engine) and the plugin's phase_of agree on every
    descriptor the runner makes: LoRA cases, twins of uniform-decode and of mixed FULL
    graphs, the speculator's managers."""
    from engines import vllm_runner

    module = vllm_release(monkeypatch, tmp_path, version=vllm)
    model = _vllm_model(cuda)
    configs = [
        {"lora_capture_cases": [0, 1], "draft": model},
        {"cudagraph_mode": module.FULL_MIXED_ONLY},
        {"cudagraph_mode": module.FULL_DECODE_ONLY},
    ]
    seen = set()
    for kw in configs:
        module.reset_globals()
        runner = module.GPUModelRunner(model, SIZES, ubatch_stream=torch.cuda.Stream(), **kw)
        prefixes = {id(m): p for p, m in vllm_plugin.managers(runner, module.CudaGraphManager)}
        for key in vllm_plugin.engine_keys(runner, module.CudaGraphManager):
            manager, desc = key.native
            loras = manager.lora_capture_cases != [0]
            phase, _, labels = vllm_runner.desc_key(
                desc, prefixes[id(manager)], loras, manager._capture_descs[desc.cg_mode]
            )
            assert phase == key.phase, desc
            assert set(labels) <= set(key.labels)
            seen.add(phase)
    assert {"piecewise", "full_decode", "full_decode_ubatch", "full_mixed", "full_mixed_ubatch"} <= seen
    assert {"draft_prefill_piecewise", "draft_prefill_full_decode", "draft_decode_full_decode"} <= seen


def test_vllm_leaves_out_the_draft_decode_graphs_a_one_step_speculator_never_captures(
    vllm, cuda, monkeypatch, tmp_path
):
    """With one speculative step vLLM's speculator captures its draft prefill only: a plan with
    draft decode graphs is refused before the first graph, a plan without them is followed."""
    from engines.plans import build, keyed

    module, plan, model, runner = _vllm_routed(vllm, cuda, monkeypatch, tmp_path, draft=True)
    runner.speculator.num_speculative_steps = 1
    drafts = len(_draft_decode(module) or SIZES)
    with pytest.raises(
        core.PluginRefused, match=rf"the plan holds {drafts} graph keys vllm does not capture \(capture/draft_decode"
    ):
        runner.capture_model()
    assert runner.cudagraph_manager.builds == []
    spec = harness.vllm_spec(SIZES, draft=True).split('[[phases]]\nname = "draft_decode_full_decode"')[0]
    plan = build(tmp_path, spec, "warmup=every-size", "outputs=view")
    plan = keyed(
        keyed(plan, "piecewise", pieces=3, keeps={8: HIDDEN_BYTES}),
        "full_decode_ubatch",
        stream="ubatch",
        micro_batches=2,
    )
    plan = keyed(plan, "draft_prefill_piecewise", pieces=3)
    module = vllm_release(monkeypatch, tmp_path, version=vllm)
    monkeypatch.setenv(core.ENV_PLAN, str(plan_file(tmp_path, plan)))
    vllm_plugin.register()
    runner = _vllm_runner(module, model, draft=True)
    runner.speculator.num_speculative_steps = 1
    runner.capture_model()
    gs = module.CudaGraphManager.__capture_plan__.loop.graphs
    assert [m.id for m in gs.report.steps] == [s.id for s in plan.steps]
    assert runner.speculator.decode_cudagraph_manager.graphs == {}
    runner.release()
    gs.release()


def test_vllm_a_listed_graph_vllm_does_not_capture_is_one_error_and_nothing_is_left(vllm, cuda, monkeypatch, tmp_path):
    """A manager whose graphs were listed and matched but which vLLM's capture_model skips
    (a path the plugin does not know): the loop is incomplete when capture_model returns, so
    the plugin closes it, which names the first step not captured and releases every graph."""
    from capture_plan.executor import ExecutorError

    module, plan, model, runner = _vllm_routed(vllm, cuda, monkeypatch, tmp_path, draft=True)
    monkeypatch.setattr(
        module.EagleSpeculator, "capture", lambda self: self.prefill_cudagraph_manager.capture(self._forward)
    )
    with pytest.raises(ExecutorError, match=r"capture/draft_decode_full_decode/8") as err:
        runner.capture_model()
    assert "\n" not in str(err.value)
    assert runner.cudagraph_manager.graphs == {} and runner.speculator.prefill_cudagraph_manager.graphs == {}
    assert all(not w.concrete_cudagraph_entries for w in module.CUDAGraphWrapper._all_instances)
    gc.collect()
    assert cuda.snapshot() == []


def _without_twins(plan):
    import msgspec

    from capture_plan.schemas.codec import seal

    steps = [s for s in plan.steps if s.phase != "full_decode_ubatch"]
    steps = [msgspec.structs.replace(s, index=i) for i, s in enumerate(steps)]
    timeline = [msgspec.structs.replace(m, step=i) for i, m in enumerate(plan.predicted.timeline[: len(steps)])]
    phases = [p for p in plan.phases if p.name != "full_decode_ubatch"]
    predicted = msgspec.structs.replace(plan.predicted, timeline=timeline)
    edges = [e for e in plan.edges if "ubatch" not in e.src and "ubatch" not in e.dst]
    return seal(msgspec.structs.replace(plan, steps=steps, phases=phases, predicted=predicted, edges=edges))


@pytest.mark.parametrize("fallback", [False, True], ids=["refuse", "fallback"])
def test_vllm_refuses_a_plan_without_graphs_it_captures_before_the_first(
    vllm, cuda, monkeypatch, tmp_path, fallback, caplog
):
    module = vllm_release(monkeypatch, tmp_path, version=vllm)
    plan = harness.vllm_plan(tmp_path, SIZES, keeps=HIDDEN_BYTES)
    path = plan_file(tmp_path, _without_twins(plan))
    monkeypatch.setenv(core.ENV_PLAN, str(path))
    if fallback:
        monkeypatch.setenv(core.ENV_FALLBACK, "engine")
    vllm_plugin.register()
    runner = _vllm_runner(module, _vllm_model(cuda))
    if not fallback:
        with pytest.raises(core.PluginRefused) as err:
            runner.capture_model()
        line = str(err.value)
        assert "\n" not in line and f"{core.ENV_PLAN}={path}" in line
        assert "vllm captures 3 graphs the plan does not hold (full_decode_ubatch/8 tokens x2 micro-batches" in line
        assert runner.cudagraph_manager.builds == [] and runner.cudagraph_manager.graphs == {}  # before the first
        return
    with caplog.at_level(logging.WARNING, logger="capture_plan.plugins"):
        runner.capture_model()
    assert "capturing as vllm does (CAPTURE_PLAN_FALLBACK=engine)" in caplog.text
    assert len(runner.cudagraph_manager.graphs) == 7  # vLLM's own capture, whole
    runner.release()


def test_vllm_refuses_a_plan_whose_order_it_cannot_follow(vllm, cuda, monkeypatch, tmp_path):
    """vLLM records PIECEWISE before FULL: a plan with its FULL phase first is refused."""
    from engines.plans import build, keyed

    module = vllm_release(monkeypatch, tmp_path, version=vllm)
    spec = harness.vllm_spec(SIZES).replace('after = ["piecewise"]\n', "")  # vLLM's order, dropped
    first, rest = spec.split('[[phases]]\nname = "full_decode"')
    plan = build(tmp_path, '[[phases]]\nname = "full_decode"' + rest + first, "warmup=every-size", "outputs=view")
    plan = keyed(keyed(plan, "piecewise", pieces=3), "full_decode_ubatch", stream="ubatch", micro_batches=2)
    assert [s.phase for s in plan.steps][0] == "full_decode"  # the planner keeps the spec's order
    runner, line = _vllm_refused(module, plan, cuda, monkeypatch, tmp_path)
    assert "\n" not in line and re.search(r"the plan captures capture/full_decode/\d+ before capture/piecewise/8", line)
    assert f"which vllm cannot follow ({vllm_plugin.ORDER})" in line and "then FULL" in vllm_plugin.ORDER
    assert runner.cudagraph_manager.graphs == {}


@pytest.mark.parametrize("phase", ["piecewise", "full_decode"])
def test_vllm_refuses_a_plan_whose_phase_is_not_as_piecewise_as_vllms_mode(vllm, cuda, monkeypatch, tmp_path, phase):
    """The plugin reads whether a phase's graphs are pieces from the plan (its kind's
    property, ``PlanIndex.piecewise``), never from a kind's name: a plan that says otherwise
    than vLLM's descriptors (PIECEWISE pieces, FULL whole) is refused before the first graph."""
    module = vllm_release(monkeypatch, tmp_path, version=vllm)
    plan = harness.vllm_plan(tmp_path, SIZES, keeps=HIDDEN_BYTES, draft_decode=_draft_decode(module))
    flip = msgspec.UNSET if phase == "piecewise" else True
    plan = msgspec.structs.replace(
        plan, phases=[msgspec.structs.replace(p, piecewise=flip) if p.name == phase else p for p in plan.phases]
    )
    runner, line = _vllm_refused(module, plan, cuda, monkeypatch, tmp_path)
    said = "PIECEWISE pieces" if phase == "piecewise" else "one FULL graph"
    assert "\n" not in line and f"vLLM records capture/{phase}/" in line and said in line
    assert f"the plan's phase {phase!r} (kind " in line and ("is not piecewise" in line) == (phase == "piecewise")
    assert runner.cudagraph_manager.graphs == {}


@pytest.mark.parametrize(
    "pieces,message",
    [
        (4, r"capture/piecewise/8\): the engine's loop moved on to piecewise/4 after 3 of the step's 4 pieces"),
        (2, r"capture/piecewise/8\): the engine records a piece more than the 2 the plan's step has"),
    ],
)
def test_vllm_a_piece_count_that_differs_from_the_plans_leaves_no_graph(
    vllm, cuda, monkeypatch, tmp_path, pieces, message
):
    from capture_plan.executor import ExecutorError

    module, plan, model, runner = _vllm_routed(vllm, cuda, monkeypatch, tmp_path, pieces=pieces)
    with pytest.raises(ExecutorError, match=message):
        runner.capture_model()
    assert runner.cudagraph_manager.graphs == {}
    assert all(not w.concrete_cudagraph_entries for w in module.CUDAGraphWrapper._all_instances)
    gc.collect()
    assert cuda.snapshot() == []


def test_vllm_a_warm_up_keeping_more_than_declared_names_the_step(vllm, cuda, monkeypatch, tmp_path):
    from capture_plan.executor import ExecutorError

    module = vllm_release(monkeypatch, tmp_path, version=vllm)
    plan = harness.vllm_plan(tmp_path, SIZES, keeps=HIDDEN_BYTES // 2)
    monkeypatch.setenv(core.ENV_PLAN, str(plan_file(tmp_path, plan)))
    vllm_plugin.register()
    runner = _vllm_runner(module, _vllm_model(cuda))
    with pytest.raises(ExecutorError, match=r"warmup/piecewise/8\): the warm-up kept 256 B past its block"):
        runner.capture_model()
    assert runner.cudagraph_manager.graphs == {}


def _dynamic_speculator(runner) -> None:
    """vLLM's TargetDependentARSpeculator with dynamic speculative decoding: its capture passes
    specialize_spec_tokens=supports_decode_metadata_update and uses_dynamic_speculative_decoding()."""
    import types

    runner.speculator.supports_decode_metadata_update = True
    runner.speculator.speculative_config = types.SimpleNamespace(uses_dynamic_speculative_decoding=lambda: True)


_UNROUTED = {
    "sleep": ("cuMem pool", lambda r: setattr(r.vllm_config, "use_cumem_cudagraph_pool", True)),
    "breakable": ("breakable PIECEWISE graphs", lambda r: setattr(r.cudagraph_manager, "use_breakable_cg", True)),
    "pipeline": (
        r"pipeline parallelism \(pipeline_parallel_size=2\): a rank before the last returns intermediate tensors",
        lambda r: setattr(r.vllm_config.parallel_config, "pipeline_parallel_size", 2),
    ),
    "dynamic-speculator": (
        "dynamic speculative decoding .* makes the draft decode graphs per speculative token count",
        _dynamic_speculator,
    ),
}


@pytest.mark.parametrize("setting", list(_UNROUTED))
def test_vllm_refuses_what_it_does_not_route_in_one_line_before_the_first_graph(
    vllm, cuda, monkeypatch, tmp_path, setting
):
    module = vllm_release(monkeypatch, tmp_path, version=vllm)
    monkeypatch.setenv(core.ENV_PLAN, str(plan_file(tmp_path, harness.vllm_plan(tmp_path, SIZES, draft=True))))
    vllm_plugin.register()
    runner = _vllm_runner(module, _vllm_model(cuda), draft=True)
    says, configure = _UNROUTED[setting]
    configure(runner)
    with pytest.raises(core.PluginRefused, match=f"{says}.*the plugin does not route it") as err:
        runner.capture_model()
    assert "\n" not in str(err.value) and "CAPTURE_PLAN_FALLBACK=engine" in str(err.value)
    assert runner.cudagraph_manager.builds == [] and runner.speculator.prefill_cudagraph_manager.builds == []


def test_vllm_captures_a_dynamic_speculator_as_it_does_where_the_operator_chose_so(
    vllm, cuda, monkeypatch, tmp_path, caplog
):
    module = vllm_release(monkeypatch, tmp_path, version=vllm)
    monkeypatch.setenv(core.ENV_PLAN, str(plan_file(tmp_path, harness.vllm_plan(tmp_path, SIZES, draft=True))))
    monkeypatch.setenv(core.ENV_FALLBACK, "engine")
    vllm_plugin.register()
    runner = _vllm_runner(module, _vllm_model(cuda), draft=True)
    _dynamic_speculator(runner)
    with caplog.at_level(logging.WARNING, logger="capture_plan.plugins"):
        runner.capture_model()
    assert "dynamic speculative decoding" in caplog.text and "capturing as vLLM does" in caplog.text
    assert len(runner.cudagraph_manager.graphs) == 7 and runner.cudagraph_manager.pool == module.get_global_graph_pool()
    assert module.CudaGraphManager.__capture_plan__.loop is None  # no loop made: nothing half adopted
    runner.release()


def _calibrated(plan):
    from engines.plans import calibrated

    return calibrated(plan)


def test_vllm_answers_its_estimate_from_the_plan(vllm, cuda, monkeypatch, tmp_path, caplog):
    from capture_plan.schemas.keys import capture_memory

    module = vllm_release(monkeypatch, tmp_path, version=vllm)
    plan = harness.vllm_plan(tmp_path, SIZES, keeps=HIDDEN_BYTES)
    # not calibrated for a device: the figure is unknown, and the estimate is refused
    monkeypatch.setenv(core.ENV_PLAN, str(plan_file(tmp_path, plan, "raw.json")))
    vllm_plugin.register()
    runner = _kv_sized_before_capture(_vllm_runner(module, _vllm_model(cuda)))
    with pytest.raises(core.PluginRefused, match=r"reserve for capture: unknown.*--calibration REPORT"):
        runner.profile_cudagraph_memory()
    # calibrated: the plan's whole-capture figure, no profiling capture
    module = vllm_release(monkeypatch, tmp_path, version=vllm)
    calibrated = _calibrated(plan)
    monkeypatch.setenv(core.ENV_PLAN, str(plan_file(tmp_path, calibrated)))
    vllm_plugin.register()
    runner = _kv_sized_before_capture(_vllm_runner(module, _vllm_model(cuda)))
    figure = runner.profile_cudagraph_memory()
    assert figure == capture_memory(calibrated).bytes == vllm_plugin.plan_total(calibrated) > 30 * 2**20
    assert runner.cudagraph_manager.builds == []  # nothing captured to answer it
    runner.capture_model()  # then the capture, through the loop the estimate made
    assert module.CudaGraphManager.__capture_plan__.loop.complete
    runner.release()
    # the operator's choice: vLLM's own estimate (its extrapolation: the fake's memory never moves)
    module = vllm_release(monkeypatch, tmp_path, version=vllm)
    monkeypatch.setenv(core.ENV_PLAN, str(plan_file(tmp_path, plan, "raw.json")))
    monkeypatch.setenv(core.ENV_FALLBACK, "engine")
    vllm_plugin.register()
    runner = _kv_sized_before_capture(_vllm_runner(module, _vllm_model(cuda)))
    with caplog.at_level(logging.WARNING, logger="capture_plan.plugins"):
        assert runner.profile_cudagraph_memory() == (7 - 1) * module.MIB
    assert "vLLM profiles as it does" in caplog.text


@pytest.mark.parametrize("fallback", [False, True], ids=["refuse", "fallback"])
def test_vllm_checks_the_keys_at_capture_after_answering_the_estimate(
    vllm, cuda, monkeypatch, tmp_path, fallback, caplog
):
    """The estimate comes before vLLM made its managers (nothing to check the keys of then):
    the capture that follows checks them before its first graph, and refuses, or captures as
    vLLM does where the operator chose so."""
    module = vllm_release(monkeypatch, tmp_path, version=vllm)
    plan = _calibrated(_without_twins(harness.vllm_plan(tmp_path, SIZES, keeps=HIDDEN_BYTES)))
    monkeypatch.setenv(core.ENV_PLAN, str(plan_file(tmp_path, plan)))
    if fallback:
        monkeypatch.setenv(core.ENV_FALLBACK, "engine")
    vllm_plugin.register()
    runner = _kv_sized_before_capture(_vllm_runner(module, _vllm_model(cuda)))
    assert runner.profile_cudagraph_memory() == vllm_plugin.plan_total(plan)
    if not fallback:
        with pytest.raises(core.PluginRefused, match=r"vllm captures 3 graphs the plan does not hold") as err:
            runner.capture_model()
        assert "\n" not in str(err.value) and runner.cudagraph_manager.builds == []
        return
    with caplog.at_level(logging.WARNING, logger="capture_plan.plugins"):
        runner.capture_model()
    assert "capturing as vLLM does (CAPTURE_PLAN_FALLBACK=engine)" in caplog.text
    # vLLM sized its KV cache with the plan's figure: its own capture may take more, and the warning says so
    figure = vllm_plugin.plan_total(plan)
    assert f"its KV cache was sized with the plan's figure for graph memory ({figure} B), not vLLM's own" in caplog.text
    assert len(runner.cudagraph_manager.graphs) == 7  # vLLM's own capture, whole
    runner.release()


def test_vllm_captures_again_as_it_does_once_the_plans_capture_is_done(vllm, cuda, monkeypatch, tmp_path, caplog):
    """Elastic EP drops the graphs and captures again (release_graphs, then capture_model): the
    plan's capture is done, so vLLM's own capture records them, with a warning."""
    module, plan, model, runner = _vllm_routed(vllm, cuda, monkeypatch, tmp_path)
    runner.capture_model()
    gs = module.CudaGraphManager.__capture_plan__.loop.graphs
    runner.cudagraph_manager.release_graphs()
    with caplog.at_level(logging.WARNING, logger="capture_plan.plugins"):
        runner.capture_model()
    assert "vLLM captures again after the plan's capture; its own capture records it" in caplog.text
    assert len(runner.cudagraph_manager.graphs) == 7
    assert runner.cudagraph_manager.pool == module.get_global_graph_pool()  # vLLM's own pool
    runner.release()
    gs.release()


def test_vllm_a_graph_a_manager_adds_after_the_check_is_refused_and_nothing_is_left(vllm, cuda, monkeypatch, tmp_path):
    """A dynamic speculator specializes its descriptors inside its own capture, after
    capture_model listed them: such a graph was not checked against the plan, so the
    capture stops there, everything released."""
    import dataclasses

    module, plan, model, runner = _vllm_routed(vllm, cuda, monkeypatch, tmp_path, draft=True)
    decode = runner.speculator.decode_cudagraph_manager
    capture = module.EagleSpeculator.capture

    def specialized(self):
        full = decode._capture_descs[module.CUDAGraphMode.FULL]
        full.append(dataclasses.replace(full[0], max_query_len=7))  # one more graph, made late
        capture(self)

    monkeypatch.setattr(module.EagleSpeculator, "capture", specialized)
    from capture_plan.executor import CaptureFailed

    with pytest.raises(CaptureFailed) as err:
        runner.capture_model()
    line = str(err.value)
    assert "\n" not in line and "SpeculatorCudaGraphManager captures 1 graphs it did not list" in line
    assert "all partial graphs were released" in line and "CAPTURE_PLAN_FALLBACK" not in line  # not offered mid-capture
    assert runner.cudagraph_manager.graphs == {} and runner.speculator.prefill_cudagraph_manager.graphs == {}
    assert all(not w.concrete_cudagraph_entries for w in module.CUDAGraphWrapper._all_instances)
    gc.collect()
    assert cuda.snapshot() == []


def test_the_entry_points_name_the_plugins_under_the_engines_groups():
    """pyproject.toml registers each plugin under the group its engine loads (the group's
    name is a hook point, checked against the wheels)."""
    import importlib

    import tomllib

    groups = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"][
        "entry-points"
    ]
    want = {
        hook("sglang", "0.5.23", "GENERAL_PLUGINS_GROUP").signature.strip("= '"): sgl_plugin.register,
        hook("vllm", "0.33.0", "DEFAULT_PLUGINS_GROUP").signature.strip("= '"): vllm_plugin.register,
    }
    assert set(groups) == set(want)
    for group, fn in want.items():
        ((name, target),) = groups[group].items()
        module, attr = target.split(":")
        assert name == "capture_plan" and getattr(importlib.import_module(module), attr) is fn


# -- the installed engine checked live at registration ------------------------------------------


def test_an_unknown_vllm_whose_hook_points_are_a_known_releases_is_captured_by_the_plan(
    cuda, monkeypatch, tmp_path, caplog
):
    """vLLM 0.35.0 (not known) with 0.34.0's objects: one INFO line, and the capture goes
    through the plan, with 0.34.0's shape (no warm-up added for the persistent buffer)."""
    module = vllm_release(monkeypatch, tmp_path, version="0.34.0")
    monkeypatch.setattr(core, "installed", lambda dist: "0.35.0" if dist == "vllm" else "(not installed)")
    plan = harness.vllm_plan(tmp_path, SIZES, keeps=HIDDEN_BYTES)
    monkeypatch.setenv(core.ENV_PLAN, str(plan_file(tmp_path, plan)))
    with caplog.at_level(logging.INFO, logger="capture_plan.plugins"):
        vllm_plugin.register()
    (record,) = caplog.records
    assert record.levelno == logging.INFO
    assert record.message == (
        f"capture-plan: vllm 0.35.0 is not a release capture-plan knows; its {len(vllm_plugin.LIVE)} hook points "
        f"checked live are vllm 0.34.0's ({', '.join(vllm_plugin.LIVE)}): captured by the plan "
        f"{plan_file(tmp_path, plan)}"
    )
    runner = _vllm_runner(module, _vllm_model(cuda))
    runner.capture_model()
    gs = module.CudaGraphManager.__capture_plan__.loop.graphs
    assert [m.id for m in gs.report.steps] == [s.id for s in plan.steps]
    runner.release()
    gs.release()


def test_an_unknown_vllm_with_a_method_renamed_starts_capturing_as_it_does_with_one_warning(
    cuda, monkeypatch, tmp_path, caplog
):
    """A copy of the 0.34.0 shape whose GPUModelRunner.profile_cudagraph_memory is renamed,
    reported as 0.35.0: no known release's hook points match, so the plugin installs nothing,
    one WARNING names the first mismatched row (the newest release's), and vLLM starts and
    captures as it does; CAPTURE_PLAN_STRICT=1 stops the start-up with that line."""
    module = vllm_release(monkeypatch, tmp_path, version="0.34.0")
    runner_cls = module.GPUModelRunner
    runner_cls.estimate_cudagraph_memory = runner_cls.profile_cudagraph_memory
    del runner_cls.profile_cudagraph_memory
    monkeypatch.setattr(core, "installed", lambda dist: "0.35.0" if dist == "vllm" else "(not installed)")
    monkeypatch.setenv(core.ENV_PLAN, str(plan_file(tmp_path, harness.vllm_plan(tmp_path, SIZES))))
    before = [dict(vars(c)) for c in _classes(module)]
    with caplog.at_level(logging.INFO, logger="capture_plan.plugins"):
        vllm_plugin.register()
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and "\n" not in record.message
    assert "vllm 0.35.0: the hook points moved (vllm 0.34.0 row " in record.message
    assert "GPUModelRunner.profile_cudagraph_memory: not in the installed vllm (AttributeError" in record.message
    assert "fix: pip install vllm==0.34.0, or a capture-plan that knows vllm 0.35.0" in record.message
    assert [dict(vars(c)) for c in _classes(module)] == before  # nothing installed
    runner = _vllm_runner(module, _vllm_model(cuda))
    runner.capture_model()  # the server starts: vLLM's own capture
    assert len(runner.cudagraph_manager.graphs) == 7
    assert not hasattr(module.CudaGraphManager, "__capture_plan__")
    runner.release()
    monkeypatch.setenv(core.ENV_STRICT, "1")
    with pytest.raises(SystemExit) as exit_:
        vllm_plugin.register()
    assert "vllm 0.35.0: the hook points moved" in str(exit_.value.code)


def test_an_unknown_sglang_whose_hook_points_are_the_known_releases_is_captured_by_the_plan(
    cuda, monkeypatch, tmp_path, caplog
):
    """SGLang 0.5.24 (not known) with 0.5.23's objects: one INFO line, then SGLang's start-up
    captures every graph key through the plan (the runners' own loops, the plan's report)."""
    module = sglang_release(monkeypatch, tmp_path)
    monkeypatch.setattr(core, "installed", lambda dist: "0.5.24" if dist == "sglang" else "(not installed)")
    plan = harness.sglang_plan(tmp_path, SIZES)
    path = plan_file(tmp_path, plan)
    monkeypatch.setenv(core.ENV_PLAN, str(path))
    with caplog.at_level(logging.INFO, logger="capture_plan.plugins"):
        sgl_plugin.register()
    assert [r.message for r in caplog.records] == [
        f"capture-plan: sglang 0.5.24 is not a release capture-plan knows; its {len(sgl_plugin.LIVE)} hook points "
        f"checked live are sglang 0.5.23's ({', '.join(sgl_plugin.LIVE)}): captured by the plan {path}"
    ]
    adoption = module.FullCudaGraphBackend.__capture_plan__
    assert adoption is sgl_plugin.ADOPTION
    engine = harness.plugged_sglang_start(module, plan, _sgl_model(plan, cuda), SIZES)
    gs = adoption.loop.graphs
    assert [m.id for m in gs.report.steps] == [s.id for s in plan.steps]
    assert len(engine.graphs) == len(gs.graphs) == sum(s.op == "capture" for s in plan.steps)
    engine.cleanup()
    gs.release()


def test_a_known_release_registers_with_one_info_line(vllm, cuda, monkeypatch, tmp_path, caplog):
    """Issue 49, item 11: a known release's registration said nothing; now one INFO line names
    the release, the rows checked live and the plan that routes capture (fails before: no record)."""
    vllm_release(monkeypatch, tmp_path, version=vllm)
    path = plan_file(tmp_path, harness.vllm_plan(tmp_path, SIZES))
    monkeypatch.setenv(core.ENV_PLAN, str(path))
    with caplog.at_level(logging.INFO, logger="capture_plan.plugins"):
        vllm_plugin.register()
    assert [(r.levelno, r.message) for r in caplog.records] == [
        (
            logging.INFO,
            f"capture-plan: vllm {vllm}: its {len(vllm_plugin.LIVE)} hook points checked live hold "
            f"({', '.join(vllm_plugin.LIVE)}): captured by the plan {path}",
        )
    ]


def test_the_contract_checks_the_installed_vllms_hook_points_without_a_gpu(vllm, cuda, monkeypatch, tmp_path, capsys):
    """``python -m capture_plan.adapters.plugins.contract --installed``: the check registration
    runs, on the installed (here: engine-faithful) vLLM, no plan: its rows hold (exit 0); with a
    method renamed, the moved row is named (exit 1). Issue 49, item 12: there was no such mode."""
    from capture_plan.adapters.plugins.contract import main as contract

    module = vllm_release(monkeypatch, tmp_path, version=vllm)
    monkeypatch.delenv(core.ENV_PLAN, raising=False)
    assert contract(["--installed", "vllm"]) == 0
    assert capsys.readouterr().out == (
        f"vllm {vllm}: its {len(vllm_plugin.LIVE)} hook points checked live hold ({', '.join(vllm_plugin.LIVE)}): "
        "the plugin captures through a plan\n"
    )
    runner_cls = module.GPUModelRunner
    runner_cls.estimate_cudagraph_memory = runner_cls.profile_cudagraph_memory
    del runner_cls.profile_cudagraph_memory
    assert contract(["--installed", "vllm"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"the installed vllm: vllm {vllm}: the hook points moved (vllm {vllm} row ")
    assert "GPUModelRunner.profile_cudagraph_memory: not in the installed vllm (AttributeError" in err


def test_the_live_check_reads_names_kinds_and_literal_defaults():
    from capture_plan.adapters.plugins.hook_point import HookPoint

    def row(signature):
        return HookPoint("vllm", "0.0", "vllm/x.py", "f", signature, "")

    def f(self, create_forward_fn, progress_bar_desc="Capturing CUDA graphs", *, stream=None, limit=1 << 20):
        pass

    assert live.params_of_table(row("(self, a=1 << 20, *, b=None)").signature) == [
        ("self", "POSITIONAL_OR_KEYWORD", None),
        ("a", "POSITIONAL_OR_KEYWORD", "1 << 20"),
        ("b", "KEYWORD_ONLY", "None"),
    ]
    import inspect

    params = list(inspect.signature(f).parameters.values())
    want = live.params_of_table(
        "(self, create_forward_fn, progress_bar_desc='Capturing CUDA graphs', *, stream=None, limit=1 << 20)"
    )
    assert all(
        p.name == n and p.kind.name == k and live.same_default(d, p.default) for p, (n, k, d) in zip(params, want)
    )
    assert not live.same_default("'Capturing'", "Capturing CUDA graphs")  # another literal
    assert not live.same_default(None, None)  # a default where the release has none
    assert live.same_default("1 << 20", 1 << 20)  # an expression: presence only


# -- vLLM sizing its KV cache after capture (0.34.0's extensible KV cache) ----------------------

CAPACITY = 1 << 34
BLOCK = 1 << 20


def _device_memory(monkeypatch, runner, per_graph):
    """The fake device's free memory: what every graph the runner holds takes off it
    (``per_graph(n)`` for n graphs: FULL graphs and compiled pieces), as a real pool does."""

    def graphs() -> int:
        managers = [runner.cudagraph_manager]
        if runner.speculator is not None:
            managers += [runner.speculator.prefill_cudagraph_manager, runner.speculator.decode_cudagraph_manager]
        pieces = sum(
            e.cudagraph is not None
            for w in type(runner.cudagraph_manager.compiled.pieces[0])._all_instances
            for e in w.concrete_cudagraph_entries.values()
        )
        return sum(len(m.graphs) for m in managers) + pieces

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (CAPACITY - per_graph(graphs()), CAPACITY))


def _kv_blocks(monkeypatch, module, model, per_graph) -> tuple[int, object]:
    runner = _vllm_runner(module, model)
    _device_memory(monkeypatch, runner, per_graph)
    worker = module.Worker(runner, block_bytes=BLOCK, requested_memory=CAPACITY)
    worker.determine_available_memory()
    worker.initialize_from_config()
    return worker.compile_or_warm_up_model(), runner


def test_vllm_sizes_the_same_kv_cache_after_capture_with_the_plugin_as_without(cuda, monkeypatch, tmp_path):
    """vLLM 0.34.0 with its extensible KV cache: the plugin answers the estimate as vLLM does
    (0), the capture goes through the plan, and the KV cache vLLM sizes after capture is the
    one it sizes without the plugin. Answering with the plan's figure (what the plugin did
    for 0.33.0's order) would count graph memory twice: the cache shrinks by that figure."""
    plan = _calibrated(harness.vllm_plan(tmp_path, SIZES, keeps=HIDDEN_BYTES))
    model = _vllm_model(cuda)
    per_graph = lambda n: n * (4 << 20)  # noqa: E731
    module = vllm_release(monkeypatch, tmp_path, version="0.34.0")
    monkeypatch.delenv(core.ENV_PLAN, raising=False)
    alone, runner = _kv_blocks(monkeypatch, module, model, per_graph)
    # 7 FULL graphs, 4 PIECEWISE keys x 3 pieces; vLLM keeps its margin floor free (extensible_kv_cache.py)
    assert alone == (CAPACITY - 19 * (4 << 20) - module.KV_CACHE_MARGIN_FLOOR_BYTES) // BLOCK
    runner.release()

    module = vllm_release(monkeypatch, tmp_path, version="0.34.0")
    monkeypatch.setenv(core.ENV_PLAN, str(plan_file(tmp_path, plan)))
    vllm_plugin.register()
    routed, runner = _kv_blocks(monkeypatch, module, model, per_graph)
    adoption = module.CudaGraphManager.__capture_plan__
    assert adoption.loop.complete and routed == alone
    assert runner.extensible_kv_cache.reserved_headroom_bytes == 0  # graph memory counted once: measured
    runner.release()
    adoption.loop.graphs.release()

    # the plan's figure as the answer (the deferral switched off): counted twice, the cache smaller
    module = vllm_release(monkeypatch, tmp_path, version="0.34.0")
    monkeypatch.setattr(vllm_plugin, "sizes_kv_cache_after_capture", lambda runner: False)
    vllm_plugin.register()
    twice, runner = _kv_blocks(monkeypatch, module, model, per_graph)
    assert twice == alone - vllm_plugin.plan_total(plan) // BLOCK
    runner.release()
    module.CudaGraphManager.__capture_plan__.loop.graphs.release()


@pytest.mark.parametrize("off_by", [0, 2], ids=["as-predicted", "twice-the-prediction"])
def test_vllm_checks_the_plans_prediction_against_what_the_capture_took(cuda, monkeypatch, tmp_path, caplog, off_by):
    """With the KV cache sized after capture, the plan's figure is checked against vLLM's own
    measure of its capture (capture_model's free-memory drop): the figure in the capture
    report, and one WARNING naming the gap where it is wider than the tolerance."""
    plan = _calibrated(harness.vllm_plan(tmp_path, SIZES, keeps=HIDDEN_BYTES))
    predicted = vllm_plugin.plan_total(plan)
    module = vllm_release(monkeypatch, tmp_path, version="0.34.0")
    monkeypatch.setenv(core.ENV_PLAN, str(plan_file(tmp_path, plan)))
    vllm_plugin.register()
    took = predicted * (off_by or 1)
    with caplog.at_level(logging.INFO, logger="capture_plan.plugins"):
        blocks, runner = _kv_blocks(monkeypatch, module, _vllm_model(cuda), lambda n: took * n // 19)
    report = module.CudaGraphManager.__capture_plan__.loop.graphs.report
    assert report.engine_capture_bytes == took
    assert "vLLM sizes its KV cache after capture (extensible KV cache): its estimate stands (0 B)" in caplog.text
    warnings = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    if not off_by:
        assert warnings == []
    else:
        (line,) = warnings
        assert f"vLLM's capture took {took} B, the plan predicted {predicted} B (more by {took - predicted} B" in line
        assert "vLLM sized its KV cache after capture, from what it took" in line and "--calibration" in line
    runner.release()
    module.CudaGraphManager.__capture_plan__.loop.graphs.release()


@pytest.mark.parametrize("post_capture", [False, True], ids=["reserve", "post-capture-sizing"])
def test_sglang_checks_the_plans_figure_against_the_capture_where_it_sizes_its_kv_cache_after(
    cuda, monkeypatch, tmp_path, caplog, post_capture
):
    """With SGLANG_ENABLE_POST_CAPTURE_KV_SIZING SGLang sizes its KV cache from what the
    capture left free: the plan's figure is checked against the loop's measure of the capture
    (its report's free-memory drop; the fake device's free memory falls by a fixed share per
    graph recorded), one WARNING naming the gap; without it SGLang's reserve stands and
    nothing is checked."""
    import fake_cuda
    from engines.plans import calibrated

    module = sglang_release(monkeypatch, tmp_path)
    plan = calibrated(harness.sglang_plan(tmp_path, SIZES))
    monkeypatch.setenv(core.ENV_PLAN, str(plan_file(tmp_path, plan)))
    if post_capture:
        monkeypatch.setenv(sgl_plugin.POST_CAPTURE_ENV, "1")
    predicted = vllm_plugin.plan_total(plan)
    graphs = sum(s.op == "capture" for s in plan.steps)
    per_graph = 3 * predicted // graphs  # about three times the prediction, once every graph is recorded
    recorded = []
    end = fake_cuda.FakeGraph.capture_end

    def capture_end(graph):
        recorded.append(graph)
        end(graph)

    monkeypatch.setattr(fake_cuda.FakeGraph, "capture_end", capture_end)
    monkeypatch.setattr(
        torch.cuda, "mem_get_info", lambda device=None: (CAPACITY - per_graph * len(recorded), CAPACITY)
    )
    sgl_plugin.register()
    with caplog.at_level(logging.WARNING, logger="capture_plan.plugins"):
        engine = harness.plugged_sglang_start(module, plan, _sgl_model(plan, cuda), SIZES)
    assert len(recorded) == graphs
    took = per_graph * graphs
    assert module.FullCudaGraphBackend.__capture_plan__.loop.graphs.report.device_view.drop == took
    lines = [r.message for r in caplog.records]
    if post_capture:
        (line,) = lines
        assert f"SGLang's capture took {took} B, the plan predicted {predicted} B (more by {took - predicted} B" in line
        assert "SGLang sizes its KV cache after capture (SGLANG_ENABLE_POST_CAPTURE_KV_SIZING)" in line
    else:
        assert lines == []
    engine.cleanup()
    module.FullCudaGraphBackend.__capture_plan__.loop.graphs.release()
