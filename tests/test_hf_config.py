"""Specs whose [model] names a Hugging Face config.json."""

from __future__ import annotations

import json

import msgspec
import pytest

from capture_plan.planner import BuildOptions, build_plan
from capture_plan.schemas.errors import InputError

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 8192,
    "vocab_size": 128256,
    "dtype": "bfloat16",
    "rope_theta": 500000.0,
}
MIXTRAL = {
    "model_type": "mixtral",
    "hidden_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "intermediate_size": 3584,
    "vocab_size": 32000,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "torch_dtype": "bfloat16",
}
QWEN_MOE = {
    "model_type": "qwen2_moe",
    "hidden_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "intermediate_size": 5632,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "vocab_size": 151936,
    "dtype": "bfloat16",
}
GEMMA2 = {
    "model_type": "gemma2",
    "hidden_size": 2304,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "intermediate_size": 9216,
    "vocab_size": 256000,
    "dtype": "float32",
}


def _write(tmp_path, cfg, model_extra=""):
    d = tmp_path / "models"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "spec.toml").write_text(
        f'[model]\nconfig = "config.json"\n{model_extra}\n'
        '[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 8, 64]\n'
    )
    return d / "spec.toml"


def _model(tmp_path, cfg, **kw):
    from capture_plan.planner.schedule.read import read_spec

    return read_spec(BuildOptions(backend="torch", spec=_write(tmp_path, cfg, **kw))).spec.model


@pytest.mark.parametrize(
    "cfg,want",
    [
        (
            LLAMA,
            dict(
                name="llama",
                hidden=2048,
                layers=16,
                heads=32,
                kv_heads=8,
                head_dim=64,
                intermediate=8192,
                vocab=128256,
                dtype_bytes=2,
            ),
        ),
        (MIXTRAL, dict(hidden=1024, head_dim=64, experts=8, experts_per_token=2, expert_intermediate=3584)),
        (
            QWEN_MOE,
            dict(
                intermediate=5632,
                experts=60,
                experts_per_token=4,
                expert_intermediate=1408,
                shared_expert_intermediate=5632,
                kv_heads=16,
            ),
        ),
        (GEMMA2, dict(head_dim=256, heads=8, hidden=2304, dtype_bytes=4, vocab=256000)),
    ],
)
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


@pytest.mark.parametrize(
    "cfg,message",
    [
        (_drop(LLAMA, "hidden_size"), r"config.json: \$.hidden_size: missing field hidden_size \(the model's hidden\)"),
        (_drop(LLAMA, "vocab_size"), r"\$.vocab_size: missing field vocab_size"),
        (_drop(LLAMA, "model_type"), r"\$.model_type: missing field model_type"),
        (
            {**LLAMA, "model_type": "gpt9"},
            r"\$.model_type: unknown model_type 'gpt9'; known: deepseek_v2, deepseek_v3, gemma, ",
        ),
        (
            {**LLAMA, "num_hidden_layers": 0},
            r"\$.num_hidden_layers: num_hidden_layers must be a positive integer, got 0",
        ),
        ({**LLAMA, "num_hidden_layers": True}, r"must be a positive integer, got True"),
        ({**LLAMA, "hidden_size": "2048"}, r"\$.hidden_size: hidden_size must be a positive integer, got '2048'"),
        ({**LLAMA, "vocab_size": 10**9}, r"\$.vocab_size: vocab_size = 1000000000 is absurd"),
        ({**LLAMA, "num_key_value_heads": 5}, r"\$.num_key_value_heads: num_attention_heads 32 is not a multiple"),
        (_drop(LLAMA, "dtype"), r"\$.dtype: missing field dtype \(or torch_dtype\)"),
        ({**LLAMA, "dtype": "int3"}, r"unsupported dtype 'int3'"),
        (
            {**MIXTRAL, "num_experts_per_tok": 9},
            r"\$.num_experts_per_tok: num_experts_per_tok 9 exceeds num_local_experts 8",
        ),
        (
            _drop(MIXTRAL, "num_local_experts"),
            r"missing field num_local_experts \(the model's experts; also read as num_experts\)",
        ),
    ],
)
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
    (tmp_path / "s.toml").write_text(
        '[model]\nconfig = "nope.json"\n[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1]\n'
    )
    code, out, err = cli("build", "-b", "torch", "--spec", "s.toml")
    assert code == 1 and err.count("\n") == 1
    assert "s.toml: $.model.config: cannot read model config 'nope.json'" in err
    assert "fix: the path is relative to the spec file" in err


# -- the model types engines serve, every spelling transformers accepts -------------

