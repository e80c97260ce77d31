"""SGLang 0.5.23's hook points (rows of :data:`capture_plan.adapters.plugins.hooks.HOOKS`),
read from its released wheel. No torch, no engine import."""

from __future__ import annotations

from capture_plan.adapters.plugins.hook_point import HookPoint

_SGL = "sglang", "0.5.23"
_SGL_RUNNER = "sglang/srt/model_executor/runner/decode_cuda_graph_runner.py"
_SGL_BACKEND = "sglang/srt/model_executor/runner_backend/full_cuda_graph_backend.py"
_SGL_MODEL_RUNNER = "sglang/srt/model_executor/model_runner.py"
_SGL_GRAPH_CONFIG = "sglang/srt/model_executor/cuda_graph_config.py"


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
