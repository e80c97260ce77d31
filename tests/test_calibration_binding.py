"""A calibration is bound to what it measured (issue 40, item 1): a capture report of one
backend and model gives no device figures to a build of another.

Before: ``planner build -b fa3 --spec qwen.toml --calibration plans/calibration/h200-fa3-ci.json``
printed the Llama report's graph-exec figure for an 80-layer spec, unscaled and unflagged, and
``planner report R --plan P`` accepted such a plan as its calibration's own.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_inputs import one_line_error, reseal

ROOT = Path(__file__).resolve().parents[1]
CAL = ROOT / "plans/calibration/h200-fa3-ci.json"
DIMS = {
    "layers": 32,
    "hidden": 4096,
    "heads": 32,
    "kv_heads": 8,
    "head_dim": 128,
    "intermediate": 14336,
    "vocab": 128256,
    "dtype_bytes": 2,
    "logits_dtype_bytes": 4,
}


def _spec(layers: int) -> str:
    dims = "\n".join(f"{k} = {v}" for k, v in {**DIMS, "layers": layers}.items())
    return f'[model]\nname = "mine"\n{dims}\n[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 2, 4, 8]\n'


@pytest.mark.parametrize("layers", [8, 80])
def test_a_calibration_of_another_model_is_refused_naming_the_dimension(cli, tmp_path, layers):
    (tmp_path / "s.toml").write_text(_spec(layers))
    err = one_line_error(
        cli("build", "-b", "fa3", "--spec", "s.toml", "--calibration", str(CAL), "-o", "p.json"),
        f"h200-fa3-ci.json: $.model: the calibration measured another model than this build's (layers 32 -> {layers})",
        "fix: build this plan without --calibration",
        "python -m capture_plan.references.calibrate PLAN REPORT",
    )
    assert "None" not in err
    assert not (tmp_path / "p.json").exists()


def test_the_same_model_typed_into_a_spec_takes_the_calibration(cli, tmp_path):
    (tmp_path / "s.toml").write_text(_spec(32))
    code, out, err = cli("build", "-b", "fa3", "--spec", "s.toml", "--calibration", str(CAL), "-o", "p.json")
    assert code == 0, err
    assert "reserve for capture:" in out and "graph-exec" in out


def test_a_calibration_of_another_backend_is_refused(cli):
    one_line_error(
        cli("build", "-b", "triton", "--ci", "--calibration", str(CAL), "-o", "p.json"),
        "$.backend: the calibration measured backend 'fa3', this build is for 'triton'",
    )


def test_sizes_refuses_a_calibration_of_another_model_too(cli, tmp_path):
    (tmp_path / "s.toml").write_text(_spec(80))
    (tmp_path / "t.csv").write_text("size,count\n1,5\n3,2\n")
    one_line_error(
        cli("sizes", "-b", "fa3", "--spec", "s.toml", "--traffic", "t.csv", "--calibration", str(CAL)),
        "(layers 32 -> 80)",
    )


def _report(tmp_path: Path, change) -> Path:
    raw = json.loads(CAL.read_text())
    change(raw)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(raw))
    return path


def test_a_report_that_says_neither_its_model_nor_is_listed_is_refused(cli, tmp_path):
    """The same report's bytes changed: not the one planner/data/calibrations.toml lists."""
    path = _report(tmp_path, lambda r: r.update(capture_seconds=2.0))
    one_line_error(
        cli("build", "-b", "fa3", "--ci", "--calibration", str(path), "-o", "p.json"),
        "r.json: $.model: the report does not say which model it measured",
    )


def test_a_report_that_names_its_model_binds_by_it(cli, tmp_path):
    """What the executor writes now: the plan's backend and model in the report."""
    path = _report(tmp_path, lambda r: r.update(capture_seconds=2.0, backend="fa3", model={"dimensions": DIMS}))
    code, out, err = cli("build", "-b", "fa3", "--ci", "--calibration", str(path), "-o", "p.json")
    assert code == 0, err
    (tmp_path / "s.toml").write_text(_spec(80))
    one_line_error(
        cli("build", "-b", "fa3", "--spec", "s.toml", "--calibration", str(path), "-o", "q.json"),
        "(layers 32 -> 80)",
    )
    eagle = cli("build", "-b", "fa3", "--ci", "--speculative", "eagle", "--calibration", str(path), "-o", "e.json")
    one_line_error(eagle, "phase draft_decode layers unset -> 1")


def test_report_against_a_plan_whose_calibration_measured_another_model_exits_1(cli, tmp_path):
    """A plan built (before builds refused it) from a calibration of another model: `planner
    report CAL --plan P` took the report as the plan's own, printed the table and exited 0."""
    raw = json.loads((ROOT / "plans/fa3-ci-h200.json").read_text())
    raw["inputs"]["model"]["dimensions"]["layers"] = 80
    (tmp_path / "p.json").write_bytes(reseal(raw))
    one_line_error(cli("report", str(CAL), "--plan", "p.json"), "(layers 32 -> 80)")
    code, out, err = cli("report", str(CAL), "--plan", str(ROOT / "plans/fa3-ci-h200.json"))
    assert code == 0, err


def test_the_executor_writes_the_backend_and_model_a_calibration_binds_to(cli, fake, tmp_path):
    """A capture report the executor wrote (capture on the CPU, CUDA faked: tests/fake_cuda.py)
    names the plan's backend and model, and the build binds it by them: a build of the same
    spec takes it, one of another model is refused naming the dimension. (Before: this test
    searched executor/measure.py's source for the field names.)"""
    import torch

    from capture_plan.executor import capture
    from capture_plan.planner import BuildOptions, build_plan
    from fake_cuda import Target

    (tmp_path / "s.toml").write_text(_spec(32))
    plan = build_plan(BuildOptions(backend="fa3", spec=tmp_path / "s.toml", strategies=("outputs=keep",)))
    gs = capture(plan, Target(fake), progress=False, device=torch.device("cpu"))
    try:
        gs.write_report(tmp_path / "r.json")
    finally:
        gs.release()
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["backend"] == "fa3" and report["model"]["dimensions"] == DIMS
    (tmp_path / "s80.toml").write_text(_spec(80))
    one_line_error(
        cli("build", "-b", "fa3", "--spec", "s80.toml", "--calibration", "r.json", "-o", "q.json"),
        "r.json: $.model: the calibration measured another model than this build's (layers 32 -> 80)",
    )
    code, out, err = cli("build", "-b", "fa3", "--spec", "s.toml", "--calibration", "r.json", "-o", "p.json")
    assert code == 0, err


@pytest.mark.gpu
def test_the_calibrate_command_the_fix_names_makes_a_calibration_the_build_takes(tmp_path):
    """On a GPU: python -m capture_plan.references.calibrate PLAN REPORT, then the build with it."""
    import subprocess
    import sys

    from capture_plan.planner.cli import main

    (tmp_path / "s.toml").write_text(_spec(8))
    assert main(["build", "-b", "fa3", "--spec", str(tmp_path / "s.toml"), "-o", str(tmp_path / "p.json")]) == 0
    done = subprocess.run(
        [sys.executable, "-m", "capture_plan.references.calibrate", str(tmp_path / "p.json"), str(tmp_path / "r.json")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["backend"] == "fa3" and report["model"]["dimensions"]["layers"] == 8
    args = ["build", "-b", "fa3", "--spec", str(tmp_path / "s.toml"), "--calibration", str(tmp_path / "r.json")]
    assert main([*args, "-o", str(tmp_path / "c.json")]) == 0
