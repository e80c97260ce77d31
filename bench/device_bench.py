"""Device-memory benchmark on one GPU: the free memory capture takes, predicted and measured.

An engine subtracts what capture takes from free device memory before it
sizes its KV cache, so the figure that matters is the drop in
``torch.cuda.mem_get_info()``'s free bytes, not the graph pool. Every case
runs in a fresh process (the first graph capture of a process pays a one-off
driver cost outside the caching allocator), with random weights:

  reference   the 32-layer reference decode step (FA3 if importable), plans/fa3-ci.json
  eagle       the speculative reference, all four EAGLE phases, plans/fa3-eagle-ci.json
  llama, gemma2, qwen2, mixtral, qwen2_moe
              transformers models built from configs (capture_plan.adapters.hf.HFTarget), SGLang's
              36 decode sizes up to 256

and for each, in that fresh process (``--modes``):

  executor    ``capture(plan, target)``: the report's device view (pool, hoisted,
              allocator-held, allocator-cached, outside-allocator), free memory after
              every step, and what stays gone after ``release()`` + ``empty_cache()``;
              the plan's analytic pool prediction (built from the config) against the
              pool measured after every capture
  loop        the engines' loop (largest-first, 2 warm-ups, ``torch.cuda.graph``,
              outputs kept) on the same model, its device drop
  startup     ``capture_plan.adapters.startup.predict_startup`` (a few recorded sizes per phase ->
              the whole plan simulated -> the bytes capture will take), its time and where it
              went, with the case's plan as the schedule (an engine's checked-in plan: the
              analytic build it saves is the case's ``build_s``);
              then a KV cache sized from it (free - predicted - margin), the capture, and
              the slack left; the prediction against the measured drop at every step;
              its ``shortcuts`` (a one-phase plan's graph copies stopped early:
              ``--copy-error-mib``, ``none`` for every copy), the allocator core its build
              ran on, and its time over the capture's (``predict_of_capture``)
  startup-cached
              the same in a later fresh process: the calibration the "startup" mode's
              process wrote is read from the run's start-up cache (nothing recorded), and
              ``confirm_startup`` checks it against the capture
  vllm        vLLM 0.33.0's own method (bench/baselines.py): ``profile_cudagraph_memory``
              step for step (one throwaway pool, the 2 largest FULL descriptors sampled
              around their graph blocks, ``measured - sum(samples) + first + (n - 1) *
              max(second, 1 MiB)``), at vLLM's default sizes on an H200 (51) with
              hidden-state outputs in persistent buffers, against its capture of the same
              graphs; its time. Runs are before 2026-12-02 measured another method: see
              docs/measurements.md
  vllm-0.34   vLLM 0.34.0's capture of its own default graphs on the device
              (bench/baselines.py ``vllm_034_sizes``: the target's decode graphs keyed
              (requests, query length), EAGLE's draft decode grid up to max_num_seqs, the
              persistent buffers sized for the widest descriptor up front) against the
              plan's prediction for the same graphs (the case's spec at vLLM's sizes, the
              target's phase as vLLM's `full` kind: hidden states out, logits outside the
              graph; built analytically: its pool against the capture's pool, and its
              whole-capture figure, a lower bound while an item is unknown, against the
              drop) and vLLM 0.34.0's estimator (0 with its extensible KV cache,
              the default on CUDA: the capture is measured instead; else the 2-sample
              ``profile_cudagraph_memory``, unchanged from 0.33.0)
  reuse, reuse-off
              ``capture(plan, target)`` with every phase of the plan set to ``reuse =
              "exec-update"`` (executables shared between graphs alike in structure), and the
              plan as it is: the free-memory drop, the driver memory outside the allocator
              (graph-exec), the pool, capture time, executables instantiated (the report's
              ``reuse``), then ``verify`` (interleave, scribble, and for shared graphs reuse):
              its faults are the wrong replays
  sglang      SGLang 0.5.23's reserve (``reserve_for_graph_mb``), arithmetic only
  timing      ``capture(plan, target)`` then ``executor.timing.time_replays``: the median
              replay time of every graph (20 timed replays after 3 untimed), the step-time
              curve ``planner sizes --timing`` weighs padding with; the timed capture report
              is written beside the JSON (:func:`timed_report_path`) for that command

Writes JSON (date, device, driver, per case) to --out and prints a table and a
one-line summary last.
Run: python -m bench.device_bench [--cases reference,eagle,...] [--modes executor,loop,...] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from bench.harness import (
    CaseDoesNotFit,
    MiB,
    add_layers,
    add_out_dir,
    add_overwrite,
    case_options,
    case_target,
    eagle_config,
    engine_loop,
    free_bytes,
    header,
    largest_first,
    main_exit,
    release,
    result_file,
    run_module,
    startup_added,
)

CASES = ("reference", "eagle", "llama", "gemma2", "qwen2", "mixtral", "qwen2_moe")
MODES = (
    "executor",
    "loop",
    "startup",
    "startup-cached",
    "vllm",
    "vllm-0.34",
    "sglang",
    "timing",
    "reuse",
    "reuse-off",
)


def _phase_order(plan) -> list[tuple[str, list[int]]]:
    """The engines' loop: phases in plan order, each largest-first."""
    return largest_first((p.name, p.sizes) for p in plan.phases)


