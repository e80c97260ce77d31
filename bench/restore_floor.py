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

Writes JSON (the harness's header) to --out and prints one line per case, then a
one-line summary last.
Run: python -m bench.restore_floor [--cases reference,llama,eagle] [--layers 32] [--rebuild] [--moved] [--tag T]
[--out DIR]
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
        "graphs": len(rebuilt.execs),
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
    from capture_plan.executor.graph_file import current_environment, graph_tensors, save_graphs
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
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
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
