"""SGLang 0.5.23's side of bench/fit_bench.py (``--releases sglang==0.5.23``; issue 52, item 6).

For each bench model, in a fresh process on the device:

  runner    SGLang 0.5.23's start-up as tests/engines/sglang_memory.py follows it, over the
            release's decode runner (tests/engines/sglang_runner.py before the adoption: the
            code the plugin routes, no plugin here): the memory settings resolved for the
            device (``handle_gpu_memory_settings``: nvidia-smi's total, its chunked-prefill
            size, decode sizes and ``mem_fraction_static``); ``pre_model_load_memory``; the
            case's model loaded (bench.harness ``case_target``) and SGLang's float32 rope
            cache made beside it (``case_model.engine_weights``, counted with the weights); the pool sized from the
            free memory (``_profile_available_bytes``, ``calculate_pool_sizes``,
            ``resolve_max_num_reqs``) and allocated; the decode graphs captured, their free
            memory drop measured (``capture_decode_graph``); then, not a release step, one
            eager prefill chunk's transient peak (the slack must hold it; fit estimates it)
  fit       ``planner fit --engine sglang==0.5.23`` for the same model and device, given
            the context length, page size and the prefill graphs' switch (:func:`fit_flags`);
            the rest (chunked-prefill size, decode sizes, ``mem_fraction_static``) fit
            resolves itself, and :func:`settings_check` compares them with the runner's

Both sides disable SGLang's prefill graphs (``--disable-prefill-cuda-graph``): they are
breakable graphs (a segment between attention calls), which the case models cannot be
captured as. The row's ``rule_check`` feeds fit's rule (planner/fit/sizing.py
``sglang_kv_bytes``) the runner's measured items. EAGLE is skipped (:data:`SKIP`).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

RELEASE = "sglang==0.5.23"
DESCRIPTION = (
    "SGLang 0.5.23-shaped (tests/engines/sglang_memory.py): mem_fraction_static's static pool, sized "
    "after the weights load and before the decode graphs are captured; prefill graphs disabled on both sides"
)
#: the cases not run, and why
SKIP = {
    "eagle": "the SGLang runner follows the non-speculative start-up only (no EAGLE runners' sizes and "
    "graphs, no draft KV in the cell)",
}
#: where the SGLang runner differs from SGLang (beside the case models' own code: fit_bench.DIFFERS)
DIFFERS = [
    "the start-up makes the process's first torch stream where the release does (ModelRunner.__init__'s "
    "forward_stream, right after pre_model_load_memory): torch's stream pools are in what the pool is "
    "sized from, not in the decode graphs' drop. Runs before this change made the first at the capture "
    "(the global capture stream), whose drop then held the pools (70 MiB on an H100: "
    "side-stream-2026-12-07-streams.json) and whose pool was that much larger",
    "prefill graphs disabled on both sides (--disable-prefill-cuda-graph): SGLang's CUDA default is "
    "breakable prefill graphs, which the case models cannot be captured as; mem_fraction_static then "
    "reserves no prefill-graph memory (reserve_for_graph_mb)",
    "the model is loaded before the runner's ModelRunner exists: pre_model_load_memory is measured "
    "before bench.harness case_target builds it, and the ModelRunner is made once the pool is sized",
    "the case model's own decode cache counts as the pool's (free when the pool is sized; the rest of "
    "the pool is allocated beside it)",
    "no attention backend buffers and no eager runner input registry; the decode graphs' outputs go "
    "to the shared float32 logits buffer as the release's do (tests/engines/case_model.py SGLangCaseModel)",
    "the case model (transformers') keeps no rotary cos/sin cache: the runner makes SGLang's after it is "
    "built, before the pool is sized (tests/engines/case_model.py engine_weights: max_position_embeddings x "
    "rotary_dim in float32, as layers/rotary_embedding/base.py keeps it on CUDA), and its weights are the "
    "case model's parameters and buffers with that cache in place of the case model's rotary inv_freq "
    "buffers (SGLang keeps none; they stay in the memory the load took). Runs before this change counted "
    "the inv_freq buffers and no cache",
    "attention: the transformers cases attend with FA3 over their own (unpaged) cache, num_splits 0, as "
    "SGLang's sm90 default backend (adapters/hf.py attention='fa3'; runs before this change used "
    "transformers' SDPA, whose grouped K/V heads are expanded over the whole cache in the graph pool); "
    "the reference case calls FA3 itself",
    "the reference case's weights and cache are drawn into tensors allocated first, each float32 draw given "
    "back to the device at once (references/decode.py ReferenceConfig.own_segments), as an engine loads "
    "weights; runs before this change left the freed draws' space pinned in the weights' segments, which "
    "the pool's free-memory reading (and the logits buffer, carved from it) saw",
    "the activation peak is not SGLang's: the release runs no profiling forward (its slack is a "
    "heuristic); the runner measures one eager prefill chunk (chunked_prefill_size tokens, attention "
    "skipped) and its sampling over cuda_graph_max_bs rows, after the pool and the graphs; the chunk "
    "runs vLLM's eager layers (SGLang's are the same shape; tests/engines/engine_layers.py), the MoE "
    "layers' caches allocated per call as SGLang's fused_experts_impl allocates them",
]


@dataclass(frozen=True)
class Settings:
    """What both sides are given (SGLang's own settings), then what the runner resolved
    for the device (``handle_gpu_memory_settings``)."""

    context_length: int
    page_size: int = 1
    disable_prefill_cuda_graph: bool = True
    kv_cache_dtype: str = "auto"
    gpu_mem_mib: float = 0.0
    chunked_prefill_size: int = 0
    cuda_graph_max_bs: int = 0
    cuda_graph_bs: tuple[int, ...] = ()
    mem_fraction_static: float = 0.0

    @classmethod
    def of(cls, d: dict) -> Settings:
        """A row's settings back (JSON lists to tuples)."""
        return cls(**{**d, "cuda_graph_bs": tuple(d.get("cuda_graph_bs", ()))})


def resolve(gpu_mem_mib: float, context_length: int):
    """The runner's memory settings (tests/engines/sglang_memory.py ``handle_gpu_memory_settings``)
    and the row's :class:`Settings`."""
    from capture_plan.tests.engines import sglang_memory as sm

    ms = sm.handle_gpu_memory_settings(gpu_mem_mib, context_len=context_length, prefill_backend=sm.DISABLED)
    s = Settings(
        context_length=context_length,
        gpu_mem_mib=gpu_mem_mib,
        chunked_prefill_size=ms.chunked_prefill_size,
        cuda_graph_max_bs=ms.decode_max_bs,
        cuda_graph_bs=ms.decode_bs,
        mem_fraction_static=ms.mem_fraction_static,
    )
    return ms, s


def fit_flags(s: Settings) -> dict:
    """What fit is given, under SGLang's flag names (the rest it resolves for the device)."""
    return {
        "context-length": s.context_length,
        "page-size": s.page_size,
        "kv-cache-dtype": s.kv_cache_dtype,
        "disable-prefill-cuda-graph": s.disable_prefill_cuda_graph,
    }


# -- the fit side (no torch) -----------------------------------------------------------------------


def fit_side(case: str, folder: Path, layers: int, device_name: str, s: Settings) -> dict:
    """fit's figures for the case (``refused``: fit's one line where it refuses the model)."""
    from bench.fit_bench import case_spec, fit_figures, long_context
    from capture_plan.planner.fit.fit import FitRequest, fit
    from capture_plan.planner.fit.model import load_model
    from capture_plan.schemas.errors import InputError

    model = load_model(str(case_spec(case, folder, layers)))
    out: dict = {"model": model.name, "model_type": model.model_type, "source": model.source}
    try:
        with long_context():
            res = fit(FitRequest(model, device_name, RELEASE, 1, fit_flags(s)))
    except InputError as err:
        out["refused"] = str(err).splitlines()[0]
        return out
    out["default"] = fit_figures(res)
    out["plan"] = {"skipped": "no plan of SGLang's decode graphs is built for the case models"}
    return out


def settings_check(s: Settings, fitted: dict) -> dict:
    """The settings the runner resolved for the device against fit's, by SGLang's flag names."""
    got = fitted["settings"]
    pairs = {
        "mem-fraction-static": (s.mem_fraction_static, got.get("mem-fraction-static")),
        "chunked-prefill-size": (s.chunked_prefill_size, got.get("chunked-prefill-size")),
        "cuda-graph-max-bs": (s.cuda_graph_max_bs, got.get("cuda-graph-max-bs")),
        "cuda-graph-bs": (",".join(map(str, s.cuda_graph_bs)), got.get("cuda-graph-bs")),
    }
    return {name: {"runner": r, "fit": f, "ok": r == f} for name, (r, f) in pairs.items()}


def rule_check(runner: dict) -> dict:
    """fit's rule (planner/fit/sizing.py ``sglang_kv_bytes``) fed the runner's measured items:
    the free memory before the weights, the weights, the other memory the load took (the
    free memory's drop less the weights, the model's own decode cache counted as free: the
    pool's) and the runner's ``mem_fraction_static``; its tokens, rounded to pages as
    calculate_pool_sizes rounds them, against the runner's."""
    from capture_plan.planner.fit import sizing

    m, weights = runner["measured"], runner["weights_bytes"]
    pre, page, cell = m["pre_model_load_bytes"], runner["block_size"], m["kv_cell_bytes"]
    other = pre - m["available_bytes"] - weights
    kv = sizing.sglang_kv_bytes(
        pre, weights=weights, non_torch=other, fraction=runner["settings"]["mem_fraction_static"]
    )
    blocks = max(kv, 0) // cell // page
    return {
        "blocks": blocks,
        "runner_blocks": runner["blocks"],
        "error": (blocks - runner["blocks"]) / runner["blocks"] if runner["blocks"] else None,
        "torch_reserve_growth_bytes": 0,
    }


def case_row(runner: dict, fitted: dict, s: Settings) -> dict:
    """The runner's record, fit's figures and their comparisons (None where fit refused)."""
    from bench.fit_bench import compare

    ok = "default" in fitted
    return {
        "runner": runner,
        "fit": fitted,
        "compare": compare(runner, fitted["default"]) if ok else None,
        "compare_plan": None,
        "settings_check": settings_check(s, fitted["default"]) if ok else None,
        "rule_check": rule_check(runner),
    }


# -- the runner side (the GPU, in a fresh process) -------------------------------------------------


def start_up(startup, target) -> dict:
    """The start-up after ``pre_model_load_memory`` (``startup``: tests/engines/sglang_memory.py
    ``StartUp``) on ``target`` (loaded since): the pool, the decode graphs, the prefill chunk's
    peak; the runner's record (tests/engines/sizing.py ``sglang_0523``) and what else it measured."""
    import torch

    from bench.baselines import hidden_state_outputs
    from bench.harness import free_bytes
    from capture_plan.tests.engines.case_model import SGLangCaseModel, decode_cache, engine_weights, measured_weights
    from capture_plan.tests.engines.sizing import sglang_0523

    s = startup.settings
    committed, per_token, full, sliding = decode_cache(target)
    cell = per_token * (full + sliding)  # DefaultPoolConfigurator: every layer (none is hybrid SWA in SGLang)
    model = SGLangCaseModel(target, s.chunked_prefill_size)  # its LM head taken before the swap below
    # SGLang's model holds its rope's cos/sin cache from its load on: made before the pool is sized
    # (layers/rotary_embedding/base.py RotaryEmbedding.__init__: float32 on CUDA)
    weights, rope = engine_weights(target, torch.float32)
    rope_bytes = rope.nbytes if rope is not None else 0
    with torch.no_grad(), hidden_state_outputs(target):
        pool = startup.alloc_memory_pool(model, cell=cell, committed_bytes=committed)
        free = free_bytes()
        # cuBLAS initialized before the capture, as the release does; init_cublas_bytes is the
        # free-memory drop it took (torch's workspace included, where it made one)
        startup.init_attention_backends(model)
        cublas_init = free - free_bytes()
        torch.cuda.empty_cache()  # as the capture's first reading does: what torch holds then
        reserved = torch.cuda.memory_reserved()
        runner, graph_bytes = startup.init_cuda_graphs(model)
        # the drop split: torch's growth (the pool, the logits buffer, the capture stream's
        # workspaces; the capture's last reading emptied the cache) and the driver's (graph execs)
        reserved_growth = torch.cuda.memory_reserved() - reserved
        free_after_capture = torch.cuda.mem_get_info()[0]
        peak = model.prefill_peak(s.chunked_prefill_size, min(s.decode_max_bs, s.chunked_prefill_size))
        record = sglang_0523(startup, weights_bytes=weights, graph_bytes=graph_bytes, activation_peak_bytes=peak)
        total = torch.cuda.mem_get_info()[1]
        pre = int(round(startup.pre_model_load_memory * (1 << 30)))
        measured = {
            "gpu_mem_mib": s.gpu_mem,
            "pre_model_load_bytes": pre,
            "context_bytes": total - pre,
            "available_bytes": int(round(pool.available_gpu_memory * (1 << 30))),
            "rest_bytes": pool.rest_bytes,
            "slack_bytes": int(pre * (1 - s.mem_fraction_static)),
            "committed_bytes": committed,
            "rope_cache_bytes": rope_bytes,
            "case_rotary_bytes": measured_weights(target) - measured_weights(target, rotary=False),
            "kv_cell_bytes": cell,
            "kv_bytes_per_token_layer": per_token,
            "layers": {"full": full, "sliding": sliding},
            "pool_allocated_bytes": pool.kv_bytes,
            "req_to_token_bytes": pool.req_to_token_bytes,
            "logits_buffer_bytes": model.logits_buffer.nbytes if model.logits_buffer is not None else 0,
            "free_after_capture_bytes": free_after_capture,
            "capture_reserved_growth_bytes": reserved_growth,
            "init_cublas_bytes": cublas_init,
            "graphs": len(runner.backend._graphs),
        }
        runner.backend.cleanup()
        pool.tensors.clear()
        del rope
    return {**json.loads(record.to_json()), "measured": measured}


def child(case: str, layers: int, context_length: int) -> dict:
    """The SGLang runner's start-up for ``case`` in this (fresh) process (module docstring)."""
    if case in SKIP:
        return {"skipped": f"{case}: {SKIP[case]}"}
    import torch

    from bench.harness import DEVICE_FIELDS, CaseDoesNotFit, case_target
    from capture_plan.executor.device import driver_version
    from capture_plan.tests.engines import adoption, sglang_memory, sglang_runner

    device_name = torch.cuda.get_device_name()
    device = dict(zip(DEVICE_FIELDS, (device_name, driver_version(), torch.__version__, torch.version.cuda)))
    ms, s = resolve(sglang_memory.gpu_memory_capacity_mib(), context_length)
    module = adoption.before_module(Path(sglang_runner.__file__), Path(tempfile.mkdtemp()), "sglang_fit_bench")
    startup = sglang_memory.StartUp(module, ms)  # pre_model_load_memory: before the model is built
    try:
        # SGLang's sm90 default: FA3, num_splits 0 (FA3's own split heuristic) unless deterministic
        # (sglang/srt/layers/attention/flashattention_backend.py FlashAttentionBackend.__init__)
        target = case_target(case, None, layers, max_bs=ms.decode_max_bs, attention="fa3", own_segments=True)
    except CaseDoesNotFit as err:
        return {"skipped": f"{case} does not fit this device: {err}"}
    torch.cuda.synchronize()
    return {"device": device, "settings": asdict(s), "runner": start_up(startup, target)}
