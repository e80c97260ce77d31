"""A build's KV tokens under speculative decoding named by the engine's own flags (vLLM's
``--speculative-config``, SGLang's ``--speculative-*``; planner/fit/draft.py): the draft's graphs
(and the target's at its verify widths) are in no plan without speculative phases. Where fit
models them (vLLM's EAGLE head: planner/fit/vllm.py draft_captures) ``planner build`` /
``planner sizes`` price each figure of the target's graphs with the draft's estimated beside it;
elsewhere (SGLang's drafts, where nothing measured is near) they say the KV tokens are unknown,
why, and give no token figure, as ``planner fit`` says "graph memory unknown" for the same item.
A calibration of a plan with speculative phases measured those graphs: then its figure is taken.

Before: the build priced the plan's target graphs as the whole graph memory (the draft's as 0
bytes) and recorded exact-looking tokens (472,720 for the EAGLE head below, on the H100); fit with
``--plan``/``--calibration`` of a plan without speculative phases took that figure as the whole too.
Then (stop 64) every draft left them unknown; since stop 65 vLLM's EAGLE head's graphs are priced.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "planner/data/configs"
EAGLE = str(CONFIGS / "eagle-llama-3.1-8b.json")
TRAFFIC = str(ROOT / "tests/data/traffic-skewed.csv")
VLLM_EAGLE = json.dumps({"method": "eagle", "model": EAGLE, "num_speculative_tokens": 3})
VLLM_NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5})
#: (engine, its context flag, the speculative flags as --engine-flag items and as fit's flags)
ENGINES = {
    "vllm eagle": ("vllm==0.34.0", "max-model-len", {"speculative-config": VLLM_EAGLE}),
    "sglang eagle": (
        "sglang==0.5.23",
        "context-length",
        {"speculative-algorithm": "EAGLE", "speculative-draft-model-path": EAGLE},
    ),
    "sglang ngram": ("sglang==0.5.23", "context-length", {"speculative-algorithm": "NGRAM"}),
}
CALIBRATION = str(ROOT / "plans/calibration/h200-fa3-ci.json")
EAGLE_CALIBRATION = str(ROOT / "plans/calibration/h200-fa3-eagle-ci.json")


def _build_flags(case: str) -> list[str]:
    engine, ctx, spec = ENGINES[case]
    flags = ["--engine", engine, "--engine-flag", f"{ctx}=8192"]
    return flags + [w for k, v in spec.items() for w in ("--engine-flag", f"{k}={v}")]


def _fit_flags(case: str) -> list[str]:
    engine, ctx, spec = ENGINES[case]
    return ["--engine", engine, f"--{ctx}", "8192", *(w for k, v in spec.items() for w in (f"--{k}", v))]


def _kv(path: str) -> dict:
    return json.loads(Path(path).read_text())["predicted"]["kv"]


def _graph(res: dict) -> dict:
    return next(i for i in res["items"] if i["name"] == "graph memory")


def test_a_build_under_vllms_eagle_prices_the_plans_graphs_with_the_drafts_beside_them(cli):
    """vLLM's EAGLE head: fit estimates its graphs, so the build's KV tokens are known: fewer
    than the plan's graphs alone would leave, the draft's graphs named in the figure's source."""
    code, out, err = cli("fit", "--model", "llama-3-8b", "--device", "H100", *_fit_flags("vllm eagle"), "--json")
    assert code == 0, err
    assert _graph(json.loads(out))["status"] == "estimated"
    code, out, err = cli("build", "-b", "fa3", "--device", "H100", *_build_flags("vllm eagle"), "-o", "s.json")
    assert code == 0, err
    kv = _kv("s.json")
    assert 0 < kv["kv_tokens"] < kv["kv_tokens_without_graphs"], kv
    engine = ["--engine", "vllm==0.34.0", "--engine-flag", "max-model-len=8192"]
    code, _, err = cli("build", "-b", "fa3", "--device", "H100", *engine, "-o", "t.json")
    assert code == 0, err
    assert kv["kv_tokens"] < _kv("t.json")["kv_tokens"]  # the draft's graphs and its KV layer cost tokens
    assert cli("check", "s.json")[0] == 0
    # uncalibrated, a plan with speculative phases holds its own draft graphs: no figure of
    # them, so unknown, never its figure with the head's graphs estimated again beside it
    code, _, err = cli("build", "-b", "fa3", "--speculative", "eagle", "--ci", "--device", "H200",
                       *_build_flags("vllm eagle"), "-o", "e.json")  # fmt: skip
    assert code == 0, err
    assert _kv("e.json")["kv_tokens"] is None, _kv("e.json")