QWEN3_MOE = {
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts_per_tok": 8,
    "vocab_size": 151936,
    "dtype": "bfloat16",
}
#: DeepSeek-V3's config.json (the dimensions; Kimi K2's says deepseek_v3 too)
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "vocab_size": 129280,
    "torch_dtype": "bfloat16",
}
GPT_OSS = {
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "num_hidden_layers": 36,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "intermediate_size": 2880,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "vocab_size": 201088,
    "torch_dtype": "bfloat16",
}
GLM4_MOE = {
    "model_type": "glm4_moe",
    "hidden_size": 5120,
    "num_hidden_layers": 92,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "n_routed_experts": 160,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "vocab_size": 151552,
    "torch_dtype": "bfloat16",
}
GEMMA3 = {
    "model_type": "gemma3",
    "torch_dtype": "bfloat16",
    "text_config": {
        "model_type": "gemma3_text",
        "hidden_size": 5376,
        "num_hidden_layers": 62,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "head_dim": 128,
        "intermediate_size": 21504,
        "vocab_size": 262208,
    },
}


@pytest.mark.parametrize(
    "cfg,want",
    [
        # transformers 5.17 writes num_local_experts (Qwen3MoeConfig.attribute_map), the Hub's configs num_experts
        ({**QWEN3_MOE, "num_local_experts": 128}, dict(experts=128, experts_per_token=8, expert_intermediate=768)),
        ({**QWEN3_MOE, "num_experts": 128}, dict(experts=128, experts_per_token=8, expert_intermediate=768)),
        ({**QWEN3_MOE, "num_experts": 128, "num_local_experts": 128}, dict(experts=128)),
        # MLA: head_dim is the query/key head dim, qk_nope + qk_rope; one shared expert of moe_intermediate_size
        (
            DEEPSEEK_V3,
            dict(
                name="deepseek_v3",
                heads=128,
                kv_heads=128,
                head_dim=192,
                intermediate=18432,
                experts=256,
                experts_per_token=8,
                expert_intermediate=2048,
                shared_expert_intermediate=2048,
            ),
        ),
        ({**DEEPSEEK_V3, "head_dim": 64}, dict(head_dim=192)),  # what transformers writes there: qk_rope_head_dim
        ({**DEEPSEEK_V3, "num_local_experts": 256}, dict(experts=256)),
        (GPT_OSS, dict(heads=64, kv_heads=8, head_dim=64, experts=128, experts_per_token=4, expert_intermediate=2880)),
        ({**_drop(GPT_OSS, "num_local_experts"), "num_experts": 32}, dict(experts=32)),
        (GLM4_MOE, dict(head_dim=128, experts=160, expert_intermediate=1536, shared_expert_intermediate=1536)),
        ({**GLM4_MOE, "n_shared_experts": 2}, dict(shared_expert_intermediate=3072)),
        # a multimodal config: the decoder is text_config; the dtype is the outer one's
        (
            GEMMA3,
            dict(
                name="gemma3_text",
                hidden=5376,
                layers=62,
                heads=32,
                kv_heads=16,
                head_dim=128,
                vocab=262208,
                dtype_bytes=2,
            ),
        ),
        ({**GEMMA3, "text_config": _drop(GEMMA3["text_config"], "model_type")}, dict(name="gemma3_text", hidden=5376)),
        ({**GEMMA3, "text_config": {**GEMMA3["text_config"], "dtype": "float32"}}, dict(dtype_bytes=4)),
        ({**_drop(LLAMA, "dtype"), "torch_dtype": "float32"}, dict(dtype_bytes=4)),
        ({**LLAMA, "torch_dtype": "bfloat16"}, dict(dtype_bytes=2)),
    ],
)
def test_served_model_types_and_aliases(tmp_path, cfg, want):
    m = _model(tmp_path, cfg)
    assert {k: getattr(m, k) for k in want} == want


