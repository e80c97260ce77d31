"""`planner fit --engine sglang==0.5.23` for models with sliding-window layers: SGLang's one
pool over every layer, or its hybrid sliding-window split, as the release decides
(planner/data/fit_rules.toml [swa], planner/fit/swa.py).

Each test failed before: fit refused every model with sliding-window layers under SGLang.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from capture_plan.planner.cli import main
from capture_plan.planner.fit.fit import FitRequest, fit
from capture_plan.planner.fit.model import kv_bytes_per_token, load_model
from capture_plan.planner.fit.tables import releases, rules, swa_rule
from capture_plan.schemas.errors import InputError

ROOT = Path(__file__).resolve().parent.parent
SGL = "sglang==0.5.23"
#: 2 full and 6 sliding-window layers (layer_types), a 1024-token window: 2048 KV bytes a token a layer
LAYER_TYPES = ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3 + ["full_attention"]


def config(tmp_path: Path, **keys) -> Path:
    """A small qwen3-shaped config.json with ``keys`` (an architecture, layer types, ...) over it."""
    cfg = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "sliding_window": 1024,
        "torch_dtype": "bfloat16",
        "layer_types": LAYER_TYPES,
        **keys,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def kv_bytes(res) -> int:
    return next(i.bytes for i in res.items if i.name == "KV cache")


def test_a_model_sglang_does_not_split_is_priced_with_one_pool_over_every_layer():
    """Gemma-2-9B: SGLang 0.5.23 neither lists Gemma2ForCausalLM as hybrid nor lets it be (an
    override keeps Gemma 2 and 3 in one pool): DefaultPoolConfigurator prices every layer, the 21
    sliding-window ones as the 21 full ones, 8 KV heads x (256 + 256) x 2 bytes each."""
    gemma = load_model(str(ROOT / "planner/data/configs/gemma-2-9b.json"))
    res = fit(FitRequest(gemma, "H100", SGL, 1, {"context-length": 8192}))
    assert res.fits and gemma.sliding_layers == 21 and gemma.layers == 42
    assert res.kv_tokens == kv_bytes(res) // (8192 * 42) > 0
    assert any("one KV pool" in n and "Gemma2ForCausalLM" in n for n in res.notes), res.notes
    assert "swa-full-tokens-ratio" not in res.settings


def test_a_window_on_every_layer_is_one_pool_too(tmp_path):
    """A Mistral-style config (every layer slides, the architecture not hybrid): one pool."""
    m = load_model(str(config(tmp_path, architectures=["MistralForCausalLM"], layer_types=None)))
    res = fit(FitRequest(m, "H100", SGL, 1, {}))
    assert m.sliding_layers == 8 and res.kv_tokens == kv_bytes(res) // (2048 * 8)


def test_a_hybrid_model_is_priced_with_the_split_pool(tmp_path):
    """MellumForCausalLM (is_hybrid_swa_model lists it, its split read from layer_types):
    HybridSWAPoolConfigurator's cell is the 2 full layers' bytes and 0.8 x the 6 sliding
    ones', the full tokens int(available // cell), the sliding tokens int(full x 0.8); with
    --swa-full-tokens-ratio the ratio given, with --disable-hybrid-swa-memory one pool."""
    m = load_model(str(config(tmp_path, architectures=["MellumForCausalLM"])))
    assert (m.full_layers, m.sliding_layers) == (2, 6)
    per = kv_bytes_per_token(m, 1, 2)
    for flags, ratio in (({}, 0.8), ({"swa-full-tokens-ratio": 0.5}, 0.5)):
        res = fit(FitRequest(m, "H100", SGL, 1, flags))
        full = int(kv_bytes(res) // (per * 2 + ratio * (per * 6)))
        assert res.fits and res.kv_tokens == full and res.settings["swa-full-tokens-ratio"] == ratio
        assert any(f"({int(full * ratio):,} sliding-window tokens)" in n for n in res.notes), res.notes
    one = fit(FitRequest(m, "H100", SGL, 1, {"disable-hybrid-swa-memory": True}))
    assert one.kv_tokens == kv_bytes(one) // (per * 8) < res.kv_tokens
    with pytest.raises(InputError, match="vllm has no flag --swa-full-tokens-ratio"):  # SGLang's flag
        fit(FitRequest(m, "H100", "vllm==0.34.0", 1, {"swa-full-tokens-ratio": 0.5}))


def test_a_hybrid_split_fit_does_not_model_is_refused_with_a_fix_that_works(tmp_path, capsys):
    """MiMo-V2 (its split read from hybrid_layer_pattern), a layer_types architecture whose
    sliding-window layers have a width of their own, a config that opts in: one line naming
    --disable-hybrid-swa-memory, and the command it names fits."""
    cases = (
        ({"architectures": ["MiMoV2FlashForCausalLM"]}, "not read from its layer_types"),
        ({"architectures": ["MellumForCausalLM"], "swa_head_dim": 64}, "their own geometry (swa_head_dim)"),
        ({"is_hybrid_swa": True}, "Qwen3ForCausalLM's layer split is not read"),
    )
    for keys, why in cases:
        path = config(tmp_path, **keys)
        with pytest.raises(InputError, match=re.escape(why)):
            fit(FitRequest(load_model(str(path)), "H100", SGL, 1, {}))
        code = main(["fit", "--model", str(path), "--device", "H100", "--engine", SGL])
        err = capsys.readouterr().err
        assert code == 1 and err.count("\n") == 1 and "--disable-hybrid-swa-memory`" in err, err
        argv = shlex.split(err.split("`")[1])
        assert main(argv[1:]) == 0, capsys.readouterr().err
        capsys.readouterr()


def test_an_override_keeps_an_opted_in_gemma2_in_one_pool(tmp_path):
    """disabled_for is keyed by the first architecture: a Gemma2 config that opts in stays in
    one pool; an Exaone 4 one only where it gives sliding_window_pattern."""
    m = load_model(str(config(tmp_path, architectures=["Gemma2ForCausalLM"], is_hybrid_swa=True)))
    assert fit(FitRequest(m, "H100", SGL, 1, {})).kv_tokens is not None
    exaone = config(tmp_path, architectures=["Exaone4ForCausalLM"], is_hybrid_swa=True)
    with pytest.raises(InputError, match="Exaone4ForCausalLM's layer split"):
        fit(FitRequest(load_model(str(exaone)), "H100", SGL, 1, {}))
    exaone = config(tmp_path, architectures=["Exaone4ForCausalLM"], is_hybrid_swa=True, sliding_window_pattern=4)
    assert fit(FitRequest(load_model(str(exaone)), "H100", SGL, 1, {})).fits


def test_a_sliding_pool_that_cannot_hold_the_window_does_not_start(tmp_path):
    """validate_swa_pool_size: a sliding pool of window + page tokens or fewer raises. The
    fixes: the smallest swa-full-tokens-ratio whose pool holds it, then one pool; each fits."""
    m = load_model(str(config(tmp_path, architectures=["MellumForCausalLM"])))
    per = kv_bytes_per_token(m, 1, 2)
    base = fit(FitRequest(m, "H100", SGL, 1, {"context-length": 512}))
    items = {i.name: i.bytes for i in base.items}
    pre = items["device total"] - items["CUDA context"]
    want = int(1250 * (per * 2 + 0.8 * per * 6))  # 1250 full tokens: 1000 sliding, under 1024 + 1
    frac = (want + items["weights"] + items["non-torch memory"]) / pre
    res = fit(FitRequest(m, "H100", SGL, 1, {"context-length": 512, "mem-fraction-static": frac}))
    assert not res.fits and "sliding-window pool holds" in res.overflow, res.overflow
    ratio, rest = res.fixes[0], res.fixes[1:]
    assert ratio.startswith("--swa-full-tokens-ratio ") and rest == ["--disable-hybrid-swa-memory"]
    below = {
        "context-length": 512,
        "mem-fraction-static": frac,
        "swa-full-tokens-ratio": float(ratio.split()[1]) - 0.01,
    }
    assert "sliding-window pool holds" in fit(FitRequest(m, "H100", SGL, 1, below)).overflow


def test_every_sglang_release_has_one_swa_rule_and_its_facts_hold_together():
    """Each modelled SGLang release is in exactly one [swa] table (vLLM in none); the layer
    split fit models is one SGLang gives the split to, or to a config that opts in."""
    from capture_plan.planner.fit.tables import _rules

    for release in releases():
        engine, version = release.split("==")
        tables = [r for r in _rules().swa.values() if r.engine == engine and version in r.releases]
        assert len(tables) == (engine == "sglang"), release
    for rule in _rules().swa.values():
        assert set(rule.needs_sliding_layers) <= set(rule.architectures)
        assert 0 < rule.ratio <= 1
        assert {r.engine for r in rules().values()} >= {rule.engine}
    assert swa_rule("sglang", "0.5.23") is not None and swa_rule("vllm", "0.34.0") is None


def test_a_build_refused_for_the_split_names_the_switch_as_its_engine_flag(cli, tmp_path):
    """``planner build --engine sglang==0.5.23`` over a spec whose config is a hybrid split fit
    does not model: one line whose fix is the build with ``--engine-flag
    disable-hybrid-swa-memory=true``, and that build is made."""
    from cli_inputs import LLAMA, SPEC, one_line_error

    (tmp_path / "m").mkdir()
    hybrid = {**LLAMA, "architectures": ["MiMoV2FlashForCausalLM"], "sliding_window": 1024}
    (tmp_path / "m" / "config.json").write_text(json.dumps({**hybrid, "max_position_embeddings": 8192}))
    (tmp_path / "m" / "s.toml").write_text('[model]\nconfig = "config.json"\n' + SPEC)
    args = ("build", "-b", "fa3", "--spec", "m/s.toml", "--device", "NVIDIA H100 80GB HBM3", "--engine", SGL)
    err = one_line_error(cli(*args, "-o", "c.json"), "--engine-flag disable-hybrid-swa-memory=true")
    argv = shlex.split(err.split("`")[1])
    assert "disable-hybrid-swa-memory=true" in argv
    code, out, err = cli(*argv[1:])
    assert code == 0, err


def llama4(tmp_path: Path, **text) -> Path:
    """A small Llama-4-shaped config.json (Llama4ForConditionalGeneration over a llama4_text
    text config of 8 layers, a 1024-token attention chunk), ``text`` over its text config."""
    inner = {
        "model_type": "llama4_text",
        "hidden_size": 2048,
        "intermediate_size": 4096,
        "intermediate_size_mlp": 8192,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_local_experts": 4,
        "num_experts_per_tok": 1,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "attention_chunk_size": 1024,
        "torch_dtype": "bfloat16",
        **text,
    }
    cfg = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "text_config": inner}
    path = tmp_path / "llama4.json"
    path.write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return path


def test_llama4_is_priced_with_the_split_sglang_gives_its_chunked_attention_layers(tmp_path):
    """SGLang 0.5.23 lists Llama4ForConditionalGeneration as hybrid SWA and splits it by position
    (get_hybrid_layer_ids: layer i full where (i + 1) % 4 == 0): of 8 layers 2 full, 6 chunked,
    the cell 2 full layers' bytes and 0.8 x the 6 chunked ones'. It was refused before."""
    m = load_model(str(llama4(tmp_path)))
    assert m.attention_chunk == 1024 and m.sliding_layers == 0  # no sliding_window: model.py reads none
    per = kv_bytes_per_token(m, 1, 2)
    res = fit(FitRequest(m, "H100", SGL, 1, {"context-length": 8192}))
    full = int(kv_bytes(res) // (per * 2 + 0.8 * (per * 6)))
    assert res.fits and res.kv_tokens == full and res.settings["swa-full-tokens-ratio"] == 0.8
    assert [(k.kind, k.layers) for k in res.kv_layers] == [("full attention", 2), ("chunked attention", 6)]
    assert any("attention_chunk_size 1,024" in n and f"({int(full * 0.8):,} sliding" in n for n in res.notes)
    one = fit(FitRequest(m, "H100", SGL, 1, {"context-length": 8192, "disable-hybrid-swa-memory": True}))
    assert one.kv_tokens == kv_bytes(one) // (per * 8) < full
    assert [(k.kind, k.layers) for k in one.kv_layers] == [("full attention", 8)]


def test_llama4_without_an_attention_chunk_is_refused_with_a_fix_that_works(tmp_path, capsys):
    """A Llama 4 config that gives no attention_chunk_size (transformers' default is not read):
    the window SGLang checks is unknown to fit, so one line naming --disable-hybrid-swa-memory,
    and the command it names runs."""
    path = llama4(tmp_path, attention_chunk_size=None)
    code = main(["fit", "--model", str(path), "--device", "H100", "--engine", SGL, "--context-length", "8192"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "gives no attention_chunk_size" in err, err
    argv = shlex.split(err.split("`")[1])
    assert "--disable-hybrid-swa-memory" in argv and main(argv[1:]) == 0, capsys.readouterr().err


def _sliding_tokens(res) -> int:
    """The sliding-window tokens a split pool holds, as fit's note says them (fitting or not)."""
    found = [re.search(r"\(([\d,]+) sliding-window tokens\)", n) for n in res.notes]
    (count,) = [int(f[1].replace(",", "")) for f in found if f]
    return count


def _at_sliding_tokens(m, want: int):
    """fit of ``m`` under the mem-fraction-static whose pool holds ``want`` sliding-window tokens
    (bisected: the tokens rise with the fraction, by at most one a step of a full-side token)."""
    lo, hi = 1e-4, 0.5
    for _ in range(80):
        mid = (lo + hi) / 2
        res = fit(FitRequest(m, "H100", SGL, 1, {"context-length": 512, "mem-fraction-static": mid}))
        lo, hi = (mid, hi) if _sliding_tokens(res) < want else (lo, mid)
    res = fit(FitRequest(m, "H100", SGL, 1, {"context-length": 512, "mem-fraction-static": hi}))
    assert _sliding_tokens(res) == want
    return res


@pytest.mark.parametrize(
    ("arch", "window"),
    [
        ("MellumForCausalLM", 1023),  # mellum.py get_attention_sliding_window_size: sliding_window - 1
        ("GraniteSWAForCausalLM", 1024),  # no method: the config's sliding_window
        ("EmbeddingGemma2Model", 512),  # embedding_gemma2.py: 512 whatever the config says
        ("Llama4ForConditionalGeneration", 1024),  # the config's attention_chunk_size
    ],
)
def test_the_sliding_pool_is_refused_exactly_where_sglang_refuses_it(tmp_path, arch, window):
    """validate_swa_pool_size raises where sliding_window_size + page_size >= the sliding tokens,
    the window resolve_sliding_window_size gives (the model class's, else the config's, else
    the attention chunk): with a page of 1, window + 1 sliding tokens are refused and window + 2
    start. Fit checked the config's window, one token stricter for Mellum (it refused 1025)."""
    path = llama4(tmp_path) if arch.startswith("Llama4") else config(tmp_path, architectures=[arch])
    m = load_model(str(path))
    below, at = _at_sliding_tokens(m, window + 1), _at_sliding_tokens(m, window + 2)
    assert not below.fits and f"its {window:,}-token window" in below.overflow, below.overflow
    assert at.fits, at.overflow
