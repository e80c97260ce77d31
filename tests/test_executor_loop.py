"""The loop-shaped API on CPU, CUDA faked (tests/fake_cuda.py): an engine-shaped
runner that keeps its own stream, buffers, dispatch keys and per-phase loops
captures through ``capture_loop`` exactly what ``capture(plan, target)``
captures; an engine loop that breaks the plan gets one ExecutorError naming
the step, and nothing half-captured stays behind; a vLLM PIECEWISE step of a plan
that does not say its piece count is refused by name (one whole graph would not
be the plan's pieces)."""

from __future__ import annotations

import dataclasses
import gc
import threading
from pathlib import Path
from typing import NamedTuple

import pytest

torch = pytest.importorskip("torch")

from engine_shaped import run_engine  # noqa: E402

CPU = torch.device("cpu")
DECODE = '[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 2, 4, 8]\n'


def _plan(tmp_path: Path, backend: str, *strategies: str, ci: bool = False, eagle: bool = False):
    from capture_plan.planner import BuildOptions, build_plan
    from capture_plan.references.planted import spec_toml

    spec = tmp_path / "spec.toml"
    spec.write_text(spec_toml([1, 2, 4, 8]) if eagle else DECODE)
    # outputs=keep: the fake's pool memory is freed with its owner, so a view would dangle
    return build_plan(BuildOptions(backend=backend, ci=ci, spec=spec, strategies=("outputs=keep", *strategies)))


class Model:
    """The model code both ways: out = x[:rows] * 2 + 1, a fresh output in the
    pool while a graph records (as a model's allocations go there), the graph
    re-running the computation on replay. ``calls`` logs every forward and
    workspace refresh."""

    def __init__(self, fake, tokens: dict[str, int], max_bs: int = 8):
        self.fake, self.tokens = fake, tokens
        self.x = torch.zeros(max_bs * max(tokens.values()), 4)
        self.calls: list[tuple] = []
        self.fail_at: tuple[str, int] | None = None

    def forward(self, phase: str, bs: int, ws):
        g = self.fake.recording
        self.calls.append(("run", phase, bs, g is not None, ws is not None))
        if g is not None and (phase, bs) == self.fail_at:
            raise ValueError("boom")
        rows = bs * self.tokens[phase]
        out = self.fake.pool_tensor(rows, 4) if g is not None else torch.empty(rows, 4)

        def compute():
            torch.add(self.x[:rows] * 2, 1, out=out)

        compute()
        if g is not None:
            g.calls.append(compute)
        return out

    def refresh(self, phase, n, bs, ws):
        self.calls.append(("refresh", phase, bs, self.fake.recording is not None, True))


class AsTarget:
    """The model as a CaptureTarget, for ``capture(plan, target)``."""

    def __init__(self, model: Model):
        self.model = model

    def run(self, phase, bs, ws):
        return self.model.forward(phase, bs, ws)

    def prepare(self, phase, n, bs, gen):
        self.model.x.normal_(generator=gen)

    def refresh(self, phase, n, bs, ws):
        self.model.refresh(phase, n, bs, ws)


def _recorded(calls) -> list[tuple]:
    """Each recording, with the refresh right before it."""
    return [(c, calls[i - 1] if i and calls[i - 1][0] == "refresh" else None) for i, c in enumerate(calls) if c[3]]


def _warmups(calls) -> dict[str, int]:
    runs: dict[str, int] = {}
    for c in calls:
        if c[0] == "run" and not c[3]:
            runs[c[1]] = runs.get(c[1], 0) + 1
    return runs


def _first(plan, phase: str) -> int:
    return next(s.bs for s in plan.steps if s.op == "capture" and s.phase == phase)


CASES = [
    ("fa3", (), True, False),
    ("triton", (), False, False),
    ("fa3", ("workspace=hoisted", "pool=own"), False, True),
    ("fa3", (), True, True),
    ("fa3", ("pool=shared",), True, True),
]


