"""What instantiated CUDA graphs take from free memory outside the caching allocator.

For each case (a fresh process each, random weights; the cases of
``bench.device_bench``): one eager run at the largest size, as ``capture()``
warms up, then every planned size largest-first into one pool, recorded with
``keep_graph=True`` (``bench.harness.engine_loop(driver_memory=True)``), and after each

* the driver memory the *recording* took (free-memory drop minus the caching
  allocator's growth) and, separately, what its *instantiation* took;
* the graph's nodes (``capture_plan.executor.graph_nodes``).

Then every graph is destroyed and the cache emptied (what comes back), and
every size is captured again (what the second round takes). The per-node
figure, the instantiations' driver bytes over their nodes, is what
``planner/data/devices.toml [graph_exec_per_node]`` lists.

A case's model is sized for the device (``bench.harness.case_target``); a case that does
not fit is skipped, saying why (``skipped``, on its line and the summary's).

Writes bench/results/graph-exec-<date>.json; prints one line per case and a
summary line last.
Run: python -m bench.graph_exec_bench [--cases reference,llama,...]

``--overhead``: what one graph exec takes apart from its nodes, from graphs of 1 to 256
in-place kernels and a piecewise-shaped case (``bench.graph_exec_overhead``); writes
bench/results/graph-exec-overhead-<date>.json (one command, about a minute on an H100):
python -m bench.graph_exec_bench --overhead
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench.harness import (
    MiB,
    add_out_dir,
    add_overwrite,
    case_options,
    engine_loop,
    fitted_target,
    free_bytes,
    header,
    main_exit,
    release,
    result_file,
    run_module,
)

CASES = ("reference", "llama", "gemma2", "qwen2", "mixtral", "qwen2_moe", "deepseek_v3")


def child(case: str) -> dict:
    import torch

    from capture_plan.planner import build_plan

    plan = build_plan(case_options(case, Path(tempfile.mkdtemp())))
    target, why = fitted_target(case, plan)
    if why:
        return {"case": case, "skipped": why}
    phase = plan.phases[0]
    sizes = sorted(phase.sizes, reverse=True)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    target.prepare(phase.name, sizes[0], sizes[0], gen)
    target.run(phase.name, sizes[0], None)  # the warm-up capture() runs
    torch.cuda.empty_cache()
    first = engine_loop(target, [(phase.name, sizes)], warmups=0, driver_memory=True)
    a = free_bytes()
    release(first)
    returned = free_bytes() - a
    second = engine_loop(target, [(phase.name, sizes)], warmups=0, driver_memory=True)
    release(second)
    first, second = first.driver, second.driver
    nodes = sum(r["nodes"] or 0 for r in first)
    inst = sum(r["instantiate_bytes"] for r in first)
    return {
        "case": case,
        "phase": phase.name,
        "graphs": len(sizes),
        "nodes": nodes,
        "instantiate_bytes": inst,
        "record_bytes": sum(r["record_bytes"] for r in first),
        "bytes_per_node": inst / nodes if nodes else None,
        "returned_on_destroy_bytes": returned,
        "second_round_bytes": sum(r["instantiate_bytes"] + r["record_bytes"] for r in second),
        "first": first,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    add_out_dir(ap)
    add_overwrite(ap)
    ap.add_argument(
        "--overhead",
        action="store_true",
        help="measure the per-graph cost of a graph exec apart from its nodes (bench.graph_exec_overhead)",
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-overhead", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child)), flush=True)
        return
    if args.child_overhead:
        from bench import graph_exec_overhead

        print("RESULT " + json.dumps(graph_exec_overhead.child(args.child_overhead)), flush=True)
        return
    res: dict = header(device=True)
    if args.overhead:
        from bench import graph_exec_overhead

        path = result_file(args, "graph-exec-overhead", res["date"])
        line = graph_exec_overhead.run(path, res, run_module)
        print(f"wrote {path.path}")
        print(line)
        return
    path = result_file(args, "graph-exec", res["date"])
    res["cases"] = {}
    for case in args.cases.split(","):
        p = run_module("graph_exec_bench", ["--child", case], capture_output=True, text=True)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if p.returncode or not lines:
            res["cases"][case] = {"error": (p.stderr or p.stdout)[-1500:]}
            print(f"{case}: FAILED\n{res['cases'][case]['error']}", flush=True)
            continue
        r = res["cases"][case] = json.loads(lines[-1][7:])
        path.write(res)
        if "skipped" in r:
            print(f"{case}: SKIPPED: {r['skipped']}", flush=True)
            continue
        print(
            f"{case}: {r['graphs']} graphs {r['nodes']} nodes: instantiations {r['instantiate_bytes'] / MiB:.0f} MiB "
            f"({r['bytes_per_node']:.0f} B/node), recordings {r['record_bytes'] / MiB:.0f} MiB, "
            f"back on destroy {r['returned_on_destroy_bytes'] / MiB:.0f} MiB, "
            f"second round {r['second_round_bytes'] / MiB:.0f} MiB",
            flush=True,
        )
    print(f"wrote {path.path}")
    print(summary(res))


def summary(res: dict) -> str:
    """The SUMMARY line: bytes per node over the cases that counted nodes, and each case
    skipped on this device with its reason."""
    ok = [r for r in res["cases"].values() if r.get("nodes")]
    total_b, total_n = sum(r["instantiate_bytes"] for r in ok), sum(r["nodes"] for r in ok)
    each = ", ".join(f"{r['case']} {r['bytes_per_node']:.0f}" for r in ok)
    skipped = "".join(f"; {c} SKIPPED: {r['skipped']}" for c, r in res["cases"].items() if "skipped" in r)
    counted = (
        f"SUMMARY {len(ok)} cases: {total_b / total_n:.0f} B per node over {total_n} nodes (per case {each})"
        if total_n
        else "SUMMARY no case counted nodes"
    )
    return counted + skipped


if __name__ == "__main__":
    main_exit(main)