# -- the modes (each in a fresh process) -----------------------------------------
def mode_executor(target, plan) -> dict:
    import torch

    from capture_plan.executor import capture

    segs0 = {s["address"] for s in torch.cuda.memory_snapshot()}
    gs = capture(plan, target, progress=False)
    rep = gs.report
    view = rep.device_view
    free_after = free_bytes()
    # what the ordinary allocator gained (the pools excluded): for the allocator-held/cached items
    new = [
        {
            "size": s["total_size"],
            "allocated": s["allocated_size"],
            "stream": s["stream"],
            "pool": list(s.get("segment_pool_id") or (0, 0)),
            "blocks": [(b["size"], b["state"]) for b in s["blocks"]][:8],
        }
        for s in torch.cuda.memory_snapshot()
        if s["address"] not in segs0
        and tuple(s.get("segment_pool_id") or (0, 0)) not in {tuple(int(x) for x in p) for p in gs.pools.values()}
    ]
    gs.release()
    torch.cuda.empty_cache()
    stays = view.free_before - free_bytes()
    caps = [m for m in rep.steps if m.id.startswith("capture/") and m.reserved]
    # no capture reserved anything (a plan of one empty graph): no worst step, no error ratio
    worst = max(caps, key=lambda m: abs(m.predicted_reserved - m.reserved) / m.reserved, default=None)
    return {
        "analytic_error": (plan.predicted.pool_bytes - rep.pool_bytes) / rep.pool_bytes if rep.pool_bytes else None,
        "analytic_worst_step": None
        if worst is None
        else {"step": worst.id, "predicted_mib": worst.predicted_reserved / MiB, "measured_mib": worst.reserved / MiB},
        "pool_mib": rep.pool_bytes / MiB,
        "predicted_pool_mib": plan.predicted.pool_bytes / MiB,
        "drop_mib": view.drop / MiB,
        "items_mib": {i.name: i.bytes / MiB for i in view.items},
        "first_in_process": view.first_in_process,
        "capture_s": rep.capture_seconds,
        "free_after_check_mib": (view.free_before - free_after) / MiB,
        "stays_after_release_mib": stays / MiB,
        "driver": rep.driver,
        "new_ordinary_segments": new,
        "report": json.loads(__import__("msgspec").json.encode(rep)),
    }


def with_reuse(plan):
    """``plan`` with every phase but piecewise ones set to ``reuse = "exec-update"`` (revision 7), sealed."""
    import msgspec

    from capture_plan.schemas.codec import seal
    from capture_plan.schemas.plan import REUSE_REVISION

    phases = [p if p.piecewise is True else msgspec.structs.replace(p, reuse="exec-update") for p in plan.phases]
    return seal(msgspec.structs.replace(plan, phases=phases, revision=max(plan.revision, REUSE_REVISION)))