@pytest.mark.parametrize("backend,strategies,ci,eagle", CASES)
def test_engine_loop_captures_what_capture_captures(tmp_path, fake, backend, strategies, ci, eagle):
    from capture_plan.executor import capture

    plan = _plan(tmp_path, backend, *strategies, ci=ci, eagle=eagle)
    tokens = {p.name: p.tokens_per_request for p in plan.phases}
    ref_model = Model(fake, tokens)
    ref = capture(plan, AsTarget(ref_model), progress=False, device=CPU)
    pools_ref = fake.pools
    model = Model(fake, tokens)
    loop, backend_ = run_engine(plan, model, CPU, target=AsTarget(model))  # replays refresh a hoisted workspace
    gs = loop.graphs
    try:
        # the same recordings and refreshes in the same order, and as many warm-up runs per phase; a
        # phase warmed up once at its largest size and captured smallest-first warms up at its first size
        assert _recorded(model.calls) == _recorded(ref_model.calls)
        assert _warmups(model.calls) == _warmups(ref_model.calls)
        if not any(s.op == "warmup" and s.bs != _first(plan, s.phase) for s in plan.steps):
            assert model.calls == ref_model.calls
        assert list(gs.graphs) == list(ref.graphs) == list(backend_.graphs)
        assert [(c.pool, c.held, c.rows_per_request, c.order) for c in gs.graphs.values()] == [
            (c.pool, c.held, c.rows_per_request, c.order) for c in ref.graphs.values()
        ]
        assert set(gs.pools) == set(ref.pools) and fake.pools - pools_ref == len(ref.pools)
        assert {p: w.numel() for p, w in gs.workspaces.items()} == {p: w.numel() for p, w in ref.workspaces.items()}
        r, g = ref.report, gs.report
        assert [(m.step, m.id, m.reserved, m.predicted_reserved) for m in g.steps] == [
            (m.step, m.id, m.reserved, m.predicted_reserved) for m in r.steps
        ]
        # each warm-up step carries its scratch figure (what a calibration's peak reads), nothing else does
        assert [(m.id, m.scratch is not None) for m in g.steps] == [(m.id, m.scratch is not None) for m in r.steps]
        assert any(m.scratch is not None for m in r.steps) == any(s.op == "warmup" for s in plan.steps)
        assert (g.pool_bytes, g.hoisted_bytes, g.plan_digest) == (
            r.pool_bytes,
            r.hoisted_bytes,
            r.plan_digest,
        ) and g.pool_bytes > 0
        for p in plan.phases:
            top = max(p.sizes)
            assert [gs.padded(p.name, n) for n in range(1, top + 1)] == [
                ref.padded(p.name, n) for n in range(1, top + 1)
            ]
        # the engine's stored graphs are the set's, and replays serve its stored outputs
        assert all(backend_.graphs[k] is c.graph for k, c in gs.graphs.items())
        model.x.normal_()
        for (phase, bs), out in backend_.outputs.items():
            got = gs.replay(phase, bs)[0]
            assert got.data_ptr() == out.data_ptr() and torch.equal(got, model.x[: got.shape[0]] * 2 + 1)
    finally:
        ref.release()
        gs.release()


def _gone(fake, backend) -> None:
    """Nothing half-captured: the engine's stores emptied (on_failure), no pool memory left."""
    assert backend.graphs == {} and backend.outputs == {}
    gc.collect()
    assert fake.snapshot() == []


def _reverse(backend, runners):
    runners[0].sizes = [1, 2, 4, 8]


def _phase_order(backend, runners):
    runners.reverse()


def _own_pool(backend, runners):
    backend.pool_override = torch.cuda.graph_pool_handle()


def _own_stream(backend, runners):
    backend.stream_override = torch.cuda.Stream()


def _string(backend, runners):
    backend.output_override = lambda out: (out, "logits")


def _host(backend, runners):
    backend.output_override = lambda out: (out, torch.zeros(2, device="meta"))


