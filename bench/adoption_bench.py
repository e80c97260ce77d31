"""Adoption benchmark on one GPU: an engine's own capture loop through ``capture_loop``
against ``capture(plan, target)``, on the same plan and model.

The engine here is shaped as SGLang's runners are (``EngineBackend``: a
``capture_one`` that warms up, records one graph and stores graph and outputs
under the engine's own key; one runner per phase with its own loop over sizes
and its own stream), adopted with the changes docs/adoption.md shows, marked
``# +``. Each case runs in a fresh process, in this order: ``capture()``, the
engine's loop, ``capture()`` again (a warm process, for the time). Recorded
per case: pool bytes, the per-step pool figures, the graphs and the dispatch
table of both, whether they are equal, the capture seconds, the free-memory
drop, and ``verify`` (interleave, scribble) on both GraphSets.

Cases (random weights, no download):

  reference    the 32-layer reference decode step (FA3 if importable), plans/fa3-ci.json's build
  eagle        the speculative reference, all four EAGLE phases, plans/fa3-eagle-ci.json's build
  llama        a transformers Llama (dense), SGLang's 36 decode sizes up to 256
  mixtral      a transformers Mixtral (MoE, top-2 of 8 experts)
  deepseek_v3  a transformers DeepSeek-V3 (MLA attention, routed and shared experts)

A case's model is sized for the device (``bench.harness.case_target``); a case that does
not fit is skipped, saying why (``skipped``, on the summary line).

Run: python -m bench.adoption_bench [--cases reference,eagle,...] [--out DIR] [--overwrite]
Writes bench/results/adoption-<date>.json (the harness's header, per case) and
prints a one-line summary last.
"""

from __future__ import annotations

import argparse
import json
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

CASES = ("reference", "eagle", "llama", "mixtral", "deepseek_v3")
#: the transformers cases' configs on top of bench.harness.HF_ARCHS: 4 layers (what
#: bench/results/adoption-2026-12-01.json measured)
HF_CONFIG = dict(num_hidden_layers=4, max_position_embeddings=4096)


# -- the engine: SGLang-shaped, adopted (each adoption change marked # +) ---------------
class EngineBackend:
    """SGLang's FullCudaGraphBackend in shape: ``capture_one`` warms up, records
    one graph, and keeps the graph and what ``hold`` returns under its own key."""

    def __init__(self, stream):
        self.stream, self.graphs, self.outputs = stream, {}, {}

    def capture_one(self, key, forward, step, before_run=None):
        import torch

        with step.warmup():  # +
            for _ in range(step.warmups):  # + was range(2)
                if before_run is not None:
                    before_run()
                forward()
        if before_run is not None:
            with step.eager():
                before_run()
        graph = torch.cuda.CUDAGraph()
        with step.graph(graph, pool=step.pool, stream=self.stream):  # + was torch.cuda.graph(graph, pool)
            out = forward()
        self.graphs[key] = graph
        self.outputs[key] = step.hold(out)  # +

    def cleanup(self):
        self.graphs.clear()
        self.outputs.clear()


def engine_capture(plan, model, device):
    """The engine's start-up: its own stream and backend, one runner loop per
    phase in the plan's order (was: its own phase list, each ``reversed(capture_bs)``)."""
    import torch

    from capture_plan.executor import capture_loop

    stream = torch.cuda.Stream(device=device)
    backend = EngineBackend(stream)
    with capture_loop(plan, stream=stream, device=device, target=model, on_failure=backend.cleanup) as loop:  # +
        for phase in loop.phases:  # +
            for bs in loop.sizes(phase):  # + was reversed(self.capture_bs)
                step = loop.step(phase, bs)  # +
                ws = step.workspace

                def refresh(bs=bs, ws=ws, phase=phase):
                    model.refresh(phase, bs, bs, ws)

                backend.capture_one(
                    (phase, bs),
                    lambda bs=bs, ws=ws, phase=phase: model.run(phase, bs, ws),
                    step,
                    None if ws is None else refresh,
                )
    return loop.graphs, backend


# -- the cases ---------------------------------------------------------------------------
def _facts(gs) -> dict:
    """What capture() and the engine's loop must agree on."""
    return dict(
        pool=gs.report.pool_bytes,
        steps=[(m.id, m.reserved) for m in gs.report.steps],
        graphs=[(f"{p}/{b}", c.pool, c.held, c.rows_per_request) for (p, b), c in gs.graphs.items()],
        dispatch={
            p: [gs.padded(p, n) for n in range(1, gs.table(p).sizes[-1] + 1)]
            for p in dict.fromkeys(q for q, _ in gs.graphs)
        },
    )


