"""CLI transcripts: exit code, stdout and stderr of every command and error path."""

from __future__ import annotations

import json
import os

import pytest


def test_build_writes_the_default_plan_and_prints_a_summary(cli, tmp_path):
    code, out, err = cli("build", "--backend", "fa3", "--ci")
    assert code == 0, err
    assert out.startswith("plans/fa3-ci.json: 36 captures in 1 phase(s)")
    assert "predicted pool" in out and "decode: order=largest-first outputs=view" in out
    plan = json.loads((tmp_path / "plans/fa3-ci.json").read_text())
    assert plan["command"] == ["planner", "build", "--backend", "fa3", "--ci"]
    assert [f for f in os.listdir(tmp_path / "plans") if f.startswith(".")] == []  # no temp file left


def test_build_names_and_dry_run(cli, tmp_path):
    assert cli("build", "-b", "fa3", "--speculative", "eagle", "--ci", "--max-bs", "4")[0] == 0
    assert (tmp_path / "plans/fa3-eagle-ci.json").exists()  # --max-bs is no part of the name
    code, out, _ = cli("build", "-b", "torch", "--dry-run")
    assert code == 0 and "(dry run, not written)" in out
    assert not (tmp_path / "plans/torch.json").exists()
    assert cli("build", "-b", "torch", "-o", "out/x.json")[0] == 0
    # relative to the plan's folder
    assert json.loads((tmp_path / "out/x.json").read_text())["command"][-2:] == ["-o", "x.json"]


def test_check_reports_drift_with_file_and_fix(cli, tmp_path):
    assert cli("build", "-b", "fa3")[0] == 0
    code, out, _ = cli("build", "-b", "fa3", "--check")
    assert (code, out.strip()) == (0, "plans/fa3.json: up to date")
    path = tmp_path / "plans/fa3.json"
    path.write_text(path.read_text().replace('"largest-first"', '"smallest-first"', 1))
    code, out, err = cli("build", "-b", "fa3", "--check")
    assert code == 1 and out == ""
    assert err.strip() == (
        "planner: error: plans/fa3.json: plan is stale: its digest does not match its content "
        "(edited by hand or corrupted); fix: run `planner build --backend fa3`"
    )
    code, _, err = cli("check", "plans")
    assert code == 1 and "plans/fa3.json: plan is stale" in err and "planner build --backend fa3" in err
    assert "planner check --fix" in err
    code, out, _ = cli("check", "--fix", "plans")
    assert (code, out.strip()) == (0, "plans/fa3.json: rebuilt (planner build --backend fa3)")
    assert cli("check")[0] == 0
    path.unlink()
    code, _, err = cli("build", "-b", "fa3", "--check")
    assert code == 1 and "plans/fa3.json: plan is missing" in err


def test_check_all_plans_uses_each_recorded_command(cli, tmp_path):
    for args in (("-b", "fa3", "--ci"), ("-b", "triton"), ("-b", "torch", "-s", "outputs=keep")):
        assert cli("build", *args)[0] == 0
    code, out, err = cli("check")
    assert code == 0, err
    assert out.splitlines() == [
        "plans/fa3-ci.json: up to date",
        "plans/torch.json: up to date",
        "plans/triton.json: up to date",
    ]


@pytest.mark.parametrize(
    "content,message",
    [
        ("[[phases]\nname=1", "spec.toml: malformed TOML: "),
        ("", "spec.toml: file is empty"),
        (
            '[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 2]\nsize = 3\n',
            "spec.toml: $.phases[0]: Object contains unknown field `size`",
        ),
        (
            '[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, "2"]\n',
            "spec.toml: $.phases[0].sizes[1]: Expected `int`, got `str`",
        ),
        (
            '[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 2, 0]\n',
            "spec.toml: $.phases[0].sizes[2]: Expected `int` >= 1",
        ),
        (
            '[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [8, 4, 8]\n',
            "spec.toml: $.phases[0].sizes[2]: duplicate capture size 8 (also $.phases[0].sizes[0]); fix: list each "
            "size once",
        ),
        (
            '[[phases]]\nname = "decode"\nkind = "decode"\nsizes = []\n',
            "spec.toml: $.phases[0].sizes: Expected `array` of length >= 1",
        ),
        (
            '[[phases]]\nname = "decode"\nkind = "prefill"\nsizes = [1]\n',
            "spec.toml: $.phases[0].kind: unknown phase kind 'prefill'; fix: use one of decode, draft_decode, "
            "draft_extend, full, piecewise, target_verify",
        ),
    ],
)
def test_bad_spec_gets_one_located_line_and_writes_nothing(cli, tmp_path, content, message):
    (tmp_path / "spec.toml").write_text(content)
    code, out, err = cli("build", "-b", "fa3", "--spec", "spec.toml")
    assert code == 1 and out == ""
    assert err.startswith("planner: error: " + message), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "plans").exists()


