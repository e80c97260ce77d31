"""What a process's first GEMM on a side stream takes from the device outside torch's allocator.

Engines warm up and capture on a stream of their own (SGLang: runner_utils/pool.py's global
capture stream; torch.cuda.graph's side stream). The SGLang fit bench's runner lost about
70 MiB of free memory outside torch before its first graph, on every model, with kernel
code loaded eagerly as well as lazily (fit-bench-2026-12-07-h100-sglang-fa3-{eager,lazy}),
and a 1024x1024 bf16 matmul on a new stream in that process took as much (a probe at
b50c148). This bench measures the parts alone, in fresh processes: what a process's first
GEMM (cuBLAS's initialization) and a new stream's first GEMM take, outside torch and in it.
Its first results (side-stream-2026-12-07.json) put the outside memory at the process's
first GEMM (on the default stream here) and none at a later new stream's: the runner's 70 MiB is
not explained by this alone.

Per run (a fresh process each, ``--runs``): cuBLAS initialized by a ``--dtype`` matmul on the
default stream, then the same matmul on a new stream, then on a second new stream; after
each, the free-memory drop (``torch.cuda.mem_get_info``) and the caching allocator's growth
(``memory_reserved``); ``outside`` is the drop less the growth.

``--case NAME``: a bench case's decode step at its plan's largest size in place of the matmul
(:func:`child_case`): the step an engine's capture stream runs first. In the SGLang runner's
process a decode step on a new stream took about 70 MiB outside torch where a matmul took
none (a probe at 21d6a15), and vLLM 0.34.0's runner, which captures on a new stream too, lost
as much more than 0.33.0's (fit-bench-2026-12-07-h100-034-rope: its capture's driver share).

``--streams N``: what creating streams takes (:func:`child_streams`). A probe at 43db924 found
the runners' 70 MiB there: the process's first ``torch.cuda.Stream()`` took 70 MiB outside
torch on an H100 (torch makes its stream pools at once), a second none, and a driver stream
544 KiB. The runners' capture streams were their processes' first; the releases make theirs
earlier (vLLM's GPUModelRunner output_copy_stream, SGLang's ModelRunner forward_stream: after
the first free-memory reading, before the profile), and so do the runners since. The steps
above create their streams before reading, so they miss it.

Writes bench/results/side-stream-<date>.json; prints one line per run and SUMMARY last.
Run: python -m bench.side_stream_bench [--runs 3] [--dtype bfloat16] [--n 1024] [--case llama] [--streams 64]
"""

from __future__ import annotations

import argparse
import json

from bench.harness import (
    MiB,
    add_out_dir,
    add_overwrite,
    driver_state,
    header,
    main_exit,
    outside_bytes,
    result_file,
    run_module,
)

STEPS = ("default_stream", "first_side_stream", "second_side_stream")


def _steps(run) -> dict:
    """Per step of :data:`STEPS`, what ``run()`` takes on its stream (the default stream, then a
    new one, then another), each stream made before the first reading: outside torch and in it."""
    import torch

    out = {}
    for step in STEPS:
        stream = torch.cuda.current_stream() if step == "default_stream" else torch.cuda.Stream()
        a = driver_state()
        with torch.cuda.stream(stream):
            run()
        b = driver_state()
        out[step] = {"outside_bytes": outside_bytes(a, b), "reserved_growth_bytes": b[1] - a[1]}
    return out


def child(dtype: str, n: int) -> dict:
    import torch

    torch.cuda.init()
    w = torch.ones((n, n), dtype=getattr(torch, dtype), device="cuda")
    # the product's buffer is made before any step: a 1-10 MiB allocation on a stream with no
    # segment of its own would take a new 20 MiB segment (the caching allocator's large
    # buffer), which is the bench's, not cuBLAS's (the first results, side-stream-2026-12-07,
    # count it in the side streams' growth: 52 = 32 MiB workspace + that segment)
    o = torch.empty_like(w)
    return _steps(lambda: torch.matmul(w, w, out=o))


def child_case(case: str) -> dict:
    """The steps of :func:`child` with the bench case's decode step at its plan's largest size
    for the matmul (``--case``): the transformers cases attend with FA3 over their cache, as
    the engines' sm90 backends (``bench.harness case_target``). The default stream's step is
    the process's first forward (cuBLAS initialized in it); the first side stream's is what an
    engine's capture stream runs first where no forward ran on a stream of its own before it
    (SGLang 0.5.23's decode warm-ups, vLLM 0.34.0's ``graph_capture`` stream)."""
    import tempfile
    from pathlib import Path

    import torch

    from bench.harness import case_options, fitted_target
    from capture_plan.planner import build_plan

    plan = build_plan(case_options(case, Path(tempfile.mkdtemp())))
    kw = {"attention": "fa3"} if case not in ("reference", "eagle") else {}
    target, why = fitted_target(case, plan, **kw)
    if why:
        return {"skipped": why}
    phase = plan.phases[0]
    bs = max(phase.sizes)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    target.prepare(phase.name, bs, bs, gen)
    with torch.no_grad():
        return {"case": case, "phase": phase.name, "bs": bs, **_steps(lambda: target.run(phase.name, bs, None))}


