"""Replay times on a real GPU (marked ``gpu``): ``time_replays`` puts a median replay time on every
capture step of the report, and ``planner sizes --timing`` reads them as measured step times.

Run on the device: ``python -m pytest -m gpu -q tests/test_gpu_timing.py``.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

SIZES = [1, 2, 4, 8, 16, 32, 64]
SMALL = dict(layers=2, hidden=1024, heads=8, kv_heads=2, head_dim=128, intermediate=2048, vocab=32000)


def test_replay_times_reach_the_report_and_planner_sizes(cli, tmp_path):
    from capture_plan.executor import capture
    from capture_plan.executor.timing import time_replays
    from capture_plan.planner import BuildOptions, build_plan
    from capture_plan.references.decode import ReferenceConfig, ReferenceModel
    from capture_plan.schemas.codec import decode_report
    from capture_plan.schemas.spec import Model

    spec = tmp_path / "spec.toml"
    spec.write_text(
        "[model]\n"
        + "".join(f"{k} = {v}\n" for k, v in SMALL.items())
        + f'\n[[phases]]\nname = "decode"\nkind = "decode"\nsizes = {SIZES}\n'
    )
    plan = build_plan(BuildOptions(backend="fa3", spec=spec, output=tmp_path / "plan.json"))
    model = ReferenceModel(ReferenceConfig(model=Model(**SMALL), max_bs=64, max_seqlen=256))
    gs = capture(plan, model, progress=False)
    try:
        timed = time_replays(gs, runs=5, warmup=2)
        gs.write_report(tmp_path / "report.json")
    finally:
        gs.release()
    replays = {m.id: m.replay_seconds for m in timed.steps if m.id.startswith("capture/")}
    assert sorted(replays) == sorted(f"capture/decode/{bs}" for bs in SIZES)
    assert all(isinstance(t, float) and t > 0 for t in replays.values()), replays
    again = decode_report((tmp_path / "report.json").read_bytes(), "report.json")
    assert {m.id: m.replay_seconds for m in again.steps if m.id.startswith("capture/")} == replays

    (tmp_path / "t.csv").write_text("size,count\n1,50\n3,40\n5,30\n9,20\n17,10\n40,5\n")
    code, out, err = cli(
        "sizes", "-b", "fa3", "--spec", str(spec), "--traffic", "t.csv", "--timing", str(tmp_path / "report.json")
    )
    assert code == 0, err
    assert "7 sizes replayed" in out and "roofline of" not in out
