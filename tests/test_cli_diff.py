"""``planner diff``: the figures, inputs and decisions a reviewer reads, a CI
threshold and a Markdown PR comment (issue 19). Before: "predicted hoisted:
0.0 MiB -> 0.0 MiB (-100.0%)" for 8,200 B -> 0 B, no per-pool figures, no
inputs, and --exit-code failed on any change."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgspec
import pytest

from cli_inputs import SPEC, one_line_error

PLANS = Path(__file__).resolve().parents[1] / "plans"


@pytest.fixture
def plans(tmp_path):
    shutil.copytree(PLANS, tmp_path / "plans")
    return tmp_path / "plans"


def test_a_change_under_one_mib_is_written_in_bytes(cli, plans):
    code, out, err = cli("diff", "plans/fa3-eagle-ci.json", "plans/fa3-eagle.json")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[:7] == [
        "plans/fa3-eagle-ci.json -> plans/fa3-eagle.json",
        "predicted:",
        "  total (pools + hoisted): 1,520.0 MiB -> 1,520.0 MiB (-8,200 B, -0.00051%)",
        # the same figure twice (the plan's hoisted bytes are the device's hoisted item): one line
        "  hoisted = device item hoisted: 8,200 B -> 0 B (-8,200 B, -100.0%)",
        "inputs:",
        "  command: planner build --backend fa3 --ci --speculative eagle -> planner build --backend fa3 "
        "--speculative eagle",
        "  ci: true -> false",
    ]
    assert "  [target_verify] fa3-ci-varlen-gate: workspace=hoisted -> (none)" in lines
    assert (
        lines[-1] == "steps: 210 (204 captures, 4 warm-ups, 2 provisions) -> 208 (204 captures, 4 warm-ups, "
        "0 provisions)"
    )


def test_per_pool_per_phase_baseline_and_inputs(cli, plans):
    code, out, _ = cli("diff", "plans/fa3.json", "plans/fa3-eagle.json")
    lines = out.splitlines()
    assert code == 0
    for line in [
        "  pool shared: 258.0 MiB -> 542.0 MiB (+284.0 MiB, +110.1%)",
        "  pool phase:target_verify: (none) -> 978.0 MiB",
        "  phase adds decode: 258.0 MiB -> 0 B (-258.0 MiB, -100.0%)",
        "  phase adds target_verify: (none) -> 978.0 MiB",
        "  largest graph alone: 252.0 MiB -> 972.0 MiB (+720.0 MiB, +285.7%)",
        "  engines' loop baseline: 2,122.0 MiB -> 11,486.0 MiB (+9,364.0 MiB, +441.3%)",
        "  captures: 36 -> 204 (+168, +466.7%)",
        "  spec: embedded:default (79b2e6c6e604) -> embedded:default-eagle (9d7baaf8fa5b)",
        "  speculative: none -> eagle",
        "  sizes decode: 36 sizes 1..256 -> 51 sizes 1..256 (+[3, 5, 6, 7, 10, 14, 18, 20, ... (15 in all)])",
        "  sizes target_verify: (none) -> 51 sizes 1..256",
        "phase order: decode => target_verify -> draft_extend -> draft_decode -> decode",
    ]:
        assert line in lines, (line, out)


def test_tp_and_model_changes_are_inputs(cli, plans):
    assert cli("build", "-b", "fa3", "--ci", "--tp", "8", "-o", "tp8.json")[0] == 0
    code, out, _ = cli("diff", "plans/fa3-ci.json", "tp8.json")
    assert code == 0
    assert (
        "inputs:\n  command: planner build --backend fa3 --ci "
        "-> planner build --backend fa3 --ci --tp 8 -o tp8.json"
        "\n  tp: 1 -> 8\n" in out
    )
    assert "  largest graph alone: 252.0 MiB -> 214.0 MiB (-38.0 MiB, -15.1%)" in out.splitlines()


def test_identical_plans(cli, plans):
    code, out, _ = cli("diff", "plans/fa3.json", "plans/fa3.json", "--exit-code", "--fail-above", "0")
    assert (code, out) == (
        0,
        "plans/fa3.json and plans/fa3.json: no differences in inputs, steps, decisions or predictions\n",
    )


@pytest.mark.parametrize(
    "limit,code,shown",
    [
        ("5", 1, "5%"),
        ("5%", 1, "5%"),
        ("1262MiB", 0, ""),
        ("1261MiB", 1, "1,261.0 MiB"),
        ("489", 1, "489%"),
        ("490", 0, ""),
        ("1GiB", 1, "1,024.0 MiB"),
        ("8200B", 1, "8,200 B"),
    ],
)
def test_fail_above_is_the_ci_threshold(cli, plans, limit, code, shown):
    # fa3 -> fa3-eagle: 258.0 -> 1,520.0 MiB, +1,262.0 MiB, +489.1%
    got, out, err = cli("diff", "plans/fa3.json", "plans/fa3-eagle.json", "--fail-above", limit)
    assert got == code and out.startswith("plans/fa3.json -> plans/fa3-eagle.json\n")
    if code:
        assert err == (
            "planner: error: plans/fa3-eagle.json: predicted total (pools + hoisted; no device total in either "
            "plan) grew 258.0 MiB -> 1,520.0 MiB "
            f"(+1,262.0 MiB, +489.1%), above --fail-above {shown}; fix: make the plan cheaper, or "
            "raise --fail-above if the growth is intended\n"
        )
    else:
        assert err == ""


@pytest.fixture
def nine_sizes(cli, plans):
    """The reference at 9 sizes chosen for the skewed traffic, with the H200 calibration
    (plans/fa3-ci-h200.json is the same build at the spec's 36 sizes)."""
    traffic = PLANS.parent / "tests" / "data" / "traffic-skewed.csv"
    args = ["--calibration", "plans/calibration/h200-fa3-ci.json", "--sizes", "auto", "--traffic", str(traffic)]
    code, _, err = cli("build", "-b", "fa3", "--ci", *args, "--max-graphs", "9", "-o", "plans/nine.json")
    assert (code, err) == (0, "")
    return "plans/nine.json"


def test_fail_above_gates_on_the_device_total_with_graph_exec(cli, plans, nine_sizes):
    # issue 52: 9 -> 36 sizes leaves pools + hoisted at 258.0 MiB (+0.0%), but graph-exec grows
    # 23.5 -> 94.0 MiB, the device total +22.2%; the gate compared pools + hoisted and exited 0
    code, out, err = cli("diff", nine_sizes, "plans/fa3-ci-h200.json", "--fail-above", "5%")
    assert code == 1 and "device: taken after capture: 317.5 MiB -> 388.0 MiB (+70.5 MiB, +22.2%)" in out
    assert err == (
        "planner: error: plans/fa3-ci-h200.json: device total (graph-exec included) grew 317.5 MiB -> 388.0 MiB "
        "(+70.5 MiB, +22.2%), above --fail-above 5%; fix: make the plan cheaper, or raise --fail-above if the "
        "growth is intended\n"
    )
    code, out, err = cli("diff", nine_sizes, "plans/fa3-ci-h200.json", "--fail-above", "70MiB")
    assert code == 1
    code, out, err = cli("diff", nine_sizes, "plans/fa3-ci-h200.json", "--fail-above", "25%")
    assert (code, err) == (0, "")
    # within the limit, the text says which total it gated on
    assert out.splitlines()[-1] == (
        "gate: within --fail-above 25%: device total (graph-exec included) 317.5 MiB -> 388.0 MiB (+70.5 MiB, +22.2%)"
    )


def test_fail_above_gates_on_pools_and_hoisted_where_a_plan_has_no_device_total(cli, plans):
    # fa3-ci has no calibration: its device total is unknown, so the gate reads pools + hoisted, and says so
    code, out, err = cli("diff", "plans/fa3-ci.json", "plans/fa3-ci-h200.json", "--fail-above", "0")
    assert (code, err) == (0, "")
    assert out.splitlines()[-1] == (
        "gate: within --fail-above 0%: predicted total (pools + hoisted; no device total in the old plan) "
        "258.0 MiB -> 258.0 MiB"
    )
    code, out, _ = cli("diff", "plans/fa3-ci-h200.json", "plans/fa3-ci.json", "-f", "markdown", "--fail-above", "0")
    assert code == 0 and out.splitlines()[2] == (
        "Within the limit: --fail-above 0%: predicted total (pools + hoisted; no device total in the new plan) "
        "258.0 MiB -> 258.0 MiB."
    )


def test_fail_above_never_fails_a_plan_that_shrinks(cli, plans):
    assert cli("diff", "plans/fa3-eagle.json", "plans/fa3.json", "--fail-above", "0")[0] == 0


def test_exit_code_fails_on_any_difference(cli, plans):
    assert cli("diff", "plans/fa3-eagle-ci.json", "plans/fa3-eagle.json", "--exit-code")[0] == 1
    assert cli("diff", "plans/fa3-eagle-ci.json", "plans/fa3-eagle.json", "--fail-above", "0")[0] == 0


@pytest.mark.parametrize("limit", ["x", "-3", "nan", "inf", "5 MiB%", ""])
def test_a_threshold_that_is_not_a_number_is_a_usage_error(cli, plans, limit):
    code, out, err = cli("diff", "plans/fa3.json", "plans/fa3.json", "--fail-above", limit)
    assert (code, out) == (2, "")
    assert err.splitlines()[-1] == (
        f"Error: Invalid value for '--fail-above': {limit!r} is not a percentage (5, 5%) or an amount (64MiB, 8200B)"
    )


def test_markdown_for_a_pr_comment(cli, plans):
    code, out, _ = cli("diff", "plans/fa3-eagle-ci.json", "plans/fa3-eagle.json", "-f", "markdown", "--fail-above", "5")
    lines = out.splitlines()
    assert code == 0
    assert lines[:6] == [
        "### Capture plan `plans/fa3-eagle.json` vs `plans/fa3-eagle-ci.json`",
        "",
        "Within the limit: --fail-above 5%: predicted total (pools + hoisted; no device total in either plan) "
        "1,520.0 MiB -> 1,520.0 MiB (-8,200 B, -0.00051%).",
        "",
        "| figure | old | new | change |",
        "| --- | ---: | ---: | ---: |",
    ]
    assert "| **total (pools + hoisted)** | 1,520.0 MiB | 1,520.0 MiB | **-8,200 B, -0.00051%** |" in lines
    assert "| pool phase:target_verify = phase adds target_verify | 978.0 MiB | 978.0 MiB | |" in lines
    assert "| **hoisted = device item hoisted** | 8,200 B | 0 B | **-8,200 B, -100.0%** |" in lines
    # the device items never measured: one line, not one "unknown | unknown" row each
    assert (
        "Unknown in both plans (never measured for this device): device: reserve (peak), device: taken after "
        "capture, device item stream-workspace, device item allocator-other, device item graph-exec." in lines
    )
    assert not [line for line in lines if "unknown" in line and line.startswith("|")]
    assert "- ci: true -> false" in lines
    assert (
        lines[-1] == "**Steps**: 210 (204 captures, 4 warm-ups, 2 provisions) -> 208 (204 captures, 4 warm-ups, "
        "0 provisions)"
    )


def test_markdown_says_when_the_threshold_is_crossed(cli, plans):
    code, out, err = cli("diff", "plans/fa3.json", "plans/fa3-eagle.json", "-f", "markdown", "--fail-above", "5")
    assert code == 1 and err.count("\n") == 1
    assert out.splitlines()[2] == (
        "**Over the limit**: predicted total (pools + hoisted; no device total in either plan) grew "
        "258.0 MiB -> 1,520.0 MiB "
        "(+1,262.0 MiB, +489.1%), above --fail-above 5%"
    )


def test_the_markdown_escapes_table_cells(cli, plans):
    from capture_plan.planner.report.compare import Figure, PlanDiff
    from capture_plan.planner.report.compare_text import render_markdown

    d = PlanDiff(
        old_name="a|b",
        new_name="c",
        figures=[Figure(label="pool x|y", old=1, new=2, unit="bytes")],
        inputs=[],
        decisions=[],
        steps=[],
        step_lines=[],
    )
    assert "| **pool x\\|y** | 1 B | 2 B | **+1 B, +100.0%** |" in render_markdown(d).splitlines()


@pytest.mark.parametrize(
    "other,needle",
    [
        ("plans/traces/fa3-ci.json", "plans/traces/fa3-ci.json: this is a trace file, not a plan"),
        ("v2.json", "v2.json: plan version 2 is newer than this capture-plan understands (1)"),
    ],
)
def test_non_plans_and_other_versions_are_one_line(cli, plans, tmp_path, other, needle):
    raw = json.loads((plans / "fa3.json").read_text())
    (tmp_path / "v2.json").write_text(json.dumps({**raw, "version": 2}))
    for args in (("plans/fa3.json", other), (other, "plans/fa3.json")):
        code, out, err = cli("diff", *args)
        assert (code, out) == (1, "") and err.count("\n") == 1 and needle in err, err


def test_plans_of_different_versions_are_refused_by_the_library(built):
    import msgspec

    from capture_plan.planner.report.compare import compare
    from capture_plan.schemas.errors import InputError

    a = built(backend="fa3", max_bs=8)
    with pytest.raises(
        InputError,
        match=r"b.json: plans of different versions \(a.json: 1, b.json: 0\) cannot "
        r"be compared",
    ):
        compare(a, msgspec.structs.replace(a, version=0), "a.json", "b.json")


def test_the_figures_are_a_table_of_getters():
    # adding a figure is one row: (label, getter, unit); each getter reads a real plan
    from capture_plan.planner.report.compare import FIGURES
    from capture_plan.schemas.codec import decode_plan

    plan = decode_plan((PLANS / "fa3-ci-h200.json").read_bytes(), "fa3-ci-h200.json")
    assert len(FIGURES) >= 5 and len({label for label, _, _ in FIGURES}) == len(FIGURES), FIGURES
    assert {unit for _, _, unit in FIGURES} == {"bytes", "count", "device-bytes"}
    known = set()
    for label, get, unit in FIGURES:
        assert isinstance(label, str) and label and callable(get), label
        value = get(plan)
        numbers = list(value.values()) if isinstance(value, dict) else [value]
        # a device item may be unknown (None) on a calibrated plan: its peak without warm-up figures
        assert all(isinstance(v, int) and v >= 0 or (v is None and unit == "device-bytes") for v in numbers), (
            label,
            value,
        )
        if value is not None:
            known.add(unit)
    assert known == {"bytes", "count", "device-bytes"}


def test_a_reorder_and_sizes_that_read_the_same(cli, tmp_path):
    for name, sizes in (("a", "[1, 2, 4]"), ("b", "[1, 3, 4]")):
        (tmp_path / f"{name}.toml").write_text(f'[[phases]]\nname = "decode"\nkind = "decode"\nsizes = {sizes}\n')
        assert cli("build", "-b", "fa3", "--spec", f"{name}.toml", "-o", f"{name}.json")[0] == 0
    assert cli("build", "-b", "fa3", "--spec", "a.toml", "-s", "order=smallest-first", "-o", "asc.json")[0] == 0
    out = cli("diff", "a.json", "b.json")[1].splitlines()
    assert "  sizes decode: 3 sizes 1..4 -> 3 sizes 1..4 (+[3] -[2])" in out
    out = cli("diff", "a.json", "asc.json")[1].splitlines()
    assert out[-2:] == [
        "steps: 4 (3 captures, 1 warm-up, 0 provisions) in both, not the same (--steps shows how)",
        "capture order changed in decode",
    ]
    assert "  pins: none -> -s order=smallest-first" in out


def test_a_calibrated_plan_diffs_its_measured_device_items_against_unknown(cli, plans):
    # the plan without a calibration: its measured device items are unknown, never 0
    code, out, _ = cli("diff", "plans/fa3-ci-h200.json", "plans/fa3-ci.json")
    assert code == 0
    assert "  device item stream-workspace: 32.0 MiB -> unknown" in out.splitlines()
    assert any(
        line.startswith("  device item graph-exec: ") and line.endswith(" -> unknown") for line in out.splitlines()
    )
    assert "  device item pool:" not in out  # the same simulated pool: no change to show


def test_diff_shows_predictions_strategies_and_steps(cli):
    assert cli("build", "-b", "fa3")[0] == 0
    assert cli("build", "-b", "fa3", "-s", "order=smallest-first", "-o", "plans/asc.json")[0] == 0
    code, out, _ = cli("diff", "plans/fa3.json", "plans/asc.json", "--steps")
    assert code == 0
    folded = "total (pools + hoisted) = pools at peak = pool shared = phase adds decode = device item pool"
    assert f"  {folded}: 258.0 MiB -> " in out
    assert "[decode] optimizer: order=largest-first" in out
    assert "+capture decode 1 shared view" in out and "-capture decode 1 shared view" in out
    code, _, _ = cli("diff", "plans/fa3.json", "plans/asc.json", "--exit-code")
    assert code == 1
    code, out, _ = cli("diff", "plans/fa3.json", "plans/fa3.json", "--exit-code")
    assert code == 0 and "no differences" in out


_PRESET_SPEC = (
    '[model]\npreset = "llama-3-8b"\n{extra}[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 2, 4, 8, 16]\n'
)


def _spec_plans(cli, tmp_path, **extras: str) -> None:
    for name, extra in extras.items():
        (tmp_path / f"{name}.toml").write_text(_PRESET_SPEC.format(extra=extra))
        assert cli("build", "-b", "fa3", "--spec", f"{name}.toml", "-o", f"{name}.json")[0] == 0


def test_a_model_change_with_an_equal_prediction_is_named_with_its_values(cli, tmp_path):
    """Issue 29: `layers` 32 -> 40 read "prediction unchanged" and two spec digests."""
    _spec_plans(cli, tmp_path, a="", b="layers = 40\n")
    code, out, err = cli("diff", "a.json", "b.json")
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        "a.json -> b.json",
        "predicted: unchanged (total 24.0 MiB)",
        "inputs:",
        "  command: planner build --backend fa3 --spec a.toml -o a.json -> planner build --backend fa3 --spec b.toml "
        "-o b.json",
        "  spec: a.toml (219115a530f7) -> b.toml (8766f06c29c0)",
        "  model layers: 32 (preset llama-3-8b) -> 40 (spec)",
    ]
    md = cli("diff", "a.json", "b.json", "-f", "markdown")[1].splitlines()
    assert md[-1] == "- model layers: 32 (preset llama-3-8b) -> 40 (spec)"
    assert "The prediction is unchanged." in md
    assert not [line for line in md if line.startswith("| **")]  # nothing predicted moved


