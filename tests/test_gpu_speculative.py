"""The speculative (EAGLE) reference on a real GPU, and the bug class verify exists for.

Run on the device: ``python -m pytest -m gpu -q tests/test_gpu_speculative.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

SIZES = [1, 2, 4, 8, 16, 32]


def plan_for(tmp_path: Path, strategies=(), ci=True, **kw):
    from capture_plan.planner import BuildOptions, build_plan
    from capture_plan.references.planted import spec_toml

    path = tmp_path / "spec.toml"
    path.write_text(spec_toml(kw.pop("sizes", SIZES), **kw))
    return build_plan(BuildOptions(backend="fa3", ci=ci, spec=path, strategies=tuple(strategies)))


def make(bugs=(), **kw):
    from capture_plan.references.planted import small_model

    return small_model(bugs, max_bs=max(SIZES), **kw)


@pytest.fixture(scope="module")
def clean():
    return make()


def test_triton_metadata_kernels_equal_their_torch_specification(clean):
    import torch

    m = clean
    gen = torch.Generator(device="cuda")
    for seed in range(5):
        gen.manual_seed(seed)
        bs = 3 + seed * 7
        m.prepare("draft_decode", bs - 2, bs, gen)
        triton_out = [t.clone() for t in m.run("draft_decode", bs, None)]
        kernels, m.kernels = m.kernels, None
        try:
            torch_out = m.run("draft_decode", bs, None)
        finally:
            m.kernels = kernels
        for a, b in zip(triton_out, torch_out):
            assert torch.equal(a, b), seed


def test_metadata_kernels_write_the_same_buffers_as_their_specification(clean):
    """Every buffer a Triton metadata kernel writes, entry for entry (not only
    what the phase returns), equals the torch specification's, padded rows
    included; entries neither writes keep their fill."""
    import torch

    from capture_plan.references.speculative_kernels import _torch_kv_rows, _torch_page_scatter

    m, cfg = clean, clean.cfg
    k, width, stride = cfg.topk, cfg.draft_kv_width or cfg.num_steps, cfg.draft_page_cols
    gen = torch.Generator(device="cuda")
    i32 = dict(dtype=torch.int32, device="cuda")
    for seed in range(4):
        gen.manual_seed(seed)
        bs = 3 + 9 * seed
        m.prepare("draft_decode", max(1, bs - seed), bs, gen)
        slots, lens, rows = m._slots(bs), m.seq_lens[:bs], bs * k
        for step in range(cfg.num_steps):
            a, b = torch.full((rows * width,), -7, **i32), torch.full((rows * width,), -7, **i32)
            ra = m.kernels.kv_rows(m.req_to_token, slots, lens, step, a, k, width, cfg.max_seqlen)
            rb = _torch_kv_rows(m.req_to_token, slots, lens, step, b, k, width)
            assert torch.equal(a, b) and torch.equal(ra, rb), (seed, step)
        branch = slots.long().repeat_interleave(k)
        pos = lens.long().repeat_interleave(k)[:, None] + torch.arange(cfg.num_steps, device="cuda")
        locs = m.req_to_token[branch[:, None], pos].long()
        a, b = torch.full((rows * stride,), -7, **i32), torch.full((rows * stride,), -7, **i32)
        pa = m.kernels.page_scatter(locs, a, stride, cfg.page_size)
        pb = _torch_page_scatter(locs, b, stride, cfg.page_size)
        assert torch.equal(a, b) and torch.equal(pa, pb), seed
        a, b = m.slot_accept.clone(), m.slot_accept.clone()
        m.kernels.record_accept(slots, m.accept_lens[:bs], a, False)
        b[:, 0].index_copy_(0, slots.long(), m.accept_lens[:bs])
        # every padded row writes the spare row: which one lands last is unspecified in both
        real = torch.arange(a.shape[0], device="cuda") != m.pad_row
        assert torch.equal(a[real], b[real]), seed


@pytest.mark.parametrize("plan_file", ["fa3-eagle-ci", "fa3-eagle"])
def test_every_phase_captures_as_planned_and_verifies_clean(tmp_path, clean, plan_file):
    from capture_plan.executor import capture, verify

    plan = plan_for(tmp_path, ci=plan_file.endswith("-ci"))
    gs = capture(plan, clean, progress=False, record=True)
    try:
        assert list(gs.graphs) == [(s.phase, s.bs) for s in plan.steps if s.op == "capture"]
        res = verify(gs)
        assert res.ok, res.summary()
        assert "read-only" in res.checks
        assert gs.report.pool_bytes > 0
    finally:
        gs.release()


def _planted(tmp_path, bug, strategies=(), **kw):
    """The planted-bug run of :func:`capture_plan.references.planted.planted_run` (a fresh
    process: a planted write can end the CUDA context, and it must not take the
    other tests with it) on the plan of :func:`plan_for`."""
    from capture_plan.planner import plan_bytes
    from capture_plan.references.planted import planted_run

    path = tmp_path / "plan.json"
    path.write_bytes(plan_bytes(plan_for(tmp_path, strategies)))
    return planted_run(path, (bug,), **kw)


def _faults(tmp_path, bug, strategies=(), **model) -> dict:
    """verify's interleave and footprint faults for one planted bug."""
    run = _planted(tmp_path, bug, strategies, **model)
    assert run.exit == 0 and run.result is not None, run.output
    return run.result


