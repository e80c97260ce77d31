"""What the CLI tests share: a minimal spec, two rules in conflict, a Llama config.json, the one-line error check,
resealing a plan, and a size choice with every option set."""

from __future__ import annotations

from pathlib import Path

from capture_plan.planner.inputs.build_options import SizeChoiceOptions
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
#: a spec's two rules that require opposite capture orders (team-a, team-b)
CONFLICTING_RULES = """
[[rules]]
id = "team-a"
why = "x"
require = [{ order = "largest-first" }]
[[rules]]
id = "team-b"
why = "y"
require = [{ order = "smallest-first" }]
"""


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


def every_size_choice(folder: Path) -> SizeChoiceOptions:
    """``--sizes auto``'s options, every one set (paths in ``folder``, none of them read): what a
    test of the options' round trips (flat, record, command) gives."""
    return SizeChoiceOptions(
        traffic=folder / "t.csv",
        traffic_phases=("decode",),
        metric="m",
        max_size=300,
        timing=folder / "r.json",
        context=2048,
        budget_mib=300.5,
        max_graphs=12,
        max_padding=0.25,
    )
