"""``planner check`` (and ``--fix``): stale plans, recorded builds, links, folders with
other files, any working directory.

``planner check`` says, per stale plan on its own line, which recorded
input or rule changed, how far the prediction moved, and the command that
fixes it (issue 19). Before: "plan is stale: it differs" and five stale plans
as one line of about 1,100 characters."""

from __future__ import annotations

import json

import pytest

from capture_plan.schemas.codec import canonical_bytes
from cli_inputs import one_line_error, reseal

SPEC = (
    '[model]\npreset = "llama-3-8b"\nvocab = 128256\n'
    '[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 2, 4, 8, 16, 32, 64]\n'
)


def _build(cli, tmp_path, name: str, spec: str = SPEC) -> None:
    (tmp_path / f"{name}.toml").write_text(spec)
    code, _, err = cli("build", "-b", "fa3", "--spec", f"{name}.toml", "-o", f"plans/{name}.json")
    assert code == 0, err


def test_a_spec_edit_names_the_spec_and_the_mib_it_moved(cli, tmp_path):
    _build(cli, tmp_path, "mine")
    (tmp_path / "mine.toml").write_text(SPEC.replace("128256", "152064"))
    expected = (
        "planner: error: plans/mine.json: plan is stale: changed: spec: ../mine.toml (3ba190e6c6e8 -> "
        "73ba45d3e0d5), model vocab: 128256 (spec) -> 152064 (spec); predicted total 58.0 MiB -> 64.0 MiB "
        "(+6.0 MiB, +10.3%); fix: run "
        "`planner build --backend fa3 --spec mine.toml -o plans/mine.json`\n"
    )
    assert cli("build", "-b", "fa3", "--spec", "mine.toml", "-o", "plans/mine.json", "--check") == (1, "", expected)
    assert cli("check") == (1, "", expected.replace("`\n", "`, or `planner check --fix`\n"))


def test_a_model_change_that_leaves_the_prediction_equal_is_named(cli, tmp_path):
    """Issue 29: `layers` 32 -> 40 read "spec: ... (hash -> hash); prediction unchanged"."""
    _build(cli, tmp_path, "mine")
    (tmp_path / "mine.toml").write_text(SPEC.replace("vocab = 128256", "vocab = 128256\nlayers = 40"))
    code, out, err = cli("check")
    assert (code, out) == (1, "")
    assert err == (
        "planner: error: plans/mine.json: plan is stale: changed: spec: ../mine.toml (3ba190e6c6e8 -> "
        "b241d6412c21), model layers: 32 (preset llama-3-8b) -> 40 (spec); prediction unchanged; fix: run "
        "`planner build --backend fa3 --spec mine.toml -o plans/mine.json`, or `planner check --fix`\n"
    )


def test_every_changed_input_is_named_not_the_first_three(cli, tmp_path):
    _build(cli, tmp_path, "mine")
    edited = SPEC.replace("vocab = 128256", "vocab = 32000\nlayers = 40\nhidden = 2048\nheads = 16\nkv_heads = 4")
    (tmp_path / "mine.toml").write_text(edited.replace("64]", "64, 128]"))
    err = cli("check")[2]
    for named in [
        "model hidden: 4096 (preset llama-3-8b) -> 2048 (spec)",
        "model heads: 32 (preset llama-3-8b) -> 16 (spec)",
        "model kv_heads: 8 (preset llama-3-8b) -> 4 (spec)",
        "model layers: 32 (preset llama-3-8b) -> 40 (spec)",
        "model vocab: 128256 (spec) -> 32000 (spec)",
        "sizes decode: 7 sizes 1..64 -> 8 sizes 1..128 (+[128])",
    ]:
        assert f" {named}," in err or f" {named};" in err, (named, err)
    assert "more input" not in err and err.count("\n") == 1


def test_each_stale_plan_is_one_line_and_fresh_ones_are_listed(cli, tmp_path):
    for name in ("a", "b", "c"):
        _build(cli, tmp_path, name)
    for name in ("a", "c"):
        (tmp_path / f"{name}.toml").write_text(SPEC.replace("64]", "64, 128]"))
    code, out, err = cli("check", "plans")
    assert (code, out) == (1, "plans/b.json: up to date\n")
    lines = err.splitlines()
    assert len(lines) == 3 and lines[-1].startswith("planner: error: 2 of 3 plan(s) stale; fix: ")
    for name, line in zip("ac", lines):
        assert line.startswith(f"planner: error: plans/{name}.json: plan is stale: changed: spec: ../{name}.toml (")
        assert ", sizes decode: 7 sizes 1..64 -> 8 sizes 1..128 (+[128]); " in line
        assert line.endswith(
            f"; predicted total 58.0 MiB -> 124.0 MiB (+66.0 MiB, +113.8%); fix: run "
            f"`planner build --backend fa3 --spec {name}.toml -o plans/{name}.json`"
        )