def _empty(backend, runners):
    backend.output_override = lambda out: (None, ())


def _rows(backend, runners):
    backend.output_override = lambda out: out[:-1] if out.shape[0] > 1 else torch.zeros(3, 4)


def _ends_early(backend, runners):
    runners[0].sizes = [8, 4]


def _no_hold(backend, runners):
    backend.hold_at = ("decode", 4)


FAULTS = [
    (_reverse, r"asked for decode/1 out of the plan's order: the plan's next capture is decode/8", "capture/decode/8"),
    (
        _phase_order,
        r"asked for decode/8 out of the plan's order: the plan's next capture is target_verify/1",
        "capture/target_verify/1",
    ),
    (_own_pool, r"records into pool \(0, \d+\), not the plan's pool 'shared'", "capture/decode/8"),
    (_own_stream, r"records on stream .* not the capture stream", "capture/decode/8"),
    (_string, r"output out\[1\] is a str: the output policy holds tensors", "capture/decode/8"),
    (_host, r"output out\[1\] is on meta, not cpu: a replay never writes it", "capture/decode/8"),
    (_empty, r"outputs hold no tensor", "capture/decode/8"),
    (_rows, r"output has 7 rows, not a multiple of bs 8", "capture/decode/8"),
    (_ends_early, r"ended with 2 of the plan's captures not made", "capture/decode/2"),
    (_no_hold, r"moved on to decode/2 before the step's outputs were held", "capture/decode/4"),
]


@pytest.mark.parametrize("configure,message,step", FAULTS, ids=[f[0].__name__.strip("_") for f in FAULTS])
def test_an_engine_loop_that_breaks_the_plan_gets_one_error_naming_the_step(tmp_path, fake, configure, message, step):
    from capture_plan.executor import ExecutorError

    eagle = configure is _phase_order
    plan = _plan(tmp_path, "fa3", ci=True, eagle=eagle)
    model = Model(fake, {p.name: p.tokens_per_request for p in plan.phases})
    holder = {}

    def setup(backend, runners):
        holder["backend"] = backend
        configure(backend, runners)

    with pytest.raises(ExecutorError, match=message) as info:
        run_engine(plan, model, CPU, configure=setup)
    assert f"({step})" in str(info.value), str(info.value)
    assert len(str(info.value).splitlines()) == 1
    _gone(fake, holder["backend"])


def test_an_engine_forward_that_raises_is_capture_failed_naming_the_step(tmp_path, fake):
    from capture_plan.executor import CaptureFailed

    plan = _plan(tmp_path, "fa3", ci=True)
    model = Model(fake, {"decode": 1})
    model.fail_at = ("decode", 2)
    holder = {}
    with pytest.raises(CaptureFailed, match=r"ValueError: boom; all partial graphs were released") as info:
        run_engine(plan, model, CPU, configure=lambda b, r: holder.setdefault("backend", b))
    step = next(s for s in plan.steps if s.id == "capture/decode/2")
    assert f"step {step.index} (capture/decode/2: phase decode, bs 2)" in str(info.value)
    _gone(fake, holder["backend"])


@dataclasses.dataclass(frozen=True)
class LogitsOut:
    logits: torch.Tensor
    hidden: torch.Tensor | None = None


class Pair(NamedTuple):
    ids: torch.Tensor
    scores: torch.Tensor


