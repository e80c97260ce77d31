"""bench/fit_bench.py's runner side on the device (issue 52, item 6): the vLLM 0.34.0-shaped
runner sizes a case model's KV cache (0.34.0: after capture; 0.33.0-shaped: the estimate
deducted before it), and the SGLang 0.5.23-shaped one its static pool (before the decode
graphs), every figure measured, and fit's rule fed those figures gives its blocks.
Run on the device: ``python -m pytest -m gpu -q -s tests/test_gpu_fit_bench.py``; the whole
comparison is ``python -m bench.fit_bench`` (``--releases sglang==0.5.23``)."""

from __future__ import annotations

import json

import pytest

from bench_modules import bench_module

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("release", ["vllm==0.34.0", "vllm==0.33.0"])
def test_the_runner_sizes_a_case_models_kv_cache_on_the_device(release):
    fb = bench_module("fit_bench")
    got = fb.fresh_child("qwen2_moe", 32, release)  # a start-up's own process, as the bench runs it
    assert "error" not in got, got["error"]
    print(json.dumps(got, indent=1))
    r, s = got["runner"], got["settings"]
    m = r["measured"]
    assert m["graphs"] == len(s["capture_sizes"]) == 51  # one FULL decode graph per default size
    assert r["weights_bytes"] > 0 and m["committed_bytes"] > 0
    assert r["activation_peak_bytes"] > 0  # profile_run's peak: measured
    assert r["graph_bytes"] > 0 and r["graph_pool_bytes"] > 0
    assert r["blocks"] > 0 and r["kv_tokens"] == r["blocks"] * s["block_size"]
    if release == "vllm==0.34.0":
        assert r["graph_estimate_bytes"] == 0 and r["transient_peak_bytes"] >= r["activation_peak_bytes"]
    else:
        assert r["graph_estimate_bytes"] > 0
    check = fb.rule_check(r, release)
    grew = r["torch_reserve_growth_bytes"] > r["transient_peak_bytes"]  # fit takes it as 0
    assert check["blocks"] == r["blocks"] or grew, check


def test_the_sglang_runner_sizes_a_case_models_pool_on_the_device():
    """SGLang 0.5.23's defaults for the device (H100/H200: 36 decode sizes up to 256), the pool
    sized from the free memory after loading less the static slack, every decode size captured,
    the graphs' drop holding the shared logits buffer, and fit's rule on the measured items
    giving the runner's tokens."""
    fb, sgl = bench_module("fit_bench"), bench_module("fit_bench_sglang")
    # a fresh process: in a test session's, earlier tests' garbage freed during the capture and
    # their capture stream's cuBLAS workspace made the drop smaller than the logits buffer (H100)
    got = fb.fresh_child("qwen2_moe", 32, sgl.RELEASE)
    assert "error" not in got, got["error"]
    print(json.dumps(got, indent=1))
    r, s = got["runner"], got["settings"]
    m = r["measured"]
    assert m["graphs"] == len(s["cuda_graph_bs"]) == 36 and s["disable_prefill_cuda_graph"]
    assert r["weights_bytes"] > 0 and m["committed_bytes"] > 0 and r["activation_peak_bytes"] > 0
    assert r["graph_bytes"] >= m["logits_buffer_bytes"] > 0 and r["graph_pool_bytes"] > 0
    assert r["kv_tokens"] == r["blocks"] == m["rest_bytes"] // m["kv_cell_bytes"] > 0
    assert sgl.rule_check(r)["blocks"] == r["blocks"]
