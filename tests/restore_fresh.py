"""The fresh processes of tests/test_gpu_restore.py's restore test: one saves, another restores.

    python tests/restore_fresh.py save FOLDER          # capture a small reference plan, save its graph file
    python tests/restore_fresh.py restore FOLDER PAD   # restore it at other addresses, check, fall back

``save`` builds a 2-layer reference decode plan at four sizes (FA3 where importable) into
FOLDER/plan.json, makes the model ready (valid inputs, one eager run), captures and writes
FOLDER/graphs.cpgraphs. ``restore`` allocates PAD MiB first, so that the model, the
workspaces and the pools land at other addresses than the saving process's, makes the same
model as ready, restores the file, replays every restored graph against the eager run at
its size, runs ``verify``'s interleave and scribble checks, then restores a copy of the file
saved with another driver through ``restore_or_capture``: refused, captured, one WARNING.
Each prints one ``RESULT {json}`` line last; both exit 0 unless something raised.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

SMALL = dict(layers=2, hidden=1024, heads=8, kv_heads=2, head_dim=128, intermediate=2048, vocab=32000)
SIZES = [1, 2, 4, 8]


def _model():
    """The reference model, as ready as an engine has it before capture: valid inputs, one eager run."""
    import torch

    from capture_plan.references.decode import ReferenceConfig, ReferenceModel
    from capture_plan.schemas.spec import Model

    model = ReferenceModel(ReferenceConfig(model=Model(**SMALL), max_bs=max(SIZES), max_seqlen=256))
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    model.prepare("decode", max(SIZES), max(SIZES), gen)
    model.run("decode", max(SIZES), None)
    torch.cuda.synchronize()
    return model


def save(folder: Path) -> dict:
    from capture_plan.executor import capture
    from capture_plan.executor.fa3 import load_fa3
    from capture_plan.executor.graph_file import save_graphs
    from capture_plan.planner import BuildOptions, build_plan
    from capture_plan.schemas.codec import canonical_bytes

    spec = folder / "spec.toml"
    text = "[model]\n" + "".join(f"{k} = {v}\n" for k, v in SMALL.items())
    spec.write_text(text + f'\n[[phases]]\nname = "decode"\nkind = "decode"\nsizes = {SIZES}\n')
    fa3 = load_fa3() is not None
    plan = build_plan(BuildOptions(backend="fa3" if fa3 else "torch", ci=fa3, spec=spec))
    (folder / "plan.json").write_bytes(canonical_bytes(plan))
    model = _model()
    gs = capture(plan, model, progress=False)
    file = save_graphs(gs, plan, model, folder / "graphs.cpgraphs")
    out = {"graphs": len(gs.graphs), "nodes": sum(len(g.nodes) for g in file.graphs), "backend": plan.inputs.backend}
    gs.release()
    return out


class _Count(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def restore(folder: Path, pad_mib: int) -> dict:
    import msgspec
    import torch

    from capture_plan.executor import load_plan, restore_or_capture, verify
    from capture_plan.executor.graph_file import encode, read_graph_file
    from capture_plan.executor.graph_restore import restore as restore_graphs

    pad = torch.empty(pad_mib << 20, dtype=torch.uint8, device="cuda")  # everything after lands elsewhere
    plan = load_plan(folder / "plan.json", check_env=False)
    model = _model()
    gs = restore_graphs(plan, model, folder / "graphs.cpgraphs")
    report = gs.restored
    out: dict = {
        "pad": pad.data_ptr(),
        "restored": report is not None,
        "graphs": len(gs.graphs),
        "report": {
            k: getattr(report, k)
            for k in ("seconds", "parts", "graphs", "nodes", "keys", "segments", "moved", "builder")
        },
    }
    # every graph against the eager run at its size, bit for bit, on fresh inputs
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1)
    equal, differ = [], []
    for phase, bs in sorted(gs.graphs, key=lambda key: gs.graphs[key].order):  # no Captured held past release
        model.prepare(phase, bs, bs, gen)
        got = [t.clone() for t in gs.replay(phase, bs)]
        ref = [t.clone() for t in gs.eager(phase, bs)]
        torch.cuda.synchronize()
        same = len(got) == len(ref) > 0 and all(torch.equal(a, b) for a, b in zip(got, ref))
        (equal if same else differ).append(f"{phase}/{bs}")
    out.update(equal=equal, differ=differ)
    res = verify(gs, checks=("interleave", "scribble"), seed=3)
    out["verify"] = {"ok": res.ok, "replays": res.replays, "summary": res.summary()}
    gs.release()
    # the fallback: a file saved with another driver is refused, captured instead, one WARNING
    file = read_graph_file(folder / "graphs.cpgraphs")
    other = msgspec.structs.replace(file, valid_for=msgspec.structs.replace(file.valid_for, driver="0.0"))
    (folder / "other-driver.cpgraphs").write_bytes(encode(other))
    count = _Count()
    logging.getLogger("capture_plan.executor").addHandler(count)
    try:
        fell = restore_or_capture(plan, model, folder / "other-driver.cpgraphs", progress=False)
    finally:
        logging.getLogger("capture_plan.executor").removeHandler(count)
    out["fallback"] = {"restored": fell.restored is not None, "graphs": len(fell.graphs), "warnings": count.lines}
    fell.release()
    del pad
    return out


def main(argv: list[str]) -> int:
    what, folder = argv[0], Path(argv[1])
    result = save(folder) if what == "save" else restore(folder, int(argv[2]))
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
