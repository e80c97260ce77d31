"""The engine plugins' start-up from a graph file (``CAPTURE_PLAN_GRAPHS``, issue 51 deliverable 4)
on the engine-faithful runners of tests/engines/ as the engines ship them, on the CPU: torch.cuda
faked (tests/fake_cuda.py) and the driver faked (tests/restore_device.py, the fakes of
tests/test_restore.py), every graph walking as one fake graph whose addresses the test places.

Checked, for SGLang 0.5.23 (its four runners made one after another) and each vLLM release:
the first start-up, with no file yet, captures through the plan and writes the file; the next,
a fresh engine whose model, pools and workspace lie elsewhere, restores every graph from it
instead (no warm-up, no recording of the engine's), hands each to wherever the engine keeps its
graphs and outputs, every address relocated to this start-up's memory (vLLM's engine-owned KV
range too), and reports it; a file refused (another driver) is one WARNING and the plan's
capture, the file kept; a plan a restore can never take is not written, one WARNING saying why.
The same start-ups on a GPU, in fresh processes, replays compared bit for bit:
tests/test_gpu_plugins_restore.py.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import msgspec
import pytest

from capture_plan.adapters.plugins import core, restoring, sglang as sgl_plugin, vllm as vllm_plugin

torch = pytest.importorskip("torch")  # before the engines' runners, which import torch

import restore_device  # noqa: E402
from engines import harness  # noqa: E402
from engines.plans import build  # noqa: E402
from engines.plugged import loops_on_cpu, plan_file, sglang_release, vllm_release  # noqa: E402
from engines.toy import ToyModel  # noqa: E402

CPU = torch.device("cpu")
SIZES = [1, 2, 4, 8]
MiB = 1 << 20
#: cuBLAS's workspace in the saving start-up and in the restoring one
WS, NEW_WS = 0x7700_0000_0000, 0x7800_0000_0000
#: vLLM's extensible KV cache reservation in each start-up (memory the engine owns outside torch's allocator)
KV, NEW_KV = 0x7A00_0000_0000, 0x7B00_0000_0000


@pytest.fixture
def dev(fake, monkeypatch):
    """The fake CUDA and driver (tests/restore_device.py), the plugins' loops on the CPU."""
    loops_on_cpu(monkeypatch)
    return restore_device.install(fake, monkeypatch)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# -- SGLang 0.5.23 --------------------------------------------------------------------------------


def _sglang_start(dev, monkeypatch, tmp_path, plan, ws: int):
    """One SGLang start-up with the plugin registered (``CAPTURE_PLAN_PLAN`` and
    ``CAPTURE_PLAN_GRAPHS`` set by the caller): a fresh release, model and engine, its one
    capture stream holding cuBLAS's workspace at ``ws``, the graph's tensor its model's weight;
    its runners made one after another, each capturing. Returns (module, model, engine)."""
    from capture_plan.executor import streams

    module = sglang_release(monkeypatch, tmp_path)
    sgl_plugin.register()
    tokens = {p.name: p.tokens_per_request for p in plan.phases}
    model = ToyModel(tokens, max_tokens=max(SIZES) * max(tokens.values()), fake=dev.fake)
    module.reset_globals()
    stream = module.get_or_create_global_graph_capture_stream()  # the loop's stream: its workspace the file's
    dev.fake.segments[:] = []  # a fresh process: the saving one's workspace is not here
    restore_device.workspace(dev.fake, stream, ws)
    restore_device.workspace(dev.fake, streams.capture_stream(CPU), ws + 64 * MiB)  # the executor's (a restore's)
    adoption = module.FullCudaGraphBackend

    def place():
        loop = getattr(getattr(adoption, "__capture_plan__", None), "loop", None)
        try:
            pool = restore_device.pool_segment(dev.fake, loop.gs.pools["shared"])
        except (AttributeError, KeyError, ValueError):  # no graph in the pool yet (a restore's loading run)
            pool = 0x7000_0000_0000
        return {"pool": pool, "tensor": model.w.data_ptr(), "word": ws + 0x80}

    dev.driver.place = place
    dev.driver.ranges = [(model.w.data_ptr(), model.w.untyped_storage().nbytes())]
    engine = harness.SGLangEngine()
    harness.capture_in_plan_order(engine, harness.sglang_runners(module, model, SIZES), plan)
    return module, model, engine


