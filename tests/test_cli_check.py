"""``planner check`` says, per stale plan on its own line, which recorded
input or rule changed, how far the prediction moved, and the command that
fixes it (issue 19). Before: "plan is stale: it differs" and five stale plans
as one line of about 1,100 characters."""

from __future__ import annotations

SPEC = '[model]\nvocab = 128256\n[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 2, 4, 8, 16, 32, 64]\n'


def _build(cli, tmp_path, name: str, spec: str = SPEC) -> None:
    (tmp_path / f"{name}.toml").write_text(spec)
    code, _, err = cli("build", "-b", "fa3", "--spec", f"{name}.toml", "-o", f"plans/{name}.json")
    assert code == 0, err


def test_a_spec_edit_names_the_spec_and_the_mib_it_moved(cli, tmp_path):
    _build(cli, tmp_path, "mine")
    (tmp_path / "mine.toml").write_text(SPEC.replace("128256", "152064"))
    expected = (
        "planner: error: plans/mine.json: plan is stale: changed: spec: ../mine.toml (d488039a491f -> "
        "4ef05cf04192); predicted total 58.0 MiB -> 64.0 MiB (+6.0 MiB, +10.3%); fix: run "
        "`planner build --backend fa3 --spec mine.toml -o plans/mine.json`\n"
    )
    assert cli("build", "-b", "fa3", "--spec", "mine.toml", "-o", "plans/mine.json", "--check") == (1, "", expected)
    assert cli("check") == (1, "", expected.replace("`\n", "`, or `planner check --fix`\n"))


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
    assert first.endswith("; prediction unchanged; fix: run `planner build --backend fa3`, or `planner check --fix`")
