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

``--attention fa3 [--splits N]``: the transformers cases attend with FA3 over their cache,
as the engines' sm90 backends (``adapters/hf.py`` ``HFTarget``); ``--warmups N``: N eager
runs before each capture, as the engines' loop. Each graph's record then holds what its
warm-ups and its first replay took outside the allocator too, and each case what its first
eager run took (a process's first kernels: library initialization).

Writes bench/results/graph-exec-<date>[-<tag>].json; prints one line per case and a
summary line last.
Run: python -m bench.graph_exec_bench [--cases reference,llama,...]

``--overhead``: what one graph exec takes apart from its nodes, from graphs of 1 to 256
in-place kernels and a piecewise-shaped case (the section below :func:`summary`); writes
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
    driver_state,
    engine_loop,
    fitted_target,
    free_bytes,
    header,
    main_exit,
    outside_bytes,
    release,
    result_file,
    run_module,
)

CASES = ("reference", "llama", "gemma2", "qwen2", "mixtral", "qwen2_moe", "deepseek_v3")


def child(case: str, attention: str = "model", splits: int = 0, warmups: int = 0) -> dict:
    import torch

    from capture_plan.planner import build_plan

    plan = build_plan(case_options(case, Path(tempfile.mkdtemp())))
    kw = {"attention": attention, "fa3_splits": splits} if case not in ("reference", "eagle") else {}
    target, why = fitted_target(case, plan, **kw)
    if why:
        return {"case": case, "skipped": why}
    phase = plan.phases[0]
    sizes = sorted(phase.sizes, reverse=True)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    target.prepare(phase.name, sizes[0], sizes[0], gen)
    cold = driver_state()
    target.run(phase.name, sizes[0], None)  # the warm-up capture() runs
    first_run = outside_bytes(cold, driver_state())
    torch.cuda.empty_cache()
    first = engine_loop(target, [(phase.name, sizes)], warmups=warmups, driver_memory=True)
    a = free_bytes()
    release(first)
    returned = free_bytes() - a
    second = engine_loop(target, [(phase.name, sizes)], warmups=warmups, driver_memory=True)
    release(second)
    first, second = first.driver, second.driver
    nodes = sum(r["nodes"] or 0 for r in first)
    inst = sum(r["instantiate_bytes"] for r in first)
    cfg = getattr(getattr(target, "model", None), "config", None)  # a transformers case's
    return {
        "case": case,
        "phase": phase.name,
        # what fit's nodes per layer divide by (planner/data/fit_estimates.toml [graph.layers])
        "layers": cfg.num_hidden_layers if cfg is not None else target.cfg.model.layers,
        "graphs": len(sizes),
        "attention": attention if kw else "model",
        "splits": splits if kw else None,
        "warmups": warmups,
        "nodes": nodes,
        "first_run_bytes": first_run,
        "instantiate_bytes": inst,
        "record_bytes": sum(r["record_bytes"] for r in first),
        "warmup_bytes": sum(r["warmup_bytes"] for r in first),
        "replay_bytes": sum(r["replay_bytes"] for r in first),
        "bytes_per_node": inst / nodes if nodes else None,
        "returned_on_destroy_bytes": returned,
        "second_round_bytes": sum(r["instantiate_bytes"] + r["record_bytes"] for r in second),
        "first": first,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument(
        "--attention",
        choices=("model", "fa3"),
        default="model",
        help="the transformers cases' attention: their own (default) or FA3 over the cache, as the engines' "
        "sm90 backends (adapters/hf.py HFTarget); the reference cases call FA3 themselves",
    )
    ap.add_argument("--splits", type=int, default=0, help="FA3's num_splits with --attention fa3 (0: its heuristic)")
    ap.add_argument(
        "--warmups", type=int, default=0, help="eager runs before each capture, as the engines' loop (default 0)"
    )
    ap.add_argument("--tag", default=None, help="appended to the result's name")
    add_out_dir(ap)
    add_overwrite(ap)
    ap.add_argument(
        "--overhead",
        action="store_true",
        help="measure what a graph exec takes apart from its nodes (writes graph-exec-overhead-DATE.json)",
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-overhead", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.attention, args.splits, args.warmups)), flush=True)
        return
    if args.child_overhead:
        print("RESULT " + json.dumps(overhead_child(args.child_overhead)), flush=True)
        return
    res: dict = header(device=True)
    if args.overhead:
        path = result_file(args, "graph-exec-overhead", res["date"])
        line = overhead(path, res)
        print(f"wrote {path.path}")
        print(line)
        return
    path = result_file(args, "graph-exec", res["date"], args.tag or "")
    res["options"] = {"attention": args.attention, "splits": args.splits, "warmups": args.warmups}
    res["cases"] = {}
    opts = ["--attention", args.attention, "--splits", str(args.splits), "--warmups", str(args.warmups)]
    for case in args.cases.split(","):
        p = run_module("graph_exec_bench", ["--child", case, *opts], capture_output=True, text=True)
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
            f"first eager run {r['first_run_bytes'] / MiB:.0f} MiB, warm-ups {r['warmup_bytes'] / MiB:.0f} MiB, "
            f"first replays {r['replay_bytes'] / MiB:.0f} MiB, "
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


# -- --overhead: what a graph exec takes apart from its nodes ------------------------------
#
# The device memory one instantiated CUDA graph takes apart from its nodes:
# ``python -m bench.graph_exec_bench --overhead``.
#
# Why: ``planner/data/devices.toml [graph_exec_per_node]`` was measured on few large graphs
# (252 whole-model graphs, about 475 nodes each), so whatever a graph exec costs by itself
# is spread over its nodes there. An engine that captures piecewise graphs (vLLM's
# PIECEWISE pieces, split at attention: layers + 1 graphs per size; SGLang's breakable
# prefill segments) instantiates thousands of small graphs, where such a per-graph cost
# dominates. This mode measures it directly.
#
# Each point runs in its own process (driver memory taken by an instantiation is kept
# after the graph is destroyed and reused by later graphs, so a fresh process per series
# is the clean baseline). A process first captures, instantiates and replays one 1-node
# warm-up graph (the first graph's one-time costs), then captures graphs of ``k`` kernel
# nodes into ONE shared pool (capture_begin/capture_end, see :func:`_capture`), and after
# ``N`` of them (cumulative,
# nothing destroyed) records
#
# * ``free_drop``: the free-memory drop (``torch.cuda.mem_get_info``) since the baseline,
#   once after instantiation and again after replaying every graph once (``replayed``:
#   what an upload at first launch adds);
# * ``pool``: the caching allocator's reserved growth (the pool's segments and any other
#   segment), which is not graph-exec; ``exec = free_drop - pool``.
#
# The kernels allocate nothing: ``x.add_(1)`` on a preallocated tensor, one kernel node
# each. The fit is ``exec = N x per_graph + N x k x per_node`` by least squares over every
# point (no intercept: zero graphs take zero bytes).
#
# The piecewise-shaped case: ``layers`` layers of ``per_layer`` kernel nodes, captured for
# ``sizes`` sizes, either as one whole graph per size or as ``layers + 1`` pieces per size
# (one before the first attention, one after each), in one pool, largest size first, as
# vLLM's PIECEWISE capture does. With ``alloc`` each piece returns a new tensor of the
# size's rows (a piece's output that the next piece reads, dropped once the next piece is
# captured), so the pool side of pieces is seen too: whether the pool stays at one size's
# live set (every size reusing the largest size's blocks) as fit's pool term assumes.

#: kernel nodes per graph and graph counts measured (cumulative within a series)
KS = (1, 4, 16, 64, 256)
NS = (64, 256, 1024)
#: the piecewise-shaped case: Llama-3.1-8B's 32 layers, 12 nodes per layer (chosen when
#: fit read [graph.nodes] llama 381 over 32 layers; the bench's llama has 8, so its
#: transformers graph holds about 48 a layer: 12 stands for a fused layer, and the overhead's
#: fit, per graph and per node, does not depend on it), vLLM's 51 default capture sizes
#: (1, 2, 4, 8..512 step 8 up to 256, then step 16), hidden 4096 rows
LAYERS, PER_LAYER, HIDDEN = 32, 12, 4096
SIZES = (1, 2, 4, *range(8, 257, 8), *range(272, 513, 16))


def _measure(torch, pool_reserved: int, free0: int) -> dict:
    torch.cuda.synchronize()
    drop = free0 - int(torch.cuda.mem_get_info()[0])
    pool = int(torch.cuda.memory_reserved()) - pool_reserved
    return {"free_drop": drop, "pool": pool, "exec": drop - pool}


def _capture(torch, pool, stream, fn):
    """One graph of ``fn``'s kernels into ``pool`` on ``stream``, and ``fn``'s result.
    capture_begin/capture_end directly: ``torch.cuda.graph`` runs gc.collect and
    empty_cache before each capture, which vLLM patches out for all but a forward's first
    piece (vllm/compilation/cuda_graph.py CUDAGraphWrapper.__call__, gc_disable) and which
    would take minutes over thousands of graphs."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        g.capture_begin(pool=pool)
        try:
            out = fn()
        finally:
            g.capture_end()
    return g, out


def _warm(torch, x, stream) -> object:
    torch.cuda.synchronize()
    g, _ = _capture(torch, None, stream, lambda: x.add_(1))
    g.replay()
    torch.cuda.synchronize()
    return g


def series(k: int) -> dict:
    """Graphs of ``k`` in-place adds, one shared pool, measured after each of :data:`NS`."""
    import torch

    x = torch.zeros(1024, device="cuda")
    stream = torch.cuda.Stream()
    keep = [_warm(torch, x, stream)]
    pool = torch.cuda.graph_pool_handle()
    reserved0, free0 = int(torch.cuda.memory_reserved()), int(torch.cuda.mem_get_info()[0])
    points, graphs = [], []
    for n in NS:
        while len(graphs) < n:
            graphs.append(_capture(torch, pool, stream, lambda: [x.add_(1) for _ in range(k)])[0])
        row = {"k": k, "n": n, **_measure(torch, reserved0, free0)}
        for g in graphs:
            g.replay()
        row["replayed"] = _measure(torch, reserved0, free0)
        points.append(row)
    del keep
    return {"k": k, "points": points}


def _last(h, alloc: bool):
    return h.add(1) if alloc else h.add_(1)


def _layers(h, layer):
    for _ in range(LAYERS):
        h = layer(h)
    return h


def piecewise(pieces: bool, alloc: bool) -> dict:
    """The piecewise-shaped case: :data:`SIZES` largest first, ``LAYERS + 1`` pieces per size
    (``pieces``) or one whole graph, ``PER_LAYER`` kernel nodes a layer; ``alloc``: each
    piece's output is a new ``size x HIDDEN`` tensor that the next piece reads."""
    import torch

    stream = torch.cuda.Stream()
    x = torch.zeros(max(SIZES), HIDDEN, device="cuda", dtype=torch.bfloat16)
    keep = [_warm(torch, x[:1], stream)]
    pool = torch.cuda.graph_pool_handle()
    reserved0, free0 = int(torch.cuda.memory_reserved()), int(torch.cuda.mem_get_info()[0])
    graphs = []

    def layer(h):
        # PER_LAYER kernel nodes; with alloc the layer's last one allocates its output
        for _ in range(PER_LAYER - (1 if alloc else 0)):
            h.add_(1)
        return h.add(1) if alloc else h

    for size in sorted(SIZES, reverse=True):
        h = x[:size]
        if pieces:
            # LAYERS pieces of one layer's nodes each and a last one-node piece (vLLM's
            # layers + 1 graphs a size): the nodes of one whole graph and one more
            for i in range(LAYERS + 1):
                last = i == LAYERS
                g, h = _capture(torch, pool, stream, lambda h=h, last=last: _last(h, alloc) if last else layer(h))
                graphs.append(g)
        else:
            g, h = _capture(torch, pool, stream, lambda h=h: _layers(h, layer))
            graphs.append(g)
        del h  # the size's last output: nothing keeps it (vLLM's weak reference)
    row = _measure(torch, reserved0, free0)
    nodes = len(SIZES) * (LAYERS * PER_LAYER + (1 if pieces else 0))
    del keep
    return {"pieces": pieces, "alloc": alloc, "graphs": len(graphs), "nodes": nodes, **row}


def overhead_fit(points: list[dict], key: str = "exec") -> dict:
    """Least squares of ``bytes = n x per_graph + n x k x per_node`` (no intercept) over
    ``points``' ``key`` bytes; the residuals say how well two terms describe them."""
    a = [(p["n"], p["n"] * p["k"]) for p in points]
    y = [p[key] for p in points]
    s11 = sum(u * u for u, _ in a)
    s12 = sum(u * v for u, v in a)
    s22 = sum(v * v for _, v in a)
    t1 = sum(u * b for (u, _), b in zip(a, y, strict=True))
    t2 = sum(v * b for (_, v), b in zip(a, y, strict=True))
    det = s11 * s22 - s12 * s12
    per_graph = (t1 * s22 - t2 * s12) / det
    per_node = (s11 * t2 - s12 * t1) / det
    resid = [b - (u * per_graph + v * per_node) for (u, v), b in zip(a, y, strict=True)]
    return {
        "per_graph_bytes": per_graph,
        "per_node_bytes": per_node,
        "max_abs_residual_bytes": max(abs(r) for r in resid),
        "residuals": resid,
    }


def overhead_child(spec: str) -> dict:
    """One ``--overhead`` process's measurement: ``k=<K>`` (a :func:`series`) or
    ``piecewise=<0|1>,alloc=<0|1>`` (:func:`piecewise`)."""
    kv = dict(part.split("=") for part in spec.split(","))
    if "k" in kv:
        return series(int(kv["k"]))
    return piecewise(kv["piecewise"] == "1", kv["alloc"] == "1")


SPECS = [f"k={k}" for k in KS] + [f"piecewise={p},alloc={a}" for a in (0, 1) for p in (0, 1)]


def overhead(path, res: dict) -> str:
    """``--overhead``: every :data:`SPECS` child, the fit, written to ``path`` (a
    ResultFile) as it goes; returns the SUMMARY line."""
    res.update(
        {
            "mode": "overhead",
            "ks": list(KS),
            "ns": list(NS),
            "piecewise_case": {"layers": LAYERS, "per_layer": PER_LAYER, "hidden": HIDDEN, "sizes": list(SIZES)},
            "series": [],
            "piecewise": [],
        }
    )
    for spec in SPECS:
        p = run_module("graph_exec_bench", ["--child-overhead", spec], capture_output=True, text=True)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if p.returncode or not lines:
            res.setdefault("errors", {})[spec] = (p.stderr or p.stdout)[-1500:]
            print(f"{spec}: FAILED\n{res['errors'][spec]}", flush=True)
            continue
        r = json.loads(lines[-1][7:])
        if "points" in r:
            res["series"].append(r)
            for q in r["points"]:
                print(
                    f"k={q['k']:>3} N={q['n']:>4}: exec {q['exec'] / MiB:8.1f} MiB "
                    f"(after replay {q['replayed']['exec'] / MiB:8.1f}), pool {q['pool'] / MiB:.1f} MiB",
                    flush=True,
                )
        else:
            res["piecewise"].append(r)
            print(
                f"{'pieces' if r['pieces'] else 'whole '} alloc={int(r['alloc'])}: {r['graphs']} graphs "
                f"{r['nodes']} nodes: exec {r['exec'] / MiB:.1f} MiB, pool {r['pool'] / MiB:.1f} MiB",
                flush=True,
            )
        path.write(res)
    pts = [q for s in res["series"] for q in s["points"]]
    if len({q["k"] for q in pts}) < 2:
        path.write(res)
        return "SUMMARY overhead: too few series to fit"
    res["fit"] = overhead_fit(pts)
    res["fit_replayed"] = overhead_fit([{**q, "exec": q["replayed"]["exec"]} for q in pts])
    path.write(res)
    f, fr = res["fit"], res["fit_replayed"]
    pw = {(r["pieces"], r["alloc"]): r for r in res["piecewise"]}
    shown = ""
    if (True, False) in pw and (False, False) in pw:
        a, b = pw[(True, False)], pw[(False, False)]
        shown = (
            f"; piecewise {a['graphs']} graphs {a['exec'] / MiB:.0f} MiB vs whole {b['graphs']} graphs "
            f"{b['exec'] / MiB:.0f} MiB of graph-exec"
        )
    return (
        f"SUMMARY overhead over {len(pts)} points: {f['per_graph_bytes']:.0f} B per graph + "
        f"{f['per_node_bytes']:.0f} B per node (after one replay each: {fr['per_graph_bytes']:.0f} + "
        f"{fr['per_node_bytes']:.0f}; largest residual {f['max_abs_residual_bytes'] / MiB:.1f} MiB){shown}"
    )


if __name__ == "__main__":
    main_exit(main)
