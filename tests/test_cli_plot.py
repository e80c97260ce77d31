"""``planner plot OLD [NEW]``: pool memory per capture for a PR (issue 19).
Checked by rendering: the file exists, is the image asked for, has the
series, and is the same bytes and size every time. How it looks was checked
by eye (docs/plot-example.png is one)."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

PLANS = Path(__file__).resolve().parents[1] / "plans"


@pytest.fixture
def plans(tmp_path):
    shutil.copytree(PLANS, tmp_path / "plans")
    return tmp_path / "plans"


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_per_pool_series_end_at_each_pools_peak(plans):
    from capture_plan.planner.plot import pool_series
    from capture_plan.schemas.codec import decode_plan

    plan = decode_plan((plans / "fa3-eagle-ci.json").read_bytes(), "p")
    series = pool_series(plan)
    assert {name: ys[-1] for name, ys in series.items()} == plan.predicted.pools
    assert all(len(ys) == 204 for ys in series.values())
    assert all(a <= b for ys in series.values() for a, b in zip(ys, ys[1:]))  # a private pool only grows
    assert series["shared"][50] == 0 and series["phase:target_verify"][50] > 0  # target_verify captures first


def test_two_plans_as_png_fixed_size_and_deterministic(cli, plans, tmp_path):
    code, out, err = cli("plot", "plans/fa3-eagle-ci.json", "plans/fa3-eagle.json", "-o", "a.png", "--budget", "2048")
    assert (code, out, err) == (0, "wrote a.png\n", "")
    first = (tmp_path / "a.png").read_bytes()
    assert _png_size(first) == (1400, 640)
    assert cli("plot", "plans/fa3-eagle-ci.json", "plans/fa3-eagle.json", "-o", "a.png", "--budget", "2048")[0] == 0
    assert (tmp_path / "a.png").read_bytes() == first


def test_svg_has_the_series_phases_baseline_and_budget(cli, plans, tmp_path):
    assert (
        cli(
            "build",
            "-b",
            "fa3",
            "--ci",
            "--speculative",
            "eagle",
            "-s",
            "target_verify.order=smallest-first",
            "-o",
            "tv.json",
        )[0]
        == 0
    )
    code, out, _ = cli("plot", "plans/fa3-eagle-ci.json", "tv.json", "-o", "tv.svg", "--budget", "4096")
    assert (code, out) == (0, "wrote tv.svg\n")
    svg = (tmp_path / "tv.svg").read_text()
    assert svg.startswith("<?xml")
    for text in [
        "fa3-eagle-ci \u2192 tv: predicted total 1,520.0 MiB -&gt; 9,514.0 MiB (+7,994.0 MiB, +525.9%); "
        "budget 4,096 MiB: over by 5,418.0 MiB",
        "old fa3-eagle-ci: pool phase:target_verify: 978.0 MiB",
        "new tv: pool phase:target_verify: 8,972.0 MiB",
        "new tv: pool shared: 542.0 MiB",
        "new tv: all pools: 9,514.0 MiB",
        "engines' loop peak: 11,486.0 MiB",
        "budget: 4,096 MiB",
        "target_verify",
        "51 sizes, bs 1\u2192256",
        "phase:target_verify pool, smallest-first",
        "captures of fa3-eagle-ci (old), batch sizes",
    ]:
        assert text in svg, text
    again = svg
    assert cli("plot", "plans/fa3-eagle-ci.json", "tv.json", "-o", "tv.svg", "--budget", "4096")[0] == 0
    assert (tmp_path / "tv.svg").read_text() == again  # no date, no version, fixed ids


def test_one_plan_and_a_baseline_above_the_scale(cli, plans, tmp_path):
    assert cli("plot", "plans/fa3-eagle.json", "-o", "one.svg")[0] == 0
    svg = (tmp_path / "one.svg").read_text()
    assert "fa3-eagle: predicted 1,520.0 MiB (pools 1,520.0 MiB + hoisted 0 B), engines' loop 11,486.0 MiB" in svg
    assert "(7.6x the plan's pools; above this scale)" in svg


@pytest.mark.parametrize(
    "args,needle",
    [
        (("plans/fa3.json", "-o", "plans/fa3-ci.json"), "-o plans/fa3-ci.json: exists and is not a PNG image"),
        (("plans/fa3.json", "-o", "x.svg"), "-o x.svg: exists and is not an SVG image"),
        (("plans/traces/fa3-ci.json", "-o", "t.png"), "this is a trace file, not a plan"),
    ],
)
def test_bad_input_is_one_line(cli, plans, tmp_path, args, needle):
    (tmp_path / "x.svg").write_bytes(b"\x89PNG\r\n\x1a\nnot svg")
    code, out, err = cli("plot", *args)
    assert (code, out) == (1, "") and err.count("\n") == 1 and needle in err, err


def test_output_is_required_and_budget_a_number(cli, plans):
    assert cli("plot", "plans/fa3.json")[0] == 2
    code, _, err = cli("plot", "plans/fa3.json", "-o", "a.png", "--budget", "lots")
    assert code == 2 and "Invalid value for '--budget'" in err
