"""``planner fit --traffic``: the traffic's best size lists priced in KV tokens beside the engine
default's (planner/fit/traffic.py), each row's expected padding, and the refusals."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from capture_plan.planner.cli import main
from capture_plan.planner.fit.fit import FitRequest, fit
from capture_plan.planner.fit.model import load_model
from capture_plan.planner.sizes.fit_traffic import fit_traffic

ROOT = Path(__file__).resolve().parent.parent
LLAMA = str(ROOT / "planner/data/configs/llama-3.1-8b.json")
SKEWED = ROOT / "tests/data/traffic-skewed.csv"
VLLM = ("--engine", "vllm==0.34.0", "--max-model-len", "8192")
SGLANG = ("--engine", "sglang==0.5.23", "--context-length", "8192")


def run(*args: str, capsys) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def fit_json(*more: str, capsys) -> dict:
    code, out, err = run("fit", "--model", LLAMA, "--device", "H100", *more, "--json", capsys=capsys)
    assert code == 0, err
    return json.loads(out)


def refused(*more: str, capsys) -> str:
    code, out, err = run("fit", "--model", LLAMA, "--device", "H100", *more, capsys=capsys)
    assert code == 1 and not out and err.count("\n") == 1, (out, err)
    return err


def run_fix(err: str, capsys) -> tuple[int, str, str]:
    """The command a refusal's fix names (between backticks), run."""
    argv = shlex.split(err.split("`")[1])
    assert argv[:2] == ["planner", "fit"], err
    return run(*argv[1:], capsys=capsys)


@pytest.mark.parametrize("engine", [VLLM, SGLANG])
def test_the_rows_are_the_default_the_front_then_fewer(engine, capsys):
    """Engine default first, the front's lists by count (each ending at the engine's largest
    size, padding less the more sizes it has, the fewest that pad no more than the default
    among them), then fewer and none; the other figures as without the traffic."""
    plain = fit_json(*engine, capsys=capsys)
    res = fit_json(*engine, "--traffic", str(SKEWED), capsys=capsys)
    names = [c["name"] for c in res["size_costs"]]
    front = [c for c in res["size_costs"] if c["name"].startswith("traffic front")]
    default = res["size_costs"][0]
    assert names[0] == "engine default" and names[1 : 1 + len(front)] == [c["name"] for c in front]
    assert names[1 + len(front) :] == [c["name"] for c in plain["size_costs"][1:]]  # fewer (vLLM), none
    assert 1 <= len(front) <= 3
    counts = [len(c["sizes"]) for c in front]
    assert counts == sorted(set(counts)) and [c["name"] for c in front] == [f"traffic front {k}" for k in counts]
    assert counts[-1] == len(default["sizes"])  # the default's count: its graph count, padded least
    assert all(max(c["sizes"]) == max(default["sizes"]) == res["traffic"]["largest"] for c in front)
    pads = [c["padding_pct"] for c in front]
    assert pads == sorted(pads, reverse=True) and pads[0] <= default["padding_pct"] and pads[-1] < pads[0]
    assert res["traffic"]["steps"] == 10951
    assert "a step of n run as size s costs s" in res["traffic"]["cost"] and "estimate" in res["traffic"]["cost"]
    for key in ("items", "kv_tokens", "kv_blocks", "settings"):
        assert res[key] == plain[key], key
    assert plain["traffic"] is None and all(c["padding_pct"] is None for c in plain["size_costs"])
    none = {c["name"]: c for c in res["size_costs"]}["none"]
    assert none["padding_pct"] is None  # no graphs: no padding to price


def test_front_rows_cost_tokens_by_the_default_rows_rule(capsys):
    """vLLM 0.34.0 sizes its KV cache after capture: each front list costs its graphs' tokens,
    read against capturing none as the default's are, fewer sizes fewer tokens."""
    res = fit_json(*VLLM, "--traffic", str(SKEWED), capsys=capsys)
    costs = res["size_costs"]
    none = costs[-1]["kv_tokens"]
    assert all(c["kv_tokens"] + c["tokens_cost"] == none for c in costs)
    front = [c for c in costs if c["name"].startswith("traffic front")]
    spent = [c["tokens_cost"] for c in front]
    assert spent == sorted(spent) and spent[0] < costs[0]["tokens_cost"]  # fewer sizes, fewer tokens


def test_a_list_equal_to_the_default_costs_the_same_tokens(tmp_path, capsys):
    """Traffic on every size of the default list: the front's list of the default's count is
    that list, priced to the byte and token as the engine default's row, padding nothing."""
    default = fit_json(*VLLM, capsys=capsys)["size_costs"][0]
    path = tmp_path / "every.csv"
    path.write_text("size,count\n" + "".join(f"{s},{1 + s % 7}\n" for s in default["sizes"]))
    costs = fit_json(*VLLM, "--traffic", str(path), capsys=capsys)["size_costs"]
    same = [c for c in costs if c["name"].startswith("traffic front") and c["sizes"] == default["sizes"]]
    assert len(same) == 1 and costs[0]["sizes"] == default["sizes"]
    for key in ("graph_bytes", "kv_tokens", "tokens_cost", "padding_pct"):
        assert same[0][key] == costs[0][key], key
    assert same[0]["padding_pct"] == 0.0