def mode_reuse(target, plan, on: bool) -> dict:
    """One capture with executable reuse on (every phase) or off, its device figures and verify."""
    import msgspec

    from capture_plan.executor import capture, verify

    plan = with_reuse(plan) if on else plan
    gs = capture(plan, target, progress=False)
    rep = gs.report
    view = rep.device_view
    captures = sum(s.op == "capture" for s in plan.steps)
    reuse = rep.reuse if rep.reuse is not msgspec.UNSET else None
    res = verify(gs, checks=("interleave", "scribble"))
    out = {
        "reuse": on,
        "graphs": captures,
        "instantiations": reuse.instantiations if reuse is not None else captures,
        "groups": [len(g.graphs) for g in reuse.groups] if reuse is not None else [],
        "refusals": [f"{r.graph}: {r.reason}" for r in reuse.refusals][:40] if reuse is not None else [],
        "clusters": reuse.clusters if reuse is not None else "",
        "capture_s": rep.capture_seconds,
        "pool_mib": rep.pool_bytes / MiB,
        "drop_mib": view.drop / MiB,
        "graph_exec_mib": view.item("outside-allocator") / MiB,
        "verify_ok": res.ok,
        "verify_checks": list(res.checks),
        "verify_replays": res.replays,
        "wrong_replays": len(res.faults),
        "faults": [str(f) for f in res.faults[:10]],
    }
    gs.release()
    return out


def mode_timing(target, plan) -> dict:
    """Every graph's median replay time, in the capture report ``planner sizes --timing`` reads."""
    import msgspec

    from capture_plan.executor import capture
    from capture_plan.executor.timing import time_replays

    gs = capture(plan, target, progress=False)
    rep = time_replays(gs, runs=20, warmup=3)
    gs.release()
    steps = [(m.id, m.replay_seconds) for m in rep.steps if isinstance(m.replay_seconds, float)]  # else UNSET
    return {
        "replay_ms": {i: round(t * 1e3, 4) for i, t in steps},
        "report": json.loads(msgspec.json.encode(rep)),
    }


def timed_report_path(result: Path, case: str) -> Path:
    """Where the ``timing`` mode writes ``case``'s timed capture report: beside the result
    JSON, named after it (``device-DATE[-TAG].json`` -> ``report-CASE-timed-DATE[-TAG].json``),
    so that it is as unique as the result's name, which :class:`bench.harness.ResultFile`
    keeps from being replaced unasked: another run of the same day (another ``--tag``)
    writes its own reports instead of replacing the committed ones."""
    return result.with_name(f"report-{case}-timed-{result.stem.removeprefix('device-')}.json")


def mode_loop(target, plan) -> dict:
    before = free_bytes()
    run = engine_loop(target, _phase_order(plan), warmups=2, free_after=True)
    drop = before - run.free_after[-1]
    from capture_plan.executor.pool import pool_reserved

    pool = pool_reserved([run.pool])
    secs = run.seconds
    release(run)
    return {"pool_mib": pool / MiB, "drop_mib": drop / MiB, "capture_s": secs}


def cache_length(target) -> int | None:
    """The KV cache length the case's target was built with (sized for the device:
    bench.harness.case_target), None where the target does not say."""
    cfg = getattr(target, "cfg", None)
    return getattr(cfg, "max_seqlen", getattr(target, "max_seqlen", None))


def vllm_setup(case: str, plan, layers: int):
    """vLLM 0.33.0's graphs for a case (bench/baselines.py): its default sizes on an H200
    for the case's decode query length, the uniform-decode FULL descriptors made of them
    (the main model's phase: ``decode``, or EAGLE's ``target_verify``), the speculator's
    phases (EAGLE's drafts, at the same request counts), and a target sized for them."""
    from bench.baselines import vllm_capture_sizes, vllm_full_decode_requests

    phases = [p.name for p in plan.phases]
    eagle = "target_verify" in phases
    q = eagle_config(layers, 1).num_draft_tokens if eagle else 1  # tokens per request verified
    sizes = vllm_capture_sizes(decode_query_len=q)
    reqs = vllm_full_decode_requests(sizes, decode_query_len=q)
    target = case_target(case, plan, layers, max_bs=max(reqs))
    full = ("target_verify" if eagle else "decode", reqs)
    spec = [(p, reqs) for p in phases if p.startswith("draft_")]
    return target, full, spec, sizes


