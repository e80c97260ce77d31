"""``python -m capture_plan.references.calibrate PLAN REPORT`` (the fix a refused --calibration
names) where it cannot capture: one line, exit 1, nothing written (issue 49, bug 2).

Before: without a GPU it ended in a traceback (an fa3 plan: ``ImportError: FA3 requested but
neither ...``; a ``-b torch`` plan: ``RuntimeError: Cannot get CUDA generator``; a ``--ci``
plan on CPU torch: ``EnvironmentMismatch`` raised out of executor/load.py). On a GPU:
tests/test_calibration_binding.py's gpu test runs it through.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from capture_plan.references import calibrate

ROOT = Path(__file__).resolve().parents[1]
CI_PLAN = ROOT / "plans/fa3-ci.json"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "capture_plan.references.calibrate", *args], capture_output=True, text=True
    )


def _one_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 1, done.stderr
    line = done.stderr.strip()
    assert "\n" not in line and "Traceback" not in line and line.startswith("calibrate: error: "), done.stderr
    assert done.stdout == ""
    return line


def _torch_plan(tmp_path: Path) -> Path:
    from capture_plan.planner.cli import main

    path = tmp_path / "torch.json"
    assert main(["build", "-b", "torch", "--ci", "-o", str(path)]) == 0
    return path


@pytest.mark.parametrize("backend", ["fa3", "torch"])
def test_without_a_cuda_device_it_says_so_and_names_the_command_for_the_gpu_machine(tmp_path, backend):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: the gpu test runs the command through")
    plan = CI_PLAN if backend == "fa3" else _torch_plan(tmp_path)
    report = tmp_path / "r.json"
    line = _one_line(_run(str(plan), str(report)))
    assert line.startswith(
        f"calibrate: error: {plan}: capturing a calibration report needs a CUDA device; this machine has none "
        f"(torch {torch.__version__}); fix: run `python -m capture_plan.references.calibrate {plan} {report}` "
        "on a machine with a CUDA GPU of compute capability >= "
    )
    assert line.endswith(f"then build with --calibration {report}")
    assert f"backend {backend}'s kernels" in line
    assert not report.exists()


def test_a_gpu_without_the_plans_backend_kernels_is_named_before_the_capture(tmp_path, monkeypatch):
    """On a GPU machine without FA3's kernels (the ImportError of the reference's attention,
    before): the environment check names them, strict here whatever the plan's --ci."""
    from capture_plan.executor.load import Environment, load_plan

    plan = load_plan(CI_PLAN, check_env=False)
    gpu = Environment("NVIDIA H100 80GB HBM3", (9, 0), "2.13.0", frozenset())
    from capture_plan.executor.errors import EnvironmentMismatch

    with pytest.raises(EnvironmentMismatch) as err:
        calibrate.check_machine(plan, str(CI_PLAN), "r.json", environment=gpu)
    assert str(err.value) == (
        f"{CI_PLAN}: this machine cannot capture the plan for its calibration: backend fa3 kernels not importable "
        "(any of flash_attn_interface, fa3_fwd_interface); fix: run `python -m capture_plan.references.calibrate "
        f"{CI_PLAN} r.json` on a machine with a CUDA GPU of compute capability >= 9.0, torch "
        f"{plan.requires.torch} and backend fa3's kernels (any of flash_attn_interface, fa3_fwd_interface), "
        "then build with --calibration r.json"
    )
    fits = Environment("NVIDIA H100 80GB HBM3", (9, 0), "2.13.0", frozenset({"flash_attn_interface"}))
    calibrate.check_machine(plan, str(CI_PLAN), "r.json", environment=fits)  # nothing to say


def test_a_bad_plan_or_report_folder_is_one_line_before_the_device(tmp_path):
    (tmp_path / "bad.json").write_text("{")
    line = _one_line(_run(str(tmp_path / "bad.json"), str(tmp_path / "r.json")))
    assert f"{tmp_path / 'bad.json'}" in line
    line = _one_line(_run(str(tmp_path / "gone.json"), str(tmp_path / "r.json")))
    assert "gone.json" in line
    line = _one_line(_run(str(CI_PLAN), str(tmp_path / "no" / "r.json")))
    assert line == (
        f"calibrate: error: {tmp_path / 'no' / 'r.json'}: the report's folder {tmp_path / 'no'} is not there; "
        f"fix: mkdir -p {tmp_path / 'no'}"
    )
