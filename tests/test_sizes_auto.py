"""``planner build --sizes auto --traffic FILE``: the plan captures the sizes chosen for the traffic,
records the traffic (its path relative to the plan, the digest of its bytes) and the choice's
figures, rebuilds byte for byte from anywhere, says in ``explain`` and ``diff`` why each size is
in, and refuses bad input with one located line whose fix command works (tests/test_error_fixes.py
runs those commands)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from capture_plan.planner.inputs.build_options import (
    BuildOptions,
    SizeChoiceOptions,
    options_from_command,
    options_from_record,
)
from capture_plan.schemas.codec import decode_plan
from cli_inputs import every_size_choice, one_line_error

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "data"
SKEWED = DATA / "traffic-skewed.csv"
SCRAPE = DATA / "vllm-metrics.prom"
CALIBRATION = ROOT / "plans/calibration/h200-fa3-ci.json"


def _repo(tmp_path: Path) -> Path:
    """A checkout holding a traffic file under data/ and a plans/ folder."""
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    (repo / "plans").mkdir()
    shutil.copy(SKEWED, repo / "data/t.csv")
    return repo


def _plan(path: Path):
    return decode_plan(path.read_bytes(), str(path))


def test_the_plan_records_the_traffic_and_rebuilds_byte_for_byte_from_any_clone(cli, tmp_path, monkeypatch):
    repo = _repo(tmp_path)
    monkeypatch.chdir(repo)
    code, out, err = cli("build", "-b", "fa3", "--sizes", "auto", "--traffic", "data/t.csv", "--max-graphs", "12")
    assert code == 0, err
    path = repo / "plans/fa3-sizes-t.json"  # not the spec's own plan's name: it is another plan
    assert out.startswith("plans/fa3-sizes-t.json: 12 captures")
    raw = json.loads(path.read_bytes())
    assert raw["revision"] == 5
    assert raw["inputs"]["traffic"] == "../data/t.csv"  # relative to the plan: the same in every clone
    assert raw["inputs"]["traffic_digest"] == "sha256:" + hashlib.sha256(SKEWED.read_bytes()).hexdigest()
    assert raw["command"] == [
        "planner", "build", "--backend", "fa3", "--sizes", "auto", "--traffic", "../data/t.csv", "--max-graphs", "12"
    ]  # fmt: skip
    (choice,) = raw["predicted"]["sizes"]
    sizes = [w["size"] for w in choice["sizes"]]
    assert len(sizes) == 12 and sizes[-1] == 256 and sorted(raw["phases"][0]["sizes"]) == sizes
    assert sum(w["steps"] for w in choice["sizes"]) == choice["steps"] == 10951
    # `planner check` from the folder above and from elsewhere, and in another clone
    for cwd in (repo, tmp_path, repo / "plans"):
        monkeypatch.chdir(cwd)
        code, out, err = cli("check", str(path))
        assert code == 0 and out.endswith("up to date\n"), err
    clone = tmp_path / "clone"
    shutil.copytree(repo, clone)
    monkeypatch.chdir(tmp_path)
    assert cli("check", "clone/plans")[0] == 0
    # the traffic is part of the plan: other counts are a stale plan, named by what changed
    (clone / "data/t.csv").write_text(SKEWED.read_text().replace("\n3,1333\n", "\n3,2333\n"))
    code, _, err = cli("check", "clone/plans")
    assert code == 1 and "plan is stale" in err and "traffic: ../data/t.csv (4c07d02f83c7 -> " in err
    assert path.read_bytes() == (repo / "plans/fa3-sizes-t.json").read_bytes()  # a check writes nothing


def test_the_chosen_list_beats_sglangs_default_on_padding_at_no_more_device_memory(cli, tmp_path):
    """The issue's target, on the plan: for the skewed traffic (most steps at small odd sizes, a
    tail to 256) the chosen list pads less than SGLang's default 36 sizes, and the calibrated
    device total is no larger."""
    code, _, err = cli(
        "build", "-b", "fa3", "--ci", "--calibration", str(CALIBRATION), "--sizes", "auto", "--traffic", str(SKEWED),
        "-o", "p.json",
    )  # fmt: skip
    assert code == 0, err
    plan = _plan(tmp_path / "p.json")
    (choice,) = plan.predicted.sizes
    sglang = next(a for a in choice.against if a.label == "SGLang default")
    assert len(sglang.sizes) == 36 and len(choice.sizes) <= 36
    assert choice.padding < sglang.padding / 2
    assert choice.device_bytes is not None and sglang.device_bytes is not None
    assert choice.device_bytes <= sglang.device_bytes
    assert plan.predicted.device is not None and plan.predicted.device.total_bytes == choice.device_bytes
    assert choice.approximate and choice.step_time.startswith("roofline of NVIDIA H200")


def test_explain_and_diff_say_why_each_size_is_in(cli, tmp_path):
    base = ["build", "-b", "fa3", "--sizes", "auto", "--traffic", str(SKEWED)]
    assert cli(*base, "--max-graphs", "8", "-o", "a.json")[0] == 0
    assert cli(*base, "--max-graphs", "10", "-o", "b.json")[0] == 0
    a = _plan(tmp_path / "a.json")
    (choice,) = a.predicted.sizes
    code, text, _ = cli("explain", "a.json")
    assert code == 0
    assert "- [decode] sizes-auto: 8 sizes: " in text and "; SGLang default (36 sizes): padding ~" in text
    for w in choice.sizes:  # one decision per size: the steps that run its graph, padding saved, memory added
        assert f"- [decode] sizes-auto {w.size}: capture {w.size}" in text
    assert sum("of graph memory" in line for line in text.splitlines()) == 8
    assert "the largest size the engine schedules: always captured" in text
    first = choice.sizes[0]
    assert first.padding_saved is not None and first.padding_saved > 0
    assert f"{first.steps:,.6g} steps" in text
    code, text, _ = cli("diff", "a.json", "b.json")
    assert code == 0
    assert "sizes-auto: 8 sizes" in text and "sizes-auto: 10 sizes" in text
    assert "without it they run the graph of" in text  # a size that came in, with why


def test_the_largest_size_the_engine_schedules_is_always_captured(cli, tmp_path):
    base = ["build", "-b", "fa3", "--sizes", "auto", "--traffic", str(SKEWED)]
    assert cli(*base, "--max-graphs", "1", "-o", "one.json")[0] == 0
    assert _plan(tmp_path / "one.json").phases[0].sizes == [256]
    assert cli(*base, "--max-size", "300", "--max-graphs", "4", "-o", "top.json")[0] == 0
    plan = _plan(tmp_path / "top.json")
    assert max(plan.phases[0].sizes) == 300 and len(plan.phases[0].sizes) == 4
    (choice,) = plan.predicted.sizes
    assert choice.sizes[-1].size == 300 and choice.sizes[-1].padding_saved is None
    assert all(w.padding_saved is not None for w in choice.sizes[:-1])


def test_speculative_phases_choose_per_phase(cli, tmp_path):
    traffic = tmp_path / "eagle.json"
    traffic.write_text(
        json.dumps(
            {
                "decode": {str(n): 400 // n for n in range(1, 33)},
                "target_verify": {str(n): 1 + 200 // (n * n) for n in range(1, 33, 3)},
            }
        )
    )
    code, _, err = cli(
        "build", "-b", "fa3", "--speculative", "eagle", "--max-bs", "32", "--sizes", "auto", "--traffic",
        str(traffic), "--max-graphs", "6", "-o", "e.json",
    )  # fmt: skip
    assert code == 0, err
    plan = _plan(tmp_path / "e.json")
    chosen = {c.phase: [w.size for w in c.sizes] for c in plan.predicted.sizes}
    assert set(chosen) == {"decode", "target_verify"}
    by_name = {p.name: sorted(p.sizes) for p in plan.phases}
    for name, sizes in chosen.items():
        assert by_name[name] == sizes and len(sizes) == 6 and sizes[-1] == 32
    assert chosen["decode"] != chosen["target_verify"]  # each phase for its own traffic
    assert len(by_name["draft_decode"]) == 20  # a phase the traffic does not name keeps the spec's sizes


def test_a_bucketed_histogram_is_spread_and_the_plan_says_so(cli, tmp_path):
    code, _, err = cli(
        "build", "-b", "fa3", "--preset", "vllm", "--sizes", "auto", "--traffic", str(SCRAPE), "--phase", "piecewise",
        "--max-graphs", "16", "-o", "v.json",
    )  # fmt: skip
    assert code == 0, err
    code, text, _ = cli("explain", "v.json")
    assert "each bucket's steps spread evenly over its sizes" in text
    plan = _plan(tmp_path / "v.json")
    (choice,) = plan.predicted.sizes
    assert choice.phase == "piecewise" and choice.notes and "approximate within a bucket" in choice.notes[0]


def test_the_record_and_the_command_read_back_alike(tmp_path):
    """Every size-choice option round-trips through the plan's record and its command text."""
    from capture_plan.planner.inputs.build_options import build_record, normalized_command

    opts = BuildOptions(
        backend="fa3",
        device="NVIDIA H200",  # a build input since issue 52 (build --device without --sizes auto)
        sizes=every_size_choice(tmp_path),
        output=tmp_path / "plans/p.json",
    )
    plan_path = tmp_path / "plans/p.json"
    assert options_from_record(build_record(opts), plan_path) == opts
    assert options_from_command(normalized_command(opts), plan_path) == opts
    assert "--budget-mib 300.5" in " ".join(normalized_command(opts))
    whole = BuildOptions(backend="fa3", sizes=SizeChoiceOptions(traffic=tmp_path / "t.csv", budget_mib=300.0))
    assert "--budget-mib 300 " in " ".join(normalized_command(whole)) + " "


