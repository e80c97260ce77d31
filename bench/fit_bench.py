"""`planner fit` against the engine-faithful runner on one GPU (issue 52, item 6).

For each bench model (bench/device_bench.py's CASES, random weights: bench.harness
``case_target``), in a fresh process on the device:

  runner    vLLM 0.34.0's start-up as tests/engines has it (vllm_runner_034.py over
            0.33.0's runner, vllm_worker_034.py; loaded as tests/engines/plugged.py loads
            them), on the case's own model (the transformers cases attending with FA3 over
            their cache, 32 splits, as vLLM's sm90 backend: adapters/hf.py
            ``attention="fa3"``): the init snapshot before the model is built;
            the weights' bytes measured (its parameters and buffers, vLLM's rope cache in place
            of transformers' inv_freq buffers); ``profile_run`` (the
            dummy run at max_num_batched_tokens, attention skipped as vLLM's profiling run
            skips it: the model's ``profile_hidden``; then the dummy sampler run) with its
            activation peak measured; the sizing warm-up; the capture at the release's
            default sizes for the device; the extensible KV cache (0.34.0's default) sized
            after capture; recorded as tests/engines/sizing.py ``RunnerSizing``
  fit       ``planner fit`` (the library, ``capture_plan.planner.fit.fit.fit``) for the same
            model (the case's spec: its config.json, or the reference's dimensions),
            device, release and settings (:func:`fit_flags`: the runner's settings under
            vLLM's flag names), and again with ``--plan``: the case's plan of those
            graphs (bench.device_bench ``vllm034_setup``, built analytically)

and per case each item from both sides (weights, activation peak, graph memory, KV blocks
and tokens) with its error against the issue's targets (:data:`TARGETS`), one JSON (the
harness's header) and a last ``SUMMARY`` line per case. The runner and fit come from the
same reading of the wheel: their agreement proves consistency, not correctness. Where the
runner's model is not vLLM's is listed in the JSON (:data:`DIFFERS`). Only the
settings are the device's: fit reads the device's total from its own table.

``--releases vllm==0.34.0,vllm==0.33.0`` adds the 0.33.0-shaped path (:data:`RELEASES`: the
same runner with the extensible KV cache off, its graph estimate deducted before capture);
``sglang==0.5.23`` SGLang's static pool (bench/fit_bench_sglang.py: its runner, settings,
fit side and rule check; the rows have the same comparisons, no ``--plan`` figure, and a
``settings_check`` of the memory settings both sides resolved for the device).
A case whose model does not fit the device is skipped, saying why. Not run here: a
calibration of the runner's capture.
Run: python -m bench.fit_bench [--cases reference,llama,...] [--releases R,...] [--layers 32] [--tag T]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import fit_bench_sglang as sgl
from bench.harness import (
    DEVICE_FIELDS,
    MiB,
    add_layers,
    add_out_dir,
    add_overwrite,
    case_options,
    header,
    main_exit,
    result_file,
    run_module,
)

CASES = ("reference", "eagle", "llama", "gemma2", "qwen2", "mixtral", "qwen2_moe")
RELEASE = "vllm==0.34.0"
#: the releases a run may size (``--releases``), and how the runner follows each
RELEASES = {
    RELEASE: "the extensible KV cache (0.34.0's default on CUDA): sized after capture",
    "vllm==0.33.0": "0.33.0-shaped: the 0.34.0 runner with the extensible KV cache off, so 0.33.0's graph "
    "estimate (profile_cudagraph_memory) is taken from the budget before capture, and 0.33.0's sampler; "
    "fit's vllm==0.33.0 rule",
    sgl.RELEASE: sgl.DESCRIPTION,
}
#: the context length both sides are given (every case's KV is counted for it; the runner's
#: sizing does not read it: its tokens are blocks x block size)
MAX_MODEL_LEN = 4096
#: the engines' variables under which a context past the model's own length starts (the llama
#: case's config.json says 2048, MAX_MODEL_LEN is 4096: vLLM's _get_and_verify_max_len and
#: SGLang's ModelConfig refuse it without them, and so does fit, planner/fit/context.py);
#: fit runs under them, as the engine would (:func:`long_context`)
LONG_CONTEXT_ENV = {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1", "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}


@contextlib.contextmanager
def long_context():
    """:data:`LONG_CONTEXT_ENV` set in this process for the block (restored after)."""
    saved = {k: os.environ.get(k) for k in LONG_CONTEXT_ENV}
    os.environ.update(LONG_CONTEXT_ENV)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


#: speculative tokens a step of the EAGLE case (bench.harness eagle_config: 3 draft steps, 4 tokens verified)
EAGLE_TOKENS = 3
#: the EAGLE case's draft layers (references/speculative.py SpeculativeConfig.draft_layers, which
#: eagle_config leaves at its default; written here so that fit's side imports no torch)
EAGLE_DRAFT_LAYERS = 1
#: what fit leaves out of a case, written into its row
FIT_LACKS = {
    "eagle": "fit is given the draft as vLLM's --speculative-config (an EAGLE head of the target's dimensions, "
    "one layer: speculative_config): its weights (beside the target's in the weights compared), its KV layer, "
    "its graphs and its dummy propose in the profile are priced from vLLM's EAGLE code (planner/fit/vllm.py "
    "draft_captures, draft_profile). Runs before stop 65 ran the speculative reference's draft phases (its own "
    "lm_head, softmax and top-k in float32) in the runner, not vLLM's EAGLE head, and left fit's draft graphs "
    "unknown; runs refit before stop 64 gave fit the target alone",
}
#: how the reference case's weights are made (bench/fit_bench_sglang.py's DIFFERS says it for SGLang)
REFERENCE_WEIGHTS = (
    "the reference case's weights and cache are drawn into tensors allocated first, each float32 draw "
    "given back to the device at once (references/decode.py ReferenceConfig.own_segments), as an engine "
    "loads weights into tensors of their size. Runs before this change cast each draw into a new tensor: "
    "the freed draws were split by the next tensors, whose segments then held free space (torch's reserve, "
    "not allocated) that the runner's free-memory readings counted as used and fit does not; the EAGLE "
    "case's speculative reference still makes them so"
)
#: where the runner's model differs from vLLM's: agreement proves consistency with the wheel
#: reading, not the engine's figures
DIFFERS = [
    "the case's own model code and kernels (bench.harness case_target), not vLLM's model and kernels, "
    "but for attention: the transformers cases attend with FA3 over their cache, as vLLM's sm90 backend, "
    "with its FULL graphs' 32 splits (adapters/hf.py attention='fa3'; runs before this change used "
    "transformers' SDPA, whose grouped K/V heads are expanded over the whole cache in the graph pool); "
    "EAGLE's draft is vLLM's EAGLE head (tests/engines/case_model.py as_vllm_eagle, route_vllm_eagle: fc, the "
    "target's embedding and lm_head, greedy argmax) over the speculative reference's draft layer and cache "
    "(the reference's layer code: its first input norm runs, with the target's weight); 0.33.0's rows run "
    "0.34.0's speculator (its decode grid to max_num_seqs) with 0.33.0's argmax",
    "cudagraph_mode FULL_DECODE_ONLY (vLLM's default is FULL_AND_PIECEWISE): the case models have no "
    "piecewise split; fit is given the same mode",
    "the dummy runs (profile_run's and the sizing warm-up's) run, for the transformers cases, vLLM "
    "0.34.0's eager decoder layers over the model's weights (tests/engines/engine_layers.py: the merged "
    "qkv and gate_up outputs, the in-place fused add-norm, SiluAndMul's output, Gemma2's native float32 "
    "norms, the fused MoE's router, top-k, output and caches cut from its workspace, a shared expert "
    "first; stand-ins of the fused kernels computed in row chunks into the outputs they allocate), and "
    "over the reference decode step's weights for the reference and EAGLE cases' targets; attention "
    "skipped (0.34.0's sizing warm-up runs a mixed prefill-decode step with attention). Runs before "
    "this change ran transformers' layers, and the references their own profile_hidden; runs before "
    "engine_layers.code_of let gate_up die at the activation in every MLP (vLLM's Qwen2, Gemma 2 and "
    "Qwen2-MoE MLPs and all of SGLang's keep it to down_proj) and gave SGLang's MoE a new output (its "
    "fused_experts_impl writes the input in place where the layer has no shared expert)",
    "the sampler is tests/engines' stand-in of the release's (vllm_runner_034.py Sampler; 0.33.0-shaped: "
    "vllm_runner.py's, 0.33.0's, which 0.34.0's extends): it allocates what the release's sampler does "
    "in the profiling run's two passes, in its shapes, dtypes and order (the model-dtype logits, the "
    "float32 copy, the Triton top-k/top-p scratch made once and kept, Gumbel-max's per-block scratch, "
    "the logprob tensors), on the branch a stock install runs (fit's: fit_rules.toml "
    "[sampler.vllm-0-33] flashinfer_default: 0.34.0 the Triton branch, 0.33.0 FlashInfer's, its two more "
    "float32 copies and row-states cache), not its kernels. Runs before this change used softmax/argmax, "
    "then a float32 log-softmax and top-k",
    "the persistent buffers the release makes after its init snapshot are stand-ins in its shapes, dtypes "
    "and order (tests/engines/vllm_runner.py RequestState, InputBuffers, the Sampler's PenaltiesState, "
    "LogitBiasState, BadWordsState and LogprobTokenIdsState, StructuredOutputsWorker, and 0.34.0's "
    "BlockTables at initialize_kv_cache; the Triton top-k/top-p scratch kept after the profile), fit's "
    "'engine buffers' item (fit_rules.toml [buffers.vllm-0-33]); their pinned-host staging and kernels "
    "are not, and neither side has the block tables' per-group vectors, FlashAttention's scheduler "
    "metadata (a few KiB) or the speculator's own buffers (EAGLE's). Runs before this change had none of "
    "them",
    "the runner makes the process's first torch stream where the release does (GPUModelRunner.__init__'s "
    "output_copy_stream, after the init snapshot, before the profile): torch's stream pools are then in "
    "its non-KV memory, not its capture. Runs before this change made the first in the capture "
    "(graph_capture's stream), whose drop then held the pools (70 MiB on an H100: "
    "side-stream-2026-12-07-streams.json)",
    "the model's decode cache (its own static KV, read by the captured graphs) stays allocated through "
    "capture and counts as KV: committed blocks after capture (the release keeps min_committed_blocks), "
    "or, 0.33.0-shaped, given back to the budget (the release allocates its cache after profiling)",
    "the case model (transformers') keeps no rotary cos/sin cache: the runner makes vLLM's before the "
    "profile (tests/engines/case_model.py rotary_cache: max_position_embeddings x rotary_dim in the "
    "model's dtype, as rotary_embedding/base.py casts it), and its weights are the case model's "
    "parameters and buffers with that cache in place of the case model's rotary inv_freq buffers (vLLM "
    "keeps none). Runs before this change counted the inv_freq buffers and no cache",
    "the MoE cases' fused-MoE workspace: the runner's case model makes vLLM's at each dummy run, grown "
    "and kept as its workspace manager keeps it (tests/engines/case_model.py moe_workspace; fit's 'MoE "
    "workspace' item), and the dummy runs' MoE layers cut their caches from it. Runs before 2028b99 had "
    "no workspace; runs before the engine layers ran transformers' expert loop, whose transients were "
    "in the runner's activation peak",
    "the reference case calls FA3 with vLLM's 32 splits and its hoisted scheduler metadata "
    "(references/decode.py ReferenceConfig.fa3_splits; runs before this change used FA3's own split "
    "heuristic, whose graphs hold none of the split-KV accumulators fit prices: planner/fit/vllm.py "
    "split_kv_accum); the EAGLE case's speculative reference (target and draft) too since stop 65, "
    "FA3's heuristic before",
    REFERENCE_WEIGHTS,
]


@dataclass(frozen=True)
class Target:
    """An item's target: ``|fit - runner| <= max(rel x runner, abs_bytes)``."""

    rel: float
    abs_bytes: int = 0
    text: str = ""