def _named(res: dict) -> set[int]:
    """draft_decode sizes a fault blames: as the culprit, or as the replay that changed a kept output."""
    sizes = set()
    for f in res["faults"]:
        for word in [f["graph"], *f["detail"].replace(":", " ").split()]:
            phase, _, bs = word.partition("/")
            if phase == "draft_decode" and bs.isdigit():
                sizes.add(int(bs))
    return sizes


@pytest.mark.parametrize("bug", ["kv-indices-topk", "page-table-scatter"])
def test_planted_out_of_bounds_writes_are_caught_and_located(tmp_path, bug):
    """Caught at several sizes, every fault blaming a draft_decode graph: as a
    footprint fault (address range, bytes) where the write leaves the graph's
    own blocks, as an interleave fault naming both graphs where it corrupts
    another graph's kept output, or as a replay that differs from eager."""
    res = _faults(tmp_path, bug)
    faults = res["faults"]
    assert faults, res["summary"]
    assert all(f["graph"].startswith("draft_decode/") or "draft_decode/" in f["detail"] for f in faults), res["summary"]
    assert len(_named(res)) >= 3, res["summary"]
    assert all(f["addr"] > 0 for f in faults if f["nbytes"])


def test_dormant_bug_stays_dormant_at_topk_1(tmp_path):
    """The kv_indices bug needs topk > 1 (as in the engines): verify is silent, not noisy --
    having run both checks over every graph (a verify that checks nothing is silent too)."""
    run = _planted(tmp_path, "kv-indices-topk", topk=1, page_size=1)
    assert run.exit == 0 and run.result is not None, run.output
    res = run.result
    assert res["ok"], res["summary"]
    # the speculative reference declares its weights read-only: verify guards them too
    assert res["checks"] == ["interleave", "footprint", "read-only"], res["summary"]
    # interleave replays every graph in two orders (one shuffled, one reversed)
    assert run.captured is not None and run.captured >= len(SIZES), run.output
    assert res["replays"] >= 2 * run.captured, res["summary"]


def test_smallest_first_order_does_not_make_the_bugs_go_away(tmp_path):
    """The reverted CI gate: capturing smallest-first hides nothing from verify."""
    for bug in ("kv-indices-topk", "page-table-scatter"):
        res = _faults(tmp_path, bug, strategies=("order=smallest-first",))
        assert len(_named(res)) >= 3, (bug, res["summary"])


def test_read_only_guard_names_the_graph_that_writes_a_weight(tmp_path, clean):
    from capture_plan.executor import capture, verify

    plan = plan_for(tmp_path)

    class Scribbler:
        """Delegates to the clean target; draft_extend also bumps a weight in place."""

        def __init__(self, inner):
            self.inner = inner

        def run(self, phase, bs, ws):
            out = self.inner.run(phase, bs, ws)
            if phase == "draft_extend" and bs == 8:
                self.inner.draft.lm_head[0, :4].add_(1)
            return out

        def prepare(self, *a):
            self.inner.prepare(*a)

        def refresh(self, *a):
            self.inner.refresh(*a)

        def read_only(self):
            return self.inner.read_only()

    target = Scribbler(clean)
    saved = clean.draft.lm_head.clone()
    gs = capture(plan, target, progress=False)
    try:
        res = verify(gs, checks=("interleave",))
        ro = [f for f in res.faults if f.check == "read-only"]
        assert ro and ro[0].graph == "draft_extend/8" and "draft.lm_head" in ro[0].detail, res.summary()
    finally:
        gs.release()
        clean.draft.lm_head.copy_(saved)


def test_wild_write_names_the_graph_and_the_sanitizer_command(tmp_path):
    """An illegal address kills the CUDA context: in a subprocess."""
    run = _planted(tmp_path, "wild", checks=("interleave",), record=False)
    assert run.captured, run.output
    assert run.exit == 3 and run.failed, run.output
    line = run.failed
    assert line.startswith("FAILED verify, graph draft_extend/") and "CUDA context is lost" in line, line
    assert "compute-sanitizer --tool memcheck" in line, line
