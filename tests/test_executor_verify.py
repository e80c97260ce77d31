"""verify() on CPU with CUDA faked: on graphs capture() made from a plan, and on graphs an
engine captured itself (adopt).

verify() on CPU, CUDA faked (tests/fake_cuda.py): pool fills, the scribble
check, and interleave blaming only the graph that is wrong.

verify() on graphs an engine captured itself (``capture_plan.executor.engine.adopt``), on
CPU with CUDA faked: a plain capture loop into one pool, no plan, verified
with the engine's eager function finds exactly what verify finds on the same
model captured by ``capture(plan, target)``, and nothing on a clean one."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from fake_cuda import decode_plan as _plan  # noqa: E402

CPU = torch.device("cpu")


def test_fill_writes_the_byte_over_exactly_the_given_ranges():
    from capture_plan.executor.verification import CANARY, SCRIBBLE, _fill

    buf = torch.zeros(64, dtype=torch.uint8)
    base = buf.data_ptr()
    _fill([(base + 4, 8), (base + 40, 3)], SCRIBBLE, CPU)
    want = torch.zeros(64, dtype=torch.uint8)
    want[4:12] = SCRIBBLE
    want[40:43] = SCRIBBLE
    assert torch.equal(buf, want)
    _fill([(base, 64)], CANARY, CPU)
    assert bool((buf == CANARY).all())
    _fill([], SCRIBBLE, CPU)  # no segments: nothing written
    assert bool((buf == CANARY).all())


class Outputs:
    """out = x[:bs] * 2 + 1 in a fresh tensor per call, as a model allocating
    its output does (a graph's output is its own memory, an eager run's is
    new). The graph of ``wrong_bs`` adds 1 when replayed: its replays differ
    from eager, and so does its kept output ever after."""

    def __init__(self, fake, wrong_bs=None, max_bs=16):
        self.fake, self.wrong_bs = fake, wrong_bs
        self.x = torch.zeros(max_bs, 4)

    def _out(self, bs):
        return self.fake.pool_tensor(bs, 4) if self.fake.recording is not None else torch.empty(bs, 4)

    def run(self, phase, bs, ws):
        out = self._out(bs)
        torch.add(self.x[:bs] * 2, 1, out=out)
        g = self.fake.recording
        if g is not None:
            extra = 2 if bs == self.wrong_bs else 1
            g.calls.append(lambda: torch.add(self.x[:bs] * 2, extra, out=out))
        return out

    def prepare(self, phase, n, bs, gen):
        self.x.normal_(generator=gen)

    def refresh(self, phase, n, bs, ws):
        pass


@pytest.mark.parametrize("seed", range(6))
def test_interleave_blames_only_the_graph_whose_replay_differs(tmp_path, fake, seed):
    """A kept output whose own replay already differed from eager is no
    reference: the graphs replayed after it wrote nothing into it."""
    from capture_plan.executor import capture, verify

    plan = _plan(tmp_path, [1, 2, 4, 8, 16])
    gs = capture(plan, Outputs(fake, wrong_bs=4), progress=False, device=CPU)
    try:
        res = verify(gs, checks=("interleave",), seed=seed, rounds=2)
    finally:
        gs.release()
    assert res.faults, "the wrong graph went unnoticed"
    assert {f.graph for f in res.faults} == {"decode/4"}, res.summary(20)
    assert all("differ from eager" in f.detail and "kept output changed" not in f.detail for f in res.faults)
    assert res.replays == 3 * 5  # two shuffled orders and the reversed one


def test_interleave_passes_graphs_that_match_eager(tmp_path, fake):
    from capture_plan.executor import capture, verify

    gs = capture(_plan(tmp_path, [1, 2, 4, 8, 16]), Outputs(fake), progress=False, device=CPU)
    try:
        res = verify(gs, checks=("interleave",), rounds=2)
    finally:
        gs.release()
    assert res.ok, res.summary()


class Scratch(Outputs):
    """Adds a scratch buffer that lies in the graph pool (``pool``) and must be
    zeroed before use; the ``lazy_bs`` graph zeroes it while capturing only, so
    its replays read whatever the pool holds -- zeros, until something else
    writes there. Interleave cannot see that; the scribble check can."""

    def __init__(self, fake, lazy_bs, pool: torch.Tensor):
        super().__init__(fake)
        self.lazy_bs, self.scratch = lazy_bs, pool.view(torch.float32)

    def run(self, phase, bs, ws):
        out = self._out(bs)
        scratch = self.scratch[: bs * 4].view(bs, 4)

        def compute(zero=True):
            if zero:
                scratch.zero_()
            torch.add(self.x[:bs] * 2 + 1, scratch, out=out)

        compute()
        g = self.fake.recording
        if g is not None:
            g.calls.append(lambda: compute(zero=bs != self.lazy_bs))
        return out


def test_scribble_catches_a_graph_that_reads_pool_memory_it_did_not_write(tmp_path, fake):
    from capture_plan.executor import capture, verify

    pool = torch.zeros(16 * 4 * 4, dtype=torch.uint8)
    gs = capture(_plan(tmp_path, [1, 2, 4, 8, 16]), Scratch(fake, 8, pool), progress=False, device=CPU)
    (pid,) = gs.pools.values()
    fake.segments = [{"address": pool.data_ptr(), "total_size": pool.numel(), "segment_pool_id": pid}]
    assert gs.report.pool_bytes == sum(4 * 4 * b for b in (1, 2, 4, 8, 16))  # the outputs
    try:
        assert verify(gs, checks=("interleave",)).ok  # the pool still holds zeros: nothing to see
        res = verify(gs, checks=("scribble",))
    finally:
        fake.segments = []
        gs.release()
    assert [(f.check, f.graph) for f in res.faults] == [("scribble", "decode/8")], res.summary()
    assert "reads pool memory it did not write" in res.faults[0].detail


SIZES = [1, 2, 4, 8, 16]


def _plain_loop(target, sizes=SIZES):
    """What an engine does without capture-plan: largest first, a warm-up per
    size, one graph per size into one pool, graphs and outputs kept by size."""
    pool = torch.cuda.graph_pool_handle()
    graphs, outputs = {}, {}
    for bs in reversed(sizes):
        target.run("decode", bs, None)  # warm-up
        g = torch.cuda.CUDAGraph()
        g.capture_begin(pool=pool)
        out = target.run("decode", bs, None)
        g.capture_end()
        graphs[bs], outputs[bs] = g, out
    return graphs, outputs, pool


def _adopted(target, **kw):
    from capture_plan.executor import adopt

    graphs, outputs, pool = _plain_loop(target)
    return adopt(
        graphs,
        outputs,
        pool=pool,
        eager=lambda phase, bs: target.run(phase, bs, None),
        prepare=target.prepare,
        device=CPU,
        **kw,
    )


def _faults(res) -> list[tuple[str, str, str]]:
    return [(f.check, f.graph, f.detail) for f in res.faults]


@pytest.mark.parametrize("seed", range(4))
def test_adopted_graphs_verify_like_executor_captured_ones(tmp_path, fake, seed):
    from capture_plan.executor import capture, verify

    wrong = Outputs(fake, wrong_bs=4)
    ours = capture(_plan(tmp_path, SIZES), wrong, progress=False, device=CPU)
    theirs = _adopted(Outputs(fake, wrong_bs=4))
    try:
        assert [(c.phase, c.bs, c.order, c.rows_per_request, c.held) for c in theirs.graphs.values()] == [
            (c.phase, c.bs, c.order, c.rows_per_request, c.held) for c in ours.graphs.values()
        ]
        assert [theirs.padded("decode", n) for n in range(1, 17)] == [ours.padded("decode", n) for n in range(1, 17)]
        a = verify(ours, checks=("interleave",), seed=seed, rounds=2)
        b = verify(theirs, checks=("interleave",), seed=seed, rounds=2)
    finally:
        ours.release()
    assert b.faults and {f.graph for f in b.faults} == {"decode/4"}, b.summary(20)
    assert _faults(b) == _faults(a) and b.replays == a.replays
    clean = _adopted(Outputs(fake))
    assert verify(clean, checks=("interleave",), seed=seed, rounds=2).ok


def test_scribble_finds_the_lazy_graph_among_adopted_ones(fake):
    from capture_plan.executor import verify

    pool_mem = torch.zeros(16 * 4 * 4, dtype=torch.uint8)
    gs = _adopted(Scratch(fake, 8, pool_mem))
    (pid,) = gs.pools.values()
    fake.segments = [{"address": pool_mem.data_ptr(), "total_size": pool_mem.numel(), "segment_pool_id": pid}]
    try:
        res = verify(gs, checks=("interleave", "scribble"))
    finally:
        fake.segments = []
    assert [(f.check, f.graph) for f in res.faults] == [("scribble", "decode/8")], res.summary()


class ReadOnly(Outputs):
    """The graph of ``bad_bs`` also bumps a weight on replay."""

    def __init__(self, fake, bad_bs):
        super().__init__(fake)
        self.weight, self.bad_bs = torch.ones(4), bad_bs

    def run(self, phase, bs, ws):
        out = super().run(phase, bs, ws)
        g = self.fake.recording
        if g is not None and bs == self.bad_bs:
            g.calls.append(lambda: self.weight.add_(1))
        return out


def test_read_only_tensors_given_to_adopt_are_guarded(fake):
    from capture_plan.executor import verify

    target = ReadOnly(fake, 2)
    res = verify(_adopted(target, read_only={"lm_head": target.weight}), checks=("interleave",))
    assert "read-only" in res.checks
    assert {f.graph for f in res.faults if f.check == "read-only"} == {"decode/2"}, res.summary()


def test_without_prepare_float_inputs_are_redrawn_and_integer_ones_kept(fake):
    from capture_plan.executor import EngineFunctions

    x, idx = torch.zeros(4, 2), torch.arange(4)
    fns = EngineFunctions(lambda phase, bs: x[:bs], inputs={"x": x, "idx": idx})
    gen = torch.Generator()
    gen.manual_seed(0)
    fns.prepare("decode", 2, 4, gen)
    assert not torch.equal(x, torch.zeros(4, 2)) and torch.equal(idx, torch.arange(4))
    assert fns.run("decode", 2, None)[0].shape == (2, 2) and fns.read_only() == {}


def test_bad_adoption_input_is_one_clear_error(fake):
    from capture_plan.executor import ExecutorError, adopt

    target = Outputs(fake)
    graphs, outputs, pool = _plain_loop(target, [1, 2])
    eager = lambda phase, bs: target.run(phase, bs, None)  # noqa: E731
    cases = [
        (dict(graphs=graphs, outputs={2: outputs[2]}, pool=pool, eager=eager), r"no outputs for graph decode/1"),
        (dict(graphs={"two": graphs[2]}, outputs=outputs, pool=pool, eager=eager), r"graph key 'two' is neither"),
        (dict(graphs=graphs, outputs=outputs, pool=pool), r"needs the engine's eager function"),
        (dict(graphs=graphs, outputs=outputs, pool=pool, eager=eager, held="weak"), r"held='weak'"),
        (
            dict(graphs=graphs, outputs={1: outputs[1], 2: torch.zeros(3, 4)}, pool=pool, eager=eager),
            r"adopt, graph decode/2: output has 3 rows, not a multiple of bs 2",
        ),
        (dict(graphs=graphs, outputs=outputs, pool={"verify": pool}, eager=eager), r"no pool for phase 'decode'"),
    ]
    for kw, message in cases:
        with pytest.raises(ExecutorError, match=message):
            adopt(device=CPU, **kw)


def test_footprint_on_adopted_graphs_without_the_history_says_how_to_record_it(fake):
    from capture_plan.executor import VerificationFailed, verify

    with pytest.raises(VerificationFailed, match=r"needs the allocation history.*record_graphs\(\)"):
        verify(_adopted(Outputs(fake)), checks=("footprint",))


def test_record_graphs_pairs_each_graph_with_its_own_window_when_a_capture_fails(monkeypatch):
    """The wrapping alone (the history is the GPU tests'): a failed capture in
    the middle is left out and the graphs after it keep their own windows."""
    from capture_plan.executor import engine

    class Recorder:
        def __init__(self, max_entries):
            self.pairs, self.open = [], None

        def begin(self):
            self.open = len(self.pairs)

        def end(self):
            self.pairs.append(f"window {self.open}")

        def stop(self):
            return list(self.pairs)

        def close(self):
            pass

    class Graph:
        def capture_begin(self, pool=None, capture_error_mode="global"):
            pass

        def capture_end(self):
            if getattr(self, "broken", False):
                raise RuntimeError("capture invalidated")

    monkeypatch.setattr(engine, "AllocationRecorder", Recorder)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    graphs = [Graph(), Graph(), Graph()]
    graphs[1].broken = True
    methods = (Graph.capture_begin, Graph.capture_end)
    with engine.record_graphs() as rec:
        for g in graphs:
            g.capture_begin()
            try:
                g.capture_end()
            except RuntimeError:
                pass
    assert rec.graphs == [graphs[0], graphs[2]]
    assert [rec.window(g) for g in graphs] == ["window 0", None, "window 2"]
    assert (Graph.capture_begin, Graph.capture_end) == methods  # unwrapped again
