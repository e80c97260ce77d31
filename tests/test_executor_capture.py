"""capture(plan, target) on CPU with CUDA faked (tests/fake_cuda.py): its steps, and what capture leaves behind.

capture() on CPU, CUDA faked (tests/fake_cuda.py): every plan step op runs,
the target called exactly as the plan's steps say, in order.

What capture leaves behind, on CPU with CUDA faked: warm-ups run in scratch
pools that are all returned, and the report's device view adds up.

A plan with a vLLM PIECEWISE phase is refused by capture() before any work: its
graphs are pieces between eagerly-run attention ops, which the engine's
piecewise wrappers record through capture_loop. Before, the executor captured
each step as one whole graph: a different graph from the one the plan
describes, silently."""

from __future__ import annotations

import ctypes
import re
import threading
from pathlib import Path
from typing import get_args

import pytest

torch = pytest.importorskip("torch")
from fake_cuda import Target, decode_plan  # noqa: E402

CPU = torch.device("cpu")


PHASES = (
    '[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 2, 4, 8]\n'
    '[[phases]]\nname = "target_verify"\nkind = "target_verify"\nsizes = [1, 2, 4]\ntokens_per_request = 4\n'
)


def _plan(tmp_path: Path, backend: str, *strategies: str, ci: bool = False):
    from capture_plan.planner import BuildOptions, build_plan

    spec = tmp_path / "spec.toml"
    spec.write_text(PHASES)
    # outputs=keep: the fake has no device memory to take non-owning views of
    return build_plan(BuildOptions(backend=backend, ci=ci, spec=spec, strategies=("outputs=keep", *strategies)))


def _expected_calls(plan) -> list[tuple]:
    """The target calls each step op makes, as the loop's docstring states them."""
    hoisted: set[str] = set()
    calls = []
    for s in plan.steps:
        ws = s.phase in hoisted
        if s.op == "provision":
            hoisted.add(s.phase)
        elif s.op == "warmup":
            for _ in range(max(s.runs, 1)):
                calls += [("refresh", s.phase, s.bs, False, True)] * ws + [("run", s.phase, s.bs, False, ws)]
        else:  # the refresh runs eagerly before recording; the run is recorded
            calls += [("refresh", s.phase, s.bs, False, True)] * ws + [("run", s.phase, s.bs, True, ws)]
    return calls


def test_every_plan_step_op_runs_somewhere():
    """provision: the loop's setup; warmup and capture: with the capture they
    precede, in the loop's step (capture() is a user of capture_loop)."""
    import inspect

    from capture_plan.executor.loop import CaptureLoop, LoopStep
    from capture_plan.schemas.plan import StepOp

    setup = inspect.getsource(CaptureLoop.setup)
    assert all(f'"{op}"' in setup for op in get_args(StepOp))
    assert callable(LoopStep.warmup) and callable(LoopStep.graph)


@pytest.mark.parametrize(
    "backend,strategies,ci",
    [
        ("fa3", (), True),  # one warm-up per phase, smallest-first gate
        ("triton", (), False),  # a warm-up before every capture
        ("fa3", ("workspace=hoisted", "pool=own"), False),  # provision steps, a pool per phase
    ],
)
def test_the_target_is_called_exactly_as_the_plan_steps_say(tmp_path, fake, backend, strategies, ci):
    from capture_plan.executor import capture

    plan = _plan(tmp_path, backend, *strategies, ci=ci)
    assert {s.op for s in plan.steps} >= {"warmup", "capture"}
    target = Target(fake)
    gs = capture(plan, target, progress=False, device=CPU)
    try:
        assert target.calls == _expected_calls(plan)
        captures = [s for s in plan.steps if s.op == "capture"]
        assert list(gs.graphs) == [(s.phase, s.bs) for s in captures]
        assert [c.order for c in gs.graphs.values()] == list(range(len(captures)))
        assert [(c.pool, c.held) for c in gs.graphs.values()] == [(s.pool, s.outputs or "keep") for s in captures]
        assert set(gs.pools) == {s.pool for s in captures} and fake.pools == len(gs.pools)
        provisions = {s.phase: max(s.bytes, 1) for s in plan.steps if s.op == "provision"}
        assert {p: w.numel() for p, w in gs.workspaces.items()} == provisions
        assert gs.report.hoisted_bytes == sum(provisions.values())
        predicted = {m.step: m.reserved for m in plan.predicted.timeline}
        assert [(m.step, m.id, m.predicted_reserved) for m in gs.report.steps] == [
            (s.index, s.id, predicted.get(s.index, 0)) for s in plan.steps
        ]
        assert [(p, b) for _, p, b in gs.timeline] == [(s.phase, s.bs) for s in captures]
    finally:
        gs.release()
    if "pool=own" in strategies:
        assert len({s.pool for s in plan.steps if s.op == "capture"}) == 2


