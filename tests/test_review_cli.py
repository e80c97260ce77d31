"""Findings of the fresh-eyes robustness review of the planner as a CI tool.

Each test failed before the fix it names: bad input gives one located line and
exit 1, nothing is lost, and a plan checks clean right after it is built.
"""

from __future__ import annotations

import json

import pytest

SPEC = '[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 2]\n'


def one_line_error(result, *needles: str) -> str:
    code, out, err = result
    assert code == 1, (code, out, err)
    assert err.startswith("planner: error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err
    return err


# R1. the same axis pinned twice ------------------------------------------------------------------


@pytest.mark.parametrize(
    "pins", [("order=smallest-first", "order=largest-first"), ("decode.outputs=keep", "decode.outputs=view")]
)
def test_r1_an_axis_pinned_twice_is_refused(cli, tmp_path, pins):
    # before: the last pin won, but the plan records its pins sorted, so the
    # plan just written was stale for `planner check` (its command rebuilt the other pin)
    args = [a for p in pins for a in ("-s", p)]
    one_line_error(cli("build", "-b", "fa3", *args, "-o", "x.json"), "is pinned twice", "fix: pin")
    assert not (tmp_path / "x.json").exists()


def test_r1_repeated_and_phase_overriding_pins_still_build_and_check(cli, tmp_path):
    assert (
        cli(
            "build",
            "-b",
            "fa3",
            "-s",
            "order=largest-first",
            "-s",
            "order=largest-first",
            "-s",
            "decode.outputs=keep",
            "-s",
            "outputs=view",
            "-o",
            "x.json",
        )[0]
        == 0
    )
    assert cli("check", "x.json")[0] == 0


# R2. budget errors name the spec as given, not as the plan records it ----------------------------


@pytest.mark.parametrize(
    "budget,pins,needle",
    [
        (0.5, (), "is below the floor"),
        (60, ("-s", "order=smallest-first", "-s", "outputs=keep"), "exceeds budget_mib 60"),
    ],
)
def test_r2_budget_errors_point_at_the_spec_from_the_cwd(cli, tmp_path, budget, pins, needle):
    # before: "../b.toml: $.budget_mib" (the path relative to plans/, where the plan records it)
    (tmp_path / "b.toml").write_text(f"budget_mib = {budget}\n" + SPEC.replace("[1, 2]", "[1, 2, 4, 8, 16, 32, 64]"))
    err = one_line_error(cli("build", "-b", "fa3", "--spec", "b.toml", *pins), needle)
    assert err.startswith("planner: error: b.toml: $.budget_mib: "), err
    assert not (tmp_path / "plans").exists()


# R3. a newer planner's plan is not downgraded ----------------------------------------------------


def _newer_revision(path) -> bytes:
    from capture_plan.schemas.codec import canonical_bytes, plan_digest
    from capture_plan.schemas.plan import PLAN_REVISION

    raw = json.loads(path.read_bytes())
    raw.update(revision=PLAN_REVISION + 1, added_later={"x": 1}, digest="")
    raw["digest"] = plan_digest(raw)
    path.write_bytes(canonical_bytes(raw))
    return path.read_bytes()


@pytest.mark.parametrize(
    "args", [("check", "plans"), ("check", "--fix", "plans"), ("build", "-b", "fa3"), ("build", "-b", "fa3", "--check")]
)
def test_r3_a_newer_revision_plan_is_neither_called_stale_nor_downgraded(cli, tmp_path, args):
    # before: `check` called it stale, and `check --fix` or a rebuild by the same
    # command rewrote it as this (older) planner's revision, dropping what it added
    assert cli("build", "-b", "fa3")[0] == 0
    newer = _newer_revision(tmp_path / "plans/fa3.json")
    assert cli("show", "plans/fa3.json")[0] == 0  # readers still accept it
    one_line_error(
        cli(*args), "plans/fa3.json: $.revision: plan revision", "newer capture-plan", "fix: upgrade capture-plan"
    )
    assert (tmp_path / "plans/fa3.json").read_bytes() == newer


def test_r3_force_replaces_a_newer_revision_plan(cli, tmp_path):
    assert cli("build", "-b", "fa3")[0] == 0
    _newer_revision(tmp_path / "plans/fa3.json")
    assert cli("build", "-b", "fa3", "--force")[0] == 0
    assert cli("check", "plans")[0] == 0


# R4. a link to a plan is checked as the plan it points to -----------------------------------------


def test_r4_a_symlink_beside_its_plan_is_not_stale_and_fix_never_clobbers_the_target(cli, tmp_path):
    # before: `check plans` called plans/latest.json (-> fa3.json) stale, and
    # `check --fix` wrote a plan named "latest" (-o latest.json) over plans/fa3.json,
    # which was then stale itself: every --fix flipped the checked-in plan
    assert cli("build", "-b", "fa3")[0] == 0
    plan = (tmp_path / "plans/fa3.json").read_bytes()
    (tmp_path / "plans/latest.json").symlink_to("fa3.json")
    code, out, err = cli("check", "plans")
    assert code == 0 and out == "plans/fa3.json: up to date\n", (out, err)
    assert cli("check", "--fix", "plans")[0] == 0
    assert (tmp_path / "plans/fa3.json").read_bytes() == plan
    (tmp_path / "elsewhere.json").symlink_to("plans/fa3.json")
    code, out, _ = cli("check", "elsewhere.json")
    assert code == 0 and out == "plans/fa3.json: up to date\n"


def test_r4_each_plan_is_checked_once(cli, tmp_path):
    assert cli("build", "-b", "fa3")[0] == 0
    code, out, _ = cli("check", "plans", "plans/fa3.json", "./plans/fa3.json")
    assert code == 0 and out == "plans/fa3.json: up to date\n", out


# R5. a folder checked with other JSON in it -------------------------------------------------------


@pytest.mark.parametrize(
    "name,content,needle",
    [
        ("other.json", '{"a": 1}', "other.json: not a plan file: a plan has `command` and `steps`"),
        ("t.json", None, "t.json: this is a trace file, not a plan"),
    ],
)
def test_r5_non_plan_json_in_a_checked_folder_says_what_it_is_and_how_to_fix(cli, tmp_path, name, content, needle):
    # before: {"a": 1} gave "$.version: missing or non-integer `version`; fix: rebuild the plan
    # with the `planner build` command it records" (it has no command), and a trace in the folder
    # said "pass a plan file" (the user passed a folder)
    from pathlib import Path

    assert cli("build", "-b", "fa3")[0] == 0
    path = tmp_path / "plans" / name
    if content is None:
        path.write_bytes((Path(__file__).parents[1] / "plans/traces/fa3-ci.json").read_bytes())
    else:
        path.write_text(content)
    one_line_error(cli("check", "plans"), needle, "fix: move it out of plans")
    one_line_error(cli("show", f"plans/{name}"), needle, "fix: pass a plan file")


# R6. --plot never replaces a plan (or any file that is not a PNG) ------------------------------------


@pytest.mark.parametrize("target", ["plans/fa3.json", "s.toml"])
def test_r6_plot_refuses_to_replace_a_file_that_is_not_a_png(cli, tmp_path, target):
    # before: `planner simulate plans/fa3.json --plot plans/fa3.json` replaced the plan with a PNG
    assert cli("build", "-b", "fa3")[0] == 0
    (tmp_path / "s.toml").write_text(SPEC)
    before = (tmp_path / target).read_bytes()
    code, out, err = cli("simulate", "plans/fa3.json", "--plot", target)
    one_line_error((code, out, err), f"--plot {target}: exists and is not a PNG image", "fix: plot to a new")
    assert out == "" and (tmp_path / target).read_bytes() == before


def test_r6_plot_replaces_its_own_png(cli, tmp_path):
    pytest.importorskip("matplotlib")
    assert cli("build", "-b", "fa3")[0] == 0
    (tmp_path / "empty.png").write_bytes(b"")
    for _ in range(2):
        for name in ("t.png", "empty.png"):
            code, out, _ = cli("simulate", "plans/fa3.json", "--plot", name)
            assert code == 0 and out.endswith(f"wrote {name}\n")
            assert (tmp_path / name).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


# R7. a spec rule cannot take a built-in rule's id -----------------------------------------------------


@pytest.mark.parametrize(
    "rule_id,needle",
    [
        ("output-lifetime", "is a built-in rule's"),
        ("default", "is a built-in rule's"),
        ("optimizer", "the planner's own decisions"),
        ("warmup", "the planner's own decisions"),
    ],
)
def test_r7_spec_rule_ids_are_not_the_builtin_ones(cli, tmp_path, rule_id, needle):
    # before: accepted; the plan's decisions then said "breaks output-lifetime" for the spec's
    # rule (order=smallest-first here), indistinguishable from the built-in rule of that id
    (tmp_path / "s.toml").write_text(
        SPEC + f'[[rules]]\nid = "{rule_id}"\nwhy = "mine"\nrequire = [{{ order = "smallest-first" }}]\n'
    )
    one_line_error(
        cli("build", "-b", "fa3", "--spec", "s.toml"),
        f"s.toml: $.rules[0].id: rule id '{rule_id}' ",
        needle,
        "fix: give the rule an id of its own",
    )
    assert not (tmp_path / "plans").exists()


# R8. `after` lists in a cycle are located in the spec -------------------------------------------------


def test_r8_after_cycles_are_located_at_an_after_entry(cli, tmp_path):
    # before: "planner: error: rules: rules in conflict: after:a, after:b ..." (where: "rules")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub/cyc.toml").write_text(
        "".join(
            f'[[phases]]\nname = "{n}"\nkind = "decode"\nsizes = [1]\nafter = ["{d}"]\n'
            for n, d in (("a", "c"), ("b", "a"), ("c", "b"))
        )
    )
    one_line_error(
        cli("build", "-b", "fa3", "--spec", "sub/cyc.toml"),
        "planner: error: sub/cyc.toml: $.phases[1].after[0]: rules in conflict: after:a, after:b, after:c",
        "a -> b -> c -> a",
    )
    assert not (tmp_path / "plans").exists()