def test_json_spec_errors_are_located_too(cli, tmp_path):
    (tmp_path / "s.json").write_text('{"phases": [{"name": "decode", "kind": "decode", "sizes": [1, -2]}]}')
    code, _, err = cli("build", "-b", "fa3", "--spec", "s.json")
    assert code == 1 and "s.json: $.phases[0].sizes[1]: Expected `int` >= 1" in err
    (tmp_path / "t.json").write_text('{"phases": [')
    code, _, err = cli("build", "-b", "fa3", "--spec", "t.json")
    assert code == 1 and "t.json: malformed JSON" in err


def test_unknown_backend_unreadable_spec_and_unwritable_output(cli, tmp_path):
    code, _, err = cli("build", "-b", "xformers")
    assert code == 1 and "--backend: unknown backend 'xformers'; fix: use one of fa3, flashinfer, torch, triton" in err
    code, _, err = cli("build", "-b", "fa3", "--spec", "missing.toml")
    assert code == 1 and "missing.toml: cannot read spec: No such file or directory" in err
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o500)
    try:
        code, _, err = cli("build", "-b", "fa3", "-o", "ro/plan.json")
        if os.geteuid() != 0:  # root can write anywhere
            assert code == 1 and "ro/plan.json: cannot write: Permission denied" in err
            assert os.listdir(tmp_path / "ro") == []
    finally:
        (tmp_path / "ro").chmod(0o700)
    (tmp_path / "file").write_text("x")
    code, _, err = cli("build", "-b", "fa3", "-o", "file/plan.json")
    assert code == 1 and "file/plan.json: cannot write" in err


def _no_such_option(err: str, name: str) -> bool:
    # click words it "No such option: --x" (8.2) or "No such option '--x'" (8.3): both name it
    return "No such option" in err and name in err


def test_usage_errors_are_the_frameworks_exit_2(cli):
    code, _, err = cli("build")
    assert code == 2 and "Missing option '--backend'" in err and "Try 'planner build -" in err
    code, _, err = cli("build", "-b", "fa3", "--frobnicate")
    assert code == 2 and _no_such_option(err, "--frobnicate")
    code, _, err = cli("biuld")
    assert code == 2 and "No such command 'biuld'" in err and "planner planner" not in err
    code, _, err = cli("build", "-b", "fa3", "--tp", "x")
    assert code == 2 and "Invalid value for '--tp'" in err
    code, _, err = cli("show")
    assert code == 2 and "Missing argument 'plan'." in err  # the name, not the usage line's {plan}


def test_bare_planner_help_version_and_debug(cli):
    code, out, err = cli()
    assert code == 2 and "Usage: planner" in out + err and "Commands" in out + err
    assert len((out + err).splitlines()) > 5  # the help as the framework lays it out, not squashed
    for flag in ("-h", "--help"):
        code, out, _ = cli(flag)
        assert code == 0 and out.startswith("Usage: planner")
    code, out, _ = cli("--version")
    from capture_plan import executor, planner, schemas

    assert code == 0 and out == f"planner (capture-plan) {schemas.__version__}\n"
    assert planner.__version__ == executor.__version__ == schemas.__version__
    from importlib.metadata import version

    assert version("capture-plan") == schemas.__version__  # pyproject reads the same attribute
    # --debug belongs to `planner`, before the command; after it, it is unknown (no argv scanning)
    code, _, err = cli("build", "-b", "nope", "--debug")
    assert code == 2 and _no_such_option(err, "--debug")
    code, _, err = cli("build", "-b", "nope")
    assert code == 1 and err.count("\n") == 1
    from capture_plan.schemas.errors import InputError

    with pytest.raises(InputError):  # --debug: the traceback of any error
        cli("--debug", "build", "-b", "nope")


def test_help_lists_arguments_and_shell_completion_offers_commands_backends_and_pins(cli, monkeypatch):
    code, out, _ = cli("show", "-h")
    assert code == 0 and out.startswith("Usage: planner show [OPTIONS] {plan}")
    assert "Arguments:\n  plan <path>  Plan file.  [required]" in out
    code, out, _ = cli("build", "-h")
    assert code == 0 and "Attention backend: fa3, flashinfer, torch, triton" in " ".join(out.split())
    monkeypatch.setenv("_PLANNER_COMPLETE", "bash_complete")
    for words, cword, expected in (
        ("planner build --backend f", "3", ["plain,fa3", "plain,flashinfer"]),
        ("planner sh", "1", ["plain,show"]),
        ("planner build -s ord", "3", ["plain,order=largest-first", "plain,order=smallest-first"]),
        ("planner build -s decode.outputs=", "3", ["plain,decode.outputs=keep", "plain,decode.outputs=view"]),
        ("planner build --speculative ''", "3", ["plain,eagle"]),
        ("planner build --preset v", "3", ["plain,vllm"]),
        ("planner build --allocator e", "3", ["plain,expandable"]),
    ):
        monkeypatch.setenv("COMP_WORDS", words)
        monkeypatch.setenv("COMP_CWORD", cword)
        code, out, _ = cli()
        assert (code, out.split()) == (0, expected)


