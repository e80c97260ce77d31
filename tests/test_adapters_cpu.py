"""The transformers adapter's eager path on CPU, with tiny random models built from configs."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from adapters.hf import HFTarget  # noqa: E402

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=101, max_position_embeddings=256)


def _model(kind: str):
    if kind == "llama":
        cfg = transformers.LlamaConfig(**TINY)
    elif kind == "mixtral":
        cfg = transformers.MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2)
    elif kind == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(**TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                          shared_expert_intermediate_size=64)
    else:
        cfg = transformers.Gemma2Config(**TINY, head_dim=16, sliding_window=64)
    cfg._attn_implementation = "sdpa" if kind != "gemma2" else "eager"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).to(torch.float32)


KINDS = ["llama", "mixtral", "qwen2_moe", "gemma2"]


@pytest.mark.parametrize("kind", KINDS)
def test_run_is_repeatable_and_rows_are_independent(kind):
    target = HFTarget(_model(kind), max_bs=4, max_seqlen=32)
    gen = torch.Generator().manual_seed(1)
    target.prepare("decode", 4, 4, gen)
    a = target.run("decode", 4, None).clone()
    assert a.shape == (4, 101) and torch.isfinite(a).all()
    # the write position is reset every run: a second run sees the same cache
    assert torch.equal(target.run("decode", 4, None), a)
    # batch 2 uses rows [:2] of the same cache and buffers
    assert torch.allclose(target.run("decode", 2, None), a[:2], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_step_with_no_history_equals_the_model_without_cache(kind):
    model = _model(kind)
    target = HFTarget(model, max_bs=4, max_seqlen=16)
    gen = torch.Generator().manual_seed(2)
    target.prepare("decode", 3, 3, gen)
    buf = target._buffers[1]
    pos = int(target.position)
    buf.mask[:3] = torch.finfo(buf.mask.dtype).min
    buf.mask[:3, ..., pos] = 0
    got = target.run("decode", 3, None)
    with torch.no_grad():
        want = model(input_ids=buf.ids[:3], position_ids=buf.positions[:3], use_cache=False).logits[:, -1]
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    # the new keys landed in the shared static cache at the prepared slot, rows 0..2 only
    k = target.cache.layers[0].keys
    assert k[:3, :, pos].abs().sum() > 0 and k[3:].abs().sum() == 0


def test_multi_token_phase_and_history_mask():
    target = HFTarget(_model("llama"), max_bs=2, max_seqlen=16, tokens={"decode": 1, "target_verify": 4})
    gen = torch.Generator().manual_seed(3)
    target.prepare("target_verify", 2, 2, gen)
    out = target.run("target_verify", 2, None)
    assert out.shape == (8, 101)
    m = target._buffers[4].mask[0, 0]
    pos = int(target.position)
    # token i sees the new tokens up to itself and none after
    for i in range(4):
        assert (m[i, pos:pos + i + 1] == 0).all()
        assert (m[i, pos + i + 1:] < 0).all()


def test_sliding_window_shorter_than_the_cache_is_refused():
    cfg = transformers.Gemma2Config(**TINY, head_dim=16, sliding_window=8)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match="sliding_window 8 < max_seqlen 16"):
        HFTarget(model, max_bs=2, max_seqlen=16)


def test_hf_target_is_a_capture_target():
    from executor.target import CaptureTarget

    assert isinstance(HFTarget(_model("llama"), max_bs=2, max_seqlen=8), CaptureTarget)