# R9. the trace and model config a spec names are inputs too: never the output -----------------------

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


@pytest.mark.parametrize("what", ["trace", "model config"])
def test_r9_force_never_writes_over_the_trace_or_config_a_spec_names(cli, tmp_path, what):
    # before: README says a build never writes over its --trace, but the trace a spec names
    # (`trace = "t.json"`, a GPU recording) and its model config were replaced under --force
    from pathlib import Path

    if what == "trace":
        name, spec = "t.json", 'trace = "t.json"\n' + SPEC.replace("[1, 2]", "[1, 2, 4, 8]")
        (tmp_path / name).write_bytes((Path(__file__).parents[1] / "plans/traces/fa3-ci.json").read_bytes())
    else:
        name, spec = "config.json", '[model]\nconfig = "config.json"\n' + SPEC
        (tmp_path / name).write_text(json.dumps(LLAMA))
    (tmp_path / "s.toml").write_text(spec)
    before = (tmp_path / name).read_bytes()
    assert cli("build", "-b", "fa3", "--spec", "s.toml", "--dry-run")[0] == 0
    one_line_error(
        cli("build", "-b", "fa3", "--spec", "s.toml", "-o", name, "--force"),
        f"{name}: the output is the {what} file",
        "fix: name another output with -o",
    )
    assert (tmp_path / name).read_bytes() == before


