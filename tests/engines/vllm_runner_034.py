"""vLLM 0.34.0's graph capture (the V2 model runner), as the release changed 0.33.0's.

Run over the namespace of tests/engines/vllm_runner.py as it was before the adoption
(:func:`engines.plugged.release` with ``version="0.34.0"``): what this file defines
replaces 0.33.0's, the rest (the piece wrappers, the forward context, the global pool,
the profiling pass) is 0.33.0's, which 0.34.0 kept. The names it uses from there are
imported for the type checker only.

Facts from the released wheel (vllm==0.34.0; this code is our own, its class, method and
parameter names the release's where the plugin hooks them):

* ``config/compilation.py``: ``decode_cudagraph_capture_shapes(sizes, query_lens,
  max_tokens)``: the (requests, query length) uniform-decode graphs, each query length up
  to the requests it maps to and ``max_tokens // q``, the first size above that limit
  captured at the limit; ``decode_cudagraph_capture_grid(max_requests)``: every count up
  to 6, then a step of the largest power of two not above ``0.65 * n ** (2/3)``.
* ``config/vllm.py`` ``_split_cudagraph_capture_sizes``: off SM100 and without explicit
  sizes, prefill (token-keyed) graphs take the shared sizes, decode graphs the request
  counts ``min(cdiv(s, q), max_num_seqs)`` of the shared sizes ``s`` whose rounded-up
  tokens fit; ``get_draft_decode_cudagraph_request_sizes``: the draft decode manager's
  own grid up to ``max_num_seqs`` (EAGLE/MTP with 2 or more speculative tokens).
* ``v1/worker/gpu/cudagraph_utils.py``: ``CudaGraphManager.__init__(..., decode_query_lens,
  ..., decode_request_sizes=None)``; ``_init_candidates`` builds the decode descriptors
  (each followed by its micro-batch twin), then the token-keyed ones, sorts each mode
  largest first (stable); ``capture(create_forward_fn, progress_bar_desc, stream=None)``
  records on ``stream`` (a new one where None: ``graph_capture``) and keeps it as
  ``self.capture_stream``; the order is 0.33.0's (PIECEWISE, then FULL).
  ``ModelCudaGraphManager.capture`` lost ``has_lora``; ``store_capture_output`` sizes the
  persistent hidden states up front for the widest descriptor (``persistent_like``).
* ``spec_decode/autoregressive/cudagraph_utils.py``: ``SpeculatorCudaGraphManager``
  (moved here), its ``capture`` takes ``slot_mappings_buffer``;
  ``spec_decode/autoregressive/speculator.py``: ``AutoRegressiveSpeculator.capture``
  (inherited by ``TargetDependentARSpeculator``) and ``init_cudagraph_manager`` (the draft
  decode manager, query length 1, its own request grid).
* ``v1/worker/gpu/model_runner.py`` ``GPUModelRunner.profile_cudagraph_memory``: 0 where
  ``cache_config.enable_extensible_kv_cache`` (on by default on CUDA), else the estimate.
* ``v1/worker/gpu_worker.py``: ``determine_available_memory`` puts the estimate into
  ``peak_activation_memory`` (and subtracts it from the KV budget);
  ``initialize_from_config`` with the extensible KV cache sets
  ``reserved_headroom_bytes = peak_activation_memory``; ``compile_or_warm_up_model``
  captures, then ``measure_kv_cache_blocks`` sizes the cache from the memory free after
  capture less that headroom (``extensible_kv_cache.py``).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # 0.33.0's, in whose namespace this file runs
    from .vllm_runner import (
        FULL_AND_PIECEWISE,
        FULL_DECODE_ONLY,
        BatchDescriptor,
        BatchExecutionDescriptor,
        Config,
        CUDAGraphMode,
        CUDAGraphWrapper,
        PiecewiseModel,
        UBatchRunner,
        get_global_graph_pool,
        profile_cudagraph_memory,
        set_forward_context,
    )

RELEASE = "0.34.0"


def _walk_grid(limit: int, step) -> list[int]:
    grid, size = [], 1
    while size < limit:
        grid.append(size)
        stride = 1 << max(0, math.floor(math.log2(max(1.0, step(size)))))
        size = (size // stride + 1) * stride
    return [*grid, limit] if limit else []


def decode_cudagraph_capture_grid(max_requests: int) -> list[int]:
    return _walk_grid(max_requests, lambda n: 0.65 * n ** (2 / 3))


def decode_cudagraph_capture_shapes(sizes, query_lens, max_tokens) -> list[tuple[int, int]]:
    sizes = sorted(set(sizes))
    shapes: set = set()
    for q, max_reqs in query_lens.items():
        limit = min(max_reqs, max_tokens // q)
        reachable = sizes[: bisect.bisect_left(sizes, limit) + 1]
        shapes.update((min(n, limit), q) for n in reachable if limit >= 1)
    return sorted(shapes, key=lambda shape: (shape[1], shape[0]))


def decode_request_sizes(capture_sizes, query_lens, max_num_seqs) -> list[int]:
    """``_split_cudagraph_capture_sizes``'s default decode request counts of the shared sizes."""
    top = max(capture_sizes)
    return sorted({min(-(-s // q), max_num_seqs) for s in capture_sizes for q in query_lens if -(-s // q) * q <= top})


def persistent_like(x: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """``store_capture_output``'s buffer, ``max_tokens`` rows at least (through
    ``torch.empty_like``: the allocation the fake CUDA counts, as it counts 0.33.0's)."""
    return torch.empty_like(x.new_empty((max(max_tokens, x.shape[0]), *x.shape[1:])))


class CudaGraphManager:
    """cudagraph_utils.py's CudaGraphManager: descriptors, the capture loop, the pool."""

    def __init__(
        self,
        capture_sizes,
        cudagraph_mode=FULL_AND_PIECEWISE,
        decode_query_lens=None,
        *,
        max_num_reqs: int | None = None,
        lora_capture_cases=None,
        ubatch_runner: UBatchRunner | None = None,
        decode_request_sizes=None,
    ):
        self.capture_sizes = sorted(capture_sizes)
        self.max_num_reqs = max_num_reqs or max(capture_sizes)
        self.cudagraph_mode = cudagraph_mode
        query_lens = decode_query_lens or {1: self.max_num_reqs}
        self.decode_max_reqs = {q: min(n, self.max_num_reqs) for q, n in sorted(query_lens.items())}
        self.decode_query_len = max(self.decode_max_reqs)
        self.decode_request_sizes = decode_request_sizes
        self.lora_capture_cases = list(lora_capture_cases or [0])
        self.ubatch_runner = ubatch_runner
        self.graphs: dict = {}
        self.pool = get_global_graph_pool()
        self.use_breakable_cg = False
        self.capture_stream = None
        self._max_full_descs_to_capture = None
        self._capture_mem_samples = None
        self._capture_descs: dict = {}
        #: (descriptor, warmup) of every forward build, in order (the tests read it)
        self.builds: list = []
        self._init_candidates()

    def _maybe_ubatch_twin(self, desc):
        if self.ubatch_runner is None or desc.cg_mode != CUDAGraphMode.FULL or desc.num_reqs is None:
            return None
        uniform, rem = divmod(desc.num_tokens, desc.num_reqs)
        if rem or desc.uniform_token_count not in (None, uniform) or desc.num_tokens < 2:
            return None
        return dataclasses.replace(desc, num_ubatches=2, uniform_token_count=uniform)

    def _init_candidates(self):
        decode_mode, mixed_mode = self.cudagraph_mode
        sizes = self.decode_request_sizes
        if sizes is None:
            sizes = decode_request_sizes(self.capture_sizes, self.decode_max_reqs, self.max_num_reqs)
        max_tokens = max(self.capture_sizes)
        decode_descs, token_keyed = [], []
        if decode_mode:
            for (n, q), loras in itertools.product(
                decode_cudagraph_capture_shapes(sizes, self.decode_max_reqs, max_tokens), self.lora_capture_cases
            ):
                desc = BatchExecutionDescriptor(decode_mode, n * q, n, q, num_active_loras=loras)
                decode_descs.append(desc)
                twin = self._maybe_ubatch_twin(desc)
                if twin is not None:
                    decode_descs.append(twin)
        if mixed_mode:
            for num_tokens, loras in itertools.product(self.capture_sizes, self.lora_capture_cases):
                reqs = None if mixed_mode == CUDAGraphMode.PIECEWISE else min(num_tokens, self.max_num_reqs)
                desc = BatchExecutionDescriptor(mixed_mode, num_tokens, reqs, num_active_loras=loras)
                token_keyed.append(desc)
                twin = self._maybe_ubatch_twin(desc)
                if twin is not None:
                    token_keyed.append(twin)
        by_mode: dict = {}
        for desc in decode_descs + token_keyed:
            by_mode.setdefault(desc.cg_mode, []).append(desc)
        for mode, descs in by_mode.items():
            descs.sort(key=lambda d: d.num_tokens, reverse=True)
            self._capture_descs[mode] = descs

    def _capture_stream(self, desc):
        if desc.num_ubatches > 1:
            return self.ubatch_runner.capture_stream
        return torch.cuda.current_stream()

    def capture(self, create_forward_fn, progress_bar_desc="Capturing CUDA graphs", stream=None):
        stream = stream if stream is not None else torch.cuda.Stream()  # graph_capture(device, stream)
        self.capture_stream = stream
        with torch.cuda.stream(stream):
            for mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
                if mode not in self._capture_descs:
                    continue
                descs = self._capture_descs[mode]
                if mode == CUDAGraphMode.FULL and self._max_full_descs_to_capture is not None:
                    descs = descs[: self._max_full_descs_to_capture]
                for desc in descs:
                    forward_fn = create_forward_fn(desc, warmup=True)
                    forward_fn(CUDAGraphMode.NONE)
                    if desc.cg_mode == CUDAGraphMode.PIECEWISE:
                        forward_fn(CUDAGraphMode.PIECEWISE)
                        continue
                    forward_fn = create_forward_fn(desc, warmup=False)
                    graph = torch.cuda.CUDAGraph()
                    if self._capture_mem_samples is not None:
                        free_before = torch.cuda.mem_get_info()[0]
                    with torch.cuda.graph(graph, self.pool, stream=self._capture_stream(desc)):
                        forward_fn(CUDAGraphMode.NONE)
                    if self._capture_mem_samples is not None:
                        self._capture_mem_samples.append(free_before - torch.cuda.mem_get_info()[0])
                    self.graphs[desc] = graph

    def release_graphs(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()


class ModelCudaGraphManager(CudaGraphManager):
    """cudagraph_utils.py's ModelCudaGraphManager: the persistent hidden states sized up front."""

    def __init__(self, model, capture_sizes, **kw):
        super().__init__(capture_sizes, **kw)
        self.model = model
        self.compiled = PiecewiseModel(model)
        self.hidden_states = None
        self.lora_calls: list = []

    def capture(self, model):
        max_tokens = max((d.num_tokens for descs in self._capture_descs.values() for d in descs), default=0)

        def store_capture_output(num_tokens, out):
            if self.hidden_states is None:
                self.hidden_states = persistent_like(out, max_tokens)
            self.model.launch(lambda: self.hidden_states[:num_tokens].copy_(out))

        def create_forward_fn(desc, warmup: bool):
            self.builds.append((desc, warmup))
            num_tokens = desc.num_tokens
            self.lora_calls.append((desc.num_active_loras, desc.num_reqs or num_tokens, num_tokens))
            x = self.model.x[:num_tokens]
            batch_descriptor = BatchDescriptor(num_tokens, desc.num_active_loras)

            def forward_fn(cg_mode):
                with set_forward_context(num_tokens, cg_mode, batch_descriptor):
                    out = self.compiled(x)
                if cg_mode == CUDAGraphMode.PIECEWISE:
                    return None
                store_capture_output(num_tokens, out)

            return forward_fn

        super().capture(create_forward_fn)

    def release(self) -> None:
        self.release_graphs()
        CUDAGraphWrapper.clear_all_graphs()


class SpeculatorCudaGraphManager(CudaGraphManager):
    """autoregressive/cudagraph_utils.py's: the draft's graphs, fresh inputs per build."""

    def capture(
        self,
        forward_fn,
        progress_bar_desc="Capturing CUDA graphs",
        specialize_spec_tokens=False,
        slot_mappings_buffer=None,
    ):
        def create_forward_fn(desc, warmup):
            self.builds.append((desc, warmup))
            num_reqs = desc.num_reqs or min(desc.num_tokens, self.max_num_reqs)
            return lambda cg_mode: forward_fn(num_reqs, desc.num_tokens, cg_mode)

        super().capture(create_forward_fn, progress_bar_desc)


class AutoRegressiveSpeculator:
    """autoregressive/speculator.py's: the draft decode manager (query length 1, its own
    request grid up to max_num_seqs with 2 or more speculative steps) and the capture."""

    def __init__(self, draft, capture_sizes, num_speculative_steps: int = 2, max_num_seqs: int | None = None):
        self.draft, self.num_speculative_steps = draft, num_speculative_steps
        self.max_num_seqs = max_num_seqs or max(capture_sizes)
        self.compiled = PiecewiseModel(draft)
        self.draft_tokens = torch.zeros(draft.x.shape, device=draft.device)
        self.capture_sizes = capture_sizes
        self.prefill_cudagraph_manager = None
        self.decode_cudagraph_manager = None

    def init_cudagraph_manager(self, cudagraph_mode):
        grid = decode_cudagraph_capture_grid(self.max_num_seqs) if self.num_speculative_steps >= 2 else []
        self.decode_cudagraph_manager = SpeculatorCudaGraphManager(
            [max(grid, default=1)],
            FULL_DECODE_ONLY,
            {1: self.max_num_seqs},
            max_num_reqs=self.max_num_seqs,
            decode_request_sizes=grid,
        )

    def _forward(self, num_reqs, num_tokens, cg_mode):
        x = self.draft.x[:num_tokens]
        with set_forward_context(num_tokens, cg_mode, BatchDescriptor(num_tokens)):
            out = self.compiled(x)
        if cg_mode != CUDAGraphMode.PIECEWISE:
            self.draft.launch(lambda: self.draft_tokens[:num_tokens].copy_(out))

    def capture(self):
        self.prefill_cudagraph_manager.capture(self._forward, slot_mappings_buffer=None)
        if self.num_speculative_steps == 1:
            return
        self.decode_cudagraph_manager.capture(self._forward)

    def release(self) -> None:
        for m in (self.prefill_cudagraph_manager, self.decode_cudagraph_manager):
            m.release_graphs()


class EagleSpeculator(AutoRegressiveSpeculator):
    """target_dependent_ar/speculator.py's TargetDependentARSpeculator: the draft prefill
    manager (the model's modes, query length num_speculative_steps + 1); capture inherited."""

    def init_cudagraph_manager(self, cudagraph_mode):
        q = self.num_speculative_steps + 1
        self.prefill_cudagraph_manager = SpeculatorCudaGraphManager(
            self.capture_sizes, cudagraph_mode, {q: self.max_num_seqs}, max_num_reqs=self.max_num_seqs
        )
        super().init_cudagraph_manager(cudagraph_mode)


class CacheConfig:
    """What the runner reads of vLLM's cache config: the extensible KV cache."""

    def __init__(self, enable_extensible_kv_cache: bool = True):
        self.enable_extensible_kv_cache = enable_extensible_kv_cache


class GPUModelRunner:
    """What the estimate, the capture and the KV sizing need of vLLM's runner."""

    def __init__(
        self,
        model,
        capture_sizes,
        *,
        ubatch_stream=None,
        lora_capture_cases=None,
        draft=None,
        tp=1,
        cudagraph_mode=FULL_AND_PIECEWISE,
        extensible_kv_cache: bool = True,
    ):
        self.vllm_config = Config(tp)
        self.cache_config = CacheConfig(extensible_kv_cache)
        self.extensible_kv_cache = None
        self.ubatch_runner = UBatchRunner(ubatch_stream) if ubatch_stream is not None else None
        self.cudagraph_manager = ModelCudaGraphManager(
            model,
            capture_sizes,
            cudagraph_mode=cudagraph_mode,
            ubatch_runner=self.ubatch_runner,
            lora_capture_cases=lora_capture_cases,
        )
        self.speculator = None
        if draft is not None:
            self.speculator = EagleSpeculator(draft, capture_sizes)
            self.speculator.init_cudagraph_manager(cudagraph_mode)

    @property
    def manager(self) -> ModelCudaGraphManager:
        return self.cudagraph_manager

    def capture_model(self, *, profile_only=False):
        free_before = torch.cuda.mem_get_info()[0]
        self.cudagraph_manager.capture(self.cudagraph_manager.model)
        if self.speculator is not None:
            self.speculator.capture()
        return free_before - torch.cuda.mem_get_info()[0]

    def profile_cudagraph_memory(self):
        if self.cache_config.enable_extensible_kv_cache:
            return 0  # the extensible KV cache measures the capture footprint after warmup
        return profile_cudagraph_memory(self)

    def release(self) -> None:
        self.cudagraph_manager.release()
        if self.speculator is not None:
            self.speculator.release()


class ExtensibleKVCache:
    """extensible_kv_cache.py's: address space reserved, blocks backed after capture."""

    def __init__(self, block_bytes: int):
        self.block_bytes = block_bytes
        #: kept free when the cache is sized: the profiled peak plus the graph estimate
        self.reserved_headroom_bytes = 0
        self.num_committed_blocks = 0


def measure_kv_cache_blocks(kv_cache, vllm_config, device, *, init_free_memory, requested_memory):
    """The blocks the memory free after capture holds, less the headroom, within the request."""
    free_memory = torch.cuda.mem_get_info()[0]
    used_since_start = init_free_memory - free_memory
    available = min(free_memory, requested_memory - used_since_start) - kv_cache.reserved_headroom_bytes
    kv_cache.num_committed_blocks = max(available, 0) // kv_cache.block_bytes
    return kv_cache.num_committed_blocks


class Worker:
    """gpu_worker.py's start-up, as far as the KV cache's size: the estimate, the cache
    made, the capture, and (extensible) the cache sized from what capture left free."""

    def __init__(self, runner, *, block_bytes: int, requested_memory: int):
        self.model_runner, self.block_bytes, self.requested_memory = runner, block_bytes, requested_memory

    def determine_available_memory(self) -> int:
        self.init_free_memory = torch.cuda.mem_get_info()[0]
        estimate = self.model_runner.profile_cudagraph_memory()
        self.peak_activation_memory = 0 + estimate  # the profiled transient peak (none here) + the estimate
        self.available_kv_cache_memory_bytes = self.requested_memory - estimate
        return self.available_kv_cache_memory_bytes

    def initialize_from_config(self) -> None:
        if self.model_runner.cache_config.enable_extensible_kv_cache:
            kv = self.model_runner.extensible_kv_cache = ExtensibleKVCache(self.block_bytes)
            kv.reserved_headroom_bytes = self.peak_activation_memory
        else:
            self.num_blocks = self.available_kv_cache_memory_bytes // self.block_bytes

    def compile_or_warm_up_model(self) -> int:
        """Captures; returns the KV cache's blocks."""
        self.model_runner.capture_model()
        kv = self.model_runner.extensible_kv_cache
        if kv is None:
            return self.num_blocks
        return measure_kv_cache_blocks(
            kv,
            self.model_runner.vllm_config,
            None,
            init_free_memory=self.init_free_memory,
            requested_memory=self.requested_memory,
        )
