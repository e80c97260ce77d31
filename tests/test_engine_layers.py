"""tests/engines/engine_layers.py (the runners' profiling forward: vLLM's and SGLang's eager
decoder layers over a transformers model's weights) allocates what fit counts for the layer
phase (planner/fit/estimate.py ``activation_per_token``): the peak of the bytes its tensors
hold, traced on the CPU op by op, against fit's bytes a token x the tokens, for each
architecture the bench runs and both engines' code. The stand-in and fit come from one
reading of the engines' code (the lines each names); this holds them to each other, op by
op, where the GPU bench holds them to each other by the allocator's peak."""

from __future__ import annotations

import json
import weakref

import pytest

from bench_modules import bench_module


def _tracer():
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Peak(TorchDispatchMode):
        """The most bytes the storages made under it held at once (a storage counts while a
        tensor made under it holds it)."""

        def __init__(self, before=()):
            super().__init__()
            #: storages made before it (a view of one is not a new one): not counted
            self.before = {t.untyped_storage().data_ptr() for t in before}
            self.storages: dict[int, tuple[int, list]] = {}
            self.peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                    s = t.untyped_storage()
                    if s.data_ptr() not in self.before:
                        entry = self.storages.get(s.data_ptr())
                        # the allocator may hand a freed storage's address to a new one before
                        # the next call sweeps it: a dead entry is that old storage, not this one
                        if entry is None or not any(r() is not None for r in entry[1]):
                            entry = self.storages[s.data_ptr()] = (s.nbytes(), [])
                        entry[1].append(weakref.ref(t))
            live = 0
            for ptr, (nbytes, refs) in list(self.storages.items()):
                if any(r() is not None for r in refs):
                    live += nbytes
                else:
                    del self.storages[ptr]
            self.peak = max(self.peak, live)
            return out

    return torch, Peak


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma2", "mixtral", "qwen2_moe"])
def test_the_profiling_forward_holds_at_its_peak_what_fit_counts(name, engine, tmp_path):
    torch, Peak = _tracer()
    transformers = pytest.importorskip("transformers")
    from capture_plan.planner.fit import estimate
    from capture_plan.planner.fit.model import load_model
    from capture_plan.tests.engines import engine_layers
    from capture_plan.tests.engines.case_model import fused_moe_workspace_bytes, moe_dims

    cfg = bench_module("harness").hf_config(
        name, num_hidden_layers=3, hidden_size=256, intermediate_size=1024, num_attention_heads=4
    )
    cfg.num_key_value_heads, cfg.head_dim, cfg.dtype = 2, 64, "float32"
    if name == "qwen2_moe":
        cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size = 256, 1024
    if name == "mixtral":
        cfg.intermediate_size = 256  # the experts' (Mixtral's intermediate_size is theirs)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    m = load_model(str(tmp_path / "config.json"))
    tokens = 4096  # the stand-ins' 64-row chunks and the norms' (tokens x 1) are under 2% of it
    ids = torch.randint(0, 100, (tokens,))
    held = None
    if engine == "vllm" and moe_dims(hf.config) is not None:  # the workspace vLLM's manager keeps
        top_k, inter, hidden, _ = moe_dims(hf.config)
        held = torch.empty(fused_moe_workspace_bytes(tokens, top_k, inter, hidden, 4), dtype=torch.uint8)
    workspace = engine_layers.Workspace(held)
    before = [ids, *hf.parameters(), *hf.buffers(), *([held] if held is not None else [])]
    with torch.no_grad(), Peak(before) as peak:
        out = engine_layers.profile_forward(hf, ids, workspace, engine)
        del out
    fit = tokens * estimate.activation_per_token(m, 1, engine)
    assert fit <= peak.peak <= fit * 1.02, (peak.peak, fit)
