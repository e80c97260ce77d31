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