@pytest.mark.parametrize(
    "cfg,message",
    [
        (
            {**QWEN3_MOE, "num_experts": 64, "num_local_experts": 128},
            r"\$.num_experts: num_experts = 64 and num_local_experts = 128 disagree \(transformers reads "
            r"num_experts as num_local_experts\); fix: keep one of num_experts and num_local_experts",
        ),
        ({**DEEPSEEK_V3, "num_local_experts": 8}, r"num_local_experts = 8 and n_routed_experts = 256 disagree"),
        (
            {**LLAMA, "torch_dtype": "float16"},
            r"\$.torch_dtype: torch_dtype = 'float16' and dtype = 'bfloat16' disagree",
        ),
        (
            QWEN3_MOE,
            r"\$.num_local_experts: missing field num_local_experts \(the model's experts; also read as "
            r"num_experts\)",
        ),
        ({**QWEN3_MOE, "num_experts": 0}, r"\$.num_experts: num_experts must be a positive integer, got 0"),
        ({**QWEN3_MOE, "num_experts": 4}, r"\$.num_experts_per_tok: num_experts_per_tok 8 exceeds num_experts 4"),
        (
            _drop(DEEPSEEK_V3, "qk_rope_head_dim"),
            r"\$.qk_rope_head_dim: missing field qk_rope_head_dim \(the model's head "
            r"dim\)",
        ),
        ({**DEEPSEEK_V3, "n_shared_experts": 0}, r"\$.n_shared_experts: n_shared_experts must be a positive integer"),
        (
            {**DEEPSEEK_V3, "n_shared_experts": 1024},
            r"\$.n_shared_experts: moe_intermediate_size \* "
            r"n_shared_experts = 2097152 is absurd",
        ),
        (
            {**LLAMA, "model_type": "qwen3_next"},
            r"\$.model_type: model_type 'qwen3_next' is not supported: its "
            r"linear-attention",
        ),
        (
            {**GEMMA3, "text_config": None},
            r"\$.text_config: a gemma3 config keeps its decoder's dimensions in text_config",
        ),
        (
            {**GEMMA3, "text_config": _drop(GEMMA3["text_config"], "hidden_size")},
            r"config.json: \$.text_config.hidden_size: missing field hidden_size",
        ),
        ({**GEMMA3, "torch_dtype": "int3"}, r"config.json: \$.torch_dtype: unsupported dtype 'int3'"),
        (
            {**GEMMA3, "text_config": {**GEMMA3["text_config"], "dtype": "int3"}},
            r"config.json: \$.text_config.dtype: unsupported dtype 'int3'",
        ),
        (
            {**GEMMA3, "text_config": {**GEMMA3["text_config"], "model_type": "gpt9"}},
            r"\$.text_config.model_type: unknown model_type 'gpt9'",
        ),
    ],
)
def test_bad_served_configs_name_the_keys(tmp_path, cfg, message):
    with pytest.raises(InputError, match=message):
        _model(tmp_path, cfg)


def test_two_aliases_that_disagree_are_named(monkeypatch):
    """A key with two aliases (as Sarvam's n_routed_experts in transformers 5.24):
    the error names the two spellings the file gives."""
    from capture_plan.planner.inputs import hf_config

    table = hf_config.architectures()
    kind = msgspec.structs.replace(
        table.model_types["deepseek_v3"],
        aliases={"num_experts": "n_routed_experts", "num_local_experts": "n_routed_experts"},
    )
    monkeypatch.setattr(
        hf_config,
        "architectures",
        lambda: msgspec.structs.replace(table, model_types={**table.model_types, "deepseek_v3": kind}),
    )
    cfg = {**_drop(DEEPSEEK_V3, "n_routed_experts"), "num_experts": 8, "num_local_experts": 16}
    with pytest.raises(
        InputError,
        match=r"\$.num_local_experts: num_local_experts = 16 and num_experts = 8 disagree "
        r"\(transformers reads num_local_experts as n_routed_experts\)",
    ):
        hf_config.model_from_config(cfg, "config.json")


def test_cli_one_line_for_an_alias_that_disagrees(cli, tmp_path):
    spec = _write(tmp_path, {**QWEN3_MOE, "num_experts": 64, "num_local_experts": 128})
    code, out, err = cli("build", "-b", "torch", "--spec", str(spec))
    assert code == 1 and err.count("\n") == 1 and not out
    assert "config.json: $.num_experts: num_experts = 64 and num_local_experts = 128 disagree" in err


# -- the table against the installed transformers --------------------------------------


def _transformers():
    return pytest.importorskip("transformers")


def test_aliases_are_transformers_attribute_maps():
    """Each type's aliases are its config class's attribute_map, so the table
    cannot drift from what transformers accepts (checked in CI against the
    lowest and the newest transformers the hf extra allows)."""
    CONFIG_MAPPING = pytest.importorskip("transformers").CONFIG_MAPPING

    from capture_plan.planner.inputs.hf_config import architectures

    _transformers()
    table = architectures()
    for mt, kind in table.model_types.items():
        assert kind.aliases == dict(CONFIG_MAPPING[mt].attribute_map), mt
    for mt in [*table.unsupported, *table.wrappers, *(w.model_type for w in table.wrappers.values())]:
        assert mt in CONFIG_MAPPING, mt
    # PreTrainedConfig reads the old torch_dtype as dtype
    assert CONFIG_MAPPING["llama"].from_dict({"torch_dtype": "float16"}).dtype is not None