#: the issue's targets (GPU, runners, seven models); graph memory without a calibration
TARGETS = {
    "weights": Target(0.0, 0, "exact"),
    "activation peak": Target(0.02, 32 * MiB, "within 2% or 32 MiB"),
    "graph memory": Target(0.10, 0, "within 10% (no calibration)"),
    "kv tokens": Target(0.005, 0, "within 0.5%"),
}


@dataclass(frozen=True)
class Settings:
    """What both sides are given (vLLM's own settings)."""

    gpu_memory_utilization: float
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    capture_sizes: tuple[int, ...]
    cudagraph_mode: str = "FULL_DECODE_ONLY"
    kv_cache_dtype: str = "auto"
    #: EAGLE's speculative tokens a step (the runner's alone: fit does not model them)
    num_speculative_tokens: int = 0


def settings_for(device_name: str, release: str = RELEASE, case: str = "") -> Settings:
    """The release's defaults for the device, as fit resolves them (planner/fit/sizing.py:
    its batch defaults by the device's total, its default capture sizes, its utilization);
    for the EAGLE case, the shared sizes with its uniform decode sizes (bench/baselines.py
    ``vllm_capture_sizes`` at query length 4), given to fit as explicit sizes."""
    from bench.baselines import vllm_capture_sizes
    from capture_plan.planner.fit import sizing
    from capture_plan.planner.fit.tables import device, rule_for

    _, _, _, rule = rule_for(release)
    name, dev = device(device_name)
    seqs, batched = sizing.vllm_batch_defaults(dev.torch_total, name, rule.batch_tier_160)
    k = EAGLE_TOKENS if case == "eagle" else 0
    sizes = (
        vllm_capture_sizes(max_num_seqs=seqs, max_num_batched_tokens=batched, decode_query_len=1 + k)
        if k
        else sizing.vllm_default_sizes(seqs, batched, None, rule.capture_appends)
    )
    return Settings(rule.default_utilization, MAX_MODEL_LEN, seqs, batched, 16, tuple(sizes), num_speculative_tokens=k)