def mode_vllm(case: str, plan, layers: int) -> dict:
    """vLLM 0.33.0's own method on the case's model (bench/baselines.py): its estimate
    (``profile_cudagraph_memory`` step for step) against its capture (``capture_model``)
    of the same graphs in a fresh pool, both with hidden-state outputs in persistent
    buffers, at vLLM's default sizes for the device."""
    import torch

    from bench.baselines import hidden_state_outputs, vllm_capture_model, vllm_profile, vllm_release

    target, full, spec, sizes = vllm_setup(case, plan, layers)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    with hidden_state_outputs(target):
        for phase, reqs in [full, *spec]:  # valid inputs, and the eager profiling run before capture
            target.prepare(phase, max(reqs), max(reqs), gen)
            target.run(phase, max(reqs), None)
        release()
        t0 = time.perf_counter()
        prof = vllm_profile(target, full, spec)
        seconds = time.perf_counter() - t0
        run = vllm_capture_model(target, full, spec)
        measured, graphs = run.measured, len(run.graphs)
        vllm_release(run)
    return {
        "method": "vLLM 0.33.0 profile_cudagraph_memory (bench/baselines.py)",
        "max_seqlen": cache_length(target),
        "capture_sizes": sizes,
        "full": {"phase": full[0], "requests": full[1]},
        "speculator": [p for p, _ in spec],
        "estimate_mib": prof["estimate"] / MiB,
        "profile_measured_mib": prof["measured"] / MiB,
        "samples_mib": [s / MiB for s in prof["samples"]],
        "profiled_graphs": prof["profiled_graphs"],
        "seconds": seconds,
        "graphs": graphs,
        "vllm_capture_drop_mib": measured / MiB,
        "error": (prof["estimate"] - measured) / measured if measured else None,
    }


def spec_text(spec) -> str:
    """``spec`` as TOML, its ``[model]`` the config alone where it names a config.json (as the
    case's own spec gave it). ``build_spec`` returns the model with the dimensions read from
    the config filled in; written out beside the config they are refused (``[model] names a
    config and also lists layers, ...``), which stopped the vllm-0.34 mode of every
    transformers case (issue 49, item 7)."""
    import msgspec

    from capture_plan.planner.inputs.spec_toml import spec_toml

    text = spec_toml(spec)
    if spec.model.config is msgspec.UNSET:
        return text
    head, _, rest = text.partition("\n[model]\n")
    _, _, tail = rest.partition("\n\n")  # the model's table ends at the first blank line
    return f"{head}\n[model]\nconfig = {json.dumps(spec.model.config)}\n\n{tail}"


def vllm034_setup(case: str, plan, layers: int, folder: Path, backend: str | None = None):
    """vLLM 0.34.0's graphs for a case at its H200 defaults (bench/baselines.py
    ``vllm_034_sizes``; EAGLE: 3 speculative tokens, query length 4) and the plan for the same
    graphs: the case's spec with the main phase at vLLM's decode request counts (as the
    `full` kind: vLLM's forward returns hidden states), a
    ``draft_decode`` phase at its draft decode grid and the other draft phases at the
    decode request counts, built analytically (``backend``: the plan's attention backend,
    the case's own where None). Returns (full, speculator, sizes, plan); no torch (the CPU
    tests run it)."""
    import msgspec

    from bench.baselines import vllm_034_sizes
    from capture_plan.planner import build_plan
    from capture_plan.planner.build import build_spec

    phases = [p.name for p in plan.phases]
    eagle = "target_verify" in phases
    k = eagle_config(layers, 1).num_draft_tokens - 1 if eagle else 0  # speculative tokens a step
    sizes = vllm_034_sizes(num_speculative_tokens=k)
    reqs = sorted({n for n, _ in sizes.decode}, reverse=True)
    main = "target_verify" if eagle else "decode"
    draft = sizes.draft_decode or reqs
    spec = [(p, sorted(draft if p == "draft_decode" else reqs, reverse=True)) for p in phases if p.startswith("draft_")]
    want = {main: reqs, **dict(spec)}
    opts = case_options(case, folder)
    base = build_spec(opts)
    # vLLM's graph of the target is the model's forward: it returns the final-normed hidden
    # states and computes the logits outside the graph (the `full` kind; the capture below
    # swaps the head out the same way, hidden_state_outputs). The drafts keep their kinds:
    # the draft's sampling needs its head inside its graphs.
    kinds = {main: "full"}
    kept = [
        msgspec.structs.replace(ph, sizes=sorted(want[ph.name]), kind=kinds.get(ph.name, ph.kind))
        for ph in base.phases
        if ph.name in want
    ]
    path = folder / f"{case}-vllm-0.34.toml"
    path.write_text(spec_text(msgspec.structs.replace(base, phases=kept)))
    vllm_plan = build_plan(
        msgspec.structs.replace(
            opts, spec=path, ci=False, speculative=None, max_bs=None, backend=backend or opts.backend
        )
    )
    return (main, reqs), spec, sizes, vllm_plan