def test_a_step_op_the_executor_does_not_know_is_one_clear_error(tmp_path, fake):
    import msgspec

    from capture_plan.executor import ExecutorError, capture

    plan = _plan(tmp_path, "torch")
    steps = [msgspec.structs.replace(s, op="free") if s.index == 1 else s for s in plan.steps]
    bad = msgspec.structs.replace(plan, steps=steps)
    with pytest.raises(ExecutorError, match=r"unknown step op 'free'.*fix: upgrade"):
        capture(bad, Target(fake), progress=False, device=CPU)


def _leak(fake, gs) -> None:
    """A segment of the set's pool that outlives it, as a kept output held by the engine would."""
    (pid,) = gs.pools.values()
    fake.segments = [{"address": 1 << 20, "total_size": 512, "segment_pool_id": pid}]


def _records(caplog) -> list[tuple[str, str, str]]:
    return [(r.name, r.levelname, r.getMessage()) for r in caplog.records]


def test_capture_logs_through_the_named_logger_and_prints_nothing(tmp_path, fake, caplog, capsys):
    import logging

    from capture_plan.executor import capture

    caplog.set_level(logging.DEBUG, logger="capture_plan.executor")
    plan = _plan(tmp_path, "torch")
    gs = capture(plan, Target(fake), progress=False, device=CPU)
    _leak(fake, gs)
    gs.release()
    got = _records(caplog)
    assert {name for name, _, _ in got} == {"capture_plan.executor"}
    (summary,) = [m for _, level, m in got if level == "INFO"]
    assert re.fullmatch(
        rf"capture-plan: 7 graphs of {plan.name} in [\d.]+ s; pool 0.0 MiB, predicted "
        r"[\d,.]+ MiB \(-100.0%\); free device memory [\d,.]+ MiB less",
        summary,
    ), summary
    progress = [m for _, level, m in got if level == "DEBUG"]
    assert progress[0].startswith("capture-plan: 1/7 graphs in ") and "servable up to n=" in progress[0]
    assert progress[-1].startswith("capture-plan: 7/7 graphs in ")
    (warning,) = [m for _, level, m in got if level == "WARNING"]
    assert warning.startswith("capture-plan: 512 B of released graph pools are still held")
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize("rank", [0, 1])
def test_under_torch_distributed_rank0_logs_progress_and_every_rank_its_warnings(
    tmp_path, fake, caplog, capsys, monkeypatch, rank
):
    """One gloo process plays rank 0 or (its rank faked) rank 1 of the world."""
    import logging

    import torch.distributed as dist

    from capture_plan.executor import capture, driver

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    caplog.set_level(logging.DEBUG, logger="capture_plan.executor")
    plan = _plan(tmp_path, "torch")
    bars = []
    monkeypatch.setattr(driver, "_progress", lambda steps, enabled: bars.append(enabled))  # tqdm may be absent
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        if rank:
            monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
        gs = capture(plan, Target(fake), progress=True, device=CPU)
        _leak(fake, gs)
        gs.release()
    finally:
        dist.destroy_process_group()
    got = _records(caplog)
    levels = [level for _, level, _ in got]
    (warning,) = [m for _, level, m in got if level == "WARNING"]
    assert warning.startswith(f"capture-plan [rank {rank}]: 512 B of released graph pools are still held")
    assert bars == [rank == 0]  # the tqdm bar on rank 0 only
    assert capsys.readouterr() == ("", "")
    if rank == 0:
        assert levels.count("INFO") == 1 and "DEBUG" in levels
    else:
        assert levels == ["WARNING"]


