"""One owner per concept (issue 50, item 3): the strategy axes are declared once, in
schemas/strategy.py; the plan's Strategy, the spec's Choice, the pins and the optimizer's
searched axes are made of them, and a new axis is that one file changed."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path
from typing import get_args, get_origin

import pytest

import capture_plan
from capture_plan.schemas.plan import Strategy
from capture_plan.schemas.spec import Choice
from capture_plan.schemas.strategy import AXES, AXIS_VALUES, MEMORY_AXES, ChoiceAxes, StrategyAxes

ROOT = Path(__file__).resolve().parents[1]


def test_strategy_and_choice_are_made_of_the_axes():
    assert AXES == ("order", "outputs", "workspace", "pool", "warmup")
    assert MEMORY_AXES == ("order", "outputs", "workspace", "pool")
    assert Strategy.__struct_fields__[: len(AXES)] == AXES == ChoiceAxes.__struct_fields__
    assert Choice.__struct_fields__[: len(AXES)] == AXES
    for ax in AXES:
        # a choice's axis is the strategy's, optional
        hint = ChoiceAxes.__annotations__[ax]
        assert get_origin(hint) is not None and set(get_args(hint)) == {StrategyAxes.__annotations__[ax], type(None)}
        assert AXIS_VALUES[ax] == get_args(StrategyAxes.__annotations__[ax])
    assert Strategy().label() == "order=largest-first outputs=keep workspace=pool pool=shared warmup=every-size"


def test_no_other_module_lists_the_axes():
    """A tuple or list of three axis names or more, written out, outside schemas/strategy.py (two
    may be a table's columns)."""
    names = set(AXES)
    for folder in ("planner", "schemas"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "strategy.py" and folder == "schemas":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.Tuple, ast.List)):
                    written = {e.value for e in node.elts if isinstance(e, ast.Constant)}
                    assert len(written & names) < 3, f"{path.relative_to(ROOT)}:{node.lineno}"


#: a sixth axis added to schemas/strategy.py as one would write it, (what stands there, what
#: replaces it): its type before StrategyAxes, then its field in StrategyAxes and ChoiceAxes
NEW_AXIS = (
    ("\nclass StrategyAxes(", '\nFuse = Literal["unfused", "fused"]\n\n\nclass StrategyAxes('),
    ('    warmup: Warmup = "every-size"\n', '    warmup: Warmup = "every-size"\n    fuse: Fuse = "unfused"\n'),
    ("    warmup: Warmup | None = None\n", "    warmup: Warmup | None = None\n    fuse: Fuse | None = None\n"),
)


BUILD = """
import sys
from pathlib import Path
import capture_plan
import pytest
assert capture_plan.__file__.startswith(sys.argv[1]), capture_plan.__file__
from capture_plan.planner.build import BuildOptions, build_plan
from capture_plan.schemas.strategy import MEMORY_AXES
assert "fuse" in MEMORY_AXES
out = Path(sys.argv[1]) / "p.json"
plan = build_plan(BuildOptions(backend="fa3", ci=True, max_bs=8, strategies=["fuse=fused"], output=out))
(decision,) = [d for d in plan.decisions if d.rule == "optimizer"]
print(plan.phases[0].strategy.fuse, len(decision.alternatives), sum(a.feasible for a in decision.alternatives))
print(plan.phases[0].strategy.label())
"""


def test_a_new_axis_is_one_file_changed(tmp_path):
    """A copy of the package whose schemas/strategy.py alone declares a sixth axis: a pin
    names it, the optimizer searches it (every alternative twice: fused and not) and the
    plan records it, with no other file changed."""
    package = tmp_path / "capture_plan"
    package.mkdir()
    shutil.copy(ROOT / "__init__.py", package)
    ignore = shutil.ignore_patterns("__pycache__")
    for sub in ("schemas", "planner"):
        shutil.copytree(ROOT / sub, package / sub, ignore=ignore)
    strategy = package / "schemas" / "strategy.py"
    text = strategy.read_text()
    for there, new in NEW_AXIS:
        assert text.count(there) == 1, there
        text = text.replace(there, new)
    strategy.write_text(text)
    changed = [
        p.relative_to(package).as_posix()
        for p in package.rglob("*.py")
        if p.read_bytes() != (ROOT / p.relative_to(package)).read_bytes()
    ]
    assert changed == ["schemas/strategy.py"]
    run = subprocess.run(
        [sys.executable, "-c", BUILD, str(tmp_path)],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    first, label = run.stdout.splitlines()
    fuse, alternatives, feasible = first.split()
    assert fuse == "fused"
    # 2 orders x 2 outputs (workspace in the pool; one phase: one pool) x 2 fuse; the pin
    # leaves the 4 fused ones feasible
    assert (int(alternatives), int(feasible)) == (8, 4)
    assert label.endswith("warmup=once-per-phase fuse=fused")
    assert capture_plan.__file__.startswith(str(ROOT))


def test_the_model_dimensions_are_written_out_once():
    """PhaseModel is made of Model's fields (each optional), not a second list of them."""
    import msgspec

    from capture_plan.schemas.spec import PHASE_DIMENSIONS, Model, PhaseModel

    assert PhaseModel.__struct_fields__ == PHASE_DIMENSIONS
    for f in PHASE_DIMENSIONS:
        assert set(get_args(PhaseModel.__annotations__[f])) == {Model.__annotations__[f], msgspec.UnsetType}
    tree = ast.parse((ROOT / "schemas" / "spec.py").read_text())
    declared = [
        node.target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in PHASE_DIMENSIONS
    ]
    assert sorted(declared) == sorted(PHASE_DIMENSIONS)  # once each: Model's
    # bounds and strictness are Model's
    with pytest.raises(msgspec.ValidationError, match=r"\$.hidden"):
        msgspec.convert({"hidden": 0}, PhaseModel)
    with pytest.raises(msgspec.ValidationError, match="unknown field `layers`"):
        msgspec.convert({"layers": 2}, PhaseModel)
    assert msgspec.convert({"vocab": 32000}, PhaseModel).vocab == 32000
