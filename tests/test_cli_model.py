"""No silent model (issue 29): a spec's ``[model]`` gives every dimension, or names a
config.json or a preset for the rest, or is refused naming the missing keys; the build
summary, ``planner show`` and the plan say which dimensions the prediction used and where
each came from. Before: ``[model] name = "qwen-72b"`` built Llama-3-8B with exit 0, and a
real spec without its ``vocab`` line gave exactly the default plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_inputs import LLAMA, SPEC

# a real spec's [model]: every dimension typed in
REAL = (
    '[model]\nname = "small"\nlayers = 2\nhidden = 1024\nheads = 8\nkv_heads = 2\nhead_dim = 128\n'
    "intermediate = 2048\nvocab = 32000\n"
)
FIX = (
    'fix: list them in [model], read them from the model\'s config.json (config = "config.json", relative to '
    'the spec), or take the missing ones from a preset (preset = "llama-3-8b")'
)
PRESET_DIMS = (
    "layers 32, hidden 4096, heads 32, kv_heads 8, head_dim 128, intermediate 14336, vocab 128256, "
    "dtype_bytes 2, logits_dtype_bytes 4 (preset llama-3-8b)"
)


def _build(cli, tmp_path, spec: str, *args: str):
    (tmp_path / "s.toml").write_text(spec)
    return cli("build", "-b", "fa3", "--spec", "s.toml", "-o", "s.json", *args)


def test_a_model_named_without_dimensions_is_refused_naming_them(cli, tmp_path):
    code, out, err = _build(cli, tmp_path, '[model]\nname = "qwen-72b"\n' + SPEC)
    assert (code, out) == (1, "")
    assert err == (
        "planner: error: s.toml: $.model: [model] names model 'qwen-72b' but gives no layers, hidden, heads, "
        f"kv_heads, head_dim, intermediate, vocab; {FIX}\n"
    )
    assert not (tmp_path / "s.json").exists()


def test_a_real_spec_without_its_vocab_is_refused_not_the_default_plan(cli, tmp_path):
    code, out, err = _build(cli, tmp_path, REAL.replace("vocab = 32000\n", "") + SPEC)
    assert (code, out) == (1, "")
    assert err == f"planner: error: s.toml: $.model: [model] names model 'small' but gives no vocab; {FIX}\n"
    assert not (tmp_path / "s.json").exists()


@pytest.mark.parametrize(
    "fix,line",
    [
        ('preset = "llama-3-8b"\n', f"model qwen-72b: {PRESET_DIMS}"),
        (
            "layers = 80\nhidden = 8192\nheads = 64\nkv_heads = 8\nhead_dim = 128\nintermediate = 29568\n"
            "vocab = 152064\n",
            "model qwen-72b: layers 80, hidden 8192, heads 64, kv_heads 8, head_dim 128, intermediate 29568, "
            "vocab 152064 (spec); dtype_bytes 2, logits_dtype_bytes 4 (default)",
        ),
    ],
)
def test_each_fix_the_refusal_names_builds_and_says_where_each_dimension_came_from(cli, tmp_path, fix, line):
    code, out, err = _build(cli, tmp_path, f'[model]\nname = "qwen-72b"\n{fix}' + SPEC)
    assert (code, err) == (0, "")
    assert out.splitlines()[2] == f"  {line}"
    show = cli("show", "s.json")[1].splitlines()
    assert show[2] == f"  {line}"


def test_the_config_fix_builds_and_names_the_config(cli, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    code, out, _ = _build(cli, tmp_path, '[model]\nname = "qwen-72b"\nconfig = "config.json"\n' + SPEC)
    assert code == 0
    assert out.splitlines()[2] == (
        "  model qwen-72b: layers 2, hidden 2048, heads 32, kv_heads 8, head_dim 64, intermediate 8192, "
        "vocab 128256, dtype_bytes 2 (config config.json); logits_dtype_bytes 4 (default)"
    )
    used = json.loads((tmp_path / "s.json").read_text())["inputs"]["model"]
    assert used["sources"] == {**{k: "config" for k in used["dimensions"]}, "logits_dtype_bytes": "default"}


def test_a_preset_and_given_dimensions_are_recorded_apart(cli, tmp_path):
    model = '[model]\npreset = "llama-3-8b"\nvocab = 32000\nlogits_dtype_bytes = 2\n'
    assert _build(cli, tmp_path, model + SPEC)[0] == 0
    used = json.loads((tmp_path / "s.json").read_text())["inputs"]["model"]
    assert used["preset"] == "llama-3-8b" and used["dimensions"]["vocab"] == 32000
    assert {k for k, v in used["sources"].items() if v == "spec"} == {"vocab", "logits_dtype_bytes"}
    line = cli("show", "s.json")[1].splitlines()[2]
    assert line == (
        "  model llama-3-8b: layers 32, hidden 4096, heads 32, kv_heads 8, head_dim 128, intermediate 14336 "
        "(preset llama-3-8b); vocab 32000 (spec); dtype_bytes 2 (preset llama-3-8b); logits_dtype_bytes 2 (spec)"
    )


def test_a_spec_without_model_and_the_embedded_spec_say_they_plan_the_default_model(cli, tmp_path):
    assert _build(cli, tmp_path, SPEC)[0] == 0
    assert cli("show", "s.json")[1].splitlines()[2] == f"  model llama-3-8b: {PRESET_DIMS}"
    code, out, _ = cli("build", "-b", "fa3", "--dry-run")
    assert code == 0 and out.splitlines()[2] == f"  model llama-3-8b: {PRESET_DIMS}"


def test_a_phase_with_its_own_model_prints_its_dimensions(cli, tmp_path):
    from pathlib import Path

    spec = (Path(__file__).parent / "data/eagle3.toml").read_text()
    code, out, _ = _build(cli, tmp_path, spec)
    assert code == 0
    lines = out.splitlines()
    assert f"  model llama-3-8b: {PRESET_DIMS}" in lines
    assert cli("show", "s.json")[1].splitlines()[1:10] == lines[1:10]  # the same lines, read back from the file
    assert (
        "  phase draft_decode: layers 1, hidden 2048, heads 16, kv_heads 4, intermediate 8192, vocab 32000 (its own; "
        "the others the model's)" in lines
    )


@pytest.mark.parametrize(
    "model,where,needle",
    [
        ('preset = "qwen-72b"\n', "$.model.preset", "unknown model preset 'qwen-72b'; fix: use one of llama-3-8b"),
        (
            'preset = "llama-3-8b"\nconfig = "config.json"\n',
            "$.model.preset",
            "[model] names both a config and a preset",
        ),
        # listing the default's own value was not caught (the check compared with the default)
        ('config = "config.json"\nlayers = 32\n', "$.model.config", "[model] names a config and also lists layers"),
    ],
)
def test_ambiguous_or_unknown_model_sources_are_one_line(cli, tmp_path, model, where, needle):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    code, out, err = _build(cli, tmp_path, "[model]\n" + model + SPEC)
    assert (code, out) == (1, "") and err.count("\n") == 1
    assert err.startswith(f"planner: error: s.toml: {where}: ") and needle in err, err


def test_the_schema_says_what_a_model_requires(cli):
    code, out, _ = cli("schema", "spec")
    assert code == 0
    model = json.loads(out)["$defs"]["Model"]
    assert model["anyOf"] == [
        {"required": ["config"]},
        {"required": ["preset"]},
        {"required": ["layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab"]},
    ]
    assert "preset" in model["properties"]


def test_a_config_edit_names_the_dimension_and_the_config_key(cli, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert _build(cli, tmp_path, '[model]\nconfig = "config.json"\n' + SPEC)[0] == 0
    used = json.loads((tmp_path / "s.json").read_text())["inputs"]["model"]
    assert used["config_keys"] == {
        "dtype_bytes": "torch_dtype",
        "head_dim": "hidden_size / num_attention_heads",
        "heads": "num_attention_heads",
        "hidden": "hidden_size",
        "intermediate": "intermediate_size",
        "kv_heads": "num_key_value_heads",
        "layers": "num_hidden_layers",
        "vocab": "vocab_size",
    }
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "num_hidden_layers": 4}))
    code, out, err = cli("check", "s.json")
    assert (code, out) == (1, "")
    assert (
        ", model layers: 2 (config config.json: num_hidden_layers) -> 4 (config config.json: num_hidden_layers);" in err
    ), err


_DIMS = "layers = 80\nhidden = 8192\nheads = 64\nkv_heads = 8\nhead_dim = 128\nintermediate = 29568\nvocab = 152064\n"
_PHASE = '[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 2]\n'


@pytest.mark.parametrize("head, shown", [("", "model unnamed: "), ('name = "qwen-like"\n', "model qwen-like: ")])
def test_a_model_of_every_dimension_and_no_name_is_not_called_the_preset(cli, tmp_path, head, shown):
    """Issue 40, item 9: shown as `model llama-3-8b` (the default preset's name), a preset it did
    not use: named after the spec where the spec names itself, else unnamed."""
    (tmp_path / "s.toml").write_text(head + "[model]\n" + _DIMS + _PHASE)
    code, out, err = cli("build", "-b", "fa3", "--spec", "s.toml", "-o", "p.json")
    assert code == 0, err
    line = next(line for line in out.splitlines() if line.lstrip().startswith("model "))
    assert line.strip().startswith(shown) and "llama" not in line, line
    assert json.loads((tmp_path / "p.json").read_text())["inputs"]["model"]["name"] == shown[6:-2]


def test_the_approximate_paragraph_is_said_once_per_command(cli, tmp_path):
    """Issue 49, item 13: a config-derived model's "approximate: ..." paragraph (five lines on a
    terminal) is said once by each command that prints the plan's figures, never per phase or twice."""
    from capture_plan.planner.memory.fidelity import TRACE_COMMANDS

    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    eagle = (Path(__file__).parent / "data/eagle3.toml").read_text()  # four phases, drafts with models of their own
    (tmp_path / "s.toml").write_text('[model]\nconfig = "config.json"\n' + eagle.replace('name = "eagle3-example"', ""))
    (tmp_path / "t.csv").write_text("phase,size,count\ndecode,1,3\ntarget_verify,2,4\ndraft_decode,1,5\n")
    spec = ("-b", "fa3", "--spec", "s.toml")
    for args in (
        ("build", *spec, "-o", "s.json"),
        ("show", "s.json"),
        ("sizes", *spec, "--traffic", "t.csv", "--write-spec", "w.toml"),
        ("build", *spec, "--sizes", "auto", "--traffic", "t.csv", "-o", "auto.json"),
        ("build", "-b", "fa3", "--spec", "w.toml", "--dry-run"),
    ):
        code, out, err = cli(*args)
        assert code == 0, (args, err)
        assert (out + err).count(TRACE_COMMANDS) == 1 and (out + err).count("approximate: the figures") == 1, args
    code, out, err = cli("check", "--require-exact", "s.json")
    assert code == 1 and err.count(TRACE_COMMANDS) == 1 and err.count("the prediction is approximate:") == 1