def _sglang_plan(tmp_path, monkeypatch, path):
    plan = harness.sglang_plan(tmp_path, SIZES)
    monkeypatch.setenv(core.ENV_PLAN, str(plan_file(tmp_path, plan)))
    monkeypatch.setenv(core.ENV_GRAPHS, str(path))
    return plan


def test_sglang_writes_its_graph_file_then_restores_every_graph_from_it(dev, monkeypatch, tmp_path, caplog):
    from capture_plan.executor.graph_restore import RestoredGraph
    from capture_plan.schemas.graph_file import read_graph_file

    path = tmp_path / "graphs.cpgraphs"
    plan = _sglang_plan(tmp_path, monkeypatch, path)
    keys = sum(s.op == "capture" for s in plan.steps)
    caplog.set_level(logging.INFO, logger="capture_plan.plugins")
    # the first start-up: no file yet, captured through the plan, then written
    module, model, engine = _sglang_start(dev, monkeypatch, tmp_path, plan, WS)
    adoption = module.FullCudaGraphBackend.__capture_plan__
    gs = adoption.loop.graphs
    assert len(gs.graphs) == len(engine.graphs) == keys and sum(r.backend.warmup_runs for r in engine.runners) > 0
    outcome = adoption.graphs.outcome
    assert (outcome.what, outcome.saved, outcome.graphs) == ("captured", True, keys), outcome
    assert _warnings(caplog) == [] and f"SGLang captured ({path} was not there yet); wrote {path}" in caplog.text
    saved = read_graph_file(path)
    names = {s.name for s in saved.segments}
    # named as a restore finds them: the plan's pool, the runners' weight, the loop stream's cuBLAS workspace
    assert {"tensor:decode.model.w", "workspace:capture/0"} <= names and any(
        n.startswith("pool:shared/") for n in names
    )
    first = engine, gs  # alive until the next start-up restored: its memory is not handed out again meanwhile
    # the next start-up: a fresh engine and model, its memory elsewhere: every graph restored, none captured
    caplog.clear()
    dev.driver.nodes.clear()
    module, model2, engine = _sglang_start(dev, monkeypatch, tmp_path, plan, NEW_WS)
    adoption = module.FullCudaGraphBackend.__capture_plan__
    start = adoption.graphs
    assert start.restored and start.outcome.graphs == keys and _warnings(caplog) == []
    assert f"SGLang restored {keys} graphs from {path} in " in caplog.text
    assert sum(r.backend.warmup_runs for r in engine.runners) == 0  # no warm-up of the engine's ran
    # the restore's eager run of each loading key is followed by SGLang's post-warm-up hook, its recording not
    assert getattr(model2, "after_warmup", 0) == len(start.outcome.report.keys) > 0
    assert not adoption.loop.complete  # the plan's loop never opened: nothing captured
    report = start.outcome.report
    assert report.segments == report.moved == len(saved.segments)  # every segment lies elsewhere
    # every graph the engine keeps is a restored one, its outputs shaped as the saved ones
    assert len(engine.graphs) == keys and all(isinstance(g, RestoredGraph) for g in engine.graphs.values())
    for (phase, *shape_key), out in engine.outputs.items():
        rows = shape_key[0] * {p.name: p.tokens_per_request for p in plan.phases}[phase]
        assert isinstance(out, torch.Tensor) and out.shape == (rows, model2.hidden), (phase, shape_key)
    # every address relocated to this start-up's memory: its weight, its workspace, its restored pool
    kernels = dev.driver.kernels()
    assert len(kernels) == keys
    memory = restore_device.restored_memory(dev)
    # (the workspace: the executor's capture stream's, the stream a restore primes and loads the kernels on)
    for pointer, _, _, tensor, seven, word in kernels:
        assert (tensor, seven, word) == (model2.w.data_ptr() + 8, 7, NEW_WS + 64 * MiB + 0x80)
        assert any(a <= pointer < a + n for a, n in memory), hex(pointer)
    # the engine replays them as its own
    runner = engine.runners[0]
    shape_key = next(iter(runner.backend._graphs))
    before = len(dev.driver.launched)
    assert runner.backend.replay(shape_key) is runner.backend._outputs[shape_key]
    assert len(dev.driver.launched) == before + 1
    engine.cleanup()
    start.gs.release()
    first[0].cleanup()
    first[1].release()


