"""The engines' own graph-memory methods, followed step for step, for the benches' comparisons.

Read from the released wheels (one ``pip download --no-deps PIN`` per release, as ``.ci/engine_wheels.py`` runs them;
the files and names are rows of ``capture_plan.adapters.plugins.hooks.HOOKS``, which
tests/test_engine_contract.py checks against those wheels):

* vLLM 0.33.0 (``v1/worker/gpu/cudagraph_utils.py``, ``v1/worker/gpu/model_runner.py``,
  ``config/vllm.py``):

  - :func:`vllm_capture_sizes`: ``VllmConfig._set_cudagraph_sizes``'s default sizes for
    a device (H200: 51 sizes, 1-512); :func:`vllm_full_decode_requests`: the uniform-decode
    FULL descriptors ``CudaGraphManager._init_candidates`` makes of them;
  - :func:`vllm_capture_model`: ``GPUModelRunner.capture_model`` +
    ``ModelCudaGraphManager.capture``: empty the cache, read free memory, then on one side
    stream (``graph_capture``) each FULL descriptor largest-first (one warm-up that also
    fills the persistent hidden-state buffers, then ``torch.cuda.graph`` into the pool,
    the forward copying its outputs into those buffers), then the speculator's graphs, and
    the free-memory drop from the start;
  - :func:`vllm_profile`: ``profile_cudagraph_memory``: collect, empty the cache, ONE
    throwaway pool for everything, the FULL descriptors capped at the 2 largest
    (``_FULL_GRAPH_PROFILING_SAMPLES``), the free-memory drop around each FULL
    ``torch.cuda.graph`` block alone sampled, the speculator's graphs in full, and
    :func:`vllm_estimate`: ``max(measured - sum(samples) + first + (n - 1) * max(second,
    1 MiB), 0)`` (``_extrapolate_full_graph_memory``, ``_MIN_PER_GRAPH_BYTES``).

  Not followed, because the benches' models have none: PIECEWISE graphs (torch.compile's
  pieces; vLLM captures them first and its estimate measures them in full), encoder
  graphs, LoRA variants, micro-batch twins, the minimal profiling KV cache. The benches'
  configuration is therefore vLLM's ``FULL_DECODE_ONLY``; vLLM's models return hidden
  states from the FULL graphs (logits are computed outside them): :func:`hidden_state_outputs`
  swaps the benches' models' LM heads for their final norm while vLLM's method runs.

* SGLang 0.5.23 (``arg_groups/memory_hook.py``): :func:`sglang_reserve_mib` is
  ``reserve_for_graph_mb``, its DP-attention, MLA and breakable-prefill (DeepEP) terms
  included, and :func:`sglang_prefill_sizes` the prefill sizes it counts
  (``cuda_graph_hook.generate_prefill_cuda_graph_batch_sizes``). SGLang measures nothing
  before capture: this figure is subtracted from the device before the KV cache is sized,
  inside a floor (``reserved_mem = max(reserved_mem, 10 GiB)`` on a device over 60 GiB).
  With ``SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1`` the KV cache is sized after capture
  instead (no graph reserve), unless ``post_capture_kv_sizing_planned`` switches it off
  (MLA, DeepSeek-V4- and MiniMax-style sparse attention, decode-context parallelism > 1,
  the memory saver, KV-cache sharding, prefill not fully graph-covered, EAGLE-family drafts
  under unified memory, a device other than CUDA).

Importing this module imports neither torch nor transformers (the GPU functions do when
called), so the CPU tests check the arithmetic and the step order (tests/test_bench_harness.py).
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import math
from dataclasses import dataclass, field
from typing import Any

from bench.harness import outputs

MiB = 2**20
#: vLLM 0.33.0 ``_FULL_GRAPH_PROFILING_SAMPLES``: FULL descriptors its estimate captures
VLLM_FULL_SAMPLES = 2
#: vLLM 0.33.0 ``_MIN_PER_GRAPH_BYTES``: the floor of the per-graph extrapolation
VLLM_MIN_PER_GRAPH_BYTES = 1 << 20


# -- vLLM: sizes and arithmetic ------------------------------------------------------------


def vllm_capture_sizes(
    *,
    max_num_seqs: int = 1024,
    max_num_batched_tokens: int = 8192,
    decode_query_len: int = 1,
    blackwell: bool = False,
) -> list[int]:
    """vLLM 0.33.0's default capture sizes (tokens), ascending: ``_set_cudagraph_sizes``
    without user sizes, in the default performance mode, without dynamic speculative
    decoding. The defaults are the OpenAI server's on an H100/H200 (``arg_utils``: 1024
    sequences, 8192 batched tokens): 1, 2, 4, 8-248 by 8, 256-512 by 16 (51 sizes).
    ``blackwell``: a data-center Blackwell device (capability family 100), whose ceiling
    is 1024."""
    default_max = 1024 if blackwell else 512
    q = decode_query_len
    max_size = min(max_num_seqs * q * 2, default_max)
    uniform: list[int] = []
    if q > 1:

        def request_counts(max_reqs: int) -> list[int]:
            max_reqs = min(max_reqs, default_max)
            counts = [n for n in (1, 2, 4) if n <= max_reqs]
            counts += list(range(8, min(max_reqs + 1, 256), 8))
            counts += list(range(256, max_reqs + 1, 16))
            return sorted(set(counts + [max_reqs]))

        uniform = sorted({n * q for n in request_counts(max_num_seqs) if n * q <= max_size})
    elif max_num_seqs <= max_size:
        uniform = [max_num_seqs]
    max_size = min(max_num_batched_tokens, max_size)
    sizes = [i for i in (1, 2, 4) if i <= max_size]
    if max_size >= 8:
        sizes += list(range(8, min(max_size + 1, 256), 8))
    if max_size >= 256:
        sizes += list(range(256, max_size + 1, 16))
    if max_num_batched_tokens <= max_size and max_num_batched_tokens not in sizes:
        sizes.append(max_num_batched_tokens)
    sizes += [s for s in uniform if s <= max_num_batched_tokens]
    return sorted(set(sizes))


def vllm_full_decode_requests(
    capture_sizes: list[int], *, decode_query_len: int = 1, max_num_seqs: int = 1024
) -> list[int]:
    """The request counts of vLLM 0.33.0's uniform-decode FULL descriptors, largest first
    (the order it captures them): ``CudaGraphManager._init_candidates`` rounds each size
    up to a multiple of the decode query length and drops those above the largest size,
    ``max_num_seqs`` requests or ``max_num_seqs * decode_query_len`` tokens."""
    q = decode_query_len
    largest = max(capture_sizes)
    reqs: list[int] = []
    for size in sorted(capture_sizes):
        tokens = -(-size // q) * q
        if tokens > max_num_seqs * q or tokens > largest or tokens // q > max_num_seqs:
            continue
        if tokens // q not in reqs:
            reqs.append(tokens // q)
    return sorted(reqs, reverse=True)


# -- vLLM 0.34.0's split sizes ---------------------------------------------------------------


def _walk_grid(limit: int, step) -> list[int]:
    """``config/compilation.py`` ``_walk_grid``: 1, ..., ``limit``, each the next multiple of
    the largest power of two not above ``step(size)``."""
    grid, size = [], 1
    while size < limit:
        grid.append(size)
        stride = 1 << max(0, math.floor(math.log2(max(1.0, step(size)))))
        size = (size // stride + 1) * stride
    return [*grid, limit] if limit else []


def vllm_decode_grid(max_requests: int) -> list[int]:
    """vLLM 0.34.0's ``decode_cudagraph_capture_grid``: every request count up to 6, then a step
    of the largest power of two not above ``0.65 * n ** (2/3)``: 64 sizes at 1024."""
    return _walk_grid(max_requests, lambda n: 0.65 * n ** (2 / 3))


def vllm_prefill_grid(max_tokens: int, dense_head: bool = False) -> list[int]:
    """vLLM 0.34.0's ``prefill_cudagraph_capture_grid`` (the token grid of a data-center
    Blackwell's wide defaults): 54 sizes at 8192."""
    grid = _walk_grid(max_tokens, lambda t: min(t, max(8, t / 4), 0.07 * max(t, 4096)))
    if dense_head:
        grid = sorted({*grid, *(t for t in range(1, 33) if t < max_tokens)})
    return grid