# R10. the order of -s pins does not change the plan ---------------------------------------------------


def test_r10_pins_in_any_order_give_the_same_bytes_and_check_clean(cli, tmp_path):
    # before: alternatives' `violates` listed the pins in the order typed, while the plan's
    # command records them sorted: `-s outputs=keep -s order=largest-first` gave a plan
    # that `planner check` called stale right after the build
    (tmp_path / "s.toml").write_text(
        SPEC.replace("[1, 2]", "[1, 2, 4, 8]") + '[[phases]]\nname = "verify"\n'
        'kind = "target_verify"\nsizes = [1, 4]\ntokens_per_request = 4\n'
        'output_lifetime = "across-phases"\n'
    )
    pins = ["outputs=keep", "order=largest-first"]
    for name, order in (("a.json", pins), ("b.json", pins[::-1])):
        assert cli("build", "-b", "fa3", "--spec", "s.toml", *[a for p in order for a in ("-s", p)], "-o", name)[0] == 0
    a, b = (json.loads((tmp_path / n).read_bytes()) for n in ("a.json", "b.json"))
    for p in (a, b):  # the output name, which the command and the build record hold, differs
        p["inputs"]["build"].pop("output")
    assert {**a, "command": [], "name": "", "digest": ""} == {**b, "command": [], "name": "", "digest": ""}
    code, out, err = cli("check", "a.json", "b.json")
    assert code == 0, err


