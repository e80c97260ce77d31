"""vLLM 0.34.0's runner and worker start-up (tests/engines/vllm_runner_034.py,
vllm_worker_034.py), on CPU with CUDA faked, as far as the KV cache's size: what
``capture_model`` measures (encoder graphs, the model state's inner graphs, the cache
emptied around the measurement), the profiling run's measured activation peak, the graph
estimate's switch (``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``), the extensible KV cache's
margin floor, transient peak and torch reserve growth, the draft decode manager's mode and
``specialize_spec_tokens``. The device's memory is a script (:class:`Device`): what each step
allocates, caches and keeps is the test's, so each figure is checked against arithmetic."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from engines import harness  # noqa: E402
from engines.plugged import vllm_release  # noqa: E402
from engines.toy import ToyModel  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SIZES = [1, 2, 4, 8]
GIB, MIB = 1 << 30, 1 << 20
TOTAL = 80 * GIB


class Device:
    """The fake device's memory: allocated (torch's current and peak), cached (reserved,
    not allocated) and outside torch (graphs); ``mem_get_info``, ``memory_stats``,
    ``memory_reserved``, ``empty_cache`` and ``reset_peak_memory_stats`` read it. Every
    call is logged in ``calls``."""

    def __init__(self, monkeypatch, used: int = 20 * GIB):
        self.allocated = self.peak = self.cached = 0
        self.outside = used
        self.peak_reserved = 0
        self.calls: list[str] = []
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "mem_get_info", self.mem_get_info)
        monkeypatch.setattr(cuda, "memory_stats", self.memory_stats)
        monkeypatch.setattr(cuda, "memory_reserved", lambda d=None: self.allocated + self.cached)
        monkeypatch.setattr(cuda, "empty_cache", self.empty_cache)
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", self.reset_peak)

    def mem_get_info(self, device=None):
        self.calls.append("mem_get_info")
        return TOTAL - self.outside - self.allocated - self.cached, TOTAL

    def memory_stats(self, device=None):
        return {
            "allocated_bytes.all.current": self.allocated,
            "allocated_bytes.all.peak": self.peak,
            "reserved_bytes.all.current": self.allocated + self.cached,
            "reserved_bytes.all.peak": self.peak_reserved,
        }

    def empty_cache(self):
        self.calls.append("empty_cache")
        self.cached = 0

    def reset_peak(self, device=None):
        self.peak, self.peak_reserved = self.allocated, self.allocated + self.cached

    def transient(self, nbytes: int, keep_cached: bool = True):
        """A step's temporaries: allocated, then freed into the cache."""
        grow = max(nbytes - self.cached, 0)
        self.cached -= nbytes - grow
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.allocated + self.cached)
        self.allocated -= nbytes
        self.cached += nbytes if keep_cached else 0


def _runner(module, fake, **kw):
    model = ToyModel({"piecewise": 1}, max_tokens=max(SIZES) * harness.DRAFT_QUERY, fake=fake)
    module.reset_globals()
    return module.GPUModelRunner(model, SIZES, ubatch_stream=torch.cuda.Stream(), **kw)


def test_capture_model_measures_encoder_and_inner_graphs_with_the_cache_emptied_around(fake, monkeypatch, tmp_path):
    """0.34.0's capture_model also captures the encoder's graphs and the model state's inner
    graphs, and empties the cache before its first and after its last free-memory reading:
    the runner measured the two managers only, so a model with encoder or inner graphs made
    vLLM's figure (and the plugin's capture-gap check) differ from the runner's (fails before:
    no encoder or inner graphs captured, the drop 2 GiB short and the warm-ups' cache in it)."""
    module = vllm_release(monkeypatch, tmp_path, version="0.34.0", fits=False)
    dev = Device(monkeypatch)
    dev.cached = 3 * GIB  # the profiling run's cache: emptied before the first reading
    encoded = []

    def encoder(tokens):
        encoded.append(tokens)
        if fake.recording is not None:
            dev.outside += 256 * MIB  # each encoder graph's memory
        return torch.zeros(tokens, 4)

    def inner(stream):
        dev.outside += 1 * GIB  # the model state's inner graphs, on the model graphs' stream
        dev.cached += 5 * GIB  # warm-up activations cached on the capture stream: emptied after
        inner.stream = stream

    state = module.ModelState(module.EncoderRunner(encoder, budgets=[64, 256, 1024, 4096]), inner)
    runner = _runner(module, fake, model_state=state)
    took = runner.capture_model()
    assert sorted(state.encoder_runner.graphs) == [64, 256, 1024, 4096] and inner.stream is not None
    assert took == 4 * 256 * MIB + GIB  # the toy's FULL graphs take nothing on this device
    assert dev.calls[0] == "empty_cache" and dev.calls[1] == "mem_get_info"
    assert dev.calls[-2:] == ["empty_cache", "mem_get_info"]
    runner.release()


