"""What the CLI tests share: a minimal spec, a Llama config.json, the one-line error check,
and resealing a plan."""

from __future__ import annotations

from capture_plan.schemas.codec import canonical_bytes, plan_digest

# a Llama-3.2-1B-shaped config.json (2 layers), for specs whose [model] names a config
LLAMA = {
    "model_type": "llama",
    "hidden_size": 2048,
    "num_hidden_layers": 2,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 8192,
    "vocab_size": 128256,
    "torch_dtype": "bfloat16",
}
SPEC = '[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 2]\n'


def one_line_error(result, *needles: str) -> str:
    code, out, err = result
    assert code == 1, (code, out, err)
    assert err.startswith("planner: error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err
    return err


def reseal(raw: dict) -> bytes:
    """A plan edited and sealed again: the digest matches, the content lies."""
    raw = {**raw, "digest": ""}
    raw["digest"] = plan_digest(raw)
    return canonical_bytes(raw)
