"""vLLM 0.34.0's hook points: 0.33.0's rows
(:mod:`capture_plan.adapters.plugins.hooks_vllm_0_33_0`) as its change table moves them
(:func:`~capture_plan.adapters.plugins.hook_point.follow`), and the rows it added. No
torch, no engine import."""

from __future__ import annotations

from capture_plan.adapters.plugins.hook_point import Moved, follow
from capture_plan.adapters.plugins.hooks_vllm_0_33_0 import _VLLM_0_33_0, _VLLM_RUNNER

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
