"""The speculative reference and verify's helpers on the CPU (no CUDA needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from capture_plan.references.speculative import PHASES, SpeculativeConfig, SpeculativeModel  # noqa: E402
from capture_plan.schemas.spec import Model, Phase  # noqa: E402

SHAPE = Model(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=1000)


def _tuple(out):
    return out if isinstance(out, tuple) else (out,)


@pytest.fixture(scope="module", params=[(1, 1), (3, 4)], ids=["topk1-page1", "topk3-page4"])
def model(request):
    topk, page = request.param
    return SpeculativeModel(
        SpeculativeConfig(model=SHAPE, max_bs=8, max_seqlen=32, topk=topk, page_size=page),
        backend="torch",
        device="cpu",
    )


@pytest.mark.parametrize("phase", PHASES)
def test_padding_leaves_the_real_requests_unchanged(model, phase):
    """The executor replays the graph of the padded size and slices: the rows of
    the n real requests must not depend on the padding (sentinel slots)."""
    gen = torch.Generator()
    gen.manual_seed(5)
    model.prepare(phase, 5, 8, gen)
    padded = _tuple(model.run(phase, 8, None))
    alone = _tuple(model.run(phase, 5, None))
    rows = padded[0].shape[0] // 8
    for a, b in zip(padded, alone):
        assert a.shape[0] == 8 * rows
        torch.testing.assert_close(a[: 5 * rows].float(), b.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kind", PHASES)
def test_the_analytic_outputs_are_what_the_model_returns(model, kind):
    """The planner's analytic program for each phase kind leaves exactly the
    blocks the reference returns alive as outputs (sizes in bytes)."""
    from capture_plan.planner.inputs.resources import backend
    from capture_plan.planner.memory.analytic import analytic_program

    cfg = model.cfg
    phase = Phase(
        name=kind,
        kind=kind,
        sizes=[8],
        tokens_per_request=cfg.tokens(kind),
        layers=1 if kind.startswith("draft") else None,
        steps=cfg.num_steps if kind == "draft_decode" else 1,
        topk=cfg.topk if kind.startswith("draft") else 1,
    )
    alive: dict[int, tuple[int, str]] = {}
    for e in analytic_program(SHAPE, phase, 8, backend("torch")).flatten():
        if e.op == "alloc":
            alive[e.id] = (e.size, e.kind)
        else:
            alive.pop(e.id)
    predicted = sorted(size for size, k in alive.values() if k == "output")
    gen = torch.Generator()
    gen.manual_seed(1)
    model.prepare(kind, 8, 8, gen)
    returned = sorted(t.numel() * t.element_size() for t in _tuple(model.run(kind, 8, None)))
    assert predicted == returned


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(bugs=frozenset({"typo"})), "unknown planted bug"),
        (dict(num_steps=5, draft_kv_width=4), "draft_kv_width 4 cannot hold num_steps 5"),
        (dict(page_size=4, num_steps=5, draft_page_cols=4), "draft_page_cols 4 cannot hold num_steps 5"),
        (dict(max_seqlen=4), "max_seqlen 4 leaves no context"),
        (dict(max_seqlen=30, page_size=4), "not a multiple of page_size"),
        (dict(topk=0), "must be >= 1"),
    ],
)
def test_bad_configs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(model=SHAPE, **kwargs)


def test_planted_bugs_need_cuda():
    with pytest.raises(ValueError, match="need a CUDA device"):
        SpeculativeModel(
            SpeculativeConfig(model=SHAPE, max_bs=4, max_seqlen=32, bugs=frozenset({"wild"})),
            backend="torch",
            device="cpu",
        )


def test_batches_outside_the_target_are_refused(model):
    with pytest.raises(ValueError, match="outside 1..max_bs=8"):
        model.run("decode", 9, None)
    with pytest.raises(ValueError, match="do not fit a batch of 4"):
        model.prepare("decode", 5, 4, torch.Generator())


# -- verify's helpers ---------------------------------------------------------
def test_outside_is_the_complement_of_the_kept_intervals():
    from capture_plan.executor.verification import _outside

    segs = [(1000, 100), (2000, 50)]
    keep = [(1010, 10), (1050, 60), (1990, 20)]
    assert _outside(segs, keep) == [(1000, 10), (1020, 30), (2010, 40)]
    assert _outside(segs, []) == segs


def test_owners_names_the_other_graphs_whose_blocks_a_write_lands_in():
    from capture_plan.executor.verification import _owners

    def cap(phase, bs, own):
        return SimpleNamespace(phase=phase, bs=bs, window=SimpleNamespace(own=own))

    a, b, c = cap("decode", 8, [(100, 50)]), cap("decode", 4, [(140, 20)]), cap("draft_decode", 2, [(300, 10)])
    assert _owners([a, b, c], 145, 150, exclude=a) == ["decode/4"]
    assert _owners([a, b, c], 200, 250, exclude=a) == []


def test_read_only_checksum_sees_any_changed_word_and_any_alignment():
    from capture_plan.executor.verification import _Guard

    w = torch.randn(1001, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    for t in (w, w[1:], w[3:700]):  # byte offsets 0, 2 and 6: not all 8-aligned
        before = _Guard._sum(t)
        t[5] += 1
        assert _Guard._sum(t) != before
    # a change whose bytes cancel out (0x3f80 -> 0x407f: the same byte sum) at an unaligned offset
    odd = torch.zeros(16, dtype=torch.bfloat16)[1:]
    odd.view(torch.int16)[2] = 0x3F80
    before = _Guard._sum(odd)
    odd.view(torch.int16)[2] = 0x407F
    assert _Guard._sum(odd) != before
    target = SimpleNamespace(read_only=lambda: {"w": w})
    guard = _Guard(target)
    res = SimpleNamespace(faults=[])
    guard.check("decode/8", res)
    assert res.faults == []
    w[0] = 42
    guard.check("decode/8", res)
    assert len(res.faults) == 1 and res.faults[0].check == "read-only" and "'w'" in res.faults[0].detail
    guard.check("decode/4", res)  # re-baselined: the next graph is not blamed
    assert len(res.faults) == 1


def test_only_device_errors_count_as_a_lost_context():
    from capture_plan.executor.verification import is_device_fault

    assert is_device_fault(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not is_device_fault(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_device_fault(torch.OutOfMemoryError("CUDA out of memory"))
    assert not is_device_fault(ValueError("CUDA error: not from the device"))


def test_sanitizer_command_reruns_this_interpreter_with_its_own_arguments(monkeypatch):
    import sys

    from capture_plan.executor.verification import sanitizer_command

    monkeypatch.setattr(sys, "orig_argv", ["python3", "-c", "print('x y')"])
    cmd = sanitizer_command()
    assert cmd.startswith("compute-sanitizer --tool memcheck ")
    assert cmd.endswith(f"{sys.executable} -c 'print('\"'\"'x y'\"'\"')'")


def test_recorder_finds_its_markers_by_address_and_size_in_order():
    from capture_plan.executor.pool import AllocationRecorder

    rec = object.__new__(AllocationRecorder)
    rec._markers = [SimpleNamespace(data_ptr=lambda a=a: a, numel=lambda n=n: n) for a, n in ((10, 12345), (20, 12347))]

    def ev(action, addr, size):
        return {"action": action, "addr": addr, "size": size}

    traces = [ev("alloc", 10, 12347), ev("alloc", 10, 12345), ev("alloc", 99, 8), ev("alloc", 20, 12347)]
    assert rec._positions(traces) == [1, 3]
    with pytest.raises(RuntimeError, match="lost 1 capture marker"):
        rec._positions(traces[:3])


@pytest.mark.parametrize("kind,field", [("decode", "steps"), ("target_verify", "topk"), ("draft_extend", "steps")])
def test_draft_settings_on_other_phases_are_refused(kind, field):
    from capture_plan.planner.inputs.validate import validate_spec
    from capture_plan.schemas.errors import InputError
    from capture_plan.schemas.spec import Spec

    spec = Spec(phases=[Phase(name="p", kind=kind, sizes=[1], **{field: 3})])
    with pytest.raises(InputError, match=rf"{field} = 3 has no meaning for a {kind} phase"):
        validate_spec(spec, "s.toml")


def test_spec_toml_gives_the_four_phases_the_model_expects(tmp_path):
    """The small reference's spec (tests and bench share it): every phase named
    after its kind, at the sizes asked for, with the draft settings."""
    from capture_plan.planner import BuildOptions, build_plan
    from capture_plan.references.planted import spec_toml

    path = tmp_path / "spec.toml"
    path.write_text(spec_toml([4, 1, 2, 2], steps=2, topk=3))
    plan = build_plan(BuildOptions(backend="fa3", ci=True, spec=path))
    assert {p.name: p.kind for p in plan.phases} == {k: k for k in PHASES}
    assert all(sorted(p.sizes) == [1, 2, 4] for p in plan.phases)
    assert {p.name: p.tokens_per_request for p in plan.phases} == {
        "decode": 1,
        "target_verify": 4,
        "draft_decode": 1,
        "draft_extend": 3,
    }


def test_recorder_windows_keep_only_allocations_in_graph_pool_segments():
    """capture_begin allocates the RNG's graph-safe state (two 8-byte blocks) in
    the ordinary allocator inside the window (measured on an H200): not the pool's."""
    from capture_plan.executor.pool import AllocationRecorder

    rec = object.__new__(AllocationRecorder)
    rec._markers = [SimpleNamespace(data_ptr=lambda a=a: a, numel=lambda n=n: n) for a, n in ((10, 12345), (30, 12347))]
    rec._marks = [(0, 1)]

    def ev(action, addr, size):
        return {"action": action, "addr": addr, "size": size}

    history = [
        ev("alloc", 10, 12345),
        ev("alloc", 12, 8),
        ev("alloc", 14, 8),
        ev("alloc", 1000, 512),
        ev("alloc", 1600, 256),
        ev("free_requested", 1600, 256),
        ev("free_requested", 14, 8),
        ev("alloc", 30, 12347),
    ]
    rec._traces = lambda: (history, [(1000, 3000)])  # one pool segment; the markers and RNG blocks lie outside
    rec.close = lambda: None
    (win,) = rec.stop()
    assert win.events == [("alloc", 1000, 512), ("alloc", 1600, 256), ("free", 1600, 256)]
    assert win.alive_after == [(1000, 512)]