def test_one_change_is_one_bold_row(cli, tmp_path):
    """Issue 29: one +300 MiB change filled five bold rows (total, peak, pool, phase, device
    pool: one number) and seven `unknown | unknown` rows."""
    _spec_plans(cli, tmp_path, a="", c="vocab = 512000\n")
    lines = cli("diff", "a.json", "c.json", "-f", "markdown")[1].splitlines()
    assert [line for line in lines if line.startswith("| **")] == [
        "| **total (pools + hoisted) = pools at peak = pool shared = phase adds decode = largest graph alone = "
        "device item pool** | 24.0 MiB | 52.0 MiB | **+28.0 MiB, +116.7%** |",
        "| **engines' loop baseline** | 24.0 MiB | 68.0 MiB | **+44.0 MiB, +183.3%** |",
    ]
    assert "- model vocab: 128256 (preset llama-3-8b) -> 512000 (spec)" in lines
    text = cli("diff", "a.json", "c.json")[1].splitlines()
    assert text[2:4] == [
        "  total (pools + hoisted) = pools at peak = pool shared = phase adds decode = largest graph alone = "
        "device item pool: 24.0 MiB -> 52.0 MiB (+28.0 MiB, +116.7%)",
        "  engines' loop baseline: 24.0 MiB -> 68.0 MiB (+44.0 MiB, +183.3%)",
    ]


