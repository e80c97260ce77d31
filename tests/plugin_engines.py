"""Runners shaped as SGLang 0.5.23's and vLLM 0.33.0's capture, placed under the engines'
module paths (``monkeypatch.setitem(sys.modules, ...)``), for the plugin tests on the CPU
(tests/test_plugins.py, CUDA faked) and on the GPU (tests/test_gpu_plugins.py). Their
class, method and parameter names are the releases' (rows of
capture_plan.adapters.plugins.hooks, checked against the wheels by
tests/test_engine_contract.py); their bodies keep the shape of the releases' capture:

* SGLang: ``capture`` -> ``FullCudaGraphBackend.capture_session(stream)`` (the one global
  pool and capture stream) -> ``_capture_one_stream`` over ``reversed(capture_bs)`` x LoRA
  variants -> ``capture_one_shape`` -> ``FullCudaGraphBackend.capture_one``: 2 warm-ups
  after a synchronize, ``device_module.graph(cuda_graph=, pool=, stream=)``, graph and
  output stored under the shape key;
* vLLM: ``CudaGraphManager.capture`` over the FULL descriptors largest-first on a stream
  of its own, per descriptor ``create_forward_fn(desc, warmup=True)`` run once, then
  ``torch.cuda.graph(graph, self.pool, stream=...)``; ``ModelCudaGraphManager`` stores the
  outputs in one persistent hidden-state buffer made from the first warm-up;
  ``GPUModelRunner.profile_cudagraph_memory``.

``model`` is anything with ``forward(bs) -> tensor``.
"""

from __future__ import annotations

import contextlib
import sys
import types
from dataclasses import dataclass

import torch

from capture_plan.adapters.plugins import core, sglang as sgl_plugin, vllm as vllm_plugin
from capture_plan.adapters.plugins.hooks import hook