def test_sglang_a_refused_file_is_one_warning_then_the_plans_capture(dev, monkeypatch, tmp_path, caplog):
    from capture_plan.schemas.graph_file import encode, read_graph_file

    path = tmp_path / "graphs.cpgraphs"
    plan = _sglang_plan(tmp_path, monkeypatch, path)
    _, _, engine = _sglang_start(dev, monkeypatch, tmp_path, plan, WS)
    engine.cleanup()
    file = read_graph_file(path)
    other = msgspec.structs.replace(file, valid_for=msgspec.structs.replace(file.valid_for, driver="575.1"))
    path.write_bytes(encode(other))
    caplog.clear()
    module, model, engine = _sglang_start(dev, monkeypatch, tmp_path, plan, NEW_WS)
    adoption = module.FullCudaGraphBackend.__capture_plan__
    (line,) = _warnings(caplog)
    assert line.startswith(f"capture-plan: graph file {path}: not restored: driver differs: the file was saved with")
    assert f"capturing through the plan instead ({path} is kept: delete it" in line
    outcome = adoption.graphs.outcome
    assert outcome.what == "captured" and "driver differs" in outcome.why and not outcome.saved
    # every runner captured through the plan, in its order, none left out
    gs = adoption.loop.graphs
    assert [m.id for m in gs.report.steps] == [s.id for s in plan.steps]
    assert len(engine.graphs) == len(gs.graphs) == sum(s.op == "capture" for s in plan.steps)
    assert all(r.backend.warmup_runs > 0 for r in engine.runners)
    assert path.read_bytes() == encode(other)  # kept as it was
    engine.cleanup()
    gs.release()


def test_a_graph_file_without_a_plan_is_refused_in_one_line(monkeypatch):
    monkeypatch.delenv(core.ENV_PLAN, raising=False)
    monkeypatch.setenv(core.ENV_GRAPHS, "graphs.cpgraphs")
    with pytest.raises(
        core.PluginRefused, match="CAPTURE_PLAN_GRAPHS=graphs.cpgraphs is set without CAPTURE_PLAN_PLAN"
    ):
        core.settings()
    monkeypatch.delenv(core.ENV_GRAPHS)
    assert core.settings() is None


# -- vLLM ----------------------------------------------------------------------------------------


def _full_plan(tmp_path, monkeypatch, path, *, calibrated: bool = False):
    """vLLM's FULL decode graphs alone (``cudagraph_mode`` FULL_DECODE_ONLY, no micro-batch twins):
    a plan a restore can take (no piecewise phase); ``calibrated``: its whole-capture figure complete."""
    from engines.plans import calibrated as calibrate

    spec = f'[[phases]]\nname = "full_decode"\nkind = "full"\nsizes = {SIZES}\n'
    plan = build(tmp_path, spec, "warmup=every-size", "outputs=view")
    plan = calibrate(plan) if calibrated else plan
    monkeypatch.setenv(core.ENV_PLAN, str(plan_file(tmp_path, plan)))
    monkeypatch.setenv(core.ENV_GRAPHS, str(path))
    return plan


def _vllm_start(dev, monkeypatch, tmp_path, version, kv: int, ws: int, *, mode=None):
    """One vLLM start-up with the plugin registered: a fresh release, model and runner (FULL
    decode graphs only, unless ``mode``), its extensible KV cache reserved at ``kv`` (4 MiB),
    the executor's capture stream holding cuBLAS's workspace at ``ws``; the graph's struct word
    points into the KV range, its tensor is the model's weight. Returns (module, model, runner)."""
    from capture_plan.executor import streams

    module = vllm_release(monkeypatch, tmp_path, version=version)
    vllm_plugin.register()
    model = ToyModel({"piecewise": 1}, max_tokens=max(SIZES), fake=dev.fake)
    module.reset_globals()
    runner = module.GPUModelRunner(model, SIZES, cudagraph_mode=mode or module.FULL_DECODE_ONLY)
    buffer = SimpleNamespace(_buffer=SimpleNamespace(base_ptr=kv, reserved_size=4 * MiB))
    runner.extensible_kv_cache = SimpleNamespace(buffer=buffer)
    dev.fake.segments[:] = []
    restore_device.workspace(dev.fake, streams.capture_stream(CPU), ws)
    adoption = module.CudaGraphManager

    def place():
        loop = getattr(getattr(adoption, "__capture_plan__", None), "loop", None)
        try:
            pool = restore_device.pool_segment(dev.fake, loop.gs.pools["shared"])
        except (AttributeError, KeyError, ValueError):
            pool = 0x7000_0000_0000
        return {"pool": pool, "tensor": model.w.data_ptr(), "word": kv + 16}

    dev.driver.place = place
    dev.driver.ranges = [(model.w.data_ptr(), model.w.untyped_storage().nbytes())]  # the KV range: the engine's word
    return module, model, runner


