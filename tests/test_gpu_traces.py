"""Few-size traces and memory snapshots on a real GPU (marked ``gpu``).

Run on the device: ``python -m pytest -m gpu -q tests/test_gpu_traces.py``.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

SMALL = dict(layers=2, hidden=1024, heads=8, kv_heads=2, head_dim=128, intermediate=2048, vocab=32000)
SIZES = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64]


def _spec(tmp_path, sizes):
    text = "[model]\n" + "".join(f"{k} = {v}\n" for k, v in SMALL.items())
    text += f'\n[[phases]]\nname = "decode"\nkind = "decode"\nsizes = {list(sizes)}\n'
    path = tmp_path / "spec.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def model():
    from capture_plan.references.decode import ReferenceConfig, ReferenceModel
    from capture_plan.schemas.spec import Model

    return ReferenceModel(ReferenceConfig(model=Model(**SMALL), max_bs=64, max_seqlen=256))


def _pred(p):
    return p.pool_bytes, p.pools, p.timeline, p.largest_graph_bytes, p.baseline_bytes


def test_prediction_from_three_sizes_equals_the_one_from_every_size(tmp_path, model):
    from capture_plan.executor import capture, profile, write_trace
    from capture_plan.planner import BuildOptions, build_plan

    spec = _spec(tmp_path, SIZES)
    plan = build_plan(BuildOptions(backend="fa3", spec=spec))
    # The first capture in a process can create persistent blocks (a library's
    # workspace): capture once so that both profiles see the same process.
    capture(plan, model, progress=False).release()
    write_trace(profile(plan, model, sizes="all"), tmp_path / "all.json")
    write_trace(profile(plan, model), tmp_path / "few.json")
    full = build_plan(BuildOptions(backend="fa3", spec=spec, trace=tmp_path / "all.json"))
    few = build_plan(BuildOptions(backend="fa3", spec=spec, trace=tmp_path / "few.json"))
    from capture_plan.schemas.trace import default_samples

    assert few.predicted.samples["decode"].measured == default_samples(SIZES) == [1, 24, 64]
    assert _pred(few.predicted) == _pred(full.predicted)
    gs = capture(few, model, progress=False)
    try:
        measured = {m.step: m.reserved for m in gs.report.steps}
        for m in few.predicted.timeline:  # every step, not just the total
            assert measured[m.step] == m.reserved, (  # exact at every step (docs/measurements.md)
                m.step,
                measured[m.step],
                m.reserved,
            )
    finally:
        gs.release()


def test_snapshot_dumped_during_capture_predicts_like_the_projects_trace(tmp_path, model, monkeypatch):
    """The same captures, read twice: torch's pickled snapshot and capture_plan.executor.profile's trace."""
    import torch

    from capture_plan.executor import pool, profile, write_trace
    from capture_plan.planner import BuildOptions, build_plan

    snap = tmp_path / "snapshot.pickle"
    stop = pool.AllocationRecorder.stop

    def dump_then_stop(self):  # the history is still on: dump it as an engine would
        torch.cuda.memory._dump_snapshot(str(snap))
        return stop(self)

    monkeypatch.setattr(pool.AllocationRecorder, "stop", dump_then_stop)
    spec = _spec(tmp_path, SIZES)
    # engine style: a warm-up before every capture (outside the pool), outputs kept
    plan = build_plan(BuildOptions(backend="fa3", spec=spec, strategies=("warmup=every-size", "outputs=keep")))
    trace = profile(plan, model, sizes="all")
    write_trace(trace, tmp_path / "trace.json")
    assert snap.stat().st_size > 0
    a = build_plan(BuildOptions(backend="fa3", spec=spec, trace=tmp_path / "trace.json"))
    b = build_plan(BuildOptions(backend="fa3", spec=spec, trace=snap))
    from capture_plan.planner.memory.snapshot import trace_from_snapshot
    from capture_plan.schemas.spec import Phase

    got = trace_from_snapshot(snap.read_bytes(), [Phase(name="decode", kind="decode", sizes=SIZES)], "snap")
    sizes = lambda t: {c.bs: [(e.op, e.size) for e in c.events] for c in t.captures}  # noqa: E731
    assert sizes(got) == sizes(trace)
    assert _pred(b.predicted) == _pred(a.predicted)


def test_speculative_phases_from_three_sizes_equal_every_size(tmp_path):
    """torch.topk's scratch over the vocabulary (planner/memory/scratch_shapes.py): with the SM
    count the recording writes, all four EAGLE phases of the small speculative reference
    (top-k 4: the draft's first top-k runs over 4 rows a request) are derived from three
    sizes each and predict what every size recorded predicts."""
    import msgspec
    import torch

    from capture_plan.executor import capture, profile, write_trace
    from capture_plan.planner import BuildOptions, build_plan
    from capture_plan.references.planted import small_model, spec_toml
    from capture_plan.schemas.trace import default_samples

    sizes = [1, 2, 4, 8, 12, 16, 24, 32]
    path = tmp_path / "spec.toml"
    path.write_text(spec_toml(sizes))
    opts = BuildOptions(backend="fa3", ci=True, spec=path)
    plan = build_plan(opts)
    target = small_model(max_bs=max(sizes))
    capture(plan, target, progress=False).release()  # both recordings see the same process
    every, few = profile(plan, target, sizes="all"), profile(plan, target)
    assert few.multiprocessors == torch.cuda.get_device_properties(0).multi_processor_count
    write_trace(every, tmp_path / "all.json")
    write_trace(few, tmp_path / "few.json")
    full = build_plan(msgspec.structs.replace(opts, trace=tmp_path / "all.json"))
    derived = build_plan(msgspec.structs.replace(opts, trace=tmp_path / "few.json"))
    for p in plan.phases:
        assert derived.predicted.samples[p.name].measured == default_samples(p.sizes), p.name
    assert _pred(derived.predicted) == _pred(full.predicted)