def child_streams(n: int) -> dict:
    """``--streams N``: what creating streams takes, outside torch: the process's first
    ``torch.cuda.Stream()`` (torch makes its stream pools then, every stream of them at once:
    c10/cuda/CUDAStream.cpp ``initDeviceStreamState``), a second one (taken from the pools), and
    ``N`` driver streams made directly (``cuStreamCreate``, non-blocking), whose mean is the
    driver's bytes per stream; ``pool_streams`` is the first's bytes over that mean."""
    import ctypes

    import torch

    from capture_plan.executor.libcuda import call

    torch.cuda.init()
    torch.empty(1, device="cuda")  # the context, before any reading
    out: dict = {}
    for step in ("first_torch_stream", "second_torch_stream"):
        a = driver_state()
        torch.cuda.Stream()
        out[step] = {"outside_bytes": outside_bytes(a, driver_state())}
    create, destroy = call("cuStreamCreate"), call("cuStreamDestroy_v2")
    handles = [ctypes.c_void_p() for _ in range(n)]
    a = driver_state()
    for h in handles:
        if create(ctypes.byref(h), 1):  # CU_STREAM_NON_BLOCKING
            raise RuntimeError("cuStreamCreate failed")
    raw = outside_bytes(a, driver_state())
    for h in handles:
        destroy(h)
    per = raw / n
    out["raw_streams"] = {"count": n, "outside_bytes": raw, "per_stream_bytes": per}
    out["pool_streams"] = round(out["first_torch_stream"]["outside_bytes"] / per) if per else None
    return out


def summary(res: dict) -> str:
    """The SUMMARY line: per step, the outside bytes over the runs (min..max MiB)."""
    runs = [r for r in res["runs"] if "error" not in r and "skipped" not in r]
    if not runs:
        return "SUMMARY no run finished"
    if res.get("streams"):
        first = [r["first_torch_stream"]["outside_bytes"] / MiB for r in runs]
        per = [r["raw_streams"]["per_stream_bytes"] / 1024 for r in runs]
        return (
            f"SUMMARY {len(runs)} runs, outside torch: first torch.cuda.Stream() "
            f"{min(first):.0f}..{max(first):.0f} MiB; "
            f"a driver stream {min(per):.0f}..{max(per):.0f} KiB; torch's pools {runs[0]['pool_streams']} streams"
        )

    def span(step: str, key: str) -> str:
        v = [r[step][key] / MiB for r in runs]
        return f"{min(v):.0f}" if min(v) == max(v) else f"{min(v):.0f}..{max(v):.0f}"

    parts = [
        f"{s.replace('_', ' ')} {span(s, 'outside_bytes')} MiB (torch +{span(s, 'reserved_growth_bytes')})"
        for s in STEPS
    ]
    what = f"{res['case']} decode step" if res.get("case") else f"{res['dtype']} {res['n']}x{res['n']} matmul"
    return f"SUMMARY {len(runs)} runs, {what}, outside torch: " + "; ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--streams", type=int, default=0, help="N: what creating streams takes (child_streams)")
    ap.add_argument("--case", default="", help="a bench case's decode step instead of the matmul (child_case)")
    ap.add_argument("--tag", default="")
    add_out_dir(ap)
    add_overwrite(ap)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        got = (
            child_streams(args.streams)
            if args.streams
            else child_case(args.case)
            if args.case
            else child(args.dtype, args.n)
        )
        print("RESULT " + json.dumps(got), flush=True)
        return
    res = header(device=True)
    path = result_file(args, "side-stream", res["date"], args.tag)
    res.update(dtype=args.dtype, n=args.n, case=args.case, streams=args.streams, runs=[])
    flags = ["--case", args.case] if args.case else ["--dtype", args.dtype, "--n", str(args.n)]
    flags = ["--streams", str(args.streams)] if args.streams else flags
    for i in range(args.runs):
        p = run_module("side_stream_bench", ["--child", *flags], capture_output=True, text=True)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        r = json.loads(lines[-1][7:]) if lines and not p.returncode else {"error": (p.stderr or p.stdout)[-1500:]}
        res["runs"].append(r)
        print(f"run {i}: " + ("FAILED " + r["error"] if "error" in r else json.dumps(r)), flush=True)
    path.write(res)
    print(f"wrote {path.path}")
    print(summary(res))


if __name__ == "__main__":
    main_exit(main)