# R11. a report checked against a plan it was not captured from ----------------------------------------


def test_r11_report_against_another_plan_exits_1(cli, tmp_path):
    # before: exit 0 with a "warning:" line in the table on stdout, which CI never sees
    import msgspec

    from capture_plan.schemas.report import CaptureReport

    assert cli("build", "-b", "fa3")[0] == 0
    assert cli("build", "-b", "fa3", "--ci")[0] == 0
    plan = json.loads((tmp_path / "plans/fa3.json").read_bytes())
    rep = CaptureReport(
        plan="fa3",
        plan_digest=plan["digest"],
        device="d",
        torch="2.11",
        backend_module="fa3",
        pool_bytes=1,
        predicted_pool_bytes=1,
        capture_seconds=1.0,
    )
    (tmp_path / "r.json").write_bytes(msgspec.json.encode(rep))
    assert cli("report", "r.json", "--plan", "plans/fa3.json")[0] == 0
    code, out, err = cli("report", "r.json", "--plan", "plans/fa3-ci.json")
    one_line_error(
        (code, out, err),
        "r.json: $.plan_digest: report was captured from plan 'fa3'",
        "not from plans/fa3-ci.json ('fa3-ci', sha256:",
        "fix: pass the plan it was captured from",
    )
    assert out == ""


# R12. build --check of a what-if against the checked-in plan of the same name -------------------------


def test_r12_build_check_of_another_command_is_not_called_stale(cli, tmp_path):
    # before: "plans/fa3.json: plan is stale ...; fix: run `planner build --backend fa3 --tp 8`",
    # a fix that write_plan then refuses (or, with --force, that clobbers the checked-in plan)
    assert cli("build", "-b", "fa3")[0] == 0
    one_line_error(
        cli("build", "-b", "fa3", "--tp", "8", "--check"),
        "plans/fa3.json: holds the plan of `planner build --backend fa3`, not of this command",
        "fix: check it with `planner check plans/fa3.json`, or give this build its own file with -o",
    )
    assert cli("build", "-b", "fa3", "--check")[0] == 0
    assert cli("build", "-b", "fa3", "--tp", "8", "-o", "plans/tp8.json")[0] == 0
    assert cli("build", "-b", "fa3", "--tp", "8", "-o", "plans/tp8.json", "--check")[0] == 0


@pytest.mark.parametrize("content", ['{"a": 1}', "not json", ""])
def test_r12_build_check_of_a_file_that_is_no_plan_is_not_called_stale(cli, tmp_path, content):
    # before: "plan is stale ...; fix: run `planner build --backend fa3`", a build that
    # write_plan refuses ("exists and is not a plan"): the same dead end as above
    (tmp_path / "plans").mkdir()
    (tmp_path / "plans/fa3.json").write_text(content)
    one_line_error(
        cli("build", "-b", "fa3", "--check"),
        "plans/fa3.json: exists and is not a plan",
        "fix: check another file with -o, or replace it with `planner build --backend fa3 --force`",
    )
    assert (tmp_path / "plans/fa3.json").read_text() == content


# R13. a spec's model config is read like every other input ------------------------------------------


