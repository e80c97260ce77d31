"""Speculative (EAGLE) benchmark on one GPU: the engines' loops against capture-plan.

Side by side in one process, on the speculative reference workload
(references/speculative.py: 32-layer Llama-3-8B-shaped target, one-layer draft
with its own lm_head, FA3), the four phases and the sizes of the checked-in
EAGLE plans:

  loop       every phase largest-first, outputs kept, 2 warm-ups per size,
             one pool shared by all phases (what the engines do)
  gate       the reverted CI gate: FA3 multi-token phases (target_verify,
             draft_extend) smallest-first, the others largest-first, outputs kept
  executor   capture(load_plan(P), target) for plans/fa3-eagle-ci.json and
             plans/fa3-eagle.json
  timing     capture seconds only, all four variants per round, the order
             rotated every round, --repeats rounds: medians (a single run's
             seconds move by +-30% with whoever runs first after a release)

For each: pool MiB per pool and in total, capture seconds per phase and in
total, every graph replayed against the eager run. For the executor also the
analytic and the trace-driven prediction per phase and per pool against
measured (the trace: the target phases at 3 sizes, the draft phases at every
size; written to --trace-dir, plans/traces/ by default), and verify() with
every check. Then the planted bugs: each caught
(graph, address range, bytes) at several sizes, also under smallest-first
order; the wild write in subprocesses (it kills the CUDA context).

The target is the harness's "eagle" case (``bench.harness.case_target``): its KV cache
length is sized for the device's free memory (512 tokens where it fits, as on an H200 or
an H100 80GB at 32 layers; shorter on a smaller card; recorded as ``max_seqlen``); where
not even the shortest cache fits, the parts that need the target are skipped, saying why
(``skipped``), and the planted bugs (a small model of their own) still run.

Writes JSON (date, device) to --out; prints SUMMARY last (what ran, where parts were skipped).
Run: python -m bench.speculative_bench [--layers 32] [--skip PARTS] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

from bench.harness import (
    REPO,
    MiB,
    add_layers,
    add_out_dir,
    add_overwrite,
    check_loop,
    eagle_config,
    engine_loop,
    fitted_target,
    header,
    main_exit,
    release,
    result_file,
)
from capture_plan.executor import capture, load_plan, profile, verify, write_trace
from capture_plan.executor.pool import pool_reserved
from capture_plan.planner import BuildOptions, build_plan, plan_bytes
from capture_plan.references.planted import planted_run, spec_toml

MULTI_TOKEN = ("target_verify", "draft_extend")
PARTS = ("loop", "gate", "executor", "timing", "bugs", "wild")
#: the parts that run the target model (the others build a small model of their own)
MODEL_PARTS = frozenset({"loop", "gate", "executor", "timing"})


def build_target(plan, layers: int):
    """The bench's target: the harness's "eagle" case for ``plan`` (its largest size),
    sized for this device (``bench.harness.fitted_target``): ``(model, None)``, or
    ``(None, why)`` where it does not fit."""
    return fitted_target("eagle", plan, layers)


def _order(sizes: dict, phases: list[str], ascending: dict) -> list[tuple[str, list[int]]]:
    """The loop's order: ``phases`` in turn, each largest-first unless ``ascending[phase]``."""
    return [(p, sorted(sizes[p], reverse=not ascending[p])) for p in phases]


def per_phase(report, plan) -> dict:
    """Pool growth and seconds per phase, measured and predicted, from the per-step report."""
    grown, pred, secs = defaultdict(int), defaultdict(int), defaultdict(float)
    prev_m = prev_p = 0
    for m in report.steps:
        phase = m.id.split("/")[1]
        grown[phase] += m.reserved - prev_m
        pred[phase] += m.predicted_reserved - prev_p
        secs[phase] += m.seconds
        prev_m, prev_p = m.reserved, m.predicted_reserved
    return {
        p.name: {"measured_mib": grown[p.name] / MiB, "predicted_mib": pred[p.name] / MiB, "capture_s": secs[p.name]}
        for p in plan.phases
    }


def per_pool(gs, plan) -> dict:
    return {
        pid: {"measured_mib": pool_reserved([h]) / MiB, "predicted_mib": plan.predicted.pools.get(pid, 0) / MiB}
        for pid, h in gs.pools.items()
    }


