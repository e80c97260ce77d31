"""vLLM 0.33.0's graph capture (the V2 model runner), adopted onto ``capture_loop``.

Facts from the released wheel (vllm==0.33.0; this code is our own, its class,
method and parameter names the release's where the plugin hooks them):

* ``v1/worker/gpu/cudagraph_utils.py``: graphs are keyed by
  ``BatchExecutionDescriptor`` (cg_mode, num_tokens, num_reqs,
  uniform_token_count, max_query_len, num_active_loras, num_ubatches);
  ``CudaGraphManager._init_candidates``: per capture size and LoRA case
  (``lora_capture_cases``), a uniform-decode descriptor of the decode mode
  (num_tokens rounded up to the query length) and a mixed one of the mixed
  mode, each FULL one followed by its micro-batch twin
  (``_maybe_ubatch_twin``: num_ubatches > 1); each mode's list sorted
  largest first (a stable sort: a twin stays right after its FULL
  descriptor). ``CudaGraphManager.capture(create_forward_fn,
  progress_bar_desc)``, inside ``graph_capture(device)``: every PIECEWISE
  descriptor, then every FULL one; per descriptor ``create_forward_fn(desc,
  warmup=True)`` and one eager run (``forward_fn(CUDAGraphMode.NONE)``); a
  PIECEWISE descriptor then runs ``forward_fn(CUDAGraphMode.PIECEWISE)`` (the
  piece wrappers record); a FULL one builds again with ``warmup=False`` and
  records ``torch.cuda.graph(graph, pool, stream=self._capture_stream(desc))``
  (a twin on the micro-batch runner's ``capture_stream``) into ``self.pool =
  current_platform.get_global_graph_pool()``. With
  ``_max_full_descs_to_capture`` set (the profiling pass) FULL is capped at
  the first descriptors.
* ``ModelCudaGraphManager.capture``: ``create_forward_fn`` calls the LoRA
  capture hook, and ``store_capture_output`` allocates the persistent
  ``hidden_states`` buffer on first use, in a warm-up run (every warm-up runs
  as NONE and stores its output: the first is the largest PIECEWISE
  descriptor's), and copies every FULL graph's output into it; a PIECEWISE
  forward returns None. Then ``super().capture(create_forward_fn, ...)``.
* ``spec_decode/target_dependent_ar``: the EAGLE speculator's
  ``prefill_cudagraph_manager`` (the model's modes, query length
  ``num_speculative_steps + 1``) and ``decode_cudagraph_manager``
  (FULL_DECODE_ONLY, query length 1), each a ``SpeculatorCudaGraphManager``
  whose ``capture(forward_fn, ...)`` ends in ``CudaGraphManager.capture``; the
  draft's FULL graphs write into the speculator's buffers.
* ``model_runner.py`` ``GPUModelRunner.capture_model(*, profile_only=False)``:
  the model manager's capture, then the speculator's; returns the free
  memory it took.
* ``vllm/compilation/cuda_graph.py`` ``CUDAGraphWrapper.__call__``: each
  compiled piece records its own graph per batch descriptor
  (``concrete_cudagraph_entries``, a ``CUDAGraphEntry`` with ``cudagraph`` and
  ``output``), ``torch.cuda.graph(cudagraph, pool=self.graph_pool,
  stream=current_stream())`` into the global pool, the last piece's output
  made a weak reference inside the capture (``weak_ref_output``), every
  entry's output kept as ``weak_ref_tensors(output)``; attention runs eagerly
  between pieces (vLLM's attention op writes into an output buffer the piece
  before allocated).
* ``cudagraph_utils.py`` ``profile_cudagraph_memory(runner)``, before the KV
  cache: points the global pool, the manager and every wrapper at one
  throwaway pool, caps FULL at ``_FULL_GRAPH_PROFILING_SAMPLES`` (2), runs
  ``capture_model(profile_only=True)``, samples the free memory around each
  FULL graph and returns ``measured - sum(samples) + first + (n - 1) *
  max(second, 1 MiB)`` (``_extrapolate_full_graph_memory``), then clears every
  graph and restores the pools.

The adoption: each added line ends with ``# +``, each removed one stays as a
``# - `` comment (tests/engines/adoption.py counts them and runs the version
before; the engine plugin, tests/test_plugins.py, routes that version). The
manager iterates its own descriptors in the plan's order (the plan's keys: a
profiling pass's subset), the wrappers record each piece through the step,
and the profiling pass is a declared partial pass whose answer is the plan's
figure. Phases: :func:`desc_key`, as the plugin names them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import itertools
import math

import torch

from capture_plan.adapters.profiling import profile_cudagraph_memory as planned_capture_memory  # +

MIB = 1 << 20
_FULL_GRAPH_PROFILING_SAMPLES = 2


class CUDAGraphMode(enum.IntEnum):
    NONE = 0
    PIECEWISE = 1
    FULL = 2


#: (decode mode, mixed mode) of vLLM's compound modes
FULL_AND_PIECEWISE = (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE)
FULL_DECODE_ONLY = (CUDAGraphMode.FULL, CUDAGraphMode.NONE)
#: vLLM's FULL: one routine (separate_routine() is False), so mixed FULL descriptors only
FULL_MIXED_ONLY = (CUDAGraphMode.NONE, CUDAGraphMode.FULL)


@dataclasses.dataclass(frozen=True)
class BatchExecutionDescriptor:
    cg_mode: CUDAGraphMode
    num_tokens: int
    num_reqs: int | None
    uniform_token_count: int | None = None
    max_query_len: int | None = None
    num_active_loras: int = 0
    num_ubatches: int = 1


@dataclasses.dataclass(frozen=True)
class BatchDescriptor:
    """vllm.forward_context's: what a piece wrapper keys its graphs by."""

    num_tokens: int
    num_active_loras: int = 0


