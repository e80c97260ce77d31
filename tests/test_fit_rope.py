"""The rotary cos/sin cache fit counts with the weights, by rope type, as each release's
rotary_embedding classes size it (planner/data/fit_rules.toml [rope], read from the vLLM 0.33.0
and 0.34.0 and SGLang 0.5.23 wheels). The expected rows are written here from the classes'
code, not from fit's functions: YaRN is built with original_max_position_embeddings as its
length and keeps original x factor rows; linear scaling max x factor; LongRoPE a short and a
long cache (SGLang keeps both beside their concatenation); SGLang's dynamic NTK max x factor
where vLLM's keeps max. Before: every rope type was max_position_embeddings rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from capture_plan.planner.fit.fit import FitRequest, fit
from capture_plan.planner.fit.model import load_model, weight_bytes
from capture_plan.planner.fit.rope import rotary_cache
from capture_plan.schemas.errors import InputError

ROOT = Path(__file__).resolve().parents[1]

#: a small Llama: head_dim 64, rotary_dim 64, bf16
BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 32768,
    "torch_dtype": "bfloat16",
}


def model(tmp_path, **changes):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**BASE, **changes}))
    return load_model(str(path))


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}
LINEAR = {"rope_type": "linear", "factor": 2.5}
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 32, "long_factor": [2.0] * 32}


@pytest.mark.parametrize(
    ("rope", "vllm_rows", "sglang_rows", "sglang_element"),
    [
        (None, 32768, 32768, 4),
        ({"rope_type": "default"}, 32768, 32768, 4),
        (YARN, 8192 * 4, 8192 * 4, 4),
        ({**YARN, "original_max_position_embeddings": 4096}, 4096 * 4, 4096 * 4, 4),
        (LINEAR, 32768 * 5 // 2, 32768 * 5 // 2, 4),
        (DYNAMIC, 32768, 32768 * 2, 4),
        (LLAMA3, 32768, 32768, 4),
        ({**LONGROPE, "original_max_position_embeddings": 4096}, 4096 + 32768, 2 * (4096 + 32768), 2),
    ],
)
@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_rows_and_element_by_rope_type(tmp_path, rope, vllm_rows, sglang_rows, sglang_element, key):
    m = model(tmp_path, **({key: rope} if rope else {}))
    for version in ("0.33.0", "0.34.0"):
        assert rotary_cache(m, "vllm", version).bytes == vllm_rows * 64 * 2, (rope, version)
    assert rotary_cache(m, "sglang", "0.5.23").bytes == sglang_rows * 64 * sglang_element, rope


def test_the_weights_item_counts_the_yarn_cache(tmp_path):
    """A Qwen2.5-style yarn config (max_position_embeddings 32768, factor 4, original 32768):
    vLLM keeps 131,072 rows, not 32,768; the weights item says so."""
    m = model(tmp_path, rope_scaling={**YARN, "original_max_position_embeddings": 32768})
    flags = {"max-model-len": 8192}
    w = next(i for i in fit(FitRequest(m, "H100", "vllm==0.34.0", 1, flags)).items if i.name == "weights")
    plain = weight_bytes(msgspec.structs.replace(m, max_positions=0), 1)
    assert w.bytes == plain + 131072 * 64 * 2 and "yarn: 131,072 rows x 64 x 2 B" in w.source, w.source


def test_two_rope_rows_keep_two_caches(tmp_path):
    """get_rope keeps one cache per key: a config whose layer types give two rope rows (nested
    rope_parameters, transformers 5) holds two; two equal rows one."""
    nested = {"full_attention": LINEAR, "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    m = model(tmp_path, rope_parameters=nested)
    assert rotary_cache(m, "vllm", "0.34.0").bytes == (32768 * 5 // 2 + 32768) * 64 * 2
    same = {"full_attention": LINEAR, "sliding_attention": LINEAR}
    assert rotary_cache(model(tmp_path, rope_parameters=same), "vllm", "0.34.0").bytes == 32768 * 5 // 2 * 64 * 2


def test_a_deepseek_rope_is_deepseek_yarn_with_its_float32_error_bar(tmp_path):
    """deepseek_v2.py (both engines) passes any rope but the default as deepseek_yarn: original x
    factor rows; vLLM keeps them in the model's dtype unless FlashInfer's rope runs (float32): the
    error bar; SGLang in float32."""
    cfg = json.loads((ROOT / "planner/data/configs/deepseek-v2-lite.json").read_text())
    cfg["rope_scaling"] = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale": 0.707}
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    m = load_model(str(tmp_path / "ds.json"))  # qk_rope_head_dim 64, max_position_embeddings 163840, bf16
    v = rotary_cache(m, "vllm", "0.34.0")
    assert (v.bytes, v.error) == (163840 * 64 * 2, 163840 * 64 * 2) and "deepseek_yarn" in v.how
    assert rotary_cache(m, "sglang", "0.5.23").bytes == 163840 * 64 * 4


@pytest.mark.parametrize(
    ("rope", "says"),
    [
        ({"rope_type": "mrope", "mrope_section": [16, 24, 24]}, "multimodal rope"),
        ({"rope_type": "default", "mrope_section": [16, 24, 24]}, "multimodal rope"),
        ({"rope_type": "dynamic", "alpha": 1000.0}, "NTK-alpha"),
        ({"rope_type": "su-per", "factor": 2.0}, "is not modelled (modelled: default, linear"),
        ({"rope_type": "yarn", "original_max_position_embeddings": 8192}, "reads a yarn rope's factor"),
    ],
)
def test_a_rope_not_modelled_is_refused_in_one_located_line(tmp_path, rope, says):
    m = model(tmp_path, rope_scaling=rope)
    with pytest.raises(InputError) as err:
        rotary_cache(m, "vllm", "0.34.0")
    assert says in err.value.what and err.value.where.endswith("config.json: $.rope_scaling"), str(err.value)


def test_a_release_not_read_takes_the_nearest_read_and_says_so(tmp_path):
    m = model(tmp_path, rope_scaling=YARN)
    r = rotary_cache(m, "vllm", "0.25.0")
    assert r.bytes == 8192 * 4 * 64 * 2 and "read from 0.33.0, 0.34.0" in r.how
    assert "read from" not in rotary_cache(m, "vllm", "0.34.0").how
