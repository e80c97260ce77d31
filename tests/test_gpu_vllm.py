"""vLLM's graph kinds on a real GPU (marked ``gpu``; skipped where CUDA is absent):
the analytic ``full`` and ``piecewise`` programs against the pool measured when
the reference model's forward (up to the final norm, no logits, as vLLM's
graphs are) is captured the way each mode captures it.

Run on the device: ``python -m pytest -m gpu -q tests/test_gpu_vllm.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

SMALL = dict(layers=2, hidden=1024, heads=8, kv_heads=2, head_dim=128, intermediate=2048, vocab=32000)
SIZES = [1, 2, 4, 8, 16, 32, 64]
#: the capture strategy both tests follow by hand or through the executor (vLLM's:
#: largest first, outputs as weak references, one warm-up)
PINS = ("order=largest-first", "outputs=view", "warmup=once-per-phase", "pool=shared")


def _plan(tmp_path: Path, kind: str, extra: str = ""):
    from capture_plan.planner import BuildOptions, build_plan

    text = "[model]\n" + "".join(f"{k} = {v}\n" for k, v in SMALL.items())
    text += f'\n[[phases]]\nname = "{kind}"\nkind = "{kind}"\nsizes = {SIZES}\n{extra}'
    path = tmp_path / f"{kind}.toml"
    path.write_text(text)
    return build_plan(BuildOptions(backend="fa3", spec=path, strategies=PINS, output=tmp_path / f"{kind}.json"))


@pytest.fixture(scope="module")
def model():
    import torch.nn.functional as F

    from capture_plan.references.decode import ReferenceConfig, ReferenceModel, _rmsnorm
    from capture_plan.schemas.spec import Model

    class HiddenModel(ReferenceModel):
        """vLLM's graphs: the forward up to the final norm, logits computed outside
        the graph. While ``capturing`` is (pool, graphs), each attention call ends
        the current graph, runs eagerly into an output buffer the piece before it
        allocated, and begins the next graph in the same pool: vLLM's PIECEWISE."""

        capturing = None

        def run(self, phase, bs, workspace):
            assert workspace is None  # the plans here keep no hoisted workspace
            tpr = self.cfg.tokens[phase]
            h = F.embedding(self.input_ids[: bs * tpr], self.embed)
            for layer in self.layers:
                h = self._layer(layer, h, bs, tpr, None)
            return _rmsnorm(h, self.final_norm)

        def _attention(self, layer, q, k, v, bs, md, rows=None):
            if self.capturing is None:
                return super()._attention(layer, q, k, v, bs, md, rows)
            import torch

            pool, graphs, *marks = self.capturing
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # in the piece: in the pool
            graphs[-1].capture_end()
            if marks:  # the pool after each piece (a graph key's per-piece prediction)
                from capture_plan.executor.pool import pool_reserved

                marks[0].append(pool_reserved([pool]))
            out.copy_(super()._attention(layer, q, k, v, bs, md, rows))  # eager: outside the pool
            graphs.append(torch.cuda.CUDAGraph())
            graphs[-1].capture_begin(pool=pool)
            return out

    cfg = ReferenceConfig(
        model=Model(**SMALL), max_bs=64, max_seqlen=256, tokens={"decode": 1, "full": 1, "piecewise": 1}
    )
    return HiddenModel(cfg)


def test_full_phase_prediction_and_replays(tmp_path, model):
    """A FULL graph is one ordinary capture: the executor runs the plan as it is."""
    from capture_plan.executor import capture, verify

    plan = _plan(tmp_path, "full")
    gs = capture(plan, model, progress=False)
    try:
        measured = gs.report.pool_bytes
        assert abs(plan.predicted.pool_bytes - measured) / measured <= 0.10, (plan.predicted.pool_bytes, measured)
        res = verify(gs, checks=("interleave", "scribble"), rounds=2)
        assert res.ok, res.summary()
    finally:
        gs.release()


def test_piecewise_phase_prediction(tmp_path, model):
    """PIECEWISE captured by hand as vLLM does it (the executor captures one graph
    per step): largest first, one eager warm-up at the largest size, each size's
    pieces into one pool, outputs dropped after capture (vLLM keeps weak
    references). Memory only: replaying pieces needs the eager attention between
    them, which is the engine's runtime, not the plan's."""
    import torch

    from capture_plan.executor.pool import pool_reserved

    plan = _plan(tmp_path, "piecewise")
    assert [(s.op, s.bs) for s in plan.steps] == [("warmup", 64)] + [("capture", bs) for bs in sorted(SIZES)[::-1]]
    pool, stream, kept = torch.cuda.graph_pool_handle(), torch.cuda.Stream(), []
    try:
        with torch.cuda.stream(stream):
            model.prepare("piecewise", 64, 64, torch.Generator(device="cuda").manual_seed(0))
            del_me = model.run("piecewise", 64, None)  # the warm-up (cuBLAS's workspace lands outside the pool)
            del del_me
            torch.cuda.synchronize()
            for bs in sorted(SIZES, reverse=True):
                graphs = [torch.cuda.CUDAGraph()]
                model.capturing = (pool, graphs)
                graphs[0].capture_begin(pool=pool)
                out = model.run("piecewise", bs, None)
                graphs[-1].capture_end()
                model.capturing = None
                assert len(graphs) == SMALL["layers"] + 1  # one piece more than attention calls
                del out
                kept.append(graphs)
            torch.cuda.synchronize()
        measured = pool_reserved([pool])
        predicted = plan.predicted.pool_bytes
        assert abs(predicted - measured) / measured <= 0.10, (predicted, measured)
        # attention's own allocations stay out of the pool: no more than a FULL capture of the same sizes
        assert predicted <= _plan(tmp_path, "full").predicted.pool_bytes
    finally:
        model.capturing = None
        for graphs in kept:
            for g in graphs:
                g.reset()
        kept.clear()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def test_piecewise_prediction_per_piece(tmp_path, model):
    """A graph key's per-piece prediction (``pieces = "attention"``: layers + 1 pieces)
    against the pool measured after each piece when the largest size is captured
    alone, piece by piece, into a fresh pool (as the test above captures it)."""
    import itertools

    import torch

    from capture_plan.executor.pool import pool_reserved

    plan = _plan(tmp_path, "piecewise", 'pieces = "attention"\n')
    key = plan.predicted.keys[0]
    assert key.step == "capture/piecewise/64" and len(key.pieces) == SMALL["layers"] + 1
    pool, stream, marks, graphs = torch.cuda.graph_pool_handle(), torch.cuda.Stream(), [], []
    try:
        with torch.cuda.stream(stream):
            model.prepare("piecewise", 64, 64, torch.Generator(device="cuda").manual_seed(0))
            del_me = model.run("piecewise", 64, None)
            del del_me
            torch.cuda.synchronize()
            graphs.append(torch.cuda.CUDAGraph())
            model.capturing = (pool, graphs, marks)
            graphs[0].capture_begin(pool=pool)
            out = model.run("piecewise", 64, None)
            graphs[-1].capture_end()
            model.capturing = None
            marks.append(pool_reserved([pool]))
            del out
            torch.cuda.synchronize()
        predicted = list(itertools.accumulate(key.pieces))
        assert len(marks) == len(predicted)
        for i, (p, m) in enumerate(zip(predicted, marks)):
            assert abs(p - m) <= max(0.10 * m, 2 << 20), (i, predicted, marks)
    finally:
        model.capturing = None
        for g in graphs:
            g.reset()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
