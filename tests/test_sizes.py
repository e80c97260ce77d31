"""``planner sizes``: traffic in (CSV, JSON, a Prometheus histogram), step time per size (measured
replays, a roofline), the best list of each count (exact), memory per list, the chosen list, the
spec it writes, and every bad input as one located line."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings, strategies as st

from capture_plan.planner.build import BuildOptions
from capture_plan.planner.inputs.build_options import SizeChoiceOptions
from capture_plan.planner.sizes.size_front import best_lists, candidates, expected
from capture_plan.planner.sizes.traffic import read_traffic
from capture_plan.schemas.codec import canonical_bytes, decode_report
from capture_plan.schemas.report import CaptureReport, StepMeasurement
from cli_inputs import one_line_error
from reports import capture_report

DATA = Path(__file__).parent / "data"
SKEWED = DATA / "traffic-skewed.csv"
SCRAPE = DATA / "vllm-metrics.prom"
MiB = 2**20
# a small decode model: the memory of every list simulates fast
SMALL_SPEC = (
    "[model]\nlayers = 2\nhidden = 1024\nheads = 8\nkv_heads = 2\nhead_dim = 128\nintermediate = 2048\n"
    'vocab = 32000\n\n[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 2, 4, 8, 16, 24, 32]\n'
)


def _parse(text: str, *, phases=None, default=None, top=None, source="t.csv"):
    phases = phases or {"decode": 1}
    choice = SizeChoiceOptions(traffic=Path(source), traffic_phases=tuple(default or ()))
    return read_traffic(choice, phases, top or {p: 256 for p in phases}, text.encode())


# -- traffic in -----------------------------------------------------------------------------------


def test_the_traffic_forms_read_alike():
    want = {"decode": {1: 5.0, 3: 2.0, 9: 7.0}}
    forms = [
        "size,count\n1,5\n3,2\n9,7\n",
        "# steps per batch size\n1,5\n\n3,2\n9,7\n",
        "phase,size,count\ndecode,1,5\ndecode,3,2\ndecode,9,7\n",
        json.dumps({"decode": {"1": 5, "3": 2, "9": 7}}),
        "size,count\n1,5\n3,2\n9,7\n12,0\n",  # a size with no steps adds nothing
        # issue 40, item 8: a spreadsheet's tab-separated export (was read as a Prometheus scrape
        # without the histogram) and its header's case (Size,Count was refused)
        "size\tcount\n1\t5\n3\t2\n9\t7\n",
        "1\t5\n3\t2\n9\t7\n",
        "phase\tsize\tcount\ndecode\t1\t5\ndecode\t3\t2\ndecode\t9\t7\n",
        "Size,Count\n1,5\n3,2\n9,7\n",
        "PHASE,Size,COUNT\ndecode,1,5\ndecode,3,2\ndecode,9,7\n",
    ]
    for text in forms:
        tr = _parse(text)
        assert tr.phases == want, text
        assert not tr.notes


def test_a_serving_logs_export_reads_as_its_counts():
    """Issue 49, item 9: a size on several lines, a one-column per-step log, a ``count,size``
    header and ``;`` separators were refused (each fails before)."""
    want = {"decode": {1: 5.0, 3: 2.0, 9: 7.0}}
    forms = [
        "size,count\n1,2\n3,2\n9,7\n1,3\n",  # a size listed twice: its steps added
        "1\n9\n3\n1\n9\n1\n9\n9\n1\n9\n3\n9\n1\n9\n",  # one size a line: each line a step
        "size\n" + "1\n" * 5 + "3\n" * 2 + "9\n" * 7,  # the same with its header
        "count,size\n5,1\n2,3\n7,9\n",  # the columns named, in the other order
        "Count;Size\n5;1\n2;3\n7;9\n",
        "size;count\n1;5\n3;2\n9;7\n",  # ;-separated (a comma-decimal locale's spreadsheet)
        "1;5\n3;2\n9;7\n",
        "# phase first or last\nsize;count;phase\n1;5;decode\n3;2;decode\n9;4;decode\n9;3;decode\n",
        "phase,size\ndecode,1\ndecode,1\ndecode,1\ndecode,1\ndecode,1\ndecode,3\ndecode,3\n"
        + "decode,9\n" * 7,  # a per-step log of a named phase
    ]
    for text in forms:
        tr = _parse(text)
        assert tr.phases == want, text
        assert tr.form == "csv" and not tr.notes


def test_traffic_without_phase_names_goes_to_the_phases_asked():
    tr = _parse("1,4\n2,1\n", phases={"target_verify": 4, "draft_decode": 1}, default=["draft_decode"])
    assert tr.phases == {"draft_decode": {1: 4.0, 2: 1.0}}


def test_a_histogram_spreads_each_bucket_over_its_sizes_and_says_so():
    tr = read_traffic(
        SizeChoiceOptions(traffic=SCRAPE, traffic_phases=("piecewise",)), {"piecewise": 1}, {"piecewise": 512}
    )
    sizes = tr.phases["piecewise"]
    assert tr.form == "prometheus"
    # both engines' series added: le=1 holds 120 + 80 steps; (1, 8] 1400 + 800 over 7 sizes
    assert sizes[1] == 200
    assert sizes[2] == sizes[8] == pytest.approx(2200 / 7)
    assert sum(sizes.values()) == pytest.approx(3456 + 2400)
    assert max(sizes) == 512 and 513 not in sizes
    assert len(tr.notes) == 1 and "spread evenly" in tr.notes[0] and "custom_histogram_buckets" in tr.notes[0]


def test_single_size_buckets_are_exact_and_a_histogram_counts_tokens():
    text = (
        "# TYPE vllm:iteration_tokens_total histogram\n"
        + "".join(
            f'vllm:iteration_tokens_total_bucket{{le="{b}.0"}} {c}\n' for b, c in [(1, 0), (2, 0), (3, 0), (4, 0)]
        )
        + "".join(
            f'vllm:iteration_tokens_total_bucket{{le="{b}.0"}} {c}\n' for b, c in [(5, 3), (6, 3), (7, 3), (8, 9)]
        )
        + 'vllm:iteration_tokens_total_bucket{le="+Inf"} 9\n'
    )
    tr = _parse(text, phases={"target_verify": 4}, top={"target_verify": 2})
    assert not tr.notes  # every bucket one size: nothing spread
    # 5 tokens are 2 requests of 4 tokens (ceil), 8 tokens 2 requests
    assert tr.phases == {"target_verify": {2: 9.0}}


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("size,count\n1,5\n2,3,4\n", ["t.csv:3", "expected 2 columns, got 3"]),
        ("size,count\n1,-5\n", ["t.csv:2", "not a whole number of steps"]),
        ("size,count\n1,2.5\n", ["t.csv:2", "not a whole number of steps"]),
        ("size,count\n0,2\n", ["t.csv:2", "out of range"]),
        ("sizes,counts\n1,2\n", ["t.csv:1", "expected a header"]),
        ("count,size\n2\n", ["t.csv:2", "expected 2 columns, got 1", "write count,size on every line"]),
        ("size,size\n1,2\n", ["t.csv:1", "expected a header naming size"]),
        ("count\n1\n", ["t.csv:1", "expected a header naming size"]),
        ("1,2,3,4\n", ["t.csv:1", "expected 1 to 3 columns, got 4"]),
        ("size,count\n1,0\n2,0\n", ["has no steps"]),
        ("", ["t.csv: the traffic lists no batch sizes (the file is empty"]),  # issue 40: was "every count is 0"
        ("size,count\n# none yet\n", ["the traffic lists no batch sizes"]),
        # issue 40, item 8: other scripts' digits, which int() and float() take
        ("size,count\n1,\uff15\n", ["t.csv:2", "count '\uff15' is not a number in ASCII digits"]),
        ("size,count\n\uff11,5\n", ["t.csv:2", "size '\uff11' is not a number in ASCII digits"]),
        ("size,count\n1,1_000\n", ["t.csv:2", "not a number in ASCII digits"]),
        # what int() and float() refuse (planner/sizes/traffic.py's _parsed)
        ("size,count\n1.5,2\n", ["t.csv:2", "size '1.5' is not a whole number; fix: give batch sizes as 1, 2"]),
        ("size,count\n1,x\n", ["t.csv:2", "count 'x' is not a number; fix: give the number of steps"]),
        (
            'vllm:iteration_tokens_total_bucket{le="abc"} 5\n',
            ["t.csv:1", "bucket bound le='abc' is not a number; fix: give the whole scrape"],
        ),
        ('{"decode": {"\uff11": 1}}', ["not a number in ASCII digits"]),
        ("size,count\n300,1\n", ["reaches size 300", "above the engine's largest size 256", "--max-size 300"]),
        ("phase,size,count\nverify,1,1\n", ["phase 'verify' is not in the spec"]),
        ('{"decode": {"1": 1.5}}', ["$.decode['1']", "not a whole number"]),
        ('{"decode": [1, 2]}', ["not a traffic document"]),
        ('{"decode": ', ["not valid JSON"]),
        ("# HELP x y\nvllm:num_requests_running 3\n", ["no histogram vllm:iteration_tokens_total"]),
        (
            '# TYPE vllm:iteration_tokens_total histogram\nvllm:iteration_tokens_total_bucket{le="1.0"} 5\n'
            'vllm:iteration_tokens_total_bucket{le="8.0"} 3\n',
            ["t.csv:3", "fewer than the bucket before it"],
        ),
        (
            'vllm:iteration_tokens_total_bucket{le="256.0"} 5\nvllm:iteration_tokens_total_bucket{le="+Inf"} 7\n',
            ["t.csv:2", "2 step(s) lie above 256 tokens", "--max-size"],
        ),
    ],
)
def test_bad_traffic_is_one_located_line(text, needles):
    from capture_plan.schemas.errors import InputError

    with pytest.raises(InputError) as err:
        _parse(text)
    message = str(err.value)
    assert "\n" not in message and "fix:" in message
    for needle in needles:
        assert needle in message, message


# -- the best list of each count --------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    st.dictionaries(st.integers(1, 12), st.integers(0, 50), min_size=1, max_size=8),
    st.integers(0, 3),
    st.sampled_from(["flat", "steps", "kv"]),
)
def test_the_program_finds_the_cheapest_list_of_every_count(weights, extra, shape):
    traffic = {n: float(w) for n, w in weights.items() if w}
    if not traffic:
        return
    top = max(traffic) + extra
    costs = {
        "flat": lambda n, s: 1.0 + 0.1 * s,
        "steps": lambda n, s: 1.0 + (s > 4) + 3 * (s > 9),  # a tile boundary: flat, then a jump
        "kv": lambda n, s: 1.0 + 0.3 * n + 0.05 * s,  # the real rows cost more than the padded ones
    }
    cost = costs[shape]
    cands, _ = candidates(traffic, top)
    best = best_lists(traffic, cands, cost, len(cands))
    for k, b in best.items():
        assert len(b.sizes) == k and b.sizes[-1] == top and list(b.sizes) == sorted(set(b.sizes))
        brute = min(
            expected(traffic, tuple(sorted((*rest, top))), cost)
            for rest in itertools.combinations([c for c in cands if c != top], k - 1)
        )
        assert b.seconds == pytest.approx(brute, rel=1e-12)
        assert expected(traffic, b.sizes, cost) == pytest.approx(b.seconds, rel=1e-12)


# -- the front and the chosen list --------------------------------------------------------------------


def _choose(**kw):
    from capture_plan.planner.sizes.command import choose_sizes
    from capture_plan.planner.sizes.sizes import SizesOptions

    build = kw.pop("build", BuildOptions(backend="fa3", ci=True))
    shown = {k: kw.pop(k) for k in ("upto", "every") if k in kw}
    return choose_sizes(SizesOptions(build=build, choice=SizeChoiceOptions(**kw), **shown))


@pytest.fixture(scope="module")
def skewed():
    """The front of the skewed traffic for the embedded spec (SGLang's 36 sizes), built once."""
    return _choose(traffic=SKEWED)


def test_the_chosen_list_beats_sglangs_default_at_no_more_memory(skewed):
    """The issue's target: for a skewed traffic (most steps at small odd sizes, a tail to 256) the
    chosen 36 sizes pad less than SGLang's default 36 at equal or lower graph memory."""
    (ph,) = skewed.phases
    sglang = next(r for r in ph.defaults if r.label == "SGLang default")
    assert len(sglang.sizes) == 36 and ph.current.sizes == sglang.sizes  # the embedded spec is SGLang's list
    chosen = ph.chosen
    assert len(chosen.sizes) == 36
    assert chosen.padding < sglang.padding / 2
    assert chosen.pool_bytes <= sglang.pool_bytes
    # the chosen list's figures are the plan built with it
    assert skewed.plan.predicted.pool_bytes == chosen.pool_bytes
    assert [p.sizes for p in skewed.plan.phases] == [sorted(chosen.sizes, reverse=True)]
    assert chosen.approximate and "roofline" in ph.time_source and "approximate" in ph.time_source


def test_every_list_covers_the_largest_size_and_padding_falls_with_more_sizes(skewed):
    (ph,) = skewed.phases
    assert all(r.sizes[-1] == 256 for r in [*ph.front, *ph.defaults, ph.chosen])
    paddings = [r.padding for r in ph.front]
    assert paddings == sorted(paddings, reverse=True) and paddings[0] > 10 * paddings[-1]
    assert [len(r.sizes) for r in ph.front][:4] == [1, 2, 3, 4]


def test_the_table_names_every_figures_provenance(skewed):
    from capture_plan.planner.sizes.output import render

    text = render(skewed)
    assert "graph memory: simulated (analytic model, native allocator)" in text
    assert "device total: unknown" in text
    assert "roofline of NVIDIA H200" in text and "~: approximate" in text
    line = next(x for x in text.splitlines() if x.strip().startswith("against SGLang default (36 sizes)"))
    assert "x less" in line and "pool 258.0 vs 258.0 MiB" in line


def test_a_calibration_gives_the_device_total_and_the_budget_applies_to_it():
    root = Path(__file__).parent.parent
    cal = root / "plans/calibration/h200-fa3-ci.json"
    res = _choose(build=BuildOptions(backend="fa3", ci=True, calibration=cal), traffic=SKEWED, budget_mib=330, upto=40)
    (ph,) = res.phases
    assert all(r.device_bytes is not None for r in ph.front)
    assert ph.chosen.device_bytes <= 330 * MiB < next(r for r in ph.front if len(r.sizes) == 36).device_bytes
    assert res.plan.predicted.device.total_bytes == ph.chosen.device_bytes
    # the calibration report's capture seconds, measured per size
    assert ph.front[0].capture_seconds is not None and not ph.front[0].capture_approximate


def test_max_padding_takes_the_fewest_sizes_and_max_size_is_always_captured(tmp_path):
    spec = tmp_path / "small.toml"
    spec.write_text(SMALL_SPEC)
    traffic = tmp_path / "t.csv"
    traffic.write_text("".join(f"{n},{100 // n}\n" for n in range(1, 33)) + "40,3\n")
    res = _choose(build=BuildOptions(backend="fa3", spec=spec), traffic=traffic, max_size=48, max_padding=1.0)
    (ph,) = res.phases
    chosen = ph.chosen
    assert chosen.sizes[-1] == 48 and chosen.padding <= 1.0
    fewer = next(r for r in ph.front if len(r.sizes) == len(chosen.sizes) - 1) if len(chosen.sizes) > 1 else None
    assert fewer is None or fewer.padding > 1.0


def _report(times: dict[int, float], phase="decode") -> CaptureReport:
    steps = [
        StepMeasurement(
            step=i,
            id=f"capture/{phase}/{bs}",
            reserved=0,
            predicted_reserved=0,
            seconds=0.01 * bs,
            replay_seconds=t,
        )
        for i, (bs, t) in enumerate(sorted(times.items(), reverse=True))
    ]
    return capture_report(None, steps, torch="2.13", backend_module="m")


def test_measured_replay_times_choose_the_sizes_before_each_jump(tmp_path):
    """Replay time that jumps above 16 and above 32 (tile boundaries): two sizes go to 16 and 32."""
    spec = tmp_path / "small.toml"
    spec.write_text(SMALL_SPEC)
    times = {1: 1e-3, 8: 1e-3, 16: 1e-3, 17: 2e-3, 24: 2e-3, 32: 2e-3, 33: 3e-3}
    report = tmp_path / "timed.json"
    report.write_bytes(canonical_bytes(_report(times)))
    traffic = tmp_path / "t.csv"
    traffic.write_text("".join(f"{n},10\n" for n in range(1, 33)))
    res = _choose(build=BuildOptions(backend="fa3", spec=spec), traffic=traffic, timing=report, max_graphs=2)
    (ph,) = res.phases
    assert ph.chosen.sizes == (16, 32)
    assert ph.time_source.startswith(f"{report} (NVIDIA H200 sm90): 7 sizes replayed")
    assert ph.chosen.padding == pytest.approx(0.0, abs=1e-9)  # 1..16 cost as 16, 17..32 as 32: no step pays for padding
    assert ph.chosen.approximate  # the traffic's own sizes between the measured ones are interpolated
    assert ph.chosen.capture_seconds == pytest.approx(0.16 + 0.32)


def test_a_report_without_replay_times_is_refused(cli, tmp_path):
    report = tmp_path / "plain.json"
    report.write_bytes(canonical_bytes(msgspec.structs.replace(_report({1: 1e-3, 2: 1e-3}), steps=[])))
    one_line_error(
        cli("sizes", "-b", "fa3", "--traffic", str(SKEWED), "--timing", str(report)),
        "times 0 size(s) of phase 'decode'",
        "time_replays",
    )


def test_replay_seconds_are_left_out_of_reports_without_them():
    rep = _report({1: 1e-3})
    plain = msgspec.structs.replace(rep, steps=[msgspec.structs.replace(rep.steps[0], replay_seconds=msgspec.UNSET)])
    assert b"replay_seconds" not in canonical_bytes(plain)  # reports written before keep their bytes
    again = decode_report(canonical_bytes(rep), "r.json")
    assert again.steps[0].replay_seconds == 1e-3


# -- the CLI ------------------------------------------------------------------------------------------


def test_cli_writes_a_spec_that_builds_the_chosen_plan_from_anywhere(cli, tmp_path):
    (tmp_path / "out").mkdir()
    code, out, err = cli(
        "sizes", "-b", "fa3", "--traffic", str(SKEWED), "--max-graphs", "12", "--write-spec", "out/c.toml"
    )
    assert code == 0, err
    assert "chosen: 12 sizes (the least padding within --max-graphs 12)" in out
    assert "wrote out/c.toml; build its plan with `planner build --backend fa3 --spec out/c.toml`" in out
    text = (tmp_path / "out/c.toml").read_text()
    digest = "sha256:" + __import__("hashlib").sha256(SKEWED.read_bytes()).hexdigest()
    assert digest in text and "decode: 12 sizes, padding ~" in text
    code, out, err = cli("build", "-b", "fa3", "--spec", "out/c.toml", "-o", "out/c.json")
    assert code == 0, err
    plan = json.loads((tmp_path / "out/c.json").read_text())
    assert len(plan["phases"][0]["sizes"]) == 12 and plan["phases"][0]["sizes"][0] == 256
    assert cli("check", "out/c.json")[0] == 0
    # the same spec, byte for byte, written from another directory
    import os

    os.chdir(tmp_path / "out")
    code, out, err = cli(
        "sizes", "-b", "fa3", "--traffic", str(SKEWED), "--max-graphs", "12", "--write-spec", "again.toml"
    )
    assert code == 0, err
    assert (tmp_path / "out/again.toml").read_bytes() == text.encode()


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--budget-mib", "100"], ["--budget-mib", "no list fits the budget of 100 MiB", "252.0 MiB"]),
        (["--max-padding", "0.001%", "--max-graphs", "4"], ["--max-padding 0.001", "no list of at most 4 sizes"]),
        (["--max-padding", "lots"], ["--max-padding", "not a percentage"]),
        (["--device", "NVIDIA Z9"], ["--device", "unknown device 'NVIDIA Z9'", "NVIDIA H200"]),
        (["--device", "NVIDIA L40S"], ["--device", "'NVIDIA L40S' has no roofline figures", "NVIDIA H200"]),
        # found by the issue 49 fuzz run: an empty --device priced the default H200
        (["--device", ""], ["--device", "no device named (--device '' has no letters", "NVIDIA H100 80GB HBM3"]),
        (["--metric", ""], ["--metric ''", "names no histogram"]),
        (["--phase", "verify"], ["--phase verify", "unknown phase 'verify'"]),
        (["--max-size", "0"], ["--max-size", "must be 1.."]),
        (["--max-graphs", "0"], ["--max-graphs 0", "must be 1 or more"]),
        (["--write-spec", "TRAFFIC"], ["--write-spec", "the output is the traffic file"]),
    ],
)
def test_cli_refuses_with_one_located_line(cli, tmp_path, args, needles):
    traffic = tmp_path / "t.csv"
    traffic.write_bytes(SKEWED.read_bytes())
    args = [str(traffic) if a == "TRAFFIC" else a for a in args]
    one_line_error(cli("sizes", "-b", "fa3", "--traffic", str(traffic), *args), *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.csv"]  # nothing written


def test_cli_reads_a_prometheus_scrape_for_vllms_phases(cli):
    code, out, err = cli("sizes", "-b", "fa3", "--preset", "vllm", "--traffic", str(SCRAPE), "--phase", "piecewise")
    assert code == 0, err
    assert "piecewise 5,856 steps at sizes 1..512" in out and "note: vllm:iteration_tokens_total: 2 series" in out
    assert "\nfull_decode:" not in out  # the histogram was given to piecewise alone
    assert "vLLM default" in out and "chosen: 51 sizes" in out


_PIECES = st.sampled_from(
    ["size,count", "phase,size,count", "count;size", "size", ";",
     "decode,", "1", "9", "-3", "2.5", "1e3", ",", "\n", " ", "#", "{", "}", '"',
     ":", "[", "]", "le=", 'x_bucket{le="4.0"} 3', "vllm:iteration_tokens_total_bucket", '{le="+Inf"}', "nan", "\xff"]
)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(st.lists(_PIECES, max_size=30).map("".join))
def test_any_traffic_text_reads_or_is_one_located_line(text):
    from capture_plan.schemas.errors import InputError

    try:
        tr = _parse(text)
    except InputError as err:
        assert "\n" not in str(err)
        return
    assert tr.phases and all(w > 0 and 1 <= s <= 256 for sizes in tr.phases.values() for s, w in sizes.items())


def test_cli_plots_the_front_and_never_over_another_file(cli, tmp_path):
    pytest.importorskip("matplotlib")
    from capture_plan.planner.report.plot import PNG_MAGIC

    spec = tmp_path / "small.toml"
    spec.write_text(SMALL_SPEC)
    (tmp_path / "t.csv").write_text("size,count\n1,9\n3,5\n7,2\n30,1\n")
    code, out, err = cli("sizes", "-b", "fa3", "--spec", str(spec), "--traffic", "t.csv", "--plot", "front.png")
    assert code == 0, err
    assert out.endswith("wrote front.png\n") and (tmp_path / "front.png").read_bytes().startswith(PNG_MAGIC)
    one_line_error(
        cli("sizes", "-b", "fa3", "--spec", str(spec), "--traffic", "t.csv", "--plot", "t.csv"),
        "--plot t.csv",
        "not a PNG image",
    )
    assert (tmp_path / "t.csv").read_text().startswith("size,count")


def test_the_written_spec_holds_the_builds_own_options_and_replaces_only_its_own(cli, tmp_path):
    (tmp_path / "other.toml").write_text("# my own spec\n")
    base = ("sizes", "-b", "fa3", "--traffic", str(SKEWED), "--max-graphs", "4", "--tp", "2", "--allocator")
    code, out, err = cli(*base, "expandable", "--write-spec", "s.toml")
    assert code == 0, err
    text = (tmp_path / "s.toml").read_text()
    assert text.startswith("# Capture sizes chosen by `planner sizes`")
    assert "\ntp = 2\n" in text and '\nallocator = "expandable"\n' in text
    assert cli(*base, "expandable", "--write-spec", "s.toml")[0] == 0  # its own spec: replaced
    one_line_error(cli(*base, "native", "--write-spec", "other.toml"), "--write-spec other.toml", "is not a spec")
    assert (tmp_path / "other.toml").read_text() == "# my own spec\n"


def test_a_recorded_trace_prices_every_candidate():
    """Graph memory from a recorded trace: the sizes it lacks are derived (planner/memory/fitting.py)."""
    root = Path(__file__).parent.parent
    res = _choose(build=BuildOptions(backend="fa3", ci=True, trace=root / "plans/traces/fa3-ci.json"), traffic=SKEWED)
    assert "simulated (trace model" in res.memory_source
    (ph,) = res.phases
    assert res.plan.predicted.pool_bytes == ph.chosen.pool_bytes and res.plan.predicted.source == "trace"


def test_graph_keys_are_priced_as_the_plan_captures_them():
    """A phase with variants (SGLang's lora/nolora graphs per size) captures every key of each
    size; outputs kept make the pool grow with each graph, so a list priced without its keys
    would show less than the plan built with it."""
    root = Path(__file__).parent.parent
    build = BuildOptions(backend="fa3", spec=root / "plans/specs/sglang-lora.toml", strategies=("outputs=keep",))
    res = _choose(build=build, traffic=SKEWED, max_graphs=6, upto=8)
    (ph,) = res.phases
    assert len(ph.chosen.sizes) == 6 and sum(s.op == "capture" for s in res.plan.steps) == 12
    assert res.plan.predicted.pool_bytes == ph.chosen.pool_bytes
    sglang = next(r for r in ph.defaults if r.label == "SGLang default")
    assert sglang.pool_bytes > ph.chosen.pool_bytes  # 72 kept graphs against 12


# -- issue 49 ------------------------------------------------------------------------------------


def test_context_is_bounded_by_the_models_window_else_the_planners(cli, tmp_path):
    """Issue 49, item 4: ``--context 1000000000000`` priced steps of ~1.8e9 ms (failed before)."""
    from capture_plan.schemas.limits import MAX_CONTEXT
    from cli_inputs import LLAMA

    traffic = tmp_path / "t.csv"
    traffic.write_text("size,count\n1,5\n2,3\n")
    sized = ["sizes", "-b", "fa3", "--traffic", str(traffic)]
    one_line_error(
        cli(*sized, "--context", str(10**12)), "--context 1000000000000", f"must be 1..{MAX_CONTEXT:,}", "fix:"
    )
    one_line_error(cli(*sized, "--context", "0"), "--context 0", "must be 1..")
    assert cli(*sized, "--context", str(MAX_CONTEXT))[0] == 0
    # a model whose config names its window: that is the bound, and the error says where it is from
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "max_position_embeddings": 2048}))
    (tmp_path / "m.toml").write_text(
        'budget_mib = 4096\n[model]\nconfig = "config.json"\n[[phases]]\nname = "decode"\nkind = "decode"\n'
        "sizes = [1, 2]\n"
    )
    own = [*sized, "--spec", str(tmp_path / "m.toml")]
    one_line_error(
        cli(*own, "--context", "2049"),
        "--context 2049",
        "must be 1..2,048, the model's max_position_embeddings",
        "config.json: $.max_position_embeddings",
    )
    code, out, err = cli(*own, "--context", "2048")
    assert code == 0, err
    assert "context 2048 tokens" in out
    # a window shorter than the default context: the default is the window
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "max_position_embeddings": 512}))
    code, out, err = cli(*own)
    assert code == 0, err
    assert "context 512 tokens" in out


