"""A plan's graph memory in KV tokens (issue 52 item 3): ``planner build``/``planner sizes``
``--engine ENGINE==VERSION`` (with ``--engine-flag NAME=VALUE``) price a plan built for a device
by planner fit's rule for that release (planner/fit/kv_price.py), record it (``predicted.kv``),
show what each chosen size costs in ``explain`` (graph-exec included, in KV tokens), choose sizes
under a KV-token floor (``--min-kv-tokens``), and ``diff --fail-above-kv-tokens`` gates on it.

Before: ``explain`` said each size "adds 0.0 MiB" (the pool's reuse), the size choice knew no
token floor, and ``diff`` gated on bytes only."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from cli_inputs import one_line_error

ROOT = Path(__file__).resolve().parents[1]
TRAFFIC = ROOT / "tests" / "data" / "traffic-skewed.csv"
H100 = "NVIDIA H100 80GB HBM3"
ENGINE = ("--device", H100, "--engine", "vllm==0.34.0", "--engine-flag", "max-model-len=8192")
AUTO = ("--sizes", "auto", "--traffic", str(TRAFFIC))


def _plan(tmp_path: Path, name: str) -> dict:
    return json.loads((tmp_path / name).read_text())


def _fix_command(err: str) -> list[str]:
    """The command a one-line error's fix names (between backticks), as argv after `planner`."""
    cmd = err.split("`")[1]
    argv = shlex.split(cmd)
    assert argv[0] == "planner"
    return argv[1:]


def test_the_pricer_is_planner_fits_rule(tmp_path):
    """The KV tokens a build records are planner fit's: with fit's own graph estimate of the
    engine's default sizes as the graph figure, the pricer gives fit's tokens for that set."""
    from capture_plan.planner.fit.fit import FitRequest, fit
    from capture_plan.planner.fit.kv_price import KvPricer
    from capture_plan.planner.fit.model import load_model

    model = load_model("llama-3-8b")
    flags = {"max-model-len": 8192}
    for engine in ("vllm==0.34.0", "vllm==0.33.0", "vllm==0.25.0"):
        res = fit(FitRequest(model, H100, engine, 1, flags))
        pricer = KvPricer(FitRequest(model, H100, engine, 1, flags))
        default = next(c for c in res.size_costs if c.name == "engine default")
        none = next(c for c in res.size_costs if c.name == "none")
        assert default.graph_bytes and pricer.tokens(default.graph_bytes) == default.kv_tokens, engine
        assert pricer.none_tokens == none.kv_tokens
    # 0.34 takes the graphs from free memory after capture: more graph memory, fewer tokens
    after = KvPricer(FitRequest(model, H100, "vllm==0.34.0", 1, flags))
    assert after.tokens(1 << 30) < after.tokens(0)


def test_a_build_for_a_device_records_its_graphs_in_kv_tokens(cli, tmp_path):
    code, out, err = cli("build", "-b", "fa3", *ENGINE, "-o", "kv.json")
    assert (code, err) == (0, ""), err
    kv = _plan(tmp_path, "kv.json")["predicted"]["kv"]
    assert kv["engine"] == f"vllm==0.34.0 on {H100} (max-model-len=8192)"
    assert "graph-exec included" in kv["graph"] and kv["graph_bytes"] > 0
    assert 0 < kv["kv_tokens"] < kv["kv_tokens_without_graphs"]
    code, out, err = cli("check", "kv.json")
    assert code == 0 and "up to date" in out
    # a build without --engine records none: every checked-in plan keeps its bytes
    assert "kv" not in json.loads((ROOT / "plans" / "fa3.json").read_text())["predicted"]