def test_a_plan_without_a_model_record_is_one_row(cli, tmp_path):
    """A plan before revision 4 records no dimensions nor rules: one "not recorded" row each, not one per name."""
    from capture_plan.planner.report.compare import input_changes
    from capture_plan.schemas.codec import decode_plan

    _spec_plans(cli, tmp_path, a="")
    new = decode_plan((tmp_path / "a.json").read_bytes(), "a.json")
    old = msgspec.structs.replace(new, inputs=msgspec.structs.replace(new.inputs, model=msgspec.UNSET), revision=2)
    rows = [(c.label, c.old, c.new) for c in input_changes(old, new)]
    assert rows == [
        (
            "model dimensions",
            "not recorded",
            "name llama-3-8b, layers 32 (preset llama-3-8b), hidden 4096 (preset llama-3-8b), heads 32 (preset "
            "llama-3-8b), kv_heads 8 (preset llama-3-8b), head_dim 128 (preset llama-3-8b), intermediate 14336 "
            "(preset llama-3-8b), vocab 128256 (preset llama-3-8b), dtype_bytes 2 (preset llama-3-8b), "
            "logits_dtype_bytes 4 (preset llama-3-8b)",
        ),
        ("plan revision", "2", "4"),
    ]
    old = msgspec.structs.replace(old, inputs=msgspec.structs.replace(old.inputs, rules=msgspec.UNSET))
    assert ("rules applied", "not recorded") == next(
        (c.label, c.old) for c in input_changes(old, new) if c.label.startswith("rule")
    )