def test_a_calibration_is_priced_with_its_own_devices_roofline(cli, tmp_path):
    """Issue 49, item 5: an H200 calibration with ``--device "NVIDIA H100 80GB HBM3"`` priced the
    H200's device total beside the H100's step times, unsaid (failed before: it was accepted)."""
    root = Path(__file__).parent.parent
    cal = root / "plans/calibration/h200-fa3-ci.json"
    sized = ["sizes", "-b", "fa3", "--ci", "--traffic", str(SKEWED), "--calibration", str(cal)]
    one_line_error(
        cli(*sized, "--device", "NVIDIA H100 80GB HBM3"),
        "--device NVIDIA H100 80GB HBM3 with --calibration",
        # the build's own refusal (planner/schedule/read.py device_estimate), made when the build is
        # resolved, before any step is priced: step_time.roofline_device's copy of it was unreachable
        "the calibration was measured on 'NVIDIA H200', not 'NVIDIA H100 80GB HBM3'",
        "fix: leave --device out",
    )
    code, out, err = cli(*sized)  # the fix works
    assert code == 0, err
    assert "roofline of NVIDIA H200" in out
    assert cli(*sized, "--device", "NVIDIA H200")[0] == 0  # the calibration's own device, named
    # a calibration measured on an H100: its roofline is the H100's, not the default H200's
    h100 = tmp_path / "h100.json"
    dims = {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "intermediate": 14336}
    dims |= {"vocab": 128256, "dtype_bytes": 2, "logits_dtype_bytes": 4}  # the embedded model's (calibrations.toml)
    raw = {**json.loads(cal.read_text()), "backend": "fa3", "model": {"dimensions": dims}}
    h100.write_text(json.dumps({**raw, "device": raw["device"].replace("NVIDIA H200", "NVIDIA H100 80GB HBM3")}))
    code, out, err = cli(*sized[:-1], str(h100))
    assert code == 0, err
    assert "roofline of NVIDIA H100 80GB HBM3" in out
    # one measured on a device the roofline table lacks: refused, naming the calibration
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**raw, "device": raw["device"].replace("NVIDIA H200", "NVIDIA Z9")}))
    one_line_error(cli(*sized[:-1], str(other)), "--calibration", "no roofline figures for 'NVIDIA Z9'", "--timing")


def test_the_written_spec_of_a_config_model_builds(cli, tmp_path):
    """Its [model] listed the default dimensions beside the config, which a build refuses
    ("[model] names a config and also lists layers, ..."; failed before)."""
    from cli_inputs import LLAMA, SPEC

    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    (tmp_path / "m.toml").write_text('[model]\nconfig = "config.json"\n' + SPEC)
    (tmp_path / "t.csv").write_text("size,count\n1,5\n2,3\n")
    args = ("sizes", "-b", "fa3", "--spec", "m.toml", "--traffic", "t.csv", "--write-spec", "w.toml")
    assert cli(*args)[0] == 0
    code, out, err = cli("build", "-b", "fa3", "--spec", "w.toml", "--dry-run")
    assert code == 0, err
    assert "config.json); logits" in out