def test_a_rule_change_is_named(cli, tmp_path, data_file):
    assert cli("build", "-b", "fa3")[0] == 0
    data_file("rules.toml", b'\n[[rules]]\nid = "team-note"\nwhy = "a note"\nprefer = { order = "largest-first" }\n')
    code, out, err = cli("check")
    assert (code, out) == (1, "")
    first = err.splitlines()[0]
    assert first.startswith("planner: error: plans/fa3.json: plan is stale: changed: rules: 31f9c0f044bd -> ")
    # which rule, and what it says
    assert first.endswith(
        ", rule team-note: (none) -> always; prefer order=largest-first; prediction unchanged; fix: run "
        "`planner build --backend fa3`, or `planner check --fix`"
    )


def test_an_edited_rule_is_named_with_what_it_said_and_says(cli, tmp_path, data_file, monkeypatch):
    from capture_plan.planner.inputs import resources

    assert cli("build", "-b", "fa3", "--ci", "-o", "plans/e.json")[0] == 0
    real = resources.data_bytes
    gate = b'require = [{ order = "smallest-first" }, { workspace = "hoisted" }]'
    assert gate in real("rules.toml")
    # the FA3 gate loses its second way out (data_file's teardown restores the shipped files)
    monkeypatch.setattr(
        resources,
        "data_bytes",
        lambda n: real(n).replace(gate, b'require = [{ order = "smallest-first" }]') if n == "rules.toml" else real(n),
    )
    for cached in (resources.data, resources.rules_digest, resources.builtin_rules, resources.baseline):
        cached.cache_clear()
    err = cli("check")[2]
    assert (
        "rule fa3-ci-varlen-gate: when backend=fa3 multi_token=true ci=true; require order=smallest-first or "
        "workspace=hoisted -> when backend=fa3 multi_token=true ci=true; require order=smallest-first" in err
    ), err


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
def test_a_newer_revision_plan_is_neither_called_stale_nor_downgraded(cli, tmp_path, args):
    # before: `check` called it stale, and `check --fix` or a rebuild by the same
    # command rewrote it as this (older) planner's revision, dropping what it added
    assert cli("build", "-b", "fa3")[0] == 0
    newer = _newer_revision(tmp_path / "plans/fa3.json")
    assert cli("show", "plans/fa3.json")[0] == 0  # readers still accept it
    one_line_error(
        cli(*args), "plans/fa3.json: $.revision: plan revision", "newer capture-plan", "fix: upgrade capture-plan"
    )
    assert (tmp_path / "plans/fa3.json").read_bytes() == newer


def test_force_replaces_a_newer_revision_plan(cli, tmp_path):
    assert cli("build", "-b", "fa3")[0] == 0
    _newer_revision(tmp_path / "plans/fa3.json")
    assert cli("build", "-b", "fa3", "--force")[0] == 0
    assert cli("check", "plans")[0] == 0


def test_a_symlink_beside_its_plan_is_not_stale_and_fix_never_clobbers_the_target(cli, tmp_path):
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


def test_each_plan_is_checked_once(cli, tmp_path):
    assert cli("build", "-b", "fa3")[0] == 0
    code, out, _ = cli("check", "plans", "plans/fa3.json", "./plans/fa3.json")
    assert code == 0 and out == "plans/fa3.json: up to date\n", out


