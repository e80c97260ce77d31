"""A plan's device items (planner/device.py), its fidelity (planner/fidelity.py) and --require-exact."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from capture_plan.planner import BuildOptions, build_plan
from capture_plan.planner.cli import main
from capture_plan.planner.device import calibration_from_report, peak
from capture_plan.schemas.errors import InputError
from capture_plan.schemas.plan import Step
from capture_plan.schemas.report import CaptureReport, DeviceItem, DeviceView, StepMeasurement

MiB = 2**20
ROOT = Path(__file__).resolve().parent.parent


def _report(plan, *, per_graph=2 * MiB, scratch=100 * MiB, workspace=32 * MiB, device="NVIDIA H200 sm90, torch 2.11"):
    """A report of ``plan`` as the executor writes it: free memory falls by the pool's growth
    plus ``per_graph`` driver bytes per capture; warm-ups took ``scratch``."""
    free0 = 100_000 * MiB
    free, reserved, steps = free0 - workspace, workspace, []
    for s, m in zip(plan.steps, plan.predicted.timeline):
        if s.op == "capture":
            grown = m.reserved + workspace - reserved
            reserved += grown
            free -= grown + per_graph
        steps.append(
            StepMeasurement(
                step=s.index,
                id=s.id,
                reserved=m.reserved,
                predicted_reserved=m.reserved,
                seconds=0.0,
                free=free,
                allocator_reserved=reserved,
                scratch=scratch if s.op == "warmup" else None,
            )
        )
    pool = plan.predicted.pool_bytes
    view = DeviceView(
        free_before=free0,
        free_after=free,
        drop=free0 - free,
        items=[
            DeviceItem(name="pool", bytes=pool),
            DeviceItem(name="hoisted", bytes=0),
            DeviceItem(name="allocator-held", bytes=workspace),
            DeviceItem(name="allocator-cached", bytes=0),
            DeviceItem(name="outside-allocator", bytes=free0 - free - pool - workspace),
        ],
        first_in_process=True,
    )
    return CaptureReport(
        plan=plan.name,
        plan_digest=plan.digest,
        device=device,
        torch="2.11",
        backend_module="",
        pool_bytes=pool,
        predicted_pool_bytes=pool,
        capture_seconds=1.0,
        steps=steps,
        driver="580.1",
        device_view=view,
    )


@pytest.fixture(scope="module")
def fa3ci():
    return build_plan(BuildOptions(backend="fa3", ci=True))


def test_without_a_calibration_the_measured_items_are_unknown_never_zero(fa3ci):
    dev = fa3ci.predicted.device
    items = {i.name: i for i in dev.items}
    assert items["pool"].bytes == fa3ci.predicted.pool_bytes and items["pool"].provenance == "simulated"
    for name in ("stream-workspace", "allocator-other", "graph-exec"):
        assert items[name].bytes is None and items[name].provenance == "unknown"
        assert "--calibration" in items[name].source
    assert dev.total_bytes is None and dev.peak_bytes is None


def test_a_calibration_report_gives_the_total_and_the_warmup_peak(tmp_path, fa3ci):
    rep = tmp_path / "report.json"
    rep.write_bytes(msgspec.json.encode(_report(fa3ci)))
    plan = build_plan(BuildOptions(backend="fa3", ci=True, calibration=rep, output=tmp_path / "p.json"))
    dev = plan.predicted.device
    items = {i.name: i.bytes for i in dev.items}
    captures = sum(s.op == "capture" for s in plan.steps)
    assert items["stream-workspace"] == 32 * MiB  # planner/data/devices.toml, sm90
    assert items["graph-exec"] == captures * 2 * MiB
    assert dev.total_bytes == sum(items.values())
    # the warm-up runs first, on an empty pool: its 100 MiB scratch is below the final pools here
    assert dev.peak_bytes == dev.total_bytes > 100 * MiB + 32 * MiB
    assert "NVIDIA H200" in dev.device and "580.1" in dev.device
    assert plan.inputs.calibration == "report.json"


def test_a_warmup_larger_than_the_pools_is_the_peak(tmp_path, fa3ci):
    rep = tmp_path / "report.json"
    rep.write_bytes(msgspec.json.encode(_report(fa3ci, scratch=1000 * MiB)))
    plan = build_plan(BuildOptions(backend="fa3", ci=True, calibration=rep, output=tmp_path / "p.json"))
    # the one warm-up runs before any capture: its scratch plus the workspace (allocator-other is 0 here)
    assert plan.predicted.device.peak_bytes == 1000 * MiB + 32 * MiB > plan.predicted.device.total_bytes


def test_a_calibration_without_the_device_items_or_a_workspace_figure_gives_no_zeros(tmp_path, fa3ci):
    rep = _report(fa3ci, device="NVIDIA H200")  # no compute capability: no workspace figure
    path = tmp_path / "r.json"
    path.write_bytes(msgspec.json.encode(rep))
    plan = build_plan(BuildOptions(backend="fa3", ci=True, calibration=path, output=tmp_path / "p.json"))
    items = {i.name: i for i in plan.predicted.device.items}
    assert items["stream-workspace"].bytes is None and items["allocator-other"].bytes is None
    assert plan.predicted.device.total_bytes is None
    bare = msgspec.structs.replace(rep, device_view=msgspec.structs.replace(rep.device_view, items=[]))
    with pytest.raises(InputError, match="lacks pool, hoisted, allocator-held"):
        calibration_from_report(bare, "bare.json", {})


def test_the_peak_is_a_warmup_on_top_of_the_pools_captured_before_it():
    steps = [
        Step(index=0, id="warmup/a/8", op="warmup", phase="a", bs=8),
        Step(index=1, id="capture/a/8", op="capture", phase="a", bs=8),
        Step(index=2, id="warmup/b/8", op="warmup", phase="b", bs=8),
        Step(index=3, id="capture/b/8", op="capture", phase="b", bs=8),
    ]
    after = [0, 300, 300, 320]
    got = peak(steps, after, {}, {"a": 2.0, "b": 1.0}, {"a": 50, "b": 100}, fixed=10)
    assert got == 300 + 100 + 10 + 2  # during b's warm-up: a's pool, b's scratch, fixed, a's driver memory
    assert peak(steps, after, {}, {"a": 2.0}, {"a": 50, "b": 100}, fixed=10) is None  # b's graphs: unknown


def test_a_report_without_device_memory_is_refused_as_a_calibration(tmp_path, fa3ci):
    old = msgspec.structs.replace(_report(fa3ci), device_view=None)
    with pytest.raises(InputError, match="no device view"):
        calibration_from_report(old, "old.json", {})


def test_a_calibration_from_another_device_than_the_trace_is_refused_naming_both(tmp_path, capsys):
    trace = ROOT / "plans/traces/fa3-ci.json"
    plan = build_plan(BuildOptions(backend="fa3", ci=True, trace=trace, output=tmp_path / "t.json"))
    rep = tmp_path / "h100.json"
    rep.write_bytes(msgspec.json.encode(_report(plan, device="NVIDIA H100 80GB HBM3 sm90, torch 2.11")))
    code = main(
        ["build", "-b", "fa3", "--ci", "--trace", str(trace), "--calibration", str(rep), "-o", str(tmp_path / "x.json")]
    )
    err = capsys.readouterr().err
    assert code == 1 and "H100" in err and "H200" in err and err.count("\n") == 1, err


def test_config_builds_are_approximate_and_require_exact_refuses_them(tmp_path, capsys):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 2048,
                "num_hidden_layers": 4,
                "num_attention_heads": 16,
                "num_key_value_heads": 8,
                "intermediate_size": 5632,
                "vocab_size": 32000,
                "dtype": "bfloat16",
            }
        )
    )
    spec = tmp_path / "m.toml"
    spec.write_text('[model]\nconfig = "config.json"\n[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 8]\n')
    plan = build_plan(BuildOptions(backend="torch", spec=spec, output=tmp_path / "m.json"))
    assert plan.predicted.fidelity == "approximate"
    caveat = plan.predicted.caveat
    assert "llama" in caveat and "-89%" in caveat and "capture_plan.executor.profile" in caveat
    out = tmp_path / "m.json"
    assert main(["build", "-b", "torch", "--spec", str(spec), "-o", str(out), "--require-exact"]) == 1
    err = capsys.readouterr().err
    assert "approximate" in err and err.count("\n") == 1 and not out.exists()  # refused before writing
    assert main(["build", "-b", "torch", "--spec", str(spec), "-o", str(out)]) == 0
    assert "approximate: the figures describe the reference" in capsys.readouterr().out
    assert main(["check", str(out)]) == 0 and main(["check", str(out), "--require-exact"]) == 1


def test_reference_and_trace_plans_say_what_they_describe(fa3ci):
    assert fa3ci.predicted.fidelity == "reference" and "capture_plan.references" in fa3ci.predicted.describes
    traced = build_plan(BuildOptions(backend="fa3", ci=True, trace=ROOT / "plans/traces/fa3-ci.json"))
    assert traced.predicted.fidelity == "recorded" and "fa3-ci.json" in traced.predicted.describes


def test_a_report_from_another_device_than_the_calibration_is_refused_naming_both(tmp_path, fa3ci, capsys):
    rep = tmp_path / "report.json"
    rep.write_bytes(msgspec.json.encode(_report(fa3ci)))
    out = tmp_path / "p.json"
    assert main(["build", "-b", "fa3", "--ci", "--calibration", str(rep), "-o", str(out)]) == 0
    plan = json.loads(out.read_text())
    other = msgspec.structs.replace(
        _report(fa3ci), device="NVIDIA H100 80GB HBM3 sm90, torch 2.11", plan_digest=plan["digest"]
    )
    (tmp_path / "h100.json").write_bytes(msgspec.json.encode(other))
    capsys.readouterr()
    assert main(["report", str(tmp_path / "h100.json"), "--plan", str(out)]) == 1
    err = capsys.readouterr().err
    assert "H100" in err and "H200" in err and err.count("\n") == 1, err
    same = msgspec.structs.replace(_report(fa3ci), plan_digest=plan["digest"])
    (tmp_path / "same.json").write_bytes(msgspec.json.encode(same))
    assert main(["report", str(tmp_path / "same.json"), "--plan", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "device view (foreground, first capture of its process" in shown and "graph-exec" in shown


def test_report_require_exact_refuses_an_approximate_plan_and_needs_one(tmp_path, capsys):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "mixtral",
                "hidden_size": 1024,
                "num_hidden_layers": 2,
                "num_attention_heads": 16,
                "num_key_value_heads": 8,
                "intermediate_size": 3584,
                "vocab_size": 32000,
                "num_local_experts": 8,
                "num_experts_per_tok": 2,
                "dtype": "bfloat16",
            }
        )
    )
    spec = tmp_path / "m.toml"
    spec.write_text('[model]\nconfig = "config.json"\n[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 8]\n')
    out = tmp_path / "m.json"
    assert main(["build", "-b", "torch", "--spec", str(spec), "-o", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["predicted"]["fidelity"] == "approximate" and "mixtral" in plan["predicted"]["caveat"]
    rep = tmp_path / "r.json"
    p = build_plan(BuildOptions(backend="torch", spec=spec, output=out))
    rep.write_bytes(msgspec.json.encode(_report(p)))
    capsys.readouterr()
    assert main(["report", str(rep), "--plan", str(out)]) == 0
    assert main(["report", str(rep), "--plan", str(out), "--require-exact"]) == 1
    assert "approximate" in capsys.readouterr().err
    assert main(["report", str(rep), "--require-exact"]) == 1
    assert "--plan" in capsys.readouterr().err


def test_a_calibrated_plan_compares_with_its_own_calibration_report(capsys):
    cal = ROOT / "plans/calibration/h200-fa3-ci.json"
    assert main(["report", str(cal), "--plan", str(ROOT / "plans/fa3-ci-h200.json")]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("graph-exec"))
    assert row.split()[1:3] == ["94.0", "94.0"]  # predicted from that very report, measured in it
    # another plan's report stays refused
    assert main(["report", str(cal), "--plan", str(ROOT / "plans/fa3-eagle-ci-h200.json")]) == 1
