"""The engines' hook points the plugins use and the docs name, as typed data.

One row per name: the engine (its distribution name), the release it was read
from, the file inside that release's wheel, the qualified name in the file and
its signature. The plugins look their patch targets up here (:func:`hook`), the
adoption guide's table is generated from here (``docs/generate.py``), and
``tests/test_engine_contract.py`` reads the released wheels (``pip download
--no-deps``, zipfile + ast; nothing installed or imported) and fails, naming the
row, where a release no longer has a name or its signature changed
(:mod:`capture_plan.adapters.plugins.contract`).

``signature`` spells what the contract checks:

* ``"(self, stream)"``: a function or method, its parameters as
  :func:`~capture_plan.adapters.plugins.contract.signature_of` writes them (names,
  defaults as written in the source, ``*``/``/``/``*args``/``**kw``; annotations
  are not compared: a plugin calls by name, and annotations change with every
  refactor);
* ``"class"``: a class defined in the file;
* ``"= <expr>"``: a module- or class-level assignment and its value as written
  (``= 'sglang.srt.plugins'``, ``= EnvBool(False)``);
* ``": <annotation>"``: a class-level field declared without a value (a dataclass's
  ``num_tokens: int``);
* ``"attribute"``: an instance attribute, ``self.<name>`` assigned in a method of the
  class the rest of the name gives (``ModelCudaGraphManager.hidden_states``).

What this table does not know: behaviour. A release that keeps every name and
signature but reorders what ``capture_one`` does passes the contract; the
behaviour tests (tests/test_plugins.py, on engine-shaped runners) and the GPU run
are what check behaviour, for the releases in :data:`KNOWN`.

No torch, no engine import: the plugins' entry points import this first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class HookPoint:
    """One name in one engine release."""

    #: the engine's distribution name ("sglang", "vllm")
    engine: str
    #: the release it was read from ("0.5.23")
    version: str
    #: the file inside the release's wheel ("sglang/srt/plugins/__init__.py")
    file: str
    #: the qualified name in that file ("FullCudaGraphBackend.capture_one")
    name: str
    #: what the contract checks: "(params)", "class" or "= <expr>" (module docstring)
    signature: str
    #: what capture-plan does with it (the adoption guide's table)
    role: str

    @property
    def module(self) -> str:
        """The dotted module of :attr:`file` (``sglang.srt.plugins``)."""
        parts = self.file.removesuffix(".py").split("/")
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    @property
    def qualified(self) -> str:
        """``module:name``, as an entry point spells it."""
        return f"{self.module}:{self.name}"


_SGL = "sglang", "0.5.23"
_SGL_RUNNER = "sglang/srt/model_executor/runner/decode_cuda_graph_runner.py"
_SGL_BACKEND = "sglang/srt/model_executor/runner_backend/full_cuda_graph_backend.py"
_SGL_MODEL_RUNNER = "sglang/srt/model_executor/model_runner.py"
_SGL_GRAPH_CONFIG = "sglang/srt/model_executor/cuda_graph_config.py"
_VLLM = "vllm", "0.33.0"
_VLLM_CG = "vllm/v1/worker/gpu/cudagraph_utils.py"
_VLLM_RUNNER = "vllm/v1/worker/gpu/model_runner.py"
_VLLM_PIECE = "vllm/compilation/cuda_graph.py"
_VLLM_SPEC = "vllm/v1/worker/gpu/spec_decode/target_dependent_ar/cudagraph_utils.py"
_VLLM_AR = "vllm/v1/worker/gpu/spec_decode/target_dependent_ar/speculator.py"
_VLLM_DRAFT = "vllm/v1/worker/gpu/spec_decode/speculator.py"
_VLLM_PARALLEL = "vllm/config/parallel.py"

#: SGLang 0.5.23's hook points
_SGLANG_0_5_23: tuple[HookPoint, ...] = (
    # -- SGLang 0.5.23
    HookPoint(
        *_SGL,
        "sglang/srt/plugins/__init__.py",
        "GENERAL_PLUGINS_GROUP",
        "= 'sglang.srt.plugins'",
        "the entry-point group capture-plan registers (pyproject.toml)",
    ),
    HookPoint(
        *_SGL,
        "sglang/srt/plugins/__init__.py",
        "load_plugins",
        "()",
        "calls the plugin in every process; logs and goes on where a plugin raises an Exception",
    ),
    HookPoint(
        *_SGL,
        "sglang/srt/model_executor/runner/decode_cuda_graph_runner.py",
        "DecodeCudaGraphRunner",
        "class",
        "the decode runner; the EAGLE draft runners subclass it",
    ),
    HookPoint(
        *_SGL,
        _SGL_RUNNER,
        "DecodeCudaGraphRunner._capture",
        "(self)",
        "opens the capture stream and the backend's capture session around _capture_one_stream",
    ),
    HookPoint(
        *_SGL,
        _SGL_RUNNER,
        "DecodeCudaGraphRunner._capture_one_stream",
        "(self, stream_idx=None)",
        "iterates sizes largest-first x LoRA variant x attention variant; wrapped: the plan's order",
    ),
    HookPoint(
        *_SGL,
        _SGL_RUNNER,
        "DecodeCudaGraphRunner.capture_one_shape",
        "(self, size, forward, stream_idx=None, variant_label=None, attention_variant=None)",
        "one graph key (size, LoRA variant, attention variant): the plan's step is taken here",
    ),
    HookPoint(
        *_SGL,
        "sglang/srt/speculative/eagle_draft_cuda_graph_runner.py",
        "EAGLEDraftCudaGraphRunner",
        "class",
        "EAGLE's draft-decode runner (phase draft_decode)",
    ),
    HookPoint(
        *_SGL,
        "sglang/srt/speculative/eagle_draft_extend_cuda_graph_runner.py",
        "EAGLEDraftExtendCudaGraphRunner",
        "class",
        "EAGLE's draft-extend runner (phase draft_extend)",
    ),
    HookPoint(
        *_SGL,
        _SGL_BACKEND,
        "FullCudaGraphBackend",
        "class",
        "the backend every FULL runner records through",
    ),
    HookPoint(
        *_SGL,
        _SGL_BACKEND,
        "FullCudaGraphBackend.capture_session",
        "(self, stream)",
        "binds the global graph pool and the capture stream; wrapped: the plan's pool",
    ),
    HookPoint(
        *_SGL,
        _SGL_BACKEND,
        "FullCudaGraphBackend.capture_one",
        "(self, shape_key, forward_fn, capture_inputs=None, post_warmup_hook=None)",
        "2 warm-ups (sync, TP barrier) and one recording; replaced: the plan's warm-ups and recording",
    ),
    HookPoint(
        *_SGL,
        _SGL_BACKEND,
        "FullCudaGraphBackend.cleanup",
        "(self)",
        "resets and drops the backend's graphs: what a failed loop calls",
    ),
    HookPoint(
        *_SGL,
        _SGL_MODEL_RUNNER,
        "ModelRunner",
        "class",
        "the model runner: made in the scheduler once the config is published, before any weight is loaded",
    ),
    HookPoint(
        *_SGL,
        _SGL_MODEL_RUNNER,
        "ModelRunner.initialize",
        "(self)",
        "loads the weights (load_model), before the KV cache and the graph runners; wrapped: the plan's "
        "sizes checked against the configured ones first",
    ),
    HookPoint(
        *_SGL,
        "sglang/srt/runtime_context.py",
        "get_exec",
        "()",
        "the published exec config: graph.cuda_graph_config.decode.bs, the configured decode sizes",
    ),
    HookPoint(
        *_SGL,
        "sglang/srt/arg_groups/fields/exec_.py",
        "ExecGraph._NS_PATH",
        "= 'exec.graph'",
        "get_exec().graph: the namespace that holds cuda_graph_config",
    ),
    HookPoint(
        *_SGL,
        "sglang/srt/arg_groups/fields/exec_.py",
        "ExecGraph.cuda_graph_config",
        "= None",
        "the resolved CudaGraphConfig (--cuda-graph-bs-decode, or the default for the GPU's memory)",
    ),
    HookPoint(
        *_SGL,
        _SGL_GRAPH_CONFIG,
        "CudaGraphConfig.decode",
        "= field(default_factory=lambda: PhaseConfig(backend=Backend.FULL))",
        "the decode phase's settings, which every decode runner's sizes come from",
    ),
    HookPoint(
        *_SGL,
        _SGL_GRAPH_CONFIG,
        "PhaseConfig.backend",
        "= Backend.DISABLED",
        "the phase's capture backend: the decode sizes are checked early only where it is Backend.FULL",
    ),
    HookPoint(
        *_SGL,
        _SGL_GRAPH_CONFIG,
        "Backend.FULL",
        "= 'full'",
        "the backend FullCudaGraphBackend records (breakable and disabled decode graphs are not routed)",
    ),
    HookPoint(
        *_SGL,
        _SGL_GRAPH_CONFIG,
        "PhaseConfig.bs",
        "= None",
        "the configured sizes (the plan's are checked against them before the weights load)",
    ),
    HookPoint(
        *_SGL,
        "sglang/srt/model_executor/runner/base_cuda_graph_runner.py",
        "get_batch_sizes_to_capture",
        "(model_runner, captured_req_width=1, *, gathered_buffer_required=None)",
        "a runner's sizes: the configured ones aligned, clamped to the request pool's size (known once the KV "
        "cache is sized); the plugin's runner_sizes follows it",
    ),
    HookPoint(
        *_SGL,
        "sglang/srt/utils/common.py",
        "get_cuda_graph_batch_size_alignment",
        "(*, gathered_buffer_required=None)",
        "the alignment get_batch_sizes_to_capture filters by: the early size check runs where it is 1",
    ),
    HookPoint(
        *_SGL,
        "sglang/srt/model_executor/runner_utils/pool.py",
        "get_or_create_global_graph_capture_stream",
        "()",
        "the one process-wide capture stream every runner records on",
    ),
    HookPoint(
        *_SGL,
        "sglang/srt/arg_groups/memory_hook.py",
        "reserve_for_graph_mb",
        "(server_args)",
        "SGLang's graph reserve (bench/baselines.py follows it)",
    ),
    HookPoint(
        *_SGL,
        "sglang/srt/arg_groups/overrides.py",
        "post_capture_kv_sizing_planned",
        "(server_args)",
        "where post-capture KV sizing switches itself off",
    ),
    HookPoint(
        *_SGL,
        "sglang/srt/environ.py",
        "Envs.SGLANG_ENABLE_POST_CAPTURE_KV_SIZING",
        "= EnvBool(False)",
        "post-capture KV sizing, off by default",
    ),
)

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


@dataclass(frozen=True)
class Moved:
    """What a later release changed of one row of the release before: the fields given
    replace the row's (``file``, ``signature``, ``role``; ``name`` where it was renamed
    or now lives on another class)."""

    file: str | None = None
    name: str | None = None
    signature: str | None = None
    role: str | None = None


#: a row a later release no longer has (a value of :func:`follow`'s ``changes``)
GONE = None


def follow(
    rows: tuple[HookPoint, ...],
    version: str,
    changes: Mapping[str, Moved | None],
    added: tuple[tuple[str, str, str, str], ...] = (),
) -> tuple[HookPoint, ...]:
    """The hook points of the release after ``rows``' (``version``): each row kept, moved
    as ``changes[name]`` says (:class:`Moved`), or dropped (:data:`GONE`), then ``added``
    as (file, name, signature, role). A name of ``changes`` that ``rows`` lacks is a
    ValueError: the change table is checked against the release it edits."""
    names = {h.name for h in rows}
    unknown = sorted(set(changes) - names)
    if unknown:
        raise ValueError(f"{rows[0].engine} {version}: changes name rows the release before lacks: {unknown}")
    out = []
    for h in rows:
        if h.name not in changes:
            out.append(replace(h, version=version))
            continue
        moved = changes[h.name]
        if moved is None:
            continue
        given = {k: v for k, v in vars(moved).items() if v is not None}
        out.append(replace(h, version=version, **given))
    out += [HookPoint(rows[0].engine, version, *row) for row in added]
    return tuple(out)


_VLLM_AUTOREGRESSIVE = "vllm/v1/worker/gpu/spec_decode/autoregressive"
_VLLM_COMPILATION = "vllm/config/compilation.py"

#: vLLM 0.34.0 (read from vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl): what changed
#: of 0.33.0's rows. Decode graphs are keyed by (requests, query length), the speculator's
#: manager moved to the autoregressive package, the persistent hidden states are sized up
#: front, and the KV cache is sized after capture where the extensible KV cache is on.
_VLLM_0_34_0_CHANGES: dict[str, Moved | None] = {
    "CudaGraphManager.__init__": Moved(
        signature="(self, vllm_config, device, cudagraph_mode, decode_query_lens, lora_capture_cases=None, "
        "varlen_decode=False, ubatch_runner=None, decode_request_sizes=None)",
        role="binds the platform's global graph pool; decode_query_lens maps each uniform-decode query length "
        "to its most requests, decode_request_sizes the request grid (the draft decode manager's own)",
    ),
    "CudaGraphManager.capture": Moved(
        signature="(self, create_forward_fn, progress_bar_desc='Capturing CUDA graphs', stream=None)",
        role="PIECEWISE then FULL, each largest-first, one warm-up each, on `stream` where given; wrapped: "
        "the plan's order and steps",
    ),
    "CudaGraphManager._init_candidates": Moved(
        role="fills _capture_descs: decode graphs per (requests, query length) "
        "(decode_cudagraph_capture_shapes), token-keyed ones per prefill size, twins, largest first; read by "
        "the plugin",
    ),
    "ModelCudaGraphManager.capture": Moved(
        signature="(self, model, model_state, input_buffers, intermediate_tensors, block_tables, attn_groups, "
        "kv_cache_config, pcp_manager=None, use_aux_hidden_state_outputs=False, lora_capture_hook=None, "
        "progress_bar_desc='Capturing CUDA graphs')",
    ),
    "ModelCudaGraphManager.hidden_states": Moved(
        role="the persistent hidden states: allocated by the first warm-up, sized for the widest descriptor "
        "(store_capture_output's persistent_like), every FULL graph's output",
    ),
    "SpeculatorCudaGraphManager": Moved(file=f"{_VLLM_AUTOREGRESSIVE}/cudagraph_utils.py"),
    "SpeculatorCudaGraphManager.capture": Moved(
        file=f"{_VLLM_AUTOREGRESSIVE}/cudagraph_utils.py",
        signature="(self, forward_fn, model_state, input_buffers, block_tables, attn_groups, kv_cache_config, "
        "progress_bar_desc='Capturing CUDA graphs', specialize_spec_tokens=False, slot_mappings_buffer=None)",
    ),
    "TargetDependentARSpeculator.capture": Moved(
        file=f"{_VLLM_AUTOREGRESSIVE}/speculator.py",
        name="AutoRegressiveSpeculator.capture",
        role="the draft prefill manager's capture, then (more than one speculative step) the draft decode "
        "manager's with specialize_spec_tokens=supports_decode_metadata_update and "
        "uses_dynamic_speculative_decoding(): that case is refused before the first graph (inherited by "
        "TargetDependentARSpeculator)",
    ),
    "GPUModelRunner.profile_cudagraph_memory": Moved(
        role="the runner's entry to the estimate: 0 where the extensible KV cache is on (the KV cache is "
        "sized after capture), else profile_cudagraph_memory; replaced: the same answer, 0 or the plan's figure",
    ),
    "profile_cudagraph_memory": Moved(
        role="the graph-memory estimate before the KV cache, where the extensible KV cache is off; answered "
        "from the plan instead",
    ),
}

_VLLM_0_34_0_ADDED: tuple[tuple[str, str, str, str], ...] = (
    (
        f"{_VLLM_AUTOREGRESSIVE}/speculator.py",
        "AutoRegressiveSpeculator.init_cudagraph_manager",
        "(self, cudagraph_mode)",
        "makes decode_cudagraph_manager, its request sizes get_draft_decode_cudagraph_request_sizes()",
    ),
    (
        "vllm/config/cache.py",
        "CacheConfig.enable_extensible_kv_cache",
        "= Field(default=None)",
        "the extensible KV cache (None: on for CUDA): the KV cache sized after capture; the plugin then "
        "answers the estimate with 0 and checks the plan against what capture took",
    ),
    (
        _VLLM_RUNNER,
        "GPUModelRunner.cache_config",
        "attribute",
        "the runner's cache config, read for enable_extensible_kv_cache",
    ),
    (
        _VLLM_RUNNER,
        "GPUModelRunner.extensible_kv_cache",
        "attribute",
        "the extensible KV cache, made before capture, backed after it",
    ),
    (
        "vllm/v1/worker/extensible_kv_cache.py",
        "measure_kv_cache_blocks",
        "(kv_cache, vllm_config, device, *, init_free_memory, requested_memory)",
        "sizes the extensible KV cache from the memory free after capture, less reserved_headroom_bytes",
    ),
    (
        "vllm/v1/worker/extensible_kv_cache.py",
        "ExtensibleKVCache.reserved_headroom_bytes",
        "attribute",
        "the headroom kept free: the profiled activation peak plus the graph estimate (0 from the plugin, "
        "so graph memory is not counted twice)",
    ),
    (
        _VLLM_COMPILATION,
        "CompilationConfig.prefill_cudagraph_capture_token_sizes",
        "= None",
        "token-keyed graphs' sizes (PIECEWISE and mixed FULL): the preset's piecewise sizes",
    ),
    (
        _VLLM_COMPILATION,
        "CompilationConfig.decode_cudagraph_capture_request_sizes",
        "= None",
        "uniform-decode graphs' request counts: the preset's full_decode sizes",
    ),
    (
        _VLLM_COMPILATION,
        "decode_cudagraph_capture_shapes",
        "(sizes, query_lens, max_tokens)",
        "the (requests, query length) decode graphs (bench/baselines.py follows it)",
    ),
    (
        _VLLM_COMPILATION,
        "decode_cudagraph_capture_grid",
        "(max_requests)",
        "the request grid of the draft decode graphs, up to max_num_seqs (bench/baselines.py follows it)",
    ),
    (
        "vllm/config/vllm.py",
        "VllmConfig.get_draft_decode_cudagraph_request_sizes",
        "(self)",
        "the draft decode manager's request sizes (EAGLE/MTP with 2 or more speculative tokens)",
    ),
    (
        "vllm/config/vllm.py",
        "VllmConfig._split_cudagraph_capture_sizes",
        "(self, legacy_sizes, target_query_lens)",
        "splits the sizes into prefill tokens and decode requests (bench/baselines.py follows it)",
    ),
)

#: vLLM 0.34.0's hook points: 0.33.0's as :data:`_VLLM_0_34_0_CHANGES` moves them, and more
_VLLM_0_34_0 = follow(_VLLM_0_33_0, "0.34.0", _VLLM_0_34_0_CHANGES, _VLLM_0_34_0_ADDED)

#: every hook point, engine by engine, release by release
HOOKS: tuple[HookPoint, ...] = (*_SGLANG_0_5_23, *_VLLM_0_33_0, *_VLLM_0_34_0)

#: engine -> the releases whose hook points :data:`HOOKS` holds, oldest first
KNOWN: dict[str, tuple[str, ...]] = {}
for _h in HOOKS:
    if _h.version not in KNOWN.setdefault(_h.engine, ()):
        KNOWN[_h.engine] += (_h.version,)


def hook(engine: str, version: str, name: str) -> HookPoint:
    """The row of ``engine`` ``version`` named ``name``; KeyError where there is none
    (a programming error: the plugins name rows of this table)."""
    for h in HOOKS:
        if (h.engine, h.version, h.name) == (engine, version, name):
            return h
    raise KeyError(f"{engine} {version}: no hook point {name!r} in capture_plan.adapters.plugins.hooks.HOOKS")


def requirements() -> list[str]:
    """``engine==version`` for every known release (what ``.ci/run`` downloads)."""
    return [f"{e}=={v}" for e, versions in KNOWN.items() for v in versions]


if __name__ == "__main__":  # `python -m capture_plan.adapters.plugins.hooks`: the pins, for .ci/run
    print(" ".join(requirements()))
