"""planner/fit/reserve.py: vLLM 0.34.0's torch reserve growth over its KV-cache sizing step,
simulated, against what the engine-faithful runners measured on the GPU (bench/fit_bench.py's
committed results), and as the 0.34.0 rule takes it (measure_kv_cache_bytes: the larger of the
transient peak and the growth kept free)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from bench_modules import bench_module
from capture_plan.planner.fit import sizing
from capture_plan.planner.fit.fit import FitRequest, fit
from capture_plan.planner.fit.model import load_model
from capture_plan.planner.fit.reserve import sizing_step_growth, sizing_step_requests
from capture_plan.planner.fit.tables import rules, sampler_rule
from capture_plan.planner.memory.allocator import PoolSim

fb = bench_module("fit_bench")
MIB, GIB = 1 << 20, 1 << 30
RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"
#: each case's newest committed run of the 0.34.0-shaped runner
MEASURED = {
    "llama": "fit-bench-2026-12-07-vllm-layers.json",
    "qwen2": "fit-bench-2026-12-07-vllm-layers.json",
    "mixtral": "fit-bench-2026-12-07-vllm-layers.json",
    "gemma2": "fit-bench-2026-12-07-vllm-layers.json",
    "qwen2_moe": "fit-bench-2026-12-07-vllm-layers.json",
    "reference": "fit-bench-2026-12-07-vllm-refs-layers.json",
}
#: where the simulation meets the measured growth to the MiB (elsewhere the runner's start-up left
#: segments pinned that the step reused: planner/fit/reserve.py's docstring)
EXACT = {"llama", "qwen2", "mixtral"}


def _case(case: str) -> tuple[int, int, int]:
    """(simulated growth, measured growth, measured transient peak) of the case's 0.34.0 run
    (a transformers case's spec is written from its transformers config: skipped without it)."""
    if case != "reference":
        pytest.importorskip("transformers")
    source = json.loads((RESULTS / MEASURED[case]).read_text())
    row = source["cases"][case]["vllm==0.34.0"]
    s = row["settings"]
    model = load_model(str(fb.case_spec(case, Path(tempfile.mkdtemp()), source["layers"])))
    tokens, rows = s["max_num_batched_tokens"], min(s["max_num_seqs"], s["max_num_batched_tokens"])
    sim = sizing_step_growth(model, 1, tokens, rows, sampler_rule("vllm", "0.34.0").rule)
    runner = row["runner"]
    return sim, runner["torch_reserve_growth_bytes"], runner["transient_peak_bytes"]


@pytest.mark.parametrize("case", sorted(MEASURED))
def test_the_simulated_growth_meets_the_runners_measured_growth_within_its_error_bar(case):
    """The runner (tests/engines/vllm_worker_034.py ``_measure_sizing_step``, the release's
    reading of the reserve around its sizing step) measured its growth on an H100. The
    simulation from an emptied cache meets it where nothing the start-up left pins a segment
    the step reuses, and is within the item's error bar everywhere (what fit's KV cache is
    held to)."""
    sim, measured, transient = _case(case)
    if case in EXACT:
        assert abs(sim - measured) < 1 * MIB, (sim / MIB, measured / MIB)
    flags = {"max-model-len": 4096, "max-num-batched-tokens": 8192, "max-num-seqs": 1024}
    source = json.loads((RESULTS / MEASURED[case]).read_text())
    model = load_model(str(fb.case_spec(case, Path(tempfile.mkdtemp()), source["layers"])))
    with fb.long_context():
        items = {i.name: i for i in fit(FitRequest(model, "H100", "vllm==0.34.0", 1, flags)).items}
    growth = items["torch reserve growth"]
    assert growth.bytes == sim and abs(sim - measured) <= growth.error_bytes, (sim / MIB, measured / MIB)


def test_the_reference_grows_past_its_transient_peak_and_the_simulation_says_why():
    """On the reference at 8192 tokens the measured growth is 1.7x the transient peak: the
    sampler's float32 logits (1024 rows x 128256 x 4 B) are larger than every block the layers
    freed, so they take a segment of their own beside the layers'. The simulation shows it: the
    reserve's peak comes after the last float32 copy is requested, and without the sampler's
    float32 copy the growth falls to within the layers' segments."""
    sim, measured, transient = _case("reference")
    assert measured > 1.5 * transient and sim > 1.5 * transient
    source = json.loads((RESULTS / MEASURED["reference"]).read_text())
    model = load_model(str(fb.case_spec("reference", Path(tempfile.mkdtemp()), source["layers"])))
    rule = sampler_rule("vllm", "0.34.0").rule
    ops = sizing_step_requests(model, 1, 8192, 1024, rule)
    f32 = 1024 * model.vocab * 4
    assert sum(n == f32 for n, _ in ops) == rule.fp32_copies
    copies = {i for n, i in ops if n == f32}
    pool = PoolSim()
    pool.run([(n, i) for n, i in ops if i not in copies], {})
    assert sim - pool.peak_reserved >= f32 - 2 * MIB


def test_vllm_034_keeps_the_larger_of_the_peak_and_the_growth_free():
    """measure_kv_cache_bytes: ``available -= max(transient_peak, torch_reserve_growth)``."""
    rule = rules()["vllm-extensible"]
    init_free, weights, other, graph, peak = 80 * GIB, 60 * GIB, 9 * GIB, 1 * GIB, 2 * GIB
    base = dict(weights=weights, non_torch=other, activation=peak, graph=graph)
    below = sizing.vllm_after_capture(rule, 80 * GIB, init_free, reserve_growth=peak // 2, **base)
    assert below == sizing.vllm_after_capture(rule, 80 * GIB, init_free, **base)
    above = sizing.vllm_after_capture(rule, 80 * GIB, init_free, reserve_growth=3 * GIB, **base)
    assert below - above == 3 * GIB - peak


def test_fit_prices_the_growth_for_034_only_and_takes_it_from_the_kv_cache():
    """The 0.34.0 result has a "torch reserve growth" item (estimated, its error bar the
    activation items' fraction of it or its excess over the transient peak, the larger);
    0.33.0 sizes before capture and has none."""
    model = load_model(str(Path(__file__).resolve().parent.parent / "planner/data/configs/llama-3.1-8b.json"))
    r = fit(FitRequest(model, "H100", "vllm==0.34.0", 1, {"max-model-len": 8192}))
    items = {i.name: i for i in r.items}
    growth, act = items["torch reserve growth"], items["activation peak"]
    assert growth.status == "estimated" and growth.bytes > act.bytes
    assert growth.error_bytes == max(growth.bytes // 2, growth.bytes - act.bytes)
    assert "planner/fit/reserve.py" in growth.source
    old = fit(FitRequest(model, "H100", "vllm==0.33.0", 1, {"max-model-len": 8192}))
    assert "torch reserve growth" not in {i.name for i in old.items}