@pytest.mark.parametrize(
    "make,needle",
    [
        ("fifo", "config.json: is a FIFO (named pipe), not a config file"),
        ("list", "config.json: $.model_type: model_type must be a string, got ['llama']"),
        ("deep", "config.json: nested too deeply to read"),
    ],
)
def test_r13_odd_model_configs_are_one_line_not_a_hang_or_an_internal_error(cli, tmp_path, make, needle):
    # before: a FIFO hung the build (and /dev/zero read until memory ran out: not tested here,
    # a regression would not stop at the alarm below; read_input refuses both alike), and a
    # list model_type or deep nesting were internal errors (exit 3)
    import os

    cfg = tmp_path / "config.json"
    if make == "fifo":
        os.mkfifo(cfg)
    elif make == "list":
        cfg.write_text(json.dumps({**LLAMA, "model_type": ["llama"]}))
    else:
        cfg.write_text('{"a": ' + "[" * 100000 + "]" * 100000 + "}")
    (tmp_path / "s.toml").write_text('[model]\nconfig = "config.json"\n' + SPEC)
    import signal

    def hang(signum, frame):
        raise TimeoutError("the build hung on the model config")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(30)  # a regression hangs on the FIFO: fail, do not stall the suite
    try:
        one_line_error(cli("build", "-b", "fa3", "--spec", "s.toml", "--dry-run"), needle)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# R14. graph -f dot quotes the plan's name -------------------------------------------------------------


def test_r14_dot_output_escapes_quotes_in_the_plan_name(cli, tmp_path):
    # before: `-o 'we"ird.json'` gave `digraph "we"ird" {`, which Graphviz cannot read
    import re

    assert cli("build", "-b", "fa3", "--max-bs", "2", "-o", 'we"ird\\name.json')[0] == 0
    code, out, _ = cli("graph", 'we"ird\\name.json')
    assert code == 0 and out.splitlines()[0] == r'digraph "we\"ird\\name" {'
    for line in out.splitlines():  # every quoted string closes on its line
        assert len(re.findall(r'(?<!\\)(?:\\\\)*"', line)) % 2 == 0, line


# R15. a spec rule for a backend that does not exist ---------------------------------------------------


def test_r15_a_rule_for_an_unknown_backend_is_refused(cli, tmp_path):
    # before: `when = { backend = ["FA3"] }` never matched "fa3": a team gate that silently gated nothing
    (tmp_path / "s.toml").write_text(
        SPEC + '[[rules]]\nid = "team-gate"\nwhy = "x"\n'
        'when = { backend = ["fa3", "FA3"] }\nrequire = [{ order = "smallest-first" }]\n'
    )
    one_line_error(
        cli("build", "-b", "fa3", "--spec", "s.toml"),
        "s.toml: $.rules[0].when.backend[1]: unknown backend 'FA3': the rule would never apply",
        "fix: use one of fa3, flashinfer, torch, triton",
    )
    assert not (tmp_path / "plans").exists()


@pytest.mark.parametrize("field", ["backend", "phase_kind"])
def test_r15_a_rule_whose_when_lists_nothing_is_refused(cli, tmp_path, field):
    # before: `when = { backend = [] }` matched no backend (and `phase_kind = []` no phase):
    # the rule never applied, and the build chose largest-first against its require
    (tmp_path / "s.toml").write_text(
        SPEC + f'[[rules]]\nid = "team-gate"\nwhy = "x"\nwhen = {{ {field} = [] }}\n'
        'require = [{ order = "smallest-first" }]\n'
    )
    one_line_error(
        cli("build", "-b", "fa3", "--spec", "s.toml"),
        f"s.toml: $.rules[0].when.{field}: an empty list matches nothing: the rule would never apply",
        f"fix: list the {field.replace('_', ' ')}s it is for, or leave {field} out to match any",
    )
    assert not (tmp_path / "plans").exists()


def test_r15_a_rule_requiring_an_empty_choice_is_refused(cli, tmp_path):
    # before: `require = [{}]` was met by every strategy: a gate that required nothing
    (tmp_path / "s.toml").write_text(
        SPEC + '[[rules]]\nid = "team-gate"\nwhy = "x"\nrequire = [{ order = "smallest-first" }, {}]\n'
    )
    one_line_error(
        cli("build", "-b", "fa3", "--spec", "s.toml"),
        "s.toml: $.rules[0].require[1]: an empty choice is met by every strategy",
        "fix: name the axis",
    )
    assert not (tmp_path / "plans").exists()