def test_conflicting_rules_exit_1_naming_them(cli, tmp_path):
    (tmp_path / "s.toml").write_text("""[[phases]]
name = "decode"
kind = "decode"
sizes = [1, 2]
[[rules]]
id = "a"
why = "a"
require = [{ order = "largest-first" }]
[[rules]]
id = "b"
why = "b"
require = [{ order = "smallest-first" }]
""")
    code, _, err = cli("build", "-b", "fa3", "--spec", "s.toml")
    assert code == 1 and "rules in conflict: a, b" in err


def test_strategy_pin_breaking_a_rule(cli):
    code, _, err = cli("build", "-b", "triton", "-s", "warmup=once-per-phase")
    assert code == 1 and "breaks rule warmup-per-shape for phase 'decode'" in err


def test_strategy_pin_no_strategy_has_names_the_options(cli, tmp_path):
    """One phase shares its pool with nothing: pool=own is no option. The
    error says so (it used to blame unnamed rules)."""
    code, _, err = cli("build", "-b", "fa3", "--max-bs", "16", "-s", "decode.pool=own", "-o", str(tmp_path / "p.json"))
    assert code == 1 and err.count("\n") == 1
    assert "phase 'decode' has no strategy with pool=own (its options: pool: shared)" in err
    assert not (tmp_path / "p.json").exists()