# every bad input: (traffic file text or None for the skewed one, extra args, what the line says)
BAD = {
    "beyond the largest size": (None, ["--max-size", "128"], ["reaches size 256", "--max-size 256"]),
    "negative count": ("size,count\n1,5\n3,-2\n", [], ["t.csv:3", "count '-2'"]),
    "fractional count": ("size,count\n1,5\n3,2.5\n", [], ["t.csv:3", "count '2.5'"]),
    "empty CSV": ("size,count\n", [], ["lists no batch sizes"]),
    "empty histogram": ("ZERO", [], ["no steps"]),
    "scrape without the metric": ("SCRAPE", ["--metric", "vllm:nope"], ["no histogram vllm:nope"]),
    "budget no list meets": (None, ["--budget-mib", "10"], ["--budget-mib", "no list fits", "--budget-mib 252"]),
    "padding no list meets": (None, ["--max-graphs", "4", "--max-padding", "0.001"], ["pads at most 0.001%"]),
}


def _traffic(tmp_path: Path, text: str | None) -> Path:
    path = tmp_path / "t.csv"
    if text is None:
        path.write_bytes(SKEWED.read_bytes())
    elif text == "SCRAPE":
        path = tmp_path / "t.prom"
        path.write_bytes(SCRAPE.read_bytes())
    elif text == "ZERO":
        path = tmp_path / "t.prom"
        lines = [
            line.rpartition(" ")[0] + " 0" if line.startswith("vllm:iteration_tokens_total") else line
            for line in SCRAPE.read_text().splitlines()
        ]
        path.write_text("\n".join(lines) + "\n")
    else:
        path.write_text(text)
    return path


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_one_located_line_with_a_command_and_writes_nothing(cli, tmp_path, name):
    text, args, needles = BAD[name]
    traffic = _traffic(tmp_path, text)
    before = sorted(p.name for p in tmp_path.iterdir())
    line = one_line_error(
        cli("build", "-b", "fa3", "--sizes", "auto", "--traffic", traffic.name, *args, "-o", "out.json"), *needles
    )
    assert "; fix: " in line and "`planner build --backend fa3" in line.partition("; fix: ")[2]
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no plan written