def fit_flags(s: Settings, folder: Path | None = None) -> dict:
    """``s`` under vLLM's flag names, as ``planner fit`` takes them; with speculative tokens,
    the EAGLE draft's ``--speculative-config`` too (:func:`speculative_config`, its spec
    written into ``folder``)."""
    spec = {}
    if s.num_speculative_tokens:
        if folder is None:
            raise ValueError("the EAGLE case's flags need a folder for the draft's spec")
        spec = {"speculative-config": speculative_config(folder, s.num_speculative_tokens)}
    return spec | {
        "gpu-memory-utilization": s.gpu_memory_utilization,
        "max-model-len": s.max_model_len,
        "max-num-seqs": s.max_num_seqs,
        "max-num-batched-tokens": s.max_num_batched_tokens,
        "block-size": s.block_size,
        "cudagraph-capture-sizes": list(s.capture_sizes),
        "cudagraph-mode": s.cudagraph_mode,
        "kv-cache-dtype": s.kv_cache_dtype,
    }


def speculative_config(folder: Path, tokens: int) -> str:
    """vLLM's ``--speculative-config`` for the EAGLE case's draft, as fit takes it: method
    eagle, ``tokens`` a step, the draft the speculative reference runs (references/speculative.py:
    :data:`EAGLE_DRAFT_LAYERS` decoder layers of the target's dimensions, the target's embedding
    shared) as a spec written into ``folder``."""
    path = folder / "eagle-draft.toml"
    path.write_text(
        f'[model]\npreset = "llama-3-8b"\nlayers = {EAGLE_DRAFT_LAYERS}\n\n'
        '[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1]\n'
    )
    return json.dumps({"method": "eagle", "model": str(path), "num_speculative_tokens": tokens})


