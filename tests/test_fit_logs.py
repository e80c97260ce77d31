"""`planner fit` against the start-up logs real deployments published (tests/data/engine_logs).

Every fixture is read, and its test id says what is checked:

- ``refused-release``: a release fit does not model; fit refuses it with one line naming the
  nearest modelled release (issue 52, item 2).
- ``refused-model``: a model fit does not model; the one-line refusal names what is missing.
- ``compared``: fit is run from the log's config, device and settings alone (no figure of the
  log is given to it, except where the device has no graph figure: below) and each figure the
  log shows is held to its target: KV tokens and KV GiB within 1%, graph memory within 10%
  (the capture's own figure where the log shows it, else the engine's pre-capture estimate),
  weights within fit's stated error bar, the profiling run's activation peak within 10%.

Where fit misses a target, the miss is a :class:`Gap` below: the error measured, why, and a
bound the test holds it to. A gap is not a pass: the test fails if the error leaves its
bound, and fails too once the error is back inside the target (the gap is closed: remove
it), so this table always says what fit gets wrong today. No figure is fitted to a log.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from capture_plan.planner.fit.fit import fit
from capture_plan.planner.fit.model import load_model
from capture_plan.planner.fit.tables import GiB, rule_for
from capture_plan.schemas.errors import InputError
from capture_plan.schemas.fit import FitItem

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

LOGS = Path(__file__).resolve().parent / "data" / "engine_logs"

#: fixtures whose model fit refuses, and what the one-line refusal must name
REFUSED = {"vllm-0.19.0_a100-80gb_gpt-oss-20b": ("'gpt_oss' is not modelled", "mxfp4", "attention sinks")}

#: fixture settings fit does not read: they leave the KV pool's size as it is
NOT_SIZING = {"enable-prefix-caching"}

#: the targets (issue 52): |fit / logged - 1| at most this
TARGETS = {"kv_tokens": 0.01, "kv_cache_gib": 0.01, "graph": 0.10, "activation_peak_gib": 0.10}


class Gap(NamedTuple):
    """A figure fit misses against one log: ``error`` (fit / logged - 1, as measured when the
    gap was recorded, to 0.5 points), ``bound`` (the test fails beyond it) and why."""

    error: float
    bound: float
    why: str


NON_TORCH_TP = (
    "non-torch memory at tp > 1: vLLM 0.19.0 logs 2.06-2.13 GiB ('non-torch forward increase memory', "
    "NCCL's lazily allocated buffers and the all-reduce workspaces on an H100 host) against fit's 0.75 GiB "
    "estimate (planner/data/fit_estimates.toml [non_torch], not measured on an engine); the size of NCCL's "
    "buffers depends on its version and the host's topology, not on vLLM's code, so it is left to a "
    "measurement on the project's own H100 rather than taken from the logs under test"
)
GRAPH_PIECEWISE = (
    "graph memory: fit counts graph-exec as nodes x the per-node figure the project measured on its own "
    "graphs (devices.toml) plus the largest size's activations and, on sm90, the FA3 split-KV accumulators "
    "of vLLM's FULL graphs as the pool; vLLM's capture (FULL_AND_PIECEWISE: FULL graphs and sizes x "
    "(layers + 1) piecewise graphs, 1,500-3,300 graph execs) took 0.64-1.57 GiB in the 0.19.0 logs, 0.96 GiB "
    "in the 0.20.0 one. What each of those execs costs apart from its nodes is not measured yet "
    "(devices.toml [graph_exec_per_graph], bench/graph_exec_bench.py --overhead): fit prices them by their "
    "nodes only. "
    "The project's own H100 bench shows the same gap in the pool (bench/results/"
    "device-2026-12-06-h100-vllm034.json, llama: pool 1054 MiB captured against 68 predicted)"
)
DEDUCTED_TP4 = (
    "KV GiB under vLLM 0.20.0 (which takes its graph estimate from the budget) at tp 4: the engine deducted "
    "its 1.10 GiB estimate where fit deducts its own 0.23 (0.87 GiB), non-torch memory at tp 4 as in the "
    "0.19.0 logs (about 1.4 GiB more than fit's estimate), and about 0.4 GiB more of the fp8 MoE path's "
    "workspaces than fit's activation peak counts: 2.7 GiB of a 12.15 GiB cache"
)
MLA_WEIGHTS = (
    "weights: vLLM's MLA keeps per-layer W_UK_T / W_UV copies of kv_b_proj made after loading and a YaRN "
    "rotary cache, which fit's count (planner/fit/model.py) does not hold: -0.15 GiB, 9 MiB past the bar"
)

#: (fixture, figure) -> the gap recorded
GAPS: dict[tuple[str, str], Gap] = {
    ("vllm-0.19.0_h100_llama-3.1-8b-instruct_tp2", "kv_tokens"): Gap(0.022, 0.035, NON_TORCH_TP),
    ("vllm-0.19.0_h100_llama-3.1-8b-instruct_tp2", "kv_cache_gib"): Gap(0.022, 0.035, NON_TORCH_TP),
    ("vllm-0.19.0_h100_llama-3.1-8b-instruct_tp4", "kv_tokens"): Gap(0.022, 0.035, NON_TORCH_TP),
    ("vllm-0.19.0_h100_llama-3.1-8b-instruct_tp4", "kv_cache_gib"): Gap(0.022, 0.035, NON_TORCH_TP),
    ("vllm-0.19.0_h100_qwen2.5-7b-instruct_tp4", "kv_tokens"): Gap(0.022, 0.035, NON_TORCH_TP),
    ("vllm-0.19.0_h100_qwen2.5-7b-instruct_tp4", "kv_cache_gib"): Gap(0.022, 0.035, NON_TORCH_TP),
    ("vllm-0.19.0_h100_mixtral-8x7b-instruct_tp2", "kv_tokens"): Gap(0.048, 0.06, NON_TORCH_TP),
    ("vllm-0.19.0_h100_mixtral-8x7b-instruct_tp2", "kv_cache_gib"): Gap(0.048, 0.06, NON_TORCH_TP),
    ("vllm-0.19.0_h100_deepseek-v2-lite-chat", "weights"): Gap(-0.005, 0.01, MLA_WEIGHTS),
    ("vllm-0.19.0_h100_llama-3.1-8b-instruct", "graph"): Gap(-0.504, 0.9, GRAPH_PIECEWISE),
    ("vllm-0.19.0_h100_llama-3.1-8b-instruct_tp2", "graph"): Gap(-0.602, 0.9, GRAPH_PIECEWISE),
    ("vllm-0.19.0_h100_llama-3.1-8b-instruct_tp4", "graph"): Gap(-0.661, 0.9, GRAPH_PIECEWISE),
    ("vllm-0.19.0_h100_qwen2.5-7b-instruct", "graph"): Gap(-0.519, 0.9, GRAPH_PIECEWISE),
    ("vllm-0.19.0_h100_qwen2.5-7b-instruct_tp4", "graph"): Gap(-0.673, 0.9, GRAPH_PIECEWISE),
    ("vllm-0.19.0_h100_qwen3-8b", "graph"): Gap(-0.519, 0.9, GRAPH_PIECEWISE),
    ("vllm-0.19.0_h100_qwen3-30b-a3b", "graph"): Gap(-0.661, 0.9, GRAPH_PIECEWISE),
    ("vllm-0.19.0_h100_gemma-2-9b-it", "graph"): Gap(-0.512, 0.9, GRAPH_PIECEWISE),
    ("vllm-0.19.0_h100_deepseek-v2-lite-chat", "graph"): Gap(-0.878, 0.95, GRAPH_PIECEWISE),
    ("vllm-0.19.0_h100_mixtral-8x7b-instruct_tp2", "graph"): Gap(-0.662, 0.9, GRAPH_PIECEWISE),
    ("vllm-0.20.0_4xh100_qwen3-235b-a22b-instruct-2507-fp8", "kv_cache_gib"): Gap(0.220, 0.3, DEDUCTED_TP4),
    ("vllm-0.20.0_4xh100_qwen3-235b-a22b-instruct-2507-fp8", "graph"): Gap(-0.756, 0.9, GRAPH_PIECEWISE),
}


def _read(path: Path) -> dict:
    return tomllib.loads(path.read_text(encoding="utf-8"))


def _kind(path: Path) -> str:
    log = _read(path)
    try:
        rule_for(f"{log['engine']}=={log['version']}")
    except InputError:
        return "refused-release"
    return "refused-model" if path.stem in REFUSED else "compared"


FIXTURES = sorted(LOGS.glob("*.toml"))
KINDS = {path: _kind(path) for path in FIXTURES}


def _of(kind: str) -> list:
    return [pytest.param(p, id=f"{kind}:{p.stem}") for p in FIXTURES if KINDS[p] == kind]


def test_the_folder_holds_logs_of_every_kind():
    # an empty parametrization would pass vacuously
    counts = {kind: sum(k == kind for k in KINDS.values()) for kind in ("refused-release", "refused-model", "compared")}
    assert min(counts.values()) >= 1 and counts["compared"] >= 10, counts


@pytest.mark.parametrize("path", _of("refused-release"))
def test_a_log_of_an_unmodelled_release_is_refused_naming_the_nearest(path):
    log = _read(path)
    with pytest.raises(InputError) as err:
        rule_for(f"{log['engine']}=={log['version']}")
    assert f"--engine {log['engine']}==" in err.value.fix and "\n" not in str(err.value)


@pytest.mark.parametrize("path", _of("refused-model"))
def test_a_log_of_an_unmodelled_model_is_refused_naming_what_is_missing(path):
    with pytest.raises(InputError) as err:
        load_model(str(LOGS / _read(path)["config"]))
    assert all(part in str(err.value) for part in REFUSED[path.stem]) and "\n" not in str(err.value)


def _check(stem: str, figure: str, got: float, logged: float, target: float) -> None:
    """Hold fit's ``got`` to ``target`` against ``logged``, or to the figure's recorded gap."""
    error = got / logged - 1
    gap = GAPS.get((stem, figure))
    if gap is None:
        assert abs(error) <= target, f"{figure}: fit {got:.4g} against {logged:.4g} logged ({error:+.2%})"
        return
    assert abs(error) > target, f"{figure}: the gap is closed ({error:+.2%}): remove it from GAPS"
    assert abs(error) <= gap.bound, f"{figure}: {error:+.2%} is past the gap's bound {gap.bound:.0%} ({gap.why})"
    assert error == pytest.approx(gap.error, abs=0.005), f"{figure}: now {error:+.2%}, recorded {gap.error:+.2%}"


@pytest.mark.parametrize("path", _of("compared"))
def test_fit_meets_the_published_log(path):
    log = _read(path)
    engine = f"{log['engine']}=={log['version']}"
    model = load_model(str(LOGS / log["config"]))
    # settings that do not change the KV pool's size (prefix caching reuses blocks, it adds none)
    settings = {k: v for k, v in log["settings"].items() if k not in NOT_SIZING}
    args = (model, log["device"], engine, log["tp"], settings)
    r = fit(*args)
    logged = log["logged"]
    items = {i.name: i for i in r.items}
    graph = items["graph memory"]
    if graph.bytes is None:
        # nothing measured is near this device's graphs: fit leaves them unknown, never zero,
        # and its tokens are an upper bound; the release's other items are then checked with
        # the engine's own logged estimate (printed to 0.01 GiB) in the graph item's place
        assert graph.status == "unknown" and r.kv_bytes / GiB >= logged["kv_cache_gib"]
        given = FitItem("graph memory", int(logged["graph_estimate_gib"] * GiB), int(0.005 * GiB), "given", path.name)
        r = fit(*args, measured_graph=given)
        items = {i.name: i for i in r.items}
    else:
        shown = logged.get("graph_gib", logged.get("graph_estimate_gib"))
        assert shown is not None, "a compared log shows graph memory"
        _check(path.stem, "graph", graph.bytes / GiB, shown, TARGETS["graph"])
    if "total_gpu_gib" in logged:  # the device table's total is the one the engine saw
        assert items["device total"].bytes / GiB == pytest.approx(logged["total_gpu_gib"], abs=0.005)
    if "weights_gib" in logged:  # within fit's own error bar (and the log's 0.01 GiB print)
        w = items["weights"]
        bar = (w.error_bytes + 0.005 * GiB) / (logged["weights_gib"] * GiB)
        _check(path.stem, "weights", w.bytes / GiB, logged["weights_gib"], bar)
    if "activation_peak_gib" in logged:
        got = items["activation peak"].bytes / GiB
        _check(path.stem, "activation_peak_gib", got, logged["activation_peak_gib"], TARGETS["activation_peak_gib"])
    _check(path.stem, "kv_cache_gib", r.kv_bytes / GiB, logged["kv_cache_gib"], TARGETS["kv_cache_gib"])
    if "kv_tokens" in logged:  # not where a block override set the count (the log's notes say)
        _check(path.stem, "kv_tokens", r.kv_tokens, logged["kv_tokens"], TARGETS["kv_tokens"])


def test_every_gap_names_a_compared_log_and_a_checked_figure():
    stems = {p.stem for p in FIXTURES if KINDS[p] == "compared"}
    for stem, figure in GAPS:
        assert stem in stems, stem
        assert figure in {"graph", "weights", *TARGETS}, figure