@pytest.mark.parametrize(
    "args,needles",
    [
        (["--traffic", "TRAFFIC"], ["--traffic", "with --sizes auto only", "--sizes auto --traffic"]),
        (["--max-graphs", "8"], ["--max-graphs chooses sizes", "`planner build --backend fa3`"]),
        (["--sizes", "auto"], ["--sizes auto", "none is given", "`planner build --backend fa3`"]),
    ],
)
def test_size_choice_options_come_together(cli, tmp_path, args, needles):
    traffic = _traffic(tmp_path, None)
    args = [traffic.name if a == "TRAFFIC" else a for a in args]
    one_line_error(cli("build", "-b", "fa3", *args), *needles)
    assert not (tmp_path / "plans").exists()


def test_a_spec_budget_no_list_meets_is_located_in_the_spec(cli, tmp_path):
    """The spec's own budget_mib is the spec's to raise: the line names it, not a --budget-mib
    the build was not given (the pipeline would still refuse the spec's budget)."""
    (tmp_path / "b.toml").write_text(
        "budget_mib = 10\n\n[model]\nlayers = 2\nhidden = 1024\nheads = 8\nkv_heads = 2\nhead_dim = 128\n"
        'intermediate = 2048\nvocab = 32000\n\n[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 8, 32]\n'
    )
    (tmp_path / "t.csv").write_text("1,50\n3,20\n9,5\n30,1\n")
    line = one_line_error(
        cli("build", "-b", "fa3", "--spec", "b.toml", "--sizes", "auto", "--traffic", "t.csv", "-o", "p.json"),
        "b.toml: $.budget_mib: phase 'decode': no list fits the budget of 10 MiB",
        "fix: raise the budget to at least",
    )
    assert "--budget-mib" not in line and not (tmp_path / "p.json").exists()