def test_explain_says_what_each_size_costs_on_the_device_and_in_tokens(cli, tmp_path):
    code, out, err = cli("build", "-b", "fa3", *ENGINE, *AUTO, "--max-graphs", "9", "-o", "s.json")
    assert code == 0, err
    code, out, err = cli("explain", "s.json")
    lines = [ln for ln in out.splitlines() if "it adds" in ln]
    assert len(lines) == 9
    for ln in lines:
        # each graph's executable costs device memory the pool's reuse does not make nothing
        assert "on the device (graph-exec included)" in ln and "KV tokens under vllm==0.34.0" in ln
        device = float(ln.split("hoisted), ")[1].split(" MiB")[0])
        assert device > 0
    plan = _plan(tmp_path, "s.json")
    choice = plan["predicted"]["sizes"][0]
    assert choice["kv_tokens"] == plan["predicted"]["kv"]["kv_tokens"]
    assert all(w["kv_tokens_without"] >= choice["kv_tokens"] for w in choice["sizes"])
    # what a size takes from the KV cache is said as a cost (it read "it adds ..., 16 KV tokens")
    costs = sorted(f"{w['kv_tokens_without'] - choice['kv_tokens']:,}" for w in choice["sizes"])
    assert sorted(ln.split("; it costs ")[1].split(" KV tokens under")[0] for ln in lines) == costs


def test_the_checked_in_calibrated_plan_counts_graph_exec_per_size():
    """plans/fa3-sizes-traffic-skewed-ci.json (calibrated on an H200, no engine): each size's
    reason names its device cost, graph-exec included, where it said only "adds 0.0 MiB"."""
    plan = json.loads((ROOT / "plans" / "fa3-sizes-traffic-skewed-ci.json").read_text())
    whys = [d["why"] for d in plan["decisions"] if d["rule"].startswith("sizes-auto ")]
    assert whys and all("on the device (graph-exec included)" in w for w in whys)
    assert "KV tokens" not in " ".join(whys)  # no --engine: no tokens


def _tokens(tmp_path: Path, name: str) -> int:
    return _plan(tmp_path, name)["predicted"]["kv"]["kv_tokens"]


def test_a_floor_chooses_fewer_sizes_and_one_no_list_meets_is_refused(cli, tmp_path):
    assert cli("build", "-b", "fa3", *ENGINE, *AUTO, "-o", "all.json")[0] == 0
    assert cli("build", "-b", "fa3", *ENGINE, *AUTO, "--max-graphs", "4", "-o", "four.json")[0] == 0
    many, few = _tokens(tmp_path, "all.json"), _tokens(tmp_path, "four.json")
    assert few > many
    floor = many + (few - many) // 2
    code, out, err = cli("build", "-b", "fa3", *ENGINE, *AUTO, "--min-kv-tokens", str(floor), "-o", "f.json")
    assert code == 0, err
    plan = _plan(tmp_path, "f.json")
    assert plan["predicted"]["kv"]["kv_tokens"] >= floor
    assert len(plan["phases"][0]["sizes"]) < len(_plan(tmp_path, "all.json")["phases"][0]["sizes"])
    assert f"--min-kv-tokens {floor}" in plan["predicted"]["sizes"][0]["why"]
    code, out, err = cli("check", "f.json")
    assert code == 0, err
    # no list leaves this many: one line naming the floor, what the best leaves and a command that passes
    code, out, err = cli("build", "-b", "fa3", *ENGINE, *AUTO, "--min-kv-tokens", "10000000", "-o", "g.json")
    line = one_line_error((code, out, err), "--min-kv-tokens 10000000", "below --min-kv-tokens 10,000,000")
    assert "one size leaves" in line
    assert cli(*_fix_command(line))[0] == 0