def test_vllm_writes_its_graph_file_then_restores_every_graph_from_it(vllm, dev, monkeypatch, tmp_path, caplog):
    from capture_plan.executor.graph_restore import RestoredGraph
    from capture_plan.schemas.graph_file import read_graph_file

    path = tmp_path / "graphs.cpgraphs"
    _full_plan(tmp_path, monkeypatch, path)
    caplog.set_level(logging.INFO, logger="capture_plan.plugins")
    module, model, runner = _vllm_start(dev, monkeypatch, tmp_path, vllm, KV, WS)
    runner.capture_model()
    adoption = module.CudaGraphManager.__capture_plan__
    gs = adoption.loop.graphs
    manager = runner.cudagraph_manager
    assert len(manager.graphs) == len(gs.graphs) == len(SIZES)
    assert all(g.keep_graph and g.instantiated == 1 for g in manager.graphs.values())  # readable, instantiated once
    assert adoption.graphs.outcome.saved and _warnings(caplog) == []
    saved = read_graph_file(path)
    kv = next(s for s in saved.segments if s.kind == "engine")
    assert (kv.name, kv.size) == ("engine:extensible_kv_cache", 4 * MiB)
    assert "tensor:runner.cudagraph_manager.model.w" in {s.name for s in saved.segments}
    first = runner, gs  # alive until the next start-up restored: its memory is not handed out again meanwhile
    # the next start-up: restored, each graph handed to its manager, the KV range at its new address
    caplog.clear()
    dev.driver.nodes.clear()
    module, model2, runner = _vllm_start(dev, monkeypatch, tmp_path, vllm, NEW_KV, NEW_WS)
    runner.capture_model()
    start = module.CudaGraphManager.__capture_plan__.graphs
    assert (
        start.restored and _warnings(caplog) == [] and f"vLLM restored {len(SIZES)} graphs from {path}" in caplog.text
    )
    manager = runner.cudagraph_manager
    assert sorted(d.num_tokens for d in manager.graphs) == SIZES
    assert all(isinstance(g, RestoredGraph) for g in manager.graphs.values())
    assert [d for d, warmup in manager.builds if warmup] == [max(manager.graphs, key=lambda d: d.num_tokens)]
    assert manager.hidden_states is not None  # made by that one warm-up, as vLLM's first
    for _, _, _, tensor, seven, word in dev.driver.kernels():
        assert (tensor, seven, word) == (model2.w.data_ptr() + 8, 7, NEW_KV + 16)
    report = start.outcome.report
    assert report.segments == report.moved == len(saved.segments)  # every segment lies elsewhere
    runner.release()  # vLLM's release_graphs resets each restored graph
    start.gs.release()
    first[0].release()
    first[1].release()