def test_capture_model_with_nothing_to_capture_measures_nothing(fake, monkeypatch, tmp_path):
    module = vllm_release(monkeypatch, tmp_path, version="0.34.0", fits=False)
    dev = Device(monkeypatch)
    runner = _runner(module, fake, cudagraph_mode=module.NO_GRAPHS)
    assert runner.capture_model() == 0 and dev.calls == []


def _worker(module, runner, **kw):
    return module.Worker(runner, block_bytes=2 * MIB, requested_memory=int(TOTAL * 0.9), **kw)


def test_the_profiling_run_measures_the_activation_peak_and_the_kv_cache_keeps_it_free(fake, monkeypatch, tmp_path):
    """The worker's profiling run (profile_run: the dummy run at max_num_batched_tokens, the
    dummy sampler run) is measured, not assumed: its allocated peak less what stays is the
    activation peak, kept free by the extensible KV cache beside the margin floor and the
    sizing warm-up's reserve growth (extensible_kv_cache.py measure_kv_cache_bytes). Fails
    before: the peak was 0, no margin and no growth, the cache 3.5 GiB larger."""
    module = vllm_release(monkeypatch, tmp_path, version="0.34.0", fits=False)
    dev = Device(monkeypatch)
    runner = _runner(module, fake)
    steps = []
    real_dummy_run = runner._dummy_run

    def dummy_run(num_tokens):
        steps.append(num_tokens)
        dev.transient(GIB + 512 * MIB)  # the forward's activations at the largest step
        return real_dummy_run(num_tokens)

    monkeypatch.setattr(runner, "_dummy_run", dummy_run)
    monkeypatch.setattr(runner, "_dummy_sampler_run", lambda h: (steps.append("sampler"), dev.transient(512 * MIB)))
    worker = _worker(module, runner)
    kv_budget = worker.determine_available_memory()
    assert steps == [runner.max_num_tokens, "sampler"]  # profile_run: the dummy run, then the sampler's
    assert worker.peak_activation_memory == GIB + 512 * MIB  # the peak: measured (estimate 0: extensible)
    assert kv_budget == int(TOTAL * 0.9) - GIB - 512 * MIB  # nothing consumed beyond the peak here
    worker.initialize_from_config()
    kv = runner.extensible_kv_cache
    assert kv.reserved_headroom_bytes == GIB + 512 * MIB

    def growth_step():  # the sizing warm-up: fragmentation grows torch's reserve beyond the peak
        dev.transient(GIB + 512 * MIB, keep_cached=False)
        dev.peak_reserved += 2 * GIB

    monkeypatch.setattr(worker, "_sizing_step", growth_step)
    blocks = worker.compile_or_warm_up_model()
    assert kv.torch_reserve_growth_bytes == 2 * GIB + GIB + 512 * MIB
    free = TOTAL - 20 * GIB
    margin = max(GIB, int((GIB + 512 * MIB) * 0.75))
    available = min(int(TOTAL * 0.9), free - margin) - (3 * GIB + 512 * MIB)
    assert blocks == available // (2 * MIB)
    runner.release()


@pytest.mark.parametrize("flag", ["1", "0"])
def test_the_graph_estimate_follows_vllms_switch(fake, monkeypatch, tmp_path, flag):
    """VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0 skips the estimate (gpu_worker.py): the KV
    budget before capture is then the request less the profiled memory alone, and the
    estimate's throwaway capture does not run. Fails before: the switch was ignored."""
    module = vllm_release(monkeypatch, tmp_path, version="0.34.0", fits=False)
    Device(monkeypatch)
    monkeypatch.setenv("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", flag)
    runner = _runner(module, fake, extensible_kv_cache=False)
    asked = []
    monkeypatch.setattr(runner, "profile_cudagraph_memory", lambda: asked.append(1) or 3 * GIB)
    worker = _worker(module, runner)
    budget = worker.determine_available_memory()
    estimate = 3 * GIB if flag == "1" else 0
    assert asked == ([1] if flag == "1" else []) and worker.cudagraph_memory_estimate == estimate
    assert budget == int(TOTAL * 0.9) - estimate
    runner.release()


