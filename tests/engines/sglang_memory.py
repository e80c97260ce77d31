"""SGLang 0.5.23's start-up as far as the KV pool's size: the memory settings the server
resolves, the free memory measured before and after the weights, the pool sized from it,
the decode graphs captured and their memory measured as the release measures it.

This is the step-by-step follower of the released code (bench/fit_bench.py's SGLang
runner); planner/fit/sglang.py and planner/fit/sizing.py are the rule fit applies, from the
same reading, separate code. Facts from the released wheel
(sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl, sha256 00b3cd5b...9937, the one
planner/data/releases/sglang-0.5.23.toml names; this code is our own, its names the
release's):

* ``srt/arg_groups/memory_hook.py`` ``handle_gpu_memory_settings``: ``gpu_mem`` is
  ``utils/common.py`` ``get_device_memory_capacity`` (``get_nvgpu_memory_capacity``:
  ``nvidia-smi --query-gpu=memory.total``, MiB, the least of every GPU the host shows; else
  ``_cuda_mem_fallback``: torch's total // 2**20). Tiers, where not given:
  ``chunked_prefill_size`` / decode ``max_bs`` (tp < 4; from tp 4) are 2048 / 8 under 20 GiB,
  4096 / 48 (160) under 35, 4096 / 32 (160) under 60, 8192 / 256 (512) under 90 and under
  160, else 16384 / 512. A default decode ``max_bs`` above ``max_running_requests`` is
  capped to it. The decode sizes are ``arg_groups/cuda_graph_hook.py``
  ``generate_decode_cuda_graph_batch_sizes(max_bs)`` where not given (else ``max_bs`` is
  their largest); the prefill ``max_bs`` is ``chunked_prefill_size`` (MLA: at most 8192),
  its sizes ``generate_prefill_cuda_graph_batch_sizes``. ``mem_fraction_static``, where not
  given: with post-capture sizing planned (below) ``reserved = 1536 + tp * pp / 8 * 1024``;
  else ``activation_tokens = max(chunked_prefill_size, 2048)``, ``reserved = 512 +
  activation_tokens * 1.5 + tp * pp / 8 * 1024 + reserve_for_graph_mb``, at least 10240 where
  ``gpu_mem > 60 * 1024`` (then DeepEP's 2048, XPU's 2048); ``round((gpu_mem - reserved) /
  gpu_mem, 3)``.
* ``memory_hook.py`` ``reserve_for_graph_mb``: decode graphs (backend not disabled, not a
  prefill server) ``max_bs * 2``; prefill graphs (backend not disabled, not a decode server)
  ``len(prefill bs) * 8``, or 1536 for an MLA backend. The CUDA default prefill backend is
  breakable (``model_executor/cuda_graph_config.py`` ``default_prefill_backend``);
  ``--disable-prefill-cuda-graph`` disables it (``cuda_graph_hook.parse_cuda_graph_config``).
* ``distributed/bootstrap.py`` ``measure_pre_model_load_memory`` (``ModelRunner.init_torch_distributed``,
  before the weights load): ``get_available_gpu_memory`` (``utils/common.py``: the cache
  emptied, ``mem_get_info``'s free bytes / 2**30, a float in GiB).
* ``mem_cache/kv_cache_configurator.py`` ``KVCacheConfigurator._profile_available_bytes``
  (``alloc_memory_pool`` -> ``configure`` -> ``_resolve_memory_pool_config``, after the weights):
  ``gc.collect()``, ``get_available_gpu_memory``; ``rest = available - pre_model_load_memory *
  (1 - mem_fraction_static)`` in GiB; ``rest <= 0`` raises ValueError; ``int(rest * 2**30)``.
* ``model_executor/pool_configurator.py`` ``DefaultPoolConfigurator``: ``_compute_cell_size``
  (MHA) ``kv heads per rank * (head_dim + v_head_dim) * layers * element size`` (every
  layer: a model SGLang does not list as hybrid SWA, ``configs/model_config.py``
  ``is_hybrid_swa_model``, Gemma2 among them, gets one full pool); ``calculate_pool_sizes``:
  ``available // cell_size // page_size * page_size``; ``MemoryPoolConfig.__post_init__``
  raises RuntimeError on 0 tokens.
* ``kv_cache_configurator.py`` ``resolve_max_num_reqs``: ``estimated = int(tokens /
  context_len * 512)`` within [2048, 4096]; ``min(max_running_requests or estimated, tokens
  // 2)``. ``_build_default_req_pool``: ``ReqToTokenPool(size=max_num_reqs,
  max_context_len=context_len)`` (``mem_cache/memory_pool.py``: ``torch.zeros((size + 1,
  max_context_len), int32)``); ``MHATokenToKVPool``: per layer K and V of ``(size +
  page_size, heads, head_dim)``, zeros.
* ``model_runner_components/cuda_graph_setup.py`` ``capture_decode_graph``:
  ``get_available_gpu_memory`` before and after the decode runner is made (its buffers, the
  process's shared float32 logits buffer of ``max(capture_bs)`` rows x vocab,
  ``graph_shared_output.py``, and its capture): ``memory_usage_gb`` is the drop.
* Post-capture sizing (``SGLANG_ENABLE_POST_CAPTURE_KV_SIZING``, default off, ``environ.py``;
  ``arg_groups/overrides.py`` ``post_capture_kv_sizing_planned``: off for MLA, with decode or
  prefill graphs disabled, or where the prefill buffer exceeds the largest prefill size;
  ``model_runner_components/kv_pool_runtime.py`` ``compute_post_capture_kv_resize``: free
  after capture less ``pre_model_load_memory * (1 - mem_fraction_static)``, plus what the
  pool already backs, capped at the pre-capture tokens): not followed here (it needs the
  prefill graphs, which this runner does not capture).

Where this runner deviates (each stated where it is used, bench/fit_bench_sglang.py):

* the model is loaded before the runner exists (bench.harness ``case_target``), so
  :class:`StartUp` measures ``pre_model_load_memory`` before the caller builds it, and the
  release's ``ModelRunner`` (tests/engines/sglang_runner.py's, its ``load_model`` a no-op)
  is made after the pool is sized, with the sized request count;
* the case model is transformers' (bench.harness ``case_target``), not SGLang's: its rotary
  module keeps ``inv_freq`` buffers SGLang's does not, and no cos/sin cache; the runner makes
  SGLang's (tests/engines/case_model.py ``engine_weights``: layers/rotary_embedding/base.py
  ``RotaryEmbedding.__init__`` keeps the cache in float32 on CUDA, "for numerical stability")
  once the model is built, before the pool is sized, and counts it
  with the weights in place of the case model's rotary buffers (a few hundred bytes, left in
  the memory the load took);
* the case model keeps a static decode cache of its own (allocated with its weights): it is
  counted as the pool's (free memory when the pool is sized; the pool allocated is the rest);
* no attention backend, no eager runner (its input registry, sized by the pool's tokens),
  no prefill graphs (the bench disables them on both sides), tp = pp = 1, no speculative
  decoding, no LoRA, no DP attention, no disaggregation, no DeepEP, no VLM adjustment,
  no ``max_total_tokens`` cap.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import subprocess

GiB = 1 << 30

FULL, BREAKABLE, DISABLED = "full", "breakable", "disabled"

#: memory_hook.handle_gpu_memory_settings' tiers: (below MiB, chunked_prefill_size, max_bs tp < 4, max_bs tp >= 4)
TIERS = (
    (20 * 1024, 2048, 8, 8),
    (35 * 1024, 4096, 48, 160),
    (60 * 1024, 4096, 32, 160),
    (90 * 1024, 8192, 256, 512),
    (160 * 1024, 8192, 256, 512),
)
TOP_TIER = (16384, 512)


def generate_decode_cuda_graph_batch_sizes(max_bs: int) -> list[int]:
    """cuda_graph_hook.py: the normal case (no speculative algorithm, padding on)."""
    capture_bs = (
        [1, 2, 4, 8, 12] + list(range(16, 257, 8)) + list(range(272, 512, 16)) + list(range(512, max_bs + 1, 32))
    )
    capture_bs = [bs for bs in capture_bs if bs <= max_bs]
    if max_bs not in capture_bs:
        capture_bs.append(max_bs)
    return capture_bs


def generate_prefill_cuda_graph_batch_sizes(max_bs: int) -> list[int]:
    """cuda_graph_hook.py: the prefill capture sizes (tokens) up to ``max_bs``."""
    capture_sizes = (
        list(range(4, 33, 4))
        + list(range(48, 257, 16))
        + list(range(288, 513, 32))
        + list(range(576, 1024 + 1, 64))
        + list(range(1280, 4096 + 1, 256))
        + list(range(4608, max_bs + 1, 512))
    )
    return [s for s in capture_sizes if s <= max_bs]


def reserve_for_graph_mb(*, decode_max_bs: int, prefill_bs, decode_backend=FULL, prefill_backend=BREAKABLE, mla=False):
    """memory_hook.py, without disaggregation, DP attention or DeepEP (MiB)."""
    reserved_mem = 0.0
    if decode_backend != DISABLED:
        reserved_mem += decode_max_bs * 2
    if prefill_backend != DISABLED:
        reserved_mem += 1.5 * 1024 if mla else len(prefill_bs) * 8
    return reserved_mem


@dataclasses.dataclass(frozen=True)
class MemorySettings:
    """What handle_gpu_memory_settings resolves, and the settings the pool reads."""

    gpu_mem: float
    tp_size: int
    chunked_prefill_size: int
    decode_max_bs: int
    decode_bs: tuple[int, ...]
    prefill_backend: str
    prefill_bs: tuple[int, ...]
    reserve_for_graph_mb: float
    mem_fraction_static: float
    context_len: int
    page_size: int = 1
    max_running_requests: int | None = None


def handle_gpu_memory_settings(
    gpu_mem: float,
    *,
    context_len: int,
    tp_size: int = 1,
    pp_size: int = 1,
    chunked_prefill_size: int | None = None,
    decode_max_bs: int | None = None,
    decode_bs=None,
    max_running_requests: int | None = None,
    prefill_backend: str = BREAKABLE,
    mem_fraction_static: float | None = None,
    mla: bool = False,
    post_capture_kv_sizing: bool = False,
    page_size: int = 1,
) -> MemorySettings:
    """memory_hook.py ``handle_gpu_memory_settings`` for a CUDA device (module docstring)."""
    default_max_bs = decode_max_bs is None
    chunk, bs = next(((c, b if tp_size < 4 else b4) for top, c, b, b4 in TIERS if gpu_mem < top), TOP_TIER)
    if chunked_prefill_size is None:
        chunked_prefill_size = chunk
    if decode_max_bs is None:
        decode_max_bs = bs
    if default_max_bs and max_running_requests is not None and decode_max_bs > max_running_requests:
        decode_max_bs = max_running_requests
    if decode_bs is None:
        decode_bs = generate_decode_cuda_graph_batch_sizes(decode_max_bs)
    else:
        decode_max_bs = max(decode_bs)
    prefill_max_bs = chunked_prefill_size if not mla else min(8192, chunked_prefill_size)
    prefill_bs = generate_prefill_cuda_graph_batch_sizes(prefill_max_bs)
    graph_mb = reserve_for_graph_mb(
        decode_max_bs=decode_max_bs, prefill_bs=prefill_bs, prefill_backend=prefill_backend, mla=mla
    )
    if mem_fraction_static is None:
        if post_capture_kv_sizing:
            reserved_mem = 1536 + tp_size * pp_size / 8 * 1024
        else:
            if chunked_prefill_size <= 0:
                raise ValueError("chunked_prefill_size <= 0 (max_prefill_tokens' branch) is not followed")
            activation_tokens = max(chunked_prefill_size, 2048)
            reserved_mem = 512 + activation_tokens * 1.5 + tp_size * pp_size / 8 * 1024 + graph_mb
            if gpu_mem > 60 * 1024:
                reserved_mem = max(reserved_mem, 10 * 1024)
        mem_fraction_static = round((gpu_mem - reserved_mem) / gpu_mem, 3)
    return MemorySettings(
        gpu_mem=gpu_mem,
        tp_size=tp_size,
        chunked_prefill_size=chunked_prefill_size,
        decode_max_bs=decode_max_bs,
        decode_bs=tuple(decode_bs),
        prefill_backend=prefill_backend,
        prefill_bs=tuple(prefill_bs),
        reserve_for_graph_mb=graph_mb,
        mem_fraction_static=mem_fraction_static,
        context_len=context_len,
        page_size=page_size,
        max_running_requests=max_running_requests,
    )


def profile_available_bytes(available_gpu_memory: float, pre_model_load_memory: float, fraction: float) -> int:
    """kv_cache_configurator.py ``_profile_available_bytes`` (GiB floats in, bytes out)."""
    slack_gb = pre_model_load_memory * (1 - fraction)
    rest_memory = available_gpu_memory - slack_gb
    if rest_memory <= 0:
        minimum = 1 - available_gpu_memory / pre_model_load_memory
        raise ValueError(
            f"Loaded weights leave no GPU memory for the KV cache under --mem-fraction-static={fraction}. "
            f"Raise --mem-fraction-static above {math.ceil(minimum * 1000) / 1000:.3f}"
        )
    return int(rest_memory * (1 << 30))


def cell_size(*, kv_heads: int, head_dim: int, v_head_dim: int, layers: int, element_size: int) -> int:
    """pool_configurator.py ``DefaultPoolConfigurator._compute_cell_size`` (MHA)."""
    return kv_heads * (head_dim + v_head_dim) * layers * element_size


def calculate_pool_sizes(available_bytes: int, cell: int, page_size: int) -> int:
    """pool_configurator.py ``DefaultPoolConfigurator.calculate_pool_sizes``: the pool's tokens."""
    tokens = max(available_bytes, 0) // cell // page_size * page_size
    if tokens <= 0:  # MemoryPoolConfig.__post_init__
        raise RuntimeError("Not enough memory. Please try to increase --mem-fraction-static.")
    return tokens