def test_vllm_graphs_using_the_workspace_of_vllms_own_stream_are_saved_and_restored(
    vllm, dev, monkeypatch, tmp_path, caplog
):
    """vLLM records on a stream of its own (0.34 makes one per capture), whose cuBLAS
    workspace its warm-ups made: on an H200 the vLLM 0.34-shaped start-up's graphs pointed
    into it, an unnamed segment, and the file was never written ("24 address(es) point into
    torch:0 (33554432 B ...)"). Here cuBLAS is emulated: a stream's first GEMM (the priming)
    makes its 32 MiB workspace, and the graph's word points into the workspace of the stream
    vLLM's manager recorded on. The save names it ``engine/0``; the restore makes that
    workspace on a stream of its own and relocates the word into it."""
    from capture_plan.executor import streams
    from capture_plan.schemas.graph_file import read_graph_file
    from fake_cuda import FakeGraph

    addresses = iter(range(0x7C00_0000_0000, 0x7D00_0000_0000, 0x1000_0000))
    prime = streams.prime_stream

    def cublas(device, stream=None, name=None):  # a stream's first GEMM makes its workspace
        prime(device, stream, name)
        s = stream if stream is not None else streams.capture_stream(device)
        if not any(seg.get("stream") == s.cuda_stream for seg in dev.fake.segments):
            restore_device.workspace(dev.fake, s, next(addresses))

    monkeypatch.setattr(streams, "prime_stream", cublas)

    def workspace_of(stream) -> int:
        found = [seg for seg in dev.fake.segments if seg.get("stream") == stream.cuda_stream]
        return found[0]["address"] if found else restore_device.workspace(dev.fake, stream, next(addresses))["address"]

    begin = FakeGraph.capture_begin

    def warmed(graph, *a, **kw):  # the warm-ups before a recording ran GEMMs on its stream
        begin(graph, *a, **kw)
        workspace_of(graph.stream)

    monkeypatch.setattr(FakeGraph, "capture_begin", warmed)
    path = tmp_path / "graphs.cpgraphs"
    _full_plan(tmp_path, monkeypatch, path)
    caplog.set_level(logging.INFO, logger="capture_plan.plugins")
    module, model, runner = _vllm_start(dev, monkeypatch, tmp_path, vllm, KV, WS)
    place = dev.driver.place
    dev.driver.place = lambda: {**place(), "word": workspace_of(runner.cudagraph_manager.capture_stream) + 0x80}
    runner.capture_model()
    start = module.CudaGraphManager.__capture_plan__.graphs
    assert start.outcome.saved and _warnings(caplog) == [], start.outcome.line()
    names = {s.name for s in read_graph_file(path).segments}
    assert "workspace:engine/0" in names and not any(n.startswith("torch:") for n in names), sorted(names)[-6:]
    first = runner, module.CudaGraphManager.__capture_plan__.loop.graphs
    # the next start-up: vLLM's stream is not made (nothing is captured), the restore's own holds the workspace
    caplog.clear()
    dev.driver.nodes.clear()
    dev.fake.segments[:] = []
    monkeypatch.setattr(streams, "_primed", {})  # a fresh process: no stream primed or named yet
    module, model2, runner = _vllm_start(dev, monkeypatch, tmp_path, vllm, NEW_KV, NEW_WS)
    runner.capture_model()
    start = module.CudaGraphManager.__capture_plan__.graphs
    assert start.restored and _warnings(caplog) == [], caplog.text
    engine = next(st for sid, st in streams._named.items() if sid[1] == f"{restoring.ENGINE_STREAM}/0")
    assert streams.primed_streams()[engine.cuda_stream] == restoring.ENGINE_STREAM
    words = {word for *_, word in dev.driver.kernels()}
    assert words == {workspace_of(engine) + 0x80}, words
    runner.release()
    start.gs.release()
    first[0].release()
    first[1].release()


def test_a_restore_makes_as_many_workspace_streams_as_the_file_names(dev, monkeypatch):
    """vLLM 0.34 makes a stream per manager's capture: a speculator's graphs saved with
    workspaces engine/0 and engine/1 (review). One stream made for the name left engine/1
    missing, so such a file was always refused."""
    from capture_plan.executor import streams

    monkeypatch.setattr(streams, "_named", {})
    primed: list[str] = []
    monkeypatch.setattr(
        streams, "prime_stream", lambda device, s, name: primed.append(name) or streams.name_stream(s, name)
    )
    streams.name_stream(streams.capture_stream(CPU), "capture")
    # the capture stream's cuBLASLt workspace (a GEMM with a bias) is no second stream's
    streams.workspace_streams(
        CPU, [("capture", 32 * MiB), ("capture", MiB), ("engine", 32 * MiB), ("engine", 32 * MiB)]
    )
    assert primed == ["engine", "engine"]
    assert sorted(streams.primed_streams().values()) == ["capture", "engine", "engine"]
    streams.workspace_streams(CPU, [("engine", 32 * MiB), ("engine", 32 * MiB)])  # made once per process
    assert primed == ["engine", "engine"]