def test_hold_returns_the_engine_s_own_output_structure(tmp_path, fake):
    from capture_plan.executor import capture_loop

    plan = _plan(tmp_path, "fa3", ci=True)
    shapes = []
    with capture_loop(plan, device=CPU) as loop:
        for step in loop.steps("decode"):
            with step.graph() as g:
                a, b = fake.pool_tensor(step.bs, 4), fake.pool_tensor(step.bs, 2)
            out = {"main": LogitsOut(a), "pair": Pair(b, a), "rest": [None, b]}
            held = step.hold(out)
            assert step.recorded is None and step.landed and g is loop.gs.graphs[("decode", step.bs)].graph
            assert isinstance(held["main"], LogitsOut) and held["main"].hidden is None
            assert isinstance(held["pair"], Pair) and held["pair"].scores is held["main"].logits is a
            assert held["rest"][1] is b and isinstance(held["rest"], list)
            shapes.append(tuple(t.shape for t in loop.gs.graphs[("decode", step.bs)].outputs))
            del a, b, out, held
    assert shapes[0] == ((8, 4), (8, 2), (8, 4), (8, 2))  # every tensor in order, repeats included
    loop.graphs.release()


def test_a_view_policy_holds_non_owning_views(tmp_path, fake):
    from capture_plan.executor import capture_loop

    plan = _plan(tmp_path, "fa3", ci=True)
    import msgspec

    plan = msgspec.structs.replace(
        plan, steps=[msgspec.structs.replace(s, outputs="view") if s.op == "capture" else s for s in plan.steps]
    )
    with capture_loop(plan, device=CPU) as loop:
        for step in loop.steps("decode"):
            assert step.outputs == "view"
            with step.graph():
                t = fake.pool_tensor(step.bs, 4)
            held = step.hold(t)
            assert held.data_ptr() == t.data_ptr() and held.untyped_storage() is not t.untyped_storage()
            assert held.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
            del t, held
    gc.collect()
    assert fake.snapshot() == []  # the views kept nothing
    loop.graphs.release()


def test_misuse_outside_the_loop_is_one_clear_error(tmp_path, fake):
    from capture_plan.executor import ExecutorError, capture_loop

    plan = _plan(tmp_path, "fa3", ci=True)
    loop = capture_loop(plan, device=CPU)
    with pytest.raises(ExecutorError, match=r"not open.*fix: use `with capture_loop"):
        loop.step("decode", 8)
    with pytest.raises(ExecutorError, match=r"phase 'verify' is not in the plan; it captures \['decode'\]"):
        loop.sizes("verify")
    with pytest.raises(ExecutorError, match=r"has not finished"):
        _ = loop.graphs
    with pytest.raises(ExecutorError, match=r"pool 'phase:decode' is not one of the plan's pools \['shared'\]"):
        capture_loop(plan, device=CPU, pools={"phase:decode": (0, 99)})
    with pytest.raises(ExecutorError, match=r"step 1 \(capture/decode/8\).*hold\(\) before the graph was recorded"):
        with capture_loop(plan, device=CPU) as loop:
            loop.step("decode", 8).hold(torch.zeros(8))


def test_a_graph_the_engine_records_itself_is_checked_for_its_pool(tmp_path, fake):
    from capture_plan.executor import ExecutorError, capture_loop

    plan = _plan(tmp_path, "fa3", ci=True)
    with capture_loop(plan, device=CPU) as loop:
        for step in loop.steps("decode"):
            g = torch.cuda.CUDAGraph()
            g.capture_begin(pool=step.pool)
            t = fake.pool_tensor(step.bs, 4)
            g.capture_end()
            step.hold(t, graph=g)
            del t
    # 16 B a row; the counts come from the pool itself (its reserved bytes, less what earlier graphs took)
    assert loop.graphs.report.pool_bytes == 16 * (1 + 2 + 4 + 8)
    assert [m.reserved for m in loop.graphs.report.steps if m.id.startswith("capture")] == [
        16 * b for b in (8, 12, 14, 15)
    ]
    loop.graphs.release()
    with pytest.raises(
        ExecutorError, match=r"step 1 \(capture/decode/8\).*recorded into pool \(0, \d+\), not the plan"
    ):
        with capture_loop(plan, device=CPU) as loop:
            step = loop.step("decode", 8)
            g = torch.cuda.CUDAGraph()
            g.capture_begin(pool=torch.cuda.graph_pool_handle())
            g.capture_end()
            step.hold(torch.zeros(8, 4), graph=g)


