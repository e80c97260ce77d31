"""``planner graph --phases``: one node per phase, legible for the EAGLE plans
(issue 19: the 210-step chain rendered as a 32,767 x 62 px image)."""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import pytest

PLANS = Path(__file__).resolve().parents[1] / "plans"


@pytest.fixture
def plans(tmp_path):
    shutil.copytree(PLANS, tmp_path / "plans")


def test_dot_phase_view_of_the_eagle_plan(cli, plans):
    code, out, _ = cli("graph", "plans/fa3-eagle-ci.json", "--phases")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == 'digraph "fa3-eagle-ci" {'
    assert lines[4] == (
        '  p0 [label="target_verify\\l51 captures, bs 256 \u2192 1\\lorder largest-first (default)\\l'
        "pool phase:target_verify, outputs view\\l1 hoisted workspace (fa3-ci-varlen-gate)\\l"
        '1 warm-up (warmup)\\l"];'
    )
    assert lines[-4:] == [
        '  p0 -> p1 [label="phase-order"];',
        '  p1 -> p2 [label="phase-order"];',
        '  p2 -> p3 [label="phase-order"];',
        "}",
    ]
    assert len(lines) == 12  # 4 nodes, 3 edges: not 210 steps


def test_mermaid_phase_view(cli, plans):
    code, out, _ = cli("graph", "plans/fa3-eagle.json", "--phases", "-f", "mermaid")
    lines = out.splitlines()
    assert code == 0 and lines[0] == "flowchart LR"
    assert lines[4] == (
        '  p3["decode<br/>51 captures, bs 256 \u2192 1<br/>order largest-first (default)<br/>'
        'pool shared, outputs view<br/>1 warm-up (warmup)"]'
    )
    assert lines[-1] == "  p2 -->|phase-order| p3"


def test_one_phase_plan(cli, plans):
    code, out, _ = cli("graph", "plans/triton.json", "--phases")
    assert code == 0
    assert (
        '"decode\\l36 captures, bs 256 \u2192 1\\lorder largest-first (default)\\lpool shared, outputs view\\l'
        '36 warm-ups (warmup-per-shape)\\l"' in out
    )


def test_a_phase_name_with_quotes_stays_one_dot_string(built):
    import msgspec

    from capture_plan.planner.render import graph_phases

    plan = built(backend="fa3", max_bs=4)
    odd = msgspec.structs.replace(plan, name='we"ird')
    assert graph_phases(odd, "dot").splitlines()[0] == 'digraph "we\\"ird" {'


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` is not installed")
def test_the_phase_view_renders_small(cli, plans, tmp_path):
    out = cli("graph", "plans/fa3-eagle-ci.json", "--phases")[1]
    png = subprocess.run(["dot", "-Tpng"], input=out.encode(), capture_output=True, check=True).stdout
    width, height = struct.unpack(">II", png[16:24])
    assert width < 2000 and height < 400, (width, height)