def test_vllm_a_refused_file_is_one_warning_then_every_managers_capture_through_the_plan(
    vllm, dev, monkeypatch, tmp_path, caplog
):
    from capture_plan.schemas.graph_file import encode, read_graph_file

    path = tmp_path / "graphs.cpgraphs"
    plan = _full_plan(tmp_path, monkeypatch, path)
    _, _, runner = _vllm_start(dev, monkeypatch, tmp_path, vllm, KV, WS)
    runner.capture_model()
    runner.release()
    file = read_graph_file(path)
    tensors = {s.owner for s in file.segments if s.kind == "tensor"}
    other = msgspec.structs.replace(file, segments=[s for s in file.segments if s.kind != "engine"])
    path.write_bytes(encode(other))  # a damaged file: its addresses name a segment it lacks
    caplog.clear()
    module, _, runner = _vllm_start(dev, monkeypatch, tmp_path, vllm, NEW_KV, NEW_WS)
    runner.capture_model()
    adoption = module.CudaGraphManager.__capture_plan__
    (line,) = _warnings(caplog)
    assert line.startswith(f"capture-plan: graph file {path}: not restored: ") and "the file is damaged" in line
    assert adoption.graphs.outcome.what == "captured" and tensors
    gs = adoption.loop.graphs
    assert [m.id for m in gs.report.steps] == [s.id for s in plan.steps]
    assert sorted(d.num_tokens for d in runner.cudagraph_manager.graphs) == SIZES
    runner.release()
    gs.release()


@pytest.mark.parametrize("off_by", [1, 3], ids=["as-predicted", "three-times-the-prediction"])
def test_vllm_checks_the_plans_prediction_against_what_a_restored_start_up_took(
    dev, monkeypatch, tmp_path, caplog, off_by
):
    """The start-up prediction of a restored start-up is the plan's whole-capture figure, as a
    captured one's: checked against vLLM's own measure of its capture_model (the free memory the
    restore took), one WARNING naming the gap where it is wider than the tolerance."""
    path = tmp_path / "graphs.cpgraphs"
    plan = _full_plan(tmp_path, monkeypatch, path, calibrated=True)
    predicted = vllm_plugin.plan_total(plan)
    _, _, runner = _vllm_start(dev, monkeypatch, tmp_path, "0.34.0", KV, WS)
    runner.capture_model()
    runner.release()
    caplog.clear()
    from capture_plan.executor import restore_layout

    module, _, runner = _vllm_start(dev, monkeypatch, tmp_path, "0.34.0", NEW_KV, NEW_WS)
    capacity, laid_out, lay_out = 1 << 34, [], restore_layout.lay_out_pools

    def laying_out(*a, **kw):
        laid_out.append(True)
        return lay_out(*a, **kw)

    def free(device=None):  # the restore takes off_by times the prediction once it has laid its pools out
        return capacity - (predicted * off_by if laid_out else 0), capacity

    monkeypatch.setattr(restore_layout, "lay_out_pools", laying_out)
    monkeypatch.setattr(torch.cuda, "mem_get_info", free)
    took = runner.capture_model()
    start = module.CudaGraphManager.__capture_plan__.graphs
    assert start.restored and took == start.outcome.took == predicted * off_by
    warnings = _warnings(caplog)
    if off_by == 1:
        assert warnings == []
    else:
        (line,) = warnings
        assert f"vLLM's capture took {took} B, the plan predicted {predicted} B (more by {took - predicted} B" in line
    runner.release()
    start.gs.release()