# -- issue 40, item 10: what a reviewer types -----------------------------------------------------


def _sh(command: str, cwd, stdin: bytes | None = None):
    import os
    import subprocess
    import sys

    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(["bash", "-c", command], cwd=cwd, input=stdin, capture_output=True, env=env)


def test_diff_reads_a_pipe_and_standard_input_as_a_plan(tmp_path):
    """Was `/dev/fd/63: is a FIFO (named pipe), not a plan file` for `planner diff <(git show
    HEAD:plans/x.json) plans/x.json`."""
    root = Path(__file__).resolve().parents[1]
    done = _sh("planner diff <(cat plans/fa3.json) plans/fa3-ci.json", root)
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().startswith("/dev/fd/") and b"-> plans/fa3-ci.json" in done.stdout
    piped = _sh("planner diff - plans/fa3-ci.json --exit-code", root, (root / "plans/fa3-ci.json").read_bytes())
    assert piped.returncode == 0 and b"no differences" in piped.stdout, piped.stderr
    both = _sh("planner diff - -", root, b"")
    assert both.returncode == 1 and b"both plans are standard input" in both.stderr and b"; fix: " in both.stderr


def test_a_named_fifo_nobody_writes_is_one_line_not_a_hang(cli, tmp_path):
    import os

    os.mkfifo(tmp_path / "f")
    plan = str(Path(__file__).resolve().parents[1] / "plans/fa3.json")
    one_line_error(cli("diff", "f", plan), "f: plan file is empty")
    one_line_error(cli("show", "f"), "is a FIFO (named pipe), not a plan file")  # only diff reads pipes


