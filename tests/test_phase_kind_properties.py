"""Phase kinds carry their properties as data (planner/data/phase_kinds.toml): the planner
reads them there, the plan records the one its consumer needs (``PhasePlan.piecewise``,
revision 6), and neither the executor nor a plugin names a kind (the vLLM plugin asks the
plan whether a phase is piecewise, as the executor does). The worked example of
docs/development.md ("A new phase kind") is the test below that adds one by data alone."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import msgspec
import pytest

from capture_plan.executor.cursor import Cursor
from capture_plan.executor.errors import ExecutorError
from capture_plan.planner.inputs import resources
from capture_plan.planner.memory import analytic
from capture_plan.schemas.codec import decode_plan, plan_digest
from capture_plan.schemas.keys import PlanIndex

ROOT = Path(__file__).resolve().parent.parent

#: the docs' worked example: a kind that allocates like vLLM's PIECEWISE, for another engine
NEW_KIND = b"""
[kinds.encoder_pieces]
description = "an encoder's forward as piece graphs between eager attention ops (the docs' example)"
program = "piecewise"
piecewise = true
sizes = "tokens"
settings = ["layers", "pieces"]
"""


def _clear() -> None:
    for cached in (resources.data, resources.phase_kinds, resources.variant_axes, analytic._phase_kind_models):
        cached.cache_clear()


@pytest.fixture
def new_kind(monkeypatch):
    """phase_kinds.toml with NEW_KIND appended: the one edit a new kind is."""
    real = resources.data_bytes
    monkeypatch.setattr(resources, "data_bytes", lambda n: real(n) + NEW_KIND if n == "phase_kinds.toml" else real(n))
    _clear()
    yield
    monkeypatch.undo()
    _clear()


def test_a_new_kind_is_one_edit_to_data(new_kind, tmp_path):
    pytest.importorskip("torch")  # capture() and the loop are the executor's
    from capture_plan.executor import capture
    from capture_plan.planner.build import BuildOptions, build_plan

    spec = tmp_path / "s.toml"
    spec.write_text(
        '[model]\npreset = "llama-3-8b"\nlayers = 2\n[[phases]]\nname = "enc"\nkind = "encoder_pieces"\n'
        "sizes = [8, 16]\n"
    )
    plan = build_plan(BuildOptions(backend="fa3", spec=spec, output=tmp_path / "p.json"))
    # the planner read the kind's program and properties; the plan records what the executor needs
    assert plan.phases[0].piecewise is True and plan.revision == 6
    assert plan.predicted.pool_bytes > 0
    # the executor knows it only from the plan: capture() refuses it, the loop wants its piece count
    with pytest.raises(ExecutorError, match=r"phase 'enc' is 'encoder_pieces': its graphs are pieces"):
        capture(plan, object())  # pyright: ignore[reportArgumentType]  # refused before the target is used
    cur = Cursor(plan)
    with pytest.raises(ExecutorError, match=r"phase 'enc' is 'encoder_pieces' but the plan does not say how many"):
        cur.check(cur.phase("enc", "test"), 16, ())


def test_the_plan_records_the_property_on_piecewise_phases_only():
    for path in sorted((ROOT / "plans").glob("*.json")):
        raw = json.loads(path.read_bytes())
        kinds = resources.phase_kinds()
        recorded = [p.get("piecewise", False) for p in raw["phases"]]
        assert recorded == [kinds[p["kind"]].piecewise for p in raw["phases"]], path.name
        assert (raw["revision"] == 6) == any(recorded), path.name  # the lowest revision a plan needs


def test_a_plan_from_before_the_property_is_read_as_it_was():
    """A revision-4 plan records no property: its piecewise kind is known by the kinds of then."""
    raw = json.loads((ROOT / "plans/fa3-vllm.json").read_bytes())
    for p in raw["phases"]:
        p.pop("piecewise", None)
    raw.update(revision=4, digest="")
    raw["digest"] = plan_digest(raw)
    old = decode_plan(msgspec.json.encode(raw), "old.json")
    index = PlanIndex.of(old)
    assert [index.piecewise(p.name) for p in old.phases] == [True, False]
    raw.update(revision=6, digest="")  # a plan of this revision says so itself: no property, not piecewise
    raw["digest"] = plan_digest(raw)
    new = decode_plan(msgspec.json.encode(raw), "new.json")
    assert [PlanIndex.of(new).piecewise(p.name) for p in new.phases] == [False, False]


def _kind_names_in(path: Path, kinds, root: Path = ROOT) -> list[str]:
    """Where ``path`` names a phase kind: a module-level table holding a kind's name (the
    shape PIECEWISE_KINDS, DRAFT_PHASES and SIZED_PHASES had), or a comparison of a ``.kind``."""
    tree = ast.parse(path.read_text())
    nodes = [n.value for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None]
    nodes += [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Compare)
        and any(isinstance(x, ast.Attribute) and x.attr == "kind" for x in [n.left, *n.comparators])
    ]
    return [
        f"{path.relative_to(root)}:{c.lineno}: {c.value!r}"
        for node in nodes
        for c in ast.walk(node)
        if isinstance(c, ast.Constant) and c.value in kinds
    ]


def test_the_finder_finds_the_shapes_it_names(tmp_path):
    path = tmp_path / "example.py"
    path.write_text(
        'A = frozenset({"piecewise"})\nB = {"X": "draft_extend"}\n'
        'def f(p):\n    return p.kind == "decode", ("decode", 1)\n'
    )
    assert _kind_names_in(path, {"piecewise", "draft_extend", "decode"}, tmp_path) == [
        "example.py:1: 'piecewise'",
        "example.py:2: 'draft_extend'",
        "example.py:4: 'decode'",
    ]


def test_neither_the_executor_nor_a_plugin_names_a_kind():
    kinds = set(resources.phase_kinds())
    paths = sorted((ROOT / "executor").glob("*.py")) + sorted((ROOT / "adapters/plugins").glob("*.py"))
    found = [hit for path in paths for hit in _kind_names_in(path, kinds)]
    assert not found, "read the kind's properties instead (PlanIndex, planner/data/phase_kinds.toml):\n" + "\n".join(
        found
    )
