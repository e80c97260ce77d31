"""Restore floor and probe on one GPU: what a graph restore cannot beat, and what it must relocate.

Every case runs in a fresh process (``--cases``; the models of bench/device_bench.py: the
reference decode step on plans/fa3-ci.json's build, the EAGLE reference on
plans/fa3-eagle-ci.json's, transformers models such as ``llama``), the target made ready as
an engine has it before capture (``device_bench.ready_target``), then:

  capture   ``capture(plan, target)``: its wall time and the report's ``capture_seconds``
            (the first warm-up's kernel loading included: a fresh process)
  floor     every captured graph ``cuGraphClone`` + ``cuGraphInstantiateWithFlags`` +
            ``cuGraphUpload`` on the current stream, timed together to a synchronize
            (``capture_plan.executor.restore_probe.clone_floor``): no file, no kernel
            loading, no relocation, so the floor a restore cannot beat, against the
            capture's own seconds
  probe     every node of every graph through the driver (``restore_probe.probe_graphs``):
            kernel, memset, copy and other nodes; whether each kernel's name, module and
            parameter layout resolve; every device address in kernel arguments inside a
            segment of the plan's pools, another segment of torch's caching allocator
            (weights, KV cache, workspaces) or outside every segment; the parameters shaped
            like a TMA descriptor (128 bytes, 64-byte aligned)
  save      the graph file (``capture_plan.executor.graph_file.save_graphs``) from the probe's
            walk (one walk: ``restore_probe.walk_graphs``): its size, the seconds a start-up
            would pay to write it (the walk, hashing the kernel libraries, building and
            writing the file: ``save.seconds``, each part in ``save.parts``), what
            ``check_valid`` refuses in the saving process itself
  tma       where this driver's TMA descriptor keeps its global address
            (``capture_plan.executor.tensor_map_probe``: the words two encodings of one
            tile at two addresses differ in; ``plain`` where the only one holds the address
            as it is, so that the file's relocation covers descriptors inside parameter
            structs)
  rebuild   (``--rebuild``) every graph rebuilt from the file read back, in the same process
            (``capture_plan.executor.graph_rebuild``: each kernel found by its module's
            identity and its name, every node added through the driver, instantiated and
            uploaded: ``rebuild.seconds`` against the capture's), then each rebuilt graph
            launched and its outputs compared bit for bit with the captured graph's replay
  moved     (``--moved``) every graph rebuilt onto copies of every segment its addresses point
            into, the originals filled with 0xFF while it runs, its outputs read from the
            copies and compared bit for bit (``rebuild_proof.compare_moved``: the relocation
            proof; twice the memory of those segments, the model's weights and KV cache
            included)

A case's model is sized for the device (``bench.harness.case_target``); a case that does
not fit is skipped, saying why (``skipped``, on its line and the summary's).

``--fresh`` measures instead a start-up's restore against its capture, each in a fresh
process of its own and timed the same way: from the weights loaded (the model built, valid
inputs written, no eager run before: the first warm-up's kernel loading is inside both) to
the graphs ready, synchronized:

  capture   ``capture(plan, target)`` (the plan built here), then the graph file written
            (``save.seconds``, by part) and every captured graph replayed against the eager
            run at its size (``captured_equal``: the control)
  restore   in the next process, the plan read back and the same model built:
            ``restore(plan, target, file)`` (``capture_plan.executor.graph_restore``: checks, the
            loading runs at the keys reaching every module of the file and every kernel fetched
            by name, the pools laid out, every graph rebuilt; its parts: ``environment.*``,
            ``check.*``, ``load.*`` split them), then every
            restored graph against the eager run at its size, bit for bit; a refusal is
            recorded with its reasons, not raised

It writes ``restore-fresh-DATE[-TAG].json``; a run fails where a restored graph differs.

Writes JSON (the harness's header) to --out and prints one line per case, then a
one-line summary last.
Run: python -m bench.restore_floor [--cases reference,llama,eagle] [--layers 32] [--rebuild] [--moved] [--fresh]
[--tag T] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import traceback
from pathlib import Path

from bench.harness import (
    CaseDoesNotFit,
    add_layers,
    add_out_dir,
    add_overwrite,
    case_options,
    case_target,
    does_not_fit,
    header,
    main_exit,
    result_file,
    run_module,
)

CASES = ("reference", "llama", "eagle")


def child(case: str, layers: int, save: bool, rebuild: bool = False, moved: bool = False) -> dict:
    """One case in this (fresh) process: capture, floor, probe, save, rebuild (module docstring)."""
    import torch

    from bench.device_bench import ready_target
    from capture_plan.executor import capture
    from capture_plan.executor.restore_probe import clone_floor, probe_graphs, raw_graphs, summary_line, walk_graphs
    from capture_plan.planner import build_plan

    folder = Path(tempfile.mkdtemp())
    plan = build_plan(case_options(case, folder))
    try:
        target = ready_target(case, plan, layers)
    except CaseDoesNotFit as err:
        out = {"case": case, "skipped": does_not_fit(case, err)}
        out["summary"] = f"{case}: SKIPPED: {out['skipped']}"
        return out
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    gs = capture(plan, target, progress=False)
    wall = time.perf_counter() - t0
    out: dict = {
        "case": case,
        "plan_digest": plan.digest,
        "graphs": len(gs.graphs),
        "capture_wall_s": wall,
        "capture_s": gs.report.capture_seconds,
    }
    raws = [raw for _, _, raw in raw_graphs(gs)]
    out["floor_s"], made = clone_floor(raws, torch.cuda.current_stream().cuda_stream)
    out["floor_of_capture"] = out["floor_s"] / out["capture_s"] if out["capture_s"] else None
    if made != len(raws):
        raise RuntimeError(f"the clone floor made {made} executables of {len(raws)} graphs")
    t0 = time.perf_counter()
    walked = walk_graphs(gs)
    out["walk_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    counts = probe_graphs(gs, torch.cuda.memory_snapshot(), walked=walked)
    out["probe_s"] = time.perf_counter() - t0
    out["probe"] = counts.as_dict()
    out["summary"] = summary_line(case, counts, out["floor_s"], out["capture_s"])
    print(out["summary"], flush=True)
    out["tensor_map"] = _tensor_map()
    if save or rebuild or moved:
        out["save"] = _save(gs, plan, target, folder, walked, out["walk_s"])
        if rebuild and "bytes" in out["save"]:
            out["rebuild"] = _rebuild(gs, target, folder / "graphs.cpgraphs", walked, out["capture_s"])
        if moved and "bytes" in out["save"]:
            out["moved"] = _moved(gs, target, folder / "graphs.cpgraphs", walked)
    gs.release()
    return out


def _tensor_map() -> dict:
    """Where this driver's TMA descriptors keep their address (``tensor_map_probe``): whether
    the file's plain-word relocation covers the sm90 kernels' descriptors. Recorded, not raised."""
    from capture_plan.executor.tensor_map_probe import probe_tensor_map

    try:
        return probe_tensor_map().as_dict()
    except Exception as err:
        return {"error": str(err)}


def _rebuild(gs, target, path: Path, walked, capture_s: float) -> dict:
    """Every graph rebuilt from the file at ``path`` and checked against its captured replay
    (``graph_rebuild.rebuild_from_file``, ``rebuild_proof.compare_replays``). A failure or refusal is
    recorded (and printed whole), not raised."""
    from capture_plan.executor.graph_rebuild import rebuild_from_file
    from capture_plan.executor.rebuild_proof import compare_replays

    try:
        rebuilt = rebuild_from_file(path, gs, target, walked)
        graphs = len(rebuilt.execs)  # before destroy() empties them (the phase 2 JSON says 0)
        try:
            check = compare_replays(gs, rebuilt)
        finally:
            rebuilt.destroy()
    except Exception:
        text = traceback.format_exc()
        print(f"rebuild FAILED:\n{text}", flush=True)
        return {"error": text[-1500:]}
    out = {
        "seconds": rebuilt.seconds,
        "parts": rebuilt.parts,
        "of_capture": rebuilt.seconds / capture_s if capture_s else None,
        "graphs": graphs,
        "nodes": rebuilt.nodes,
        **check,
    }
    print(
        f"rebuild {out['graphs']} graphs, {out['nodes']} nodes in {out['seconds']:.3f} s; bit-equal "
        f"{len(check['equal'])}, differ {check['differ']}, not repeatable {check['not_repeatable']}",
        flush=True,
    )
    return out


def _moved(gs, target, path: Path, walked) -> dict:
    """The relocation proof (``rebuild_proof.compare_moved``); a failure recorded, not raised."""
    from capture_plan.executor.rebuild_proof import compare_moved

    try:
        t0 = time.perf_counter()
        check = compare_moved(gs, path, target, walked)
        check["seconds"] = time.perf_counter() - t0
    except Exception:
        text = traceback.format_exc()
        print(f"moved rebuild FAILED:\n{text}", flush=True)
        return {"error": text[-1500:]}
    print(
        f"moved rebuild onto copies of {check['segments']} segments ({check['bytes_copied'] / 2**20:.1f} MiB): "
        f"bit-equal {len(check['equal'])}, differ {check['differ']}, not repeatable {check['not_repeatable']}, "
        f"unreadable {check['unreadable']}",
        flush=True,
    )
    return check


def _save(gs, plan, target, folder: Path, walked, walk_s: float) -> dict:
    """The graph file of ``gs`` from the probe's walk: size, seconds (the walk's included:
    what a start-up that saves pays), the refusals of the saving process itself. A failure is
    recorded (and printed whole), not raised: the floor and the probe stand."""
    from capture_plan.executor.graph_env import current_environment, graph_tensors
    from capture_plan.executor.graph_file import save_graphs
    from capture_plan.executor.graph_validity import check_valid

    path = folder / "graphs.cpgraphs"
    parts: dict = {}
    try:
        t0 = time.perf_counter()
        file = save_graphs(gs, plan, target, path, walked=walked, timings=parts)
        seconds = time.perf_counter() - t0 + walk_s
        parts["walk"] = walk_s
        refusals = check_valid(file, current_environment(plan.digest, graph_tensors(gs, target), gs.pools))
    except Exception:
        text = traceback.format_exc()
        print(f"save FAILED:\n{text}", flush=True)
        return {"error": text[-1500:]}
    relocs = sum(len(n.kernel.relocations) for g in file.graphs for n in g.nodes if n.kernel is not None)
    return {
        "bytes": path.stat().st_size,
        "seconds": seconds,
        "parts": parts,
        "modules": len(file.modules),
        "libraries": [lib.name for lib in file.valid_for.libraries],
        "segments": {k: sum(s.kind == k for s in file.segments) for k in {s.kind for s in file.segments}},
        "relocations": relocs,
        "refusals_here": refusals[:10],
        "refusals_here_count": len(refusals),
    }


def fresh_child(case: str, layers: int, side: str, folder: Path | None = None) -> dict:
    """One side of ``--fresh`` in this fresh process (module docstring): ``capture`` (the
    plan built and written to ``folder``, captured, saved, the control) or ``restore`` (the
    plan read back, the file restored, every graph against the eager run)."""
    import torch

    from capture_plan.executor import RestoreRefused, capture, load_plan
    from capture_plan.executor.graph_file import save_graphs
    from capture_plan.executor.graph_restore import restore
    from capture_plan.planner import build_plan
    from capture_plan.schemas.codec import canonical_bytes

    folder = folder if folder is not None else Path(tempfile.mkdtemp())
    if side == "capture":
        plan = build_plan(case_options(case, folder))
        (folder / "plan.json").write_bytes(canonical_bytes(plan))
    else:
        plan = load_plan(folder / "plan.json", check_env=False)
    try:
        target = case_target(case, plan, layers)
    except CaseDoesNotFit as err:
        return {"case": case, "skipped": does_not_fit(case, err)}
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    for p in plan.phases:  # valid inputs everywhere; no eager run: its kernel loading is inside the timing
        target.prepare(p.name, max(p.sizes), max(p.sizes), gen)
    torch.cuda.synchronize()
    path = folder / "graphs.cpgraphs"
    t0 = time.perf_counter()
    if side == "capture":
        gs = capture(plan, target, progress=False)
        torch.cuda.synchronize()
        out: dict = {"case": case, "seconds": time.perf_counter() - t0, "capture_s": gs.report.capture_seconds}
        parts: dict = {}
        t1 = time.perf_counter()
        file = save_graphs(gs, plan, target, path, timings=parts)
        out["save"] = {"seconds": time.perf_counter() - t1, "parts": parts, "bytes": path.stat().st_size}
        # what a restore loads: the modules its runs must reach, the kernel functions it fetches by name
        out["save"].update(modules=len(file.modules), functions=len(file.functions))
        out["graphs"], out["captured_equal"] = len(gs.graphs), _against_eager(gs, target)["equal"]
        gs.release()
        return out
    try:
        gs = restore(plan, target, path)
    except RestoreRefused as err:
        return {"case": case, "refused": str(err), "reasons": err.reasons[:10]}
    torch.cuda.synchronize()
    out = {"case": case, "seconds": time.perf_counter() - t0}
    r = gs.restored
    fields = ("parts", "keys", "graphs", "nodes", "segments", "moved", "functions", "attributes", "builder")
    out.update({k: getattr(r, k) for k in fields})
    out.update(_against_eager(gs, target))
    gs.release()
    return out


def _against_eager(gs, target) -> dict:
    """Every graph of ``gs`` replayed on fresh inputs against the target's eager run at its
    size, bit for bit: ``equal`` and ``differ`` (graph names, in capture order)."""
    import torch

    gen = torch.Generator(device="cuda")
    gen.manual_seed(1)
    out: dict = {"equal": [], "differ": []}
    for phase, bs in sorted(gs.graphs, key=lambda key: gs.graphs[key].order):
        target.prepare(phase, bs, bs, gen)
        got = [t.clone() for t in gs.replay(phase, bs)]
        ref = [t.clone() for t in gs.eager(phase, bs)]
        torch.cuda.synchronize()
        same = len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))
        out["equal" if same else "differ"].append(f"{phase}/{bs}")
    return out


def fresh_summary(res: dict) -> str:
    """The ``--fresh`` run's one line: per case the restore's seconds against the capture's."""
    parts = []
    for case, row in res["cases"].items():
        c, r = row.get("capture", {}), row.get("restore", {})
        if "skipped" in c or "skipped" in r:
            parts.append(f"{case} SKIPPED: {c.get('skipped') or r.get('skipped')}")
        elif "seconds" not in c:
            parts.append(f"{case} capture FAILED")
        elif "refused" in r:
            parts.append(f"{case} REFUSED: {r['reasons'][0]}")
        elif "seconds" not in r:
            parts.append(f"{case} restore FAILED")
        else:
            load = r["parts"].get("load", 0.0)
            by = f" by the {r['builder']} graph builder" if r.get("builder") else ""  # not in runs before it
            parts.append(
                f"{case} capture {c['seconds']:.3f} s, restore {r['seconds']:.3f} s "
                f"({r['seconds'] / c['seconds']:.2f}x; loading {load:.3f} s: runs at {len(r['keys'])} keys for "
                f"{c['save'].get('modules', '?')} modules, {r.get('functions', '?')} kernels fetched by name "
                f"({r['parts'].get('load.functions', 0.0):.3f} s, {r.get('attributes', '?')} attributes set); "
                f"environment {r['parts'].get('environment', 0.0):.3f} s, check "
                f"{r['parts'].get('check', 0.0):.3f} s; rebuild "
                f"{r['parts'].get('rebuild', 0.0):.3f} s{by}), bit-equal {len(r['equal'])}/{r['graphs']} (captured "
                f"{len(c['captured_equal'])}/{c['graphs']}), moved {r['moved']}/{r['segments']} segments, file "
                f"{c['save']['bytes'] / 2**20:.1f} MiB"
            )
    return "SUMMARY restore fresh (from weights loaded to graphs ready): " + "; ".join(parts)


