"""``planner build``: the plan it writes and names, pins, what-if builds, budget errors,
and what a build refuses to write over.

The budget error names the real cheapest rule-abiding schedule, per phase
(issue 19: with a pin it named "the cheapest schedule the rules allow" at
5,232 MiB, one phase's alternative priced with the other phases still pinned,
when the rule-abiding plan was 1,412 MiB)."""

from __future__ import annotations

import json
import os

import pytest

from cli_inputs import LLAMA, SPEC, one_line_error


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


@pytest.mark.parametrize(
    "pins", [("order=smallest-first", "order=largest-first"), ("decode.outputs=keep", "decode.outputs=view")]
)
def test_an_axis_pinned_twice_is_refused(cli, tmp_path, pins):
    # before: the last pin won, but the plan records its pins sorted, so the
    # plan just written was stale for `planner check` (its command rebuilt the other pin)
    args = [a for p in pins for a in ("-s", p)]
    one_line_error(cli("build", "-b", "fa3", *args, "-o", "x.json"), "is pinned twice", "fix: pin")
    assert not (tmp_path / "x.json").exists()


def test_repeated_and_phase_overriding_pins_still_build_and_check(cli, tmp_path):
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


@pytest.mark.parametrize(
    "budget,pins,needle",
    [
        (0.5, (), "is below the floor"),
        (60, ("-s", "order=smallest-first", "-s", "outputs=keep"), "exceeds budget_mib 60"),
    ],
)
def test_budget_errors_point_at_the_spec_from_the_cwd(cli, tmp_path, budget, pins, needle):
    # before: "../b.toml: $.budget_mib" (the path relative to plans/, where the plan records it)
    (tmp_path / "b.toml").write_text(f"budget_mib = {budget}\n" + SPEC.replace("[1, 2]", "[1, 2, 4, 8, 16, 32, 64]"))
    err = one_line_error(cli("build", "-b", "fa3", "--spec", "b.toml", *pins), needle)
    assert err.startswith("planner: error: b.toml: $.budget_mib: "), err
    assert not (tmp_path / "plans").exists()


@pytest.mark.parametrize("what", ["trace", "model config"])
def test_force_never_writes_over_the_trace_or_config_a_spec_names(cli, tmp_path, what):
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


def test_pins_in_any_order_give_the_same_bytes_and_check_clean(cli, tmp_path):
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


def test_build_check_of_another_command_is_not_called_stale(cli, tmp_path):
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
def test_build_check_of_a_file_that_is_no_plan_is_not_called_stale(cli, tmp_path, content):
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


def test_spec_plans_are_the_same_from_any_directory_and_through_links(cli, tmp_path, monkeypatch):
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs/my.toml").write_text(SPEC)
    assert cli("build", "-b", "fa3", "--spec", "specs/my.toml")[0] == 0
    first = (tmp_path / "plans/fa3-my.json").read_bytes()
    raw = json.loads(first)
    assert raw["command"] == ["planner", "build", "--backend", "fa3", "--spec", "../specs/my.toml"]
    assert raw["inputs"]["spec"] == "../specs/my.toml"
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    assert cli("build", "-b", "fa3", "--spec", "../specs/my.toml", "-o", "../plans/fa3-my.json")[0] == 0
    assert (tmp_path / "plans/fa3-my.json").read_bytes() == first
    assert cli("check", "../plans")[0] == 0
    monkeypatch.chdir(tmp_path)
    os.symlink("specs", tmp_path / "alias")
    assert cli("build", "-b", "fa3", "--spec", "alias/my.toml", "-o", "plans/fa3-alias.json")[0] == 0
    assert json.loads((tmp_path / "plans/fa3-alias.json").read_text())["inputs"]["spec"] == "../alias/my.toml"
    assert cli("check")[0] == 0


def test_what_if_builds_need_force(cli, tmp_path):
    assert cli("build", "-b", "fa3", "--ci")[0] == 0
    path = tmp_path / "plans/fa3-ci.json"
    good = path.read_bytes()
    for extra in (("--tp", "2"), ("-s", "outputs=keep"), ("--allocator", "expandable")):
        one_line_error(
            cli("build", "-b", "fa3", "--ci", *extra),
            "plans/fa3-ci.json: holds a plan built by `planner build --backend fa3 --ci`",
            "--force",
        )
        assert path.read_bytes() == good
    assert cli("build", "-b", "fa3", "--ci")[0] == 0  # a rebuild of the same command is fine
    assert cli("build", "-b", "fa3", "--ci", "--tp", "2", "--force")[0] == 0
    assert json.loads(path.read_text())["inputs"]["tp"] == 2
    (tmp_path / "notes.json").write_text("my notes")
    one_line_error(cli("build", "-b", "fa3", "-o", "notes.json"), "notes.json: exists and is not a plan")
    assert (tmp_path / "notes.json").read_text() == "my notes"


def test_the_plan_a_what_if_build_would_replace_is_named_by_a_command_that_pastes(cli, tmp_path):
    """The refusal quotes the recorded command as a shell would need it: a device name
    with spaces printed bare could not be pasted (the review's finding)."""
    assert cli("build", "-b", "fa3", "--ci", "--device", "NVIDIA H100 80GB HBM3")[0] == 0
    one_line_error(
        cli("build", "-b", "fa3", "--ci"),
        "holds a plan built by `planner build --backend fa3 --ci --device 'NVIDIA H100 80GB HBM3'`",
        "--force",
    )


