"""``--device`` is read alike by every command that takes it (planner/inputs/devices.py
``device_name``): ``planner fit``, ``planner build`` (with and without ``--engine``) and
``planner sizes`` accept torch's name or words of exactly one known device, and refuse an
ambiguous or unknown name with the same one line, its fix that command with the nearest
device, which runs.

Before: ``planner fit --device H100`` was the H100, while ``planner sizes --device H100`` and
``planner build --device H100`` were refused as unknown devices (each command had its own
exact-name lookup: planner/sizes/step_time.py, planner/memory/graph_nodes.py)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from cli_inputs import one_line_error

ROOT = Path(__file__).resolve().parents[1]
TRAFFIC = str(ROOT / "tests" / "data" / "traffic-skewed.csv")
H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"
LEN = ("--max-model-len", "8192")


def _commands(device: str) -> dict[str, list[str]]:
    """Every command that takes ``--device``, with ``device``, each otherwise accepted."""
    return {
        "fit": ["fit", "--model", "llama-3-8b", "--device", device, "--engine", "vllm==0.34.0", *LEN],
        "sizes": ["sizes", "-b", "fa3", "--traffic", TRAFFIC, "--max-graphs", "4", "--device", device],
        "build": ["build", "-b", "fa3", "--device", device, "-o", "b.json"],
        "build --engine": [
            "build", "-b", "fa3", "--device", device, "--engine", "vllm==0.34.0",
            "--engine-flag", "max-model-len=8192", "-o", "e.json",
        ],
        "build --sizes auto": [
            "build", "-b", "fa3", "--sizes", "auto", "--traffic", TRAFFIC, "--max-graphs", "4",
            "--device", device, "-o", "s.json",
        ],
    }  # fmt: skip


def _device_used(cli, name: str, args: list[str], out: str) -> str:
    """The device the accepted command ``name`` priced on, as its output or plan says."""
    if name == "fit":
        return out.split(" on ", 1)[1].split(" x1", 1)[0]
    if name == "sizes":
        return out.split("roofline of ", 1)[1].split(" (", 1)[0]
    plan = json.loads(Path(args[-1]).read_text())
    recorded = plan["command"][plan["command"].index("--device") + 1]
    assert plan["predicted"]["device"]["device"].startswith(f"{recorded} sm90"), plan["predicted"]["device"]
    return recorded


@pytest.mark.parametrize("given", ["H100", "h100 80gb", "h100-80GB", H100, H100.lower()])
def test_every_command_takes_the_same_words_for_a_device(cli, given):
    """``planner sizes --device H100`` failed before: "unknown device 'H100'"."""
    for name, args in _commands(given).items():
        code, out, err = cli(*args)
        assert code == 0, (name, err)
        assert _device_used(cli, name, args, out) == H100, name
        if name == "build --engine":  # the engine's KV tokens are priced on it, and so labelled
            assert json.loads(Path("e.json").read_text())["predicted"]["kv"]["engine"].startswith(
                f"vllm==0.34.0 on {H100}"
            )


@pytest.mark.parametrize(
    ("given", "line", "near"),
    [
        (
            "A100",
            "device 'A100' names 2 devices: NVIDIA A100-SXM4-80GB; NVIDIA A100-SXM4-40GB",
            "NVIDIA A100-SXM4-80GB",
        ),
        ("nvidia", "device 'nvidia' names 8 devices: NVIDIA H100 80GB HBM3; NVIDIA H200;", H100),
        ("H300", "unknown device 'H300' (known: NVIDIA H100 80GB HBM3; NVIDIA H200;", None),
        ("H20", "unknown device 'H20' (known: NVIDIA H100 80GB HBM3; NVIDIA H200;", None),
        ("", "no device named (--device '' has no letters or digits; known: NVIDIA H100 80GB HBM3;", H100),
        ("-", "no device named (--device '-' has no letters or digits; known: NVIDIA H100 80GB HBM3;", H100),
    ],
)
def test_every_command_refuses_a_device_alike_and_its_fix_runs(cli, given, line, near):
    """An ambiguous or unknown name: one line, the same in every command up to its fix; the fix
    is that command with the nearest device (one the command can price on), and it runs."""
    refused = set()
    for name, args in _commands(given).items():
        err = one_line_error(cli(*args), "--device", line, "; fix: ")
        refused.add(err.split("; fix: ")[0])
        fixed = shlex.split(err.split("`")[1])
        assert fixed[:2] == ["planner", args[0]], err
        if near is not None:
            assert fixed[fixed.index("--device") + 1] == near, err
        code, _, err = cli(*fixed[1:], *(["--force"] if args[0] == "build" else []))
        assert code == 0, (name, err)
    assert len(refused) == 1, refused  # the same line everywhere


@pytest.mark.parametrize("given", ["H20", "L4", "A10", "L40", "h10", "A100 40G"])
def test_a_word_is_a_whole_word_of_the_name_never_a_part(given):
    """``H20`` (96 GB), ``L4`` (24 GB) and ``A10`` (24 GB) are devices of their own. Before, a
    word matched any part of a name: ``--device H20`` was priced as the H200 (141 GB) and
    ``L4`` as the L40S (48 GB), without a word said; ``A10`` was "names 2 devices" (the A100s)."""
    from capture_plan.planner.inputs.devices import DeviceRefused, device_name

    with pytest.raises(DeviceRefused) as err:
        device_name(given)
    assert err.value.what.startswith(f"unknown device {given!r} (known: "), err.value.what


def test_a_device_without_what_the_command_needs_is_refused_naming_one_with_it(cli):
    """The B200 has roofline figures but no memory total: ``planner sizes`` and ``planner build``
    take it; ``planner fit`` and a build's KV pricing (which read the total) refuse it, naming a
    device with one; the L40S has a total but no roofline figures: the size choice refuses it."""
    for name in ("sizes", "build"):
        code, _, err = cli(*_commands("b200")[name])
        assert code == 0, (name, err)
    for name in ("fit", "build --engine"):
        err = one_line_error(cli(*_commands("b200")[name]), "--device", "device 'NVIDIA B200' has no memory total")
        fixed = shlex.split(err.split("`")[1])
        assert cli(*fixed[1:])[0] == 0, err
    for name in ("sizes", "build --sizes auto"):
        err = one_line_error(cli(*_commands("l40s")[name]), "device 'NVIDIA L40S' has no roofline figures")
        fixed = shlex.split(err.split("`")[1])
        assert cli(*fixed[1:])[0] == 0, err
    code, _, err = cli(*_commands("l40s")["build"], "--force")  # its graph-exec estimated (sm89: unknown)
    assert code == 0, err


def test_fits_calibration_reads_the_device_as_fit_does(cli):
    """``planner fit --plan --calibration`` reads ``--device`` when it binds the report to it: a
    name of two devices there is the same line, its fix this command (before: the fix was the
    bare flag, ``--device NVIDIA A100-SXM4-80GB``, no command), and ``h200`` is the H200."""
    plan, cal = str(ROOT / "plans/fa3-ci-h200.json"), str(ROOT / "plans/calibration/h200-fa3-ci.json")
    args = ["fit", "--model", "llama-3-8b", "--engine", "vllm==0.34.0", *LEN, "--plan", plan, "--calibration", cal]
    err = one_line_error(cli(*args, "--device", "A100"), "--device: device 'A100' names 2 devices")
    fixed = shlex.split(err.split("`")[1])
    assert fixed[:2] == ["planner", "fit"] and "--calibration" in fixed, err
    code, out, err = cli(*args, "--device", "h200")
    assert code == 0 and out.startswith("llama-3-8b on NVIDIA H200 x1"), err


def test_a_builds_fix_replaces_the_file_the_user_forced_it_to(cli):
    """``planner build ... --force`` over a file holding another build's plan, refused for its
    --device: the fix is a command that runs, so it says --force too (the user's --force is no
    build option, and the fix dropped it: running it was refused, 'holds a plan ...'; review3)."""
    assert cli("build", "-b", "fa3", "-o", "b.json")[0] == 0
    err = one_line_error(cli("build", "-b", "fa3", "--ci", "--device", "H20", "-o", "b.json", "--force"), "--device")
    fixed = shlex.split(err.split("`")[1])
    assert fixed[-1] == "--force", err
    code, _, err = cli(*fixed[1:])
    assert code == 0, err
    command = json.loads(Path("b.json").read_text())["command"]
    near = fixed[fixed.index("--device") + 1]
    assert "--ci" in command and command[command.index("--device") + 1] == near, command
    # a fix over the build's own plan (the same command) needs none
    err = one_line_error(cli("build", "-b", "fa3", "--ci", "--device", "H20", "-o", "b.json"), "--device")
    assert "--force" not in err, err


@pytest.mark.parametrize(
    ("given", "needs", "line", "near"),
    [
        ("nvidia", (), "device 'nvidia' names 8 devices: NVIDIA H100 80GB HBM3; NVIDIA H200; ", H100),
        ("NVIDIA", ("memory",), "device 'NVIDIA' names 8 devices: ", H100),
        ("a100", ("roofline",), "device 'a100' names 2 devices: NVIDIA A100-SXM4-80GB; NVIDIA A100-SXM4-40GB", A100),
        ("", (), "no device named (--device '' has no letters or digits; known: NVIDIA H100 80GB HBM3; ", H100),
        ("-", ("memory",), "no device named (--device '-' has no letters or digits; known: ", H100),
        ("rtx", ("roofline",), "device 'rtx' names 2 devices: NVIDIA GeForce RTX 4090; NVIDIA RTX A5000", H100),
    ],
)  # fmt: skip
def test_an_ambiguous_or_empty_name_fixes_with_the_first_listed_never_a_guess(given, needs, line, near):
    """A name of several devices, or of none (no words), lists what it matches (every known
    device for an empty one) and its fix names the first listed that the command can use
    (fit_devices.toml's order: the H100 first), saying so. Before: ``nvidia`` and ``''`` were
    fixed with the "nearest" device by spelling among equal matches, the RTX A5000, and ``''``
    read "unknown device ''"; ``rtx`` under a size choice (no roofline figures for either RTX)
    was fixed with the H200 and not told why."""
    from capture_plan.planner.inputs.devices import DeviceRefused, device_name

    with pytest.raises(DeviceRefused) as err:
        device_name(given, needs)
    assert err.value.what.startswith(line), err.value.what
    assert err.value.near == near, err.value.near
    assert "first listed" in err.value.hint, err.value.hint
    if given == "rtx":  # neither candidate has roofline figures: the fix says what is missing
        assert "roofline figures" in err.value.hint, err.value.hint


@pytest.mark.parametrize("given", ["h100", "H200", "4090", "a5000", "l40s", "A100 40GB", "b200"])
def test_a_unique_part_still_resolves(given):
    """Words of exactly one known device name it, as before."""
    from capture_plan.planner.inputs.devices import device_name, known_devices

    name = device_name(given)
    assert name in known_devices() and set(given.lower().split()) <= set(name.lower().replace("-", " ").split())
