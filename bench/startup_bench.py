"""Start-up benchmark on one GPU: capture inside an engine-sized Python heap, and serving while capturing.

On the reference workload (32-layer Llama-3-8B shape, FA3 if importable),
with ``plans/fa3-ci.json`` (36 sizes) and a plan built here from SGLang's
speculative size list up to 256 (51 sizes, one decode phase):

  background  ``capture(plan, model, background=True)`` while a serving loop
              replays random batches on its own stream: time from the call to
              the first replay served by a graph and to every graph captured;
              replays per second during the capture against after it; in a
              second run every replay is compared with the eager run at the
              same padded size; the pool against a foreground capture; verify.
  heap        the engines' loop (``bench.harness.engine_loop``: largest-first,
              2 warm-ups, ``torch.cuda.graph`` per size) and the executor
              (``capture`` + ``release``), whole wall time of each, first in
              this small process, then again after building an engine-sized
              heap (``--objects`` live, collector-tracked Python objects; a
              full ``gc.collect()`` is timed there too: what capture and
              release each paid before).

The model is the harness's "reference" case (``bench.harness.case_target``) for 256
requests: its KV cache length is sized for the device's free memory (recorded as
``max_seqlen``); where not even the shortest cache fits, the run records and prints why
(``skipped``) and measures nothing.

Writes JSON (with date and device) to --out (a directory; default
bench/results/) and prints a one-line summary last.
Run: python -m bench.startup_bench [--layers 32] [--objects 10000000] [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.harness import (
    REPO,
    MiB,
    add_layers,
    add_out_dir,
    add_overwrite,
    engine_loop,
    fitted_target,
    header,
    largest_first,
    main_exit,
    release,
    result_file,
)
from capture_plan.executor import capture, load_plan, verify

#: SGLang's capture sizes with speculative decoding, up to 256
SPECULATIVE = [*range(1, 9), *range(10, 33, 2), *range(40, 65, 4), *range(72, 257, 8)]
#: the requests the model is sized for: the largest size of both plans
MAX_BS = 256


def build_target(layers: int):
    """The bench's model: the harness's "reference" case for :data:`MAX_BS` requests,
    sized for this device (``bench.harness.fitted_target``): ``(model, None)``, or
    ``(None, why)`` where it does not fit."""
    return fitted_target("reference", None, layers, max_bs=MAX_BS)


def speculative_plan(layers: int):
    from capture_plan.planner import BuildOptions, build_plan

    spec = Path(tempfile.mkdtemp()) / "speculative-sizes.toml"
    spec.write_text(
        f'[model]\npreset = "llama-3-8b"\nlayers = {layers}\n\n'
        f'[[phases]]\nname = "decode"\nkind = "decode"\nsizes = {SPECULATIVE}\n'
    )
    return build_plan(BuildOptions(backend="fa3", ci=True, spec=spec))


def engine_heap(objects: int) -> list:
    """Live, collector-tracked objects shaped like request state and metadata."""
    return [{"rid": i, "tokens": [i]} if i % 3 == 0 else [i, str(i)] for i in range(objects)]


def timed_capture(plan, model) -> dict:
    """Whole wall time of capture() and of release()."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    gs = capture(plan, model, progress=False)
    wall = time.perf_counter() - t0
    pool = gs.report.pool_bytes
    reported = gs.report.capture_seconds
    t0 = time.perf_counter()
    gs.release()
    return {
        "capture_wall_s": wall,
        "report_capture_s": reported,
        "release_s": time.perf_counter() - t0,
        "pool_mib": pool / MiB,
    }


def timed_loop(model, sizes) -> dict:
    t0 = time.perf_counter()
    run = engine_loop(model, largest_first([("decode", sizes)]))
    wall = time.perf_counter() - t0
    release(run)
    return {"capture_wall_s": wall, "loop_s": run.seconds}