@pytest.mark.parametrize(
    "option, says",
    [
        (("--budget-mib", "0"), "--budget-mib: must be more than 0 MiB, got 0"),
        (("--max-graphs", "0"), "--max-graphs 0: must be 1 or more, got 0"),
        (("--max-padding", "-1"), "--max-padding: must be a percentage from 0 to below 1e6, got -1"),
        (
            ("--context", "0"),
            "--context 0: must be 1..16,777,216, the planner's bound (no model config names one), got 0",
        ),
        # issue 40, item 3: the limit broken is the upper one (or the number is none)
        (("--budget-mib", "1e30"), "must be below 2**30 MiB (1 PiB, more than any device holds), got 1e+30"),
        (("--budget-mib", "1e15"), "must be below 2**30 MiB"),
        (("--budget-mib", "inf"), "must be a finite number of MiB, got inf"),
        (("--budget-mib", "nan"), "must be a finite number of MiB, got nan"),
    ],
)
def test_an_option_out_of_range_names_its_range_and_a_fix_never_none(cli, tmp_path, option, says):
    """Issue 40, items 2 and 3: was `...got 0; fix: None; or capture the spec's sizes: ...`, and
    `--budget-mib 1e30` said `must be more than 0 MiB`. The fix is the build without the option."""
    shutil.copy(SKEWED, tmp_path / "t.csv")
    err = one_line_error(
        cli("build", "-b", "fa3", "--ci", "--sizes", "auto", "--traffic", "t.csv", "-o", "z.json", *option),
        says,
        "fix: give",
        "or leave it out: `planner build --backend fa3 --ci --sizes auto --traffic t.csv -o z.json`",
    )
    assert "None" not in err
    sizes = cli("sizes", "-b", "fa3", "--ci", "--traffic", "t.csv", *option)
    assert "None" not in one_line_error(sizes, says, "; fix: give")


