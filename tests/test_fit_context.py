"""`planner fit`'s context length as each release takes it (planner/fit/context.py,
planner/data/fit_rules.toml [context.NAME]): the length the release derives from a config.json
(vLLM's vllm/config/model.py ``_get_and_verify_max_len``, SGLang's sglang/srt/utils/
hf_transformers/common.py ``get_context_length``), its default, and its refusal of a longer
``--max-model-len``/``--context-length`` unless its environment variable allows it.

Each expected length below is worked out by hand from the release's code, not from fit's.
Before: fit took any ``--max-model-len`` (Gemma-2 at 32768 where its config says 8192), which
the engine refuses at start."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from capture_plan.planner.cli import main
from capture_plan.planner.fit.context import derived
from capture_plan.planner.fit.fit import FitRequest, fit
from capture_plan.planner.fit.model import load_model
from capture_plan.planner.fit.refusal import Refusal
from capture_plan.planner.fit.tables import context_rules, releases
from capture_plan.schemas.errors import InputError
from cli_inputs import LLAMA

ROOT = Path(__file__).resolve().parent.parent
LLAMA31 = ROOT / "planner/data/configs/llama-3.1-8b.json"
QWEN25 = ROOT / "planner/data/configs/qwen2.5-7b.json"
DEEPSEEK = ROOT / "planner/data/configs/deepseek-v2-lite.json"
#: the three vLLM rows: transformers 4 (0.19.0), transformers 5 before 0.30.0, and 0.30.0 on
V19, V29, V34 = "vllm==0.19.0", "vllm==0.29.0", "vllm==0.34.0"
SGL = "sglang==0.5.23"
BASE = {k: v for k, v in LLAMA.items() if k != "max_position_embeddings"}


def _model(tmp_path: Path, **keys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**BASE, **keys}))
    return load_model(str(path))


def _length(model, release: str) -> tuple[float | None, int | None]:
    engine, version = release.split("==")
    limit, default, _ = derived(model, engine, version)
    return limit, default


def run(*args: str, capsys) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_every_modelled_release_has_one_context_rule():
    covered = [f"{r.engine}=={v}" for r in context_rules().values() for v in r.releases]
    assert sorted(covered) == sorted(releases()), "each release in exactly one [context] table"
    for name, r in context_rules().items():
        assert r.sources and all(": " in s for s in r.sources), name  # each names its file and function


# (config keys, {release: (length, default)}); None: the release refuses the config at start
CASES = {
    "no rope: max_position_embeddings": (
        {"max_position_embeddings": 32768},
        {V19: (32768, 32768), V29: (32768, 32768), V34: (32768, 32768), SGL: (32768, 32768)},
    ),
    # vLLM takes the smallest key (derive_max_model_len_and_key), SGLang the first of its order
    "two keys: vLLM the smallest, SGLang the first of its list": (
        {"max_position_embeddings": 4096, "seq_length": 8192},
        {V34: (4096, 4096), SGL: (8192, 8192)},
    ),
    # Command-R: model_max_length replaces vLLM's pick; it comes before max_position_embeddings in SGLang's
    "model_max_length": (
        {"max_position_embeddings": 8192, "model_max_length": 131072},
        {V34: (131072, 131072), SGL: (131072, 131072)},
    ),
    "linear factor 4": (
        {"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 4.0}},
        {V19: (16384, 16384), V34: (16384, 16384), SGL: (16384, 16384)},
    ),
    # a factor that is not whole: vLLM compares the float, its default int(); SGLang int(factor x length)
    "dynamic factor 2.5": (
        {"max_position_embeddings": 4095, "rope_scaling": {"rope_type": "dynamic", "factor": 2.5}},
        {V34: (10237.5, 10237), SGL: (10237, 10237)},
    ),
    "llama3: not scaled": (
        {"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
        {V19: (131072, 131072), V34: (131072, 131072), SGL: (131072, 131072)},
    ),
    # yarn without original_max_position_embeddings: transformers 4 (vLLM 0.19.0) has no row key to
    # read (a KeyError at start); transformers 5 gives it max_position_embeddings: 0.20.0 to 0.29.0 scale
    # it, 0.30.0 on take max_position_embeddings as already scaled, SGLang sees the key and does not scale
    "yarn, no original": (
        {"max_position_embeddings": 32768, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
        {V19: None, V29: (131072, 131072), V34: (32768, 32768), SGL: (32768, 32768)},
    ),
    "yarn with its original": (
        {
            "max_position_embeddings": 32768,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192},
        },
        {V19: (32768, 32768), V29: (32768, 32768), V34: (32768, 32768), SGL: (32768, 32768)},
    ),
    # Phi-3 long: longrope (legacy "su") is not scaled; vLLM's default is the config's original
    "su (longrope), original at the top": (
        {
            "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096,
            "rope_scaling": {"type": "su", "long_factor": [1.0], "short_factor": [1.0]},
        },
        {V19: (131072, 4096), V34: (131072, 4096), SGL: (131072, 131072)},
    ),
    # Gemma-3: vLLM does not scale a gemma3 model type; SGLang does (a linear row, no original)
    "gemma3_text linear factor 8": (
        {
            "model_type": "gemma3_text",
            "max_position_embeddings": 131072,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        },
        {V34: (131072, 131072), SGL: (1048576, 1048576)},
    ),
    # rows by layer type: vLLM reads each row, SGLang the top-level dict (no factor there)
    "nested by layer type": (
        {
            "max_position_embeddings": 8192,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0},
                "sliding_attention": {"rope_type": "default"},
            },
        },
        {V34: (16384, 16384), SGL: (8192, 8192)},
    ),
    # a null factor: vLLM warns and takes 1.0; SGLang's int(None * length) fails at start
    "null factor": (
        {"max_position_embeddings": 8192, "rope_scaling": {"rope_type": "linear", "factor": None}},
        {V34: (8192, 8192), SGL: None},
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_release_derives_the_length_as_its_code_does(tmp_path, case):
    keys, expected = CASES[case]
    model = _model(tmp_path, **keys)
    for release, want in expected.items():
        if want is None:
            with pytest.raises(InputError):
                _length(model, release)
        else:
            assert _length(model, release) == want, (case, release)


def test_a_config_without_a_length_key_is_not_checked_and_needs_the_flag(tmp_path, capsys):
    model = _model(tmp_path)
    assert _length(model, V34) == (None, None)
    assert fit(FitRequest(model, "H100", V34, 1, {"max-model-len": 1 << 20})).settings["max-model-len"] == 1 << 20
    args = ("fit", "--model", str(tmp_path / "config.json"), "--device", "H100", "--engine", V34)
    code, _, err = run(*args, capsys=capsys)
    assert code == 1 and "gives no context length" in err and "--max-model-len 8192`" in err


@pytest.mark.parametrize(
    ("model", "engine", "flag", "longest"),
    [
        (LLAMA31, V34, "--max-model-len", 131072),
        (LLAMA31, V19, "--max-model-len", 131072),
        (DEEPSEEK, V34, "--max-model-len", 163840),
        (QWEN25, SGL, "--context-length", 32768),
    ],
)
def test_a_longer_context_is_refused_with_the_longest_as_a_command_that_works(capsys, model, engine, flag, longest):
    args = ["fit", "--model", str(model), "--device", "H200", "--engine", engine]
    assert run(*args, flag, str(longest), capsys=capsys)[0] == 0
    code, _, err = run(*args, flag, str(longest + 1), capsys=capsys)
    assert code == 1 and err.count("\n") == 1, err
    assert f"{flag} {longest + 1}: {longest + 1:,} tokens are more than the {longest:,}" in err, err
    assert f"{flag} {longest}`" in err and "_ALLOW_" in err, err
    argv = shlex.split(err.split("`")[1])
    assert argv[:2] == ["planner", "fit"] and run(*argv[1:], capsys=capsys)[0] == 0, err


@pytest.mark.parametrize(
    ("engine", "flag", "env", "device"),
    [
        (V34, "max-model-len", "VLLM_ALLOW_LONG_MAX_MODEL_LEN", "H200"),
        (SGL, "context-length", "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "H100"),
    ],
)
def test_a_fix_let_through_by_the_engines_variable_is_printed_behind_it(monkeypatch, capsys, engine, flag, env, device):
    """Fails before: a million-token context let through by the engine's variable does not
    fit, and the fix (a shorter length, still past the model's own) was printed as a bare
    `planner fit ...`, which a fresh shell refuses. It is printed behind the variable, and
    runs there (the variable set) as printed."""
    monkeypatch.setenv(env, "1")
    args = ["fit", "--model", str(LLAMA31), "--device", device, "--engine", engine]
    code, _, err = run(*args, f"--{flag}", "1000000", capsys=capsys)
    assert code == 1 and err.count("\n") == 1, err
    command = err.split("`")[1]
    assert command.startswith(f"{env}=1 planner fit "), err
    argv = shlex.split(command)
    assert run(*argv[2:], capsys=capsys)[0] == 0, err
    monkeypatch.delenv(env)
    assert run(*argv[2:], capsys=capsys)[0] == 1  # without it, refused: the prefix is needed


@pytest.mark.parametrize(
    ("engine", "flag", "env", "value", "allowed"),
    [
        (V34, "max-model-len", "VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1", True),
        (V34, "max-model-len", "VLLM_ALLOW_LONG_MAX_MODEL_LEN", " True ", True),  # stripped, lower-cased
        (V34, "max-model-len", "VLLM_ALLOW_LONG_MAX_MODEL_LEN", "yes", False),  # only 1 and true
        (V19, "max-model-len", "VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0", False),
        (SGL, "context-length", "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "Yes", True),  # EnvBool
        (SGL, "context-length", "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", " 1", False),  # not stripped
        (SGL, "context-length", "SGLANG_IS_IN_CI", "true", True),  # is_in_ci() lets it through too
        (SGL, "context-length", "VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1", False),  # the other engine's
    ],
)
def test_the_engines_variable_lets_a_longer_context_through_as_the_engine_reads_it(
    monkeypatch, engine, flag, env, value, allowed
):
    model = load_model(str(QWEN25))
    monkeypatch.setenv(env, value)
    if not allowed:
        with pytest.raises(Refusal) as err:
            fit(FitRequest(model, "H200", engine, 1, {flag: 40000}))
        assert err.value.changes == {flag: 32768}
        return
    res = fit(FitRequest(model, "H200", engine, 1, {flag: 40000}))
    assert res.settings[flag] == 40000 and res.kv_tokens
    assert any(n.startswith(f"{env} is set: the engine takes 40,000 tokens, past the 32,768") for n in res.notes)


def test_the_default_is_the_releases_own(tmp_path):
    """No flag: int(length), and under longrope vLLM's original_max_position_embeddings."""
    phi = _model(
        tmp_path,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        rope_scaling={"rope_type": "longrope", "long_factor": [1.0], "short_factor": [1.0]},
    )
    assert fit(FitRequest(phi, "H200", V34, 1, {})).settings["max-model-len"] == 4096
    assert fit(FitRequest(phi, "H200", SGL, 1, {})).settings["context-length"] == 131072
    # vLLM still takes up to the length the config derives
    assert fit(FitRequest(phi, "H200", V34, 1, {"max-model-len": 131072})).settings["max-model-len"] == 131072


@pytest.mark.parametrize(
    ("keys", "path"),
    [
        ({"max_position_embeddings": "long"}, "$.max_position_embeddings"),
        ({"max_position_embeddings": 8192, "seq_length": -1}, "$.seq_length"),
        ({"max_position_embeddings": 8192, "rope_scaling": {"type": "linear", "factor": "4"}}, "$.rope_scaling.factor"),
        ({"max_position_embeddings": 8192, "rope_scaling": {"type": "linear", "factor": 0}}, "$.rope_scaling.factor"),
        ({"max_position_embeddings": 8192, "rope_scaling": [4]}, "$.rope_scaling"),
        ({"max_position_embeddings": 8192, "rope_scaling": {"type": 4}}, "$.rope_scaling.rope_type"),
        ({"max_position_embeddings": 0}, "config.json"),
    ],
)
def test_a_malformed_length_is_refused_at_its_path(tmp_path, capsys, keys, path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **keys}))
    args = ["fit", "--model", str(tmp_path / "config.json"), "--device", "H100", "--engine", V34]
    code, _, err = run(*args, "--max-model-len", "4096", capsys=capsys)
    assert code == 1 and err.count("\n") == 1 and path in err and "fix: " in err, err