def test_an_output_to_dev_null_says_dry_run(cli):
    """Was `/dev/null: cannot write: is a character device; fix: name a plan file with -o, not a folder`."""
    one_line_error(
        cli("build", "-b", "fa3", "-o", "/dev/null"),
        "/dev/null: cannot write: is a character device",
        "fix: to build without writing a plan, pass --dry-run instead of -o",
    )
    assert cli("build", "-b", "fa3", "--dry-run")[0] == 0


def test_a_mistyped_command_or_spec_key_gets_did_you_mean(cli, tmp_path):
    code, out, err = cli("biuld")
    assert code == 2 and "No such command 'biuld'. Did you mean 'build'?" in err, err
    code, out, err = cli("zzzz")
    assert code == 2 and "No such command 'zzzz'." in err and "Did you mean" not in err
    cases = {
        '[model]\npreset = "llama-3-8b"\nlayer = 8\n' + SPEC: "$.model: Object contains unknown field `layer` "
        "(did you mean `layers`?); fix: rename the key to `layers`, or ",
        SPEC.replace("sizes", "size"): "$.phases[0]: Object contains unknown field `size` (did you mean `sizes`?)",
        'nmae = "x"\n' + SPEC: "s.toml: $: Object contains unknown field `nmae` (did you mean `name`?)",
        SPEC + "zzzzzz = 1\n": "Object contains unknown field `zzzzzz`; fix: see `planner schema spec`",
    }
    for spec, says in cases.items():
        (tmp_path / "s.toml").write_text(spec)
        one_line_error(cli("build", "-b", "fa3", "--spec", "s.toml", "--dry-run"), says)
