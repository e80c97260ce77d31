"""The planner never imports torch; the executor never imports networkx or typer."""

from __future__ import annotations

import subprocess
import sys


def _run(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_import_planner_and_help_leave_torch_unimported():
    out = _run("import sys, planner, planner.build, planner.cli\n"
               "from planner.cli import main\n"
               "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
               "main(['build', '-b', 'fa3', '--dry-run'])\n"
               "print('torch' in sys.modules)")
    assert out.splitlines()[-1] == "False"


def test_executor_load_plan_needs_neither_networkx_nor_typer_nor_torch():
    out = _run("import sys, executor\nfrom executor import load_plan, PadTable\n"
               "print(sorted(m for m in ('networkx', 'typer', 'planner', 'torch') if m in sys.modules))")
    assert out == "[]"