# R16. a spec's own tp is located in the spec ---------------------------------------------------------


@pytest.mark.parametrize("tp,needle", [(3, "tp=3 does not divide heads=32"), (100000, "must be 1..")])
def test_r16_a_bad_tp_in_the_spec_points_at_the_spec_not_at_the_option(cli, tmp_path, tp, needle):
    # before: "planner: error: --tp: ..." though no --tp was given
    (tmp_path / "s.toml").write_text(f"tp = {tp}\n" + SPEC)
    err = one_line_error(cli("build", "-b", "fa3", "--spec", "s.toml"), needle)
    assert err.startswith("planner: error: s.toml: $.tp: "), err
    err = one_line_error(cli("build", "-b", "fa3", "--spec", "s.toml", "--tp", "5"), "tp=5 does not divide")
    assert err.startswith("planner: error: --tp: "), err


# R17. a plans folder that is a symlink ---------------------------------------------------------------


def test_r17_check_through_a_linked_plans_folder(cli, tmp_path, monkeypatch):
    # before: the plan records --spec ../specs/s.toml (lexically, relative to plans/), but check
    # opened plans/../specs/s.toml, which the OS resolves from the link's target: "cannot read spec"
    (tmp_path / "repo/specs").mkdir(parents=True)
    (tmp_path / "shared/plans").mkdir(parents=True)
    (tmp_path / "repo/plans").symlink_to("../shared/plans")
    (tmp_path / "repo/specs/s.toml").write_text(SPEC)
    monkeypatch.chdir(tmp_path / "repo")
    assert cli("build", "-b", "fa3", "--spec", "specs/s.toml")[0] == 0
    code, out, err = cli("check", "plans")
    assert code == 0 and out == "plans/fa3-s.json: up to date\n", err
    assert cli("check", "--fix", "plans")[0] == 0


# R18. file names that are not UTF-8 ------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--spec", "-o"])
def test_r18_a_non_utf8_file_name_is_a_located_error(cli, tmp_path, flag):
    # before: internal error (exit 3), UnicodeEncodeError writing the plan's JSON
    import os

    if os.uname().sysname == "Darwin":
        pytest.skip("macOS file systems refuse such names")
    name = os.fsdecode(b"s\xff.toml")
    (tmp_path / name).write_text(SPEC)
    args = ("--spec", name) if flag == "--spec" else ("-o", os.fsdecode(b"o\xff.json"))
    one_line_error(cli("build", "-b", "fa3", *args), f"{flag} ", "path is not valid UTF-8", "fix: rename the file")
    assert sorted(os.listdir(tmp_path)) == [name]


# R19. Ctrl-C is not "bad input or drift" --------------------------------------------------------------


def test_r19_ctrl_c_exits_130_and_leaves_the_plan_whole(cli, tmp_path, monkeypatch):
    # before: click's "Aborted!" and exit 1, the code for bad input or drift
    import os

    import capture_plan.schemas.files as files

    assert cli("build", "-b", "fa3")[0] == 0
    plan = (tmp_path / "plans/fa3.json").read_bytes()

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(files.os, "replace", interrupted)
    code, out, err = cli("build", "-b", "fa3", "-s", "order=smallest-first", "--force")
    assert code == 130 and err == "planner: interrupted\n" and out == "", (code, err)
    assert (tmp_path / "plans/fa3.json").read_bytes() == plan
    assert os.listdir(tmp_path / "plans") == ["fa3.json"]  # no temp file left


# R20. a TOML spec not named *.toml --------------------------------------------------------------------


def test_r20_a_toml_spec_without_the_toml_suffix_is_told_why(cli, tmp_path):
    # before: "spec.txt: malformed JSON: ... invalid character (byte 2)" and no fix
    (tmp_path / "spec.txt").write_text(SPEC)
    one_line_error(
        cli("build", "-b", "fa3", "--spec", "spec.txt"),
        "spec.txt: malformed JSON",
        "fix: a spec is read as TOML only when its name ends in .toml",
    )
    (tmp_path / "bad.json").write_text('{"phases": [')
    err = one_line_error(cli("build", "-b", "fa3", "--spec", "bad.json"), "bad.json: malformed JSON")
    assert "fix:" not in err


