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

Writes JSON (with date and device) to --out (default bench/results/).
Run: python bench/capture_bench.py [--layers 32] [--plan plans/fa3-ci.json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from capture_plan.executor import capture, load_plan, profile, verify, write_trace  # noqa: E402
from capture_plan.executor.pool import pool_reserved  # noqa: E402
from capture_plan.references.decode import ReferenceConfig, ReferenceModel  # noqa: E402
from capture_plan.schemas.spec import Model  # noqa: E402

MiB = 2**20


def loop_capture(model, sizes, ascending: bool, warmups: int = 2):
    """The engines' hard-coded loop, via torch.cuda.graph (one shared pool, outputs kept)."""
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream()
    graphs, outs = {}, {}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for bs in sorted(sizes, reverse=not ascending):
        with torch.cuda.stream(stream):
            for _ in range(warmups):
                model.run("decode", bs, None)
        stream.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool, stream=stream):
            outs[bs] = model.run("decode", bs, None)
        graphs[bs] = g
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return graphs, outs, pool, seconds


class Replay(NamedTuple):
    """One replay of :func:`replays_vs_eager`."""

    bs: int
    #: the replay's outputs equal an eager run's on the same inputs, bit for bit
    equal: bool
    #: that eager run equals a second one (True where no second one ran)
    eager_equal: bool
    #: max |replay - eager| (0.0 where equal)
    max_abs_diff: float


def replays_vs_eager(model, graphs, outs, gen, rounds: int = 1, eager_twice: bool = False) -> list[Replay]:
    """Replay every graph of :func:`loop_capture` ``rounds`` times, each on
    fresh inputs (``model.prepare`` for ``bs`` requests), against an eager run
    of the same inputs; with ``eager_twice`` also that eager run against a
    second one (eager runs that differ: a nondeterministic kernel, not a
    capture fault). Compares the decode phase's one output; does not release
    anything."""
    rows = []
    for _ in range(rounds):
        for bs, g in graphs.items():
            model.prepare("decode", bs, bs, gen)
            g.replay()
            got = outs[bs].clone()
            ref = model.run("decode", bs, None)
            again = True
            if eager_twice:
                ref = ref.clone()  # an eager run may return a buffer the next one reuses
                again = torch.equal(ref, model.run("decode", bs, None))
            equal = torch.equal(got, ref)
            diff = 0.0 if equal else float((got.float() - ref.float()).abs().max())
            rows.append(Replay(bs, equal, again, diff))
    return rows


def check_loop(model, graphs, outs, gen) -> int:
    """Graphs whose replay differs from the eager run of the same inputs."""
    return sum(not r.equal for r in replays_vs_eager(model, graphs, outs, gen))


def release(*objs):
    for o in objs:
        if isinstance(o, dict):
            for g in o.values():
                if isinstance(g, torch.cuda.CUDAGraph):
                    g.reset()
            o.clear()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


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
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--plan", default=str(ROOT / "plans/fa3-ci.json"))
    ap.add_argument("--out", default=str(ROOT / "bench/results"))
    ap.add_argument("--trace-out", default=None, help="also write the recorded trace here")
    args = ap.parse_args()

    plan = load_plan(args.plan)
    sizes = plan.phases[0].sizes
    cfg = ReferenceConfig(model=Model(layers=args.layers), max_bs=max(sizes))
    model = ReferenceModel(cfg)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    res: dict = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "attention": model.backend,
        "layers": args.layers,
        "sizes": len(sizes),
        "plan": Path(args.plan).name,
        "plan_digest": plan.digest,
    }

    # warm every kernel once so the first variant does not pay lazy initialisation
    model.run("decode", max(sizes), None)
    torch.cuda.synchronize()

    graphs, outs, pool, _ = loop_capture(model, [max(sizes)], ascending=False, warmups=1)
    res["alone"] = {"pool_mib": pool_reserved([pool]) / MiB}
    release(graphs, outs)

    for name, asc in (("sglang", False), ("ascending", True)):
        graphs, outs, pool, secs = loop_capture(model, sizes, ascending=asc)
        res[name] = {
            "pool_mib": pool_reserved([pool]) / MiB,
            "capture_s": secs,
            "replays_not_equal_eager": check_loop(model, graphs, outs, gen),
            "replays": len(graphs),
        }
        release(graphs, outs)
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
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"capture-{res['date'][:10]}-{args.layers}l.json"
    path.write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")
    print(json.dumps(res, indent=2, sort_keys=True))
    print(
        f"SUMMARY pool MiB: sglang {base['pool_mib']:.0f}, ascending {res['ascending']['pool_mib']:.0f}, "
        f"executor {res['executor']['pool_mib']:.0f} (alone {res['alone']['pool_mib']:.0f}); capture s: "
        f"sglang {base['capture_s']:.2f}, executor {res['executor']['capture_s']:.2f}; "
        f"pred err analytic {res['executor']['analytic_error']:+.1%} trace {res['executor']['trace_error']:+.1%}; "
        f"overhead {res['replay_overhead']['overhead_us']:.2f} us; verify all checks: "
        f"{res['executor']['verify_all_faults']} fault(s)"
    )


if __name__ == "__main__":
    main()
