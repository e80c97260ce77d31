"""``planner build --device NAME`` without ``--sizes auto`` (issue 52 item 3): a plan built for a
device counts graph-exec memory for it, estimated from the graph-exec bench's nodes per layer
(planner/memory/graph_nodes.py) and the device's per-node figure, so ``diff --fail-above`` sees
what a size costs. Before: ``--device`` without ``--sizes auto`` was refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

PLANS = Path(__file__).resolve().parents[1] / "plans"
TRAFFIC = PLANS.parent / "tests" / "data" / "traffic-skewed.csv"


@pytest.fixture
def plans(tmp_path):
    shutil.copytree(PLANS, tmp_path / "plans")
    return tmp_path / "plans"


def _items(path: Path) -> dict:
    return {i["name"]: i for i in json.loads(path.read_text())["predicted"]["device"]["items"]}


def test_a_plan_built_for_a_device_estimates_its_graph_exec(cli, plans):
    code, out, err = cli("build", "-b", "fa3", "--ci", "--device", "NVIDIA H200", "-o", "plans/d.json")
    assert (code, err) == (0, ""), err
    items = _items(plans / "d.json")
    g = items["graph-exec"]
    assert g["provenance"] == "estimated" and "bench" in g["source"]
    # 36 graphs of the reference's 876 nodes (bench, 32 layers) x 2,926 B, in 2 MiB steps; the
    # H200 calibration of the same plan measured 94.0 MiB (plans/fa3-ci-h200.json): within 10%
    assert g["bytes"] == 88 << 20
    measured = _items(plans / "fa3-ci-h200.json")["graph-exec"]["bytes"]
    assert abs(g["bytes"] - measured) <= 0.1 * measured
    assert items["stream-workspace"]["bytes"] == 32 << 20
    assert items["allocator-other"]["provenance"] == "unknown"  # nothing measured it: never 0
    plan = json.loads((plans / "d.json").read_text())
    assert plan["inputs"]["build"]["device"] == "NVIDIA H200" and "--device" in plan["command"]
    code, out, err = cli("check", "plans/d.json")
    assert code == 0 and "up to date" in out


def test_the_gate_sees_the_graph_exec_of_added_sizes_on_a_device(cli, plans):
    device = ("--device", "NVIDIA H200")
    auto = ("--sizes", "auto", "--traffic", str(TRAFFIC), "--max-graphs", "9")
    assert cli("build", "-b", "fa3", "--ci", *device, *auto, "-o", "plans/d9.json")[0] == 0
    assert cli("build", "-b", "fa3", "--ci", *device, "-o", "plans/d36.json")[0] == 0
    code, out, err = cli("diff", "plans/d9.json", "plans/d36.json", "--fail-above", "5%")
    assert code == 1
    assert err.startswith(
        "planner: error: plans/d36.json: device items known in both plans (pool + hoisted + stream-workspace + "
        "graph-exec; unknown: allocator-other) grew 312.0 MiB -> 378.0 MiB (+66.0 MiB, +21.2%)"
    )


def test_a_device_without_a_per_node_figure_leaves_graph_exec_unknown(cli, plans):
    assert cli("build", "-b", "fa3", "--device", "NVIDIA A100-SXM4-80GB", "-o", "plans/a.json")[0] == 0
    assert _items(plans / "a.json")["graph-exec"]["provenance"] == "unknown"


def test_an_unknown_device_is_one_line(cli, plans):
    """``H100`` is the H100 (tests/test_device_names.py); ``H300`` is no device: one line."""
    code, out, err = cli("build", "-b", "fa3", "--device", "H300", "-o", "plans/x.json")
    assert code == 1 and err.count("\n") == 1
    assert "unknown device 'H300'" in err and "NVIDIA H100 80GB HBM3" in err
    assert not (plans / "x.json").exists()


def test_a_device_other_than_the_calibrations_is_refused(cli, plans):
    cal = ("--calibration", "plans/calibration/h200-fa3-ci.json")
    code, _, err = cli("build", "-b", "fa3", "--ci", *cal, "--device", "NVIDIA H100 80GB HBM3", "-o", "plans/x.json")
    assert code == 1 and "the calibration was measured on 'NVIDIA H200'" in err
    assert cli("build", "-b", "fa3", "--ci", *cal, "--device", "NVIDIA H200", "-o", "plans/y.json")[0] == 0
