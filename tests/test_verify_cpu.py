"""verify() on CPU, CUDA faked (tests/fake_cuda.py): pool fills, the scribble
check, and interleave blaming only the graph that is wrong."""

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