def page_group(full: int, sliding: int) -> int:
    """Layers a KV block spans, as vLLM 0.34.0 groups them (v1/core/kv_cache_planning.py
    ``_get_kv_cache_groups_uniform_page_size``): one layer type, all its layers; two, the
    smaller count, or the larger where it is under 1.5x the smaller."""
    counts = [n for n in (full, sliding) if n > 0]
    return max(counts) if max(counts) < min(counts) * 1.5 else min(counts)


# -- the fit side (no torch) -----------------------------------------------------------------


def case_spec(case: str, folder: Path, layers: int) -> Path:
    """The spec TOML fit reads the case's model from: the transformers cases' own spec (its
    config.json beside it, bench.harness case_options), or the reference's model at
    ``layers`` layers."""
    opts = case_options(case, folder)
    if opts.spec is not None:
        return Path(opts.spec)
    path = folder / f"{case}.toml"
    path.write_text(
        f'[model]\npreset = "llama-3-8b"\nlayers = {layers}\n\n[[phases]]\nname = "decode"\nkind = "decode"\n'
        "sizes = [1]\n"
    )
    return path


def fit_side(
    case: str, folder: Path, layers: int, device_name: str, s: Settings, release: str = RELEASE, graphs: int = 0
) -> dict:
    """fit's figures for the case, without and with the plan of the runner's graphs (where
    that plan captures the runner's ``graphs`` graphs: 0, any)."""
    from capture_plan.planner.fit.fit import FitRequest, fit
    from capture_plan.planner.fit.model import load_model

    model = load_model(str(case_spec(case, folder, layers)))
    out = {"model": model.name, "model_type": model.model_type, "source": model.source}
    with long_context():
        out["default"] = fit_figures(fit(FitRequest(model, device_name, release, 1, fit_flags(s, folder))))
    try:
        plan = case_plan(case, folder, layers, model)
    except Exception as err:  # a plan that cannot be built is a result: the row says why
        out["plan"] = {"skipped": f"{type(err).__name__}: {err}"[:300]}
        return out
    if graphs and plan.graphs != graphs:
        out["plan"] = {"skipped": f"the plan captures {plan.graphs} graphs, the runner {graphs}"}
        return out
    with long_context():
        planned = fit(FitRequest(model, device_name, release, 1, fit_flags(s, folder), plan=plan))
    out["plan"] = {"plan": plan.name, **fit_figures(planned)}
    return out


def case_plan(case: str, folder: Path, layers: int, model):
    """The case's plan of vLLM 0.34.0's default graphs (bench.device_bench ``vllm034_setup``,
    the reference's at 32 layers), as ``planner fit --plan`` reads it (``plan_graphs``). The
    transformers cases' plan attends with FA3, as their runner does (``case_target``'s
    ``attention="fa3"``), not with the case's own attention."""
    from bench.device_bench import vllm034_setup
    from capture_plan.planner import build_plan
    from capture_plan.planner.fit.measured import plan_graphs

    if case == "reference" and layers != 32:
        raise ValueError(f"the reference's plan is built at 32 layers, not {layers}")
    *_, plan = vllm034_setup(case, build_plan(case_options(case, folder)), layers, folder, backend="fa3")
    return plan_graphs(plan, f"{case} at vLLM 0.34.0's default graphs (bench.device_bench vllm034_setup)", model)


def fit_figures(res) -> dict:
    """What the comparison reads of a ``FitResult``: each item's bytes, error bar and status."""
    items = {i.name: {"bytes": i.bytes, "error_bytes": i.error_bytes, "status": i.status} for i in res.items}
    return {
        "items": items,
        "kv_blocks": res.kv_blocks,
        "block_tokens": res.block_tokens,
        "kv_tokens": res.kv_tokens,
        "kv_bytes": res.kv_bytes,
        "settings": res.settings,
        "fits": res.fits,
    }


# -- the comparison (no torch) ----------------------------------------------------------------


def compare_item(runner: int, fitted: int | None, target: Target) -> dict:
    """One item: both figures, fit's error against the runner's (relative and in bytes), and
    whether it meets ``target`` (an unknown figure never does)."""
    if fitted is None:
        return {"runner": runner, "fit": None, "error": None, "error_bytes": None, "ok": False, "target": target.text}
    diff = fitted - runner
    return {
        "runner": runner,
        "fit": fitted,
        "error": diff / runner if runner else None,
        "error_bytes": diff,
        "ok": abs(diff) <= max(target.rel * abs(runner), target.abs_bytes),
        "target": target.text,
    }


def compare(runner: dict, fitted: dict) -> dict:
    """Each item the issue targets, the runner's against fit's (``fit_figures``): KV tokens
    as both count them here, blocks x block size."""
    items = fitted["items"]

    def of(name: str) -> int | None:
        return items.get(name, {}).get("bytes")

    # the runner's weights hold a speculative draft's; fit counts the draft's apart
    weights = of("weights")
    if weights is not None and of("draft weights") is not None:
        weights += of("draft weights")
    pairs = {
        "weights": (runner["weights_bytes"], weights),
        "activation peak": (runner["activation_peak_bytes"], of("activation peak")),
        "graph memory": (runner["graph_bytes"], of("graph memory")),
        "kv tokens": (runner["kv_tokens"], fitted["kv_blocks"] * fitted["block_tokens"]),
    }
    return {name: compare_item(r, f, TARGETS[name]) for name, (r, f) in pairs.items()}