def test_under_torch_distributed_a_failed_capture_is_exchanged_naming_the_rank_and_step(tmp_path, fake):
    """capture() under torch.distributed: a failing step is reported through the ranks'
    status exchange (every rank raises the same CaptureFailed, naming rank and step), and
    the exchange names this rank. One gloo process, world of one."""
    import torch.distributed as dist

    from capture_plan.executor import CaptureFailed, capture

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    plan = _plan(tmp_path, "torch")
    step = next(s for s in plan.steps if s.op == "capture" and s.bs == 2)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(CaptureFailed, match=rf"rank 0 failed at step {step.index} \({step.id}\)"):
            capture(plan, Target(fake, fail_at=2), progress=False, device=CPU)
    finally:
        dist.destroy_process_group()


def test_nothing_outside_graphset_reaches_into_its_private_members():
    """GraphSet's state is its own: other modules, benches and tests use its methods."""
    import ast

    root = Path(__file__).resolve().parent.parent
    tree = ast.parse((root / "executor" / "graphs.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GraphSet"]
    private = {
        n.attr
        for n in ast.walk(cls)
        if isinstance(n, ast.Attribute)
        and n.attr.startswith("_")
        and not n.attr.startswith("__")
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
    }
    private |= {
        f.name
        for f in cls.body
        if isinstance(f, ast.FunctionDef) and f.name.startswith("_") and not f.name.startswith("__")
    }
    assert {"_tables", "_refresh", "_bg"} <= private
    reach = []
    for path in sorted(p for d in ("executor", "adapters", "bench", "tests") for p in (root / d).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):  # GraphSet's own code says self._x
            if (
                isinstance(node, ast.Attribute)
                and node.attr in private
                and not (isinstance(node.value, ast.Name) and node.value.id == "self")
            ):
                reach.append(f"{path.relative_to(root)}:{node.lineno}: .{node.attr}")
    assert reach == []


@pytest.mark.parametrize("backend", ["torch", "triton"])  # triton warms up at every size
def test_every_warmup_runs_in_a_scratch_pool_that_is_returned_and_no_capture_does(tmp_path, fake, backend):
    from capture_plan.executor import capture
    from capture_plan.planner import BuildOptions, build_plan

    spec = tmp_path / "spec.toml"
    spec.write_text('[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 2, 4, 8]\n')
    plan = build_plan(BuildOptions(backend=backend, spec=spec, strategies=("outputs=keep",)))
    target = Target(fake)
    gs = capture(plan, target, progress=False, device=CPU)
    runs = [(c[3], scratch) for c, scratch in zip(target.calls, target.scratch)]
    warmups = sum(s.runs for s in plan.steps if s.op == "warmup")
    assert sorted(runs).count((False, True)) == warmups >= 1  # every eager (warm-up) run: in a scratch pool
    assert (True, True) not in runs  # no capture records into one
    # one per warm-up step (the cuBLAS priming uses none: its operands would keep a segment);
    # all destroyed before capture() returns
    assert fake.mempools == sum(s.op == "warmup" for s in plan.steps) == fake.mempools_freed
    gs.release()


def test_device_view_items_add_up_to_the_free_memory_drop():
    from capture_plan.executor.device import Probe, device_view

    MiB = 2**20
    before = Probe(free=10_000 * MiB, reserved=100 * MiB, allocated=90 * MiB)
    # the pools: 258 MiB reserved, 200 allocated; the cuBLAS workspace 32 MiB held; 2 MiB cached;
    # 1 KiB hoisted; and 162 MiB outside the allocator
    after = Probe(
        free=before.free - (258 + 32 + 2 + 162) * MiB - 1024,
        reserved=before.reserved + (258 + 32 + 2) * MiB + 1024,
        allocated=before.allocated + (200 + 32) * MiB + 1024,
    )
    view = device_view(
        before,
        after,
        pool_reserved=258 * MiB,
        pool_allocated=200 * MiB,
        hoisted=1024,
        first_in_process=True,
        background=False,
    )
    assert {i.name: i.bytes for i in view.items} == {
        "pool": 258 * MiB,
        "hoisted": 1024,
        "allocator-held": 32 * MiB,
        "allocator-cached": 2 * MiB,
        "outside-allocator": 162 * MiB,
    }
    assert view.drop == sum(i.bytes for i in view.items) == before.free - after.free
    assert "first graph capture" in next(i.cause for i in view.items if i.name == "outside-allocator")


def test_only_the_first_capture_of_the_process_is_marked_first(tmp_path, fake):
    from capture_plan.executor import capture, measure

    measure._captured_in_process = False
    plan = decode_plan(tmp_path, [1, 2])
    first = capture(plan, Target(fake), progress=False, device=CPU)
    second = capture(plan, Target(fake), progress=False, device=CPU)
    assert first.report.device_view.first_in_process and not second.report.device_view.first_in_process
    assert all(m.free is not None for m in first.report.steps)
    first.release()
    second.release()


ROOT = Path(__file__).resolve().parent.parent


class _Never:
    """A target that must not run: the refusal comes before any work."""

    def run(self, phase, bs, ws):
        raise AssertionError("ran")

    prepare = refresh = run


def test_capture_refuses_a_plan_with_a_piecewise_phase_before_any_work(fake):
    from capture_plan.executor import ExecutorError, capture, load_plan

    plan = load_plan(ROOT / "plans/fa3-vllm.json", check_env=False)
    assert [p.kind for p in plan.phases] == ["piecewise", "full"]
    with pytest.raises(ExecutorError, match=r"capture: phase 'piecewise' is 'piecewise'.*fix: record the pieces"):
        capture(plan, _Never(), progress=False, device=torch.device("cpu"))
    assert fake.pools == 0


class _Kept:
    """A recorded graph with (or without) its cudaGraph_t kept, as torch's CUDAGraph."""

    def __init__(self, raw):
        self.raw, self.instantiated = raw, 0

    def raw_cuda_graph(self):
        if self.raw is None:
            raise RuntimeError("You cannot access the raw cudaGraph_t instance unless keep_graph=True")
        return self.raw

    def instantiate(self):
        self.instantiated += 1


def test_a_kept_graph_is_counted_then_instantiated_and_an_engines_own_left_alone(monkeypatch):
    from capture_plan.executor import graph_nodes

    def get_nodes(graph, nodes, count):
        assert graph.value == 0xABC and nodes is None  # the count alone
        count._obj.value = 912
        return 0

    monkeypatch.setattr(graph_nodes, "_get_nodes", lambda: get_nodes)
    kept = _Kept(0xABC)
    assert graph_nodes.instantiate_kept(kept) == 912 and kept.instantiated == 1
    own = _Kept(None)  # an engine's CUDAGraph(): torch instantiated it at capture_end
    assert graph_nodes.instantiate_kept(own) is None and own.instantiated == 0
    monkeypatch.setattr(graph_nodes, "_get_nodes", lambda: None)  # no libcuda.so.1: unknown, never 0
    assert graph_nodes.node_count(_Kept(0xABC)) is None


def test_every_capture_step_reports_its_graphs_nodes_and_no_warmup_does(tmp_path, fake, monkeypatch):
    from capture_plan.executor import capture, recording

    counted = iter(range(100, 200))
    monkeypatch.setattr(recording, "instantiate_kept", lambda g: next(counted) if g.keep_graph else None)
    plan = decode_plan(tmp_path, [1, 2, 4])
    gs = capture(plan, Target(fake), progress=False, device=CPU)
    got = {m.id: m.graph_nodes for m in gs.report.steps}
    gs.release()
    assert [got[s.id] for s in plan.steps if s.op == "capture"] == [100, 101, 102]
    assert all(got[s.id] is None for s in plan.steps if s.op != "capture")


def _fake_driver(monkeypatch, inst, nodes) -> set:
    """The driver's instantiate and destroy for ExecCopies: ``inst(out, raw, flags)`` makes a
    copy (it adds the handle it gives ``out`` to the set returned, the copies alive) and
    ``nodes(graph)`` counts a graph's nodes; destroying a copy takes it out of the set."""
    from capture_plan.executor import graph_nodes

    alive: set = set()

    def destroy(ex):
        alive.remove(ex.value)
        return 0

    monkeypatch.setattr(graph_nodes, "_exec_calls", lambda: (lambda out, raw, flags: inst(out, raw, alive), destroy))
    monkeypatch.setattr(graph_nodes, "node_count", nodes)
    return alive


def test_graph_copies_of_every_phase_stay_alive_until_closed(monkeypatch):
    """The driver lends a destroyed copy's memory to the next: copies destroyed phase by
    phase measured EAGLE's later phases at a tenth of their driver memory on the H200.
    Every copy must be alive when the last one is made."""
    from capture_plan.executor import graph_nodes

    most = [0]

    def inst(out, raw, alive):
        out._obj.value = 1000 + len(alive) + most[0] * 7
        alive.add(out._obj.value)
        most[0] = max(most[0], len(alive))
        return 0

    alive = _fake_driver(monkeypatch, inst, lambda g: 900)
    copies = graph_nodes.ExecCopies()
    assert copies.add([_Kept(0x1), _Kept(0x2)], 5) == (5, 4500)  # a phase's two graphs, in turn
    assert copies.add([_Kept(0x3)], 3) == (3, 2700)  # the next phase's, the first's still alive
    assert len(alive) == most[0] == 8
    copies.close()
    assert not alive
    assert copies.add([_Kept(None)], 4) == (0, 0)  # an engine's own graph has nothing to copy


def test_copies_of_a_phase_s_graphs_are_made_side_by_side_one_thread_per_graph(monkeypatch):
    """A start-up prediction waits for its graph copies: each graph's are made on a thread
    of its own (the driver instantiates different graphs at once), the same copies as in
    turn, never one graph from two threads at once, each thread bound to the caller's
    CUDA context (a new thread has none: the driver refuses it)."""
    from capture_plan.executor import graph_nodes

    graphs = [_Kept(0x1), _Kept(0x2), _Kept(0x3)]
    meet = threading.Barrier(3, timeout=30)  # only copies made side by side get past it
    lock, busy, made, bound = threading.Lock(), set(), [], set()

    def inst(out, raw, flags):
        with lock:
            assert raw.value not in busy, "one graph instantiated from two threads at once"
            busy.add(raw.value)
            made.append(raw.value)
            out._obj.value = 1000 + len(made)
        if made.count(raw.value) == 1:
            meet.wait()
        with lock:
            busy.discard(raw.value)
        return 0

    monkeypatch.setattr(graph_nodes, "_exec_calls", lambda: (inst, lambda ex: 0))
    monkeypatch.setattr(graph_nodes, "node_count", lambda g: {0x1: 10, 0x2: 20, 0x3: 30}[g.raw])
    monkeypatch.setattr(graph_nodes, "_context_binder", lambda: lambda: bound.add(threading.get_ident()))
    copies = graph_nodes.ExecCopies()
    assert copies.add(graphs, 8) == (8, 3 * 10 + 3 * 20 + 2 * 30)  # in turn: 1, 2, 3, 1, 2, 3, 1, 2
    assert sorted(made) == [1, 1, 1, 2, 2, 2, 3, 3]
    assert len(bound) == 3 and threading.get_ident() not in bound
    copies.close()
    assert copies._made == []


def test_a_refused_copy_stops_every_thread_and_what_was_made_is_destroyed(monkeypatch):
    """Out of memory on one graph's thread stops the others at their next copy: graph 1's
    first copy returns only once graph 2's thread, refused at its first, has ended."""
    from capture_plan.executor import graph_nodes

    lock, refusing = threading.Lock(), []
    refused = threading.Event()

    def inst(out, raw, alive):
        if raw.value == 0x2:
            refusing.append(threading.current_thread())
            refused.set()
            return 2  # CUDA_ERROR_OUT_OF_MEMORY
        assert refused.wait(timeout=30), "graph 2's copy never ran beside graph 1's"
        refusing[0].join(timeout=30)  # its thread has stopped the others by now
        with lock:
            out._obj.value = 100 + len(alive)
            alive.add(out._obj.value)
        return 0

    alive = _fake_driver(monkeypatch, inst, lambda g: 5)
    copies = graph_nodes.ExecCopies()
    assert copies.add([_Kept(0x1), _Kept(0x2)], 40) == (1, 5)  # graph 1's first copy, then nothing
    assert len(alive) == 1
    copies.close()
    assert not alive


@pytest.mark.parametrize("side_by_side", [True, False])
def test_a_copy_that_fails_otherwise_is_an_error_not_a_short_count(monkeypatch, side_by_side):
    """Only out of memory ends the copies short: any other CUresult (an invalid context,
    201, on a thread without one) would leave the prediction's driver memory short."""
    from capture_plan.executor import ExecutorError, graph_nodes

    def inst(out, raw, alive):
        if raw.value == 0x2 or len(alive) >= 3:
            return 201
        out._obj.value = 100 + len(alive)
        alive.add(out._obj.value)
        return 0

    alive = _fake_driver(monkeypatch, inst, lambda g: 5)
    copies = graph_nodes.ExecCopies()
    graphs = [_Kept(0x1), _Kept(0x2)] if side_by_side else [_Kept(0x1)]
    with pytest.raises(ExecutorError, match=r"instantiating a copy of graph 0x[12] failed with CUresult 201"):
        copies.add(graphs, 8)
    copies.close()  # what was made before the failure is still destroyed
    assert not alive


def test_a_context_the_thread_cannot_bind_is_an_error(monkeypatch):
    from capture_plan.executor import ExecutorError, graph_nodes, libcuda

    def get(out):
        out._obj.value = 0xC0
        return 0

    monkeypatch.setattr(libcuda, "calls", lambda *names: {"cuCtxGetCurrent": get, "cuCtxSetCurrent": lambda c: 201})
    with pytest.raises(ExecutorError, match=r"could not make the caller's CUDA context current \(CUresult 201\)"):
        graph_nodes._context_binder()()


def test_the_context_binder_makes_the_caller_s_context_current(monkeypatch):
    from capture_plan.executor import graph_nodes, libcuda

    current, set_to = ctypes.c_void_p(0xC0), []

    def get(out):
        out._obj.value = current.value
        return 0

    def put(ctx):
        set_to.append(ctx.value)
        return 0

    monkeypatch.setattr(libcuda, "calls", lambda *names: {"cuCtxGetCurrent": get, "cuCtxSetCurrent": put})
    bind = graph_nodes._context_binder()
    current.value = 0xD0  # the caller's context is the one it had when the binder was made
    t = threading.Thread(target=bind)
    t.start()
    t.join()
    assert set_to == [0xC0]
    current.value = None  # no current context: nothing to bind
    graph_nodes._context_binder()()
    assert set_to == [0xC0]
    monkeypatch.setattr(libcuda, "calls", lambda *names: "libcuda.so.1 cannot be loaded")
    assert graph_nodes._context_binder()() is None


def test_record_on_a_named_device_returns_the_trace_and_every_phases_copies(tmp_path, fake, monkeypatch):
    """record(device=...) once overwrote ``device`` with the report's device name before
    it chose the device of its copies; the fake's graphs keep no driver graph, so no copy
    is made and each phase says so."""
    from capture_plan.executor import loop
    from capture_plan.executor.pool import Window
    from capture_plan.executor.profiling import record

    class Recorder:  # the allocation history, which the fake cannot keep: empty windows
        def __init__(self):
            self.n = 0

        def begin(self):
            pass

        def end(self):
            self.n += 1

        def stop(self):
            return [Window() for _ in range(self.n)]

        def close(self):
            pass

    monkeypatch.setattr(loop, "AllocationRecorder", Recorder)
    plan = decode_plan(tmp_path, [1, 2, 4, 8])
    rec = record(plan, Target(fake), sizes={"decode": [1, 4, 8]}, device=CPU, instantiate={"decode": 4})
    assert sorted(c.bs for c in rec.trace.captures) == [1, 4, 8]
    assert rec.trace.device.endswith(f"/ torch {torch.__version__}")
    assert rec.copies == {"decode": (0, 0, 0)}


def test_capture_of_a_plan_with_graph_keys_calls_the_target_by_each_key_s_name(tmp_path, fake):
    """capture() iterates every graph key of the plan: the target's run gets the
    key's dispatch name (the phase, and its labels), and replays dispatch by it."""
    import sys

    from capture_plan.executor import capture

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from engines.plans import keyed

    plan = keyed(decode_plan(tmp_path, [1, 2, 4]), "decode", variants={"lora": ["lora", "nolora"]})
    target = Target(fake)
    gs = capture(plan, target, progress=False, device=CPU)
    try:
        recorded = [(phase, bs) for op, phase, bs, rec, _ in target.calls if op == "run" and rec]
        assert recorded == [(f"decode/lora={v}", b) for b in (4, 2, 1) for v in ("lora", "nolora")]
        assert sorted(gs.graphs) == sorted((f"decode/lora={v}", b) for b in (1, 2, 4) for v in ("lora", "nolora"))
        assert gs.padded(gs.variant("decode", lora="nolora"), 3) == 4
    finally:
        gs.release()


def test_no_per_pool_snapshot(monkeypatch):
    """torch 2.11's ``memory_snapshot(mempool_id=)`` of the warm-ups' scratch
    ``MemPool`` corrupted the native heap on an H200 (a later memory_stats
    segfaulted in one long GPU test process); a graph pool handle's id is
    ``(0, n)`` like a MemPool's, so every pool is measured from the whole
    snapshot, filtered by its id."""
    from capture_plan.executor import pool as pool_mod

    asked = []
    segs = [
        {"address": 0, "segment_pool_id": (0, 7), "total_size": 2 << 20},
        {"address": 1 << 30, "segment_pool_id": (0, 8), "total_size": 4 << 20},
        {"address": 2 << 30, "segment_pool_id": (0, 0), "total_size": 8 << 20},
    ]

    def snapshot(mempool_id=None):
        asked.append(mempool_id)
        return [s for s in segs if mempool_id is None or tuple(s["segment_pool_id"]) == tuple(mempool_id)]

    monkeypatch.setattr(torch.cuda, "memory_snapshot", snapshot)
    assert pool_mod.one_pool_reserved((0, 7)) == 2 << 20
    assert pool_mod.one_pool_reserved([0, 8]) == 4 << 20
    assert asked == [None, None]


def _fake_probe_driver(launch_rc: int, calls: list) -> dict:
    """The cluster probe's driver calls, as fakes that log themselves."""

    def fn(name, rc=0, effect=None):
        def call(*args):
            calls.append(name)
            if effect is not None:
                effect(*args)
            return rc

        return call

    def made(handle):  # an out-parameter (ctypes.byref) set to a non-null handle
        return lambda out, *rest: setattr(out._obj, "value", handle)

    fake = {
        "cuStreamCreate": fn("stream create", effect=made(0x10)),
        "cuStreamBeginCapture_v2": fn("begin capture"),
        "cuLaunchKernelEx": fn("launch", rc=launch_rc),
        "cuStreamEndCapture": fn("end capture", effect=lambda stream, out: setattr(out._obj, "value", 0x20)),
        "cuGraphDestroy": fn("graph destroy"),
        "cuStreamDestroy_v2": fn("stream destroy"),
    }
    return fake


def test_the_cluster_probe_destroys_the_graph_a_refused_launch_leaves():
    """exec_update._captured_launch: a refused launch may still end its capture with a graph;
    it is destroyed with the stream (review finding: it leaked)."""
    from capture_plan.executor import exec_update, libcuda

    calls: list[str] = []
    fake = _fake_probe_driver(launch_rc=1, calls=calls)
    got = exec_update._captured_launch({}, fake, libcuda.KernelParams(), (4, 1, 1), (8, 1, 1))
    assert got == (1, -1, None)
    assert calls == ["stream create", "begin capture", "launch", "end capture", "graph destroy", "stream destroy"]