def test_vllm_does_not_write_a_file_no_restore_can_take(vllm, dev, monkeypatch, tmp_path, caplog):
    """A plan with PIECEWISE phases: a restore makes whole graphs only, so the capture keeps
    vLLM's graphs as they are (no keep_graph) and the file is not written, one WARNING why."""
    path = tmp_path / "graphs.cpgraphs"
    module = vllm_release(monkeypatch, tmp_path, version=vllm)
    plan = harness.vllm_plan(tmp_path, SIZES, keeps=8 * 8 * 4)
    monkeypatch.setenv(core.ENV_PLAN, str(plan_file(tmp_path, plan)))
    monkeypatch.setenv(core.ENV_GRAPHS, str(path))
    vllm_plugin.register()
    model = ToyModel({"piecewise": 1}, max_tokens=max(SIZES), fake=dev.fake)
    runner = harness.vllm_runner_of(module, model, SIZES)
    runner.capture_model()
    adoption = module.CudaGraphManager.__capture_plan__
    assert adoption.loop.complete and not path.exists()
    assert not any(g.keep_graph for g in runner.cudagraph_manager.graphs.values())
    (line,) = _warnings(caplog)
    assert f"capture-plan: vLLM captured ({path} was not there yet); {path} not written: a restore would refuse" in line
    assert "phase 'piecewise' records pieces between eager attention ops" in line
    runner.release()
    adoption.loop.graphs.release()


def test_a_tensor_parallel_plans_graphs_are_never_written(tmp_path):
    """Every rank would write the one file, and every restore refuses several ranks."""
    plan = build(tmp_path, f'[[phases]]\nname = "decode"\nkind = "decode"\nsizes = {SIZES}\n', backend="torch")
    tp2 = msgspec.structs.replace(plan, requires=msgspec.structs.replace(plan.requires, tp=2))
    for p, unsavable in ((plan, []), (tp2, ["the plan is for TP 2: a restore of tensor-parallel graphs is not built"])):
        settings = core.Settings(tmp_path / "plan.json", graphs=tmp_path / "graphs.cpgraphs")
        adoption = core.Adoption(settings, "vllm", make_loop=lambda *a, **kw: None, plan=p)
        start = restoring.start(adoption)
        assert start is not None and not start.restore and start.keys == {("decode", n): "shared" for n in SIZES}
        assert [line.split(" (")[0] for line in start.unsavable] == unsavable and start.saving == (p is plan)


def test_the_outcome_says_what_happened_in_one_line():
    assert restoring.Outcome("restored", "g", graphs=3, seconds=0.25, took=1024).line() == (
        "restored 3 graphs from g in 0.250 s, 1024 B of free memory, instead of capturing"
    )
    why = "graph file g: not restored: driver differs"
    assert restoring.Outcome("captured", "g", why=why).line() == f"captured ({why})"
    assert restoring.Outcome("captured", "g", why="g was not there yet", saved=True, graphs=3).line() == (
        "captured (g was not there yet); wrote g for the next start-up (3 graphs)"
    )


def test_a_refused_restore_returns_its_memory_before_the_plans_capture(fake, monkeypatch, tmp_path, caplog):
    """A restore that refuses after it allocated (its pools laid out, its loading runs) leaves
    what it made in the frames of its error (a layout refusal's segment tensors, its MemPool):
    torch's cache can return them only once the error is gone, as restore_or_capture does. Before:
    ``empty_cache`` ran inside the ``except`` block, the error still being handled, so the engine
    captured through the plan with the refused restore's memory still held."""
    import weakref

    from capture_plan.executor import graph_restore
    from capture_plan.executor.errors import ExecutorError, RestoreRefused

    class Block:  # what a refused restore made (a pool segment's tensor)
        pass

    made: list = []

    def lay_out():
        block = Block()
        made.append(weakref.ref(block))
        raise ExecutorError("pool shared: segment 0 came out 4 MiB, the file's is 2 MiB", where="restore")

    def refusing(*args, **kwargs):
        try:
            lay_out()
        except ExecutorError as err:
            raise RestoreRefused([err.what], where="graph file g", made=True) from None

    alive: list[bool] = []
    monkeypatch.setattr(graph_restore, "restore", refusing)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: alive.append(made[0]() is not None))
    start = restoring.GraphStart(tmp_path / "g", True, {("decode", 1): "shared"})
    with caplog.at_level(logging.WARNING):
        assert restoring.restore_collected(start, None, tensors={}, engine={}, device="cuda") is None
    assert alive == [False], "empty_cache ran while the refused restore's memory was still held"
    assert start.outcome is not None and start.outcome.what == "captured"
    assert _warnings(caplog) == [
        f"capture-plan: graph file g: not restored: pool shared: segment 0 came out 4 MiB, the file's is 2 MiB; "
        f"capturing through the plan instead ({start.path} is kept: delete it for the next start-up to write it again)"
    ]