def desc_key(desc: BatchExecutionDescriptor, prefix: str = "", loras: bool = False, siblings=()):
    """The plan's graph key of a descriptor, as the plugin names it
    (``capture_plan.adapters.plugins.vllm.phase_of``, which this stand-in for the engine
    does not import; tests/test_plugins.py checks that the two agree on every descriptor
    the runner makes): phase (``piecewise``, ``full_decode``, ``full_mixed``, ``_ubatch``
    for a twin, named for the descriptor it is the twin of: the one before it in
    ``siblings``, its mode's list, with its tokens and LoRA count; the speculator's managers
    prefixed), size (requests for a uniform-decode graph, else tokens) and labels (``loras``
    where the manager captures LoRA cases)."""
    parent = _twin_parent(desc, siblings)
    if parent is not None:
        phase, _, labels = desc_key(parent, prefix, loras)
        return phase + "_ubatch", desc.num_reqs if parent.uniform_token_count is not None else desc.num_tokens, labels
    if desc.cg_mode == CUDAGraphMode.PIECEWISE:
        phase = "piecewise"
    elif desc.uniform_token_count is not None or desc.max_query_len is not None:
        phase = "full_decode"
    else:
        phase = "full_mixed"
    phase = prefix + phase + ("_ubatch" if desc.num_ubatches > 1 else "")
    bs = desc.num_reqs if desc.uniform_token_count is not None else desc.num_tokens
    return phase, bs, ((("loras", str(desc.num_active_loras)),) if loras else ())


def _twin_parent(desc, siblings):
    """The descriptor a micro-batch twin is the twin of: the nearest one before it in its
    mode's list with one micro-batch, its tokens and LoRA count (None: not a twin, or not listed)."""
    if desc.num_ubatches == 1 or desc not in siblings:
        return None
    same = (desc.num_tokens, desc.num_active_loras)
    before = siblings[: siblings.index(desc)]
    return next(
        (d for d in reversed(before) if d.num_ubatches == 1 and (d.num_tokens, d.num_active_loras) == same), None
    )


_global_graph_pool = None


def get_global_graph_pool():
    """current_platform.get_global_graph_pool(): made once, shared by every graph."""
    global _global_graph_pool
    if _global_graph_pool is None:
        _global_graph_pool = torch.cuda.graph_pool_handle()
    return _global_graph_pool


def reset_globals() -> None:
    global _global_graph_pool, _forward_context
    _global_graph_pool = _forward_context = None
    CUDAGraphWrapper._all_instances.clear()


def weak_ref_tensors(x):
    """A tensor over ``x``'s memory that does not keep it (vllm.utils.torch_utils)."""
    if isinstance(x, (tuple, list)):
        return type(x)(weak_ref_tensors(t) for t in x)
    if not isinstance(x, torch.Tensor):
        return x
    st = x.untyped_storage()
    storage = torch._C._construct_storage_from_data_pointer(st.data_ptr(), x.device, st.nbytes())
    return torch.empty(0, dtype=x.dtype, device=x.device).set_(storage, x.storage_offset(), x.size(), x.stride())


@dataclasses.dataclass
class _ForwardContext:
    num_tokens: int
    cudagraph_runtime_mode: CUDAGraphMode
    batch_descriptor: BatchDescriptor | None = None
    step: object = None  # +


_forward_context: _ForwardContext | None = None


@contextlib.contextmanager
# - def set_forward_context(num_tokens, cudagraph_runtime_mode, batch_descriptor=None):
def set_forward_context(num_tokens, cudagraph_runtime_mode, batch_descriptor=None, step=None):  # +
    global _forward_context
    old = _forward_context
    # - _forward_context = _ForwardContext(num_tokens, cudagraph_runtime_mode, batch_descriptor)
    _forward_context = _ForwardContext(num_tokens, cudagraph_runtime_mode, batch_descriptor, step)  # +
    try:
        yield
    finally:
        _forward_context = old


@dataclasses.dataclass
class CUDAGraphEntry:
    batch_descriptor: BatchDescriptor
    cudagraph: object = None
    output: object = None
    #: weak views of the inputs it was recorded with (vLLM keeps their addresses)
    inputs: tuple = ()


class CUDAGraphWrapper:
    """A compiled piece: records its graph per batch descriptor in PIECEWISE mode, replays it after."""

    _all_instances: list = []

    def __init__(self, runnable, *, weak_ref_output: bool):
        self.runnable, self.weak_ref_output = runnable, weak_ref_output
        self.graph_pool = get_global_graph_pool()
        self.concrete_cudagraph_entries: dict[BatchDescriptor, CUDAGraphEntry] = {}
        CUDAGraphWrapper._all_instances.append(self)

    def __call__(self, *args, **kwargs):
        ctx = _forward_context
        if ctx is None or ctx.cudagraph_runtime_mode != CUDAGraphMode.PIECEWISE:
            return self.runnable(*args, **kwargs)
        key = ctx.batch_descriptor
        entry = self.concrete_cudagraph_entries.get(key)
        if entry is not None and entry.cudagraph is not None:
            entry.cudagraph.replay()
            return entry.output
        entry = self.concrete_cudagraph_entries[key] = CUDAGraphEntry(key, inputs=tuple(map(weak_ref_tensors, args)))
        cudagraph = torch.cuda.CUDAGraph()
        # - with torch.cuda.graph(cudagraph, pool=self.graph_pool, stream=torch.cuda.current_stream()):
        with ctx.step.graph(cudagraph, pool=self.graph_pool, stream=torch.cuda.current_stream()):  # +
            output = self.runnable(*args, **kwargs)
            if self.weak_ref_output:
                output = weak_ref_tensors(output)
        ctx.step.hold(output)  # +
        entry.output, entry.cudagraph = weak_ref_tensors(output), cudagraph
        return output

    @classmethod
    def clear_all_graphs(cls) -> None:
        for wrapper in cls._all_instances:
            for entry in wrapper.concrete_cudagraph_entries.values():
                if entry.cudagraph is not None:
                    entry.cudagraph.reset()
            wrapper.concrete_cudagraph_entries.clear()


