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
from capture_plan.planner.fit.estimate import moe_workspace
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
    "llama": "fit-bench-2026-12-07-vllm-cases-034.json",
    "qwen2": "fit-bench-2026-12-07-vllm-cases-034.json",
    "mixtral": "fit-bench-2026-12-07-vllm-cases-034.json",
    "gemma2": "fit-bench-2026-12-07-vllm-cases-034.json",
    "qwen2_moe": "fit-bench-2026-12-07-vllm-cases-034.json",
    "reference": "fit-bench-2026-12-07-vllm-refs-own.json",
}
#: where the simulation meets the measured growth to the MiB: the reference's since its weights
#: are made in tensors of their own size (ReferenceConfig.own_segments: before, the freed float32
#: draws left free space in the weights' segments that the step reused, 64 MiB less growth);
#: elsewhere (Gemma 2, 162 MiB over) something before the profile pins what the step reuses
#: (planner/fit/reserve.py's docstring), not the layers' order (tests/test_engine_layers.py)
EXACT = {"llama", "qwen2", "mixtral", "qwen2_moe", "reference"}


def _case(case: str):
    """(fit's torch reserve growth item, measured growth, measured transient peak) of the
    case's 0.34.0 run, fit given the run's settings on the run's device (a transformers case's
    spec is written from its transformers config: skipped without it)."""
    if case != "reference":
        pytest.importorskip("transformers")
    source = json.loads((RESULTS / MEASURED[case]).read_text())
    row = source["cases"][case]["vllm==0.34.0"]
    s = fb.Settings(**{**row["settings"], "capture_sizes": tuple(row["settings"]["capture_sizes"])})
    model = load_model(str(fb.case_spec(case, Path(tempfile.mkdtemp()), source["layers"])))
    with fb.long_context():
        res = fit(FitRequest(model, row["device"]["device"], "vllm==0.34.0", 1, fb.fit_flags(s)))
    growth = next(i for i in res.items if i.name == "torch reserve growth")
    runner = row["runner"]
    return growth, runner["torch_reserve_growth_bytes"], runner["transient_peak_bytes"]


@pytest.mark.parametrize("case", sorted(MEASURED))
def test_the_simulated_growth_meets_the_runners_measured_growth_within_its_error_bar(case):
    """The runner (tests/engines/vllm_worker_034.py ``_measure_sizing_step``, the release's
    reading of the reserve around its sizing step) measured its growth on an H100. fit's
    simulation, after the profiling run and an emptied cache, meets it where nothing from
    before the profile pins a segment the step reuses (the Qwen2-MoE case's segment that the
    profile's kept scratch pins is simulated), and is within the item's error bar everywhere
    (what fit's KV cache is held to)."""
    growth, measured, _ = _case(case)
    if case in EXACT:
        assert abs(growth.bytes - measured) < 1 * MIB, (growth.bytes / MIB, measured / MIB)
    assert abs(growth.bytes - measured) <= growth.error_bytes, (growth.bytes / MIB, measured / MIB)


def test_what_the_profile_keeps_pins_a_segment_the_step_reuses():
    """Qwen2-MoE at 8192 tokens: the profiling run's Triton top-k/top-p scratch (132 x 32000
    float32 on an H100) lands in a segment of the shared expert's gate_up while the float32
    copies hold the larger ones; the emptied cache keeps that segment, and the sizing step's
    requests fit in its free space: less growth than from an empty cache (the runner measured
    the lower figure)."""
    pytest.importorskip("transformers")
    source = json.loads((RESULTS / MEASURED["qwen2_moe"]).read_text())
    model = load_model(str(fb.case_spec("qwen2_moe", Path(tempfile.mkdtemp()), source["layers"])))
    rule = sampler_rule("vllm", "0.34.0").rule
    made = (moe_workspace(model, 1, 8192), 132 * model.vocab * 4)  # the workspace, the scratch
    bare = sizing_step_growth(model, 1, 8192, 1024, rule)
    kept = sizing_step_growth(model, 1, 8192, 1024, rule, made)
    assert bare - kept > 64 * MIB
    measured = source["cases"]["qwen2_moe"]["vllm==0.34.0"]["runner"]["torch_reserve_growth_bytes"]
    assert kept == measured


def test_the_reference_grows_past_its_transient_peak_and_the_simulation_says_why():
    """On the reference at 8192 tokens the measured growth is 1.7x the transient peak: the
    sampler's float32 logits (1024 rows x 128256 x 4 B) are larger than every block the layers
    freed, so they take a segment of their own beside the layers'. The simulation shows it:
    without the sampler's float32 copy the reserve's peak falls by that copy's size."""
    growth, measured, transient = _case("reference")
    sim = growth.bytes
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


def test_fit_prices_the_growth_for_034_only():
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
