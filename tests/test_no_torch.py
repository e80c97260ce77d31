"""The planner never imports torch; the executor never imports networkx or the CLI framework (click)."""

from __future__ import annotations

import subprocess
import sys


def _run(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_import_planner_and_help_leave_torch_unimported():
    out = _run(
        "import sys, capture_plan.planner, capture_plan.planner.build, capture_plan.planner.cli\n"
        "from capture_plan.planner.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "main(['build', '-b', 'fa3', '--dry-run'])\n"
        "print('torch' in sys.modules)"
    )
    assert out.splitlines()[-1] == "False"


def test_executor_load_plan_needs_neither_networkx_nor_click_nor_torch():
    out = _run(
        "import sys, capture_plan.executor\nfrom capture_plan.executor import load_plan, PadTable\n"
        "mods = ('networkx', 'click', 'typer', 'capture_plan.planner', 'torch')\n"
        "print(sorted(m for m in mods if m in sys.modules))"
    )
    assert out == "[]"


def test_executor_never_imports_adapters():
    """Adapters and the reference models sit above the executor: importing every executor module loads none."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    mods = sorted(p.stem for p in (root / "executor").glob("*.py") if p.stem != "__init__")
    out = _run(
        "import importlib, sys\n"
        f"for m in {mods!r}:\n"
        "    try:\n        importlib.import_module('capture_plan.executor.' + m)\n"
        "    except ImportError as e:\n        if 'torch' not in str(e): raise\n"
        "above = ('capture_plan.adapters', 'capture_plan.references')\n"
        "print(sorted(m for m in sys.modules if m.startswith(above)))"
    )
    assert out.splitlines()[-1] == "[]"
    # and no executor source names the package (an import inside a function would not show above)
    import ast

    for path in (root / "executor").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else []
            )
            assert not [
                n for n in names if n.startswith(("capture_plan.adapters", "capture_plan.references", "transformers"))
            ], (path, names)


def test_a_build_imports_no_networkx():
    """networkx costs more than a whole default build; only a cycle's error message needs it.

    The EAGLE preset at --max-bs 16 takes every step of a multi-phase build (phase
    order, the CI gate, hoisting) with a quarter of the full preset's captures."""
    out = _run(
        "import sys\nfrom capture_plan.planner.cli import main\n"
        "main(['build', '-b', 'fa3', '--ci', '--speculative', 'eagle', '--max-bs', '16', '--dry-run'])\n"
        "print('networkx' in sys.modules)"
    )
    assert out.splitlines()[-1] == "False"
