"""What an engine-faithful runner measured when it sized its KV cache on the device, as one
typed record a bench writes to JSON beside ``planner fit``'s figures (issue 52, item 6).

Each figure is the runner's own measurement, not a prediction: the weights' bytes as the
caller loaded them, the activation peak of the release's profiling run (torch's allocated
peak less what stays), graph memory as the capture's free-memory drop
(``torch.cuda.mem_get_info``: pool, graph-exec and workspaces together) with the graphs'
pool segments beside it, and the KV cache's blocks, bytes and tokens as the release rounds
them. :func:`vllm_034` reads a worker of tests/engines/vllm_worker_034.py after its
``compile_or_warm_up_model``; :func:`sglang_0523` a start-up of tests/engines/sglang_memory.py
after its decode graphs."""

from __future__ import annotations

import msgspec


class RunnerSizing(msgspec.Struct, frozen=True, kw_only=True):
    """One runner's start-up on one device (bytes unless named otherwise)."""

    engine: str
    release: str
    #: the release's sizing rule the runner followed (its file and function)
    rule: str
    device: str
    device_total_bytes: int
    weights_bytes: int
    #: the profiling run's transient peak (torch's allocated peak less what stays allocated)
    activation_peak_bytes: int
    #: the engine's graph estimate before the KV cache (0 where it sizes after capture)
    graph_estimate_bytes: int
    #: the capture's free-memory drop: pools, graph-exec, workspaces
    graph_bytes: int
    #: the graphs' pool segments after capture (torch.cuda.memory_snapshot)
    graph_pool_bytes: int
    #: kept free beside the cache: the recorded transient peak, the sizing step's reserve growth
    transient_peak_bytes: int
    torch_reserve_growth_bytes: int
    blocks: int
    block_size: int
    block_bytes: int
    kv_bytes: int
    kv_tokens: int
    #: the settings the runner ran with (the engine's own names)
    settings: dict[str, object] = msgspec.field(default_factory=dict)

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)


def pool_bytes(pool) -> int:
    """Bytes of the caching allocator's segments of ``pool`` (a graph pool handle)."""
    import torch

    want = tuple(pool)
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id") or ()) == want)


def vllm_034(worker, blocks: int, *, block_size: int, weights_bytes: int, settings=None) -> RunnerSizing:
    """The record of a vLLM 0.34.0-shaped worker that has sized its cache (``blocks``, what
    ``compile_or_warm_up_model`` returned); ``block_size``: tokens a block holds."""
    import torch

    runner = worker.model_runner
    kv = runner.extensible_kv_cache
    extensible = kv is not None
    return RunnerSizing(
        engine="vllm",
        release="0.34.0",
        rule="vllm/v1/worker/extensible_kv_cache.py measure_kv_cache_blocks"
        if extensible
        else "vllm/v1/worker/gpu_worker.py determine_available_memory",
        device=torch.cuda.get_device_name(),
        device_total_bytes=int(torch.cuda.mem_get_info()[1]),
        weights_bytes=weights_bytes,
        activation_peak_bytes=worker.profile_result.transient_peak_headroom,
        graph_estimate_bytes=worker.cudagraph_memory_estimate,
        graph_bytes=worker.cuda_graph_memory_bytes or 0,
        graph_pool_bytes=pool_bytes(runner.cudagraph_manager.pool),
        transient_peak_bytes=kv.reserved_headroom_bytes if extensible else 0,
        torch_reserve_growth_bytes=kv.torch_reserve_growth_bytes if extensible else 0,
        blocks=blocks,
        block_size=block_size,
        block_bytes=worker.block_bytes,
        kv_bytes=blocks * worker.block_bytes,
        kv_tokens=blocks * block_size,
        settings={
            "enable_extensible_kv_cache": extensible,
            "requested_memory": worker.requested_memory,
            "max_num_batched_tokens": runner.max_num_tokens,
            "max_num_seqs": runner.max_num_reqs,
            **(settings or {}),
        },
    )


def sglang_0523(
    startup, *, weights_bytes: int, graph_bytes: int, activation_peak_bytes: int, settings=None
) -> RunnerSizing:
    """The record of an SGLang 0.5.23-shaped start-up (tests/engines/sglang_memory.py
    ``StartUp``) whose pool is sized and decode graphs captured (``graph_bytes``: the drop
    ``capture_decode_graph`` measures). Its graph estimate is the reserve
    ``mem_fraction_static`` leaves for graphs (``reserve_for_graph_mb``); a block is a page."""
    import torch

    s, pool = startup.settings, startup.pool
    tokens, page = pool.max_total_num_tokens, s.page_size
    return RunnerSizing(
        engine="sglang",
        release="0.5.23",
        rule="sglang/srt/mem_cache/kv_cache_configurator.py KVCacheConfigurator._profile_available_bytes, "
        "model_executor/pool_configurator.py DefaultPoolConfigurator.calculate_pool_sizes",
        device=torch.cuda.get_device_name(),
        device_total_bytes=int(torch.cuda.mem_get_info()[1]),
        weights_bytes=weights_bytes,
        activation_peak_bytes=activation_peak_bytes,
        graph_estimate_bytes=int(s.reserve_for_graph_mb * (1 << 20)),
        graph_bytes=graph_bytes,
        graph_pool_bytes=pool_bytes(startup.module.get_or_create_global_graph_memory_pool()),
        transient_peak_bytes=0,
        torch_reserve_growth_bytes=0,
        blocks=tokens // page,
        block_size=page,
        block_bytes=pool.cell_size * page,
        kv_bytes=tokens * pool.cell_size,
        kv_tokens=tokens,
        settings={
            "mem_fraction_static": s.mem_fraction_static,
            "chunked_prefill_size": s.chunked_prefill_size,
            "cuda_graph_max_bs": s.decode_max_bs,
            "max_running_requests": pool.max_running_requests,
            "context_length": s.context_len,
            **(settings or {}),
        },
    )
