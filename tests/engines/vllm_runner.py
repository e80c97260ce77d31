"""vLLM 0.33.0's graph capture (the V2 model runner), adopted onto ``capture_loop``.

Facts from the released wheel (vllm==0.33.0; this code is our own):

* ``v1/worker/gpu/cudagraph_utils.py``: graphs are keyed by
  ``BatchExecutionDescriptor`` (cg_mode, num_tokens, num_reqs,
  uniform_token_count, max_query_len, num_active_loras, num_ubatches);
  ``CudaGraphManager._init_candidates`` sorts each mode's descriptors largest
  first, a micro-batch twin (``_maybe_ubatch_twin``: num_ubatches > 1) right
  after its FULL descriptor. ``CudaGraphManager.capture(create_forward_fn)``,
  inside ``graph_capture(device)``: every PIECEWISE descriptor, then every FULL
  one; per descriptor ``create_forward_fn(desc, warmup=True)`` and one eager
  run (``forward_fn(CUDAGraphMode.NONE)``); a PIECEWISE descriptor then runs
  ``forward_fn(CUDAGraphMode.PIECEWISE)`` (the piece wrappers record); a FULL
  one builds again with ``warmup=False`` and records ``torch.cuda.graph(graph,
  pool, stream=self._capture_stream(desc))`` (a twin on the micro-batch
  runner's stream) into ``self.pool = current_platform.get_global_graph_pool()``.
  With ``_max_full_descs_to_capture`` set (the profiling pass) FULL is capped
  at the first descriptors.
* ``ModelCudaGraphManager.capture``: ``store_capture_output`` allocates the
  persistent ``hidden_states`` buffer on first use, in a warm-up run (every
  warm-up runs as NONE and stores its output: the first is the largest
  PIECEWISE descriptor's), and copies every FULL graph's output into it; a
  PIECEWISE forward returns None.
* ``vllm/compilation/cuda_graph.py`` ``CUDAGraphWrapper.__call__``: each
  compiled piece records its own graph, ``torch.cuda.graph(cudagraph,
  pool=self.graph_pool, stream=current_stream())`` into the global pool, the
  last piece's output made a weak reference inside the capture
  (``weak_ref_output=is_last_graph``, compilation/backends.py), every entry's
  output kept as ``weak_ref_tensors(output)``; attention runs eagerly between
  pieces (vLLM's attention op writes into an output buffer the piece before
  allocated).
* ``cudagraph_utils.py`` ``profile_cudagraph_memory(runner)``, before the KV
  cache: points the global pool, the manager and every wrapper at one
  throwaway pool, caps FULL at ``_FULL_GRAPH_PROFILING_SAMPLES`` (2), runs
  ``capture_model(profile_only=True)``, samples the free memory around each
  FULL graph and returns ``measured - sum(samples) + first + (n - 1) *
  max(second, 1 MiB)`` (``_extrapolate_full_graph_memory``), then clears every
  graph and restores the pools.

The adoption: each added line ends with ``# +``, each removed one stays as a
``# - `` comment (tests/engines/adoption.py counts them and runs the version
before). The manager iterates its own descriptors in the plan's order (the
plan's keys: a profiling pass's subset), the wrappers record each piece
through the step, and the profiling pass is a declared partial pass whose
answer is the plan's figure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum

import torch

from capture_plan.adapters.profiling import profile_cudagraph_memory as planned_capture_memory  # +

MIB = 1 << 20
_FULL_GRAPH_PROFILING_SAMPLES = 2


class CUDAGraphMode(enum.IntEnum):
    NONE = 0
    PIECEWISE = 1
    FULL = 2


@dataclasses.dataclass(frozen=True)
class BatchExecutionDescriptor:
    cg_mode: CUDAGraphMode
    num_tokens: int
    num_reqs: int | None
    uniform_token_count: int | None = None
    max_query_len: int | None = None
    num_active_loras: int = 0
    num_ubatches: int = 1


def desc_key(desc: BatchExecutionDescriptor) -> tuple[str, int]:
    """The plan's graph key of a descriptor: its mode (a micro-batch twin its own
    phase, on its own stream) and its token count."""
    if desc.cg_mode == CUDAGraphMode.PIECEWISE:
        return ("piecewise", desc.num_tokens)
    return ("full_ubatch" if desc.num_ubatches > 1 else "full", desc.num_tokens)


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
    step: object = None  # +


_forward_context: _ForwardContext | None = None


@contextlib.contextmanager
# - def set_forward_context(num_tokens, cudagraph_runtime_mode):
def set_forward_context(num_tokens, cudagraph_runtime_mode, step=None):  # +
    global _forward_context
    old = _forward_context
    # - _forward_context = _ForwardContext(num_tokens, cudagraph_runtime_mode)
    _forward_context = _ForwardContext(num_tokens, cudagraph_runtime_mode, step)  # +
    try:
        yield
    finally:
        _forward_context = old


@dataclasses.dataclass
class _Entry:
    graph: object = None
    output: object = None
    #: weak views of the inputs it was recorded with (vLLM keeps their addresses)
    inputs: tuple = ()


class CUDAGraphWrapper:
    """A compiled piece: records its graph per token count in PIECEWISE mode, replays it after."""

    _all_instances: list = []

    def __init__(self, runnable, *, weak_ref_output: bool):
        self.runnable, self.weak_ref_output = runnable, weak_ref_output
        self.graph_pool = get_global_graph_pool()
        self.entries: dict[int, _Entry] = {}
        CUDAGraphWrapper._all_instances.append(self)

    def __call__(self, *args):
        ctx = _forward_context
        if ctx is None or ctx.cudagraph_runtime_mode != CUDAGraphMode.PIECEWISE:
            return self.runnable(*args)
        entry = self.entries.get(ctx.num_tokens)
        if entry is not None:
            entry.graph.replay()
            return entry.output
        entry = _Entry(inputs=tuple(weak_ref_tensors(a) for a in args))
        graph = torch.cuda.CUDAGraph()
        # - with torch.cuda.graph(graph, pool=self.graph_pool, stream=torch.cuda.current_stream()):
        with ctx.step.graph(graph, pool=self.graph_pool, stream=torch.cuda.current_stream()):  # +
            output = self.runnable(*args)
            if self.weak_ref_output:
                output = weak_ref_tensors(output)
        ctx.step.hold(output)  # +
        entry.output, entry.graph = weak_ref_tensors(output), graph
        self.entries[ctx.num_tokens] = entry
        return output

    @classmethod
    def clear_all_graphs(cls) -> None:
        for wrapper in cls._all_instances:
            for entry in wrapper.entries.values():
                entry.graph.reset()
            wrapper.entries.clear()


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


class ModelCudaGraphManager:
    """cudagraph_utils.py's CudaGraphManager + ModelCudaGraphManager, FULL_AND_PIECEWISE."""

    def __init__(self, model, capture_sizes, *, ubatch_stream=None, max_num_reqs: int | None = None):
        self.model = model
        self.compiled = PiecewiseModel(model)
        self.max_num_reqs = max_num_reqs or max(capture_sizes)
        self.graphs: dict = {}
        self.pool = get_global_graph_pool()
        self.hidden_states = None
        self.ubatch_stream = ubatch_stream
        self._max_full_descs_to_capture = None
        self._capture_mem_samples = None
        #: (descriptor, warmup) of every forward build, in order (the tests read it)
        self.builds: list = []
        self._capture_descs = self._init_candidates(sorted(capture_sizes))

    def _init_candidates(self, sizes):
        descs = {CUDAGraphMode.PIECEWISE: [], CUDAGraphMode.FULL: []}
        for n in sizes:
            full = BatchExecutionDescriptor(CUDAGraphMode.FULL, n, min(n, self.max_num_reqs), uniform_token_count=1)
            descs[CUDAGraphMode.FULL].append(full)
            if self.ubatch_stream is not None and n >= 2:  # _maybe_ubatch_twin
                descs[CUDAGraphMode.FULL].append(dataclasses.replace(full, num_ubatches=2))
            descs[CUDAGraphMode.PIECEWISE].append(BatchExecutionDescriptor(CUDAGraphMode.PIECEWISE, n, None))
        for mode_descs in descs.values():
            mode_descs.sort(key=lambda d: d.num_tokens, reverse=True)
        return descs

    def _capture_stream(self, desc):
        if desc.num_ubatches > 1:
            return self.ubatch_stream
        return torch.cuda.current_stream()

    def create_forward_fn(self, desc, warmup: bool):
        """Prepares inputs outside the graph; returns forward_fn(cg_mode)."""
        self.builds.append((desc, warmup))
        num_tokens = desc.num_tokens
        x = self.model.x[:num_tokens]

        def store_capture_output(out):
            if self.hidden_states is None:
                self.hidden_states = torch.empty_like(out)
            self.model.launch(lambda: self.hidden_states[:num_tokens].copy_(out))

        def forward_fn(cg_mode):
            # - with set_forward_context(num_tokens, cg_mode):
            with set_forward_context(num_tokens, cg_mode, self._step):  # +
                out = self.compiled(x)
            if cg_mode == CUDAGraphMode.PIECEWISE:
                return None
            store_capture_output(out)

        return forward_fn

    # - def capture(self):
    def capture(self, loop):  # +
        with torch.cuda.stream(self.capture_stream):  # graph_capture(device)
            for mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
                descs = self._capture_descs[mode]
                # - if mode == CUDAGraphMode.FULL and self._max_full_descs_to_capture is not None:
                # -     descs = descs[: self._max_full_descs_to_capture]
                order = {key: i for i, key in enumerate((k.phase, k.bs) for k in loop.keys())}  # +
                descs = sorted((d for d in descs if desc_key(d) in order), key=lambda d: order[desc_key(d)])  # +
                for desc in descs:
                    forward_fn = self.create_forward_fn(desc, warmup=True)
                    self._step = step = loop.step(*desc_key(desc))  # +
                    # - forward_fn(CUDAGraphMode.NONE)
                    with step.warmup():  # +
                        forward_fn(CUDAGraphMode.NONE)  # +
                    if desc.cg_mode == CUDAGraphMode.PIECEWISE:
                        forward_fn(CUDAGraphMode.PIECEWISE)
                        continue
                    forward_fn = self.create_forward_fn(desc, warmup=False)
                    graph = torch.cuda.CUDAGraph()
                    if self._capture_mem_samples is not None:
                        free_before = torch.cuda.mem_get_info()[0]
                    # - with torch.cuda.graph(graph, self.pool, stream=self._capture_stream(desc)):
                    with step.graph(graph, pool=self.pool, stream=self._capture_stream(desc)):  # +
                        forward_fn(CUDAGraphMode.NONE)
                    step.hold(self.hidden_states[: desc.num_tokens])  # +
                    if self._capture_mem_samples is not None:
                        self._capture_mem_samples.append(free_before - torch.cuda.mem_get_info()[0])
                    self.graphs[desc] = graph

    _step = None
    capture_stream = None

    def release(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        CUDAGraphWrapper.clear_all_graphs()


class GPUModelRunner:
    """What the profiling pass and the capture need of vLLM's runner."""

    def __init__(self, model, capture_sizes, *, ubatch_stream=None):
        self.manager = ModelCudaGraphManager(model, capture_sizes, ubatch_stream=ubatch_stream)
        self.manager.capture_stream = torch.cuda.Stream()

    # - def capture_model(self):
    def capture_model(self, loop):  # +
        free_before = torch.cuda.mem_get_info()[0]
        # - self.manager.capture()
        self.manager.capture(loop)  # +
        return free_before - torch.cuda.mem_get_info()[0]


def _extrapolate_full_graph_memory(mem_samples, total_graphs):
    if not mem_samples:
        return 0
    per_graph = max(mem_samples[1], MIB) if len(mem_samples) > 1 else 0
    return mem_samples[0] + (total_graphs - 1) * per_graph


# - def profile_cudagraph_memory(runner):
def profile_cudagraph_memory(runner, loop_for):  # + loop_for(throwaway pool) -> the declared profiling pass
    """The estimate before the KV cache: the whole capture once more, into a throwaway pool."""
    global _global_graph_pool
    saved_global_pool = _global_graph_pool
    throwaway_pool = torch.cuda.graph_pool_handle()
    _global_graph_pool = throwaway_pool
    manager = runner.manager
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
        # - measured = runner.capture_model()
        with loop_for(throwaway_pool) as loop:  # +
            runner.capture_model(loop)  # +
        # - num_full_graphs = len(manager._capture_descs[CUDAGraphMode.FULL])
        # - full_estimate = _extrapolate_full_graph_memory(mem_samples, num_full_graphs)
        # - return max(measured - sum(mem_samples) + full_estimate, 0)
        return planned_capture_memory(plan=loop.plan)  # + the plan's whole-capture figure, not the extrapolation
    finally:
        CUDAGraphWrapper.clear_all_graphs()
        for wrapper in CUDAGraphWrapper._all_instances:
            if id(wrapper) in original_pools:
                wrapper.graph_pool = original_pools[id(wrapper)]
        for graph in manager.graphs.values():
            graph.reset()
        manager.graphs.clear()
        manager.pool = saved_pool
        manager._max_full_descs_to_capture = None
        manager._capture_mem_samples = None
        _global_graph_pool = saved_global_pool