# R21. the reader of stdout goes away (`planner show P | head`) ----------------------------------------


def test_r21_a_closed_stdout_pipe_exits_141_quietly_not_1(tmp_path):
    # before: click's EPIPE handling, exit 1: the code for bad input or drift, so a CI script
    # with `set -o pipefail` told the user to rebuild plans
    import os
    import subprocess
    import sys
    from pathlib import Path

    plan = Path(__file__).resolve().parent.parent / "plans" / "fa3-ci.json"
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line is written
    try:
        r = subprocess.run(
            [sys.executable, "-m", "capture_plan.planner", "show", str(plan)],
            stdout=write,
            stderr=subprocess.PIPE,
            cwd=tmp_path,
            timeout=60,
        )
    finally:
        os.close(write)
    assert r.returncode == 141, (r.returncode, r.stderr)
    assert r.stderr == b"", r.stderr


@pytest.mark.parametrize("args", [("--help",), ("-h",), ("--version",), ("build", "--help")])
def test_r21_help_and_version_into_a_closed_pipe_exit_141_too(tmp_path, args):
    # before: the top-level --help and --version print while click parses the group's
    # options, before the command runs, so click's EPIPE handling gave exit 1 there
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)
    try:
        r = subprocess.run(
            [sys.executable, "-m", "capture_plan.planner", *args],
            stdout=write,
            stderr=subprocess.PIPE,
            cwd=tmp_path,
            timeout=60,
        )
    finally:
        os.close(write)
    assert (r.returncode, r.stderr) == (141, b"")


# R22. -o naming a folder -----------------------------------------------------------------------------


@pytest.mark.parametrize("args", [("build", "-b", "fa3", "-o", "out/"), ("simulate", "P", "--plot", "out/")])
def test_r22_an_output_path_ending_in_a_slash_is_refused_not_written_as_a_file(cli, tmp_path, args):
    # before: click turned "out/" into Path("out"): build wrote a plan file named `out`
    if args[0] == "simulate":
        assert cli("build", "-b", "fa3", "-o", "p.json")[0] == 0
        args = tuple("p.json" if a == "P" else a for a in args)
    one_line_error(cli(*args), "'out/' names a folder, not a file", "fix: give a file name, e.g. out/what-if.json")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args,example",
    [
        (("build", "-b", "fa3", "-o", "out/."), "out/what-if.json"),
        (("build", "-b", "fa3", "-o", "out/.."), "./what-if.json"),
        (("simulate", "P", "--plot", "out/."), "out/what-if.json"),
    ],
)
def test_r22_an_output_path_ending_in_dot_names_a_folder_too(cli, tmp_path, args, example):
    # before: click's Path made "out/." Path("out"): build wrote a plan file named `out`, and
    # `--plot out/.` a PNG named `out`; "out/.." created the folder `out`, then failed
    if args[0] == "simulate":
        assert cli("build", "-b", "fa3", "-o", "p.json")[0] == 0
        args = tuple("p.json" if a == "P" else a for a in args)
    (tmp_path / "keep").mkdir()  # something in the folder: a stray write would show
    before = sorted(p.name for p in tmp_path.iterdir())
    one_line_error(cli(*args), f"{args[-1]!r} names a folder, not a file", f"fix: give a file name, e.g. {example}")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("make", ["dir", "fifo"])
def test_r6_plot_to_a_folder_or_fifo_is_refused_before_the_timeline_is_printed(cli, tmp_path, make):
    # before: the timeline went to stdout, then write_atomic refused the path (exit 1 after
    # output: a refused --plot is meant to be one line on stderr and nothing on stdout)
    import os

    assert cli("build", "-b", "fa3", "-o", "p.json")[0] == 0
    os.mkdir(tmp_path / "t.png") if make == "dir" else os.mkfifo(tmp_path / "t.png")
    code, out, err = cli("simulate", "p.json", "--plot", "t.png")
    one_line_error((code, out, err), "--plot t.png: cannot write: is a ", "fix: plot to a new .png path")
    assert out == ""