def rule_check(runner: dict, release: str = RELEASE) -> dict:
    """fit's sizing rule for ``release`` (planner/fit/sizing.py ``vllm_after_capture`` or
    ``vllm_before_capture``) fed the runner's own measured items (weights, the other memory
    its free memory lost, the transient peak, the capture's drop or the graph estimate; the
    committed decode cache is KV): its blocks against the runner's. It isolates the rule
    from fit's estimates: a miss here is the rule's arithmetic, not an estimate's (after
    capture, the runner's measured torch reserve growth is given too, as fit gives its own
    simulated one: planner/fit/reserve.py)."""
    from capture_plan.planner.fit import sizing
    from capture_plan.planner.fit.tables import rule_for

    _, _, _, rule = rule_for(release)
    m, weights = runner["measured"], runner["weights_bytes"]
    committed = m["committed_bytes"]
    if rule.kind == "vllm-after-capture":
        other = m["init_free_bytes"] - m["free_after_capture_bytes"] - committed - weights - runner["graph_bytes"]
        kv = sizing.vllm_after_capture(
            rule,
            m["requested_bytes"],
            m["init_free_bytes"],
            weights=weights,
            non_torch=other,
            activation=runner["transient_peak_bytes"],
            graph=runner["graph_bytes"],
            reserve_growth=runner["torch_reserve_growth_bytes"],
        )
    else:  # before capture: what the profile consumed, its peak, the estimate if the rule deducts it
        other = m["total_consumed_bytes"] - committed - weights
        graph = runner["graph_estimate_bytes"] if rule.graph_estimate == "deducted" else 0
        kv = sizing.vllm_before_capture(
            m["requested_bytes"],
            weights=weights,
            non_torch=other,
            activation=runner["activation_peak_bytes"],
            graph=graph,
        )
    blocks = max(kv, 0) // runner["block_bytes"]
    return {
        "blocks": blocks,
        "runner_blocks": runner["blocks"],
        "error": (blocks - runner["blocks"]) / runner["blocks"] if runner["blocks"] else None,
        "torch_reserve_growth_bytes": runner["torch_reserve_growth_bytes"],
    }


def case_row(runner: dict, fitted: dict, release: str = RELEASE) -> dict:
    """The runner's record, fit's figures and their comparisons for one case and release."""
    plan = fitted.get("plan", {})
    return {
        "runner": runner,
        "fit": fitted,
        "compare": compare(runner, fitted["default"]),
        "compare_plan": compare(runner, plan) if "items" in plan else None,
        "rule_check": rule_check(runner, release),
    }


def _pct(c: dict) -> str:
    if c["fit"] is None:
        return "unknown FAIL"
    err = "n/a" if c["error"] is None else f"{c['error']:+.1%}"
    return f"{err} {'ok' if c['ok'] else 'FAIL'}"


def summary_line(case: str, row: dict, release: str = RELEASE) -> str:
    """``SUMMARY case release weights ...; activation ...; graph ... (plan ...); kv tokens ...; rule ...``."""
    case = f"{case} {release}"
    if "compare" not in row:
        return f"SUMMARY {case} {'skipped' if 'skipped' in row else 'FAILED'}: {row.get('skipped') or 'see error'}"
    c, p = row["compare"], row["compare_plan"]
    if c is None:  # fit refused the model (SGLang's rule): the runner's figures stand alone
        kv = row["runner"]["kv_tokens"]
        return f"SUMMARY {case} fit refused ({row['fit']['refused']}); kv tokens {kv:,} runner"
    graph = _pct(c["graph memory"]) + (f" (plan {_pct(p['graph memory'])})" if p else "")
    r = row["rule_check"]
    rule = "n/a" if r["error"] is None else f"{r['error']:+.2%}"
    bad = [name for name, v in (row.get("settings_check") or {}).items() if not v["ok"]]
    settings = "" if "settings_check" not in row else f"; settings {'ok' if not bad else 'differ: ' + ','.join(bad)}"
    return (
        f"SUMMARY {case} weights {_pct(c['weights'])}; activation {_pct(c['activation peak'])}; graph {graph}; "
        f"kv tokens {_pct(c['kv tokens'])} ({c['kv tokens']['runner']:,} runner); rule on measured items {rule}"
        f"{settings}"
    )


# -- the runner side (the GPU, in a fresh process) ----------------------------------------------


def runner_034(folder: Path):
    """vLLM 0.34.0's runner and worker as tests/engines/plugged.py ``release`` makes them (no
    plugin, no monkeypatch): 0.33.0's runner before the adoption, 0.34.0's files over it."""
    from capture_plan.tests.engines import adoption, plugged, vllm_runner

    module = adoption.before_module(Path(vllm_runner.__file__), folder, "vllm_034_fit_bench")
    for path in plugged.later("vllm", "0.34.0"):
        exec(compile(path.read_text(), str(path), "exec"), vars(module))
    return module


