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
* ``v1/worker/gpu/model_runner.py``: ``GPUModelRunner.profile_cudagraph_memory`` (lines
  1121-1129): 0 where ``cache_config.enable_extensible_kv_cache`` (on by default on CUDA),
  else the estimate; ``capture_model`` (lines 1141-1215): the cache emptied and free memory
  read, the encoder's graphs (``model_state.encoder_runner``: their own pool), the model
  manager's, ``model_state.capture_inner_cudagraphs`` on its capture stream, the
  speculator's, the cache emptied again, free memory read: the drop; ``profile_run`` (lines
  1070-1107): ``_dummy_run(max_num_tokens)`` (lines 888-1036: the forward eagerly, the
  speculator's propose) and ``_dummy_sampler_run`` (lines 1039-1066: a default pass and a
  warm-up-parameter pass; :class:`Sampler`, a stand-in allocating as 0.34.0's sampler does).
* ``spec_decode/autoregressive/speculator.py`` ``init_cudagraph_manager`` (lines 36-52): the
  draft decode manager FULL_DECODE_ONLY where the model's decode mode is FULL, else NONE;
  ``capture`` (lines 124-164): ``specialize_spec_tokens`` where the fused decode and dynamic
  speculative decoding are on (``cudagraph_utils.py`` lines 37-75: one graph per count).

The worker (the profiling run measured, the estimate's switch, the KV cache sized after
capture) is tests/engines/vllm_worker_034.py, run after this file.

Not modelled here: LoRA dummy runs, the adaptive-verification profiling inside capture
(off by default), pipeline and data parallelism, the multimodal encoder's profiling in
``profile_run`` (no model of this folder has multimodal input unless a test gives one).
"""

from __future__ import annotations

import bisect
import dataclasses
import gc
import itertools
import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # 0.33.0's, in whose namespace this file runs
    from .vllm_runner import (
        FULL_AND_PIECEWISE,
        FULL_DECODE_ONLY,
        SAMPLER_WARMUP,
        BatchDescriptor,
        BatchExecutionDescriptor,
        BlockTables,
        Config,
        CudaGraphManager,
        CUDAGraphMode,
        GPUModelRunner,
        InputBuffers,
        ModelCudaGraphManager,
        PiecewiseModel,
        RequestState,
        Sampler,
        StructuredOutputsWorker,
        UBatchRunner,
        get_block_table_width,
        get_global_graph_pool,
        profile_cudagraph_memory,
        set_forward_context,
    )

#: cudagraph_mode NONE: a manager that captures nothing (the draft decode manager where the
#: model's decode mode is not FULL)
NO_GRAPHS = (CUDAGraphMode.NONE, CUDAGraphMode.NONE)


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

    # 0.33.0's, which 0.34.0 kept (the class body reads the namespace's class: 0.33.0's)
    _maybe_ubatch_twin = CudaGraphManager._maybe_ubatch_twin
    _capture_stream = CudaGraphManager._capture_stream
    release_graphs = CudaGraphManager.release_graphs

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

    def needs_capture(self) -> bool:
        """cudagraph_utils.py line 445."""
        return len(self._capture_descs) > 0

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

    release = ModelCudaGraphManager.release  # 0.33.0's


@dataclasses.dataclass(frozen=True)
class SpeculatorBatchDescriptor(BatchExecutionDescriptor):
    """autoregressive/cudagraph_utils.py's: a draft decode graph per speculative-token count."""

    num_speculative_tokens: int = 0


class SpeculatorCudaGraphManager(CudaGraphManager):
    """autoregressive/cudagraph_utils.py's: the draft's graphs, fresh inputs per build.
    ``dynamic_schedule``: the speculative-token counts of dynamic speculative decoding
    (``build_dynamic_sd_schedule_lookup``'s values), read where ``specialize_spec_tokens``."""

    dynamic_schedule: tuple = ()

    def specialize_spec_tokens(self, desc, num_speculative_tokens: int):
        """cudagraph_utils.py ``specialize_spec_tokens`` (lines 37-47): a FULL descriptor not
        captured as is becomes its per-count twin where that is captured, else eager."""
        if desc.cg_mode != CUDAGraphMode.FULL or desc in self.graphs:
            return desc
        desc = SpeculatorBatchDescriptor(**vars(desc), num_speculative_tokens=num_speculative_tokens)
        return desc if desc in self.graphs else dataclasses.replace(desc, cg_mode=CUDAGraphMode.NONE)

    def capture(
        self,
        forward_fn,
        progress_bar_desc="Capturing CUDA graphs",
        specialize_spec_tokens=False,
        slot_mappings_buffer=None,
    ):
        if specialize_spec_tokens:  # cudagraph_utils.py lines 61-75: one graph per count >= 2, largest first
            counts = sorted(set(self.dynamic_schedule) - {0, 1}, reverse=True)
            self._capture_descs = {
                mode: [SpeculatorBatchDescriptor(**vars(d), num_speculative_tokens=k) for d in descs for k in counts]
                for mode, descs in self._capture_descs.items()
            }

        def create_forward_fn(desc, warmup):
            self.builds.append((desc, warmup))
            num_reqs = desc.num_reqs or min(desc.num_tokens, self.max_num_reqs)
            return lambda cg_mode: forward_fn(num_reqs, desc.num_tokens, cg_mode)

        super().capture(create_forward_fn, progress_bar_desc)


class AutoRegressiveSpeculator:
    """autoregressive/speculator.py's: the draft decode manager (query length 1, its own
    request grid up to max_num_seqs with 2 or more speculative steps) and the capture."""

    def __init__(
        self,
        draft,
        capture_sizes,
        num_speculative_steps: int = 2,
        max_num_seqs: int | None = None,
        *,
        supports_decode_metadata_update: bool = False,
        dynamic_schedule: tuple = (),
    ):
        self.draft, self.num_speculative_steps = draft, num_speculative_steps
        self.max_num_seqs = max_num_seqs or max(capture_sizes)
        self.compiled = PiecewiseModel(draft)
        self.draft_tokens = torch.zeros(draft.x.shape, device=draft.device)
        self.capture_sizes = capture_sizes
        self.prefill_cudagraph_manager = None
        self.decode_cudagraph_manager = None
        #: the fused multi-step decode (speculator.py: ``supports_decode_metadata_update``) and
        #: dynamic speculative decoding's counts (``uses_dynamic_speculative_decoding()``: non-empty)
        self.supports_decode_metadata_update = supports_decode_metadata_update
        self.dynamic_schedule = tuple(dynamic_schedule)

    def init_cudagraph_manager(self, cudagraph_mode):
        """speculator.py lines 36-52: PIECEWISE graphs are not supported for draft decodes, so
        the draft decode manager is FULL_DECODE_ONLY where the model's decode mode is FULL
        and captures nothing otherwise (NONE); its request grid its own."""
        decode_mode = FULL_DECODE_ONLY if cudagraph_mode[0] == CUDAGraphMode.FULL else NO_GRAPHS
        grid = decode_cudagraph_capture_grid(self.max_num_seqs) if self.num_speculative_steps >= 2 else []
        self.decode_cudagraph_manager = SpeculatorCudaGraphManager(
            [max(grid, default=1)],
            decode_mode,
            {1: self.max_num_seqs},
            max_num_reqs=self.max_num_seqs,
            decode_request_sizes=grid,
        )
        self.decode_cudagraph_manager.dynamic_schedule = self.dynamic_schedule

    def _forward(self, num_reqs, num_tokens, cg_mode, skip_attn: bool = False, prefill: bool | None = None):
        x = self.draft.x[:num_tokens]
        with set_forward_context(num_tokens, cg_mode, BatchDescriptor(num_tokens)):
            out = self.compiled(x)
        if cg_mode != CUDAGraphMode.PIECEWISE:
            self.draft.launch(lambda: self.draft_tokens[:num_tokens].copy_(out))

    def capture(self):
        """speculator.py lines 124-164: the prefill manager, then (2 or more steps) the decode
        manager, specialized per speculative-token count where the fused decode and dynamic
        speculative decoding are both on."""
        self.prefill_cudagraph_manager.capture(self._forward, slot_mappings_buffer=None)
        if self.num_speculative_steps == 1:
            return
        self.decode_cudagraph_manager.capture(
            self._forward,
            specialize_spec_tokens=self.supports_decode_metadata_update and bool(self.dynamic_schedule),
        )

    def propose(self, num_reqs: int, num_tokens: int | None = None) -> None:
        """The dummy run's ``speculator.propose`` (model_runner.py lines 993-1030;
        target_dependent_ar/speculator.py ``propose``), eagerly, attention skipped as the
        profiling run's dummy run skips it (``skip_attn_for_dummy_run``): the draft's prefill
        over the run's ``num_tokens`` (default ``num_reqs``), then, with 2 or more speculative
        steps, its decode of one token a request (the profiling run's draft transient)."""
        n = num_tokens or num_reqs
        self._forward(num_reqs, n, CUDAGraphMode.NONE, skip_attn=True, prefill=True)
        if self.num_speculative_steps >= 2:
            self._forward(num_reqs, num_reqs, CUDAGraphMode.NONE, skip_attn=True, prefill=False)

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
    """What the runner reads of vLLM's cache config: the extensible KV cache, the utilization."""

    def __init__(self, enable_extensible_kv_cache: bool = True, gpu_memory_utilization: float | None = None):
        self.enable_extensible_kv_cache = enable_extensible_kv_cache
        self.gpu_memory_utilization = gpu_memory_utilization


class EncoderRunner:
    """gpu/mm/encoder_runner.py's, as far as capture: ``has_cudagraph`` (a manager made) and
    ``capture`` (encoder_cudagraph.py lines 312-470: every token budget largest first, one
    eager forward into a shared output buffer, then the graph, into a pool of its own:
    ``current_platform.graph_pool_handle()``). ``forward(tokens)``: the encoder's forward;
    ``budgets``: its token budgets (none: no manager)."""

    def __init__(self, forward=None, budgets=()):
        self.forward, self.budgets = forward, sorted(budgets, reverse=True)
        self.graphs: dict = {}
        self.output = None

    def has_cudagraph(self) -> bool:
        return bool(self.budgets)

    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for budget in self.budgets:
            out = self.forward(budget)
            if self.output is None or out.shape[0] > self.output.shape[0]:
                self.output = torch.empty_like(out)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=torch.cuda.current_stream()):
                self.output[: out.shape[0]].copy_(self.forward(budget))
            self.graphs[budget] = graph

    def clear(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.output = None


class ModelState:
    """model_states/interface.py's, as far as capture: multimodal input (``encoder_runner``),
    ``capture_inner_cudagraphs`` (graphs run inside the model's forward, on the model
    graphs' capture stream: none by default, ``inner(stream)`` where given) and
    ``dummy_sampler_run`` (False: the runner's own sampler pass)."""

    def __init__(self, encoder_runner: EncoderRunner | None = None, inner=None):
        self.encoder_runner = encoder_runner
        self.supports_mm_inputs = encoder_runner is not None
        self.inner = inner

    def capture_inner_cudagraphs(self, stream=None) -> None:
        if self.inner is not None:
            self.inner(stream)

    def dummy_sampler_run(self, sampler, hidden_states) -> bool:
        return False


class Sampler(Sampler):  # 0.33.0's stand-in (vllm_runner.py), as 0.34.0 changed it
    """vLLM 0.34.0's sampler: 0.33.0's but for where Gumbel-max returns its ids (sample/gumbel.py
    ``gumbel_sample`` lines 443-479): the sampled ids (rows x int64) made before a combine kernel
    (``_gumbel_combine_kernel``) writes each row's winning block's id into them, no argmax
    index between. sampler.py's other changes (``may_mask_logits``, ``get_logprobs_dims``)
    allocate nothing."""

    @staticmethod
    def _combine(local_argmax: torch.Tensor, local_max: torch.Tensor) -> torch.Tensor:
        sampled = local_argmax.new_empty(local_argmax.shape[0])
        torch.argmax(local_max, dim=-1, out=sampled)  # the combine kernel's work, into its output
        torch.gather(local_argmax, 1, sampled.view(-1, 1), out=sampled.view(-1, 1))
        return sampled


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
        model_state: ModelState | None = None,
        max_num_tokens: int | None = None,
        max_num_reqs: int | None = None,
        speculator_options=None,
        decode_query_lens=None,
        vocab_size: int | None = None,
        max_model_len: int | None = None,
        sampler_cls=None,
    ):
        self.vllm_config = Config(tp)
        self.cache_config = CacheConfig(extensible_kv_cache)
        self.extensible_kv_cache = None
        self.model_state = model_state or ModelState()
        #: max_num_batched_tokens and max_num_seqs (default: the model's rows, the largest size)
        self.max_num_tokens = max_num_tokens or model.x.shape[0]
        self.max_num_reqs = max_num_reqs or max(capture_sizes)
        #: the model's vocabulary (model_config.get_vocab_size()) and max_model_len: given, the
        #: release's request state, input buffers, sampler state and block tables are made where it
        #: makes them; None (a capture test's toy, no vocabulary): none of them
        self.vocab_size, self.max_model_len = vocab_size, max_model_len or self.max_num_tokens
        device = getattr(model, "device", None)
        steps = int(dict(speculator_options or {}).get("num_speculative_steps", 0)) if draft is not None else 0
        # model_runner.py line 243: the process's first torch stream (async_utils.py
        # new_d2h_stream), after the Worker's init snapshot: torch makes its stream pools here,
        # before the profile, so graph_capture's stream later comes from them
        self.output_copy_stream = torch.cuda.Stream()
        self.req_states = self.input_buffers = self.structured_outputs_worker = self.block_tables = None
        if vocab_size is not None:  # lines 297-306 and 338-342: the request state, the input buffers
            # (all_token_ids dense only for an n-gram speculator: not one of this runner's)
            self.req_states = RequestState(
                self.max_num_reqs, self.max_model_len, self.max_num_tokens, steps, vocab_size, device
            )
            self.input_buffers = InputBuffers(self.max_num_reqs, self.max_num_tokens, device)
        # load_model (lines 415-553), after the weights' measurement (the caller's model is built
        # before the runner): the sampler with its request state (line 513; ``sampler_cls``: the
        # stand-in of another release's sampler), then the structured outputs worker (line 549)
        sampler_cls = sampler_cls or Sampler
        if vocab_size is None:
            self.sampler = sampler_cls()
        else:
            self.sampler = sampler_cls(max_num_reqs=self.max_num_reqs, vocab_size=vocab_size, device=device)
            q = 1 + steps  # decode_query_len
            self.structured_outputs_worker = StructuredOutputsWorker(self.max_num_reqs * q, vocab_size, device, q)
        #: the weights' bytes (gpu_worker.py's model_memory_usage: what loading took)
        self.model_memory_usage = 0
        self.ubatch_runner = UBatchRunner(ubatch_stream) if ubatch_stream is not None else None
        # model_runner.py lines 801-808: decode graphs at the decode query length (1 + the
        # speculative tokens: get_decode_cudagraph_query_lens), {1: ...} where None
        self.cudagraph_manager = ModelCudaGraphManager(
            model,
            capture_sizes,
            cudagraph_mode=cudagraph_mode,
            ubatch_runner=self.ubatch_runner,
            lora_capture_cases=lora_capture_cases,
            decode_query_lens=decode_query_lens,
        )
        self.speculator = None
        if draft is not None:
            self.speculator = EagleSpeculator(draft, capture_sizes, **dict(speculator_options or {}))
            self.speculator.init_cudagraph_manager(cudagraph_mode)

    manager = GPUModelRunner.manager  # 0.33.0's

    def initialize_kv_cache(self, block_sizes, device=None) -> None:
        """model_runner.py ``initialize_kv_cache`` (lines 644-760), as far as its own buffers: per KV
        cache group (``block_sizes``: each group's block size) a block table row of
        ``get_block_table_width(cdiv(max_model_len, block_size), block_size)`` blocks (line 704),
        in ``BlockTables`` (line 753); nothing where the runner has no request state. The KV
        cache is the worker's (``ExtensibleKVCache``) or the caller's model's own."""
        if self.vocab_size is None:
            return
        widths = [get_block_table_width(-(-self.max_model_len // b), b) for b in block_sizes]
        device = device or getattr(self.cudagraph_manager.model, "device", None)
        self.block_tables = BlockTables(block_sizes, self.max_num_reqs, self.max_num_tokens, widths, device)

    def capture_model(self, *, profile_only=False):
        """model_runner.py lines 1141-1215: nothing to capture, 0; else the cache emptied, free
        memory read, the encoder's graphs, the model manager's, the model state's inner graphs
        (on the manager's capture stream) and the speculator's; the cache emptied again (the
        warm-ups' activations cached on the capture streams), free memory read: the drop."""
        capture_encoder = self.model_state.supports_mm_inputs and self.model_state.encoder_runner.has_cudagraph()
        capture_decoder = self.cudagraph_manager.needs_capture()
        if not capture_encoder and not capture_decoder:
            return 0
        torch.cuda.empty_cache()
        start_free = torch.cuda.mem_get_info()[0]
        if capture_encoder:
            self.model_state.encoder_runner.capture()
        if capture_decoder:
            self.cudagraph_manager.capture(self.cudagraph_manager.model)
            self.model_state.capture_inner_cudagraphs(self.cudagraph_manager.capture_stream)
            if self.speculator is not None:
                self.speculator.capture()
        torch.cuda.empty_cache()
        return start_free - torch.cuda.mem_get_info()[0]

    def _dummy_run(self, num_tokens: int):
        """model_runner.py lines 888-1036, as the profiling run takes it: ``min(num_tokens,
        max_num_reqs)`` requests sharing the tokens, the model's forward eagerly, the
        speculator's propose, the hidden states and those of each request's last token."""
        num_reqs = min(num_tokens, self.max_num_reqs)
        per_req = [num_tokens // num_reqs + (i >= num_reqs - num_tokens % num_reqs) for i in range(num_reqs)]
        model = self.cudagraph_manager.model
        with set_forward_context(num_tokens, CUDAGraphMode.NONE, BatchDescriptor(num_tokens)):
            hidden_states = self.cudagraph_manager.compiled(model.x[:num_tokens])
        if self.speculator is not None:
            self.speculator.propose(num_reqs, num_tokens)
        logits_indices = torch.tensor(list(itertools.accumulate(per_req)), device=hidden_states.device) - 1
        return hidden_states, hidden_states[logits_indices]

    def compute_logits(self, hidden_states):
        """The model's ``compute_logits`` where it has one; the toy's head is its ``w``."""
        model = self.cudagraph_manager.model
        head = getattr(model, "compute_logits", None)
        return head(hidden_states) if head is not None else hidden_states @ model.w

    def _dummy_sampler_run(self, hidden_states) -> None:
        """model_runner.py lines 1039-1066: the logits of the requests' last tokens, the default
        pass, then every request given SamplingParams.for_sampler_warmup() and a second pass (the
        float32 pipeline the profiled peak must pay for); :class:`Sampler` allocates as the
        release's (its FlashInfer-free branch unless made with ``use_flashinfer``)."""
        if self.model_state.dummy_sampler_run(self.sampler, hidden_states):
            return
        num_reqs = hidden_states.shape[0]
        logits = self.compute_logits(hidden_states)
        self.sampler(logits)
        for req_idx in range(num_reqs):
            self.sampler.add_request(req_idx, SAMPLER_WARMUP)
        self.sampler.apply_staged_writes()
        self.sampler(logits)

    def profile_run(self) -> None:
        """model_runner.py lines 1070-1107: a dummy run at max_num_batched_tokens (attention
        skipped: the toy's eager attention runs, a stand-in's), the dummy sampler run on its
        last tokens, a synchronize, the tensors dropped, a collection."""
        hidden_states, sample_hidden_states = self._dummy_run(self.max_num_tokens)
        self._dummy_sampler_run(sample_hidden_states)
        torch.cuda.synchronize()
        del hidden_states, sample_hidden_states
        gc.collect()

    def profile_cudagraph_memory(self):
        if self.cache_config.enable_extensible_kv_cache:
            return 0  # the extensible KV cache measures the capture footprint after warmup
        return profile_cudagraph_memory(self)

    def release(self) -> None:
        self.cudagraph_manager.release()
        self.sampler.reset_buffer_cache()
        if self.speculator is not None:
            self.speculator.release()
        if self.model_state.encoder_runner is not None:
            self.model_state.encoder_runner.clear()