def resolve_max_num_reqs(tokens: int, context_len: int, max_running_requests: int | None = None) -> int:
    """kv_cache_configurator.py ``resolve_max_num_reqs`` (one DP worker, no Mamba)."""
    estimated = max(min(int(tokens / context_len * 512), 4096), 2048)
    if max_running_requests is not None:
        return min(max(1, max_running_requests), tokens // 2)
    return min(estimated, tokens // 2)


# -- on the device -------------------------------------------------------------------------------


def gpu_memory_capacity_mib() -> float:
    """utils/common.py ``get_nvgpu_memory_capacity``: nvidia-smi's least total, else torch's (MiB)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
        )
        values = [float(v) for v in out.stdout.split() if v.replace(".", "", 1).isdigit()]
        if out.returncode == 0 and values:
            return min(values)
    except FileNotFoundError:
        pass
    import torch

    return min(torch.cuda.mem_get_info(i)[1] // 1024 // 1024 for i in range(torch.cuda.device_count()))


def get_available_gpu_memory(empty_cache: bool = True) -> float:
    """utils/common.py: free memory in GiB, the cache emptied first."""
    import torch

    if empty_cache:
        torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(torch.cuda.current_device())[0] / (1 << 30)


@dataclasses.dataclass
class Pool:
    """What alloc_memory_pool sized and allocated."""

    available_gpu_memory: float
    rest_bytes: int
    cell_size: int
    max_total_num_tokens: int
    max_running_requests: int
    #: the pool's K and V bytes ((tokens + page_size) x cell), the request pool's
    kv_bytes: int
    req_to_token_bytes: int
    tensors: list = dataclasses.field(default_factory=list)


class StartUp:
    """scheduler.py ``init_model_worker`` over the release's runner (``module``: the version of
    tests/engines/sglang_runner.py before the adoption), as far as the pool and the decode
    graphs: the config published, ``pre_model_load_memory`` measured now (before the caller
    loads the model), :meth:`alloc_memory_pool`, :meth:`init_attention_backends`,
    :meth:`init_cuda_graphs`."""

    def __init__(self, module, settings: MemorySettings):
        self.module, self.settings = module, settings
        module.reset_globals()
        module.publish(settings.decode_bs)  # runtime_context.publish: the resolved decode sizes
        self.pre_model_load_memory = get_available_gpu_memory()
        # model_runner.py ModelRunner.__init__ (line 469), right after init_torch_distributed:
        # forward_stream, the process's first torch stream (torch makes its stream pools here,
        # inside what _profile_available_bytes reads; the capture stream comes from them later)
        import torch

        self.forward_stream = torch.cuda.Stream()
        self.pool: Pool | None = None
        self.model_runner = None

    def alloc_memory_pool(self, model, *, cell: int, committed_bytes: int = 0) -> Pool:
        """KVCacheConfigurator.configure: the pool sized from the free memory now
        (``committed_bytes``, the model's own decode cache, counted as the pool's), its
        tensors allocated; then the release's ``ModelRunner`` with the sized request count."""
        import torch

        s = self.settings
        gc.collect()
        available = get_available_gpu_memory() + committed_bytes / (1 << 30)
        rest = profile_available_bytes(available, self.pre_model_load_memory, s.mem_fraction_static)
        tokens = calculate_pool_sizes(rest, cell, s.page_size)
        reqs = resolve_max_num_reqs(tokens, s.context_len, s.max_running_requests)
        kv_bytes = (tokens + s.page_size) * cell
        req_bytes = (reqs + 1) * s.context_len * 4
        tensors = [
            torch.zeros(max(kv_bytes - committed_bytes, 0), dtype=torch.uint8, device=model.device),
            torch.zeros((reqs + 1, s.context_len), dtype=torch.int32, device=model.device),
        ]
        self.pool = Pool(available, rest, cell, tokens, reqs, kv_bytes, req_bytes, tensors)
        self.model_runner = self.module.ModelRunner(model, max_running_requests=reqs)
        return self.pool

    def init_attention_backends(self, model) -> None:
        """scheduler.py ``init_all_attention_backends``, between the pool and the graphs:
        model_runner_components/attention_backend_setup.py ``build_attention_backends`` runs
        utils/common.py ``init_cublas`` (a 16x16 float16 matmul) on CUDA before it builds a
        backend. Where it is the process's first GEMM it initializes cuBLAS (tens of MiB
        outside torch's allocator, bench/side_stream_bench.py), which then leaves the slack
        the pool left, not the graphs' drop. The runner builds no attention backend (its models call FA3
        themselves). As the release, only on CUDA (``model.device``; the CPU tests' models skip it)."""
        import torch

        if torch.device(model.device).type != "cuda":
            return
        a = torch.ones((16, 16), dtype=torch.float16, device=model.device)
        b = torch.ones((16, 16), dtype=torch.float16, device=model.device)
        c = a @ b
        del a, b, c

    def init_cuda_graphs(self, model) -> tuple[object, int]:
        """cuda_graph_setup.py ``capture_decode_graph``: the decode runner made (the shared
        logits buffer, ``model.create_logits_buffer``) and captured between two readings of
        the free memory; returns the runner and the drop in bytes."""
        import torch

        capture_bs = self.model_runner.capture_bs()
        with torch.no_grad():  # scheduler.py init_all_cuda_graphs
            before = get_available_gpu_memory()
            model.create_logits_buffer(max(capture_bs))  # GraphSharedOutput.create_for_model_runner
            runner = self.module.DecodeCudaGraphRunner(model, capture_bs)
            runner.capture()
            after = get_available_gpu_memory()
        return runner, int(round((before - after) * (1 << 30)))
