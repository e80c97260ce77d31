"""The engine plugins (capture_plan.adapters.plugins) on engine-shaped runners placed
under the engines' module paths in this process (CUDA faked, tests/fake_cuda.py): the
runners here have the released engines' class, method and parameter names
(tests/test_engine_contract.py checks those against the wheels) and the shape of
their capture (SGLang 0.5.23: capture_session -> _capture_one_stream over
reversed(capture_bs) -> capture_one_shape -> FullCudaGraphBackend.capture_one with 2
warm-ups and ``device_module.graph``; vLLM 0.33.0: CudaGraphManager.capture over
largest-first FULL descriptors, a warm-up per descriptor that fills the persistent
hidden-state buffer, ``torch.cuda.graph(graph, pool)``).

Checked: disabled, nothing changes; an unknown release, a missing plan and a plan for
another TP size are refused with one line (or, where chosen, the engine captures as
it does, with a warning); enabled, the engine's own loop captures in the plan's order,
into the plan's pool, with its outputs held, and the loop's report is complete; a
failure inside the engine's capture leaves no graph behind.
"""

from __future__ import annotations

import contextlib
import logging
import types
from pathlib import Path

import pytest

from capture_plan.adapters.plugins import core, sglang as sgl_plugin, vllm as vllm_plugin
from capture_plan.adapters.plugins.hooks import hook

# before the engines' runners, which import torch: a machine without it skips, naming it
torch = pytest.importorskip("torch")

from plugin_engines import sglang_engine, vllm_engine  # noqa: E402

CPU = torch.device("cpu")


def _plan_file(tmp_path: Path, order: str = "smallest-first", sizes=(1, 2, 4, 8), phase="decode") -> Path:
    from capture_plan.planner import BuildOptions, build_plan
    from capture_plan.schemas.codec import canonical_bytes

    spec = tmp_path / "spec.toml"
    spec.write_text(f'[[phases]]\nname = "{phase}"\nkind = "decode"\nsizes = {list(sizes)}\n')
    plan = build_plan(BuildOptions(backend="torch", spec=spec, strategies=("outputs=keep", f"order={order}")))
    path = tmp_path / "plan.json"
    path.write_bytes(canonical_bytes(plan))
    return path


class Model:
    """out = x[:rows] * 2 + 1, a fresh tensor in the pool while a graph records."""

    def __init__(self, fake, max_rows=64):
        self.fake, self.x, self.calls = fake, torch.randn(max_rows, 4), []
        self.fail_at: int | None = None

    def forward(self, bs: int):
        g = self.fake.recording
        self.calls.append((bs, g is not None))
        if g is not None and bs == self.fail_at:
            raise ValueError("boom")
        out = self.fake.pool_tensor(bs, 4) if g is not None else torch.empty(bs, 4)

        def compute():
            torch.add(self.x[:bs] * 2, 1, out=out)

        compute()
        if g is not None:
            g.calls.append(compute)
        return out


@pytest.fixture
def cuda(fake, monkeypatch):
    """The fake CUDA plus ``torch.cuda.graph`` (recording on the given stream)."""

    @contextlib.contextmanager
    def graph(cuda_graph, pool=None, stream=None, capture_error_mode="global"):
        with torch.cuda.stream(stream):
            cuda_graph.capture_begin(pool=pool)
            try:
                yield
            finally:
                cuda_graph.capture_end()

    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(sgl_plugin, "LOOP_OPTIONS", {"device": CPU})
    monkeypatch.setattr(vllm_plugin, "LOOP_OPTIONS", {"device": CPU})
    return fake


# -- SGLang 0.5.23, shaped (tests/plugin_engines.py) -------------------------------------------


def _runner(cls, fake, tp=1, sizes=(1, 2, 4, 8)):
    return cls(types.SimpleNamespace(tp_size=tp, model_config=None), Model(fake), sizes)


def test_disabled_the_sglang_plugin_changes_nothing(cuda, monkeypatch):
    runner_cls, backend_cls = sglang_engine(monkeypatch)
    before = dict(vars(runner_cls)), dict(vars(backend_cls))
    monkeypatch.delenv(core.ENV_PLAN, raising=False)
    sgl_plugin.register()
    assert (dict(vars(runner_cls)), dict(vars(backend_cls))) == before
    runner = _runner(runner_cls, cuda)
    runner.capture()
    assert [bs for bs, rec in runner.model.calls if rec] == [8, 4, 2, 1]  # SGLang's own order