def vllm_decode_shapes(sizes: list[int], query_lens: dict[int, int], max_tokens: int) -> list[tuple[int, int]]:
    """vLLM 0.34.0's ``decode_cudagraph_capture_shapes``: the (requests, query length)
    uniform-decode graphs, each query length up to the requests it maps to and
    ``max_tokens // q``; the first size above that limit captured at the limit."""
    sizes = sorted(set(sizes))
    shapes: set[tuple[int, int]] = set()
    for q, max_reqs in query_lens.items():
        limit = min(max_reqs, max_tokens // q)
        reachable = sizes[: bisect.bisect_left(sizes, limit) + 1]
        shapes.update((min(n, limit), q) for n in reachable if limit >= 1)
    return sorted(shapes, key=lambda shape: (shape[1], shape[0]))


@dataclass(frozen=True)
class Vllm034Sizes:
    """What vLLM 0.34.0 captures by default (``_set_cudagraph_sizes`` then
    ``_split_cudagraph_capture_sizes``, no explicit sizes, no dynamic speculative decoding)."""

    #: token-keyed graphs (PIECEWISE, and mixed FULL), ascending
    prefill_tokens: list[int]
    #: the target's uniform-decode graphs as (requests, query length)
    decode: list[tuple[int, int]]
    #: the draft decode manager's FULL graphs (requests; query length 1): EAGLE/MTP with K >= 2
    draft_decode: list[int]


def vllm_034_sizes(
    *,
    max_num_seqs: int = 1024,
    max_num_batched_tokens: int = 8192,
    num_speculative_tokens: int = 0,
    blackwell: bool = False,
) -> Vllm034Sizes:
    """vLLM 0.34.0's default capture sizes for a device, step by step: the shared sizes as
    0.33.0 made them (:func:`vllm_capture_sizes`); off data-center Blackwell the prefill
    graphs take them and the decode graphs the request counts ``min(cdiv(s, q),
    max_num_seqs)`` of those whose rounded-up tokens fit the largest, on Blackwell the
    token and request grids (:func:`vllm_prefill_grid`, :func:`vllm_decode_grid`, decode
    capped at 8192 tokens); decode graphs keyed (requests, query length) by
    :func:`vllm_decode_shapes`; with 2 or more speculative tokens (EAGLE, MTP) the draft
    decode graphs on their own grid up to ``max_num_seqs`` (H200: 64 up to 1024)."""
    q = 1 + num_speculative_tokens
    shared = vllm_capture_sizes(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        decode_query_len=q,
        blackwell=blackwell,
    )
    query_lens = {q: max_num_seqs}
    if blackwell:
        prefill = vllm_prefill_grid(min(8192, max_num_batched_tokens))
        requests = vllm_decode_grid(max_num_seqs)
        decode_max = min(max_num_batched_tokens, 8192)
    else:
        prefill = list(shared)
        requests = sorted({min(-(-s // q), max_num_seqs) for s in shared if -(-s // q) * q <= max(shared)})
        decode_max = max_num_batched_tokens
    draft_requests = vllm_decode_grid(max_num_seqs) if num_speculative_tokens >= 2 else []
    draft = [n for n, _ in vllm_decode_shapes(draft_requests, {1: max_num_seqs}, decode_max)]
    # the recorded max (max_cudagraph_capture_size) every decode graph is held to: the largest token count
    recorded = max([*prefill, *(n * q for n, q in vllm_decode_shapes(requests, query_lens, decode_max)), *draft])
    return Vllm034Sizes(prefill, vllm_decode_shapes(requests, query_lens, min(recorded, decode_max)), draft)


def _first_warmup(release: str) -> bool:
    """Whether vLLM ``release``'s first warm-up sizes the persistent buffers (its release
    file's ``persistent_buffer`` fact), not the widest descriptor."""
    from capture_plan.planner.inputs.releases import release as release_file

    facts = release_file("vllm", release).facts
    assert facts is not None, f"vllm {release}: its release file has no [facts]"
    return facts.persistent_buffer == "first-warmup"


def vllm_persistent_rows(release: str, first_warmup_tokens: int, widest_tokens: int) -> int:
    """Rows of the persistent hidden states a model manager keeps, as the release's
    ``persistent_buffer`` fact says: vLLM 0.33.0's first warm-up makes them the size of its own
    descriptor (the largest PIECEWISE one's, by default), 0.34.0's ``persistent_like`` the
    widest descriptor's."""
    return first_warmup_tokens if _first_warmup(release) else max(first_warmup_tokens, widest_tokens)


def vllm_extrapolate(samples: list[int], total_graphs: int) -> int:
    """``_extrapolate_full_graph_memory``: ``first + (n - 1) * max(second, 1 MiB)``; the
    first sample alone where there is one; 0 without samples."""
    if not samples:
        return 0
    per_graph = max(samples[1], VLLM_MIN_PER_GRAPH_BYTES) if len(samples) > 1 else 0
    return samples[0] + (total_graphs - 1) * per_graph


def vllm_estimate(measured: int, samples: list[int], total_full: int) -> int:
    """``profile_cudagraph_memory``'s answer: the profiling capture's whole drop with the
    sampled FULL graphs swapped for their extrapolation, never below 0."""
    return max(measured - sum(samples) + vllm_extrapolate(samples, total_full), 0)


# -- vLLM: the capture, on the GPU ---------------------------------------------------------------


@dataclass
class VllmCapture:
    """What :func:`vllm_capture_model` captured."""

    pool: Any = None
    #: ``(phase, requests)`` -> graph, in capture order
    graphs: dict = field(default_factory=dict)
    #: persistent output buffers per phase (the manager's hidden_states and aux list)
    buffers: dict = field(default_factory=dict)
    #: free bytes at the start (after emptying the cache) minus free bytes at the end
    measured: int = 0
    #: the free-memory drop around each sampled FULL ``torch.cuda.graph`` block
    samples: list = field(default_factory=list)


def _free() -> int:
    import torch

    return int(torch.cuda.mem_get_info()[0])


def _store(run: VllmCapture, phase: str, n: int, out, rows: int = 0) -> None:
    """``store_capture_output``: copy the outputs' first ``n`` rows into the phase's
    persistent buffers, made on first use like the first output (0.33.0), or with at least
    ``rows`` rows, the widest descriptor's (0.34.0's ``persistent_like``)."""

    got = outputs(out)
    if phase not in run.buffers:
        run.buffers[phase] = tuple(t.new_empty((max(rows, t.shape[0]), *t.shape[1:])) for t in got)
    for buf, t in zip(run.buffers[phase], got):
        buf[: t.shape[0]] = t


def vllm_capture_model(
    target,
    full: tuple[str, list[int]],
    speculator: list[tuple[str, list[int]]] = (),  # type: ignore[assignment]
    *,
    pool=None,
    max_full: int | None = None,
    sample: bool = False,
    release: str = "0.33.0",
) -> VllmCapture:
    """vLLM 0.33.0's capture of ``full`` (phase, request counts: the FULL descriptors)
    then each ``speculator`` phase, all into ``pool`` (a new one where None: the
    platform's global pool); ``max_full`` and ``sample``: the profiling hooks (the FULL
    descriptors capped, each FULL block's drop sampled). Step by step as
    ``GPUModelRunner.capture_model`` and ``CudaGraphManager.capture``: empty the cache,
    read free memory; on a side stream, per descriptor largest-first: a warm-up
    (``forward_fn(NONE)``, which stores its outputs in the persistent buffers), then
    ``torch.cuda.graph(graph, pool, stream=...)`` around the forward and the copy; then
    free memory again. Releases nothing: :func:`vllm_release` does. ``release``: whose
    persistent buffers (:func:`vllm_persistent_rows`: 0.34.0 sizes them for the widest
    descriptor of the phase up front)."""
    import torch

    run = VllmCapture(pool=torch.cuda.graph_pool_handle() if pool is None else pool)
    torch.cuda.empty_cache()
    start = _free()
    stream = torch.cuda.Stream()  # graph_capture(device): capture runs on a stream of its own
    phase, reqs = full
    descs = sorted(reqs, reverse=True)[:max_full]
    with torch.cuda.stream(stream):
        for kind, (name, sizes) in [("full", (phase, descs)), *(("spec", s) for s in speculator)]:
            order = sorted(sizes, reverse=True) if kind == "spec" else sizes
            widest = 0 if _first_warmup(release) else max(sizes, default=0)
            for n in order:
                _store(run, name, n, target.run(name, n, None), widest)  # the warm-up (forward_fn(NONE))
                graph = torch.cuda.CUDAGraph()
                before = None
                if sample and kind == "full":
                    torch.cuda.synchronize()
                    before = _free()
                with torch.cuda.graph(graph, pool=run.pool, stream=stream):
                    _store(run, name, n, target.run(name, n, None))
                if before is not None:
                    torch.cuda.synchronize()
                    run.samples.append(before - _free())
                run.graphs[(name, n)] = graph
    run.measured = start - _free()
    return run


def vllm_release(run: VllmCapture) -> None:
    """Reset the graphs, drop the buffers, collect and empty the cache (the profiling
    teardown, and the end of a measured capture)."""
    import torch

    for g in run.graphs.values():
        g.reset()
    run.graphs.clear()
    run.buffers.clear()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def vllm_profile(target, full: tuple[str, list[int]], speculator: list[tuple[str, list[int]]] = ()) -> dict:  # type: ignore[assignment]
    """vLLM 0.33.0's ``profile_cudagraph_memory`` on ``target``: collect and empty the
    cache, ONE throwaway pool, :func:`vllm_capture_model` with the FULL descriptors
    capped at :data:`VLLM_FULL_SAMPLES` and sampled, the speculator's in full, then
    :func:`vllm_estimate` and the teardown. Returns the estimate and its parts (bytes)."""
    import torch

    gc.collect()
    torch.cuda.empty_cache()
    throwaway = torch.cuda.graph_pool_handle()
    run = vllm_capture_model(target, full, speculator, pool=throwaway, max_full=VLLM_FULL_SAMPLES, sample=True)
    total_full = len(full[1])
    out = {
        "estimate": vllm_estimate(run.measured, run.samples, total_full),
        "measured": run.measured,
        "samples": list(run.samples),
        "full_graphs": total_full,
        "profiled_graphs": len(run.graphs),
    }
    vllm_release(run)
    return out


@contextlib.contextmanager
def hidden_state_outputs(target):
    """Within the block, ``target.run`` returns what vLLM's FULL graphs return: the final
    norm's hidden states, not logits. The benches' targets: the reference decode step and
    the speculative reference's target model (``_logits`` swapped for the final norm;
    the draft keeps its head, which its sampling needs), a transformers model in
    ``HFTarget`` (its ``lm_head`` swapped for the identity; Gemma2's soft-capping then
    applies to hidden states: one elementwise temporary). Restored on exit."""
    import torch

    from capture_plan.references.decode import _rmsnorm

    model = getattr(target, "target", target)  # the speculative reference: its target model
    hf = getattr(target, "model", None)
    if hasattr(model, "_logits") and hasattr(model, "final_norm"):
        model._logits = lambda h: _rmsnorm(h, model.final_norm)
        try:
            yield target
        finally:
            del model._logits
    elif isinstance(hf, torch.nn.Module) and hasattr(hf, "lm_head"):
        head = hf.lm_head
        hf.lm_head = torch.nn.Identity()
        try:
            yield target
        finally:
            hf.lm_head = head
    else:
        raise TypeError(f"{type(target).__name__}: no LM head known to swap for hidden-state outputs")


# -- SGLang --------------------------------------------------------------------------------------


def sglang_prefill_sizes(max_bs: int) -> list[int]:
    """SGLang 0.5.23's default prefill graph sizes (tokens) up to ``max_bs``
    (``generate_prefill_cuda_graph_batch_sizes``); on an H200 at TP < 4 ``max_bs`` is the
    chunked-prefill size, 8192 (``handle_gpu_memory_settings``): 58 sizes."""
    sizes = (
        list(range(4, 33, 4))
        + list(range(48, 257, 16))
        + list(range(288, 513, 32))
        + list(range(576, 1024 + 1, 64))
        + list(range(1280, 4096 + 1, 256))
        + list(range(4608, max_bs + 1, 512))
    )
    return [s for s in sizes if s <= max_bs]


def sglang_reserve_mib(
    *,
    decode_max_bs: int,
    prefill_sizes: list[int] | None = None,
    mla: bool = False,
    attn_dp_size: int = 0,
    disaggregation_mode: str = "null",
    decode_graphs: bool = True,
    prefill_backend: str = "breakable",
    deepep: bool = False,
) -> float:
    """SGLang 0.5.23's ``reserve_for_graph_mb`` (MiB): ``decode_max_bs * 2`` for the decode
    graphs (unless the decode backend is disabled or this is a prefill-only server);
    with DP attention (``attn_dp_size`` > 0) ``decode_max_bs * attn_dp_size * 3``, and
    ``* 1.5`` more above 300; for prefill graphs (``prefill_backend`` not "disabled", not
    a decode-only server) 8 per prefill size, or 1.5 GiB for an MLA backend, plus 1 GiB
    for breakable prefill graphs with DeepEP. ``prefill_sizes``: default
    :func:`sglang_prefill_sizes` (8192)."""
    if prefill_sizes is None:
        prefill_sizes = sglang_prefill_sizes(8192)
    reserved = 0.0
    if disaggregation_mode != "prefill" and decode_graphs:
        reserved += decode_max_bs * 2
    if attn_dp_size and disaggregation_mode != "prefill":
        reserved += decode_max_bs * attn_dp_size * 3
        if decode_max_bs > 300:
            reserved += decode_max_bs * attn_dp_size * 1.5
    if disaggregation_mode != "decode" and prefill_backend != "disabled":
        reserved += 1.5 * 1024 if mla else len(prefill_sizes) * 8
        if prefill_backend == "breakable" and deepep:
            reserved += 1 * 1024
    return reserved