def start_up(module, target, s: Settings, snapshot, extensible: bool = True) -> dict:
    """The runner's start-up on ``target`` (built after ``snapshot``, init_device's):
    profile, warm-up, capture, the KV cache sized (``extensible``: after capture, as 0.34.0;
    else before it, the graph estimate deducted, as 0.33.0); returns the runner's record
    (tests/engines/sizing.py ``RunnerSizing``) and what else it measured. The model's own
    decode cache is KV: committed blocks after capture, or, before it, added back to the
    budget (the release allocates its cache after profiling)."""
    import torch

    from bench.baselines import hidden_state_outputs
    from capture_plan.planner.inputs.releases import release
    from capture_plan.tests.engines.case_model import (
        CaseModel,
        DraftModel,
        as_vllm_eagle,
        decode_cache,
        engine_weights,
        route_dummy_runs,
        route_vllm_eagle,
        vocab_size,
    )
    from capture_plan.tests.engines.sizing import vllm_034

    # vLLM's model holds its rope's cos/sin cache from its load on (rotary_embedding/base.py
    # RotaryEmbeddingBase.__init__: cast to the model's dtype), in place of transformers'
    # inv_freq buffers (vLLM keeps none): made before the profile, counted with the weights
    k = s.num_speculative_tokens
    if k:  # the draft as vLLM's EAGLE head, before its weights are measured
        as_vllm_eagle(target)
    weights, rope = engine_weights(target)
    rope_bytes = rope.nbytes if rope is not None else 0
    committed, per_token, full, sliding = decode_cache(target)
    model = CaseModel(target, s.max_num_batched_tokens, "target_verify" if k else "decode", 1 + k)
    draft = DraftModel(target, max(s.max_num_seqs, *s.capture_sizes)) if k else None
    spec = {"num_speculative_steps": k, "max_num_seqs": s.max_num_seqs} if k else None
    module.reset_globals()
    # no autograd anywhere (vLLM runs its steps under inference mode): a head whose weight
    # requires grad would otherwise keep the sampler's intermediates alive at its peak
    with torch.no_grad(), hidden_state_outputs(target):
        runner = module.GPUModelRunner(
            model,
            list(s.capture_sizes),
            cudagraph_mode=module.FULL_DECODE_ONLY,
            extensible_kv_cache=extensible,
            max_num_tokens=s.max_num_batched_tokens,
            max_num_reqs=s.max_num_seqs,
            draft=draft,
            speculator_options=spec,
            decode_query_lens={1 + k: s.max_num_seqs},
            # the release's request state, sampler state and block tables, in the model's shapes
            vocab_size=vocab_size(target),
            max_model_len=s.max_model_len,
            # 0.33.0's sampler (vllm_runner.py), which 0.34.0's Sampler extends, on the branch a
            # stock install of 0.33.0 runs: FlashInfer's (fit_rules.toml [sampler] flashinfer_default)
            sampler_cls=None if extensible else functools.partial(module.Sampler.__base__, use_flashinfer=True),
        )
        runner.model_memory_usage = weights
        route_dummy_runs(runner, model)
        if runner.speculator is not None:
            # the head's sampling is the release's (0.33.0's rows run 0.34.0's runner, its
            # sizing 0.33.0's: DIFFERS)
            facts = release("vllm", "0.34.0" if extensible else "0.33.0").facts
            assert facts is not None
            route_vllm_eagle(
                runner.speculator, target, s.max_num_batched_tokens, s.max_num_seqs, k - 1, facts.draft_argmax_block
            )
        group = page_group(full, sliding)
        block_bytes = group * s.block_size * per_token
        groups = -(-full // group) + -(-sliding // group)  # the KV cache groups: a block table each
        requested = math.ceil(snapshot.total_memory * s.gpu_memory_utilization)  # request_memory
        worker = module.Worker(
            runner,
            block_bytes=block_bytes,
            requested_memory=requested,
            init_snapshot=snapshot,
            block_sizes=[s.block_size] * groups,
        )
        split = capture_split(runner)
        samples = estimate_samples(runner.cudagraph_manager)
        worker.determine_available_memory()
        if not extensible:
            worker.available_kv_cache_memory_bytes += committed
        worker.initialize_from_config()
        kv = runner.extensible_kv_cache
        if kv is not None:
            kv.committed_bytes = committed
        blocks = worker.compile_or_warm_up_model()
        sizing = vllm_034(worker, blocks, block_size=s.block_size, weights_bytes=weights)
        after = worker.profile_result.after_profile
        measured = {
            "requested_bytes": requested,
            "init_free_bytes": snapshot.free_memory,
            "context_bytes": snapshot.total_memory - snapshot.free_memory,
            "non_torch_growth_bytes": after.non_torch_memory - snapshot.non_torch_memory,
            "total_consumed_bytes": worker.total_consumed,
            "free_after_capture_bytes": kv.free_memory_measured if kv is not None else None,
            "committed_bytes": committed,
            "rope_cache_bytes": rope_bytes,
            "kv_bytes_per_token_layer": per_token,
            "layers": {"full": full, "sliding": sliding},
            "graphs": len(runner.cudagraph_manager.graphs) + sum(len(m.graphs) for m in managers(runner.speculator)),
            "draft_graphs": [len(m.graphs) for m in managers(runner.speculator)],
            "graph_estimate_samples_bytes": samples,
            "live_tensors": live_tensors(),
            **split,
        }
        runner.release()
        del rope
    return {**json.loads(sizing.to_json()), "measured": measured}


def live_tensors(top: int = 24) -> list[dict]:
    """What stays allocated once the KV cache is sized, for telling which of the runner's
    persistent tensors fit does not count: the live CUDA tensors the garbage collector sees,
    each storage once, grouped by shape and dtype, the ``top`` largest groups by bytes
    (``shape``, ``dtype``, ``count``, ``bytes``), after torch's own counts (``allocated_bytes``,
    ``reserved_bytes``: their difference is free space in segments that live tensors pin)."""
    import gc

    import torch

    storages: dict[int, tuple[tuple[int, ...], str, int]] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.is_cuda:  # type(): no __class__ lookups
            st = obj.untyped_storage()
            storages.setdefault(st.data_ptr(), (tuple(obj.shape), str(obj.dtype).removeprefix("torch."), st.nbytes()))
    groups: dict[tuple, list[int]] = {}
    for shape, dtype, nbytes in storages.values():
        count_bytes = groups.setdefault((shape, dtype), [0, 0])
        count_bytes[0] += 1
        count_bytes[1] += nbytes
    rows = sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]
    listed = [{"shape": list(k[0]), "dtype": k[1], "count": c, "bytes": b} for k, (c, b) in rows]
    return [{"allocated_bytes": torch.cuda.memory_allocated(), "reserved_bytes": torch.cuda.memory_reserved()}, *listed]