def test_output_equal_to_the_spec_is_refused(cli, tmp_path):
    (tmp_path / "s.json").write_text(json.dumps({"phases": [{"name": "decode", "kind": "decode", "sizes": [1]}]}))
    before = (tmp_path / "s.json").read_bytes()
    one_line_error(cli("build", "-b", "fa3", "--spec", "s.json", "-o", "s.json", "--force"), "the output is the spec")
    one_line_error(
        cli("build", "-b", "fa3", "--spec", "s.json", "-o", "./sub/../s.json", "--force"), "the output is the spec"
    )
    assert (tmp_path / "s.json").read_bytes() == before


@pytest.mark.parametrize("max_bs", ["0", "65537", "10000000", "1000000000"])
def test_max_bs_is_bounded(cli, max_bs):
    one_line_error(cli("build", "-b", "fa3", "--max-bs", max_bs), "--max-bs: must be 1..65536")


def test_max_bs_at_the_limit_with_every_phase_is_refused_by_the_size_limits(cli):
    one_line_error(
        cli("build", "-b", "fa3", "--speculative", "eagle", "--max-bs", "65536"),
        "embedded default spec (--max-bs 65536): $.phases[0].sizes",
        "over the limit",
    )


def test_empty_option_values_are_refused(cli):
    one_line_error(cli("build", "-b", "fa3", "--allocator", ""), "--allocator: unknown allocator mode ''")
    for out in ("", "."):
        one_line_error(cli("build", "-b", "fa3", "-o", out, "--dry-run"), "-o: ", "names no file")
    one_line_error(cli("build", "-b", "fa3", "-o", "/", "--dry-run"), "-o: ", "names a folder, not a file")


def _spec(cli, tmp_path, budget: int) -> None:
    out = cli("spec", "show", "--speculative", "eagle", "--max-bs", "16")[1]
    (tmp_path / "e.toml").write_text(out.replace("library_mib = 0\n", f"library_mib = 0\nbudget_mib = {budget}\n"))


def test_with_a_pin_the_budget_error_names_the_unpinned_plan_per_phase(cli, tmp_path, built):
    from capture_plan.schemas.units import mib

    free = built(backend="fa3", ci=True, speculative="eagle", max_bs=16)
    free_total = free.predicted.pool_bytes + free.predicted.hoisted_bytes
    _spec(cli, tmp_path, -(-free_total // 2**20) + 1)  # the unpinned plan fits, by under 2 MiB
    code, out, err = cli(
        "build", "-b", "fa3", "--ci", "--spec", "e.toml", "-s", "target_verify.order=smallest-first", "-o", "x.json"
    )
    assert (code, out) == (1, "") and err.count("\n") == 1
    named = "; ".join(f"{ph.name}: {ph.strategy.label()}" for ph in free.phases)
    assert (
        f"the cheapest schedule the rules allow, without the --strategy pins, takes {mib(free_total)} "
        f"(within the budget): {named}; fix: drop the --strategy pins, or raise budget_mib to at least " in err
    )
    assert err.startswith("planner: error: e.toml: $.budget_mib: predicted ")
    # the budget it names takes the pinned build (issue 40, item 6)
    import re

    _spec(cli, tmp_path, int(re.search(r"at least (\d+)", err).group(1)))
    pinned = ("-s", "target_verify.order=smallest-first", "-o", "x.json")
    assert cli("build", "-b", "fa3", "--ci", "--spec", "e.toml", *pinned)[0] == 0
    # and that schedule does build within the budget
    assert cli("build", "-b", "fa3", "--ci", "--spec", "e.toml", "-o", "y.json")[0] == 0


def test_without_pins_the_plan_itself_is_named(cli, tmp_path, built):
    free = built(backend="fa3", ci=True, speculative="eagle", max_bs=16)
    _spec(cli, tmp_path, free.predicted.largest_graph_bytes // 2**20 + 1)
    code, _, err = cli("build", "-b", "fa3", "--ci", "--spec", "e.toml", "-o", "x.json")
    named = "; ".join(f"{ph.name}: {ph.strategy.label()}" for ph in free.phases)
    assert code == 1 and err.endswith(
        f"; no schedule the rules allow is cheaper than this one: {named}; fix: raise budget_mib to at least "
        f"{-(-(free.predicted.pool_bytes + free.predicted.hoisted_bytes) // 2**20)}, or capture fewer sizes\n"
    ), err


@pytest.mark.parametrize("speculative", [(), ("--speculative", "eagle", "--max-bs", "64")])
@pytest.mark.parametrize("budget", [100, 252])
def test_the_budget_a_budget_error_names_then_builds(cli, tmp_path, speculative, budget):
    """Issue 40, item 6: `budget_mib = 100` said `raise budget_mib to at least 288` (the largest
    graph alone), and 288 then failed (`predicted 294.0 MiB exceeds budget_mib 288`): the fix
    names the cheapest schedule's own total, which then builds."""
    import re

    code, spec, err = cli("spec", "show", *speculative)
    assert code == 0, err
    (tmp_path / "b.toml").write_text(spec.replace("library_mib = 0\n", f"library_mib = 0\nbudget_mib = {budget}\n"))
    build = ("build", "-b", "fa3", "--spec", "b.toml", "--dry-run")
    err = one_line_error(cli(*build), "fix: raise budget_mib to at least")
    fits = int(re.search(r"raise budget_mib to at least (\d+)", err).group(1))
    (tmp_path / "b.toml").write_text(spec.replace("library_mib = 0\n", f"library_mib = 0\nbudget_mib = {fits}\n"))
    code, out, err = cli("build", "-b", "fa3", "--spec", "b.toml", "--dry-run")
    assert code == 0, err