def _fresh_side(case: str, side: str, folder: Path, layers: int) -> dict:
    cmd = ["--fresh-child", side, "--case", case, "--folder", str(folder), "--layers", str(layers)]
    p = run_module("restore_floor", cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        err = (p.stderr or p.stdout)[-3000:]
        print(f"{case} {side}: FAILED (exit {p.returncode})\n{err}", flush=True)
        return {"error": err}
    return json.loads(lines[-1][len("RESULT ") :])


def fresh_main(args) -> int | None:
    """``--fresh``: per case a capture process, then a restore process (module docstring)."""
    res: dict = header(device=True)
    path = result_file(args, "restore-fresh", res["date"], args.tag)
    res.update(layers=args.layers, cases={})
    for case in [c for c in args.cases.split(",") if c]:
        folder = Path(tempfile.mkdtemp())
        row: dict = {"capture": _fresh_side(case, "capture", folder, args.layers)}
        if "seconds" in row["capture"]:
            row["restore"] = _fresh_side(case, "restore", folder, args.layers)
        res["cases"][case] = row
        print(fresh_summary({"cases": {case: row}}), flush=True)
        path.write(res)
    print(f"wrote {path.path}")
    print(fresh_summary(res))
    bad = [c for c, row in res["cases"].items() if "error" in row["capture"] or "error" in row.get("restore", {})]
    bad += [c for c, row in res["cases"].items() if row.get("restore", {}).get("differ")]
    return 1 if bad else None


def summary(res: dict) -> str:
    parts = []
    for case, row in res["cases"].items():
        if "error" in row:
            parts.append(f"{case} FAILED")
            continue
        if "skipped" in row:
            parts.append(f"{case} SKIPPED: {row['skipped']}")
            continue
        a = row["probe"]["addresses"]
        s = row.get("save", {})
        saved = (
            f" file {s['bytes'] / 2**20:.1f} MiB in {s['seconds']:.2f} s, {s['refusals_here_count']} refusals here"
            if "bytes" in s
            else (" save FAILED" if s else "")
        )
        r = row.get("rebuild", {})
        if "seconds" in r:
            saved += (
                f", rebuild {r['seconds']:.3f} s ({r['of_capture']:.2f}x of capture), bit-equal "
                f"{len(r['equal'])}/{r['graphs']}, differ {len(r['differ'])}, not repeatable {len(r['not_repeatable'])}"
            )
        elif r:
            saved += " rebuild FAILED"
        tm = row.get("tensor_map", {})
        if "address_words" in tm:
            saved += f", tensor-map address words {tm['address_words']}{' (plain)' if tm['plain'] else ''}"
        m = row.get("moved", {})
        if "equal" in m:
            saved += f", moved bit-equal {len(m['equal'])}/{row['graphs']}, differ {len(m['differ'])}"
        elif m:
            saved += " moved FAILED"
        parts.append(
            f"{case} {row['graphs']} graphs floor {row['floor_s']:.3f} s / capture {row['capture_s']:.3f} s "
            f"({row['floor_of_capture']:.2f}x), addresses {a['pool']}/{a['torch']}/{a['outside']}, "
            f"tma {row['probe']['tensor_map_params']}{saved}"
        )
    return "SUMMARY restore floor (pool/other-torch/outside): " + "; ".join(parts)


def main() -> int | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"cases, comma-separated (default {','.join(CASES)})")
    add_layers(ap, help="layers of the reference models")
    ap.add_argument("--no-save", action="store_true", help="skip writing each case's graph file")
    ap.add_argument(
        "--rebuild",
        action="store_true",
        help="rebuild every graph from its file in the same process and compare its replay bit for bit",
    )
    ap.add_argument("--tag", default="")
    add_out_dir(ap)
    add_overwrite(ap)
    ap.add_argument(
        "--moved",
        action="store_true",
        help="rebuild every graph onto copies of its segments (twice their memory) and compare bit for bit",
    )
    ap.add_argument(
        "--fresh",
        action="store_true",
        help="time a restore in a fresh process against a capture in one (from weights loaded to graphs ready)",
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--fresh-child", choices=("capture", "restore"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.fresh_child:
        result = fresh_child(args.case, args.layers, args.fresh_child, Path(args.folder))
        print("RESULT " + json.dumps(result), flush=True)
        return
    if args.fresh:
        return fresh_main(args)
    if args.child:
        result = child(args.child, args.layers, not args.no_save, args.rebuild, args.moved)
        print("RESULT " + json.dumps(result), flush=True)
        return
    res: dict = header(device=True)
    path = result_file(args, "restore-floor", res["date"], args.tag)
    res.update(layers=args.layers, rebuild=args.rebuild, moved=args.moved, cases={})
    for case in [c for c in args.cases.split(",") if c]:
        cmd = ["--child", case, "--layers", str(args.layers)] + (["--no-save"] if args.no_save else [])
        cmd += (["--rebuild"] if args.rebuild else []) + (["--moved"] if args.moved else [])
        p = run_module(
            "restore_floor", cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if p.returncode or not lines:
            res["cases"][case] = {"error": (p.stderr or p.stdout)[-3000:]}
            print(f"{case}: FAILED (exit {p.returncode})\n{res['cases'][case]['error']}", flush=True)
        else:
            res["cases"][case] = json.loads(lines[-1][7:])
            print(res["cases"][case]["summary"], flush=True)
            if "error" in res["cases"][case].get("save", {}):
                print(f"{case}: save FAILED\n{res['cases'][case]['save']['error']}", flush=True)
        path.write(res)  # after every case: a time limit keeps them
    print(f"wrote {path.path}")
    print(summary(res))
    # a rebuild that failed or replays differently fails the run: the proof did not hold
    failed = [c for c, r in res["cases"].items() if "error" in r]
    for proof in ("rebuild", "moved"):
        failed += [c for c, r in res["cases"].items() if "error" in r.get(proof, {}) or r.get(proof, {}).get("differ")]
    return 1 if failed else None


if __name__ == "__main__":
    main_exit(main)