@pytest.mark.parametrize(
    "name,content,needle",
    [
        ("other.json", '{"a": 1}', "other.json: not a plan file: a plan has `command` and `steps`"),
        ("t.json", None, "t.json: this is a trace file, not a plan"),
    ],
)
def test_non_plan_json_in_a_checked_folder_is_skipped_and_refused_when_named(cli, tmp_path, name, content, needle):
    # issue 49, item 8: `planner check .` failed on a config.json beside the plans (a folder is
    # checked for plan files, not every JSON in it); named as a file, it is still refused.
    # before that: {"a": 1} gave "$.version: missing or non-integer `version`" (it has no command)
    from pathlib import Path

    assert cli("build", "-b", "fa3")[0] == 0
    path = tmp_path / "plans" / name
    if content is None:
        path.write_bytes((Path(__file__).parents[1] / "plans/traces/fa3-ci.json").read_bytes())
    else:
        path.write_text(content)
    code, out, err = cli("check", "plans")
    assert code == 0, err
    assert out == f"plans/{name}: skipped, not a plan file\nplans/fa3.json: up to date\n"
    one_line_error(cli("check", f"plans/{name}"), needle, "fix: pass a plan file")
    one_line_error(cli("show", f"plans/{name}"), needle, "fix: pass a plan file")
    assert cli("check", "--require-exact", "plans")[0] == 0  # reads the same plan files


def test_a_folder_of_no_plans_and_a_broken_plan_are_still_errors(cli, tmp_path):
    (tmp_path / "plans").mkdir()
    (tmp_path / "plans/config.json").write_text('{"model_type": "llama"}')
    one_line_error(cli("check", "plans"), "no plan files found (1 other JSON file(s) skipped)")
    assert cli("build", "-b", "fa3")[0] == 0
    # a plan cut short is not JSON: reported, never skipped as "not a plan"
    (tmp_path / "plans/cut.json").write_bytes((tmp_path / "plans/fa3.json").read_bytes()[:100])
    one_line_error(cli("check", "plans"), "plans/cut.json: not valid JSON", "fix: rebuild the plan")


@pytest.mark.parametrize(
    "build, where",
    [
        ({}, "$.inputs.build"),  # no backend
        ({"backend": "fa3", "max_bs": "x"}, "$.inputs.build.max_bs"),
        ({"backend": 3}, "$.inputs.build.backend"),
        ({"backend": "fa3", "tp": [2, 4]}, "$.inputs.build.tp"),
        # decodes, but says another build than the plan's command: refused before any rebuild
        ({"backend": "nope"}, "plans/fa3-eagle.json: $.command: `command` is `planner build --backend fa3"),
    ],
)
def test_check_locates_a_broken_recorded_build_after_the_digest(cli, tmp_path, plan_raw, build, where):
    path = tmp_path / "plans/fa3-eagle.json"
    raw = {**plan_raw, "inputs": {**plan_raw["inputs"], "build": build}}
    path.write_bytes(reseal(raw))  # sealed: passes the digest
    one_line_error(cli("check", "plans"), where)
    path.write_bytes(canonical_bytes(raw))  # unsealed: stale, and --fix cannot use its record either
    one_line_error(cli("check", "--fix", "plans"), "plans/fa3-eagle.json")


def test_a_consistent_record_the_rebuild_refuses_is_located_at_the_record(cli, tmp_path, plan_raw):
    # every field that names the backend says "nope": the plan decodes, the rebuild refuses it
    raw = json.loads(json.dumps(plan_raw))
    raw["inputs"]["build"]["backend"] = raw["inputs"]["backend"] = raw["requires"]["backend"] = "nope"
    raw["command"][3] = "nope"
    (tmp_path / "plans/fa3-eagle.json").write_bytes(reseal(raw))
    one_line_error(cli("check", "plans"), "plans/fa3-eagle.json: $.inputs.build (--backend): unknown backend 'nope'")


def test_a_plan_without_a_build_record_is_stale_and_names_its_command(cli, tmp_path, plan_raw):
    # a revision-1 plan recorded its build only as command text: rebuilt once, by hand, then clean
    path = tmp_path / "plans/fa3-eagle.json"
    raw = {**plan_raw, "revision": 1, "inputs": {k: v for k, v in plan_raw["inputs"].items() if k != "build"}}
    path.write_bytes(reseal(raw))
    for args in (("check", "plans"), ("check", "--fix", "plans")):
        one_line_error(
            cli(*args),
            "records its build only as text",
            "planner build --backend fa3 --speculative eagle --max-bs 4 --force`",
        )
    assert "check --fix`" not in cli("check", "plans")[2]  # --fix cannot rebuild it: not offered


def test_a_hand_edited_plan_is_stale_and_fix_rebuilds_it(cli, tmp_path, plan_raw):
    path = tmp_path / "plans/fa3-eagle.json"
    good = path.read_bytes()
    path.write_text(path.read_text().replace('"largest-first"', '"smallest-first"'))
    one_line_error(cli("check"), "digest does not match", "planner build --backend fa3 --speculative eagle")
    assert cli("check", "--fix")[0] == 0 and path.read_bytes() == good


