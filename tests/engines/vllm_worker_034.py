"""vLLM 0.34.0's worker start-up, as far as the KV cache's size: the profiling run, the
graph estimate, the extensible KV cache sized after capture.

Run after tests/engines/vllm_runner_034.py over the same namespace (:data:`engines.plugged.LATER`):
the runner (``GPUModelRunner``) is that file's. Facts from the released wheel (vllm==0.34.0;
this code is our own, its names the release's; each step names the lines it follows):

* ``vllm/envs.py`` lines 2355-2357: ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``, default "1".
* ``vllm/utils/mem_utils.py`` ``MemorySnapshot.measure`` (lines 154-176: torch's allocated peak
  and current, free and total from ``mem_get_info``, torch's reserve, the rest non-torch) and
  ``memory_profiling`` (lines 299-345: collect, empty the cache, reset the peak, snapshot;
  after the profiled block collect, empty, snapshot; ``total_consumed`` = the free memory the
  worker took since its first snapshot, ``transient_peak_headroom`` = torch's allocated peak
  less what stays allocated, ``non_kv_cache_memory`` their sum).
* ``vllm/v1/worker/gpu_worker.py`` ``determine_available_memory`` (lines 673-841, without
  ``kv_cache_memory_bytes`` and the startup plan): ``profile_run`` inside
  ``memory_profiling``; the graph estimate only where the flag above is on;
  ``peak_activation_memory = transient_peak_headroom + estimate``; the KV budget
  ``requested - non_kv_cache_memory - estimate``. ``initialize_from_config`` (lines 887-964):
  the runner's ``initialize_kv_cache`` (its block tables: before capture and the measure with
  the extensible cache, after the sizing without it) and the extensible cache's
  ``reserved_headroom_bytes = peak_activation_memory``.
  ``_compile_or_warm_up_model`` (lines 1022-1244): the peak reset, the sizing warm-up
  (``run_kv_cache_sizing_warmup``), ``record_transient_peak``, the capture, then
  ``measure_kv_cache_blocks``.
* ``vllm/v1/worker/gpu/warmup.py`` ``_measure_sizing_step`` (lines 452-480): a sizing step's
  growth of torch's reserve from an emptied cache, less what it leaves allocated;
  ``run_kv_cache_sizing_warmup`` (lines 483-540): the largest step, ``max_num_batched_tokens``
  (its mixed prefill-decode batch is the dummy run's forward here, and its sampler the dummy
  sampler run: the toy has no scheduler).
* ``vllm/v1/worker/extensible_kv_cache.py``: ``KV_CACHE_MARGIN_FLOOR_BYTES`` (1 GiB on CUDA),
  ``KV_CACHE_MARGIN_FRACTION`` (0.75), ``KV_CACHE_NON_TORCH_RESERVE_BYTES`` (512 MiB on
  CUDA) (lines 64-71); ``record_transient_peak`` (lines 268-278); ``measure_kv_cache_bytes``
  (lines 592-618) and ``measure_kv_cache_blocks`` (lines 621-713: collect, empty the cache,
  read free memory, the bytes, the blocks, torch's limit).

Not modelled (stated where it matters): the cache's granule rounding (``blocks_within`` is
a division here: the physical mapping's granule is the driver's), the blocks warm-up commits
(shrunk back to ``min_committed_blocks`` before capture in the release: 0 here unless the
caller sets ``committed_bytes``), the torch
memory limit (computed and kept on the cache, not applied to the allocator), multimodal IPC
memory (``reserve_mm_ipc_gpu_memory``: none without multimodal input), the JIT kernel warm-up.
"""

from __future__ import annotations

import dataclasses
import gc
import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # vllm_runner_034.py's, in whose namespace this file runs
    from .vllm_runner_034 import GPUModelRunner

KV_CACHE_MARGIN_FLOOR_BYTES = 1 << 30
KV_CACHE_MARGIN_FRACTION = 0.75
KV_CACHE_NON_TORCH_RESERVE_BYTES = 1 << 29


def estimate_cudagraphs() -> bool:
    """envs.py's ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS`` (default on)."""
    return bool(int(os.getenv("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", "1")))


def _stats(device=None) -> dict:
    return dict(torch.cuda.memory_stats(device))


@dataclasses.dataclass
class MemorySnapshot:
    """mem_utils.py's MemorySnapshot (``measure``)."""

    torch_peak: int = 0
    torch_allocated: int = 0
    free_memory: int = 0
    total_memory: int = 0
    torch_memory: int = 0

    def measure(self, device=None) -> MemorySnapshot:
        stats = _stats(device)
        self.torch_peak = stats.get("allocated_bytes.all.peak", 0)
        self.torch_allocated = stats.get("allocated_bytes.all.current", 0)
        self.free_memory, self.total_memory = torch.cuda.mem_get_info()
        self.torch_memory = torch.cuda.memory_reserved(device)
        return self

    @property
    def non_torch_memory(self) -> int:
        return self.total_memory - self.free_memory - self.torch_memory