def test_a_floor_no_padding_list_meets_names_the_floor_not_the_padding(cli, tmp_path):
    """--max-padding with a floor that no list padding that little meets: the one line names the
    floor (what the best such list leaves), not a padding the lists do meet, and its fix works.
    Before: "no list ... pads at most 1%; the least padding there is 0.02%", fix "allow more
    sizes" (more sizes leave fewer tokens)."""
    assert cli("build", "-b", "fa3", *ENGINE, "-o", "kv.json")[0] == 0
    unmet = _plan(tmp_path, "kv.json")["predicted"]["kv"]["kv_tokens_without_graphs"] + 1
    args = ("build", "-b", "fa3", *ENGINE, *AUTO, "--max-padding", "1", "--min-kv-tokens", str(unmet))
    line = one_line_error(cli(*args, "-o", "p.json"), f"--min-kv-tokens {unmet}", f"below --min-kv-tokens {unmet:,}")
    assert "pads at most 1%" in line and "least padding" not in line
    assert cli(*_fix_command(line))[0] == 0


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (("--min-kv-tokens", "1000", *AUTO), ("--engine names none", "--min-kv-tokens 1000")),
        (("--engine", "vllm==0.34.0"), ("names none", "--device")),
        (("--engine-flag", "max-model-len=8192"), ("--engine names none",)),
        (("--device", H100, "--engine", "vllm==0.34.0"), ("context length is not known", "max-model-len=8192")),
    ],
)
def test_missing_kv_inputs_are_one_line_with_a_command_that_works(cli, args, needles):
    code, out, err = cli("build", "-b", "fa3", *args, "-o", "m.json")
    line = one_line_error((code, out, err), *needles)
    assert cli(*_fix_command(line))[0] == 0


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--engine", "vllm==9.9.9"), "no modelled sizing rule"),
        (("--engine-flag", "max-model-len"), "is not NAME=VALUE"),
        (("--engine-flag", "no-such=1"), "has no flag 'no-such'"),
        (("--engine-flag", "max-model-len=long"), "takes an integer"),
        (("--engine-flag", "gpu-memory-utilization=1.5"), "must be in (0, 1]"),
        (("--engine-flag", "cudagraph-capture-sizes=1,2"), "the plan's sizes say it here"),
        (("--min-kv-tokens", "0", *AUTO), "must be 1.."),
    ],
)
def test_bad_kv_options_are_one_line(cli, args, needle):
    base = ["--device", H100, "--engine-flag", "max-model-len=8192"]
    if args[0] != "--engine":
        base += ["--engine", "vllm==0.34.0"]
    one_line_error(cli("build", "-b", "fa3", *base, *args, "-o", "b.json"), needle)


def test_planner_sizes_takes_the_floor(cli, tmp_path):
    code, out, err = cli("sizes", "-b", "fa3", *ENGINE, "--traffic", str(TRAFFIC), "--min-kv-tokens", "10000000")
    one_line_error((code, out, err), "below --min-kv-tokens 10,000,000")
    code, out, err = cli("sizes", "-b", "fa3", *ENGINE, "--traffic", str(TRAFFIC), "--min-kv-tokens", "1000")
    assert code == 0, err


def test_diff_gates_on_kv_tokens(cli, tmp_path):
    assert cli("build", "-b", "fa3", *ENGINE, *AUTO, "--max-graphs", "9", "-o", "d9.json")[0] == 0
    assert cli("build", "-b", "fa3", *ENGINE, "-o", "d36.json")[0] == 0
    cost = _tokens(tmp_path, "d9.json") - _tokens(tmp_path, "d36.json")
    assert cost > 0
    code, out, err = cli("diff", "d9.json", "d36.json", "--fail-above-kv-tokens", str(cost - 1))
    line = one_line_error((code, out, err), "KV tokens under vllm==0.34.0", f"--fail-above-kv-tokens {cost - 1:,}")
    assert f"({-cost:+,})" in line
    code, out, err = cli("diff", "d9.json", "d36.json", "--fail-above-kv-tokens", str(cost))
    assert code == 0 and f"gate: within --fail-above-kv-tokens {cost:,}: KV tokens under vllm==0.34.0" in out
    # fewer sizes: more tokens, never a failure
    assert cli("diff", "d36.json", "d9.json", "--fail-above-kv-tokens", "0")[0] == 0
    code, out, err = cli("diff", "d9.json", "d36.json", "--fail-above-kv-tokens", "0", "-f", "markdown")
    assert code == 1 and "**Over the limit**: KV tokens" in out