def mode_vllm034(case: str, plan, layers: int) -> dict:
    """vLLM 0.34.0's capture of its default graphs (:func:`vllm034_setup`) in a fresh pool,
    persistent buffers sized for the widest, against the plan's prediction for those graphs
    and vLLM 0.34.0's estimator (module docstring)."""
    import torch

    from bench.baselines import hidden_state_outputs, vllm_capture_model, vllm_profile, vllm_release
    from capture_plan.executor.pool import pool_reserved
    from capture_plan.schemas.keys import capture_memory

    folder = Path(tempfile.mkdtemp())
    full, spec, sizes, vllm_plan = vllm034_setup(case, plan, layers, folder)
    target = case_target(case, vllm_plan, layers)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    with hidden_state_outputs(target):
        for phase, reqs in [full, *spec]:
            target.prepare(phase, max(reqs), max(reqs), gen)
            target.run(phase, max(reqs), None)
        release()
        prof = vllm_profile(target, full, spec)  # the estimator with the extensible KV cache off
        run = vllm_capture_model(target, full, spec, release="0.34.0")
        measured, graphs = run.measured, len(run.graphs)
        pool = pool_reserved([run.pool])
        vllm_release(run)
    memory = capture_memory(vllm_plan)
    return {
        "method": "vLLM 0.34.0 capture_model at its default sizes (bench/baselines.py vllm_034_sizes)",
        "max_seqlen": cache_length(target),
        "full": {"phase": full[0], "requests": full[1]},
        "speculator": {p: r for p, r in spec},
        "decode_shapes": sizes.decode,
        "graphs": graphs,
        "vllm_capture_drop_mib": measured / MiB,
        # the pool alone, the part both sides account for the same way; the rest of the drop
        # is outside the pool (the graphs' driver memory, the persistent buffers, the warm-ups'
        # cached blocks), which an analytic plan does not know (plan_capture_complete False)
        "vllm_pool_mib": pool / MiB,
        "vllm_outside_pool_mib": (measured - pool) / MiB,
        "plan_pool_mib": vllm_plan.predicted.pool_bytes / MiB,
        "plan_pool_error": (vllm_plan.predicted.pool_bytes - pool) / pool if pool else None,
        "plan_capture_mib": memory.bytes / MiB,
        "plan_capture_complete": memory.complete,
        "plan_error": (memory.bytes - measured) / measured if measured else None,
        "estimate_extensible_mib": 0.0,
        "estimate_mib": prof["estimate"] / MiB,
        "estimate_error": (prof["estimate"] - measured) / measured if measured else None,
    }


def mode_sglang(case: str, plan) -> dict:
    """SGLang 0.5.23's reserve for the case (bench/baselines.py ``sglang_reserve_mib``): its
    decode term at the plan's largest decode size, its default prefill term on an H200
    (58 prefill sizes, breakable graphs), MLA for DeepSeek-V3; no DP attention, no DeepEP.
    Arithmetic only: compared with the engines' loop ("loop" mode) where it ran."""
    from bench.baselines import sglang_prefill_sizes, sglang_reserve_mib

    decode = max(max(p.sizes) for p in plan.phases if p.name == "decode")
    mla = case == "deepseek_v3"
    prefill = sglang_prefill_sizes(8192)
    return {
        "method": "SGLang 0.5.23 reserve_for_graph_mb (bench/baselines.py)",
        "decode_max_bs": decode,
        "mla": mla,
        "prefill_sizes": len(prefill),
        "reserve_mib": sglang_reserve_mib(decode_max_bs=decode, prefill_sizes=prefill, mla=mla),
        "decode_term_mib": sglang_reserve_mib(decode_max_bs=decode, prefill_backend="disabled"),
    }


def model_key(case: str, target, layers: int) -> str:
    """The start-up cache's name for the case's model: the transformers adapter's own key,
    else the reference's case and layers (its code is this checkout's)."""
    key = getattr(target, "model_key", None)
    return key() if callable(key) else f"{case}, {layers} layers"


