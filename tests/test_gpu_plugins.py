"""The engine plugins on the GPU: the SGLang- and vLLM-shaped runners of
tests/plugin_engines.py capture the small reference model through the plugins with the
real executor loop; every graph replays equal to an eager run, the loop's report is
complete, and the plan's machine check is the real one. Run on the device:
``python -m pytest -m gpu -q tests/test_gpu_plugins.py``."""

from __future__ import annotations

import pytest

from capture_plan.adapters.plugins import core, sglang as sgl_plugin, vllm as vllm_plugin

pytestmark = pytest.mark.gpu
SIZES = (1, 2, 4, 8)


def _plan(tmp_path, order: str):
    from capture_plan.planner import BuildOptions, build_plan
    from capture_plan.schemas.codec import canonical_bytes

    spec = tmp_path / "spec.toml"
    # two layers of the embedded default model (a [model] names the preset for what it leaves out)
    spec.write_text(
        '[model]\npreset = "llama-3-8b"\nlayers = 2\n\n'
        f'[[phases]]\nname = "decode"\nkind = "decode"\nsizes = {list(SIZES)}\n'
    )
    plan = build_plan(BuildOptions(backend="torch", spec=spec, strategies=("outputs=keep", f"order={order}")))
    path = tmp_path / "plan.json"
    path.write_bytes(canonical_bytes(plan))
    return path


class Reference:
    """The 2-layer reference decode step, as the runners call it: forward(bs)."""

    def __init__(self):
        import torch

        from capture_plan.references.decode import ReferenceConfig, ReferenceModel
        from capture_plan.schemas.spec import Model

        self.model = ReferenceModel(ReferenceConfig(model=Model(layers=2), max_bs=max(SIZES)))
        self.gen = torch.Generator(device="cuda")
        self.gen.manual_seed(0)
        self.model.prepare("decode", max(SIZES), max(SIZES), self.gen)

    def forward(self, bs):
        return self.model.run("decode", bs, None)


def test_sglang_plugin_on_the_gpu(monkeypatch, tmp_path):
    import torch

    from plugin_engines import sglang_engine

    runner_cls, backend_cls = sglang_engine(monkeypatch, fits=False)
    monkeypatch.setenv(core.ENV_PLAN, str(_plan(tmp_path, "smallest-first")))
    sgl_plugin.register()
    ref = Reference()
    runner = runner_cls(type("MR", (), {"tp_size": 1, "model_config": None})(), ref, SIZES)
    runner.capture()
    graphs = backend_cls.__capture_plan__.loop.graphs
    assert [m.id for m in graphs.report.steps if m.id.startswith("capture/")] == [f"capture/decode/{n}" for n in SIZES]
    for n in (1, 3, 8):
        ref.model.prepare("decode", n, n, ref.gen)
        (out,) = graphs.replay("decode", n)
        assert torch.equal(out, ref.forward(n)[:n])
    graphs.release()


def test_vllm_plugin_on_the_gpu(monkeypatch, tmp_path):
    import torch

    from plugin_engines import vllm_engine

    runner_cls, manager_cls = vllm_engine(monkeypatch, "cuda", fits=False)
    monkeypatch.setenv(core.ENV_PLAN, str(_plan(tmp_path, "smallest-first")))
    vllm_plugin.register()
    ref = Reference()
    config = type("C", (), {"parallel_config": None, "model_config": None, "sizes": SIZES})()
    runner = runner_cls(config)
    manager = runner.cudagraph_manager
    manager.capture(ref)
    graphs = manager_cls.__capture_plan__.loop.graphs
    assert len([m for m in graphs.report.steps if m.id.startswith("capture/")]) == len(SIZES)
    for desc, graph in manager.graphs.items():
        ref.model.prepare("decode", desc.num_reqs, desc.num_reqs, ref.gen)
        graph.replay()
        assert torch.equal(manager.hidden_states[: desc.num_tokens], ref.forward(desc.num_tokens))
    graphs.release()