def background_run(plan, model, serve, *, check: bool, seed: int = 0) -> dict:
    """Serve decode replays on ``serve`` while ``plan`` captures in the background."""
    limit = max(plan.phases[0].sizes)
    rng = random.Random(seed)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    during: list[tuple[float, bool]] = []  # (seconds since capture(), served by a graph)
    not_equal = checked = 0
    with torch.cuda.stream(serve):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gs = capture(plan, model, progress=False, background=True)
        returned = time.perf_counter() - t0
        while not gs.done:
            n = rng.randint(1, limit)
            with gs.exclusive():
                if check:
                    model.prepare("decode", n, limit, gen)
                res = gs.replay("decode", n)
                graph = res[0]._base is not None  # graph outputs are views of the bs-row outputs
                if check:
                    bs = res[0]._base.shape[0] if graph else n
                    got = res[0].clone()
                    ref = model.run("decode", bs, None)[:n]
                    not_equal += not torch.equal(got, ref)
                    checked += 1
                del res
            serve.synchronize()
            during.append((time.perf_counter() - t0, graph))
        gs.wait()
        total = gs.background.seconds
        after_n = max(len(during), 200)
        t1 = time.perf_counter()
        for _ in range(after_n):
            gs.replay("decode", rng.randint(1, limit))
            serve.synchronize()
        after_s = time.perf_counter() - t1
    first = next((t for t, g in during if g), None)
    graph_times = [t for t, g in during if g]
    span = (graph_times[-1] - graph_times[0]) if len(graph_times) > 1 else 0.0
    out = {
        "returned_s": returned,
        "first_servable_replay_s": first,
        "first_graph_s": gs.timeline[0][0],
        "all_captured_s": gs.timeline[-1][0],
        "capture_thread_s": total,
        "replays_during": len(during),
        "graph_replays_during": len(graph_times),
        "fallback_replays_during": len(during) - len(graph_times),
        "graph_replays_per_s_during": (len(graph_times) - 1) / span if span else None,
        "replays_per_s_after": after_n / after_s,
        "pool_mib": gs.report.pool_bytes / MiB,
        "report_capture_s": gs.report.capture_seconds,
    }
    if check:
        out["checked"], out["not_equal_eager"] = checked, not_equal
        v = verify(gs, checks=("interleave",))
        out["verify"], out["verify_faults"] = v.summary(), len(v.faults)
    gs.release()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    add_layers(ap)
    ap.add_argument("--objects", type=int, default=10_000_000, help="live Python objects of the engine-sized heap")
    ap.add_argument("--plan", default=str(REPO / "plans/fa3-ci.json"))
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per variant (median reported)")
    add_out_dir(ap)
    add_overwrite(ap)
    args = ap.parse_args()
    res: dict = header(device=True)
    out = result_file(args, "startup", res["date"], f"{args.layers}l")

    plans = {"fa3-ci": load_plan(args.plan), "speculative-51": speculative_plan(args.layers)}
    res.update(
        python=sys.version.split()[0],
        layers=args.layers,
        objects=args.objects,
        plans={k: {"sizes": len(p.phases[0].sizes), "digest": p.digest} for k, p in plans.items()},
    )
    model, why = build_target(args.layers)
    if why:  # nothing here runs without the model: the run says why and records it
        res["skipped"] = why
        out.write(res)
        print(f"SUMMARY SKIPPED: {why}")
        return
    res.update(attention=model.backend, max_seqlen=model.cfg.max_seqlen)
    model.run("decode", MAX_BS, None)  # every kernel once: no variant pays lazy initialisation
    serve = torch.cuda.Stream()
    with torch.cuda.stream(serve):
        model.run("decode", 4, None)  # cuBLAS on the serving stream before any capture
    torch.cuda.synchronize()

    res["background"] = {}
    for name, plan in plans.items():
        fg = timed_capture(plan, model)
        checked = background_run(plan, model, serve, check=True)
        fast = background_run(plan, model, serve, check=False, seed=1)
        res["background"][name] = {
            "foreground": fg,
            "checked": checked,
            "throughput": fast,
            "first_vs_foreground": fast["first_servable_replay_s"] / fg["capture_wall_s"]
            if fast["first_servable_replay_s"]
            else None,
        }
        print(name, json.dumps(res["background"][name]), flush=True)

    def measure(label: str) -> dict:
        out = {}
        for name, plan in plans.items():
            sizes = plan.phases[0].sizes
            runs = [timed_capture(plan, model) for _ in range(args.repeats)]
            loops = [timed_loop(model, sizes) for _ in range(args.repeats)]
            out[name] = {
                "executor": {k: statistics.median(r[k] for r in runs) for k in runs[0]},
                "loop": {k: statistics.median(r[k] for r in loops) for k in loops[0]},
            }
            print(label, name, json.dumps(out[name]), flush=True)
        return out

    res["small_heap"] = measure("small")
    t0 = time.perf_counter()
    heap = engine_heap(args.objects)
    res["heap_build_s"] = time.perf_counter() - t0
    res["tracked_objects"] = len(gc.get_objects())
    t0 = time.perf_counter()
    gc.collect()
    res["full_gc_s"] = time.perf_counter() - t0
    res["engine_heap"] = measure("engine-heap")
    del heap

    res["ratios"] = {
        name: {
            "executor_heap_vs_small": res["engine_heap"][name]["executor"]["capture_wall_s"]
            / res["small_heap"][name]["executor"]["capture_wall_s"],
            "loop_heap_vs_small": res["engine_heap"][name]["loop"]["capture_wall_s"]
            / res["small_heap"][name]["loop"]["capture_wall_s"],
        }
        for name in plans
    }
    print(f"wrote {out.write(res)}")
    parts = []
    for name in plans:
        b, s, h = res["background"][name], res["small_heap"][name], res["engine_heap"][name]
        t = b["throughput"]
        parts.append(
            f"{name}: capture wall small/heap executor {s['executor']['capture_wall_s']:.2f}/"
            f"{h['executor']['capture_wall_s']:.2f} s (x{res['ratios'][name]['executor_heap_vs_small']:.2f}), "
            f"release {h['executor']['release_s']:.2f} s, loop {s['loop']['capture_wall_s']:.2f}/"
            f"{h['loop']['capture_wall_s']:.2f} s; background first servable {t['first_servable_replay_s'] or 0:.3f} s "
            f"of {t['all_captured_s']:.2f} s ({(b['first_vs_foreground'] or 0):.0%} of foreground), replays/s "
            f"during {t['graph_replays_per_s_during'] or 0:.0f} after {t['replays_per_s_after']:.0f}, "
            f"{b['checked']['not_equal_eager']}/{b['checked']['checked']} != eager, pool "
            f"{t['pool_mib']:.0f}/{b['foreground']['pool_mib']:.0f} MiB, {b['checked']['verify_faults']} fault(s)"
        )
    print(
        f"SUMMARY max_seqlen {res['max_seqlen']}, objects {args.objects:,} (full gc {res['full_gc_s']:.2f} s); "
        + " | ".join(parts)
    )


if __name__ == "__main__":
    main_exit(main)
