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
    from capture_plan.planner.report.plot import pool_series
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
        # each plan by its file (not in git here: no commit), and what changed between them
        "plans/fa3-eagle-ci.json \u2192 tv.json: predicted total 1,520.0 MiB -&gt; 9,514.0 MiB (+7,994.0 MiB, "
        "+525.9%); budget 4,096 MiB: over by 5,418.0 MiB",
        "changed: pins: none -&gt; -s target_verify.order=smallest-first",
        "plans/fa3-eagle-ci.json: pool phase:target_verify: 978.0 MiB",
        "tv.json: pool phase:target_verify: 8,972.0 MiB",
        "tv.json: pool shared: 542.0 MiB",
        "tv.json: all pools: 9,514.0 MiB",
        "engines' loop peak: 11,486.0 MiB",
        "budget: 4,096 MiB",
        "target_verify",
        "51 sizes, bs 1\u2192256",
        "phase:target_verify pool, smallest-first",
    ]:
        assert text in svg, text
    again = svg
    assert cli("plot", "plans/fa3-eagle-ci.json", "tv.json", "-o", "tv.svg", "--budget", "4096")[0] == 0
    assert (tmp_path / "tv.svg").read_text() == again  # no date, no version, fixed ids


def test_one_plan_and_a_baseline_above_the_scale(cli, plans, tmp_path):
    assert cli("plot", "plans/fa3-eagle.json", "-o", "one.svg")[0] == 0
    svg = (tmp_path / "one.svg").read_text()
    assert (
        "plans/fa3-eagle.json: predicted 1,520.0 MiB (pools 1,520.0 MiB + hoisted 0 B), engines' loop 11,486.0 MiB"
        in svg
    )
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


def _drawn(old_path: Path, new_path: Path, labels: list[str]) -> dict:
    """What the plot draws, read back from its artists: per legend label the line's
    (batch size, MiB) points (sizes from the x-axis tick labels), the title, the ticks."""
    from capture_plan.planner.report.plot import drawing
    from capture_plan.schemas.codec import decode_plan

    plans = [decode_plan(p.read_bytes(), str(p)) for p in (old_path, new_path)]
    with drawing(plans, labels=labels) as fig:
        ax = fig.axes[0]
        ticks = {x: t.get_text() for x, t in zip(ax.get_xticks(), ax.get_xticklabels())}
        lines = {
            line.get_label(): [(ticks[x].split()[0], round(y, 1)) for x, y in zip(line.get_xdata(), line.get_ydata())]
            for line in ax.get_lines()
            if len(line.get_xdata()) > 1
        }
        return {"lines": lines, "title": ax.get_title(), "ticks": list(ticks.values())}


def test_two_plans_are_aligned_by_batch_size_labelled_apart_and_titled_with_the_change(cli, plans, tmp_path):
    """Issue 29: 36 vs 40 sizes were drawn by capture index (the same batch size at two
    x positions), titled "llama -> llama"."""
    assert cli("build", "-b", "fa3", "--ci", "--max-bs", "320", "-o", "big.json")[0] == 0
    got = _drawn(plans / "fa3-ci.json", tmp_path / "big.json", ["main: fa3-ci.json", "pr: fa3-ci.json"])
    old, new = (
        got["lines"]["main: fa3-ci.json: pool shared: 258.0 MiB"],
        got["lines"]["pr: fa3-ci.json: pool shared: 324.0 MiB"],
    )
    # every size both capture is at one x in both lines: the old line's sizes are the new one's minus four
    assert [bs for bs, _ in new] == ["320", "304", "288", "272"] + [bs for bs, _ in old]
    assert [bs for bs, _ in old][:3] == ["256", "248", "240"] and old[-1][0] == "1" and len(old) == 36
    assert got["ticks"][:5] == ["320 (new)", "304 (new)", "288 (new)", "272 (new)", "256"]
    assert got["title"].splitlines() == [
        "main: fa3-ci.json \u2192 pr: fa3-ci.json: predicted total 258.0 MiB -> 324.0 MiB (+66.0 MiB, +25.6%)",
        "changed: spec: embedded:default (79b2e6c6e604 -> 1a04f8bd7be2); sizes decode: 36 sizes 1..256 -> 40 sizes "
        "1..320 (+[272, 288, 304, 320])",
    ]


def test_a_plan_captured_the_other_way_keeps_each_size_at_its_x(cli, plans, tmp_path):
    assert cli("build", "-b", "fa3", "--ci", "-s", "order=smallest-first", "-o", "asc.json")[0] == 0
    got = _drawn(plans / "fa3-ci.json", tmp_path / "asc.json", ["largest-first", "smallest-first"])
    old = got["lines"]["largest-first: pool shared: 258.0 MiB"]
    new = got["lines"]["smallest-first: pool shared: 2,078.0 MiB"]
    assert [bs for bs, _ in old] == [bs for bs, _ in new] == got["ticks"]
    assert got["ticks"][0] == "1" and got["ticks"][-1] == "256"
    # at size 256: the largest-first plan's first capture (the largest graph alone), the other's last
    assert old[-1] == ("256", 252.0) and new[-1] == ("256", 2078.0)


@pytest.mark.parametrize("labels", [("--label", "a"), ("--label", "a", "--label", "b", "--label", "c")])
def test_one_label_per_plan_or_a_usage_error(cli, plans, labels):
    code, out, err = cli("plot", "plans/fa3.json", "plans/fa3-ci.json", "-o", "a.png", *labels)
    assert (code, out) == (2, "") and f"--label given {len(labels) // 2} time(s) for 2 plan(s)" in err


def test_the_default_label_is_the_file_and_its_commit(tmp_path):
    import subprocess

    from capture_plan.planner.report.plot import plan_label

    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(git + ["init", "-q"], check=True)
    plan = tmp_path / "p.json"
    assert plan_label(plan) == str(plan)  # not committed: the path alone
    plan.write_text("{}")
    subprocess.run(git + ["add", "p.json"], check=True)
    subprocess.run(git + ["commit", "-qm", "p"], check=True)
    commit = subprocess.run(git + ["log", "-1", "--format=%h"], check=True, capture_output=True, text=True).stdout
    assert plan_label(plan) == f"{plan} @ {commit.strip()}"
    plan.write_text("{ }")
    assert plan_label(plan) == f"{plan} @ {commit.strip()} (modified)"