def test_diff_kv_gate_bad_input_is_one_line(cli, tmp_path):
    assert cli("build", "-b", "fa3", *ENGINE, "-o", "k.json")[0] == 0
    one_line_error(cli("diff", "k.json", "k.json", "--fail-above-kv-tokens", "-5"), "is not a count of KV tokens")
    one_line_error(cli("diff", "k.json", "k.json", "--fail-above-kv-tokens", "1.5"), "is not a count of KV tokens")
    # a plan built without --engine: one line whose command builds one with it
    assert cli("build", "-b", "fa3", "-o", "plain.json")[0] == 0
    code, out, err = cli("diff", "plain.json", "k.json", "--fail-above-kv-tokens", "10")
    line = one_line_error((code, out, err), "records no KV tokens", "--engine vllm==0.34.0")
    assert cli(*_fix_command(line))[0] == 0
    assert "kv" in _plan(tmp_path, "plain-kv.json")["predicted"]


def test_the_summary_says_what_the_graphs_cost_in_tokens(cli):
    code, out, err = cli("build", "-b", "fa3", *ENGINE, "--dry-run")
    assert code == 0, err
    line = next(ln for ln in out.splitlines() if "KV tokens under" in ln)
    assert "with these graphs" in line and "with none: the graphs cost" in line


def test_sglang_prices_sizes_in_its_slack_not_in_tokens(cli, tmp_path):
    """SGLang 0.5.23 sizes its pool from a static fraction: sizes cost no tokens (fit's rule), so
    every size's KV cost is 0 while its device cost is not."""
    engine = ("--device", H100, "--engine", "sglang==0.5.23", "--engine-flag", "context-length=8192")
    code, out, err = cli("build", "-b", "fa3", *engine, *AUTO, "--max-graphs", "4", "-o", "g.json")
    assert code == 0, err
    kv = _plan(tmp_path, "g.json")["predicted"]["kv"]
    assert kv["kv_tokens"] == kv["kv_tokens_without_graphs"] > 0
    code, out, err = cli("explain", "g.json")
    assert all("; it costs 0 KV tokens under sglang==0.5.23" in ln for ln in out.splitlines() if "it adds" in ln)


def test_a_floor_on_a_device_whose_graph_memory_is_unknown_is_refused(cli):
    """The A100 (sm80) has a roofline but no per-node graph-exec figure: no list's tokens can be priced."""
    engine = ("--device", "NVIDIA A100-SXM4-80GB", "--engine", "vllm==0.34.0", "--engine-flag", "max-model-len=8192")
    code, out, err = cli("build", "-b", "fa3", *engine, *AUTO, "--min-kv-tokens", "1000", "-o", "a.json")
    one_line_error((code, out, err), "graph memory on the device is unknown", "--calibration REPORT")
    # without a floor the plan is built, its KV tokens unknown and said so
    code, out, err = cli("build", "-b", "fa3", *engine, "--dry-run")
    assert code == 0 and "KV tokens under vllm==0.34.0 on NVIDIA A100-SXM4-80GB (max-model-len=8192): unknown" in out


def test_a_spec_with_a_config_gives_the_context_length(cli, tmp_path):
    """A spec naming a config.json: fit reads its max_position_embeddings, no --engine-flag needed,
    and planner check rebuilds the plan (the config found relative to the plan's folder)."""
    from cli_inputs import LLAMA, SPEC

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({**LLAMA, "max_position_embeddings": 8192}))
    (tmp_path / "m" / "s.toml").write_text('[model]\nconfig = "config.json"\n' + SPEC)
    args = ("build", "-b", "fa3", "--spec", "m/s.toml", "--device", H100, "--engine", "vllm==0.34.0")
    code, out, err = cli(*args, "-o", "plans/c.json")
    assert code == 0, err
    kv = _plan(tmp_path, "plans/c.json")["predicted"]["kv"]
    assert kv["engine"] == f"vllm==0.34.0 on {H100}" and kv["kv_tokens"] > 0
    code, out, err = cli("check", "plans/c.json")
    assert code == 0 and "up to date" in out, err