def test_a_hand_edited_copy_under_another_name_is_not_up_to_date(cli, tmp_path):
    assert cli("build", "-b", "fa3", "--ci")[0] == 0
    src = tmp_path / "plans/fa3-ci.json"
    (tmp_path / "plans/zz-copy.json").write_bytes(src.read_bytes())  # an exact copy: wrong name
    one_line_error(cli("check", "plans"), "plans/zz-copy.json: plan is stale")
    (tmp_path / "plans/zz-copy.json").write_text(src.read_text().replace('"view"', '"keep"'))  # hand-edited
    one_line_error(cli("check", "plans"), "plans/zz-copy.json")
    code, out, _ = cli("check", "--fix", "plans")
    assert code == 0 and "plans/zz-copy.json: rebuilt (planner build --backend fa3 --ci -o plans/zz-copy.json)" in out
    fixed = json.loads((tmp_path / "plans/zz-copy.json").read_text())
    assert fixed["name"] == "zz-copy" and fixed["command"][-2:] == ["-o", "zz-copy.json"]
    assert cli("check", "plans")[0] == 0


def test_check_and_fix_from_another_directory(cli, tmp_path, monkeypatch):
    assert cli("build", "-b", "fa3", "--ci")[0] == 0
    good = (tmp_path / "plans/fa3-ci.json").read_bytes()
    (tmp_path / "tests").mkdir()
    monkeypatch.chdir(tmp_path / "tests")
    code, out, err = cli("check", "../plans/fa3-ci.json")
    assert (code, out.strip()) == (0, "../plans/fa3-ci.json: up to date"), err
    assert cli("check", "--fix", "../plans")[0] == 0
    assert (tmp_path / "plans/fa3-ci.json").read_bytes() == good
    monkeypatch.chdir(tmp_path)
    assert cli("check")[0] == 0


def _sizes_plan_without_its_traffic(cli, tmp_path) -> None:
    """plans/ with two plans and a sizes plan whose traffic file is then deleted."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data/t.csv").write_text("size,count\n1,50\n3,20\n9,5\n")
    for args in (("--ci",), ("--ci", "--sizes", "auto", "--traffic", "data/t.csv"), ()):
        code, _, err = cli("build", "-b", "fa3", *args)
        assert code == 0, err
    (tmp_path / "data/t.csv").unlink()


def test_a_plan_whose_traffic_is_gone_is_one_line_and_the_others_are_still_listed(cli, tmp_path):
    """Issue 40, item 5: check stopped at the sizes plan without listing the others (docs/ci.md
    says up-to-date plans are still listed), and its fix named a build that was then refused
    (`pass --force`): it replaces the sizes plan with a plan of another command."""
    _sizes_plan_without_its_traffic(cli, tmp_path)
    code, out, err = cli("check")
    assert code == 1
    assert out == "plans/fa3-ci.json: up to date\nplans/fa3.json: up to date\n"
    one_line_error(
        (code, out, err),
        "plans/fa3-sizes-t-ci.json: $.inputs.build (data/t.csv): cannot read traffic",
        "or capture the spec's sizes: `planner build --backend fa3 --ci -o plans/fa3-sizes-t-ci.json --force`",
    )
    assert "planner check --fix" not in err  # it cannot rebuild this one either
    fix = err.rsplit("`", 2)[1].split()
    assert cli(*fix[1:])[0] == 0  # the fix works: then every plan checks
    assert cli("check")[0] == 0


def test_a_plan_that_cannot_be_rebuilt_beside_a_stale_one_gets_its_own_line(cli, tmp_path):
    _sizes_plan_without_its_traffic(cli, tmp_path)
    _build(cli, tmp_path, "mine")
    (tmp_path / "mine.toml").write_text(SPEC.replace("128256", "152064"))
    code, out, err = cli("check")
    assert code == 1 and "plans/fa3-ci.json: up to date" in out
    lines = err.splitlines()
    assert len(lines) == 3 and all(line.startswith("planner: error: ") for line in lines), err
    assert "plans/fa3-sizes-t-ci.json: $.inputs.build" in lines[1] and "mine.json: plan is stale" in lines[0]
    assert lines[2].startswith(
        "planner: error: 1 of 4 plan(s) stale, 1 of 4 plan(s) cannot be rebuilt from what they record; fix: "
    )
