"""Every refusal of ``planner sizes`` whose fix names a command names a ``planner sizes``
command (the one the user ran, with the change), and that command runs: the sizes are
chosen, exit 0 (as tests/test_fit_sglang_swa.py runs fit's fixes).

Each case failed before: the fixes of the engine's settings named ``planner build``
commands (without the traffic: a plan of the spec's sizes, not the sizes asked for), the
floors and budgets named no command, and an engine flag refused on a spec without a
config.json named a command refused in turn for its context length.
"""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest

from cli_inputs import one_line_error

ROOT = Path(__file__).resolve().parent.parent
H100 = "NVIDIA H100 80GB HBM3"
VLLM = ("--engine", "vllm==0.34.0", "--device", H100)
LEN = ("--engine-flag", "max-model-len=8192")

CASES = {
    "an engine flag without an engine": (("--engine-flag", "max-model-len=4096", "--upto", "4"), "--upto 4"),
    "an engine without a device": (("--engine", "vllm==0.34.0", "--all"), "--all"),
    "a KV-token floor without an engine": (("--min-kv-tokens", "1000", "--write-spec", "w.toml"), "--write-spec"),
    "an engine flag the engine lacks": ((*VLLM, "--engine-flag", "bogus=1"), "max-model-len=8192"),
    "an engine flag out of bounds": ((*VLLM, "--engine-flag", "gpu-memory-utilization=2"), "=0.9"),
    "a release with no modelled rule": (("--engine", "vllm==0.99.0", "--device", H100, *LEN), "vllm==0.34.0"),
    "an engine that would not start": ((*VLLM, *LEN, "--engine-flag", "gpu-memory-utilization=0.05"), "utilization"),
    "a KV-token floor no list meets": ((*VLLM, *LEN, "--min-kv-tokens", "100000000"), "--min-kv-tokens"),
    "a budget no list fits": ((*VLLM, *LEN, "--budget-mib", "1"), "--budget-mib"),
    "a padding no list meets": (("--max-padding", "0.0001", "--max-graphs", "2"), "--max-padding"),
    "a traffic over the largest size": (("--max-size", "3"), "--max-size"),
    "an option out of its range": (("--context", "0", "--upto", "3"), "--upto 3"),
    "a calibration of another backend": (
        ("--calibration", str(ROOT / "plans/calibration/h200-fa3-ci.json"), "--upto", "3"),
        "--upto 3",
    ),
    "the other engine's context flag": (
        ("--engine", "sglang==0.5.23", "--device", H100, "--engine-flag", "max-model-len=4096"),
        "--engine-flag context-length=4096",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_refusal_of_planner_sizes_names_a_planner_sizes_command_that_runs(cli, tmp_path, case):
    args, kept = CASES[case]
    backend = "triton" if "--calibration" in args else "fa3"  # the calibration measured fa3
    shutil.copy(ROOT / "tests/data/traffic-skewed.csv", tmp_path / "t.csv")
    err = one_line_error(cli("sizes", "-b", backend, "--traffic", "t.csv", *args), "; fix: ", "`planner sizes ")
    commands = re.findall(r"`(planner [^`]*)`", err.partition("; fix: ")[2])
    assert len(commands) == 1 and "planner build" not in err, err
    argv = shlex.split(commands[0])
    assert argv[:2] == ["planner", "sizes"] and "--traffic" in argv and kept in shlex.join(argv), argv
    code, out, err = cli(*argv[1:])
    assert code == 0 and "chosen:" in out, err


@pytest.mark.parametrize("flag", ["bogus=1", "gpu-memory-utilization=2"])
def test_a_builds_engine_flag_refused_on_a_spec_without_a_config_names_a_build_that_runs(cli, flag):
    """The embedded spec names no config.json: a refused engine flag's fix (the flag left out,
    or a value in bounds) named the build without a max-model-len, refused in turn; now the
    build with one, and it is made."""
    err = one_line_error(cli("build", "-b", "fa3", *VLLM, "--engine-flag", flag, "-o", "p.json"), "`planner build ")
    argv = shlex.split(err.partition("; fix: ")[2].split("`")[1])
    assert "max-model-len=8192" in argv, argv
    code, _out, err = cli(*argv[1:])
    assert code == 0, err