def test_planner_sizes_shows_each_lists_tokens_and_chooses_under_the_floor(cli):
    args = ("sizes", "-b", "fa3", *ENGINE, "--traffic", str(TRAFFIC))
    code, out, err = cli(*args)
    assert code == 0, err
    assert "KV tokens: left under vllm==0.34.0" in out and "KV tokens left" in out.splitlines()[-1]
    rows = {ln.split()[0]: int(ln.split()[-2].replace(",", "")) for ln in out.splitlines() if ln[2:4].strip().isdigit()}
    assert rows["1"] > rows["36"] > rows["64"]  # more sizes, more graph memory, fewer tokens
    floor = rows["36"] + 1
    code, out, err = cli(*args, "--min-kv-tokens", str(floor))
    assert code == 0, err
    chosen = next(ln for ln in out.splitlines() if ln.startswith("  chosen: "))
    assert f"--min-kv-tokens {floor}" in chosen and int(chosen.split()[1]) < 36


def test_a_spec_of_an_moe_model_is_priced_with_its_experts():
    """A spec's MoE fields reach fit's model (weights counted per expert, not as one dense MLP)."""
    from capture_plan.planner.fit.kv_price import spec_model
    from capture_plan.planner.fit.model import weight_bytes

    dense = dict(layers=24, hidden=2048, heads=16, kv_heads=16, head_dim=128, intermediate=5632, vocab=151936)
    moe = {
        **dense,
        "experts": 60,
        "experts_per_token": 4,
        "expert_intermediate": 1408,
        "shared_expert_intermediate": 5632,
    }
    m = spec_model("qwen2-moe", moe, None)
    assert (m.experts, m.experts_per_token, m.expert_intermediate) == (60, 4, 1408)
    assert weight_bytes(m, 1) > 3 * weight_bytes(spec_model("dense", dense, None), 1)


@pytest.mark.parametrize(
    ("engine", "flags", "needle"),
    [
        ("vllm==0.34.0", ["no-such-flag=1"], "has no flag 'no-such-flag'"),
        ("sglang==0.5.23", ["no-such-flag=1"], "has no flag 'no-such-flag'"),
        ("vllm==0.34.0", ["max-num-seqs"], "is not NAME=VALUE"),
        ("vllm==0.34.0", ["max-num-seqs=many"], "takes an integer"),
        ("vllm==0.34.0", ["max-num-seqs=0"], "must be an integer from 1"),
        ("vllm==0.34.0", ["gpu-memory-utilization=1.5"], "must be in (0, 1]"),
        ("sglang==0.5.23", ["kv-cache-dtype=1"], "unknown --kv-cache-dtype value '1'"),
        ("sglang==0.5.23", ["mem-fraction-static=2"], "must be in (0, 1)"),
        ("vllm==0.34.0", ["cudagraph-mode=FULL"], "the plan's sizes say it here"),
        ("vllm==9.9", [], "no modelled sizing rule"),
        ("vllm", [], "unknown engine 'vllm'"),
        ("sglang==0.5.23", ["block-size=16"], "sglang has no flag 'block-size'"),
    ],
)
def test_a_refused_engine_setting_names_a_build_command_that_works(cli, engine, flags, needle):
    """Every refusal of ``--engine``/``--engine-flag`` (parse_engine_flags', fit's own bounds and
    choices) names, between backticks, the build command with the change that works, and that
    command builds. Before: fragments (``e.g. --engine-flag kv-cache-dtype=1``, refused itself),
    and fit's flag named alone as the placeholder ``--engine-flag NAME=VALUE``."""
    length = "context-length=8192" if engine.startswith("sglang") else "max-model-len=8192"
    args = ["build", "-b", "fa3", "--device", H100, "--engine", engine, "--engine-flag", length]
    for flag in flags:
        args += ["--engine-flag", flag]
    line = one_line_error(cli(*args, "--dry-run"), needle)
    assert "--engine-flag NAME=VALUE" not in line and "`planner build " in line, line
    assert "VALUE" not in line.split("`")[1], line
    code, out, err = cli(*_fix_command(line))
    assert code == 0, (line, err)