def test_the_draft_decode_manager_follows_the_models_decode_mode(fake, monkeypatch, tmp_path):
    """speculator.py init_cudagraph_manager: PIECEWISE graphs are not supported for draft
    decodes, so the draft decode manager is FULL_DECODE_ONLY only where the model's decode
    mode is FULL, else it captures nothing (fails before: always FULL_DECODE_ONLY)."""
    module = vllm_release(monkeypatch, tmp_path, version="0.34.0", fits=False)
    full = _runner(module, fake, draft=ToyModel({"piecewise": 1}, max_tokens=32, fake=fake))
    assert full.speculator.decode_cudagraph_manager.cudagraph_mode == module.FULL_DECODE_ONLY
    assert full.speculator.decode_cudagraph_manager.needs_capture()
    piecewise = (module.CUDAGraphMode.NONE, module.CUDAGraphMode.PIECEWISE)
    pw = _runner(module, fake, cudagraph_mode=piecewise, draft=ToyModel({"piecewise": 1}, max_tokens=32, fake=fake))
    assert not pw.speculator.decode_cudagraph_manager.needs_capture()


def test_specialize_spec_tokens_captures_a_draft_decode_graph_per_count(fake, monkeypatch, tmp_path):
    """With the fused multi-step decode and dynamic speculative decoding, the draft decode
    manager captures one graph per speculative-token count of 2 or more, largest first,
    for every descriptor (autoregressive/cudagraph_utils.py); a count without a graph runs
    eagerly. Fails before: the flag was ignored, one graph per descriptor."""
    module = vllm_release(monkeypatch, tmp_path, version="0.34.0", fits=False)
    Device(monkeypatch)
    options = {"supports_decode_metadata_update": True, "dynamic_schedule": (1, 2, 3, 3)}
    draft = ToyModel({"piecewise": 1}, max_tokens=32, fake=fake)
    runner = _runner(module, fake, draft=draft, speculator_options=options)
    manager = runner.speculator.decode_cudagraph_manager
    plain = [d for descs in manager._capture_descs.values() for d in descs]
    runner.capture_model()
    counts = [(d.num_reqs, d.num_speculative_tokens) for d in manager.graphs]
    assert counts == [(d.num_reqs, k) for d in plain for k in (3, 2)]
    desc = plain[0]
    assert manager.specialize_spec_tokens(desc, 2).num_speculative_tokens == 2
    assert manager.specialize_spec_tokens(desc, 5).cg_mode == module.CUDAGraphMode.NONE
    runner.release()


def _release_function(name: str) -> ast.FunctionDef:
    from test_engine_contract import wheel_source

    tree = ast.parse(wheel_source("vllm", "0.34.0", "vllm/v1/worker/extensible_kv_cache.py"))
    return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), tree


def test_measure_kv_cache_bytes_is_the_releases(monkeypatch, tmp_path):
    """The runner's measure_kv_cache_bytes and its CUDA constants against the 0.34.0 wheel's
    own function, run on the same inputs (read from the wheel with ast: nothing installed)."""
    module = vllm_release(monkeypatch, tmp_path, version="0.34.0", fits=False)
    fn, tree = _release_function("measure_kv_cache_bytes")
    consts = {
        t.id: v
        for n in tree.body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name) and t.id.startswith("KV_CACHE_")
        for v in [ast.unparse(n.value)]
    }
    assert consts["KV_CACHE_MARGIN_FLOOR_BYTES"] == "(3 if current_platform.is_rocm() else 1) << 30"
    assert consts["KV_CACHE_NON_TORCH_RESERVE_BYTES"] == "(2 if current_platform.is_rocm() else 1) << 29"
    assert float(consts["KV_CACHE_MARGIN_FRACTION"]) == module.KV_CACHE_MARGIN_FRACTION
    assert (module.KV_CACHE_MARGIN_FLOOR_BYTES, module.KV_CACHE_NON_TORCH_RESERVE_BYTES) == (1 << 30, 1 << 29)
    space = {"KV_CACHE_MARGIN_FLOOR_BYTES": 1 << 30, "KV_CACHE_MARGIN_FRACTION": module.KV_CACHE_MARGIN_FRACTION}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "extensible_kv_cache.py", "exec"), space)
    theirs = space["measure_kv_cache_bytes"]
    for init_free, free, committed, requested, peak, growth in [
        (70 * GIB, 40 * GIB, 0, 72 * GIB, 0, 0),
        (70 * GIB, 40 * GIB, 0, 72 * GIB, 3 * GIB, 5 * GIB),
        (70 * GIB, 40 * GIB, 2 * GIB, 30 * GIB, 2 * GIB, GIB),
        (70 * GIB, GIB // 2, 0, 72 * GIB, 0, 0),
    ]:
        kw = dict(
            init_free_memory=init_free,
            free_memory=free,
            committed_bytes=committed,
            requested_memory=requested,
            transient_peak_bytes=peak,
            torch_reserve_growth_bytes=growth,
        )
        assert module.measure_kv_cache_bytes(**kw) == theirs(**kw)
