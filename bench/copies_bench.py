"""A start-up prediction's graph copies: made in turn against side by side (one thread per graph).

For each case and way, a fresh process (random weights; the cases of ``bench.device_bench``)
records the prediction's default sizes of every phase (three per phase, as
``predict_startup``'s first recording does: ``capture_plan.executor.profiling.subset_plan``),
then makes each phase's copies, as many as the plan captures less the recorded graphs, with
``capture_plan.executor.graph_nodes.ExecCopies``:

* ``in-turn``: one copy after another (``add`` with a ``done`` that never stops them: the way
  ``copy_error`` makes them);
* ``side-by-side``: ``add`` as a prediction calls it, one thread per recorded graph.

Per phase it writes the copies' seconds and the free memory they took outside the caching
allocator (both ways must take the same: the prediction's figure); per process, the seconds
``ExecCopies.close`` took to destroy every copy, in turn (``destroy_seconds``: a prediction
waits for it too). The ways alternate,
``--repeat`` times each, so that a machine's drift falls on both.

A case's model is sized for the device (``bench.harness.case_target``); a case that does not
fit is skipped, saying why (``skipped``, on the summary line).

Writes bench/results/copies-<date>[-tag].json; prints one line per process and a summary line
last. Run: python -m bench.copies_bench [--cases reference,eagle] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.harness import (
    MiB,
    add_out_dir,
    add_overwrite,
    case_options,
    fitted_target,
    header,
    main_exit,
    result_file,
    run_module,
)

WAYS = ("in-turn", "side-by-side")


def child(case: str, way: str) -> dict:
    import torch

    from capture_plan.adapters.startup_figures import captures_per_phase
    from capture_plan.executor import capture
    from capture_plan.executor.graph_nodes import ExecCopies, node_count
    from capture_plan.executor.profiling import subset_plan
    from capture_plan.planner import build_plan

    plan = build_plan(case_options(case, Path(tempfile.mkdtemp())))
    target, why = fitted_target(case, plan)
    if why:
        return {"case": case, "way": way, "skipped": why}
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    for p in plan.phases:
        top = max(p.sizes)
        target.prepare(p.name, top, top, gen)
    gs = capture(subset_plan(plan), target, progress=False, record=True)
    planned = captures_per_phase(plan)  # as a prediction asks its copies for (adapters/startup.py)
    held = ExecCopies()
    phases = {}
    try:
        for p in plan.phases:
            graphs = [c.graph for c in gs.graphs.values() if c.phase == p.name]
            want = planned[p.name] - len(graphs)
            torch.cuda.synchronize()
            free0, res0 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
            t0 = time.perf_counter()
            made, nodes = held.add(graphs, want, (lambda m, n: False) if way == "in-turn" else None)
            seconds = time.perf_counter() - t0
            torch.cuda.synchronize()
            took = (free0 - torch.cuda.mem_get_info()[0]) - (torch.cuda.memory_reserved() - res0)
            phases[p.name] = {
                "graphs": len(graphs),
                "graph_nodes": [node_count(g) for g in graphs],
                "copies": made,
                "nodes": nodes,
                "seconds": seconds,
                "took_bytes": took,
            }
    finally:
        # the destruction, timed on its own: a prediction waits for it too (in turn: ExecCopies.close)
        t0 = time.perf_counter()
        held.close()
        destroy = time.perf_counter() - t0
        gs.release()
    return {
        "case": case,
        "way": way,
        "seconds": sum(r["seconds"] for r in phases.values()),
        "destroy_seconds": destroy,
        "phases": phases,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="reference,eagle")
    ap.add_argument("--repeat", type=int, default=3, help="processes per case and way, alternating")
    ap.add_argument("--tag", default="")
    add_out_dir(ap)
    add_overwrite(ap)
    ap.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(*args.child)), flush=True)
        return
    res: dict = header(device=True)
    path = result_file(args, "copies", res["date"], args.tag)
    res.update(repeat=args.repeat, cases={})
    for case in args.cases.split(","):
        runs: dict[str, list] = {w: [] for w in WAYS}
        for _ in range(args.repeat):
            for way in WAYS:
                p = run_module("copies_bench", ["--child", case, way], capture_output=True, text=True)
                lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
                if p.returncode or not lines:
                    runs[way].append({"error": (p.stderr or p.stdout)[-1500:]})
                    print(f"{case}/{way}: FAILED\n{runs[way][-1]['error']}", flush=True)
                    continue
                r = json.loads(lines[-1][7:])
                runs[way].append(r)
                if "skipped" in r:
                    print(f"{case}/{way}: SKIPPED: {r['skipped']}", flush=True)
                    continue
                took = sum(ph["took_bytes"] for ph in r["phases"].values())
                print(
                    f"{case}/{way}: {r['seconds']:.3f} s, {took / MiB:.0f} MiB, "
                    f"destroyed in {r['destroy_seconds']:.3f} s",
                    flush=True,
                )
            if any("skipped" in r for rs in runs.values() for r in rs):
                break  # the case does not fit this device: another process would not either
        res["cases"][case] = runs
        path.write(res)
    print(f"wrote {path.path}")
    print("SUMMARY " + "; ".join(summary(case, runs) for case, runs in res["cases"].items()))


def summary(case: str, runs: dict[str, list]) -> str:
    """The median seconds of each way, their ratio, and whether every process of either way
    took the same driver memory per phase; or why the case was skipped on this device."""
    skipped = next((r["skipped"] for rs in runs.values() for r in rs if "skipped" in r), None)
    if skipped:
        return f"{case}: SKIPPED: {skipped}"
    ok = {w: [r for r in rs if "phases" in r] for w, rs in runs.items()}
    if not all(ok.values()):
        return f"{case}: a way failed in every process"
    med = {w: statistics.median(r["seconds"] for r in rs) for w, rs in ok.items()}
    took = {
        json.dumps({n: ph["took_bytes"] for n, ph in r["phases"].items()}, sort_keys=True)
        for rs in ok.values()
        for r in rs
    }
    same = "the same driver memory per phase in every process" if len(took) == 1 else "driver memory differs"
    return (
        f"{case}: copies in turn {med['in-turn']:.3f} s, side by side {med['side-by-side']:.3f} s "
        f"({med['side-by-side'] / med['in-turn']:.2f}x, medians of {len(ok['in-turn'])} and "
        f"{len(ok['side-by-side'])}), {same}"
    )


if __name__ == "__main__":
    main_exit(main)