def capture_split(runner) -> dict:
    """Records, into the dict returned, how the runner's ``capture_model`` drop splits:
    ``capture_reserved_growth_bytes``, torch's reserve after it less before it (both read
    where the release empties the cache: the pool, the capture streams' workspaces), the rest
    of ``capture_drop_bytes`` being the driver's (graph execs; and torch's stream pools in the
    runs where the capture's stream was the process's first torch stream, before the runner
    made its first where the release does). The release's call is wrapped: the wrapper
    empties torch's cache before it (the release's first step where it captures anything)
    and reads torch's reserve around it."""
    import torch

    split: dict = {}
    capture = runner.capture_model

    def measured(*a, **kw):
        torch.cuda.empty_cache()  # as the release's first reading (model_runner.py capture_model)
        before = torch.cuda.memory_reserved()
        drop = capture(*a, **kw)
        split.update(capture_drop_bytes=drop, capture_reserved_growth_bytes=torch.cuda.memory_reserved() - before)
        return drop

    runner.capture_model = measured
    return split


def estimate_samples(manager) -> list[int]:
    """The free-memory drops of the FULL graphs the 0.33.0-shaped graph estimate samples, in
    the list returned once the estimate has run (cudagraph_utils.py profile_cudagraph_memory:
    the first ``_FULL_GRAPH_PROFILING_SAMPLES`` FULL captures into a throwaway pool, which it
    extrapolates as the first + (FULL graphs - 1) x max(the second, 1 MiB)); empty where the
    release samples none (0.34.0's extensible cache). The manager's ``capture`` is wrapped to
    read its ``_capture_mem_samples`` after each call; the release's code is left as it is."""
    samples: list[int] = []
    capture = manager.capture

    def recorded(*a, **kw):
        out = capture(*a, **kw)
        if manager._capture_mem_samples is not None:
            samples.extend(manager._capture_mem_samples)
        return out

    manager.capture = recorded
    return samples


def managers(speculator) -> list:
    """The speculator's graph managers (none without one)."""
    if speculator is None:
        return []
    return [speculator.prefill_cudagraph_manager, speculator.decode_cudagraph_manager]


def child(case: str, layers: int, release: str = RELEASE) -> dict:
    """The runner's start-up for ``case`` in this (fresh) process (module docstring)."""
    if release == sgl.RELEASE:
        return sgl.child(case, layers, MAX_MODEL_LEN)
    import torch

    from bench.harness import DEVICE_FIELDS, CaseDoesNotFit, case_target
    from capture_plan.executor.device import driver_version
    from capture_plan.planner.fit.tables import estimates

    device_name = torch.cuda.get_device_name()
    # header(device=True)'s fields, read here: the parent never touches the GPU
    device = dict(zip(DEVICE_FIELDS, (device_name, driver_version(), torch.__version__, torch.version.cuda)))
    s = settings_for(device_name, release, case)
    module = runner_034(Path(tempfile.mkdtemp()))
    torch.cuda.empty_cache()
    snapshot = module.MemorySnapshot().measure()  # init_device's, before the model is built
    # every decode graph's requests (EAGLE's draft decode grid: up to max_num_seqs)
    max_bs = s.max_num_seqs if s.num_speculative_tokens else max(s.capture_sizes)
    try:
        # vLLM's sm90 attention: FA3 with max_num_splits for its FULL graphs (fit's own reading)
        splits = estimates()["graph"]["vllm_split_kv"]["splits"]
        target = case_target(case, None, layers, max_bs=max_bs, attention="fa3", fa3_splits=splits, own_segments=True)
    except CaseDoesNotFit as err:  # a result: the case is skipped on this device, saying why
        return {"skipped": f"{case} does not fit this device: {err}"}
    torch.cuda.synchronize()
    runner = start_up(module, target, s, snapshot, extensible=release == RELEASE)
    return {"device": device, "settings": asdict(s), "runner": runner}


# -- the command --------------------------------------------------------------------------------