def test_padding_is_the_padded_tokens_of_the_traffic(tmp_path, capsys):
    """Three steps of 1 and one of 3: the default (1, 2, 4, ...) runs the 3 as 4, 7 tokens for
    the traffic's 6 (16.67%); the front's best three sizes (1, 3, 512) pad nothing and are the
    fewest that pad no more than the default."""
    path = tmp_path / "t.csv"
    path.write_text("size,count\n1,3\n3,1\n")
    res = fit_json(*VLLM, "--traffic", str(path), capsys=capsys)
    rows = {c["name"]: c for c in res["size_costs"]}
    assert rows["engine default"]["padding_pct"] == 16.67
    assert [n for n in rows if n.startswith("traffic front")] == ["traffic front 3"]
    assert rows["traffic front 3"]["sizes"] == [1, 3, 512] and rows["traffic front 3"]["padding_pct"] == 0.0
    assert rows["fewer"]["padding_pct"] == 16.67  # 1, 2, 4 ... 64: the 3 runs as 4 as well


def test_the_table_shows_the_rows_and_says_how_padding_is_counted(capsys):
    code, out, err = run("fit", "--model", LLAMA, "--device", "H100", *VLLM, "--traffic", str(SKEWED), capsys=capsys)
    assert code == 0, err
    lines = out.splitlines()
    head = next(ln for ln in lines if ln.startswith("traffic "))
    assert "10,951 steps" in head and "an estimate: fit has no step-time model" in head
    front = [ln for ln in lines if ln.startswith("sizes traffic front")]
    assert front and all(", pads " in ln and ln.endswith("%") for ln in front)
    assert lines.index(front[0]) == lines.index(next(ln for ln in lines if ln.startswith("sizes engine default"))) + 1
    assert "pads n/a (no graphs)" in next(ln for ln in lines if ln.startswith("sizes none"))


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (None, "cannot read traffic"),
        ("size,count\n1,x\n", "t.csv:2: count 'x' is not a number"),
        ("size,count\n1,0\n", "the traffic has no steps"),
    ],
)
def test_bad_traffic_is_one_located_line(tmp_path, capsys, text, needle):
    path = tmp_path / "t.csv"
    if text is not None:
        path.write_text(text)
    err = refused(*VLLM, "--traffic", str(path), capsys=capsys)
    assert needle in err and str(path) in err and "fix: " in err


@pytest.mark.parametrize(
    ("engine", "more", "flag"),
    [
        (VLLM, (), "--max-cudagraph-capture-size 608"),  # the default list's grid: 600 is not on it
        (VLLM, ("--max-num-batched-tokens", "512"), "--max-num-batched-tokens 600"),  # the batch caps the sizes
        (VLLM, ("--cudagraph-capture-sizes", "1,2,4"), "--max-cudagraph-capture-size 608"),  # the sizes left out
        (SGLANG, (), "--cuda-graph-max-bs 600"),
    ],
)
def test_traffic_above_the_largest_size_is_refused_with_a_fix_that_works(tmp_path, capsys, engine, more, flag):
    path = tmp_path / "big.csv"
    path.write_text("size,count\n1,10\n600,3\n")
    err = refused(*engine, *more, "--traffic", str(path), capsys=capsys)
    assert f"{path}: the traffic reaches size 600, above" in err and flag in err
    code, out, fix_err = run_fix(err, capsys)
    assert code == 0, fix_err
    assert "traffic front" in out and "pads 0.00%" in out


def test_traffic_without_graphs_or_under_speculative_decoding_is_refused(tmp_path, capsys):
    err = refused(*VLLM, "--enforce-eager", "--traffic", str(SKEWED), capsys=capsys)
    assert "no graphs are captured" in err and "--enforce-eager" not in err.split("`")[1]
    assert run_fix(err, capsys)[0] == 0
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    err = refused(*VLLM, "--speculative-config", spec, "--traffic", str(SKEWED), capsys=capsys)
    assert f"--traffic {SKEWED}: capture sizes under speculative decoding" in err


def test_a_fix_that_leaves_the_traffic_above_the_largest_size_is_not_offered(capsys):
    """A does-not-fit's fixes are checked with the traffic: the fewer-sizes fix (largest 64)
    would refuse the skewed traffic (to 256), so it is not offered with it."""
    model = load_model(LLAMA)
    flags = {"max-model-len": 48000, "gpu-memory-utilization": 0.3}
    bare = fit(FitRequest(model, "H100", "vllm==0.34.0", 1, flags))
    with_traffic = fit_traffic(FitRequest(model, "H100", "vllm==0.34.0", 1, flags), str(SKEWED))
    assert not bare.fits and "--max-cudagraph-capture-size 64" in bare.fixes
    assert not with_traffic.fits and "--max-cudagraph-capture-size 64" not in with_traffic.fixes
    assert "--enforce-eager" in bare.fixes and "--enforce-eager" not in with_traffic.fixes
    assert with_traffic.fixes and set(with_traffic.fixes) < set(bare.fixes)