#: values small enough to build each type's model on CPU, keyed by the table's
#: own field names (each is set through the key the table reads)
SMALL = dict(
    hidden=64,
    layers=2,
    heads=4,
    kv_heads=2,
    head_dim=16,
    intermediate=96,
    vocab=101,
    experts=4,
    experts_per_token=2,
    expert_intermediate=32,
    shared_expert_intermediate=32,
)


def _small_config(mt: str) -> dict:
    """A config dict for ``mt`` giving SMALL through the keys the table names;
    the parts of a sum or product get their own small values."""
    from capture_plan.planner.inputs.hf_config import DIMENSIONS, Combined, architectures

    table = architectures()
    kind = table.model_types[mt]
    d: dict = {
        "model_type": mt,
        "max_position_embeddings": 64,
        "pad_token_id": None,
        "bos_token_id": None,
        "eos_token_id": None,
    }
    for f in DIMENSIONS + ("experts", "experts_per_token", "expert_intermediate", "shared_expert_intermediate"):
        key = getattr(kind, f, None) or table.fields.get(f)
        if key is None:
            continue
        if isinstance(key, Combined):
            parts = {"qk_nope_head_dim": 12, "qk_rope_head_dim": 4, "moe_intermediate_size": 32, "n_shared_experts": 1}
            d.update({k: parts[k] for k in key.keys})
        elif key not in d:
            d[key] = SMALL[f]
    if mt in ("deepseek_v2", "deepseek_v3"):  # MLA attends with every head; its latent ranks; routing groups
        d.update(
            num_key_value_heads=4,
            kv_lora_rank=16,
            q_lora_rank=24,
            v_head_dim=8,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    if mt == "glm4_moe":
        d.update(first_k_dense_replace=1)
    return d


def _type_names():
    from capture_plan.planner.inputs.hf_config import architectures

    return sorted(architectures().model_types)


@pytest.mark.parametrize("mt", _type_names())
def test_the_table_reads_what_transformers_builds(tmp_path, mt):
    """A config transformers wrote (its to_dict) for each known type reads back to
    the dimensions transformers' own model has: layers, vocabulary, query heads
    x head dim (for MLA: the query/key head dim), key/value heads, and experts."""
    transformers = _transformers()
    torch = pytest.importorskip("torch")  # before its import: a machine with neither skips
    from capture_plan.planner.inputs.hf_config import model_from_config

    cfg = transformers.AutoConfig.for_model(**_small_config(mt))
    written = json.loads(cfg.to_json_string())  # what save_pretrained writes: canonical names, every key
    written["dtype"] = "float32"
    m = model_from_config(written, "config.json")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    layers = model.model.layers
    assert m.layers == len(layers) and m.vocab == model.lm_head.out_features and m.hidden == model.lm_head.in_features
    attn = layers[0].self_attn
    if hasattr(attn, "qkv_proj"):  # fused (Phi-3)
        assert (m.heads + 2 * m.kv_heads) * m.head_dim == attn.qkv_proj.out_features
    else:
        q = getattr(attn, "q_proj", None) or attn.q_b_proj  # MLA: q_b_proj
        assert m.heads * m.head_dim == q.out_features, (m.heads, m.head_dim, q)
    if hasattr(attn, "k_proj"):
        assert m.kv_heads * m.head_dim == attn.k_proj.out_features
    if m.experts is not msgspec.UNSET:
        experts = [mod for mod in model.modules() if type(mod).__name__.endswith("Experts")]
        assert experts and all(next(e.parameters()).shape[0] == m.experts for e in experts), mt


def test_reading_a_config_imports_neither_transformers_nor_torch(tmp_path):
    """The alias table is data: the planner reads a config without transformers."""
    import subprocess
    import sys

    spec = _write(tmp_path, {**DEEPSEEK_V3, "num_local_experts": 256})
    code = (
        "import sys\nfrom pathlib import Path\nfrom planner import BuildOptions, build_plan\n"
        f"build_plan(BuildOptions(backend='torch', spec=Path({str(spec)!r})))\n"
        "print(sorted(m for m in ('transformers', 'torch') if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "extra,message",
    [
        (b'[model_types.bad]\nwidth = "hidden_size"\n', r"architectures.toml: Object contains unknown field `width`"),
        (
            b'[model_types.bad]\nhead_dim = { sum = ["a"], product = ["b"] }\n',
            r"model_types.bad.head_dim: give exactly one of sum and product",
        ),
    ],
)
def test_a_broken_table_is_a_broken_package(data_file, extra, message):
    from capture_plan.planner.inputs.hf_config import architectures

    architectures.cache_clear()
    data_file("architectures.toml", extra)
    try:
        with pytest.raises(RuntimeError, match=message):
            architectures()
    finally:
        architectures.cache_clear()
