"""Specs whose [model] names a Hugging Face config.json."""

from __future__ import annotations

import json

import pytest

from planner import BuildOptions, build_plan
from schemas.errors import InputError

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
         "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
         "intermediate_size": 8192, "vocab_size": 128256, "dtype": "bfloat16", "rope_theta": 500000.0}
MIXTRAL = {"model_type": "mixtral", "hidden_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 16,
           "num_key_value_heads": 4, "intermediate_size": 3584, "vocab_size": 32000, "num_local_experts": 8,
           "num_experts_per_tok": 2, "torch_dtype": "bfloat16"}
QWEN_MOE = {"model_type": "qwen2_moe", "hidden_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 16,
            "num_key_value_heads": 16, "intermediate_size": 5632, "moe_intermediate_size": 1408,
            "shared_expert_intermediate_size": 5632, "num_experts": 60, "num_experts_per_tok": 4,
            "vocab_size": 151936, "dtype": "bfloat16"}
GEMMA2 = {"model_type": "gemma2", "hidden_size": 2304, "num_hidden_layers": 26, "num_attention_heads": 8,
          "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 9216, "vocab_size": 256000,
          "dtype": "float32"}


def _write(tmp_path, cfg, model_extra=""):
    d = tmp_path / "models"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "spec.toml").write_text(f'[model]\nconfig = "config.json"\n{model_extra}\n'
                                 '[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 8, 64]\n')
    return d / "spec.toml"


def _model(tmp_path, cfg, **kw):
    from planner.build import _spec

    return _spec(BuildOptions(backend="torch", spec=_write(tmp_path, cfg, **kw)))[0].model


@pytest.mark.parametrize("cfg,want", [
    (LLAMA, dict(name="llama", hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, intermediate=8192,
                 vocab=128256, dtype_bytes=2)),
    (MIXTRAL, dict(hidden=1024, head_dim=64, experts=8, experts_per_token=2, expert_intermediate=3584)),
    (QWEN_MOE, dict(intermediate=5632, experts=60, experts_per_token=4, expert_intermediate=1408,
                    shared_expert_intermediate=5632, kv_heads=16)),
    (GEMMA2, dict(head_dim=256, heads=8, hidden=2304, dtype_bytes=4, vocab=256000)),
])
def test_config_gives_the_dimensions(tmp_path, cfg, want):
    m = _model(tmp_path, cfg)
    assert {k: getattr(m, k) for k in want} == want


def test_config_path_is_relative_to_the_spec_and_recorded(tmp_path, monkeypatch):
    spec = _write(tmp_path, LLAMA)
    monkeypatch.chdir(tmp_path)  # not the spec's directory
    plan = build_plan(BuildOptions(backend="torch", spec=spec.relative_to(tmp_path)))
    # recorded relative to the plan's own folder (plans/), like every path a plan records
    assert plan.inputs.model_config == "../models/config.json"
    assert plan.inputs.model_config_digest.startswith("sha256:")
    # editing the config makes the plan stale: its digest is in the plan
    _write(tmp_path, {**LLAMA, "vocab_size": 32000})
    other = build_plan(BuildOptions(backend="torch", spec=spec.relative_to(tmp_path)))
    assert other.inputs.model_config_digest != plan.inputs.model_config_digest
    assert other.predicted.pool_bytes < plan.predicted.pool_bytes  # smaller logits


def _drop(cfg, key):
    return {k: v for k, v in cfg.items() if k != key}


@pytest.mark.parametrize("cfg,message", [
    (_drop(LLAMA, "hidden_size"), r"config.json: \$.hidden_size: missing field hidden_size \(the model's hidden\)"),
    (_drop(LLAMA, "vocab_size"), r"\$.vocab_size: missing field vocab_size"),
    (_drop(LLAMA, "model_type"), r"\$.model_type: missing field model_type"),
    ({**LLAMA, "model_type": "gpt9"}, r"\$.model_type: unknown model_type 'gpt9'; known: gemma, "),
    ({**LLAMA, "num_hidden_layers": 0}, r"\$.num_hidden_layers: num_hidden_layers must be a positive integer, got 0"),
    ({**LLAMA, "num_hidden_layers": True}, r"must be a positive integer, got True"),
    ({**LLAMA, "hidden_size": "2048"}, r"\$.hidden_size: hidden_size must be a positive integer, got '2048'"),
    ({**LLAMA, "vocab_size": 10**9}, r"\$.vocab_size: vocab_size = 1000000000 is absurd"),
    ({**LLAMA, "num_key_value_heads": 5}, r"\$.num_key_value_heads: num_attention_heads 32 is not a multiple"),
    (_drop(LLAMA, "dtype"), r"\$.dtype: missing field dtype \(or torch_dtype\)"),
    ({**LLAMA, "dtype": "int3"}, r"unsupported dtype 'int3'"),
    ({**MIXTRAL, "num_experts_per_tok": 9}, r"\$.num_experts_per_tok: num_experts_per_tok 9 exceeds num_local_experts 8"),
    (_drop(MIXTRAL, "num_local_experts"), r"missing field num_local_experts \(the model's experts\)"),
])
def test_bad_configs_name_the_field(tmp_path, cfg, message):
    with pytest.raises(InputError, match=message):
        _model(tmp_path, cfg)


def test_kv_heads_and_head_dim_take_hugging_face_defaults(tmp_path):
    m = _model(tmp_path, _drop(_drop(LLAMA, "num_key_value_heads"), "head_dim"))
    assert (m.kv_heads, m.head_dim) == (32, 64)


def test_config_and_listed_dimensions_conflict(tmp_path):
    with pytest.raises(InputError, match=r"\$.model.config: \[model\] names a config and also lists hidden"):
        _model(tmp_path, LLAMA, model_extra="hidden = 1024")


def test_cli_one_line_for_a_missing_config(cli, tmp_path):
    (tmp_path / "s.toml").write_text('[model]\nconfig = "nope.json"\n[[phases]]\nname = "decode"\n'
                                     'kind = "decode"\nsizes = [1]\n')
    code, out, err = cli("build", "-b", "torch", "--spec", "s.toml")
    assert code == 1 and err.count("\n") == 1
    assert "s.toml: $.model.config: cannot read model config 'nope.json'" in err
    assert "fix: the path is relative to the spec file" in err