def test_the_eagle_heads_graphs_are_priced_at_the_figures_sizes():
    """KvPricer prices a figure of the target's graphs with the EAGLE head's captured at the
    figure's own sizes (every phase's: the engine's shared sizes in plugin mode), so fewer
    sizes leave more tokens for the same target figure; a figure of no graphs has none of the
    head's either; the tokens without graphs are those."""
    from capture_plan.planner.fit.inputs import FitRequest
    from capture_plan.planner.fit.kv_price import KvPricer
    from capture_plan.planner.fit.model import load_model

    flags = {"max-model-len": 8192, "speculative-config": VLLM_EAGLE}
    pricer = KvPricer(FitRequest(load_model("llama-3-8b"), "H100", "vllm==0.34.0", 1, flags))
    figure = 300 << 20
    few, many = pricer.tokens(figure, (1, 2, 4)), pricer.tokens(figure, tuple(range(8, 513, 8)))
    assert few > many, (few, many)  # the prefill manager's graphs follow the sizes
    assert pricer.tokens(0, ()) == pricer.none_tokens > pricer.tokens(0, (1,))
    res = pricer.result(figure, (1, 2, 4))
    graph = next(i for i in res.items if i.name == "graph memory")
    assert graph.status == "estimated" and "the draft's graphs" in graph.source and graph.bytes > figure


@pytest.mark.parametrize("case", sorted(c for c in ENGINES if c != "vllm eagle"))
def test_a_build_under_speculative_decoding_leaves_its_kv_tokens_unknown_as_fit_does(cli, case, monkeypatch):
    # the EAGLE head's config derives 2,048 tokens: SGLang runs it at the target's 8,192 only so
    monkeypatch.setenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "1")
    code, out, err = cli("fit", "--model", "llama-3-8b", "--device", "H100", *_fit_flags(case), "--json")
    assert code == 0, err
    fitted = _graph(json.loads(out))
    assert fitted["status"] == "unknown" and fitted["bytes"] is None
    code, out, err = cli("build", "-b", "fa3", "--device", "H100", *_build_flags(case), "-o", "s.json")
    assert code == 0, err
    kv = _kv("s.json")
    assert kv["kv_tokens"] is None, kv  # was the target's graphs' tokens, the draft's graphs as 0
    assert kv["graph_bytes"] > 0  # the plan's own device memory stays known
    assert kv["graph"].endswith(f"KV tokens unknown: {fitted['source']}; the graph figure given (the plan's "
                                "graph memory) is of a plan with no speculative phase")  # fmt: skip
    assert kv["kv_tokens_without_graphs"] > 0 and not kv.get("overflow")
    assert "KV tokens under" in out and ": unknown (" in out and "speculative decoding" in out
    assert cli("check", "s.json")[0] == 0
    # a gate on tokens it does not know: one line, naming why and the build that measures them
    code, _, err = cli("diff", "s.json", "s.json", "--fail-above-kv-tokens", "0")
    assert code == 1 and err.count("\n") == 1 and "has no KV tokens: " in err and "--speculative NAME" in err, err


def _size_rows(out: str) -> list[str]:
    lines = out.splitlines()
    top = next(i for i, ln in enumerate(lines) if ln.rstrip().endswith("KV tokens  sizes"))
    return lines[top + 1 : next(i for i, ln in enumerate(lines) if ln.startswith("  chosen: "))]


def test_planner_sizes_prices_each_list_beside_vllms_eagle_graphs(cli):
    """Each list's graphs with the EAGLE head's beside them, captured at the list's sizes:
    more graphs, fewer tokens."""
    args = ["sizes", "-b", "fa3", "--traffic", TRAFFIC, "--max-graphs", "4", "--device", "H100"]
    code, out, err = cli(*args, *_build_flags("vllm eagle"))
    assert code == 0, err
    tokens = [int(ln.split()[-2].replace(",", "")) for ln in _size_rows(out)[:6]]
    assert tokens == sorted(tokens, reverse=True) and tokens[0] > tokens[-1], tokens
    assert cli(*args, *_build_flags("vllm eagle"), "--min-kv-tokens", "1000")[0] == 0


