"""vLLM 0.34.0's start-up sized on the GPU by the engine-faithful runner and worker
(tests/engines/vllm_runner_034.py, vllm_worker_034.py; no plugin): the profiling run's
activation peak measured, the capture measured, the extensible KV cache sized from what
capture left, reported as one record (tests/engines/sizing.py) a bench writes beside
``planner fit``'s figures. Run on the device:
``python -m pytest -m gpu -q -s tests/test_gpu_runner_sizing.py``."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.gpu
SIZES = [1, 2, 4, 8, 16, 32]
HIDDEN = 1024
BLOCK_SIZE = 16


@pytest.mark.parametrize("extensible", [True, False], ids=["extensible", "estimate"])
def test_the_034_runner_sizes_its_kv_cache_on_the_device(monkeypatch, tmp_path, extensible):
    import torch

    from engines.plugged import vllm_release
    from engines.sizing import RunnerSizing, vllm_034
    from engines.toy import ToyModel

    module = vllm_release(monkeypatch, tmp_path, version="0.34.0", fits=False)
    torch.cuda.empty_cache()
    snapshot = module.MemorySnapshot().measure()  # init_device's, before the model is loaded
    before = torch.cuda.mem_get_info()[0]
    model = ToyModel({"piecewise": 1}, max_tokens=4096, hidden=HIDDEN, device=torch.device("cuda"))
    torch.cuda.synchronize()
    weights = before - torch.cuda.mem_get_info()[0]
    module.reset_globals()
    runner = module.GPUModelRunner(model, SIZES, extensible_kv_cache=extensible)
    runner.model_memory_usage = weights
    block_bytes = 2 * BLOCK_SIZE * HIDDEN * 2 * len(model.wp)  # K and V, bf16, a layer per piece
    requested = int(snapshot.total_memory * 0.5)
    worker = module.Worker(runner, block_bytes=block_bytes, requested_memory=requested, init_snapshot=snapshot)
    worker.determine_available_memory()
    worker.initialize_from_config()
    blocks = worker.compile_or_warm_up_model()
    try:
        got = vllm_034(worker, blocks, block_size=BLOCK_SIZE, weights_bytes=weights)
        print(json.dumps(json.loads(got.to_json()), indent=1))
        assert isinstance(got, RunnerSizing) and got.kv_tokens == blocks * BLOCK_SIZE
        # the toy's forward at 4096 tokens and its sampler passes allocate: a measured peak
        assert got.activation_peak_bytes >= 4096 * HIDDEN * 4
        assert got.graph_bytes > 0 and got.graph_pool_bytes > 0
        if extensible:
            assert got.graph_estimate_bytes == 0 and got.transient_peak_bytes >= got.activation_peak_bytes
            free = runner.extensible_kv_cache.free_memory_measured
            margin = max(module.KV_CACHE_MARGIN_FLOOR_BYTES, int(got.transient_peak_bytes * 0.75))
            used = snapshot.free_memory - free
            available = min(requested - used, free - margin)
            available -= max(got.transient_peak_bytes, got.torch_reserve_growth_bytes)
            assert blocks == max(available, 0) // block_bytes
        else:  # 0.33.0's estimate, taken before the cache and kept out of it
            assert got.graph_estimate_bytes > 0
            budget = requested - worker.profile_result.non_kv_cache_memory - got.graph_estimate_bytes
            assert blocks == budget // block_bytes
    finally:
        runner.release()