def _runner_parts(fake, plan, model, fail_phase=None, holder=None):
    """SGLang's shape: the target's runner captures at one time, the EAGLE draft
    runners later, each inside its own ``loop.part()``; one loop for the plan."""
    from capture_plan.executor import capture_loop
    from engine_shaped import Backend, Runner

    stream = torch.cuda.Stream()
    backend = Backend(stream)
    if holder is not None:
        holder["backend"] = backend
    loop = capture_loop(plan, stream=stream, device=CPU, on_failure=backend.cleanup)
    for phase in dict.fromkeys(s.phase for s in plan.steps if s.op == "capture"):
        runner = Runner(phase, model, backend)  # made when the engine gets to it
        if phase == fail_phase:
            model.fail_at = (phase, loop.sizes(phase)[1])
        with loop.part():
            runner.capture(loop)
    return loop, backend


def test_runners_made_at_different_times_share_one_loop_through_parts(tmp_path, fake):
    from capture_plan.executor import capture

    plan = _plan(tmp_path, "fa3", ci=True, eagle=True)
    tokens = {p.name: p.tokens_per_request for p in plan.phases}
    ref = capture(plan, AsTarget(Model(fake, tokens)), progress=False, device=CPU)
    loop, backend = _runner_parts(fake, plan, Model(fake, tokens))
    assert loop.complete and loop.graphs.report is not None  # the last part closed the loop
    assert [(m.id, m.reserved) for m in loop.graphs.report.steps] == [(m.id, m.reserved) for m in ref.report.steps]
    assert list(backend.graphs) == list(ref.graphs)
    backend.cleanup()
    loop.graphs.release()
    ref.release()


def test_a_failure_in_a_later_part_releases_the_earlier_parts_too(tmp_path, fake):
    from capture_plan.executor import CaptureFailed

    plan = _plan(tmp_path, "fa3", ci=True, eagle=True)
    model = Model(fake, {p.name: p.tokens_per_request for p in plan.phases})
    last = list(dict.fromkeys(s.phase for s in plan.steps if s.op == "capture"))[-1]
    holder = {}
    with pytest.raises(CaptureFailed, match=rf"capture/{last}/\d+: phase {last}.*ValueError: boom"):
        _runner_parts(fake, plan, model, fail_phase=last, holder=holder)
    _gone(fake, holder["backend"])


def test_close_names_the_first_capture_never_made(tmp_path, fake):
    from capture_plan.executor import ExecutorError, capture_loop

    plan = _plan(tmp_path, "fa3", ci=True)
    loop = capture_loop(plan, device=CPU)
    with loop.part():
        step = loop.step("decode", 8)
        with step.graph():
            t = fake.pool_tensor(8, 4)
        step.hold(t)
        del t
    assert not loop.complete
    with pytest.raises(ExecutorError, match=r"step \d+ \(capture/decode/4\): the engine's loop ended with 3"):
        loop.close()
    gc.collect()
    assert fake.snapshot() == []


def _start(plan, target, **kw):
    """The engine's loop of run_engine, on the capture thread through loop.start()
    (``target``: tests/fake_cuda.py's Target, whose recording at ``gate_at``
    waits for its gate and raises at ``fail_at``)."""
    from engine_shaped import TargetModel, make_engine

    loop, backend, runners = make_engine(plan, TargetModel(target), CPU, target=target)

    def body(loop):
        for runner in runners:
            runner.capture(loop)

    return loop.start(body, **kw), loop, backend