def fresh_child(case: str, layers: int, release: str = RELEASE) -> dict:
    """``child`` in a fresh process (a start-up has no other graphs, garbage or library
    workspaces beside it: a process that captured before, say a test session's, measures a
    smaller drop), or ``{"error": its output's tail}``."""
    cmd = ["--child", case, "--layers", str(layers), "--releases", release]
    p = run_module("fit_bench", cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        return {"error": (p.stderr or p.stdout)[-3000:]}
    return json.loads(lines[-1][7:])


def run_case(case: str, layers: int, folder: Path, release: str = RELEASE) -> dict:
    """One case and release: the runner in a fresh process, then fit for the device it ran on."""
    got = fresh_child(case, layers, release)
    if "skipped" in got or "error" in got:
        return got
    return measured_row(case, folder / case, layers, got, release)


def measured_row(case: str, folder: Path, layers: int, got: dict, release: str) -> dict:
    """One case's row from the runner's measurement ``got`` (its device, settings and record):
    fit's side for the device it ran on, the comparisons and the rule check."""
    device = got["device"]["device"]
    if release == sgl.RELEASE:
        s = sgl.Settings.of(got["settings"])
        fitted = sgl.fit_side(case, folder, layers, device, s)
        return {"device": got["device"], "settings": got["settings"], **sgl.case_row(got["runner"], fitted, s)}
    s = Settings(**{**got["settings"], "capture_sizes": tuple(got["settings"]["capture_sizes"])})
    graphs = got["runner"]["measured"]["graphs"]
    fitted = fit_side(case, folder, layers, device, s, release, graphs)
    row = {"device": got["device"], "settings": got["settings"], **case_row(got["runner"], fitted, release)}
    return {**row, "fit_lacks": FIT_LACKS[case]} if case in FIT_LACKS else row


def refit(source: dict, source_name: str, folder: Path) -> dict:
    """fit's side of a measured run again, at this commit and on the CPU: ``source`` (a
    fit-bench result, ``source_name`` its file) keeps its runner records as measured; fit's
    figures, their comparisons and the rule check are recomputed with the planner as it is
    now. The device fields are the source's (the runner's device); ``refit_of`` names the
    source's file, commit and date, and this result's header names the commit fit ran at.
    A case the source skipped or failed is kept as it was."""
    res: dict = header(device=False)
    res.update({k: source[k] for k in DEVICE_FIELDS if k in source})
    res["refit_of"] = {k: source.get(k) for k in ("git_commit", "git_tree", "git_dirty", "date")} | {
        "file": source_name
    }
    # the differences as this commit knows them (fit's side may have gained one), the run's settings
    res.update({k: source[k] for k in ("releases", "layers", "targets") if k in source}, differs=DIFFERS, cases={})
    if sgl.RELEASE in source.get("releases", {}):
        res["differs_sglang"] = sgl.DIFFERS
    for case, rows in source["cases"].items():
        res["cases"][case] = {}
        for release, row in rows.items():
            if "runner" not in row:
                res["cases"][case][release] = row
                continue
            (folder / case).mkdir(parents=True, exist_ok=True)
            res["cases"][case][release] = measured_row(case, folder / case, source["layers"], row, release)
    return res


def main() -> int | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"cases, comma-separated (default {','.join(CASES)})")
    add_layers(ap, help="layers of the reference model")
    ap.add_argument(
        "--releases",
        default=RELEASE,
        help=f"releases the runner follows, comma-separated: {', '.join(RELEASES)} (default {RELEASE})",
    )
    ap.add_argument("--tag", default="")
    add_out_dir(ap)
    add_overwrite(ap)
    ap.add_argument(
        "--refit",
        default=None,
        metavar="RESULT",
        help="no GPU: recompute fit's side of a committed fit-bench result at this commit (the runner's "
        "records kept as measured); writes fit-bench-DATE-TAG.json beside it (TAG default: refit)",
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.refit:
        source = Path(args.refit)
        res = refit(json.loads(source.read_text()), source.name, Path(tempfile.mkdtemp(prefix="fit-refit-")))
        path = result_file(args, "fit-bench", res["date"], args.tag or "refit")
        print(f"wrote {path.write(res)}")
        for case, rows in res["cases"].items():
            for release, row in rows.items():
                print(summary_line(case, row, release))
        return None
    releases = [r for r in args.releases.split(",") if r]
    unknown = [r for r in releases if r not in RELEASES]
    if unknown or not releases:
        ap.error(f"--releases {args.releases}: each one of {', '.join(RELEASES)}")
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.layers, releases[0])), flush=True)
        return None
    # the device's fields come from the first case's process: this one holds no CUDA context,
    # which would take the children's free memory, and so their KV caches
    res: dict = header(device=False)
    path = result_file(args, "fit-bench", res["date"], args.tag)
    res.update(
        releases={r: RELEASES[r] for r in releases},
        layers=args.layers,
        targets={k: asdict(t) for k, t in TARGETS.items()},
        differs=DIFFERS,
        cases={},
    )
    if sgl.RELEASE in releases:
        res["differs_sglang"] = sgl.DIFFERS
    folder = Path(tempfile.mkdtemp(prefix="fit-bench-"))
    for case in [c for c in args.cases.split(",") if c]:
        (folder / case).mkdir(parents=True, exist_ok=True)
        res["cases"][case] = {}
        for release in releases:
            row = run_case(case, args.layers, folder, release)
            res["cases"][case][release] = row
            res.update(row.get("device", {}))
            if "error" in row:
                print(f"{case} {release}: FAILED\n{row['error']}", flush=True)
            path.write(res)  # after every case: a time limit keeps them
    print(f"wrote {path.path}")
    for case, rows in res["cases"].items():
        for release, row in rows.items():
            print(summary_line(case, row, release))
    return 1 if any("error" in r for rows in res["cases"].values() for r in rows.values()) else None


if __name__ == "__main__":
    main_exit(main)
