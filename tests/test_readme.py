"""The README's quickstart stays true: two commands, the second is what CI runs."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quickstart_is_two_commands_and_ci_runs_the_test_command_verbatim():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Quickstart", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    commands = [line for line in block.splitlines() if line.strip()]
    assert len(commands) == 2
    assert commands[0].endswith("planner build --backend fa3 --ci")
    assert "pytest" in commands[1]
    assert commands[1] in (ROOT / ".ci/run").read_text().splitlines()


def test_the_spec_example_builds(tmp_path):
    from capture_plan.planner import BuildOptions, build_plan

    readme = (ROOT / "README.md").read_text()
    example = readme.split("**Spec** (TOML or JSON", 1)[1].split("```toml\n", 1)[1].split("```", 1)[0]
    spec = tmp_path / "example.toml"
    spec.write_text(example)
    plan = build_plan(BuildOptions(backend="fa3", ci=True, spec=spec))
    (phase,) = plan.phases
    assert phase.strategy.workspace == "hoisted" or phase.strategy.order == "smallest-first"
    assert any(d.rule == "team-gate" for d in plan.decisions)


def test_the_quickstart_build_rewrites_the_checked_in_plan_it_names(tmp_path):
    """`planner build --backend fa3 --ci` in a clone replaces plans/fa3-ci.json: the
    checked-in file must be the plan of exactly that command (a calibrated one under
    that name made the quickstart refuse to replace it, exit 1)."""
    import json
    import os
    import shutil

    from capture_plan.planner.cli import main

    root = Path(__file__).resolve().parent.parent
    shutil.copytree(root / "plans", tmp_path / "plans")
    recorded = json.loads((tmp_path / "plans/fa3-ci.json").read_text())["command"]
    assert recorded == ["planner", "build", "--backend", "fa3", "--ci"]
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert main(["build", "--backend", "fa3", "--ci"]) == 0
    finally:
        os.chdir(old)
    assert (tmp_path / "plans/fa3-ci.json").read_bytes() == (root / "plans/fa3-ci.json").read_bytes()
