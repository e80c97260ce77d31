"""The transformers adapter captured by the executor on a real GPU (marked ``gpu``).

Run on the device: ``python -m pytest -m gpu -q tests/test_gpu_adapters.py``.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.gpu

transformers = pytest.importorskip("transformers")

SIZES = [1, 2, 4, 8, 12, 16, 24, 32]


def _model(kind: str):
    import torch

    common = dict(hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=1024, vocab_size=8192, max_position_embeddings=1024)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common)
    elif kind == "mixtral":
        cfg = transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    elif kind == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(**common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                                          shared_expert_intermediate_size=512)
    else:
        cfg = transformers.Gemma2Config(**common, head_dim=64, sliding_window=1024)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, dtype=torch.bfloat16, attn_implementation="eager" if kind == "gemma2" else "sdpa")
    return model.to("cuda"), cfg


def _spec(tmp_path, cfg) -> "object":
    d = cfg.to_dict()
    d["dtype"] = "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps(d, default=str))
    path = tmp_path / "spec.toml"
    path.write_text(f'[model]\nconfig = "config.json"\n\n[[phases]]\nname = "decode"\nkind = "decode"\n'
                    f"sizes = {SIZES}\n")
    return path


@pytest.mark.parametrize("kind", ["llama", "mixtral", "qwen2_moe", "gemma2"])
def test_capture_plan_of_a_transformers_model_verifies_and_predicts(tmp_path, kind):
    from adapters.hf import HFTarget
    from executor import capture, profile, verify, write_trace
    from planner import BuildOptions, build_plan

    model, cfg = _model(kind)
    target = HFTarget(model, max_bs=max(SIZES), max_seqlen=128)
    spec = _spec(tmp_path, cfg)
    plan = build_plan(BuildOptions(backend="torch", spec=spec))
    gs = capture(plan, target, progress=False, record=True)
    try:
        res = verify(gs)
        assert res.ok, res.summary()
    finally:
        gs.release()
    write_trace(profile(plan, target), tmp_path / "few.json")
    tplan = build_plan(BuildOptions(backend="torch", spec=spec, trace=tmp_path / "few.json"))
    assert len(tplan.predicted.samples["decode"].derived) == len(SIZES) - 3
    gs = capture(tplan, target, progress=False)
    try:
        measured = {m.step: m.reserved for m in gs.report.steps}
        for m in tplan.predicted.timeline:
            assert abs(measured[m.step] - m.reserved) <= 0.02 * max(m.reserved, 1), (kind, m.step, measured[m.step],
                                                                                      m.reserved)
        out, = gs.replay("decode", 3)
        assert out.shape == (3, cfg.vocab_size)
    finally:
        gs.release()


@pytest.mark.parametrize("kind", ["llama", "mixtral", "qwen2_moe"])
def test_sdpa_replays_equal_eager_runs_bit_for_bit(kind):
    """With the adapter's attention pin (flash / efficient / math), every replay
    of the engines' loop equals an eager run of the same inputs bit for bit,
    and two eager runs agree. Before the pin, PyTorch's dispatcher chose the
    kernel, and on the H200 6-18 of 36 replays per SDPA model differed."""
    import torch

    from adapters.hf import HFTarget

    sizes = [1, 8, 32, 64, 128, 256]
    model, _ = _model(kind)
    target = HFTarget(model, max_bs=max(sizes), max_seqlen=256)
    pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
    graphs, outs = {}, {}
    for bs in sorted(sizes, reverse=True):
        with torch.cuda.stream(stream):
            target.run("decode", bs, None)
        stream.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool, stream=stream):
            outs[bs] = target.run("decode", bs, None)
        graphs[bs] = g
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    bad = []
    try:
        for _ in range(4):
            for bs, g in graphs.items():
                target.prepare("decode", bs, bs, gen)
                g.replay()
                got = outs[bs].clone()
                want = target.run("decode", bs, None).clone()
                again = target.run("decode", bs, None)
                if not torch.equal(got, want) or not torch.equal(want, again):
                    bad.append((bs, float((got.float() - want.float()).abs().max()), torch.equal(want, again)))
    finally:
        for g in graphs.values():
            g.reset()
    assert not bad, f"(bs, max |replay - eager|, eager runs agree): {bad}"