def _run(make) -> dict:
    """Capture with ``make()`` -> (GraphSet, engine or None); its facts, time, drop and verify."""
    import torch

    from capture_plan.executor import verify

    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    t0 = time.perf_counter()
    gs, engine = make()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    drop = free0 - torch.cuda.mem_get_info()[0]
    try:
        facts = _facts(gs)
        res = verify(gs, checks=("interleave", "scribble"))
        out = dict(
            facts=facts,
            seconds=seconds,
            drop_mib=drop / MiB,
            verify_ok=res.ok,
            verify_faults=len(res.faults),
            verify=res.summary(),
        )
    finally:
        if engine is not None:
            engine.cleanup()  # the engine drops its graphs and outputs first
        gs.release()
        torch.cuda.empty_cache()
    return out


def child(case: str) -> dict:
    import tempfile

    import torch

    from capture_plan.executor import capture
    from capture_plan.planner import build_plan

    with tempfile.TemporaryDirectory() as tmp:
        plan = build_plan(case_options(case, Path(tmp), **HF_CONFIG))
    target, why = fitted_target(case, plan, **HF_CONFIG)
    if why:
        return dict(skipped=why)
    device = torch.device("cuda", torch.cuda.current_device())
    for p in plan.phases:  # the engine ran its model eagerly before capture (module loading, cuBLAS)
        target.run(p.name, min(p.sizes), None)
    torch.cuda.synchronize()
    first = _run(lambda: (capture(plan, target, progress=False), None))
    engine = _run(lambda: engine_capture(plan, target, device))
    again = _run(lambda: (capture(plan, target, progress=False), None))
    a, b = first.pop("facts"), engine.pop("facts")
    again.pop("facts")
    return dict(
        plan=plan.name,
        graphs=len(a["graphs"]),
        phases=[p.name for p in plan.phases],
        predicted_pool_mib=plan.predicted.pool_bytes / MiB,
        pool_mib=dict(capture=a["pool"] / MiB, engine_loop=b["pool"] / MiB),
        equal=dict(
            pool=a["pool"] == b["pool"],
            steps=a["steps"] == b["steps"],
            graphs=a["graphs"] == b["graphs"],
            dispatch=a["dispatch"] == b["dispatch"],
        ),
        first_step_difference=next(([x, y] for x, y in zip(a["steps"], b["steps"]) if x != y), None),
        capture=first,
        engine_loop=engine,
        capture_again=again,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    add_out_dir(ap)
    add_overwrite(ap)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child)), flush=True)
        return
    cases = [c for c in args.cases.split(",") if c]
    bad = [c for c in cases if c not in CASES]
    if bad:
        ap.error(f"unknown case(s) {bad}; use {','.join(CASES)}")
    res = dict(header(device=True), bench="adoption", cases={})
    out = result_file(args, "adoption", res["date"])
    for case in cases:
        r = run_module("adoption_bench", ["--child", case], capture_output=True, text=True)
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
        res["cases"][case] = (
            json.loads(line[7:]) if line else dict(error=f"exit {r.returncode}", output=(r.stdout + r.stderr)[-3000:])
        )
        path = out.write(res)  # after every case: a later crash loses nothing
    rows = case_rows(res["cases"])
    print("\n".join(rows))
    print(f"SUMMARY {path.name}: " + "; ".join(rows))


def case_rows(cases: dict) -> list[str]:
    """One line per case: its figures, its error, or why it was skipped on this device."""
    rows = []
    for case, c in cases.items():
        if "error" in c:
            rows.append(f"{case}: {c['error']}")
            continue
        if "skipped" in c:
            rows.append(f"{case}: SKIPPED: {c['skipped']}")
            continue
        eq = all(c["equal"].values())
        rows.append(
            f"{case}: {c['graphs']} graphs, pool {c['pool_mib']['capture']:.0f}/{c['pool_mib']['engine_loop']:.0f} MiB "
            f"{'equal' if eq else 'DIFFER ' + str(c['equal'])}, "
            f"{c['capture_again']['seconds']:.2f}/{c['engine_loop']['seconds']:.2f} s, verify "
            f"{c['capture']['verify_faults']}/{c['engine_loop']['verify_faults']} faults"
        )
    return rows


if __name__ == "__main__":
    main_exit(main)
