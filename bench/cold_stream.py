"""Experiment: what a capture on a *cold* stream adds to the graph pool.

Captures the largest reference graph alone twice into fresh pools: once on a
stream that ran the model eagerly before (what the executor does: warm-ups run
on the capture stream), once on a fresh stream whose first cuBLAS call happens
inside the capture (warm-ups on another stream, as a loop around
``torch.cuda.graph(g, pool=pool)`` without ``stream=`` does). Prints the pool
of each and the blocks still alive after the capture that are not outputs.

Run: python -m bench.cold_stream [--layers 32] [--bs 256]
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.harness import add_layers, add_out_dir, add_overwrite, header, main_exit, result_file
from capture_plan.executor.pool import AllocationRecorder, pool_reserved
from capture_plan.references.decode import ReferenceConfig, ReferenceModel
from capture_plan.schemas.spec import Model


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
    return {"pool_mib": pool_reserved([pool]) / 2**20, "persistent_blocks": lib}, g, out


def main() -> None:
    ap = argparse.ArgumentParser()
    add_layers(ap)
    ap.add_argument("--bs", type=int, default=256)
    add_out_dir(ap)
    add_overwrite(ap)
    args = ap.parse_args()
    res = header(device=True)
    out = result_file(args, "cold-stream", res["date"])
    model = ReferenceModel(ReferenceConfig(model=Model(layers=args.layers), max_bs=args.bs))
    res.update(layers=args.layers, bs=args.bs)
    warm = torch.cuda.Stream()
    res["warm_stream"], g1, o1 = capture_alone(model, args.bs, warm, warm)
    cold = torch.cuda.Stream()
    res["cold_stream"], g2, o2 = capture_alone(model, args.bs, cold, torch.cuda.current_stream())
    out.write(res)
    print(json.dumps(res, indent=2, sort_keys=True))


if __name__ == "__main__":
    main_exit(main)