@dataclasses.dataclass
class MemoryProfilingResult:
    total_consumed: int = 0
    transient_peak_headroom: int = 0
    non_kv_cache_memory: int = 0
    weights_memory: int = 0
    after_profile: MemorySnapshot = dataclasses.field(default_factory=MemorySnapshot)


class memory_profiling:
    """mem_utils.py's ``memory_profiling`` (a context manager yielding its result)."""

    def __init__(self, baseline: MemorySnapshot, weights_memory: int = 0):
        self.baseline, self.result = baseline, MemoryProfilingResult(weights_memory=weights_memory)

    def __enter__(self) -> MemoryProfilingResult:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return self.result

    def __exit__(self, *exc) -> None:
        if exc[0] is not None:
            return
        gc.collect()
        torch.cuda.empty_cache()
        r = self.result
        after = r.after_profile.measure()
        r.total_consumed = self.baseline.free_memory - after.free_memory
        r.transient_peak_headroom = after.torch_peak - after.torch_allocated
        r.non_kv_cache_memory = r.total_consumed + r.transient_peak_headroom


class ExtensibleKVCache:
    """extensible_kv_cache.py's: address space reserved, blocks backed after capture."""

    def __init__(self, block_bytes: int, capacity_blocks: int | None = None):
        self.block_bytes = self.bytes_per_block = block_bytes
        self.capacity_blocks = capacity_blocks
        #: kept free when the cache is sized: the profiled peak plus the graph estimate
        self.reserved_headroom_bytes = 0
        #: the largest growth of torch's reserve over a sizing step
        self.torch_reserve_growth_bytes = 0
        self.num_committed_blocks = 0
        #: the bytes torch's allocator may reserve once the cache is sized (not applied here)
        self.torch_memory_limit: int | None = None
        #: bytes committed to the cache when it is measured: the release shrinks warm-up's
        #: commits back to ``min_committed_blocks`` before capture (0 here); a caller whose
        #: model keeps a decode cache of its own through capture (bench/fit_bench.py's case
        #: models) sets its bytes, which measure_kv_cache_bytes counts as the cache's, not as
        #: other memory used
        self.committed_bytes = 0

    @property
    def physical_bytes(self) -> int:
        """The committed blocks' bytes (:attr:`committed_bytes`)."""
        return self.committed_bytes

    def physical_bytes_for(self, num_blocks: int) -> int:
        return num_blocks * self.bytes_per_block

    def blocks_within(self, num_bytes: int) -> int:
        blocks = max(num_bytes, 0) // self.bytes_per_block
        return blocks if self.capacity_blocks is None else min(blocks, self.capacity_blocks)

    def record_transient_peak(self) -> dict:
        """Lines 268-278: the allocated peak since the last reset, less what stays allocated."""
        torch.cuda.synchronize()
        stats = _stats()
        self.reserved_headroom_bytes = max(
            self.reserved_headroom_bytes,
            stats.get("allocated_bytes.all.peak", 0) - stats.get("allocated_bytes.all.current", 0),
        )
        return stats


def measure_kv_cache_bytes(
    *,
    init_free_memory: int,
    free_memory: int,
    committed_bytes: int,
    requested_memory: int,
    transient_peak_bytes: int = 0,
    torch_reserve_growth_bytes: int = 0,
    margin_floor_bytes: int = KV_CACHE_MARGIN_FLOOR_BYTES,
    margin_fraction: float = KV_CACHE_MARGIN_FRACTION,
) -> int:
    """Lines 592-618, as the release has it."""
    non_kv_used = init_free_memory - free_memory - committed_bytes
    headroom = free_memory + committed_bytes
    margin = max(margin_floor_bytes, int(transient_peak_bytes * margin_fraction))
    available = min(requested_memory - non_kv_used, headroom - margin)
    available -= max(transient_peak_bytes, torch_reserve_growth_bytes)
    return max(available, 0)


def measure_kv_cache_blocks(kv_cache, vllm_config, device, *, init_free_memory, requested_memory):
    """Lines 621-713: the blocks the memory free after capture holds (the margin, the
    transient peak and the reserve growth kept free), within the request; torch's limit
    computed (kept on the cache)."""
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    free_memory = torch.cuda.mem_get_info()[0]
    measured = dict(
        init_free_memory=init_free_memory,
        free_memory=free_memory,
        committed_bytes=kv_cache.physical_bytes,
        transient_peak_bytes=kv_cache.reserved_headroom_bytes,
        torch_reserve_growth_bytes=kv_cache.torch_reserve_growth_bytes,
    )
    available = measure_kv_cache_bytes(requested_memory=requested_memory, **measured)
    num_blocks = kv_cache.blocks_within(available)
    left_free = (
        free_memory
        - (kv_cache.physical_bytes_for(num_blocks) - kv_cache.physical_bytes)
        - KV_CACHE_NON_TORCH_RESERVE_BYTES
    )
    kv_cache.torch_memory_limit = torch.cuda.memory_reserved(device) + max(left_free, 0)
    kv_cache.num_committed_blocks = num_blocks
    kv_cache.free_memory_measured = free_memory
    return num_blocks