class PiecewiseModel:
    """The torch.compile'd model split at attention: a wrapper per piece,
    attention run eagerly between them, writing into the buffer the piece before
    allocated."""

    def __init__(self, model):
        n = len(model.wp)
        self.model = model
        self.pieces = [CUDAGraphWrapper(self._piece(k, n), weak_ref_output=k == n - 1) for k in range(n)]

    def _piece(self, k, n):
        def run(x):
            h = self.model.piece(k, x)
            return h if k == n - 1 else (h, self.model.new(h.shape[0]))

        return run

    def __call__(self, x):
        for k, piece in enumerate(self.pieces):
            out = piece(x)
            if k == len(self.pieces) - 1:
                return out
            h, buf = out
            self.model.attention(h, buf)  # eager between pieces
            x = buf


def entry(wrapper: CUDAGraphWrapper, num_tokens: int, loras: int = 0) -> CUDAGraphEntry:
    """A piece's entry for a token count (the tests read it)."""
    return wrapper.concrete_cudagraph_entries[BatchDescriptor(num_tokens, loras)]


@dataclasses.dataclass
class UBatchRunner:
    """The micro-batch runner: what the manager reads of it (its capture stream)."""

    capture_stream: object


class CudaGraphManager:
    """cudagraph_utils.py's CudaGraphManager: descriptors, the capture loop, the pool."""

    def __init__(
        self,
        capture_sizes,
        cudagraph_mode=FULL_AND_PIECEWISE,
        decode_query_len: int = 1,
        *,
        max_num_reqs: int | None = None,
        lora_capture_cases=None,
        ubatch_runner: UBatchRunner | None = None,
    ):
        self.capture_sizes = sorted(capture_sizes)
        self.max_num_reqs = max_num_reqs or max(capture_sizes)
        self.cudagraph_mode, self.decode_query_len = cudagraph_mode, decode_query_len
        self.lora_capture_cases = list(lora_capture_cases or [0])
        self.ubatch_runner = ubatch_runner
        self.graphs: dict = {}
        self.pool = get_global_graph_pool()
        self.use_breakable_cg = False
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
        q, largest = self.decode_query_len, max(self.capture_sizes)
        descs: dict = {}
        for num_tokens, loras in itertools.product(self.capture_sizes, self.lora_capture_cases):
            if decode_mode:
                tokens = -(-num_tokens // q) * q
                if tokens <= self.max_num_reqs * q and tokens <= largest:
                    desc = BatchExecutionDescriptor(decode_mode, tokens, tokens // q, q, num_active_loras=loras)
                    if desc not in descs.setdefault(decode_mode, []):
                        descs[decode_mode].append(desc)
                        twin = self._maybe_ubatch_twin(desc)
                        if twin is not None:
                            descs[decode_mode].append(twin)
            if mixed_mode:
                reqs = None if mixed_mode == CUDAGraphMode.PIECEWISE else min(num_tokens, self.max_num_reqs)
                desc = BatchExecutionDescriptor(mixed_mode, num_tokens, reqs, num_active_loras=loras)
                descs.setdefault(mixed_mode, []).append(desc)
                twin = self._maybe_ubatch_twin(desc)  # its uniform_token_count set: tokens / requests
                if twin is not None:
                    descs[mixed_mode].append(twin)
        for mode, mode_descs in descs.items():
            mode_descs.sort(key=lambda d: d.num_tokens, reverse=True)
            self._capture_descs[mode] = mode_descs

    def _capture_stream(self, desc):
        if desc.num_ubatches > 1:
            return self.ubatch_runner.capture_stream
        return torch.cuda.current_stream()

    # - def capture(self, create_forward_fn, progress_bar_desc="Capturing CUDA graphs"):
    def capture(self, create_forward_fn, progress_bar_desc="Capturing CUDA graphs", loop=None, prefix=""):  # +
        with torch.cuda.stream(self.capture_stream):  # graph_capture(device)
            loras = self.lora_capture_cases != [0]  # +
            order = {(k.phase, k.bs, k.labels): i for i, k in enumerate(loop.keys())}  # +
            for mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
                if mode not in self._capture_descs:
                    continue
                descs = self._capture_descs[mode]
                # - if mode == CUDAGraphMode.FULL and self._max_full_descs_to_capture is not None:
                # -     descs = descs[: self._max_full_descs_to_capture]
                mine = [d for d in descs if desc_key(d, prefix, loras, descs) in order]  # +
                descs = sorted(mine, key=lambda d: order[desc_key(d, prefix, loras, self._capture_descs[mode])])  # +
                for desc in descs:
                    forward_fn = create_forward_fn(desc, warmup=True)
                    phase, bs, labels = desc_key(desc, prefix, loras, self._capture_descs[mode])  # +
                    self._step = step = loop.step(phase, bs, **dict(labels))  # +
                    # - forward_fn(CUDAGraphMode.NONE)
                    with step.warmup():  # +
                        forward_fn(CUDAGraphMode.NONE)  # +
                    if desc.cg_mode == CUDAGraphMode.PIECEWISE:
                        forward_fn(CUDAGraphMode.PIECEWISE)
                        continue
                    forward_fn = create_forward_fn(desc, warmup=False)
                    graph = torch.cuda.CUDAGraph()
                    if self._capture_mem_samples is not None:
                        free_before = torch.cuda.mem_get_info()[0]
                    # - with torch.cuda.graph(graph, self.pool, stream=self._capture_stream(desc)):
                    with step.graph(graph, pool=self.pool, stream=self._capture_stream(desc)):  # +
                        forward_fn(CUDAGraphMode.NONE)
                    step.hold(self.captured_output(desc))  # +
                    if self._capture_mem_samples is not None:
                        self._capture_mem_samples.append(free_before - torch.cuda.mem_get_info()[0])
                    self.graphs[desc] = graph

    _step = None
    capture_stream = None

    def captured_output(self, desc):
        """What a FULL graph returns through (the model's persistent hidden states; a
        speculator's graph writes into its own buffers: None)."""
        return None

    def release_graphs(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()


class ModelCudaGraphManager(CudaGraphManager):
    """cudagraph_utils.py's ModelCudaGraphManager: the model's forward, persistent hidden states."""

    def __init__(self, model, capture_sizes, **kw):
        super().__init__(capture_sizes, **kw)
        self.model = model
        self.compiled = PiecewiseModel(model)
        self.hidden_states = None
        #: (num_active_loras, num_reqs, num_tokens) of every LoRA capture hook call
        self.lora_calls: list = []

    # - def capture(self, model):
    def capture(self, model, loop=None):  # +
        def store_capture_output(num_tokens, out):
            if self.hidden_states is None:
                self.hidden_states = torch.empty_like(out)
            self.model.launch(lambda: self.hidden_states[:num_tokens].copy_(out))

        def create_forward_fn(desc, warmup: bool):
            """Prepares inputs outside the graph; returns forward_fn(cg_mode)."""
            self.builds.append((desc, warmup))
            num_tokens = desc.num_tokens
            self.lora_calls.append((desc.num_active_loras, desc.num_reqs or num_tokens, num_tokens))
            x = self.model.x[:num_tokens]
            batch_descriptor = BatchDescriptor(num_tokens, desc.num_active_loras)

            def forward_fn(cg_mode):
                # - with set_forward_context(num_tokens, cg_mode, batch_descriptor):
                with set_forward_context(num_tokens, cg_mode, batch_descriptor, self._step):  # +
                    out = self.compiled(x)  # the compiled model: its pieces record only in PIECEWISE mode
                if cg_mode == CUDAGraphMode.PIECEWISE:
                    return None
                store_capture_output(num_tokens, out)

            return forward_fn

        # - super().capture(create_forward_fn)
        super().capture(create_forward_fn, loop=loop)  # +

    def captured_output(self, desc):
        return self.hidden_states[: desc.num_tokens]

    def release(self) -> None:
        """Every graph of the manager and the pieces dropped (the tests' teardown)."""
        self.release_graphs()
        CUDAGraphWrapper.clear_all_graphs()


class SpeculatorCudaGraphManager(CudaGraphManager):
    """target_dependent_ar/cudagraph_utils.py's: the draft's graphs, fresh inputs per build."""

    # - def capture(self, forward_fn, progress_bar_desc="Capturing CUDA graphs"):
    def capture(self, forward_fn, progress_bar_desc="Capturing CUDA graphs", loop=None, prefix=""):  # +
        def create_forward_fn(desc, warmup):
            self.builds.append((desc, warmup))
            num_reqs = desc.num_reqs or min(desc.num_tokens, self.max_num_reqs)
            return lambda cg_mode: forward_fn(num_reqs, desc.num_tokens, cg_mode, self._step)

        # - super().capture(create_forward_fn, progress_bar_desc)
        super().capture(create_forward_fn, progress_bar_desc, loop=loop, prefix=prefix)  # +


class EagleSpeculator:
    """target_dependent_ar/speculator.py's: a draft prefill manager (the model's modes,
    query length num_speculative_steps + 1) and a draft decode manager (FULL only)."""

    def __init__(self, draft, capture_sizes, num_speculative_steps: int = 2, capture_stream=None):
        self.draft, self.num_speculative_steps = draft, num_speculative_steps
        self.compiled = PiecewiseModel(draft)
        #: the draft tokens the graphs write (the speculator's persistent buffer)
        self.draft_tokens = torch.zeros(draft.x.shape, device=draft.device)
        self.prefill_cudagraph_manager = SpeculatorCudaGraphManager(
            capture_sizes, FULL_AND_PIECEWISE, num_speculative_steps + 1
        )
        self.decode_cudagraph_manager = SpeculatorCudaGraphManager(capture_sizes, FULL_DECODE_ONLY, 1)
        for m in (self.prefill_cudagraph_manager, self.decode_cudagraph_manager):
            m.capture_stream = capture_stream

    def _forward(self, num_reqs, num_tokens, cg_mode, step=None):
        x = self.draft.x[:num_tokens]
        # - with set_forward_context(num_tokens, cg_mode, BatchDescriptor(num_tokens)):
        with set_forward_context(num_tokens, cg_mode, BatchDescriptor(num_tokens), step):  # +
            out = self.compiled(x)
        if cg_mode != CUDAGraphMode.PIECEWISE:
            self.draft.launch(lambda: self.draft_tokens[:num_tokens].copy_(out))

    # - def capture(self):
    def capture(self, loop=None):  # +
        # - self.prefill_cudagraph_manager.capture(self._forward)
        self.prefill_cudagraph_manager.capture(self._forward, loop=loop, prefix="draft_prefill_")  # +
        if self.num_speculative_steps == 1:
            return
        # - self.decode_cudagraph_manager.capture(self._forward)
        self.decode_cudagraph_manager.capture(self._forward, loop=loop, prefix="draft_decode_")  # +

    def release(self) -> None:
        for m in (self.prefill_cudagraph_manager, self.decode_cudagraph_manager):
            m.release_graphs()


#: vllm/sampling_params.py SamplingParams.for_sampler_warmup: what the dummy sampler run's second
#: pass gives every request (model_runner.py _dummy_sampler_run)
SAMPLER_WARMUP = {
    "temperature": 0.9,
    "top_p": 0.9,
    "top_k": 50,
    "min_p": 0.1,
    "frequency_penalty": 0.5,
    "presence_penalty": 0.5,
    "repetition_penalty": 1.2,
    "min_tokens": 2,
    "logit_bias": {0: -1.0, 1: 0.5},
    "bad_words": [[0], [1, 2]],
    "logprobs": 5,
}


def _processes(params: dict) -> bool:
    """Whether a request's logits are processed (sample/states.py SamplingStates.add_request: a
    temperature other than 0 with anything to scale or filter; the logits processors' add_request:
    a logit bias, bad words, penalties). A request never added is greedy (temperature 0)."""
    t = params.get("temperature", 0.0)
    filtered = params.get("min_p", 0.0) != 0.0 or "top_k" in params or params.get("top_p", 1.0) != 1.0
    penalised = any(params.get(k, 0.0) != 0.0 for k in ("frequency_penalty", "presence_penalty"))
    biased = bool(params.get("logit_bias") or params.get("bad_words"))
    return (t != 0.0 and (t != 1.0 or filtered)) or penalised or biased


#: the persistent state below (the release's request and sampler state, its block tables): made
#: on the device as the release makes it, each class named for the release's and allocating its
#: device tensors in their shapes, dtypes and order (a StagedWriteTensor's: ``torch.zeros`` on
#: the device; its staging, and every UvaBackedTensor, pinned host memory: not made here).
#: 0.34.0 kept every one of them (tests/engines/vllm_runner_034.py makes them at start-up).


def _staged(size, dtype, device) -> torch.Tensor:
    """buffer_utils.py ``StagedWriteTensor``'s device tensor (``uva_instead_of_gpu`` off)."""
    return torch.zeros(size, dtype=dtype, device=device)


class RequestState:
    """v1/worker/gpu/states.py ``RequestState.__init__``: ``all_token_ids`` on the device only
    where ``use_dense_all_token_ids`` (an n-gram speculator; else UVA: pinned host), then
    ``total_len``, ``num_computed_tokens``, ``last_sampled_tokens``, ``draft_tokens`` and
    ``next_prefill_tokens``."""

    def __init__(
        self,
        max_num_reqs,
        max_model_len,
        max_num_batched_tokens,
        num_speculative_steps,
        vocab_size,
        device,
        num_prefill_lookahead=1,
        use_dense_all_token_ids=False,
    ):
        self.max_num_reqs, self.max_model_len, self.vocab_size = max_num_reqs, max_model_len, vocab_size
        self.all_token_ids = (
            _staged((max_num_reqs, max_model_len), torch.int32, device) if use_dense_all_token_ids else None
        )
        self.total_len = _staged(max_num_reqs, torch.int32, device)
        self.num_computed_tokens = _staged(max_num_reqs, torch.int32, device)
        self.last_sampled_tokens = torch.zeros(max_num_reqs, 1, dtype=torch.int64, device=device)
        self.draft_tokens = torch.zeros(max_num_reqs, num_speculative_steps, dtype=torch.int64, device=device)
        self.next_prefill_tokens = torch.zeros(num_prefill_lookahead, max_num_reqs, dtype=torch.int32, device=device)


class InputBuffers:
    """v1/worker/gpu/input_batch.py ``InputBuffers.__init__``."""

    def __init__(self, max_num_reqs, max_num_tokens, device):
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.int32, device=device)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.is_padding = torch.zeros(max_num_tokens, dtype=torch.bool, device=device)
        self.query_start_loc = torch.zeros(max_num_reqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        self.dcp_local_seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)


class PenaltiesState:
    """v1/worker/gpu/sample/penalties.py ``PenaltiesState.__init__``: the prompt's bit mask and the
    output's counts, max_num_reqs x vocab int32, whatever the requests ask."""

    def __init__(self, max_num_reqs, vocab_size, device):
        self.prompt_bin_mask = torch.zeros(max_num_reqs, -(-vocab_size // 32), dtype=torch.int32, device=device)
        self.output_bin_counts = torch.zeros(max_num_reqs, vocab_size, dtype=torch.int32, device=device)


class LogitBiasState:
    """v1/worker/gpu/sample/logit_bias.py ``LogitBiasState.__init__`` (MAX_NUM_ALLOWED_TOKEN_IDS,
    MAX_NUM_LOGIT_BIAS_TOKENS 1024, MAX_NUM_STOP_TOKEN_IDS 128)."""

    def __init__(self, max_num_reqs, device):
        self.allowed_token_ids = _staged((max_num_reqs, 1024), torch.int32, device)
        self.logit_bias_token_ids = _staged((max_num_reqs, 1024), torch.int32, device)
        self.logit_bias = _staged((max_num_reqs, 1024), torch.float32, device)
        self.stop_token_ids = _staged((max_num_reqs, 128), torch.int32, device)


class BadWordsState:
    """v1/worker/gpu/sample/bad_words.py ``BadWordsState.__init__`` (envs.py
    VLLM_MAX_BAD_WORDS_TOTAL_TOKENS 1024, VLLM_MAX_NUM_BAD_WORDS 128: their defaults)."""

    def __init__(self, max_num_reqs, device, max_total_tokens=1024, max_num_bad_words=128):
        self.bad_word_token_ids = _staged((max_num_reqs, max_total_tokens), torch.int32, device)
        self.bad_word_offsets = _staged((max_num_reqs, max_num_bad_words + 1), torch.int32, device)


class LogprobTokenIdsState:
    """v1/worker/gpu/sample/logprob.py ``LogprobTokenIdsState.__init__`` (sampling_params.py
    MAX_LOGPROB_TOKEN_IDS 128)."""

    def __init__(self, max_num_reqs, device):
        self.token_ids = _staged((max_num_reqs, 128), torch.int32, device)


class StructuredOutputsWorker:
    """v1/worker/gpu/structured_outputs.py ``StructuredOutputsWorker.__init__`` (its copy stream
    is not the process's first: no memory)."""

    def __init__(self, max_num_logits, vocab_size, device, mask_stride=1):
        self.logits_indices = torch.zeros(max_num_logits, dtype=torch.int32, device=device)
        self.grammar_bitmask = torch.zeros((max_num_logits, -(-vocab_size // 32)), dtype=torch.int32, device=device)
        self.mask_stride = mask_stride


class BlockTables:
    """v1/worker/gpu/block_table.py ``BlockTables.__init__``: per KV cache group a block table and
    its input copy (max_num_reqs x its width, int32), then the slot mappings (groups x
    max_num_batched_tokens, int64); the six per-group vectors after them (pointers, strides, block
    sizes, flags: a few bytes each) are not made here."""

    def __init__(self, block_sizes, max_num_reqs, max_num_batched_tokens, max_num_blocks_per_group, device):
        self.block_sizes = list(block_sizes)
        self.block_tables = [_staged((max_num_reqs, n), torch.int32, device) for n in max_num_blocks_per_group]
        self.input_block_tables = [torch.zeros_like(b) for b in self.block_tables]
        self.slot_mappings = torch.zeros(
            len(self.block_sizes), max_num_batched_tokens, dtype=torch.int64, device=device
        )


def get_block_table_width(max_num_blocks: int, block_size: int, token_alignment: int | None = 128) -> int:
    """v1/kv_cache_interface.py ``get_block_table_width`` (KVCacheSpec's block_table_token_alignment: 128)."""
    if token_alignment is not None:
        alignment = token_alignment // math.gcd(token_alignment, block_size)
        max_num_blocks = -(-max_num_blocks // alignment) * alignment
    return max_num_blocks


class Sampler:
    """vLLM 0.33.0's sampler (v1/worker/gpu/sample/sampler.py ``Sampler``) as the profiling run's
    dummy sampler drives it: a stand-in that allocates what the release allocates, in its shapes,
    dtypes and order, each step naming the release's function; not its kernels (the release's
    run in Triton, in place: those here are a stand-in's, the draw a per-block argmax without
    Gumbel noise). Given ``max_num_reqs``, ``vocab_size`` and ``device``, it makes the per-request
    state the release's ``Sampler.__init__`` builds with it (made at load, kept: penalties'
    counts, logit bias, bad words, the logprob token ids; the rest pinned host memory); without
    them, none (a sampler-only test). ``use_flashinfer``: the branch
    where FlashInfer's sampler runs (``flashinfer_sampler_supported``: the host's FlashInfer);
    ``num_sm``: the SMs the Triton top-k/top-p scratch is sized by (the CUDA device's where None,
    1 on the CPU). This 0.33.0 runner has no profiling run of its own: the 0.34.0 runner's
    (vllm_runner_034.py, which 0.34.0 kept) drives it in the bench's 0.33.0-shaped path."""

    #: sample/gumbel.py gumbel_sample's BLOCK_SIZE
    GUMBEL_BLOCK = 1024
    #: flashinfer/sampling.py top_k_mask_logits' row-states cache (_get_cache_buf, zeroed)
    FLASHINFER_ROW_STATES = 1 << 20

    def __init__(
        self,
        use_flashinfer: bool = False,
        num_sm: int | None = None,
        *,
        max_num_reqs: int | None = None,
        vocab_size: int | None = None,
        device=None,
    ):
        self.use_flashinfer, self.num_sm = use_flashinfer, num_sm
        if vocab_size is not None:  # sampler.py Sampler.__init__'s order (SamplingStates: pinned host)
            self.penalties_state = PenaltiesState(max_num_reqs, vocab_size, device)
            self.logit_bias_state = LogitBiasState(max_num_reqs, device)
            self.bad_words_state = BadWordsState(max_num_reqs, device)
            self.logprob_token_ids_state = LogprobTokenIdsState(max_num_reqs, device)
        self.requests: dict[int, dict] = {}
        #: the caches kept after a pass: topk_topp_triton.py _TRITON_BUFFER_CACHE and
        #: _TRITON_TABLE_CACHE, FlashInfer's row states
        self.buffers: dict[tuple, torch.Tensor | tuple] = {}

    def add_request(self, req_idx: int, params: dict) -> None:
        self.requests[req_idx] = params

    def apply_staged_writes(self) -> None:
        """The requests' parameters into the state made at load (penalties' bincount, the staged
        writes): nothing allocated that the pass keeps."""

    def reset_buffer_cache(self) -> None:
        """topk_topp_triton.py reset_buffer_cache (the release's shutdown)."""
        self.buffers.clear()

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """sampler.py ``Sampler.__call__``: the sample (the processed logits held until it
        returns), then the logprobs where a request asks (get_logprobs_dims), of the raw logits
        (logprobs_mode raw_logprobs, the default)."""
        params = [self.requests.get(i, {}) for i in range(logits.shape[0])]
        num_logprobs = max((p.get("logprobs", -1) for p in params), default=-1)
        sampled, processed = self.sample(logits, params)
        if num_logprobs >= 0:
            self.compute_topk_scores(logits, num_logprobs, sampled)
        del processed  # the release's local, held to here
        return sampled

    def sample(self, logits: torch.Tensor, params: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        """sampler.py ``sample`` and ``_sample_random``: the processed logits; each request's
        top-k and top-p gathered to the device where any sets them (SamplingStates.get_top_k_top_p);
        FlashInfer's fused sampler where it runs and the batch is eligible (top-k or top-p set, no
        greedy request), else top-k/top-p in place and Gumbel-max."""
        processed = self.apply_sampling_params(logits, params)
        ks, ps = [p.get("top_k", 0) for p in params], [p.get("top_p", 1.0) for p in params]
        top_k = self._gathered(ks, torch.int32, logits.device) if any(ks) else None
        top_p = self._gathered(ps, torch.float32, logits.device) if any(x != 1.0 for x in ps) else None
        greedy = any(p.get("temperature", 0.0) == 0.0 for p in params)
        if self.use_flashinfer and (top_k is not None or top_p is not None) and not greedy:
            return self.flashinfer_sample(processed, top_k, top_p).to(torch.int64), processed
        processed = self.apply_top_k_top_p(processed, top_k, top_p)
        return self.gumbel_sample(processed), processed

    @staticmethod
    def _gathered(values: list, dtype: torch.dtype, device) -> torch.Tensor:
        """A per-request vector on the device (the release indexes its pinned host state,
        ``self.top_k.gpu[expanded_idx_mapping]``: a rows-long device tensor)."""
        return torch.empty(len(values), dtype=dtype, device=device).copy_(torch.tensor(values, dtype=dtype))

    def apply_sampling_params(self, logits: torch.Tensor, params: list[dict]) -> torch.Tensor:
        """sampler.py ``apply_sampling_params`` (skip_top_k_top_p): the logits as they are where no
        request is processed, else a float32 copy (torch.empty_like(logits, dtype=torch.float32)
        .copy_(logits)) which the logits processors (logit_bias.py, penalties.py, bad_words.py),
        the temperature and min-p change in place (the temperature alone here)."""
        if not any(_processes(p) for p in params):
            return logits
        logits = torch.empty_like(logits, dtype=torch.float32).copy_(logits)
        logits.div_(params[0].get("temperature") or 1.0)
        return logits

    def _sms(self, logits: torch.Tensor) -> int:
        if self.num_sm is not None:
            return self.num_sm
        return torch.cuda.get_device_properties(logits.device).multi_processor_count if logits.is_cuda else 1

    def apply_top_k_top_p(self, logits: torch.Tensor, k, p) -> torch.Tensor:
        """topk_topp_sampler.py ``apply_top_k_top_p`` -> topk_topp_triton.py
        ``apply_top_k_top_p_triton``: in place; its scratch of min(next_power_of_2(min(SMs, rows)),
        SMs) x vocab in the logits' dtype and its two lookup tables made on the first call and
        kept (the tables: two of 200 float32). The stand-in masks nothing."""
        if k is None and p is None:
            return logits
        rows, vocab = logits.shape
        sms = self._sms(logits)
        programs = min(sms, rows)
        key = ("topk_topp", logits.device, logits.dtype, vocab)
        buffer = self.buffers.get(key)
        if buffer is None or buffer.shape[0] < programs:
            self.buffers[key] = logits.new_empty((min(1 << (programs - 1).bit_length(), sms), vocab))
        if ("tables", logits.device) not in self.buffers:  # _NORMAL_CDF_TO_SIGMA_TABLE, _PERCENTILE_TO_STD_TABLE
            self.buffers["tables", logits.device] = logits.new_empty(200), logits.new_empty(200)
        return logits

    def gumbel_sample(self, logits: torch.Tensor) -> torch.Tensor:
        """sample/gumbel.py ``gumbel_sample`` (lines 344-417): local_argmax (int64) and local_max
        (float32) of rows x ceil(vocab / 1024), one per block (a Triton kernel; a per-block argmax
        here), then the sampled ids (:meth:`_combine`)."""
        rows, vocab = logits.shape
        block = self.GUMBEL_BLOCK
        blocks = -(-vocab // block)
        local_argmax = logits.new_empty(rows, blocks, dtype=torch.int64)
        local_max = logits.new_empty(rows, blocks, dtype=torch.float32)
        for b in range(blocks):  # the stand-in's kernel: a block's argmax and max (a rows-long temporary)
            part = logits[:, b * block : (b + 1) * block]
            torch.argmax(part, dim=-1, out=local_argmax[:, b])
            local_argmax[:, b].add_(b * block)
            local_max[:, b].copy_(part.amax(dim=-1))
        return self._combine(local_argmax, local_max)

    @staticmethod
    def _combine(local_argmax: torch.Tensor, local_max: torch.Tensor) -> torch.Tensor:
        """gumbel.py (0.33.0) lines 415-416: the winning block (rows x 1), its id gathered."""
        max_block_idx = local_max.argmax(dim=-1, keepdim=True)
        return local_argmax.gather(dim=-1, index=max_block_idx).view(-1)

    def flashinfer_sample(self, logits: torch.Tensor, k, p) -> torch.Tensor:
        """topk_topp_sampler.py ``flashinfer_sample`` (top-k and top-p) -> flashinfer/sampling.py
        ``top_k_top_p_sampling_from_logits`` (top_k a tensor: not its top-k-first fast path):
        top_k_mask_logits' mask (torch.empty_like; its row-states cache made once and kept), the
        softmax's probabilities, then top_p_sampling_from_probs' int32 samples and valid flags."""
        key = ("flashinfer_row_states", logits.device)
        if key not in self.buffers:
            self.buffers[key] = torch.zeros(self.FLASHINFER_ROW_STATES, dtype=torch.uint8, device=logits.device)
        masked = torch.empty_like(logits).copy_(logits)
        probs = torch.softmax(masked, dim=-1)
        samples = torch.empty(logits.shape[0], dtype=torch.int32, device=logits.device)
        valid = torch.empty(logits.shape[0], dtype=torch.bool, device=logits.device)
        samples.copy_(probs.argmax(dim=-1))
        del masked, probs, valid
        return samples

    @staticmethod
    def compute_topk_scores(logits: torch.Tensor, num_logprobs: int, sampled: torch.Tensor):
        """sample/logprob.py ``compute_topk_scores`` (no request's own token ids): the top
        ``num_logprobs`` ids (torch.topk) after the sampled one, their float32 logprobs
        (compute_token_logprobs, a Triton kernel; left as made here) and the sampled ids' ranks."""
        ids = sampled.unsqueeze(-1)
        if num_logprobs > 0:
            topk_indices = torch.topk(logits, num_logprobs, dim=-1).indices
            ids = torch.cat((ids, topk_indices), dim=1)
        logprobs = logits.new_empty((logits.shape[0], ids.shape[1]), dtype=torch.float32)
        ranks = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        return ids, logprobs, ranks


class Config:
    """What the plugin reads of vLLM's config: TP size and the model's folder."""

    def __init__(self, tp: int = 1, model: str | None = None):
        self.parallel_config = type("ParallelConfig", (), {"tensor_parallel_size": tp, "pipeline_parallel_size": 1})()
        self.model_config = type("ModelConfig", (), {"model": model})()
        self.use_cumem_cudagraph_pool = False


class GPUModelRunner:
    """What the profiling pass and the capture need of vLLM's runner: its manager,
    the micro-batch runner, the speculator (``draft``: a model for EAGLE's draft)."""

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
    ):
        self.vllm_config = Config(tp)
        self.ubatch_runner = UBatchRunner(ubatch_stream) if ubatch_stream is not None else None
        self.cudagraph_manager = ModelCudaGraphManager(
            model,
            capture_sizes,
            cudagraph_mode=cudagraph_mode,
            ubatch_runner=self.ubatch_runner,
            lora_capture_cases=lora_capture_cases,
        )
        self.cudagraph_manager.capture_stream = torch.cuda.Stream()
        self.speculator = None
        if draft is not None:
            self.speculator = EagleSpeculator(
                draft, capture_sizes, capture_stream=self.cudagraph_manager.capture_stream
            )

    @property
    def manager(self) -> ModelCudaGraphManager:
        return self.cudagraph_manager

    # - def capture_model(self, *, profile_only=False):
    def capture_model(self, loop=None, *, profile_only=False):  # +
        free_before = torch.cuda.mem_get_info()[0]
        # - self.cudagraph_manager.capture(self.cudagraph_manager.model)
        self.cudagraph_manager.capture(self.cudagraph_manager.model, loop)  # +
        if self.speculator is not None:
            # - self.speculator.capture()
            self.speculator.capture(loop)  # +
        return free_before - torch.cuda.mem_get_info()[0]

    def profile_cudagraph_memory(self):
        return profile_cudagraph_memory(self)

    def release(self) -> None:
        self.cudagraph_manager.release()
        if self.speculator is not None:
            self.speculator.release()


def _extrapolate_full_graph_memory(mem_samples, total_graphs):
    if not mem_samples:
        return 0
    per_graph = max(mem_samples[1], MIB) if len(mem_samples) > 1 else 0
    return mem_samples[0] + (total_graphs - 1) * per_graph


# - def profile_cudagraph_memory(runner):
def profile_cudagraph_memory(runner, loop_for=None):  # + loop_for(throwaway pool) -> the declared profiling pass
    """The estimate before the KV cache: the whole capture once more, into a throwaway pool."""
    global _global_graph_pool
    saved_global_pool = _global_graph_pool
    throwaway_pool = torch.cuda.graph_pool_handle()
    _global_graph_pool = throwaway_pool
    manager = runner.cudagraph_manager
    saved_pool = manager.pool
    original_pools = {}
    try:
        manager.pool = throwaway_pool
        for wrapper in CUDAGraphWrapper._all_instances:
            original_pools[id(wrapper)] = wrapper.graph_pool
            wrapper.graph_pool = throwaway_pool
        manager._max_full_descs_to_capture = _FULL_GRAPH_PROFILING_SAMPLES
        mem_samples: list[int] = []
        manager._capture_mem_samples = mem_samples
        # - measured = runner.capture_model(profile_only=True)
        with loop_for(throwaway_pool) as loop:  # +
            runner.capture_model(loop, profile_only=True)  # +
        # - num_full_graphs = len(manager._capture_descs[CUDAGraphMode.FULL])
        # - full_estimate = _extrapolate_full_graph_memory(mem_samples, num_full_graphs)
        # - return max(measured - sum(mem_samples) + full_estimate, 0)
        return planned_capture_memory(plan=loop.plan)  # + the plan's whole-capture figure, not the extrapolation
    finally:
        CUDAGraphWrapper.clear_all_graphs()
        for wrapper in CUDAGraphWrapper._all_instances:
            if id(wrapper) in original_pools:
                wrapper.graph_pool = original_pools[id(wrapper)]
        manager.release_graphs()
        manager.pool = saved_pool
        manager._max_full_descs_to_capture = None
        manager._capture_mem_samples = None
        _global_graph_pool = saved_global_pool
