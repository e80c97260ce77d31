"""An engine-shaped graph runner, as SGLang and vLLM shape theirs, adopted onto
``capture_loop`` (each adoption change marked ``# +``): the CPU tests (CUDA
faked) and the GPU tests run it.

``model`` is anything with ``forward(phase, bs, workspace)`` (what the
engine's forward returns) and ``refresh(phase, n, bs, workspace)`` (the
engine's metadata computation for a hoisted workspace).
"""

from __future__ import annotations

import torch


class Backend:
    """The shape of SGLang's FullCudaGraphBackend: ``capture_one`` warms up,
    records one graph and stores it and its outputs under the engine's own
    key; ``cleanup`` drops them. Each adoption change is marked ``# +``."""

    def __init__(self, stream):
        self.stream = stream
        self.graphs: dict = {}
        self.outputs: dict = {}
        #: how the engine gets it wrong, for the fault tests
        self.pool_override = self.stream_override = None
        self.output_override = None
        self.hold_at: tuple | None = None

    def capture_one(self, key, forward_fn, step, before_run=None):
        with step.warmup():  # +
            for _ in range(step.warmups):  # + was range(2)
                if before_run is not None:
                    before_run()
                forward_fn()
        if before_run is not None:
            with step.eager():  # on the capture stream; ordered against replays in a background capture
                before_run()
        graph = torch.cuda.CUDAGraph()
        with step.graph(
            graph,
            pool=self.pool_override or step.pool,  # + was torch.cuda.graph(...)
            stream=self.stream_override or self.stream,
        ):
            out = forward_fn()
        if self.output_override is not None:
            out = self.output_override(out)
        if self.hold_at is not None and key == self.hold_at:
            return  # the engine forgets hold() here
        self.graphs[key] = graph
        self.outputs[key] = step.hold(out)  # +

    def cleanup(self):
        self.graphs.clear()
        self.outputs.clear()


class Runner:
    """One per phase, as SGLang's decode runner and EAGLE draft runners: its
    own loop over sizes (the plan's now), its own workspace computation, one
    shared backend and pool."""

    def __init__(self, phase: str, model, backend: Backend):
        self.phase, self.model, self.backend = phase, model, backend
        self.sizes = None  # the engine's own list, for the fault tests

    def capture(self, loop):
        for bs in self.sizes or loop.sizes(self.phase):  # + was reversed(self.capture_bs)
            step = loop.step(self.phase, bs)  # +
            ws = step.workspace
            # the engine computes a hoisted workspace's metadata before every run, outside the graph
            refresh = None if ws is None else (lambda bs=bs, ws=ws: self.model.refresh(self.phase, bs, bs, ws))
            self.backend.capture_one(
                (self.phase, bs), lambda bs=bs, ws=ws: self.model.forward(self.phase, bs, ws), step, refresh
            )


def make_engine(plan, model, device, *, phases=None, stream=None, **kw):
    """The engine's start-up up to its capture: its stream (a new one unless
    given), its backend, one runner per phase (the plan's order unless
    ``phases``), and the loop (``kw`` for ``capture_loop``). Returns (loop,
    backend, runners)."""
    from capture_plan.executor import capture_loop

    stream = stream if stream is not None else torch.cuda.Stream()
    backend = Backend(stream)
    loop = capture_loop(plan, stream=stream, device=device, on_failure=backend.cleanup, **kw)
    return loop, backend, [Runner(p, model, backend) for p in phases or loop.phases]


def run_engine(plan, model, device, *, configure=None, **kw):
    """:func:`make_engine`, then the engine's loop over its runners in the
    ``with`` block; ``configure(backend, runners)`` may break it first.
    Returns the loop and the backend."""
    loop, backend, runners = make_engine(plan, model, device, **kw)
    if configure is not None:
        configure(backend, runners)
    with loop:
        for runner in runners:
            runner.capture(loop)
    return loop, backend


class TargetModel:
    """A CaptureTarget as the engine's model: its ``run`` is the forward, its
    ``refresh`` the metadata computation (GPU tests: the reference models)."""

    def __init__(self, target):
        self.target = target

    def forward(self, phase, bs, ws):
        return self.target.run(phase, bs, ws)

    def refresh(self, phase, n, bs, ws):
        self.target.refresh(phase, n, bs, ws)


def plain_loop(target, phases: dict[str, list[int]], warmups: int = 1):
    """What an engine does without capture-plan (GPU): its own stream, one
    pool, every phase largest-first, ``warmups`` eager runs per size, one
    ``torch.cuda.graph`` per size, outputs kept. Returns (graphs, outputs,
    pool), graphs keyed by (phase, bs) in capture order."""
    stream = torch.cuda.Stream()
    pool = torch.cuda.graph_pool_handle()
    graphs, outputs = {}, {}
    with torch.cuda.stream(stream):
        for phase, sizes in phases.items():
            for bs in sorted(sizes, reverse=True):
                for _ in range(warmups):
                    target.run(phase, bs, None)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=stream):
                    out = target.run(phase, bs, None)
                graphs[(phase, bs)], outputs[(phase, bs)] = g, out
                del out
    return graphs, outputs, pool


def planted_child(plan_path: str, bugs: tuple[str, ...], mode: str, checks: tuple[str, ...]) -> None:
    """Capture the plan's phases of ``capture_plan.references.planted.small_model(bugs)``
    through the engine-shaped runner (``mode="loop"``: ``capture_loop`` with
    the allocation history) or the plain loop (``mode="plain"``: adopted,
    recorded by ``record_graphs``), then verify and print as
    ``capture_plan.references.planted.planted_verify`` does."""
    from capture_plan.executor import adopt, record_graphs
    from capture_plan.executor.load import load_plan
    from capture_plan.references.planted import planted_verify, small_model

    plan = load_plan(plan_path, check_env=False)
    target = small_model(bugs, max_bs=max(max(p.sizes) for p in plan.phases))
    device = torch.device("cuda", torch.cuda.current_device())
    if mode == "loop":
        loop, _ = run_engine(plan, TargetModel(target), device, target=target, record=True)
        gs = loop.graphs
    else:
        with record_graphs() as rec:
            graphs, outputs, pool = plain_loop(target, {p.name: p.sizes for p in plan.phases})
        gs = adopt(graphs, outputs, pool=pool, target=target, recorded=rec)
    planted_verify(gs, checks)


def planted(plan_path, bugs, mode: str, checks=("interleave", "footprint"), timeout: float = 600) -> dict:
    """:func:`planted_child` in a fresh Python process (a planted write can end
    the CUDA context); returns its parsed output: exit, captured, failed, result, output."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    program = (
        f"import sys; sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}]\n"
        "from engine_shaped import planted_child\n"
        f"planted_child({str(plan_path)!r}, {tuple(bugs)!r}, {mode!r}, {tuple(checks)!r})\n"
    )
    r = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=timeout)
    out = dict(exit=r.returncode, captured=None, failed=None, result=None, output=(r.stdout + r.stderr)[-3000:])
    for line in r.stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word == "CAPTURED":
            out["captured"] = int(rest)
        elif word == "FAILED" and out["failed"] is None:
            out["failed"] = line
        elif word == "RESULT":
            out["result"] = json.loads(rest)
    return out