class Worker:
    """gpu_worker.py's start-up, as far as the KV cache's size (module docstring).
    ``init_snapshot``: the snapshot ``init_device`` takes before the model is loaded
    (default: taken now, so that what the caller loaded before is not in
    ``total_consumed``); ``requested_memory``: ``ceil(total * utilization)``
    (``request_memory``); ``block_bytes``: one KV block's bytes, all layers; ``block_sizes``: each
    KV cache group's block size, for the runner's block tables (None: the runner's
    ``initialize_kv_cache`` is not called)."""

    def __init__(
        self,
        runner: GPUModelRunner,
        *,
        block_bytes: int,
        requested_memory: int,
        init_snapshot=None,
        device=None,
        block_sizes=None,
    ):
        self.model_runner, self.block_bytes, self.requested_memory = runner, block_bytes, requested_memory
        self.block_sizes = block_sizes
        self.device = device
        self.init_snapshot = init_snapshot if init_snapshot is not None else MemorySnapshot().measure(device)
        self.cudagraph_memory_estimate = 0
        self.cuda_graph_memory_bytes = None
        self.num_blocks = None

    @property
    def init_free_memory(self) -> int:
        return self.init_snapshot.free_memory

    def determine_available_memory(self) -> int:
        runner = self.model_runner
        with memory_profiling(self.init_snapshot, weights_memory=int(runner.model_memory_usage)) as profile:
            runner.profile_run()
        estimate = runner.profile_cudagraph_memory() if estimate_cudagraphs() else 0
        self.profile_result = profile
        self.total_consumed = profile.total_consumed
        self.peak_activation_memory = profile.transient_peak_headroom + estimate
        self.cudagraph_memory_estimate = estimate
        self.available_kv_cache_memory_bytes = self.requested_memory - profile.non_kv_cache_memory - estimate
        return self.available_kv_cache_memory_bytes

    def initialize_from_config(self) -> None:
        """Lines 935-958: the runner's ``initialize_kv_cache`` (its ``ExtensibleKVCache`` and block
        tables; else the blocks the budget holds, then its block tables)."""
        if self.model_runner.cache_config.enable_extensible_kv_cache:
            kv = self.model_runner.extensible_kv_cache = ExtensibleKVCache(self.block_bytes)
            if self.block_sizes:
                self.model_runner.initialize_kv_cache(self.block_sizes, self.device)
            kv.reserved_headroom_bytes = self.peak_activation_memory
        else:
            self.num_blocks = max(self.available_kv_cache_memory_bytes, 0) // self.block_bytes
            if self.block_sizes:
                self.model_runner.initialize_kv_cache(self.block_sizes, self.device)

    def _measure_sizing_step(self, step) -> None:
        """warmup.py lines 452-480 around ``step()``."""
        kv = self.model_runner.extensible_kv_cache
        kv.record_transient_peak()
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        stats = _stats()
        reserved_before = stats.get("reserved_bytes.all.current", 0)
        allocated_before = stats.get("allocated_bytes.all.current", 0)
        step()
        stats = kv.record_transient_peak()
        left_allocated = max(stats.get("allocated_bytes.all.current", 0) - allocated_before, 0)
        kv.torch_reserve_growth_bytes = max(
            kv.torch_reserve_growth_bytes,
            stats.get("reserved_bytes.all.peak", 0) - reserved_before - left_allocated,
        )

    def _sizing_step(self) -> None:
        """The largest step (max_num_batched_tokens) and its sampling."""
        runner = self.model_runner
        _, sample_hidden_states = runner._dummy_run(runner.max_num_tokens)
        runner._dummy_sampler_run(sample_hidden_states)

    def compile_or_warm_up_model(self) -> int:
        """Warms up, captures; returns the KV cache's blocks."""
        runner = self.model_runner
        extensible = runner.cache_config.enable_extensible_kv_cache
        if extensible:
            torch.cuda.reset_peak_memory_stats()
            self._measure_sizing_step(self._sizing_step)  # run_kv_cache_sizing_warmup
            runner.extensible_kv_cache.record_transient_peak()
        self.cuda_graph_memory_bytes = runner.capture_model()
        if not extensible:
            return self.num_blocks
        return measure_kv_cache_blocks(
            runner.extensible_kv_cache,
            runner.vllm_config,
            self.device,
            init_free_memory=self.init_free_memory,
            requested_memory=self.requested_memory,
        )
