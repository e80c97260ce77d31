"""vLLM 0.33.0's hook points (rows of :data:`capture_plan.adapters.plugins.hooks.HOOKS`),
read from its released wheel: the V2 GPU model runner, its default. No torch, no engine
import."""

from __future__ import annotations

from capture_plan.adapters.plugins.hook_point import HookPoint

_VLLM = "vllm", "0.33.0"
_VLLM_CG = "vllm/v1/worker/gpu/cudagraph_utils.py"
_VLLM_RUNNER = "vllm/v1/worker/gpu/model_runner.py"
_VLLM_PIECE = "vllm/compilation/cuda_graph.py"
_VLLM_SPEC = "vllm/v1/worker/gpu/spec_decode/target_dependent_ar/cudagraph_utils.py"
_VLLM_AR = "vllm/v1/worker/gpu/spec_decode/target_dependent_ar/speculator.py"
_VLLM_DRAFT = "vllm/v1/worker/gpu/spec_decode/speculator.py"
_VLLM_PARALLEL = "vllm/config/parallel.py"


#: vLLM 0.33.0's hook points (the V2 GPU model runner, its default)
_VLLM_0_33_0: tuple[HookPoint, ...] = (
    HookPoint(
        *_VLLM,
        "vllm/plugins/__init__.py",
        "DEFAULT_PLUGINS_GROUP",
        "= 'vllm.general_plugins'",
        "the entry-point group capture-plan registers (pyproject.toml)",
    ),
    HookPoint(
        *_VLLM,
        "vllm/plugins/__init__.py",
        "load_general_plugins",
        "()",
        "calls the plugin in every process; an exception stops the process",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_CG,
        "BatchExecutionDescriptor",
        "class",
        "the graph key (cg_mode, num_tokens, num_reqs, uniform_token_count, ...)",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_CG,
        "CudaGraphManager",
        "class",
        "owns the graphs, the pool and the capture order",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_CG,
        "CudaGraphManager.__init__",
        "(self, vllm_config, device, cudagraph_mode, decode_query_len, lora_capture_cases=None, "
        "varlen_decode=False, ubatch_runner=None)",
        "binds the platform's global graph pool",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_CG,
        "CudaGraphManager.capture",
        "(self, create_forward_fn, progress_bar_desc='Capturing CUDA graphs')",
        "PIECEWISE then FULL, each largest-first, one warm-up each; wrapped: the plan's order and steps",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_CG,
        "BatchExecutionDescriptor.cg_mode",
        ": CUDAGraphMode",
        "PIECEWISE or FULL: the plan's phase piecewise or full_* (the plugin's phase_of)",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_CG,
        "BatchExecutionDescriptor.num_tokens",
        ": int",
        "the tokens a graph runs (the plan's size x the phase's tokens_per_request)",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_CG,
        "BatchExecutionDescriptor.uniform_token_count",
        "= None",
        "set: a uniform-decode graph (phase full_decode); a micro-batch twin's is set by _maybe_ubatch_twin",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_CG,
        "BatchExecutionDescriptor.max_query_len",
        "= None",
        "set: a varlen-decode graph (phase full_decode)",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_CG,
        "BatchExecutionDescriptor.num_active_loras",
        "= 0",
        "a LoRA variant of a graph (the plan's label loras=N)",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_CG,
        "BatchExecutionDescriptor.num_ubatches",
        "= 1",
        "a micro-batch twin (the plan's phase ..._ubatch, its micro_batches)",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_CG,
        "CudaGraphManager._init_candidates",
        "(self)",
        "fills _capture_descs: per mode, largest first, LoRA cases and micro-batch twins; read by the plugin",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_CG,
        "CudaGraphManager._maybe_ubatch_twin",
        "(self, desc)",
        "a FULL descriptor's micro-batch twin, right after it",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_CG,
        "CudaGraphManager._capture_stream",
        "(self, desc)",
        "the stream a descriptor records on (a micro-batch twin: the ubatch runner's)",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_CG,
        "CudaGraphManager._capture_descs",
        "attribute",
        "per mode, the descriptors capture iterates: listed before the first graph, sorted into the plan's order",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_CG,
        "CudaGraphManager.graphs",
        "attribute",
        "descriptor -> FULL graph: each handed to its plan step",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_CG,
        "CudaGraphManager.pool",
        "attribute",
        "the pool FULL graphs record into: the step's while the plugin routes the capture",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_CG,
        "CudaGraphManager.use_breakable_cg",
        "attribute",
        "breakable PIECEWISE graphs (VLLM_USE_BREAKABLE_CUDAGRAPH): refused",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_CG,
        "ModelCudaGraphManager.hidden_states",
        "attribute",
        "the persistent hidden states: allocated by the first warm-up, every FULL graph's output",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_CG,
        "CudaGraphManager.release_graphs",
        "(self)",
        "drops the manager's graphs: what a failed loop calls",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_CG,
        "ModelCudaGraphManager",
        "class",
        "the model's manager: persistent hidden-state outputs (store_capture_output)",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_CG,
        "ModelCudaGraphManager.capture",
        "(self, model, model_state, input_buffers, intermediate_tensors, block_tables, attn_groups, "
        "kv_cache_config, pcp_manager=None, has_lora=False, use_aux_hidden_state_outputs=False, "
        "lora_capture_hook=None, progress_bar_desc='Capturing CUDA graphs')",
        "builds create_forward_fn and calls CudaGraphManager.capture",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_SPEC,
        "SpeculatorCudaGraphManager",
        "class",
        "a speculator's manager (EAGLE's draft prefill and decode): its capture ends in CudaGraphManager.capture",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_SPEC,
        "SpeculatorCudaGraphManager.capture",
        "(self, forward_fn, model_state, input_buffers, block_tables, attn_groups, kv_cache_config, "
        "progress_bar_desc='Capturing CUDA graphs', specialize_spec_tokens=False)",
        "builds create_forward_fn for the draft and calls CudaGraphManager.capture",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_AR,
        "TargetDependentARSpeculator.capture",
        "(self)",
        "the draft prefill manager's capture, then (more than one speculative step) the draft decode "
        "manager's with specialize_spec_tokens=supports_decode_metadata_update and "
        "uses_dynamic_speculative_decoding(): that case is refused before the first graph",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_DRAFT,
        "DraftModelSpeculator.speculative_config",
        "attribute",
        "the speculator's config, read for uses_dynamic_speculative_decoding()",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_DRAFT,
        "DraftModelSpeculator.num_speculative_steps",
        "attribute",
        "1: TargetDependentARSpeculator.capture returns before the draft decode manager (its graphs not listed)",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_DRAFT,
        "DraftModelSpeculator.supports_decode_metadata_update",
        "attribute",
        "with dynamic speculative decoding: the draft decode graphs are specialized inside their capture",
    ),
    HookPoint(
        *_VLLM,
        "vllm/config/speculative.py",
        "SpeculativeConfig.uses_dynamic_speculative_decoding",
        "(self)",
        "a graph per speculative token count, made inside the draft decode capture: refused up front",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_AR,
        "TargetDependentARSpeculator.init_cudagraph_manager",
        "(self, cudagraph_mode)",
        "makes prefill_cudagraph_manager and decode_cudagraph_manager (phases draft_prefill_*, draft_decode_*)",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_PIECE,
        "CUDAGraphWrapper",
        "class",
        "a compiled piece of a PIECEWISE graph",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_PIECE,
        "CUDAGraphWrapper.__call__",
        "(self, *args, **kwargs)",
        "records the piece into self.graph_pool; wrapped: the plan's pool, the piece held by the step",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_PIECE,
        "CUDAGraphWrapper.graph_pool",
        "attribute",
        "the pool a piece records into: the step's while its forward runs",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_PIECE,
        "CUDAGraphWrapper.concrete_cudagraph_entries",
        "attribute",
        "a piece's graphs per batch descriptor: the one a call recorded is held by the step",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_PIECE,
        "CUDAGraphWrapper.clear_all_graphs",
        "(cls)",
        "drops every piece's graph: what a failed loop calls",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_PIECE,
        "CUDAGraphEntry.cudagraph",
        "= None",
        "a piece's graph (concrete_cudagraph_entries), handed to the step",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_PIECE,
        "CUDAGraphEntry.output",
        "= None",
        "a piece's output (weak references), held by the step as a view",
    ),
    HookPoint(
        *_VLLM,
        "vllm/config/vllm.py",
        "VllmConfig.use_cumem_cudagraph_pool",
        "(self)",
        "sleep mode's cuMem graph pool: refused (graphs would not record into the plan's pool)",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_CG,
        "profile_cudagraph_memory",
        "(runner)",
        "the graph-memory estimate before the KV cache; answered from the plan instead",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_CG,
        "_extrapolate_full_graph_memory",
        "(mem_samples, total_graphs)",
        "first + (n - 1) * max(second, 1 MiB) (bench/baselines.py follows it)",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_CG,
        "_FULL_GRAPH_PROFILING_SAMPLES",
        "= 2",
        "FULL descriptors the estimate captures",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_CG,
        "_MIN_PER_GRAPH_BYTES",
        "= 1 << 20",
        "the floor of the per-graph extrapolation",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_RUNNER,
        "GPUModelRunner",
        "class",
        "the V2 model runner (cudagraph_manager, speculator, ubatch_runner)",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_RUNNER,
        "GPUModelRunner.vllm_config",
        "attribute",
        "the runner's config: TP and PP sizes, the model's folder, sleep mode",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_RUNNER,
        "GPUModelRunner.cudagraph_manager",
        "attribute",
        "the model's manager (phases piecewise, full_*)",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_RUNNER,
        "GPUModelRunner.speculator",
        "attribute",
        "the speculator, whose CudaGraphManager attributes are the draft managers (phases draft_*)",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_RUNNER,
        "GPUModelRunner.ubatch_runner",
        "attribute",
        "the micro-batch runner, whose capture_stream is the plan's stream ubatch",
    ),
    HookPoint(
        *_VLLM,
        "vllm/v1/worker/gpu/ubatch_utils.py",
        "UBatchRunner.capture_stream",
        "attribute",
        "the stream a micro-batch twin records on (the plan's stream ubatch)",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_PARALLEL,
        "ParallelConfig.tensor_parallel_size",
        "= Field(default=1, ge=1)",
        "checked against the plan's TP size",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_PARALLEL,
        "ParallelConfig.pipeline_parallel_size",
        "= Field(default=1, ge=1)",
        "above 1 refused: a non-last rank's graphs return intermediate tensors, not hidden states",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_RUNNER,
        "GPUModelRunner.capture_model",
        "(self, *, profile_only=False)",
        "empties the cache, captures encoder, model and speculator graphs, returns the free-memory drop; "
        "wrapped: the graphs checked against the plan's keys, one loop part",
    ),
    HookPoint(
        *_VLLM,
        _VLLM_RUNNER,
        "GPUModelRunner.profile_cudagraph_memory",
        "(self)",
        "the runner's entry to the estimate (calls profile_cudagraph_memory); replaced: the plan's figure",
    ),
    HookPoint(
        *_VLLM,
        "vllm/config/vllm.py",
        "VllmConfig._set_cudagraph_sizes",
        "(self)",
        "vLLM's default capture sizes (bench/baselines.py follows it)",
    ),
)
