"""The transformers adapter captured by the executor on a real GPU (marked ``gpu``).

Run on the device: ``python -m pytest -m gpu -q tests/test_gpu_adapters.py``.
Architectures: dense (Llama), MoE as transformers routes it (Mixtral,
Qwen2-MoE, Qwen3-MoE, GLM-4-MoE, GPT-OSS), MLA (DeepSeek-V3, with its routed
and shared experts), sliding-window attention (Mistral, Gemma2, GPT-OSS; and
Mistral and GPT-OSS with a window narrower than the cache); the plan is built
from the model's own config (``planner/inputs/hf_config.py``).
"""

from __future__ import annotations

import json

import pytest

import hf_tiny
from bench_modules import bench_module

pytestmark = pytest.mark.gpu

transformers = pytest.importorskip("transformers")

SIZES = [1, 2, 4, 8, 12, 16, 24, 32]


def _model(kind: str, window: int = 1024):
    import torch

    common = dict(
        hidden_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=1024,
        vocab_size=8192,
        max_position_embeddings=1024,
    )
    cfg = hf_tiny.config(kind, common, head_dim=64, expert=256, window=window)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, dtype=torch.bfloat16, attn_implementation="eager" if kind in hf_tiny.EAGER_ATTENTION else "sdpa"
    )
    return model.to("cuda"), cfg


def _spec(tmp_path, cfg) -> object:
    d = cfg.to_dict()
    d["dtype"] = "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps(d, default=str))
    path = tmp_path / "spec.toml"
    path.write_text(
        f'[model]\nconfig = "config.json"\n\n[[phases]]\nname = "decode"\nkind = "decode"\nsizes = {SIZES}\n'
    )
    return path


#: sliding windows narrower than the cache (the adapter masks them; max_seqlen 128 and 256 below)
NARROW = [("mistral", 64), ("gpt_oss", 64)]


@pytest.mark.parametrize("kind,window", [(k, 1024) for k in hf_tiny.KINDS] + NARROW)
def test_capture_plan_of_a_transformers_model_verifies_and_predicts(tmp_path, kind, window):
    from capture_plan.adapters.hf import HFTarget
    from capture_plan.executor import capture, profile, write_trace
    from capture_plan.planner import BuildOptions, build_plan
    from gpu_targets import assert_verifies_clean

    model, cfg = _model(kind, window)
    target = HFTarget(model, max_bs=max(SIZES), max_seqlen=128)
    assert target.window == (window if window < 128 else None)
    spec = _spec(tmp_path, cfg)
    plan = build_plan(BuildOptions(backend="torch", spec=spec))
    assert_verifies_clean(plan, target)
    write_trace(profile(plan, target), tmp_path / "few.json")
    tplan = build_plan(BuildOptions(backend="torch", spec=spec, trace=tmp_path / "few.json"))
    assert len(tplan.predicted.samples["decode"].derived) == len(SIZES) - 3
    gs = capture(tplan, target, progress=False)
    try:
        measured = {m.step: m.reserved for m in gs.report.steps}
        for m in tplan.predicted.timeline:
            assert measured[m.step] == m.reserved, (  # exact at every step (docs/measurements.md)
                kind,
                m.step,
                measured[m.step],
                m.reserved,
            )
        (out,) = gs.replay("decode", 3)
        assert out.shape == (3, cfg.vocab_size)
    finally:
        gs.release()


@pytest.mark.parametrize(
    "kind,window", [(k, 1024) for k in hf_tiny.KINDS if k not in hf_tiny.EAGER_ATTENTION] + [("mistral", 64)]
)
def test_sdpa_replays_equal_eager_runs_bit_for_bit(kind, window):
    """With the adapter's attention pin (flash / efficient / math), every replay
    of the engines' loop equals an eager run of the same inputs bit for bit,
    and two eager runs agree. Before the pin, PyTorch's dispatcher chose the
    kernel, and on the H200 6-18 of 36 replays per SDPA model differed."""

    from capture_plan.adapters.hf import HFTarget

    sizes = [1, 8, 32, 64, 128, 256]
    model, _ = _model(kind, window)
    _assert_replays_equal_eager(HFTarget(model, max_bs=max(sizes), max_seqlen=256), sizes, rounds=4)


def _assert_replays_equal_eager(target, sizes: list[int], rounds: int) -> None:
    """The engines' loop and its replay check, as the benchmarks run them: every replay equals
    an eager run of the same inputs bit for bit, and two eager runs agree."""
    import torch

    harness = bench_module("harness")
    run = harness.engine_loop(target, harness.largest_first([("decode", sizes)]), warmups=1)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    try:
        rows = harness.replays_vs_eager(target, run, gen, rounds=rounds, eager_twice=True)
    finally:
        harness.release(run)
    bad = [(r.bs, r.max_abs_diff, r.eager_equal) for r in rows if not (r.equal and r.eager_equal)]
    assert not bad, f"(bs, max |replay - eager|, eager runs agree): {bad}"


@pytest.mark.parametrize("kind", ["llama", "qwen2_moe", "gemma2", "mistral"])
@pytest.mark.parametrize("splits", [0, 32])
def test_fa3_attention_replays_equal_eager_runs_and_match_the_models_attention(kind, splits):
    """``HFTarget(attention="fa3")`` with the device's FA3 (the engines' sm90 attention):
    every replay of the engines' loop equals an eager run bit for bit, and its logits are
    the model's own attention's on the same inputs within bf16 rounding (Gemma2: FA3's
    soft-capping; ``splits`` 32: vLLM's FULL graphs' split count)."""
    import torch

    from capture_plan.adapters.hf import HFTarget
    from capture_plan.executor.fa3 import load_fa3

    if load_fa3() is None:
        pytest.skip("no FA3 module importable (the fa3-fwd wheel: . bench/device_env.sh)")
    sizes = [1, 8, 32, 64]
    fast = HFTarget(_model(kind)[0], max_bs=max(sizes), max_seqlen=256, attention="fa3", fa3_splits=splits)
    own = HFTarget(_model(kind)[0], max_bs=max(sizes), max_seqlen=256)
    for target in (fast, own):
        target.prepare("decode", 64, 64, torch.Generator(device="cuda").manual_seed(3))
    pos = own.position.clone()
    own._place(own._buffers[1], 64, pos, pos.expand(64))  # every row its whole history, as under FA3
    a, b = fast.run("decode", 64, None).float(), own.run("decode", 64, None).float()
    assert (a - b).abs().max().item() < 0.05 * b.abs().max().item(), kind
    _assert_replays_equal_eager(fast, sizes, rounds=3)
