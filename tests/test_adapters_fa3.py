"""``HFTarget(attention="fa3")`` on CPU: the model's attention modules call FA3's
``flash_attn_with_kvcache`` over the static cache, as the engines' default sm90 backends do.

FA3 needs sm90, so here a stand-in with FA3's documented semantics (torch, float32: each row
attends to its first ``cache_seqlens`` slots, causal aligned bottom-right, ``window_size``,
``softcap``, ``softmax_scale``) answers the calls and records them. What is checked: the
adapter hands FA3 the cache itself (views, no copy), the lengths, the scale, soft-capping,
window and split count it must, and the step computes what the model's own attention
computes on the same inputs. The kernels themselves run in tests/test_gpu_adapters.py.
"""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import hf_tiny  # noqa: E402
from capture_plan.adapters.hf import ATTENTIONS, HFTarget  # noqa: E402
from capture_plan.executor import fa3 as fa3_modules  # noqa: E402

_model = hf_tiny.cpu_model


def _fake_fa3(calls: list) -> types.ModuleType:
    """FA3's ``flash_attn_with_kvcache`` as documented (flash_attn_interface), in torch."""

    def flash_attn_with_kvcache(
        q, k_cache, v_cache, *, cache_seqlens, causal, softmax_scale, window_size, softcap, num_splits, **rest
    ):
        calls.append(
            dict(q=q, k=k_cache, v=v_cache, seqlens=cache_seqlens.clone(), window=window_size, softcap=softcap,
                 scale=softmax_scale, splits=num_splits, causal=causal, rest=rest)
        )  # fmt: skip
        b, t, h, d = q.shape
        s, kvh = k_cache.shape[1], k_cache.shape[2]
        k = k_cache.repeat_interleave(h // kvh, dim=2)
        v = v_cache.repeat_interleave(h // kvh, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * softmax_scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        slot = torch.arange(s)[None, None, :]
        qpos = (cache_seqlens.long()[:, None] - t + torch.arange(t)[None, :])[:, :, None]  # bottom-right aligned
        allowed = (slot < cache_seqlens.long()[:, None, None]) & (slot <= qpos if causal else True)
        if window_size[0] >= 0:
            allowed &= slot >= qpos - window_size[0]
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.float())
        return out.to(q.dtype)

    mod = types.ModuleType("fa3_fwd_interface")
    mod.flash_attn_with_kvcache = flash_attn_with_kvcache  # pyright: ignore[reportAttributeAccessIssue]
    return mod


@pytest.fixture
def fa3(monkeypatch):
    calls: list = []
    monkeypatch.setattr(fa3_modules, "load_fa3", lambda: _fake_fa3(calls))
    return calls


@pytest.mark.parametrize("kind", ["llama", "qwen2_moe", "mixtral", "gemma2"])
def test_fa3_step_computes_what_the_models_own_attention_computes(kind, fa3):
    """Same weights, same inputs: the FA3 target's logits are the model-attention
    target's, in decode and a 4-token phase, at the largest batch and a smaller one (Gemma2:
    its soft-capping and query scale reach FA3)."""
    tokens = {"decode": 1, "target_verify": 4}
    own = HFTarget(_model(kind), max_bs=3, max_seqlen=24, tokens=tokens)
    fast = HFTarget(_model(kind), max_bs=3, max_seqlen=24, tokens=tokens, attention="fa3", fa3_splits=32)
    for phase, bs in (("decode", 3), ("target_verify", 3), ("decode", 2)):
        for target in (own, fast):
            target.prepare(phase, bs, bs, torch.Generator().manual_seed(7))
        # the same draws (ids, write position); the own target's rows see all their history too
        pos = own.position.clone()
        own._place(own._buffers[tokens[phase]], bs, pos, pos.expand(bs))
        want = own.run(phase, bs, None)
        fa3.clear()
        got = fast.run(phase, bs, None)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (kind, phase, bs)
        layers = fast.model.config.get_text_config(decoder=True).num_hidden_layers
        assert len(fa3) == layers  # every layer's attention went to FA3
        pos, t = int(fast.position), tokens[phase]
        for call, layer in zip(fa3, fast.cache.layers):
            # the cache itself, rows [:bs], read through a transposed view: no copy
            assert call["k"].data_ptr() == layer.keys.data_ptr() and call["k"].shape[0] == bs
            assert call["v"].data_ptr() == layer.values.data_ptr()
            assert call["seqlens"].tolist() == [pos + t] * bs and call["seqlens"].dtype == torch.int32
            assert call["splits"] == 32 and call["causal"] and call["window"] == (-1, -1)
        if kind == "gemma2":
            cfg = fast.model.config
            assert fa3[0]["softcap"] == cfg.attn_logit_softcapping
            assert fa3[0]["scale"] == pytest.approx(cfg.query_pre_attn_scalar**-0.5)


def test_a_window_narrower_than_the_cache_reaches_fa3_as_transformers_counts_it(fa3):
    """Mistral slides every layer over 4 tokens in a 16-slot cache: FA3 is given (3, 0) (the
    token itself and 3 behind, transformers' ``q - w < slot <= q``), and decoding a sequence
    ends on transformers' full-sequence forward with its sliding masks."""
    window, n = 4, 12
    model = _model("mistral", window=window)
    target = HFTarget(_model("mistral", window=window), max_bs=2, max_seqlen=16, attention="fa3")
    got, want = hf_tiny.decode_last(target, model, n)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    assert {c["window"] for c in fa3} == {(window - 1, 0)} and {c["splits"] for c in fa3} == {0}


def test_prepared_rows_see_their_whole_history_under_fa3(fa3):
    """FA3 takes one length per row and no gap before the new tokens: every row's mask lets
    it see all slots before the write position (the model's own attention draws shorter
    histories), so both attentions compute the same thing on the same buffers."""
    target = HFTarget(_model("llama"), max_bs=4, max_seqlen=32, attention="fa3")
    target.prepare("decode", 4, 4, torch.Generator().manual_seed(3))
    pos = int(target.position)
    assert pos > 0
    mask = target._buffers[1].mask[:4, 0, 0]
    assert (mask[:, : pos + 1] == 0).all() and (mask[:, pos + 1 :] < 0).all()
    assert target._buffers[1].seqlens.tolist() == [pos + 1] * 4


def test_fa3_changes_the_model_key_and_the_models_own_attention_keeps_its_key(fa3):
    """A calibration keyed by ``model_key`` is not reused across attentions; the model's own
    attention keeps the key it had before FA3 existed (calibration caches stay valid)."""
    own = HFTarget(_model("llama"), max_bs=2, max_seqlen=16)
    a = HFTarget(_model("llama"), max_bs=2, max_seqlen=16, attention="fa3")
    b = HFTarget(_model("llama"), max_bs=2, max_seqlen=16, attention="fa3", fa3_splits=32)
    assert len({own.model_key(), a.model_key(), b.model_key()}) == 3
    assert own.model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(attention="flash"), "expected one of"),
        (dict(fa3_splits=32), "with attention='fa3'"),
        (dict(attention="fa3", fa3_splits=-1), "fa3_splits -1"),
    ],
)
def test_bad_attention_settings_are_refused(kw, match, fa3):
    with pytest.raises(ValueError, match=match):
        HFTarget(_model("llama"), max_bs=2, max_seqlen=16, **kw)


def test_fa3_refuses_mla_and_a_missing_fa3(monkeypatch, fa3):
    with pytest.raises(ValueError, match="MLA's latent"):
        HFTarget(_model("deepseek_v3"), max_bs=2, max_seqlen=16, attention="fa3")
    monkeypatch.setattr(fa3_modules, "load_fa3", lambda: None)
    with pytest.raises(ImportError, match="pip install fa3-fwd"):
        HFTarget(_model("llama"), max_bs=2, max_seqlen=16, attention="fa3")
    assert ATTENTIONS == ("model", "fa3")


def test_fa3_modules_are_the_planners_fa3_backend_modules():
    """One list in two places (the executor cannot read planner data): they must agree."""
    from capture_plan.planner.inputs.resources import data

    assert list(fa3_modules.FA3_MODULES) == data("backends.toml")["backends"]["fa3"]["modules"]