def check_graphs(gs, gen) -> tuple[int, int]:
    """Every graph at its full size and at a random padded size, against eager."""
    bad = n = 0
    for phase, bs in list(gs.graphs):
        for k in {bs, max(1, bs // 2 + 1)}:
            if gs.padded(phase, k) != bs:
                continue
            gs.target.prepare(phase, k, bs, gen)
            out = tuple(t.clone() for t in gs.replay(phase, k))
            ref = gs.eager(phase, k)
            bad += any(not torch.equal(a, b) for a, b in zip(out, ref))
            n += 1
    return bad, n


def executor_run(plan_path: Path, model, gen, out_dir: Path, trace_dir: Path) -> dict:
    plan = load_plan(plan_path)
    gs = capture(plan, model, progress=False)
    rep = gs.report
    res = {
        "pool_mib": rep.pool_bytes / MiB,
        "capture_s": rep.capture_seconds,
        "predicted_analytic_mib": plan.predicted.pool_bytes / MiB,
        "analytic_error": (plan.predicted.pool_bytes - rep.pool_bytes) / rep.pool_bytes,
        "phases": per_phase(rep, plan),
        "pools": per_pool(gs, plan),
    }
    bad, n = check_graphs(gs, gen)
    res["replays"], res["replays_not_equal_eager"] = n, bad
    gs.write_report(out_dir / f"report-{plan.name}.json")
    gs.release()

    # every check of verify needs the allocation history
    gs = capture(plan, model, progress=False, record=True)
    v = verify(gs)
    res["verify"] = v.summary()
    res["verify_faults"] = len(v.faults)
    res["verify_replays"] = v.replays
    gs.release()

    # exact prediction from a recorded trace of the same plan: the target
    # phases at the profiler's default sizes (the fitter derives the rest),
    # the draft phases at every size -- torch.topk's scratch over the vocabulary
    # is not affine in the batch (the fitter refuses 3 sizes and says so)
    drafts = {
        s.phase for s in plan.steps if s.op == "capture" and model.kind(s.phase) in ("draft_decode", "draft_extend")
    }
    sizes = {ph: sorted({s.bs for s in plan.steps if s.op == "capture" and s.phase == ph}) for ph in drafts}
    trace = profile(plan, model, sizes=sizes)
    tpath = trace_dir / f"{plan.name}.json"
    write_trace(trace, tpath)
    tplan = build_plan(
        BuildOptions(backend=plan.inputs.backend, ci=plan.inputs.ci, speculative=plan.inputs.speculative, trace=tpath)
    )
    gs = capture(tplan, model, progress=False)
    res["trace"] = {
        "recorded": {c.phase: sum(1 for d in trace.captures if d.phase == c.phase) for c in trace.captures},
        "trace_bytes": tpath.stat().st_size,
        "predicted_mib": tplan.predicted.pool_bytes / MiB,
        "pool_mib": gs.report.pool_bytes / MiB,
        "error": (tplan.predicted.pool_bytes - gs.report.pool_bytes) / gs.report.pool_bytes,
        "phases": per_phase(gs.report, tplan),
        "pools": per_pool(gs, tplan),
    }
    gs.release()
    return res


def timing(model, sizes, engine_order, variants, repeats: int) -> dict:
    """Capture seconds only, every variant once per round, the order rotated
    each round (whoever runs first after a release pays for it): medians.
    One process; nothing else measured in these runs."""
    runs: dict[str, list[float]] = defaultdict(list)
    names = [*variants, "fa3-eagle-ci.json", "fa3-eagle.json"]
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if name in variants:
                run = engine_loop(model, _order(sizes, engine_order, variants[name]), stop_at_oom=True)
                runs[name].append(run.seconds)
                release(run)
            else:
                gs = capture(load_plan(REPO / "plans" / name), model, progress=False)
                runs[name].append(gs.report.capture_seconds)
                gs.release()
                torch.cuda.empty_cache()
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "repeats": repeats,
        "runs_s": dict(runs),
        "median_s": med,
        "ratio_to_loop": {k: v / med["loop"] for k, v in med.items()},
    }


def floors(model, plan_path: Path) -> dict:
    """Each pool's floor: its phases' largest graph captured alone (max over its phases)."""
    plan = load_plan(plan_path)
    out: dict = {}
    for ph in plan.phases:
        run = engine_loop(model, [(ph.name, [max(ph.sizes)])], warmups=1, stop_at_oom=True)
        mib = pool_reserved([run.pool]) / MiB
        release(run)
        out[ph.pool] = max(out.get(ph.pool, 0.0), mib)
    return out


def _subprocess(bug: str, sizes, pins=(), checks=("interleave", "footprint"), record=True) -> dict:
    """One planted-bug run in its own process (a device fault ends the process's CUDA context)."""
    d = Path(tempfile.mkdtemp())  # kept: a device fault's sanitizer command re-runs from its plan
    (d / "spec.toml").write_text(spec_toml(list(sizes)))
    plan = build_plan(BuildOptions(backend="fa3", ci=True, spec=d / "spec.toml", strategies=tuple(pins)))
    (d / "plan.json").write_bytes(plan_bytes(plan))
    run = planted_run(d / "plan.json", (bug,), checks=tuple(checks), record=record, timeout=300)
    if run.result is None:
        return {"exit": run.exit, "line": run.failed or run.output[-800:]}
    faults = run.result["faults"]
    words = {w.strip(",:;()") for f in faults for w in f["detail"].split()}
    culprits = sorted(
        {f["graph"] for f in faults}
        | {w for w in words if w.count("/") == 1 and w.split("/")[0] in ("draft_decode", "draft_extend")}
    )
    return {
        "exit": run.exit,
        "faults": len(faults),
        "by_check": {c: sum(1 for f in faults if f["check"] == c) for c in {f["check"] for f in faults}},
        "graphs_named": culprits,
        "examples": [f"{f['check']}: graph {f['graph']}: {f['detail']}" for f in faults[:4]],
    }


def planted(sizes) -> dict:
    """Each in-pool bug under the planned order and under smallest-first (the reverted gate)."""
    out = {}
    for bug in ("kv-indices-topk", "page-table-scatter"):
        for order, pins in (("planned", ()), ("smallest-first", ("order=smallest-first",))):
            out[f"{bug}/{order}"] = _subprocess(bug, sizes, pins)
    return out


def wild(sizes) -> dict:
    return {str(bs): _subprocess("wild", [bs], checks=("interleave",), record=False) for bs in sizes}


def main() -> None:
    ap = argparse.ArgumentParser()
    add_layers(ap)
    add_out_dir(ap)
    ap.add_argument("--trace-dir", default=str(REPO / "plans/traces"))
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: loop,gate,executor,timing,bugs,wild")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the timing part (capture only, rotating order)")
    add_overwrite(ap)
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    res: dict = header(device=True)
    # a run that skips parts is named by the parts it ran
    path = result_file(
        args, "speculative", res["date"], f"{args.layers}l", *([p for p in PARTS if p not in skip] if skip else [])
    )
    out_dir, trace_dir = Path(args.out), Path(args.trace_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    trace_dir.mkdir(parents=True, exist_ok=True)

    ci_path = REPO / "plans/fa3-eagle-ci.json"
    ref = load_plan(ci_path)
    sizes = {p.name: sorted(p.sizes) for p in ref.phases}
    draft = next(p for p in ref.phases if p.kind == "draft_decode")
    cfg = eagle_config(args.layers, max(max(s) for s in sizes.values()))
    need_model = not MODEL_PARTS <= skip
    model, why = build_target(ref, args.layers) if need_model else (None, None)
    if why:  # the parts that need the target are skipped on this device, saying why
        res["skipped"] = why
        skip |= MODEL_PARTS
        need_model = False
        print(f"SKIPPED {', '.join(p for p in PARTS if p in MODEL_PARTS)}: {why}", flush=True)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    res.update(
        attention=model.backend if model else None,
        layers=args.layers,
        draft_layers=cfg.draft_layers,
        num_steps=cfg.num_steps,
        topk=cfg.topk,
        page_size=cfg.page_size,
        max_seqlen=model.cfg.max_seqlen if model else None,
        sizes_per_phase={k: len(v) for k, v in sizes.items()},
        draft_phase=draft.name,
    )

    def save() -> None:  # after every part: a run cut short keeps what it measured
        path.write(res)

    if need_model:
        for phase in sizes:  # lazy initialisation out of every measurement
            model.run(phase, 8, None)
        torch.cuda.synchronize()
        res["floors_mib"] = floors(model, ci_path)
        save()
    engine_order = [p for p in ("decode", "target_verify", "draft_decode", "draft_extend") if p in sizes]
    variants = {"loop": {p: False for p in engine_order}, "gate": {p: p in MULTI_TOKEN for p in engine_order}}
    for name, ascending in variants.items():
        if name in skip:
            continue
        run = engine_loop(model, _order(sizes, engine_order, ascending), stop_at_oom=True)
        res[name] = {
            "pool_mib": pool_reserved([run.pool]) / MiB,
            "capture_s": run.seconds,
            "phase_capture_s": run.phase_seconds,
            "oom_at": run.oom,
            "graphs": len(run.graphs),
        }
        res[name]["replays_not_equal_eager"] = check_loop(model, run, gen)
        release(run)
        save()
        print(name, json.dumps(res[name]), flush=True)

    if "executor" not in skip:
        for plan_file in ("fa3-eagle-ci.json", "fa3-eagle.json"):
            r = executor_run(REPO / "plans" / plan_file, model, gen, out_dir, trace_dir)
            res[plan_file] = r
            save()
            print(
                plan_file,
                json.dumps({k: r[k] for k in ("pool_mib", "capture_s", "analytic_error", "verify")}),
                flush=True,
            )

    if "timing" not in skip:
        res["timing"] = timing(model, sizes, engine_order, variants, args.repeats)
        save()
        print("timing", json.dumps(res["timing"]), flush=True)

    del model
    torch.cuda.empty_cache()
    if "bugs" not in skip:  # the small reference (2 layers), topk 4, page size 4, in subprocesses
        res["bugs"] = planted([1, 2, 4, 8, 16, 32, 64])
        save()
    if "wild" not in skip:
        res["wild"] = wild([4, 16, 64])

    save()
    print(json.dumps(res, indent=2, sort_keys=True)[:6000])
    tm = res.get("timing")
    if tm:
        print(
            "TIMING median capture s "
            + ", ".join(f"{k} {v:.2f} ({tm['ratio_to_loop'][k]:.2f}x)" for k, v in tm["median_s"].items())
            + f" over {tm['repeats']} rounds"
        )
    print(summary(res))


def summary(res: dict) -> str:
    """The SUMMARY line: the loop against the executor where both ran, else what each part
    that ran measured; the target's cache length, and the reason where its parts were
    skipped on this device."""
    ex = res.get("fa3-eagle-ci.json", {})
    loop = res.get("loop", {})
    fl = sum(res.get("floors_mib", {}).values())
    caught = {k: v.get("by_check", v.get("line")) for k, v in res.get("bugs", {}).items()}
    wild_ok = sum(
        1
        for v in res.get("wild", {}).values()
        if v["exit"] == 3 and "context is lost" in v["line"] and "compute-sanitizer" in v["line"]
    )
    target = f"SKIPPED ({res['skipped']})" if "skipped" in res else f"max_seqlen {res.get('max_seqlen')}"
    bugs = f"bugs: faults by check {caught}; wild named {wild_ok}/{len(res.get('wild', {}))}"
    if ex and loop:
        return (
            f"SUMMARY target {target}; pool MiB: loop {loop['pool_mib']:.0f} (oom at {loop['oom_at']}), gate "
            f"{res.get('gate', {}).get('pool_mib', float('nan')):.0f}, executor(ci) {ex['pool_mib']:.0f} "
            f"(floors {fl:.0f}: {ex['pool_mib'] / fl:.3f}x; {ex['pool_mib'] / loop['pool_mib']:.3f}x of loop); "
            f"capture s: loop {loop['capture_s']:.2f}, executor {ex['capture_s']:.2f} "
            f"({ex['capture_s'] / loop['capture_s']:.2f}x); pred err analytic {ex['analytic_error']:+.2%} "
            f"trace {ex['trace']['error']:+.2%}; replays bad: loop {loop['replays_not_equal_eager']}, "
            f"executor {ex['replays_not_equal_eager']}/{ex['replays']}; verify faults {ex['verify_faults']}; {bugs}"
        )
    ran = [f"target {target}"]
    if fl:
        ran.append(f"floors {fl:.0f} MiB")
    for name in ("loop", "gate"):
        if name in res:
            r = res[name]
            ran.append(
                f"{name} pool {r['pool_mib']:.0f} MiB (oom at {r['oom_at']}), {r['graphs']} graphs in "
                f"{r['capture_s']:.2f} s, replays bad {r['replays_not_equal_eager']}"
            )
    if ex:
        ran.append(
            f"executor(ci) pool {ex['pool_mib']:.0f} MiB in {ex['capture_s']:.2f} s, pred err analytic "
            f"{ex['analytic_error']:+.2%}, verify faults {ex['verify_faults']}"
        )
    if "bugs" in res or "wild" in res:
        ran.append(bugs)
    return "SUMMARY " + "; ".join(ran)


if __name__ == "__main__":
    main_exit(main)
