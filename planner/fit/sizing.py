"""Each modelled release's KV-cache sizing, step by step as planner/data/fit_rules.toml lists it.

Engine-specific arithmetic only; the items it consumes (weights, activations, graph
memory) come from :mod:`.model` and :mod:`.estimate`. Every function returns the KV
bytes the release gives the cache, or a negative figure where it would refuse to start.
"""

from __future__ import annotations

import math

from .model import FitModel
from .tables import GiB, Rule

__all__ = [
    "vllm_requested",
    "vllm_before_capture",
    "vllm_after_capture",
    "vllm_after_capture_by_budget",
    "vllm_blocks",
    "vllm_kv_groups",
    "vllm_request_bytes",
    "vllm_default_sizes",
    "vllm_given_sizes",
    "vllm_batch_defaults",
    "sglang_defaults",
    "sglang_kv_bytes",
    "sglang_decode_sizes",
    "sglang_prefill_sizes",
]


def vllm_batch_defaults(total: int, device: str, tier_160: bool = True) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) for the OpenAI API server
    (vllm/engine/arg_utils.py: EngineArgs.get_batch_defaults, on the torch total); the
    >= 160 GiB tier only in the releases that have it (the rule's ``batch_tier_160``)."""
    if tier_160 and total >= 160 * GiB:
        return 1024, 16384
    if total >= 70 * GiB and "a100" not in device.lower():
        return 1024, 8192
    return 256, 2048


def vllm_batch_limits(
    defaults: tuple[int, int], seqs: int | None, batched: int | None, max_model_len: int
) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) as vLLM resolves them from the given flags
    (None: not given) and the release's ``defaults`` (:func:`vllm_batch_defaults`):
    vllm/engine/arg_utils.py EngineArgs._set_default_max_num_seqs_and_batched_tokens_args
    (read in 0.33.0 and 0.34.0; the cap of max_num_seqs by max_num_batched_tokens is in every
    vLLM's EngineArgs since its first): defaulted batched tokens capped at max_num_seqs x
    max_model_len (chunked prefill on, the default: no max_model_len floor), then a defaulted
    max_num_seqs capped at the batched tokens. The engine refuses batched tokens below
    max_num_seqs (vllm/config/scheduler.py SchedulerConfig): the caller checks."""
    s = defaults[0] if seqs is None else seqs
    b = min(s * max_model_len, defaults[1]) if batched is None else batched
    return (min(s, b) if seqs is None else s), b


def vllm_default_sizes(
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_size: int | None = None,
    appends: tuple[str, ...] | list[str] = (),
    query_len: int = 1,
) -> list[int]:
    """vLLM's default capture sizes (vllm/config/vllm.py: VllmConfig._set_cudagraph_sizes):
    [1, 2, 4] + range(8, 256, 8) + range(256, max + 1, 16), max = min(max_num_batched_tokens,
    --max-cudagraph-capture-size or min(max_num_seqs * query_len * 2, 512)) (0.33.0 and 0.34.0:
    ``max_cudagraph_capture_size = min(max_num_tokens, max_cudagraph_capture_size)``); where
    the release appends them (the rule's ``capture_appends``), max_num_batched_tokens and the
    uniform decode sizes when they are within max: max_num_seqs, or under speculative decoding
    (``query_len`` = 1 + num_speculative_tokens, 0.33.0 and 0.34.0) n x query_len for the
    request counts n (1, 2, 4, 8 to 248 by 8, 256 to max_num_seqs by 16, and max_num_seqs) within
    the uncapped max, appended where <= max_num_batched_tokens."""
    uncapped = max_size if max_size is not None else min(max_num_seqs * query_len * 2, 512)
    top = min(max_num_batched_tokens, uncapped)
    sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, top + 1, 16))
    sizes = [s for s in sizes if s <= top]
    if "max-num-batched-tokens" in appends and max_num_batched_tokens <= top:
        sizes.append(max_num_batched_tokens)
    if "max-num-seqs" in appends and max_size is None and query_len > 1:
        reqs = min(max_num_seqs, 512)
        counts = [n for n in (1, 2, 4) if n <= reqs] + list(range(8, min(reqs + 1, 256), 8))
        counts = sorted(set(counts + list(range(256, reqs + 1, 16)) + [reqs]))
        sizes += [n * query_len for n in counts if n * query_len <= min(uncapped, max_num_batched_tokens)]
    elif "max-num-seqs" in appends and max_size is None and max_num_seqs <= min(max_num_seqs * 2, 512):
        sizes += [max_num_seqs] if max_num_seqs <= max_num_batched_tokens else []
    return sorted(set(sizes))


def vllm_request_grid(max_requests: int) -> list[int]:
    """0.34.0's request-count grid up to ``max_requests`` (vllm/config/compilation.py:
    decode_cudagraph_capture_grid over _walk_grid): every count up to 6, then the next multiple
    of the largest power of two not above 0.65 x n^(2/3); 64 sizes at 1024."""
    grid, size = [], 1
    while size < max_requests:
        grid.append(size)
        stride = 1 << max(0, math.floor(math.log2(max(1.0, 0.65 * size ** (2 / 3)))))
        size = (size // stride + 1) * stride
    return [*grid, max_requests] if max_requests else []


def vllm_draft_graphs(
    sizes: list[int], max_num_seqs: int, tokens: int, decode_sizes: str, decode_keys: str = "requests"
) -> tuple[list[int], list[int]]:
    """The request counts of an EAGLE speculator's graphs, each manager's largest first: the
    draft prefill manager's (query length ``tokens`` + 1: the shared ``sizes`` as uniform-decode
    request counts: ``decode_keys`` "requests", 0.34.0's vllm/config/vllm.py
    _split_cudagraph_capture_sizes, a count past max_num_seqs clamped to it; "tokens", 0.33.0's
    cudagraph_utils.py CudaGraphManager, each size rounded up to whole requests and one past
    max_num_seqs dropped) and, with 2 or more speculative ``tokens``, the draft decode
    manager's (one token a request): ``decode_sizes`` "request-grid" (0.34.0's
    get_draft_decode_cudagraph_request_sizes: :func:`vllm_request_grid` to max_num_seqs) or
    "capture-sizes" (0.33.0: the shared sizes up to max_num_seqs)."""
    q = tokens + 1
    top = max(sizes, default=0)
    counts = [-(-s // q) for s in sizes if -(-s // q) * q <= top]
    if decode_keys == "requests":
        prefill = {min(n, max_num_seqs) for n in counts}
    else:
        prefill = {n for n in counts if n <= max_num_seqs}
    decode: list[int] = []
    if tokens >= 2:
        decode = vllm_request_grid(max_num_seqs) if decode_sizes == "request-grid" else sizes
        decode = [n for n in decode if n <= max_num_seqs]
    return sorted(prefill, reverse=True), sorted(set(decode), reverse=True)


def vllm_given_sizes(sizes: list[int], max_num_batched_tokens: int) -> list[int]:
    """--cudagraph-capture-sizes as vLLM keeps them (VllmConfig._set_cudagraph_sizes): de-duplicated,
    sorted, those above max_num_batched_tokens dropped."""
    return sorted({s for s in sizes if s <= max_num_batched_tokens})


def vllm_requested(total: int, utilization: float) -> int:
    """vllm/v1/worker/utils.py: request_memory."""
    return math.ceil(total * utilization)


def vllm_before_capture(
    requested: int, *, weights: int, non_torch: int, activation: int, graph: int, buffers: int = 0
) -> int:
    """0.33.0's determine_available_memory: the requested budget less what the profile
    consumed (weights, non-torch, the runner's persistent ``buffers``), its transient peak and
    profile_cudagraph_memory's estimate. The byte counts by name: four ints in a row are too
    easy to swap."""
    return requested - (weights + non_torch + buffers + activation) - graph


def vllm_after_capture(
    rule: Rule,
    requested: int,
    init_free: int,
    *,
    weights: int,
    non_torch: int,
    activation: int,
    graph: int,
    buffers: int = 0,
    reserve_growth: int = 0,
) -> int:
    """0.34.0's measure_kv_cache_bytes after warm-up and capture (nothing committed yet): what
    is free, less the margin, less the larger of the transient peak (``activation``) and
    torch's reserve growth over the sizing step (``reserve_growth``, planner/fit/reserve.py).
    The item byte counts by name (as :func:`vllm_before_capture`'s); ``buffers``: the runner's
    persistent buffers, in what the start-up used as the weights are."""
    free = init_free - weights - non_torch - buffers - graph
    non_kv_used = init_free - free
    return min(requested - non_kv_used, free - vllm_margin(rule, activation)) - max(activation, reserve_growth)


def vllm_margin(rule: Rule, activation: int) -> int:
    """0.34.0's measure_kv_cache_bytes headroom on the free side: max(floor, peak x fraction)."""
    return max(rule.margin_floor_bytes, int(activation * rule.margin_fraction))


def vllm_after_capture_by_budget(rule: Rule, requested: int, init_free: int, activation: int) -> bool:
    """Whether :func:`vllm_after_capture`'s budget side (requested - used) is the smaller one,
    not the free side (free - margin): both take the same used memory, so the budget binds
    when requested <= init_free - margin."""
    return requested <= init_free - vllm_margin(rule, activation)


def _vllm_group(m: FitModel) -> int:
    """Layers per KV group (kv_cache_planning): the smallest type's count, or the largest's where
    it is under 1.5x the smallest (fewer padding layers: 12 sliding + 13 full pad to 13 + 13, not
    24 + 13)."""
    counts = [n for n in (m.full_layers, m.sliding_layers) if n > 0]
    return max(counts) if max(counts) < min(counts) * 1.5 else min(counts)


def _vllm_request(m: FitModel, block_size: int, max_model_len: int, in_flight: int) -> tuple[int, int]:
    """(layers per KV group, blocks one request at max_model_len takes): see :func:`vllm_blocks`."""
    full, sliding = m.full_layers, m.sliding_layers
    group = _vllm_group(m)
    per_request = math.ceil(full / group) * math.ceil(max_model_len / block_size) if full else 0
    if sliding:
        window = min(m.sliding_window - 1 + in_flight, max_model_len)
        per_request += math.ceil(sliding / group) * (math.ceil(window / block_size) + 1)
    return group, per_request


def vllm_kv_groups(m: FitModel) -> int:
    """The KV cache groups of :func:`vllm_blocks`' grouping (one per ``group`` layers of a type,
    the last padded): the rows of the runner's block tables."""
    group = _vllm_group(m)
    return sum(math.ceil(n / group) for n in (m.full_layers, m.sliding_layers) if n)


def vllm_request_bytes(
    m: FitModel, per_token_layer: int, block_size: int, max_model_len: int, in_flight: int, draft: int = 0
) -> int:
    """The KV bytes one request at max_model_len takes (the cache's least for max concurrency 1);
    ``draft``: a speculative draft's KV bytes per token, its layers in the one group."""
    group, per_request = _vllm_request(m, block_size, max_model_len, in_flight)
    return per_request * (group * per_token_layer + draft) * block_size


def vllm_blocks(
    m: FitModel,
    per_token_layer: int,
    block_size: int,
    available: int,
    max_model_len: int,
    in_flight: int,
    count: str = "concurrency",
    draft: int = 0,
) -> tuple[int, float, int]:
    """(blocks, max concurrency, tokens) as vLLM's KV-cache manager counts them: layers
    grouped by type in groups of the smallest type's layer count, or of the largest type's
    where it is under 1.5 x the smallest (the last group of a type padded)
    (vllm/v1/core/kv_cache_planning.py: _get_kv_cache_groups_uniform_page_size, 0.33.0 and
    0.34.0; kv_cache_utils before), a block being one page of
    every layer of a group (get_kv_cache_config_from_groups: available // bytes_per_block);
    a request at max_model_len takes cdiv(max_model_len, block_size) blocks per full group
    and cdiv(min(window - 1 + in_flight, max_model_len), block_size) + 1 per sliding group
    (kv_cache_interface.SlidingWindowSpec.max_memory_usage_bytes). The tokens logged:
    ``count`` "concurrency": int(blocks / per_request * max_model_len)
    (get_kv_cache_capacity, _report_kv_cache_config from 0.20's successor); "blocks":
    num_blocks // groups * block_size (0.19.0 and 0.20.0's _report_kv_cache_config). ``draft``:
    a speculative draft's KV bytes per token on one rank, its attention layers in the target's
    one full-attention group at their own page sizes (UniformTypeKVCacheSpecs: a block is one
    page of every layer, fit_rules.toml [speculative]); 0 without one."""
    full, sliding = m.full_layers, m.sliding_layers
    group, per_request = _vllm_request(m, block_size, max_model_len, in_flight)
    page = block_size * per_token_layer
    blocks = max(available, 0) // (group * page + draft * block_size)
    concurrency = blocks / per_request
    if count == "blocks":
        groups = (math.ceil(full / group) if full else 0) + (math.ceil(sliding / group) if sliding else 0)
        return blocks, concurrency, blocks // groups * block_size
    return blocks, concurrency, int(concurrency * max_model_len)


# SGLang 0.5.23: sglang/srt/arg_groups/memory_hook.py handle_gpu_memory_settings (MiB tiers)
_SGL_TIERS = ((20 * 1024, 2048, 8, 8), (35 * 1024, 4096, 48, 160), (60 * 1024, 4096, 32, 160))


def sglang_defaults(gpu_mem_mib: int, tp: int) -> tuple[int, int]:
    """(chunked_prefill_size, decode cuda_graph max_bs) for nvidia-smi's total."""
    for top, chunk, bs, bs_tp4 in _SGL_TIERS:
        if gpu_mem_mib < top:
            return chunk, bs if tp < 4 else bs_tp4
    if gpu_mem_mib < 160 * 1024:
        return 8192, 256 if tp < 4 else 512
    return 16384, 512


def sglang_decode_sizes(max_bs: int, speculative: bool = False) -> list[int]:
    """cuda_graph_hook.generate_decode_cuda_graph_batch_sizes: the normal list, or under
    speculative decoding its own (less padding at small batch sizes)."""
    if speculative:
        sizes = list(range(1, 9)) + list(range(10, 33, 2)) + list(range(40, 65, 4)) + list(range(72, 257, 8))
        sizes += list(range(272, max_bs + 1, 16))
    else:
        sizes = [1, 2, 4, 8, 12] + list(range(16, 257, 8)) + list(range(272, 512, 16))
        sizes += list(range(512, max_bs + 1, 32))
    sizes = [s for s in sizes if s <= max_bs]
    return sizes if max_bs in sizes else sizes + [max_bs]


def sglang_prefill_sizes(max_bs: int) -> list[int]:
    """cuda_graph_hook.generate_prefill_cuda_graph_batch_sizes (breakable prefill graphs)."""
    sizes = (
        list(range(4, 33, 4))
        + list(range(48, 257, 16))
        + list(range(288, 513, 32))
        + list(range(576, 1025, 64))
        + list(range(1280, 4097, 256))
        + list(range(4608, max_bs + 1, 512))
    )
    return [s for s in sizes if s <= max_bs]


def sglang_mem_fraction(gpu_mem_mib: int, tp: int, chunked: int, max_bs: int, prefill_graphs: int, mla: bool) -> float:
    """memory_hook.handle_gpu_memory_settings' mem_fraction_static without post-capture sizing."""
    reserved = 512 + max(chunked, 2048) * 1.5 + tp / 8 * 1024
    reserved += max_bs * 2 + (1.5 * 1024 if mla else prefill_graphs * 8)  # reserve_for_graph_mb
    if gpu_mem_mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((gpu_mem_mib - reserved) / gpu_mem_mib, 3)


def sglang_kv_bytes(pre_load_free: int, *, weights: int, non_torch: int, fraction: float) -> int:
    """kv_cache_configurator._profile_available_bytes: free after loading less the slack
    pre_model_load_memory * (1 - mem_fraction_static). The byte counts by name."""
    return int((pre_load_free - weights - non_torch) - pre_load_free * (1 - fraction))