def test_an_engine_flag_given_twice_is_one_line(cli):
    """Before: the last of two values was priced and the first silently dropped."""
    args = ("build", "-b", "fa3", *ENGINE, "--engine-flag", "max-model-len=4096", "--dry-run")
    one_line_error(cli(*args), "--engine-flag max-model-len=4096", "given twice")


def test_planner_sizes_floor_without_an_engine_names_the_engine(cli):
    """``planner sizes --min-kv-tokens`` without ``--engine``: one line saying the engine is
    missing, whose command (this ``planner sizes`` with an engine, a device and a context
    length) works. Before: "graph memory on the device is unknown ..., so the KV tokens  is
    left cannot be priced; fix: build with --calibration REPORT", which an added calibration
    does not fix (no engine prices tokens); then the flags to add, not a command."""
    args = ("sizes", "-b", "fa3", "--traffic", str(TRAFFIC), "--min-kv-tokens", "1000")
    line = one_line_error(cli(*args), "--min-kv-tokens 1000", "--engine names none")
    argv = shlex.split(line.split("`")[1])
    assert argv[:2] == ["planner", "sizes"] and "--min-kv-tokens" in argv, argv
    assert cli(*argv[1:])[0] == 0


def test_planner_fit_of_an_moe_spec_counts_its_experts_as_build_engine_does(tmp_path):
    """One reading of a spec's model for fit: `planner fit --model SPEC` and `build --engine`
    count the same weights for an MoE spec. Before, ``from_spec`` dropped the expert fields
    (a dense MLP: ~3x fewer weight bytes than the build's pricer counted)."""
    from capture_plan.planner.fit.kv_price import spec_model
    from capture_plan.planner.fit.model import from_spec, weight_bytes

    dims = dict(layers=24, hidden=2048, heads=16, kv_heads=16, head_dim=128, intermediate=5632, vocab=151936)
    moe = {**dims, "experts": 60, "experts_per_token": 4, "expert_intermediate": 1408}
    spec = tmp_path / "moe.toml"
    spec.write_text(
        'name = "moe"\n\n[model]\nname = "qwen2-moe"\n'
        + "".join(f"{k} = {v}\n" for k, v in moe.items())
        + '\n[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 2, 4]\n'
    )
    m = from_spec(spec)
    assert (m.experts, m.experts_per_token, m.expert_intermediate) == (60, 4, 1408)
    assert weight_bytes(m, 1) == weight_bytes(spec_model("qwen2-moe", moe, None), 1)


def test_the_kv_gate_refuses_plans_priced_under_different_settings(cli):
    """`diff --fail-above-kv-tokens` compares one engine's tokens: two plans priced under other
    settings (here max-model-len) are one line naming both, not a cost blamed on the new
    plan's graphs. Before, the gate compared them and said 'capture fewer sizes'."""
    other = ("--device", H100, "--engine", "vllm==0.34.0", "--engine-flag", "max-model-len=4096")
    assert cli("build", "-b", "fa3", *ENGINE, "-o", "a.json")[0] == 0
    assert cli("build", "-b", "fa3", *other, "-o", "b.json")[0] == 0
    line = one_line_error(
        cli("diff", "a.json", "b.json", "--fail-above-kv-tokens", "0"), "different engines, devices or settings"
    )
    assert "max-model-len=8192" in line and "max-model-len=4096" in line and "planner show b.json" in line


def test_the_kv_gates_fix_for_a_plan_with_a_config_adds_no_context_length(cli, tmp_path):
    """`diff --fail-above-kv-tokens` on a plan built without an engine: its fix is the build
    with the KV inputs filled in by the one filler (schedule/kv.py fixed_command), so a spec whose
    config.json gives the context length gets no made-up max-model-len, and the command works.
    Before, the fix always added max-model-len=8192 (check.py's own copy of the filler)."""
    from cli_inputs import LLAMA, SPEC

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({**LLAMA, "max_position_embeddings": 4096}))
    (tmp_path / "m" / "s.toml").write_text('[model]\nconfig = "config.json"\n' + SPEC)
    assert cli("build", "-b", "fa3", "--spec", "m/s.toml", "-o", "p.json")[0] == 0
    assert cli("build", "-b", "fa3", "--spec", "m/s.toml", *ENGINE[:4], "-o", "q.json")[0] == 0
    line = one_line_error(cli("diff", "p.json", "q.json", "--fail-above-kv-tokens", "10"), "records no KV tokens")
    fix = _fix_command(line)
    assert "--engine" in fix and not any("max-model-len" in a for a in fix), fix
    assert cli(*fix)[0] == 0 and "kv" in _plan(tmp_path, "p-kv.json")["predicted"]