def test_enabled_the_engines_loop_captures_in_the_plans_order_into_its_pool(cuda, monkeypatch, tmp_path):
    runner_cls, backend_cls = sglang_engine(monkeypatch)
    monkeypatch.setenv(core.ENV_PLAN, str(_plan_file(tmp_path, "smallest-first")))
    sgl_plugin.register()
    adoption = backend_cls.__capture_plan__
    runner = _runner(runner_cls, cuda)
    runner.capture()
    # the runner's own loop, 2 warm-ups and a recording per size, in the plan's order
    assert runner.model.calls == [(bs, rec) for bs in (1, 2, 4, 8) for rec in (False, False, True)]
    assert runner.capture_bs == [1, 2, 4, 8]  # the engine's list is left as it was
    graphs = adoption.loop.graphs  # the loop closed with the plan's last capture
    assert [m.id for m in graphs.report.steps if m.id.startswith("capture/")] == [
        f"capture/decode/{bs}" for bs in (1, 2, 4, 8)
    ]
    pool = graphs.pools[next(iter(graphs.pools))]
    assert all(g.pool() == pool for g in runner.backend._graphs.values())
    (out,) = graphs.replay("decode", 3)  # padded to 4, the engine's graph replayed
    assert torch.equal(out, runner.model.x[:3] * 2 + 1)
    assert torch.equal(runner.backend._outputs[(4, None)], runner.model.x[:4] * 2 + 1)


def test_a_plan_for_another_tp_size_refuses_the_first_capture_in_one_line(cuda, monkeypatch, tmp_path):
    runner_cls, _ = sglang_engine(monkeypatch)
    path = _plan_file(tmp_path)
    monkeypatch.setenv(core.ENV_PLAN, str(path))
    sgl_plugin.register()
    runner = _runner(runner_cls, cuda, tp=2)
    with pytest.raises(core.PluginRefused) as err:
        runner.capture()
    line = str(err.value)
    assert "\n" not in line and f"{core.ENV_PLAN}={path}" in line
    assert "it is for TP 1, sglang runs TP 2" in line and "CAPTURE_PLAN_FALLBACK=engine" in line
    assert runner.model.calls == []  # nothing captured


def test_a_plan_for_another_tp_size_falls_back_with_a_warning_where_chosen(cuda, monkeypatch, tmp_path, caplog):
    runner_cls, _ = sglang_engine(monkeypatch)
    monkeypatch.setenv(core.ENV_PLAN, str(_plan_file(tmp_path)))
    monkeypatch.setenv(core.ENV_FALLBACK, "engine")
    sgl_plugin.register()
    runner = _runner(runner_cls, cuda, tp=2)
    with caplog.at_level(logging.WARNING, logger="capture_plan.plugins"):
        runner.capture()
    assert [bs for bs, rec in runner.model.calls if rec] == [8, 4, 2, 1]  # SGLang's own capture, whole
    assert "capturing as sglang does (CAPTURE_PLAN_FALLBACK=engine)" in caplog.text


def test_a_runner_whose_sizes_are_not_the_plans_is_refused(cuda, monkeypatch, tmp_path):
    runner_cls, _ = sglang_engine(monkeypatch)
    monkeypatch.setenv(core.ENV_PLAN, str(_plan_file(tmp_path)))
    sgl_plugin.register()
    runner = _runner(runner_cls, cuda, sizes=(1, 2, 4, 8, 16))
    with pytest.raises(core.PluginRefused, match=r"the decode runner captures sizes \[1, 2, 4, 8, 16\], the plan"):
        runner.capture()


def test_a_failure_inside_the_engines_capture_leaves_no_graph(cuda, monkeypatch, tmp_path):
    from capture_plan.executor import CaptureFailed

    runner_cls, _ = sglang_engine(monkeypatch)
    monkeypatch.setenv(core.ENV_PLAN, str(_plan_file(tmp_path)))
    sgl_plugin.register()
    runner = _runner(runner_cls, cuda)
    runner.model.fail_at = 4
    with pytest.raises(CaptureFailed, match="capture/decode/4"):
        runner.capture()
    assert runner.backend._graphs == {} and runner.backend._outputs == {}  # the backend's cleanup ran


def _unknown_release(mp, tmp):
    mp.setattr(core, "installed", lambda dist: "0.5.24")


def _missing_plan(mp, tmp):
    mp.setenv(core.ENV_PLAN, str(tmp / "gone.json"))


def _invalid_plan(mp, tmp):
    (tmp / "bad.json").write_text("{")
    mp.setenv(core.ENV_PLAN, str(tmp / "bad.json"))