@pytest.mark.parametrize("command", ["build", "sizes"])
def test_the_pipelines_errors_of_the_chosen_lists_name_the_users_spec(cli, tmp_path, command):
    """A spec budget below the floor, met while the chosen lists are built (--budget-mib lets the
    choice pass): the line names the user's spec, not a temporary copy of it (it named
    /tmp/capture-plan-sizes-*/spec.toml when the lists were built through a spec file)."""
    (tmp_path / "b.toml").write_text(
        "budget_mib = 10\n\n[model]\nlayers = 2\nhidden = 1024\nheads = 8\nkv_heads = 2\nhead_dim = 128\n"
        'intermediate = 2048\nvocab = 32000\n\n[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 8, 32]\n'
    )
    (tmp_path / "t.csv").write_text("1,50\n3,20\n9,5\n30,1\n")
    args = ["-b", "fa3", "--spec", "b.toml", "--traffic", "t.csv", "--budget-mib", "200"]
    args += ["--sizes", "auto", "-o", "p.json"] if command == "build" else []
    line = one_line_error(
        cli(command, *args),
        "b.toml: $.budget_mib: budget_mib 10 is below the floor",
        "fix: raise budget_mib to at least",
    )
    assert line.startswith("planner: error: b.toml: $.budget_mib: ") and not (tmp_path / "p.json").exists()


def _counted(monkeypatch) -> dict[str, int]:
    """Counters of the spec parsed and validated (every spec, a file's or the embedded one,
    passes validate._check_rules once per parse) and of the pipeline's runs (pipeline.plan)
    and assembled plans (pipeline._assemble)."""
    from capture_plan.planner.inputs import validate
    from capture_plan.planner.schedule import pipeline

    counts = {"spec parsed": 0, "pipeline runs": 0, "plans assembled": 0}

    def counting(module, name, key):
        real = getattr(module, name)

        def wrapper(*a, **kw):
            counts[key] += 1
            return real(*a, **kw)

        monkeypatch.setattr(module, name, wrapper)

    counting(validate, "_check_rules", "spec parsed")
    counting(pipeline, "plan", "pipeline runs")
    counting(pipeline, "_assemble", "plans assembled")
    return counts


@pytest.mark.parametrize("spec_file", [False, True])
def test_a_size_choice_parses_the_spec_once_and_runs_the_pipeline_once(tmp_path, monkeypatch, spec_file):
    """``build --sizes auto`` resolves the build once and prices every list on it in memory (no
    spec written to a file and read back); the pipeline runs once, for the plan it returns, and
    the plan is the one a build of the chosen sizes gives."""
    from capture_plan.planner import build_plan, plan_bytes
    from capture_plan.planner.inputs.spec_toml import spec_toml
    from capture_plan.planner.inputs.specs import default_spec

    spec = None
    if spec_file:
        spec = tmp_path / "s.toml"
        spec.write_text(spec_toml(default_spec()))
    counts = _counted(monkeypatch)
    opts = BuildOptions(
        backend="fa3", spec=spec, sizes=SizeChoiceOptions(traffic=SKEWED, max_graphs=6), output=tmp_path / "p.json"
    )
    plan = build_plan(opts)
    assert counts == {"spec parsed": 1, "pipeline runs": 1, "plans assembled": 1}
    assert len(plan.phases[0].sizes) == 6 and plan.predicted.sizes
    # `planner sizes` likewise: one parse, one plan (of the chosen lists)
    from capture_plan.planner.sizes.command import choose_sizes
    from capture_plan.planner.sizes.sizes import SizesOptions

    counts.update({k: 0 for k in counts})
    choice = SizeChoiceOptions(traffic=SKEWED, max_graphs=6)
    res = choose_sizes(SizesOptions(build=BuildOptions(backend="fa3", spec=spec), choice=choice))
    assert counts == {"spec parsed": 1, "pipeline runs": 1, "plans assembled": 1}
    assert res.plan.predicted.pool_bytes == plan.predicted.pool_bytes
    assert plan_bytes(plan) == plan_bytes(build_plan(opts))  # the same bytes built again