def _module(monkeypatch, name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(mod, k, v)
    monkeypatch.setitem(sys.modules, name, mod)
    return mod


# -- SGLang 0.5.23, shaped -----------------------------------------------------------------------


def sglang_engine(monkeypatch, *, fits: bool = True):
    """SGLang's decode runner and backend under their module paths, shaped as in 0.5.23."""
    global_pool: list = []

    class FullCudaGraphBackend:
        def __init__(self, cuda_graph_runner):
            self._graphs, self._outputs, self._pool = {}, {}, None
            self._cuda_graph_runner = cuda_graph_runner
            self._device_module = torch.cuda
            self._capture_stream = None

        @contextlib.contextmanager
        def capture_session(self, stream):
            if self._pool is None:
                if not global_pool:
                    global_pool.append(torch.cuda.graph_pool_handle())
                self._pool = global_pool[0]
            self._capture_stream = stream
            try:
                yield
            finally:
                self._capture_stream = None

        def capture_one(self, shape_key, forward_fn, capture_inputs=None, post_warmup_hook=None):
            for _ in range(2):
                self._device_module.synchronize()
                output = forward_fn()
                del output
            graph = torch.cuda.CUDAGraph()
            with self._device_module.graph(cuda_graph=graph, pool=self._pool, stream=self._capture_stream):
                out = forward_fn()
            self._graphs[shape_key] = graph
            self._outputs[shape_key] = out

        def cleanup(self):
            for g in self._graphs.values():
                g.reset()
            self._graphs.clear()
            self._outputs.clear()
            self._pool = None

    @dataclass
    class Mode:
        name: str

    capture_stream = torch.cuda.Stream()

    class DecodeCudaGraphRunner:
        def __init__(self, model_runner, model, capture_bs, mode="DECODE"):
            self.model_runner, self.model, self.capture_bs = model_runner, model, list(capture_bs)
            self.capture_forward_mode = Mode(mode)
            self.backend = FullCudaGraphBackend(self)
            self.record_nolora_graph = False

        def capture(self):
            self.stream = capture_stream  # get_or_create_global_graph_capture_stream()
            with self.backend.capture_session(self.stream):
                self._capture_one_stream()

        def _capture_one_stream(self, stream_idx=None):
            lora_variants = ("lora", "nolora") if self.record_nolora_graph else (None,)
            for bs in reversed(self.capture_bs):
                for variant_label in lora_variants:
                    self.capture_one_shape(bs, self.model.forward, stream_idx, variant_label, None)

        def capture_one_shape(self, size, forward, stream_idx=None, variant_label=None, attention_variant=None):
            self.backend.capture_one((size, variant_label), lambda: forward(size))

    class EAGLEDraftCudaGraphRunner(DecodeCudaGraphRunner):
        pass

    h = hook("sglang", "0.5.23", "DecodeCudaGraphRunner")
    _module(monkeypatch, h.module, DecodeCudaGraphRunner=DecodeCudaGraphRunner)
    h = hook("sglang", "0.5.23", "FullCudaGraphBackend")
    _module(monkeypatch, h.module, FullCudaGraphBackend=FullCudaGraphBackend)
    h = hook("sglang", "0.5.23", "EAGLEDraftCudaGraphRunner")
    _module(monkeypatch, h.module, EAGLEDraftCudaGraphRunner=EAGLEDraftCudaGraphRunner)
    monkeypatch.setattr(core, "installed", lambda dist: "0.5.23")
    if fits:  # the fake machine fits the plan; on a GPU the real check runs
        monkeypatch.setattr(sgl_plugin, "_env_problems", lambda plan: [])
    return DecodeCudaGraphRunner, FullCudaGraphBackend


# -- vLLM 0.33.0, shaped --------------------------------------------------------------------------


def vllm_engine(monkeypatch, device: str = "cpu", *, fits: bool = True):
    @dataclass(frozen=True)
    class Mode:
        name: str

    FULL = Mode("FULL")

    @dataclass(frozen=True)
    class BatchExecutionDescriptor:
        cg_mode: Mode
        num_tokens: int
        num_reqs: int | None

    class CudaGraphManager:
        def __init__(self, vllm_config, device, cudagraph_mode, decode_query_len, lora_capture_cases=None,
                     varlen_decode=False, ubatch_runner=None):  # fmt: skip
            self.vllm_config, self.decode_query_len = vllm_config, decode_query_len
            self.graphs: dict = {}
            self.pool = torch.cuda.graph_pool_handle()  # current_platform.get_global_graph_pool()
            sizes = vllm_config.sizes
            self._capture_descs = {FULL: [BatchExecutionDescriptor(FULL, n, n) for n in sorted(sizes, reverse=True)]}

        def capture(self, create_forward_fn, progress_bar_desc="Capturing CUDA graphs"):
            stream = torch.cuda.Stream()  # graph_capture(device)
            with torch.cuda.stream(stream):
                for desc in self._capture_descs[FULL]:
                    forward_fn = create_forward_fn(desc, warmup=True)
                    forward_fn(None)
                    forward_fn = create_forward_fn(desc, warmup=False)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, self.pool, stream=stream):
                        forward_fn(None)
                    self.graphs[desc] = graph

        def release_graphs(self):
            self.graphs.clear()

    class ModelCudaGraphManager(CudaGraphManager):
        hidden_states = None

        def capture(self, model, *args, **kw):
            def store(n, out):
                if self.hidden_states is None:
                    self.hidden_states = torch.empty_like(out)
                self.hidden_states[:n] = out

            def create_forward_fn(desc, warmup):
                return lambda mode: store(desc.num_tokens, model.forward(desc.num_tokens))

            super().capture(create_forward_fn)

    class GPUModelRunner:
        def __init__(self, vllm_config):
            self.vllm_config = vllm_config
            self.cudagraph_manager = ModelCudaGraphManager(vllm_config, device, FULL, 1)

        def profile_cudagraph_memory(self):
            return 12345

    h = hook("vllm", "0.33.0", "CudaGraphManager")
    _module(monkeypatch, h.module, CudaGraphManager=CudaGraphManager, ModelCudaGraphManager=ModelCudaGraphManager)
    h = hook("vllm", "0.33.0", "GPUModelRunner.profile_cudagraph_memory")
    _module(monkeypatch, h.module, GPUModelRunner=GPUModelRunner)
    monkeypatch.setattr(core, "installed", lambda dist: "0.33.0")
    if fits:
        monkeypatch.setattr(vllm_plugin, "_env_problems", lambda plan: [])
    return GPUModelRunner, CudaGraphManager