def mode_startup(
    target, opts, plan, margin_mib: int, cache: str | None = None, key: str = "", copy_error: str = "default"
) -> dict:
    import torch

    from capture_plan.adapters.startup import confirm_startup, measured_peak, predict_startup
    from capture_plan.executor import capture

    t0 = time.perf_counter()
    # the engine's checked-in plan is the schedule (the analytic build it saves is the case's build_s)
    # copy_error: predict_startup's default, "none" (every copy: the figure measured whole) or MiB
    extra = {} if copy_error == "default" else {"copy_error": None if copy_error == "none" else float(copy_error) * MiB}
    pred = predict_startup(target, opts, schedule=plan, cache=cache, model_key=key if cache else None, **extra)
    seconds = time.perf_counter() - t0
    free = free_bytes()
    kv_bytes = free - pred.pending_bytes - margin_mib * MiB
    kv = torch.empty(kv_bytes, dtype=torch.uint8, device="cuda")  # the engine's KV cache
    before = free_bytes()
    try:
        gs = capture(pred.plan, target, progress=False)
    except Exception as err:  # an OOM is a result: the prediction was too low
        return {
            "predict_s": seconds,
            "error": f"{type(err).__name__}: {err}"[:300],
            "pending_mib": pred.pending_bytes / MiB,
            "items_mib": {k: v / MiB for k, v in pred.items.items()},
            "kv_mib": kv_bytes / MiB,
        }
    rep = gs.report
    view = rep.device_view
    slack = free_bytes() - margin_mib * MiB  # what the KV cache could still have had
    check = confirm_startup(pred, rep) if cache else None
    # The peak inside a step: a warm-up's temporaries sit in its scratch pool, returned when the
    # step ends, so the free memory after the step misses them; the report measures each
    # warm-up's scratch peak (adapters.startup.measured_peak)
    peak = measured_peak(rep)
    steps = []
    for m in rep.steps:
        predicted = pred.timeline[m.step] if m.step < len(pred.timeline) else None
        if m.free is None or predicted is None:
            continue
        measured = before - m.free
        steps.append((m.id, predicted, measured, m.reserved, m.predicted_reserved, m.allocator_reserved))
    within = [abs(p - m) <= max(2 * MiB, 0.01 * m) for _, p, m, *_ in steps]
    worst = max(steps, key=lambda t: abs(t[1] - t[2]), default=None)
    gs.release()
    del kv
    final = pred.final_bytes  # predicted to stay after capture
    return {
        "predict_s": seconds,
        "capture_s": rep.capture_seconds,
        "predicted_total_mib": pred.total_bytes / MiB,
        "pending_mib": pred.pending_bytes / MiB,
        "items_mib": {k: v / MiB for k, v in pred.items.items()},
        "graph_exec": pred.graph_exec,
        "measured_drop_mib": view.drop / MiB,
        "measured_peak_mib": peak / MiB,
        # pending is the peak: against the measured peak; the figure after capture against the drop
        "error": (pred.pending_bytes - peak) / peak,
        "final_error": (final - view.drop) / view.drop,
        "final_error_mib": (final - view.drop) / MiB,
        "steps_within_1pct_or_2mib": f"{sum(within)}/{len(within)}",
        "worst_step": None
        if worst is None
        else {"step": worst[0], "predicted_mib": worst[1] / MiB, "measured_mib": worst[2] / MiB},
        "kv_mib": kv_bytes / MiB,
        "slack_mib": slack / MiB,
        "slack_of_drop": slack / view.drop,
        "margin_mib": margin_mib,
        "recorded": pred.recorded,
        "predict_parts_s": pred.timings,
        "predict_of_capture": seconds / rep.capture_seconds if rep.capture_seconds else None,
        "shortcuts": pred.shortcuts,
        "allocator_core": pred.allocator_core,
        "copy_error": copy_error,
        "source": pred.source,
        "confirm": None if check is None else check.describe(),
        "confirm_ok": None if check is None else check.ok,
        # steps where the capture took more than predicted beyond 1% or 2 MiB (the unsafe side)
        "steps_above": sum(m - p > max(2 * MiB, 0.01 * m) for _, p, m, *_ in steps),
        # every step: id, the drop predicted and measured, the pools' reserved bytes measured and
        # predicted, the whole allocator's reserved bytes (MiB): a miss's cause is read from these
        "steps": [[i, *(None if v is None else round(v / MiB, 2) for v in rest)] for i, *rest in steps],
    }