def test_the_engine_loop_captures_in_the_background_while_the_engine_serves(tmp_path, fake):
    from fake_cuda import FakeStream, Target, decode_plan

    plan = decode_plan(tmp_path, [1, 2, 4, 8, 16])
    target = Target(fake, gate_at=4)
    with torch.cuda.stream(FakeStream(7)):
        gs, loop, backend = _start(plan, target)
        assert target.reached.wait(30)  # 16 and 8 landed, 4 is recording
        assert gs.padded("decode", 3) == 8 and not gs.done
        target.prepare("decode", 5, 16, None)
        (out,) = gs.replay("decode", 5)
        assert torch.equal(out, target.x[:5] * 2 + 1) and gs.background.graph_replays == 1
        target.gate.set()
        assert gs.wait(30)
    assert gs.lock_free and loop.complete and gs.report is not None
    assert fake.modes == ["thread_local"] * 5
    assert [m.id for m in gs.report.steps] == [s.id for s in plan.steps]
    assert list(backend.graphs) == [("decode", b) for b in (16, 8, 4, 2, 1)]
    assert loop.graphs is gs
    backend.cleanup()
    gs.release()


def test_a_background_engine_loop_that_fails_raises_at_wait_naming_the_step(tmp_path, fake):
    from capture_plan.executor import CaptureFailed
    from fake_cuda import FakeStream, Target, decode_plan

    plan = decode_plan(tmp_path, [1, 2, 4, 8, 16])
    with torch.cuda.stream(FakeStream(7)):
        gs, loop, backend = _start(plan, Target(fake, fail_at=4))
        with pytest.raises(CaptureFailed, match=r"capture/decode/4: phase decode, bs 4\).*ValueError: boom"):
            gs.wait(30)
    _gone(fake, backend)


def test_release_during_a_background_engine_loop_stops_it_at_its_next_step(tmp_path, fake):
    from capture_plan.executor import ExecutorError, capture_loop
    from fake_cuda import FakeStream, Target, decode_plan

    plan = decode_plan(tmp_path, [1, 2, 4, 8, 16])
    target = Target(fake, gate_at=4)
    with torch.cuda.stream(FakeStream(7)):
        gs, loop, backend = _start(plan, target)
        assert target.reached.wait(30)
        releasing = threading.Thread(target=gs.release)
        releasing.start()
        target.gate.set()
        releasing.join(30)
    assert not releasing.is_alive() and not loop.complete
    _gone(fake, backend)  # on_failure ran when the loop stopped
    with pytest.raises(ExecutorError, match=r"unknown fallback 'later'"):
        capture_loop(plan, device=CPU).start(lambda loop: None, fallback="later")


@pytest.mark.parametrize("shape", ["tensor", "tuple", "dict", "dataclass"])
def test_hold_lets_go_of_the_engine_s_outputs_without_a_collection(shape):
    """The loop's output flattening keeps no reference to what the engine
    returned once hold() is done: with "view" outputs the memory must be free
    for the next capture, and the collector is frozen while capturing (on the
    H200 a reference cycle here kept every output of a ci plan alive, 2 MiB
    more pool per step than capture())."""
    import weakref

    from capture_plan.executor.outputs import flatten

    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor

    t = torch.zeros(3, 2)
    out = {"tensor": t, "tuple": (t, None), "dict": {"logits": t}, "dataclass": Out(t)}[shape]
    alive = weakref.ref(t)
    gc.disable()
    try:
        leaves, rebuild = flatten(out, "step 0 (capture/decode/1)", CPU)
        held = rebuild(tuple(x.clone() for x in leaves))
        del t, out, leaves, rebuild
        assert alive() is None, "the flattening keeps the engine's output alive until a collection"
        assert held is not None
    finally:
        gc.enable()


ROOT = Path(__file__).resolve().parent.parent


