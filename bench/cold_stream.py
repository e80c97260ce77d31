"""Experiment: what a capture on a *cold* stream adds to the graph pool.

Captures the largest reference graph alone twice into fresh pools: once on a
stream that ran the model eagerly before (what the executor does: warm-ups run
on the capture stream), once on a fresh stream whose first cuBLAS call happens
inside the capture (warm-ups on another stream, as a loop around
``torch.cuda.graph(g, pool=pool)`` without ``stream=`` does). Prints the pool
of each and the blocks still alive after the capture that are not outputs, and SUMMARY last.

The model is the harness's "reference" case (``bench.harness.case_target``) for ``--bs``
requests: its KV cache length is sized for the device's free memory (recorded as
``max_seqlen``); where not even the shortest cache fits, the run records and prints why
(``skipped``) and measures nothing.

Run: python -m bench.cold_stream [--layers 32] [--bs 256]
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.harness import MiB, add_layers, add_out_dir, add_overwrite, fitted_target, header, main_exit, result_file
from capture_plan.executor.pool import AllocationRecorder, pool_reserved


def build_target(layers: int, bs: int):
    """The bench's model: the harness's "reference" case for ``bs`` requests, sized for
    this device (``bench.harness.fitted_target``): ``(model, None)``, or ``(None, why)``
    where it does not fit."""
    return fitted_target("reference", None, layers, max_bs=bs)


def capture_alone(model, bs: int, stream, warm_on):
    with torch.cuda.stream(warm_on):
        model.run("decode", bs, None)
    torch.cuda.synchronize()
    pool = torch.cuda.graph_pool_handle()
    rec = AllocationRecorder()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        rec.begin()
        g.capture_begin(pool=pool)
        out = model.run("decode", bs, None)
        g.capture_end()
        rec.end()
    (win,) = rec.stop()
    torch.cuda.synchronize()
    lib = [s for a, s in win.alive_after if a != out.untyped_storage().data_ptr()]
    return {"pool_mib": pool_reserved([pool]) / MiB, "persistent_blocks": lib}, g, out


def summary(res: dict) -> str:
    """The SUMMARY line: each stream's pool and the blocks left alive, or why it was skipped."""
    if "skipped" in res:
        return f"SUMMARY SKIPPED: {res['skipped']}"
    warm, cold = res["warm_stream"], res["cold_stream"]
    return (
        f"SUMMARY bs {res['bs']} max_seqlen {res['max_seqlen']}: pool warm stream {warm['pool_mib']:.1f} MiB, "
        f"cold stream {cold['pool_mib']:.1f} MiB ({cold['pool_mib'] - warm['pool_mib']:+.1f}); blocks alive "
        f"beyond the output: warm {len(warm['persistent_blocks'])} "
        f"({sum(warm['persistent_blocks']) / MiB:.1f} MiB), cold {len(cold['persistent_blocks'])} "
        f"({sum(cold['persistent_blocks']) / MiB:.1f} MiB)"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    add_layers(ap)
    ap.add_argument("--bs", type=int, default=256)
    add_out_dir(ap)
    add_overwrite(ap)
    args = ap.parse_args()
    res = header(device=True)
    out = result_file(args, "cold-stream", res["date"])
    res.update(layers=args.layers, bs=args.bs)
    model, why = build_target(args.layers, args.bs)
    if why:  # nothing here runs without the model: the run says why and records it
        res["skipped"] = why
        out.write(res)
        print(summary(res))
        return
    res["max_seqlen"] = model.cfg.max_seqlen
    warm = torch.cuda.Stream()
    res["warm_stream"], g1, o1 = capture_alone(model, args.bs, warm, warm)
    cold = torch.cuda.Stream()
    res["cold_stream"], g2, o2 = capture_alone(model, args.bs, cold, torch.cuda.current_stream())
    out.write(res)
    print(json.dumps(res, indent=2, sort_keys=True))
    print(summary(res))


if __name__ == "__main__":
    main_exit(main)