def ready_target(case: str, plan, layers: int):
    """The case's target (``case_target``) as an engine has it before capture: valid inputs
    in every phase, the engine's eager profiling run done, the allocator's cache emptied."""
    import torch

    target = case_target(case, plan, layers)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    for p in plan.phases:  # valid inputs everywhere, and the engine's eager profiling run before capture
        target.prepare(p.name, max(p.sizes), max(p.sizes), gen)
        target.run(p.name, max(p.sizes), None)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the engine's cache starts empty, so that the loop's emptying frees nothing of it
    return target


def child(
    case: str, modes: list[str], layers: int, margin_mib: int, cache: str | None = None, copy_error: str = "default"
) -> dict:

    from capture_plan.planner import build_plan

    folder = Path(tempfile.mkdtemp())
    opts = case_options(case, folder)
    t0 = time.perf_counter()
    plan = build_plan(opts)
    out: dict = {
        "case": case,
        "build_s": time.perf_counter() - t0,
        "captures": sum(s.op == "capture" for s in plan.steps),
        "analytic_pool_mib": plan.predicted.pool_bytes / MiB,
        "fidelity": getattr(plan.predicted, "fidelity", None),
    }
    try:
        return _child_modes(case, modes, layers, margin_mib, cache, copy_error, opts, plan, out)
    except CaseDoesNotFit as err:  # the case is skipped on this device, saying why
        return {**out, **{mode: {"skipped": f"{case} does not fit this device: {err}"} for mode in modes}}