@pytest.mark.parametrize(
    ("command", "utilization", "needle"),
    [
        (("build", "--dry-run"), "0.05", "would not start with the plan's graphs (378.0 MiB"),
        (("sizes", "--traffic", str(TRAFFIC)), "0.05", "would not start with the plan's graphs (378.0 MiB"),
        (("build", *AUTO, "--dry-run"), "0.05", "would not start with the plan's graphs (378.0 MiB"),
        # enough for one request without graphs, not with the plan's 378 MiB of them (vLLM 0.34.0
        # sizes its KV cache after capture): the plan's own graphs are what the engine fails on
        (("build", "--dry-run"), "0.22", "would not start with the plan's graphs (378.0 MiB"),
        (("sizes", "--traffic", str(TRAFFIC)), "0.22", "would not start with the plan's graphs"),
        (("sizes", "--traffic", str(TRAFFIC), "--min-kv-tokens", "1000"), "0.22", "with one size's graphs"),
    ],
)
def test_a_build_whose_engine_would_not_start_is_refused_with_a_command_that_works(cli, command, utilization, needle):
    """Issue 52 review: a build or ``planner sizes`` under an engine that would not start (its KV
    cache holds less than one request) exited 0 and said the graphs "cost 0" tokens. It is one
    line naming why, its fix the command run (``planner sizes`` its own, not a build) with fit's
    first fix (each checked by fit)."""
    args = (command[0], "-b", "fa3", *ENGINE, "--engine-flag", f"gpu-memory-utilization={utilization}", *command[1:])
    line = one_line_error(cli(*args), needle, "fewer than one request of max-model-len 8192", f"`planner {command[0]} ")
    assert "the graphs cost 0" not in line
    assert "enforce-eager" not in line and "cudagraph" not in line  # a build's sizes are its plan's
    code, out, err = cli(*_fix_command(line))
    priced = "KV tokens under vllm==0.34.0" if command[0] == "build" else "KV tokens left"
    assert code == 0 and priced in out, (line, err)


def test_a_context_length_past_the_models_is_refused_in_a_build_unless_vllms_variable(cli, tmp_path, monkeypatch):
    """A build's --engine-flag max-model-len past its config's max_position_embeddings: refused as
    vLLM refuses it (vllm/config/model.py _get_and_verify_max_len), its fix the longest it takes;
    VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 lets it through, and the plan's engine label says so."""
    from cli_inputs import LLAMA, SPEC

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({**LLAMA, "max_position_embeddings": 4096}))
    (tmp_path / "m" / "spec.toml").write_text('[model]\nconfig = "config.json"\n' + SPEC)
    args = ("build", "--spec", "m/spec.toml", "-b", "fa3", "--device", H100, "--engine", "vllm==0.34.0")
    line = one_line_error(
        cli(*args, "--engine-flag", "max-model-len=8192", "--dry-run"),
        "--engine-flag max-model-len=8192: 8,192 tokens are more than the 4,096 vLLM 0.34.0 derives",
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1",
        "the longest vLLM 0.34.0 takes: `planner build ",
    )
    assert "max-model-len=4096" in line.split("`")[1]
    assert cli(*_fix_command(line))[0] == 0
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "true")
    code, out, err = cli(*args, "--engine-flag", "max-model-len=8192", "--dry-run")
    assert code == 0 and "(max-model-len=8192) under VLLM_ALLOW_LONG_MAX_MODEL_LEN=1" in out, err