def test_planner_sizes_says_the_tokens_are_unknown_and_refuses_a_floor_it_cannot_price(cli, monkeypatch):
    monkeypatch.setenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "1")
    args = ["sizes", "-b", "fa3", "--traffic", TRAFFIC, "--max-graphs", "4", "--device", "H100"]
    args += _build_flags("sglang eagle")
    code, out, err = cli(*args)
    assert code == 0, err
    header = next(ln for ln in out.splitlines() if ln.startswith("KV tokens: "))
    assert ": unknown (" in header and "speculative decoding (EAGLE)" in header, header
    lines = out.splitlines()
    top = next(i for i, ln in enumerate(lines) if ln.rstrip().endswith("KV tokens  sizes"))
    rows = lines[top + 1 : next(i for i, ln in enumerate(lines) if ln.startswith("  chosen: "))]
    assert len(rows) > 3 and all(ln.split()[-2] == "-" for ln in rows), rows  # each list's tokens: none given
    assert "unknown KV tokens left" in out
    code, _, err = cli(*args, "--min-kv-tokens", "1000")
    assert code == 1 and err.count("\n") == 1, err
    assert "--min-kv-tokens: the graph memory under sglang==0.5.23" in err and "cannot be priced" in err, err
    fixed = shlex.split(err.split("`")[1])
    assert "--min-kv-tokens" not in fixed and cli(*fixed[1:])[0] == 0, err


def test_a_method_without_draft_graphs_is_priced(cli):
    """vLLM's n-gram captures the target's graphs alone (fit prices them): the tokens stay known,
    fewer than none of the graphs leave."""
    engine = ["--engine", "vllm==0.34.0", "--engine-flag", "max-model-len=8192"]
    code, _, err = cli("build", "-b", "fa3", "--device", "H100", *engine, "--engine-flag",
                       f"speculative-config={VLLM_NGRAM}", "-o", "n.json")  # fmt: skip
    assert code == 0, err
    kv = _kv("n.json")
    assert 0 < kv["kv_tokens"] < kv["kv_tokens_without_graphs"], kv


def test_a_calibration_of_a_plan_with_speculative_phases_prices_them(cli):
    """The EAGLE plan's calibration measured its verify and draft graphs: its figure is taken
    whole (in the build and in fit alike); the plain plan's calibration measured none of them:
    its figure with the EAGLE head's graphs estimated beside it."""
    spec = ["--engine-flag", f"speculative-config={VLLM_EAGLE}"]
    engine = ["--engine", "vllm==0.34.0", "--engine-flag", "max-model-len=8192", *spec]
    code, _, err = cli("build", "-b", "fa3", "--speculative", "eagle", "--ci", "--calibration", EAGLE_CALIBRATION,
                       *engine, "-o", "e.json")  # fmt: skip
    assert code == 0, err
    kv = _kv("e.json")
    assert kv["graph"] == "the device total (graph-exec included)"
    assert 0 < kv["kv_tokens"] < kv["kv_tokens_without_graphs"], kv
    code, _, err = cli("build", "-b", "fa3", "--ci", "--calibration", CALIBRATION, *engine, "-o", "p.json")
    assert code == 0, err
    # the plain plan's measured figure, with the EAGLE head's graphs estimated beside it
    assert 0 < _kv("p.json")["kv_tokens"] < kv["kv_tokens_without_graphs"]
    fit = ["fit", "--model", "llama-3-8b", "--device", "H200", "--engine", "vllm==0.34.0", "--max-model-len", "8192",
           "--speculative-config", VLLM_EAGLE, "--json"]  # fmt: skip
    for plan, cal, status in (
        ("fa3-eagle-ci-h200.json", EAGLE_CALIBRATION, "measured"),
        ("fa3-ci-h200.json", CALIBRATION, "estimated"),
    ):
        code, out, err = cli(*fit, "--plan", str(ROOT / "plans" / plan), "--calibration", cal)
        assert code == 0, err
        res = json.loads(out)
        planned = next(c for c in res["size_costs"] if c["name"] == "plan")
        assert _graph(res)["status"] == status and _graph(res)["bytes"], _graph(res)
        assert planned["kv_tokens"] is not None, planned


def test_a_plans_own_draft_phases_stand_for_the_engines_and_are_not_counted_twice(cli):
    """A plan with speculative phases captures the draft's graphs itself: without a calibration
    of them fit takes no figure (unknown, as before), never its predicted pool plus the EAGLE
    head's graphs estimated again; a plan without them gets the head's graphs beside it."""
    fit = ["fit", "--model", "llama-3-8b", "--device", "H200", "--engine", "vllm==0.34.0", "--max-model-len", "8192",
           "--speculative-config", VLLM_EAGLE, "--json"]  # fmt: skip
    for plan, status in (("fa3-eagle-ci-h200.json", "unknown"), ("fa3-ci-h200.json", "estimated")):
        code, out, err = cli(*fit, "--plan", str(ROOT / "plans" / plan))
        assert code == 0, err
        assert _graph(json.loads(out))["status"] == status, (plan, _graph(json.loads(out)))