def _child_modes(case, modes, layers, margin_mib, cache, copy_error, opts, plan, out) -> dict:
    # vLLM's mode builds a target of its own (sized for vLLM's sizes), SGLang's is arithmetic
    if not set(modes) <= {"vllm", "vllm-0.34", "sglang"}:
        target = ready_target(case, plan, layers)
    out["free_after_model_mib"] = free_bytes() / MiB
    for mode in modes:
        if mode == "executor":
            out[mode] = mode_executor(target, plan)
        elif mode == "loop":
            out[mode] = mode_loop(target, plan)
        elif mode == "vllm":
            out[mode] = mode_vllm(case, plan, layers)
        elif mode == "vllm-0.34":
            out[mode] = mode_vllm034(case, plan, layers)
        elif mode == "sglang":
            out[mode] = mode_sglang(case, plan)
        elif mode == "timing":
            out[mode] = mode_timing(target, plan)
        elif mode in ("reuse", "reuse-off"):
            out[mode] = mode_reuse(target, plan, on=mode == "reuse")
        elif mode in ("startup", "startup-cached"):
            # with a cache: "startup" records and writes the calibration, "startup-cached" (a
            # later process) reads it
            key = model_key(case, target, layers)
            out[mode] = mode_startup(target, opts, plan, margin_mib, cache, key, copy_error)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--modes", default="executor,loop")
    add_layers(ap, help="layers of the reference models")
    ap.add_argument("--margin-mib", type=int, default=256, help="the engine's own margin when sizing the KV cache")
    add_out_dir(ap)
    ap.add_argument("--tag", default="")
    ap.add_argument(
        "--copy-error-mib",
        default="default",
        help="start-up modes: predict_startup's copy_error in MiB, 'none' (every graph copy), or 'default'",
    )
    add_overwrite(ap)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if args.child:
        got = child(args.child, modes, args.layers, args.margin_mib, args.cache, args.copy_error_mib)
        print("RESULT " + json.dumps(got), flush=True)
        return
    # one start-up cache for the run, empty at its start: "startup" writes, "startup-cached" reads
    cache = tempfile.mkdtemp(prefix="capture-plan-bench-cache-")
    res: dict = header(device=True)
    path = result_file(args, "device", res["date"], args.tag)
    res.update(layers=args.layers, modes=modes, cases={})
    for case in args.cases.split(","):
        # one process per mode: each pays the first capture's cost itself
        row: dict = {}
        for mode in modes:
            cmd = ["--child", case, "--modes", mode, "--layers", str(args.layers), "--margin-mib", str(args.margin_mib)]
            cmd += ["--cache", cache, "--copy-error-mib", args.copy_error_mib]
            p = run_module(
                "device_bench", cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
            )
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            if p.returncode or not lines:
                row[mode] = {"error": (p.stderr or p.stdout)[-1500:]}
                print(f"{case}/{mode}: FAILED\n{row[mode]['error']}", flush=True)
                continue
            got = json.loads(lines[-1][7:])
            row.update({k: v for k, v in got.items() if k not in MODES})
            row[mode] = got[mode]
            if "skipped" in got[mode]:
                print(f"{case}/{mode}: SKIPPED: {got[mode]['skipped']}", flush=True)
                continue
            if mode == "timing":  # the report planner sizes --timing reads, beside the JSON
                report = timed_report_path(path.path, case)
                report.write_text(json.dumps(got[mode].pop("report"), indent=1, sort_keys=True) + "\n")
            print(
                f"{case}/{mode}: " + json.dumps({k: v for k, v in got[mode].items() if k != "report"})[:600], flush=True
            )
        res["cases"][case] = row
        path.write(res)  # after every case: a time limit keeps them
    parts = []
    for case, row in res["cases"].items():
        ex, lp = row.get("executor", {}), row.get("loop", {})
        bits = [case]
        if "drop_mib" in ex:
            it = ex["items_mib"]
            bits.append(
                f"exec drop {ex['drop_mib']:.0f} (pool {it['pool']:.0f} held {it['allocator-held']:.0f} "
                f"cached {it['allocator-cached']:.0f} outside {it['outside-allocator']:.0f})"
            )
        if "drop_mib" in lp:
            bits.append(f"loop {lp['drop_mib']:.0f}")
        for mode in ("startup", "startup-cached"):
            st = row.get(mode, {})
            if "error" in st and isinstance(st["error"], float):
                bits.append(
                    f"{mode}{'' if st.get('source') != 'recorded' or mode == 'startup' else ' (recorded)'} "
                    f"peak err {st['error']:+.2%} final {st['final_error_mib']:+.0f} MiB "
                    f"steps ok {st['steps_within_1pct_or_2mib']} above {st.get('steps_above')} "
                    f"slack {st['slack_mib']:.0f} "
                    f"predict {st['predict_s']:.3f}s/capture {st['capture_s']:.2f}s"
                )
        added = startup_added(row)
        if added is not None:
            bits.append(f"startup adds {added['added_s']:+.2f}s of capture alone {added['capture_alone_s']:.2f}s")
        on, off = row.get("reuse", {}), row.get("reuse-off", {})
        for name, r in (("reuse", on), ("reuse-off", off)):
            if "graph_exec_mib" in r:
                bits.append(
                    f"{name} execs {r['instantiations']}/{r['graphs']} graph-exec {r['graph_exec_mib']:.0f} MiB "
                    f"drop {r['drop_mib']:.0f} capture {r['capture_s']:.2f}s wrong {r['wrong_replays']} "
                    f"verify {'ok' if r['verify_ok'] else 'FAULTS'}"
                )
        tm = row.get("timing", {}).get("replay_ms")
        if tm:
            bits.append(f"replays {len(tm)} graphs {min(tm.values()):.3f}-{max(tm.values()):.3f} ms")
        vl = row.get("vllm", {})
        if "estimate_mib" in vl:
            bits.append(
                f"vllm {vl['estimate_mib']:.0f} / capture {vl['vllm_capture_drop_mib']:.0f} err {vl['error']:+.1%}"
            )
        v4 = row.get("vllm-0.34", {})
        if "vllm_capture_drop_mib" in v4:
            bits.append(
                f"vllm 0.34 capture {v4['vllm_capture_drop_mib']:.0f} plan {v4['plan_capture_mib']:.0f}"
                f"{'' if v4['plan_capture_complete'] else '+'} estimator {v4['estimate_mib']:.0f} (extensible: 0)"
                + (
                    f" pool {v4['vllm_pool_mib']:.0f} plan pool {v4['plan_pool_mib']:.0f}"
                    if "vllm_pool_mib" in v4
                    else ""
                )
            )
        sg = row.get("sglang", {})
        if "reserve_mib" in sg:
            bits.append(f"sglang reserve {sg['reserve_mib']:.0f}")
        parts.append(" ".join(bits))
    shutil.rmtree(cache, ignore_errors=True)
    print(f"wrote {path.path}")
    print("SUMMARY " + "; ".join(parts))


if __name__ == "__main__":
    main_exit(main)
