"""Capture benchmark on one GPU: the engines' loop against capture-plan.

Side by side in one process, on the reference workload (32-layer Llama-3-8B
shape, FA3, float32 logits), with the sizes of the checked-in plan:

  alone      the largest size captured by itself (the floor)
  sglang     largest-first, outputs kept, 2 warm-ups per size, torch.cuda.graph
  ascending  smallest-first, outputs kept, 2 warm-ups per size (the reverted gate)
  executor   capture(load_plan(PLAN), target)

For each: pool MiB (sum of the pool's segments), capture seconds, every
replay compared with the eager run; for the executor also the analytic and
trace-driven predictions and verify(); and the host overhead of
GraphSet.replay over a bare CUDAGraph.replay on a tiny graph.

The model is the harness's "reference" case (``bench.harness.case_target``) for the plan's
largest size: its KV cache length is sized for the device's free memory (recorded as
``max_seqlen``); where not even the shortest cache fits, the run records and prints why
(``skipped``) and measures nothing.

Writes JSON (with date and device) to --out (default bench/results/) and prints SUMMARY last.
Run: python -m bench.capture_bench [--layers 32] [--plan plans/fa3-ci.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.harness import (
    REPO,
    MiB,
    add_layers,
    add_out_dir,
    add_overwrite,
    check_loop,
    engine_loop,
    fitted_target,
    header,
    largest_first,
    main_exit,
    release,
    result_file,
)
from capture_plan.executor import capture, load_plan, profile, verify, write_trace
from capture_plan.executor.pool import pool_reserved


def build_target(plan, layers: int):
    """The bench's model: the harness's "reference" case at the largest size of ``plan``'s
    first phase, sized for this device (``bench.harness.fitted_target``): ``(model, None)``,
    or ``(None, why)`` where it does not fit."""
    return fitted_target("reference", plan, layers, max_bs=max(plan.phases[0].sizes))


class Tiny:
    """A one-kernel target for measuring dispatch overhead."""

    def __init__(self):
        self.x = torch.zeros(256, 16, device="cuda")

    def run(self, phase, bs, ws):
        return self.x[:bs] + 1

    def prepare(self, phase, n, bs, gen):
        self.x.normal_(generator=gen)

    def refresh(self, phase, n, bs, ws):
        pass


def replay_overhead(calls: int = 5000, repeats: int = 7) -> dict:
    import tempfile

    from capture_plan.planner import BuildOptions, build_plan  # CPU planner, present on the device too

    spec = Path(tempfile.mkdtemp()) / "tiny.toml"
    spec.write_text('[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]\n')
    plan = build_plan(BuildOptions(backend="torch", spec=spec))
    target = Tiny()
    gs = capture(plan, target, progress=False)
    g = gs.graphs[("decode", 256)].graph
    bare, ours = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            g.replay()
        torch.cuda.synchronize()
        bare.append((time.perf_counter() - t0) / calls)
        t0 = time.perf_counter()
        for _ in range(calls):
            gs.replay("decode", 200)
        torch.cuda.synchronize()
        ours.append((time.perf_counter() - t0) / calls)
    gs.release()
    b, o = statistics.median(bare), statistics.median(ours)
    return {
        "bare_us": b * 1e6,
        "graphset_us": o * 1e6,
        "overhead_us": (o - b) * 1e6,
        "calls": calls,
        "repeats": repeats,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    add_layers(ap)
    ap.add_argument("--plan", default=str(REPO / "plans/fa3-ci.json"))
    add_out_dir(ap)
    ap.add_argument("--trace-out", default=None, help="also write the recorded trace here")
    add_overwrite(ap)
    args = ap.parse_args()

    res: dict = header(device=True)
    out = result_file(args, "capture", res["date"], f"{args.layers}l")
    plan = load_plan(args.plan)
    sizes = plan.phases[0].sizes
    res.update(layers=args.layers, sizes=len(sizes), plan=Path(args.plan).name, plan_digest=plan.digest)
    model, why = build_target(plan, args.layers)
    if why:  # nothing here runs without the model: the run says why and records it
        res["skipped"] = why
        out.write(res)
        print(f"SUMMARY SKIPPED: {why}")
        return
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    res.update(attention=model.backend, max_seqlen=model.cfg.max_seqlen)

    # warm every kernel once so the first variant does not pay lazy initialisation
    model.run("decode", max(sizes), None)
    torch.cuda.synchronize()

    run = engine_loop(model, [("decode", [max(sizes)])], warmups=1)
    res["alone"] = {"pool_mib": pool_reserved([run.pool]) / MiB}
    release(run)

    for name, asc in (("sglang", False), ("ascending", True)):
        run = engine_loop(model, largest_first([("decode", sizes)], ascending=asc))
        res[name] = {
            "pool_mib": pool_reserved([run.pool]) / MiB,
            "capture_s": run.seconds,
            "replays_not_equal_eager": check_loop(model, run, gen),
            "replays": len(run.graphs),
        }
        release(run)
        print(name, res[name], flush=True)

    gs = capture(plan, model)
    rep = gs.report
    gs.write_report(Path(args.out) / f"report-{plan.name}.json")
    v = verify(gs, checks=("interleave",), rounds=1)
    res["executor"] = {
        "pool_mib": rep.pool_bytes / MiB,
        "capture_s": rep.capture_seconds,
        "predicted_analytic_mib": plan.predicted.pool_bytes / MiB,
        "analytic_error": (plan.predicted.pool_bytes - rep.pool_bytes) / rep.pool_bytes,
        "replays": v.replays,
        "replays_not_equal_eager": len(v.faults),
        "verify": v.summary(),
    }
    gs.release()

    # all three checks (footprint guard needs the allocation history)
    gs = capture(plan, model, progress=False, record=True)
    full = verify(gs)
    res["executor"]["verify_all"] = full.summary()
    res["executor"]["verify_all_faults"] = len(full.faults)
    gs.release()

    # exact prediction: record the trace, plan from it, capture again
    trace = profile(plan, model)
    trace_path = Path(args.trace_out or (Path(args.out) / "trace.json"))
    write_trace(trace, trace_path)
    from capture_plan.planner import BuildOptions, build_plan

    tplan = build_plan(BuildOptions(backend=plan.inputs.backend, ci=plan.inputs.ci, trace=trace_path))
    gs = capture(tplan, model, progress=False)
    res["executor"]["predicted_trace_mib"] = tplan.predicted.pool_bytes / MiB
    res["executor"]["trace_error"] = (tplan.predicted.pool_bytes - gs.report.pool_bytes) / gs.report.pool_bytes
    res["executor"]["trace_plan_pool_mib"] = gs.report.pool_bytes / MiB
    gs.release()

    res["replay_overhead"] = replay_overhead()
    base = res["sglang"]
    res["ratios"] = {
        "pool_vs_sglang": res["executor"]["pool_mib"] / base["pool_mib"],
        "pool_vs_alone": res["executor"]["pool_mib"] / res["alone"]["pool_mib"],
        "capture_time_vs_sglang": res["executor"]["capture_s"] / base["capture_s"],
    }
    out.write(res)
    print(json.dumps(res, indent=2, sort_keys=True))
    print(
        f"SUMMARY max_seqlen {res['max_seqlen']}; pool MiB: sglang {base['pool_mib']:.0f}, "
        f"ascending {res['ascending']['pool_mib']:.0f}, "
        f"executor {res['executor']['pool_mib']:.0f} (alone {res['alone']['pool_mib']:.0f}); capture s: "
        f"sglang {base['capture_s']:.2f}, executor {res['executor']['capture_s']:.2f}; "
        f"pred err analytic {res['executor']['analytic_error']:+.1%} trace {res['executor']['trace_error']:+.1%}; "
        f"overhead {res['replay_overhead']['overhead_us']:.2f} us; verify all checks: "
        f"{res['executor']['verify_all_faults']} fault(s)"
    )


if __name__ == "__main__":
    main_exit(main)