def test_the_engine_loop_refuses_a_piecewise_step_whose_piece_count_the_plan_lacks(fake):
    """A plan from before graph keys has piecewise phases without ``pieces``: one
    whole graph per step would be another graph than the plan's, so the loop
    says what to rebuild (tests/engines: pieces recorded as planned)."""
    import msgspec

    from capture_plan.executor import ExecutorError, capture_loop, load_plan
    from capture_plan.schemas.codec import seal

    # plans/fa3-vllm.json without its pieces (the --preset vllm spec has them since vLLM 0.34 support)
    plan = load_plan(ROOT / "plans/fa3-vllm.json", check_env=False)
    steps = [msgspec.structs.replace(st, pieces=msgspec.UNSET) for st in plan.steps]
    phases = [msgspec.structs.replace(ph, pieces=msgspec.UNSET) for ph in plan.phases]
    plan = seal(msgspec.structs.replace(plan, steps=steps, phases=phases))
    with pytest.raises(
        ExecutorError, match=r"CaptureLoop.step: phase 'piecewise' is 'piecewise' but the plan does not"
    ):
        with capture_loop(plan, device=torch.device("cpu")) as loop:
            loop.step("piecewise", loop.sizes("piecewise")[0])
    assert fake.pools == 0


def test_on_a_torch_without_keep_graph_the_loop_records_a_plain_graph(monkeypatch):
    """torch.cuda.CUDAGraph(keep_graph=True) raised TypeError before torch 2.8, which the
    executor still supports: the loop then records a plain graph (its nodes uncounted)."""
    import torch

    from capture_plan.executor import recording

    class Old:
        def __init__(self):  # no keep_graph
            self.made = True

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Old)
    assert isinstance(recording.new_graph(), Old)


def test_a_graph_without_outputs_and_ragged_outputs_are_held_and_dispatched(tmp_path, fake):
    """vLLM's pieces write into buffers and return nothing; ragged verify's slots are
    no multiple of the requests: hold(None) holds nothing, ragged=True holds them whole,
    and per-request outputs beside them are still sliced."""
    from capture_plan.executor import ExecutorError, capture_loop

    plan = _plan(tmp_path, "fa3", ci=True)
    with capture_loop(plan, device=CPU) as loop:
        for step in loop.steps("decode"):
            with step.graph():
                slots, rows = fake.pool_tensor(2 * step.bs + 1, 4), fake.pool_tensor(step.bs, 4)
            if step.bs == 8:
                with pytest.raises(ExecutorError, match=r"output 1 has 17 rows, not a multiple of bs 8.*ragged=True"):
                    step.hold((rows, slots))
                assert step.hold(None) is None
            else:
                held = step.hold((rows, slots), ragged=True)
                assert held[1] is slots
            del slots, rows
    gs = loop.graphs
    assert gs.replay("decode", 8) == () and gs.graphs[("decode", 8)].outputs == ()
    got = gs.replay("decode", 3)  # padded to 4: per-request rows sliced to 3, the slots whole
    assert [t.shape[0] for t in got] == [3, 9] and gs.graphs[("decode", 4)].rows == (1, 0)
    gs.release()


def test_a_size_the_plan_does_not_hold_is_refused_before_any_work(tmp_path, fake):
    from capture_plan.executor import ExecutorError, capture_loop

    plan = _plan(tmp_path, "fa3", ci=True)
    with pytest.raises(
        ExecutorError, match=r"CaptureLoop.step: the plan holds no graph key decode/3; phase decode has"
    ):
        with capture_loop(plan, device=CPU) as loop:
            loop.step("decode", 3)
    with pytest.raises(ExecutorError, match=r"phase 'decode' has no variant axis 'lora' \(it has no variant axes\)"):
        with capture_loop(plan, device=CPU) as loop:
            loop.step("decode", 8, lora="nolora")
    assert fake.pools == 0


def test_the_loop_records_into_an_engine_s_mempool(tmp_path, fake):
    """A torch.cuda.MemPool the engine made (a sleep-mode pool) is a pool the plan's
    graphs record into: its id is the handle, the object kept alive with the loop."""
    from capture_plan.executor import capture_loop

    plan = _plan(tmp_path, "fa3", ci=True)
    mempool = torch.cuda.MemPool()
    with capture_loop(plan, device=CPU, pools={"shared": mempool}) as loop:
        for step in loop.steps("decode"):
            assert step.pool == mempool.id
            with step.graph() as g:
                t = fake.pool_tensor(step.bs, 4)
            assert g.pool() == mempool.id
            step.hold(t)
            del t
    assert loop.graphs.pools == {"shared": mempool.id} and fake.pools == 0
    assert loop.graphs.report.pool_bytes == 16 * (1 + 2 + 4 + 8)
    loop.graphs.release()


