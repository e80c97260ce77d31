"""The plan's one index (capture_plan.schemas.keys.PlanIndex): what it answers, that it is
built once per plan, and that the executor, the adapters and the schemas search a plan's
phases by name nowhere else (read with ast)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from msgspec import UNSET

from capture_plan.executor.load import load_plan
from capture_plan.schemas.key_fields import KEY_FIELDS, KeyFields
from capture_plan.schemas.keys import GraphKey, PlanIndex, step_key, step_labels

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["fa3-eagle-ci.json", "fa3-sglang-lora.json", "fa3-vllm-keys.json"])
def test_the_index_answers_every_step_s_key(name):
    plan = load_plan(ROOT / "plans" / name, check_env=False)
    index = PlanIndex.of(plan)
    assert index is PlanIndex.of(plan)  # built once: load_plan built it
    for s in plan.steps:
        phase = next(p for p in plan.phases if p.name == s.phase)  # the search the index replaces
        # each key field the phase sets, but for the value a phase without it has
        fields = {f: getattr(phase, f) for f in KEY_FIELDS}
        fields = {f: v for f, v in fields.items() if v not in (UNSET, KEY_FIELDS[f].unset_means)}
        want = GraphKey(s.phase, s.bs, step_labels(phase, s), s.bs * phase.tokens_per_request, KeyFields(**fields))
        assert index.key(s) == step_key(plan, s) == want
        assert index.steps[s.id] is s and index.phase(s.phase) is phase and index.kinds[s.phase] == phase.kind
    assert index.pools == {s.pool for s in plan.steps if s.op == "capture"}
    assert "capture" in index.streams


def test_an_equal_plan_decoded_again_gets_its_own_index():
    a = load_plan(ROOT / "plans/fa3-ci.json", check_env=False)
    b = load_plan(ROOT / "plans/fa3-ci.json", check_env=False)
    assert a == b and PlanIndex.of(a) is not PlanIndex.of(b) and PlanIndex.of(a).plan is a


def _searches(tree: ast.AST) -> list[int]:
    """Lines that index a plan's phases by name: ``{p.name: p for p in X.phases}``,
    ``{p.name: p.kind ...}`` or ``next(... for p in X.phases if p.name == ...)``."""
    lines = []
    for node in ast.walk(tree):
        gens = getattr(node, "generators", None)
        if not gens or not any(isinstance(g.iter, ast.Attribute) and g.iter.attr == "phases" for g in gens):
            continue
        var = gens[0].target.id if isinstance(gens[0].target, ast.Name) else None
        if isinstance(node, ast.DictComp) and ast.unparse(node.key) == f"{var}.name":
            if ast.unparse(node.value) in (var, f"{var}.kind"):
                lines.append(node.lineno)
        elif any(f"{var}.name ==" in ast.unparse(cond) for g in gens for cond in g.ifs):
            lines.append(node.lineno)
    return sorted(lines)


def test_nothing_else_indexes_a_plan_s_phases_by_name():
    found = []
    for folder in ("executor", "adapters", "schemas"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text())
            own = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "PlanIndex"]
            inside = {line for n in own for line in range(n.lineno, (n.end_lineno or n.lineno) + 1)}
            found += [f"{path.relative_to(ROOT)}:{line}" for line in _searches(tree) if line not in inside]
    assert not found, "ask PlanIndex.of(plan) instead:\n" + "\n".join(found)


def test_the_search_finder_finds_the_shapes_it_names():
    code = (
        "a = {p.name: p for p in plan.phases}\n"
        "b = next(p for p in plan.phases if p.name == x)\n"
        "c = {p.name: p.kind for p in plan.phases}\n"
        "d = [p.name for p in plan.phases]\n"
    )
    assert _searches(ast.parse(code)) == [1, 2, 3]