@pytest.mark.parametrize(
    ("setup", "says"),
    [
        (_unknown_release, "sglang 0.5.24: the capture-plan plugin knows the hook points of sglang 0.5.23 only"),
        (_missing_plan, "the plan file is not there"),
        (_invalid_plan, "the plan cannot be used"),
    ],
    ids=["unknown-release", "missing-plan", "invalid-plan"],
)
def test_registration_refuses_start_up_with_one_line(cuda, monkeypatch, tmp_path, setup, says):
    runner_cls, backend_cls = sglang_engine(monkeypatch)
    monkeypatch.setenv(core.ENV_PLAN, str(_plan_file(tmp_path)))
    setup(monkeypatch, tmp_path)
    before = dict(vars(backend_cls))
    with pytest.raises(SystemExit) as exit_:
        sgl_plugin.register()
    line = str(exit_.value.code)
    assert line.startswith("capture-plan: ") and says in line and "\n" not in line and "; fix: " in line
    assert dict(vars(backend_cls)) == before  # nothing installed
    monkeypatch.setenv(core.ENV_FALLBACK, "engine")
    sgl_plugin.register()  # the operator chose the engine's capture: a warning, nothing installed
    assert dict(vars(backend_cls)) == before


def test_a_bad_fallback_setting_is_one_line():
    with pytest.raises(core.PluginRefused, match="CAPTURE_PLAN_FALLBACK='maybe' is neither 'refuse' nor 'engine'"):
        core.settings({core.ENV_PLAN: "p.json", core.ENV_FALLBACK: "maybe"})
    assert core.settings({}) is None and core.settings({core.ENV_PLAN: " "}) is None


# -- vLLM 0.33.0, shaped (tests/plugin_engines.py) ---------------------------------------------


def _vllm_config(tp=1, sizes=(1, 2, 4, 8)):
    return types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(tensor_parallel_size=tp), model_config=None, sizes=sizes
    )


def test_disabled_the_vllm_plugin_changes_nothing(cuda, monkeypatch):
    runner_cls, manager_cls = vllm_engine(monkeypatch)
    before = dict(vars(runner_cls)), dict(vars(manager_cls))
    monkeypatch.delenv(core.ENV_PLAN, raising=False)
    vllm_plugin.register()
    assert (dict(vars(runner_cls)), dict(vars(manager_cls))) == before


def test_vllm_captures_its_full_graphs_in_the_plans_order_and_answers_the_estimate(cuda, monkeypatch, tmp_path):
    runner_cls, manager_cls = vllm_engine(monkeypatch)
    monkeypatch.setenv(core.ENV_PLAN, str(_plan_file(tmp_path, "smallest-first")))
    vllm_plugin.register()
    runner = runner_cls(_vllm_config())
    # the plan is not calibrated for a device: its total is unknown, and the estimate is refused
    with pytest.raises(core.PluginRefused, match=r"reserve for capture: unknown.*--calibration REPORT"):
        runner.profile_cudagraph_memory()
    model = Model(cuda)
    manager = runner.cudagraph_manager
    manager.capture(model)
    assert [bs for bs, rec in model.calls if rec] == [1, 2, 4, 8]  # vLLM's were largest-first
    graphs = manager_cls.__capture_plan__.loop.graphs
    assert len([m for m in graphs.report.steps if m.id.startswith("capture/")]) == 4
    pool = next(iter(graphs.pools.values()))
    assert manager.pool == pool and all(g.pool() == pool for g in manager.graphs.values())
    assert [d.num_reqs for d in manager._capture_descs[next(iter(manager._capture_descs))]] == [8, 4, 2, 1]


def test_vllm_answers_the_estimate_from_a_calibrated_plan(cuda, monkeypatch, tmp_path):
    import msgspec

    from capture_plan.schemas.codec import canonical_bytes, decode_plan, seal

    runner_cls, _ = vllm_engine(monkeypatch)
    path = _plan_file(tmp_path)
    plan = decode_plan(path.read_bytes(), str(path))
    # calibrated: every device item measured, the total their sum
    items = [
        i if i.bytes is not None else msgspec.structs.replace(i, bytes=10 * 2**20, provenance="measured")
        for i in plan.predicted.device.items
    ]
    total = sum(i.bytes for i in items)
    device = msgspec.structs.replace(plan.predicted.device, items=items, total_bytes=total)
    plan = seal(msgspec.structs.replace(plan, predicted=msgspec.structs.replace(plan.predicted, device=device)))
    path.write_bytes(canonical_bytes(plan))
    monkeypatch.setenv(core.ENV_PLAN, str(path))
    vllm_plugin.register()
    assert runner_cls(_vllm_config()).profile_cudagraph_memory() == total == vllm_plugin.plan_total(plan)
    assert total > 30 * 2**20  # the pool's simulated bytes and the three items measured


def test_vllm_refuses_a_plan_whose_sizes_are_not_its_descriptors(cuda, monkeypatch, tmp_path):
    runner_cls, _ = vllm_engine(monkeypatch)
    monkeypatch.setenv(core.ENV_PLAN, str(_plan_file(tmp_path)))
    vllm_plugin.register()
    runner = runner_cls(_vllm_config(sizes=(1, 2, 4, 8, 16)))
    with pytest.raises(core.PluginRefused, match=r"vLLM's FULL decode graphs are for \[1, 2, 4, 8, 16\] requests"):
        runner.cudagraph_manager.capture(Model(cuda))


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
