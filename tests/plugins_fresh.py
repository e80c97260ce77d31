"""The fresh processes of tests/test_gpu_plugins_restore.py: an engine start-up through its plugin
that writes the graph file, then another that restores from it.

    python tests/plugins_fresh.py save ENGINE FOLDER           # no file yet: capture, write it
    python tests/plugins_fresh.py restore ENGINE FOLDER PAD    # PAD MiB allocated first: restore from it

ENGINE is ``sglang`` (SGLang 0.5.23's four runners, the EAGLE reference's phases, LoRA x
attention variants) or ``vllm`` (vLLM 0.34.0's model manager, its FULL decode graphs), the
engine-faithful runners of tests/engines/ as the engines ship them, routed by the plugin with
``CAPTURE_PLAN_PLAN`` and ``CAPTURE_PLAN_GRAPHS=FOLDER/graphs.cpgraphs`` set. ``save`` builds
the plan into FOLDER/plan.json, starts the engine (its model seeded, so both processes have the
same weights and inputs), and replays every graph the engine keeps on inputs drawn from a
seeded generator, writing their outputs to FOLDER/replays.pt. ``restore`` allocates PAD MiB
first (so that its model, workspaces and pools lie elsewhere), starts the same engine, and
replays every graph the engine keeps on the same inputs: each output compared bit for bit with
the saving process's replay of the captured graph, and with the eager forward. Each prints one
``RESULT {json}`` line last; both exit 0 unless something raised.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # tests/: engines, fake runners

SIZES = [1, 2, 4, 8, 16]
HIDDEN = 256


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record):
        self.lines.append((record.levelname, record.getMessage()))


def _plan(engine: str, folder: Path):
    from engines import harness
    from engines.plans import build
    from engines.plugged import plan_file

    if engine == "sglang":
        plan = harness.sglang_plan(folder, SIZES)
    else:
        spec = f'[[phases]]\nname = "full_decode"\nkind = "full"\nsizes = {SIZES}\n'
        plan = build(folder, spec, "warmup=every-size", "outputs=view")
    return plan_file(folder, plan)


def _start(engine: str, mp, folder: Path, work: Path):
    """The engine's start-up through its plugin; (every graph the engine keeps: name -> a function
    replaying it and returning its output, the eager forward of each: name -> function, the
    adoption)."""
    import torch

    from capture_plan.adapters.plugins import sglang as sgl_plugin, vllm as vllm_plugin
    from capture_plan.executor.load import load_plan
    from engines import harness
    from engines.plugged import sglang_release, vllm_release
    from engines.toy import ToyModel

    device = torch.device("cuda", torch.cuda.current_device())
    plan = load_plan(folder / "plan.json", check_env=False)
    replays, eager = {}, {}
    if engine == "sglang":
        module = sglang_release(mp, work, fits=False)
        sgl_plugin.register()
        tokens = {p.name: p.tokens_per_request for p in plan.phases}
        model = ToyModel(tokens, max_tokens=max(SIZES) * max(tokens.values()), hidden=HIDDEN, device=device)
        module.reset_globals()
        runners = harness.sglang_runners(module, model, SIZES)
        phases = list(dict.fromkeys(s.phase for s in plan.steps if s.op == "capture"))
        for runner in sorted(runners, key=lambda r: phases.index(r.phase)):
            runner.capture()
        for runner in runners:
            for key in runner.backend._graphs:
                size, lora, attention = key
                labels = {k: v for k, v in (("lora", lora), ("attention", attention)) if v is not None}
                name = f"{runner.phase}/{size}/{lora}/{attention}"
                replays[name] = lambda b=runner.backend, k=key: b.replay(k)
                eager[name] = lambda p=runner.phase, n=size, lb=labels: model.forward(p, n, lb)
        adoption = module.FullCudaGraphBackend.__capture_plan__
        keep = runners
    else:
        module = vllm_release(mp, work, version="0.34.0", fits=False)
        vllm_plugin.register()
        model = ToyModel({"piecewise": 1}, max_tokens=max(SIZES), hidden=HIDDEN, device=device)
        module.reset_globals()
        runner = module.GPUModelRunner(model, SIZES, cudagraph_mode=module.FULL_DECODE_ONLY)
        runner.capture_model()
        manager = runner.cudagraph_manager

        def replay(desc):
            manager.graphs[desc].replay()
            return manager.hidden_states[: desc.num_tokens]

        for desc in manager.graphs:
            replays[f"full_decode/{desc.num_tokens}"] = lambda d=desc: replay(d)
            eager[f"full_decode/{desc.num_tokens}"] = lambda n=desc.num_tokens: manager.compiled(model.x[:n])
        adoption = module.CudaGraphManager.__capture_plan__
        keep = runner
    return model, replays, eager, adoption, keep


def run(what: str, engine: str, folder: Path, pad_mib: int = 0) -> dict:
    import pytest
    import torch

    from capture_plan.adapters.plugins import core

    pad = torch.empty(pad_mib << 20, dtype=torch.uint8, device="cuda") if pad_mib else None
    lines = _Lines()
    logging.getLogger("capture_plan.plugins").addHandler(lines)
    logging.getLogger("capture_plan.plugins").setLevel(logging.INFO)
    with pytest.MonkeyPatch.context() as mp:
        if what == "save":
            _plan(engine, folder)
        mp.setenv(core.ENV_PLAN, str(folder / "plan.json"))
        mp.setenv(core.ENV_GRAPHS, str(folder / "graphs.cpgraphs"))
        work = folder / what
        work.mkdir(exist_ok=True)
        model, replays, eager, adoption, keep = _start(engine, mp, folder, work)
        outcome = adoption.graphs.outcome
        gen = torch.Generator(device="cuda")
        gen.manual_seed(1)
        model.x.normal_(generator=gen)  # inputs the graphs read live: the same in both processes
        got = {name: fn().clone() for name, fn in sorted(replays.items())}
        ref = {name: fn().clone() for name, fn in sorted(eager.items())}
        torch.cuda.synchronize()
        out: dict = {
            "outcome": outcome.what,
            "line": outcome.line(),
            "saved": outcome.saved,
            "graphs": len(got),
            "warnings": [m for level, m in lines.lines if level == "WARNING"],
            "eager_close": sorted(n for n in got if torch.allclose(got[n], ref[n], atol=1e-3, rtol=1e-3)),
        }
        if what == "save":
            torch.save({n: t.cpu() for n, t in got.items()}, folder / "replays.pt")
        else:
            saved = torch.load(folder / "replays.pt")
            out["equal"] = sorted(n for n in got if n in saved and torch.equal(got[n].cpu(), saved[n]))
            out["differ"] = sorted(n for n in got if n not in out["equal"])
            report = outcome.report  # None where the start-up captured instead (out["line"] says why)
            fields = ("seconds", "graphs", "nodes", "keys", "segments", "moved")
            out["report"] = {k: getattr(report, k) for k in fields} if report is not None else {}
            out["pad"] = pad.data_ptr() if pad is not None else 0
        del got, ref, replays, eager, keep, adoption, model
    logging.getLogger("capture_plan.plugins").removeHandler(lines)
    return out


def main(argv: list[str]) -> int:
    what, engine, folder = argv[0], argv[1], Path(argv[2])
    result = run(what, engine, folder, int(argv[3]) if len(argv) > 3 else 0)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