def test_show_explain_graph_simulate_schema(cli, tmp_path, built):
    from capture_plan.planner import plan_bytes

    plan = "plans/fa3-eagle-ci.json"  # the bytes `planner build -b fa3 --ci --speculative eagle --max-bs 16` writes
    (tmp_path / "plans").mkdir()
    # --max-bs 16: the full preset's gate and hoisting with a quarter of its captures (shared with test_build)
    (tmp_path / plan).write_bytes(plan_bytes(built(backend="fa3", ci=True, speculative="eagle", max_bs=16)))
    code, out, _ = cli("show", plan)
    assert code == 0 and "provision  target_verify  16" in out
    code, out, _ = cli("explain", plan)
    assert code == 0 and "[target_verify] fa3-ci-varlen-gate: workspace=hoisted" in out
    assert "- provision/target_verify/16 -> capture/target_verify/16: fa3-ci-varlen-gate" in out
    code, out, _ = cli("graph", plan, "--format", "mermaid")
    assert code == 0 and out.startswith("flowchart LR") and "-->|fa3-ci-varlen-gate|" in out
    code, out, _ = cli("graph", plan)
    assert code == 0 and out.startswith('digraph "fa3-eagle-ci"')
    code, _, err = cli("graph", plan, "--format", "svg")
    assert code == 1 and "--format: unknown format 'svg'" in err
    code, out, _ = cli("simulate", plan, "--plot", "t.png")
    assert code == 0 and "peak reserved" in out and (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    code, out, _ = cli("schema")
    schemas = json.loads(out)
    assert set(schemas) == {"spec", "plan", "trace", "report", "backends", "phase-kinds"}
    from capture_plan.planner.schema import SCHEMAS

    assert set(schemas) == set(SCHEMAS)
    help_text = " ".join(cli("schema", "-h")[1].split())
    assert all(f"{name}," in help_text or f"{name} or all" in help_text for name in SCHEMAS)  # help names each
    code, out, _ = cli("schema", "backends")
    backend = json.loads(out)["$defs"]["Backend"]
    assert code == 0 and backend["additionalProperties"] is False and "attention_temp_factor" in backend["properties"]
    code, out, _ = cli("schema", "spec")
    assert code == 0 and "Spec" in json.loads(out)["$defs"]
    code, _, err = cli("schema", "nope")
    assert code == 1 and "unknown schema 'nope'" in err


def test_diff_shows_predictions_strategies_and_steps(cli):
    assert cli("build", "-b", "fa3")[0] == 0
    assert cli("build", "-b", "fa3", "-s", "order=smallest-first", "-o", "plans/asc.json")[0] == 0
    code, out, _ = cli("diff", "plans/fa3.json", "plans/asc.json", "--steps")
    assert code == 0
    assert "  pool shared: 258.0 MiB -> " in out and "[decode] optimizer: order=largest-first" in out
    assert "+capture decode 1 shared view" in out and "-capture decode 1 shared view" in out
    code, _, _ = cli("diff", "plans/fa3.json", "plans/asc.json", "--exit-code")
    assert code == 1
    code, out, _ = cli("diff", "plans/fa3.json", "plans/fa3.json", "--exit-code")
    assert code == 0 and "no differences" in out


def test_plan_files_that_are_corrupt_truncated_tampered_or_newer(cli, tmp_path):
    assert cli("build", "-b", "fa3")[0] == 0
    path = tmp_path / "plans/fa3.json"
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    code, _, err = cli("show", "plans/fa3.json")
    assert code == 1 and "plans/fa3.json: not valid JSON (truncated or corrupted?)" in err
    path.write_text(text.replace('"bs": 256', '"bs": 255', 1))
    code, _, err = cli("show", "plans/fa3.json")
    assert code == 1 and "plans/fa3.json: $.digest: digest mismatch" in err
    path.write_text(text.replace('"version": 1', '"version": 9', 1))
    code, _, err = cli("show", "plans/fa3.json")
    assert code == 1 and "plan version 9 is newer than this capture-plan understands (1)" in err
    code, _, err = cli("show", "plans/none.json")
    assert code == 1 and "plans/none.json: cannot read plan" in err


def test_report_side_by_side(cli, tmp_path):
    import msgspec

    from capture_plan.schemas.report import CaptureReport, StepMeasurement

    rep = CaptureReport(
        plan="fa3",
        plan_digest="sha256:x",
        device="NVIDIA H200 sm90",
        torch="2.11",
        backend_module="fa3",
        pool_bytes=260 * 2**20,
        predicted_pool_bytes=258 * 2**20,
        capture_seconds=1.0,
        steps=[
            StepMeasurement(
                step=1, id="capture/decode/256", reserved=252 * 2**20, predicted_reserved=252 * 2**20, seconds=0.05
            )
        ],
    )
    (tmp_path / "r.json").write_bytes(msgspec.json.encode(rep))
    code, out, _ = cli("report", "r.json")
    assert code == 0 and "capture/decode/256" in out and "pool: predicted 258.0 MiB, measured 260.0 MiB (+0.8%)" in out
    assert cli("build", "-b", "fa3")[0] == 0
    code, out, err = cli("report", "r.json", "--plan", "plans/fa3.json")  # captured from another plan
    assert (
        code == 1
        and out == ""
        and err.startswith(
            "planner: error: r.json: $.plan_digest: report was captured "
            "from plan 'fa3' (sha256:x), not from plans/fa3.json"
        )
    )


def test_internal_errors_exit_3_and_debug_shows_the_traceback(cli, monkeypatch):
    import capture_plan.planner.build as build

    def boom(opts):
        raise KeyError("oops")

    monkeypatch.setattr(build, "build_plan", boom)
    code, _, err = cli("build", "-b", "fa3")
    assert code == 3 and err.startswith("planner: internal error: KeyError: 'oops' (rerun as `planner --debug")
    with pytest.raises(KeyError):
        cli("--debug", "build", "-b", "fa3")


def test_the_console_script_runs(tmp_path):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "capture_plan.planner", "build", "-b", "fa3", "--dry-run"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and "dry run" in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "capture_plan.planner", "show", "nope.json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and r.stderr.count("\n") == 1


@pytest.mark.parametrize(
    "trace,message",
    [
        ('{"captures": [', "t.json: not valid JSON (truncated or corrupted?)"),
        (
            '{"captures": [{"phase": "decode", "bs": 1, "events": [["alloc", 0, -5, "temp"]]}]}',
            "t.json: $.captures[0].events[0][2]: Expected `int` >= 0",
        ),
        (
            '{"captures": [{"phase": "verify", "bs": 1, "events": []}]}',
            "t.json: $.captures[0].phase: unknown phase 'verify'",
        ),
        (
            '{"captures": [{"phase": "decode", "bs": 1, "events": []}]}',
            "t.json: phase 'decode': planned sizes [2] lie outside the recorded sizes 1..1",
        ),
        ('{"version": 7, "captures": []}', "t.json: trace version 7 is newer than this capture-plan understands (1)"),
    ],
)
def test_bad_traces_are_refused_with_one_line(cli, tmp_path, trace, message):
    (tmp_path / "s.toml").write_text('[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 2]\n')
    (tmp_path / "t.json").write_text(trace)
    code, out, err = cli("build", "-b", "fa3", "--spec", "s.toml", "--trace", "t.json")
    assert code == 1 and out == "" and err.startswith("planner: error: " + message), err
    assert not (tmp_path / "plans").exists()