def test_a_profiling_pass_captures_its_declared_subset_and_leaves_nothing(tmp_path, fake):
    from capture_plan.executor import ExecutorError, capture_loop

    plan = _plan(tmp_path, "triton", ci=False)  # a warm-up before every capture
    dropped = []
    loop = capture_loop(plan, device=CPU, profiling={"decode": 2}, on_failure=lambda: dropped.append(1))
    assert loop.sizes("decode") == [8, 4]
    with loop:
        for step in loop.steps("decode"):
            with step.warmup():
                pass
            with step.graph():
                t = fake.pool_tensor(step.bs, 4)
            step.hold(t)
            del t
    report = loop.graphs.report
    assert report.profiling == {"decode": 2} and report.pool_bytes == 16 * (8 + 4)
    assert [m.id for m in report.steps] == [
        "warmup/decode/8",
        "capture/decode/8",
        "warmup/decode/4",
        "capture/decode/4",
    ]
    assert loop.graphs.graphs == {} and dropped == [1]  # torn down, the engine told to drop its references
    gc.collect()
    assert fake.snapshot() == []
    with pytest.raises(ExecutorError, match=r"capture_loop\(profiling=\): the profiling pass names phase 'full'"):
        capture_loop(plan, device=CPU, profiling={"full": 2})


class _Clock:
    """A ``time`` stand-in whose ``perf_counter`` moves only when the model says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.mark.parametrize("driver", ["capture", "engine-loop"])
def test_a_capture_step_s_seconds_count_its_recording(tmp_path, fake, monkeypatch, driver):
    """A report's per-step seconds are what an operator (and a start-up prediction's
    ``timings``: capture.graphs against capture.other) reads for where capture time
    goes: a capture step counts its graph's recording, a warm-up step its eager runs.
    The model's forward takes 1 s recording and 0.25 s eagerly on a fake clock."""
    import capture_plan.executor.driver as driver_mod
    import capture_plan.executor.loop as loop_mod
    import capture_plan.executor.measure as measure_mod
    import capture_plan.executor.step as step_mod
    from capture_plan.executor import capture, capture_loop

    clock = _Clock()
    for mod in (driver_mod, loop_mod, measure_mod, step_mod):
        monkeypatch.setattr(mod, "time", clock)
    plan = _plan(tmp_path, "triton", ci=False)  # a warm-up before every capture
    model = Model(fake, {p.name: p.tokens_per_request for p in plan.phases})
    forward = model.forward

    def timed(phase, bs, ws):
        clock.now += 1.0 if fake.recording is not None else 0.25
        return forward(phase, bs, ws)

    model.forward = timed
    if driver == "capture":
        gs = capture(plan, AsTarget(model), progress=False, device=CPU)
    else:
        with capture_loop(plan, device=CPU) as loop:
            for step in loop.steps("decode"):
                for w in step.planned:
                    with step.warmup(of=w):
                        for _ in range(max(w.runs, 1)):
                            model.forward("decode", w.bs, None)
                with step.graph():
                    out = model.forward("decode", step.bs, None)
                step.hold(out)
                del out
        gs = loop.graphs
    try:
        runs = {s.id: max(s.runs, 1) for s in plan.steps if s.op == "warmup"}
        assert runs, "the plan warms up: the test needs both kinds of step"
        seconds = {m.id: m.seconds for m in gs.report.steps}
        assert seconds == {s.id: 1.0 if s.op == "capture" else 0.25 * runs[s.id] for s in plan.steps}
        assert gs.report.capture_seconds == sum(seconds.values())  # nothing else moved the clock
    finally:
        gs.release()
