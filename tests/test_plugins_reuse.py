"""The SGLang plugin honours the plan's executable reuse (capture_plan.executor.exec_update),
on the engine-faithful runner of tests/engines/ with CUDA faked and the driver's graph calls
faked below (which graph an executable holds, every update and launch recorded).

Checked: SGLang's own reuse switch is off while the plan decides; the decode runner's
graphs (a phase planned with ``reuse = "exec-update"``) share executables, the engine's
backend replays what the loop serves, every replay switches the executable to its graph
first, and replays equal what the model computes; the phases without reuse are untouched.
"""

from __future__ import annotations

import ctypes

import pytest

from capture_plan.adapters.plugins import core, sglang as sgl_plugin

torch = pytest.importorskip("torch")

from engines import harness  # noqa: E402
from engines.plans import build  # noqa: E402
from engines.plugged import loops_on_cpu, plan_file, sglang_release  # noqa: E402
from engines.toy import ToyModel  # noqa: E402
from fake_cuda import FakeGraph  # noqa: E402

SIZES = [1, 2, 4, 8]


class FakeDriver:
    """The libcuda calls exec_update makes, over fake graphs: an executable holds one raw
    graph; a launch replays that graph (so a replay without its update runs the wrong one)."""

    def __init__(self):
        self.graphs: dict[int, FakeGraph] = {}
        self.holds: dict[int, int] = {}
        self.updates: list[tuple[int, int]] = []
        self.launched: list[int] = []
        self._next = 1

    def calls(self) -> dict:
        def instantiate(out, raw, flags):
            handle, self._next = self._next, self._next + 1
            out._obj.value = handle
            self.holds[handle] = raw.value
            return 0

        def update(ex, raw, info):
            self.updates.append((ex.value, raw.value))
            self.holds[ex.value] = raw.value
            return 0

        def launch(ex, stream):
            self.launched.append(self.holds[ex.value])
            self.graphs[self.holds[ex.value]].replay()
            return 0

        return {
            "cuGraphInstantiateWithFlags": instantiate,
            "cuGraphExecUpdate_v2": update,
            "cuGraphLaunch": launch,
            "cuGraphExecDestroy": lambda ex: 0,
        }


@pytest.fixture
def driver(fake, monkeypatch):
    from capture_plan.executor import exec_update
    from capture_plan.executor.exec_reuse import KernelDesc, NodeDesc, canonical

    d = FakeDriver()
    calls = d.calls()

    def raw(graph):
        d.graphs[id(graph)] = graph
        return id(graph)

    def describe(raw_graph, probes=None):
        # a chain of one kernel node per recorded call: graphs of as many calls share
        n = len(d.graphs[raw_graph].calls)
        nodes = [NodeDesc("kernel", KernelDesc((1, 1), (128, 1, 1), 0)) for _ in range(n)]
        return canonical(nodes, [(i, i + 1) for i in range(n - 1)])

    monkeypatch.setattr(FakeGraph, "raw_cuda_graph", raw)
    monkeypatch.setattr(exec_update, "_driver", lambda: calls)
    monkeypatch.setattr(exec_update, "describe", describe)
    loops_on_cpu(monkeypatch)
    return d


def _reuse_plan(tmp_path):
    from capture_plan.references.planted import spec_toml

    spec = spec_toml(SIZES)
    head = f'name = "decode"\nkind = "decode"\nsizes = {sorted(SIZES)}\n'
    assert head in spec
    axes = ", ".join(f"{a} = {v!r}".replace("'", '"') for a, v in harness.LORA.items())
    text = spec.replace(head, head + f'variants = {{ {axes} }}\nreuse = "exec-update"\n')
    return build(tmp_path, text, "warmup=every-size")


def _started(module, plan, fake):
    """SGLang (``module``, the plugin registered) started on the toy model with ``plan``'s
    phases: the model, the engine, and the plan's graphs as the plugin's loop captured them."""
    adoption = module.FullCudaGraphBackend.__capture_plan__
    tokens = {p.name: p.tokens_per_request for p in plan.phases}
    model = ToyModel(tokens, max_tokens=max(SIZES) * max(tokens.values()), fake=fake)
    engine = harness.plugged_sglang_start(module, plan, model, SIZES)
    return model, engine, adoption.loop.graphs


def test_sglang_replays_the_plans_shared_executables_and_its_own_reuse_is_off(fake, driver, monkeypatch, tmp_path):
    module = sglang_release(monkeypatch, tmp_path)
    plan = _reuse_plan(tmp_path)
    assert [p.name for p in plan.phases if p.reuse == "exec-update"] == ["decode"]
    monkeypatch.setenv(core.ENV_PLAN, str(plan_file(tmp_path, plan)))
    monkeypatch.setenv(sgl_plugin.ENGINE_REUSE_ENV, "1")
    sgl_plugin.register()
    import os

    assert os.environ[sgl_plugin.ENGINE_REUSE_ENV] == "false"
    model, engine, gs = _started(module, plan, fake)
    from capture_plan.executor.exec_update import SharedGraph

    reuse = gs.report.reuse
    decode = [c for c in gs.graphs.values() if c.key_phase == "decode"]
    assert reuse.graphs == len(decode) == 4 * len(SIZES)
    assert 1 <= reuse.instantiations < reuse.graphs and reuse.instantiations == len(driver.holds)
    # the decode runner's backend replays the loop's shared graphs; the other runners their own
    dec = next(r for r in engine.runners if r.phase == "decode")
    served = {id(c.graph) for c in decode}
    assert all(isinstance(g, SharedGraph) and id(g) in served for g in dec.backend._graphs.values())
    others = [g for r in engine.runners if r.phase != "decode" for g in r.backend._graphs.values()]
    assert others and not any(isinstance(g, SharedGraph) for g in others)
    # every replay runs its own graph: the executable is switched to it first where needed
    model.x.normal_()
    for lora in ("lora", "nolora"):
        for att in ("a", "b"):
            labels = {"lora": lora, "attention": att}
            for n in (1, 3, 8, 2):
                before = len(driver.launched)
                (out,) = gs.replay(gs.variant("decode", **labels), n)
                cap = gs.table(gs.variant("decode", **labels)).get(n)[1]
                assert driver.launched[before:] == [cap.graph.raw]
                assert torch.equal(out, model.expected("decode", n, labels)), (labels, n)
    assert driver.updates  # switching happened
    engine.cleanup()
    gs.release()


def test_without_a_driver_nothing_is_shared_and_the_report_says_why(fake, monkeypatch, tmp_path):
    """No libcuda (this CPU machine): each graph of the reuse phase is instantiated alone,
    the reason in the report; the capture is otherwise the plan's."""
    from capture_plan.executor import exec_update

    monkeypatch.setattr(exec_update, "_driver", lambda: "libcuda.so.1 cannot be loaded (test)")
    monkeypatch.setattr(FakeGraph, "raw_cuda_graph", lambda g: id(g))
    loops_on_cpu(monkeypatch)
    module = sglang_release(monkeypatch, tmp_path)
    plan = _reuse_plan(tmp_path)
    monkeypatch.setenv(core.ENV_PLAN, str(plan_file(tmp_path, plan)))
    sgl_plugin.register()
    model, engine, gs = _started(module, plan, fake)
    reuse = gs.report.reuse
    assert reuse.instantiations == reuse.graphs == 4 * len(SIZES)
    assert {r.reason for r in reuse.refusals} == {"libcuda.so.1 cannot be loaded (test)"}
    assert all(c.graph.instantiated == 1 for c in gs.graphs.values() if c.key_phase == "decode")
    engine.cleanup()
    gs.release()


def test_the_engine_switch_is_written_off_and_said_only_where_it_was_on():
    env = {}
    assert sgl_plugin.engine_reuse_off(env) is None and env[sgl_plugin.ENGINE_REUSE_ENV] == "false"
    env = {sgl_plugin.ENGINE_REUSE_ENV: "True"}
    assert "switched off" in sgl_plugin.engine_reuse_off(env)
    assert env[sgl_plugin.ENGINE_REUSE_ENV] == "false"


def test_ctypes_byref_exposes_its_object():
    """The fake driver writes an executable's handle through ``byref(out)._obj`` (what
    exec_update passes to cuGraphInstantiateWithFlags)."""
    out = ctypes.c_void_p()
    ctypes.byref(out)._obj.value = 7
    assert out.value == 7


def test_a_graph_whose_nodes_cannot_be_read_shares_nothing_and_the_capture_goes_on(fake, driver, monkeypatch):
    """The driver refusing to describe a graph (an edge with data, a node type it does not
    list) is a refusal with the reason, not a failed capture."""
    from capture_plan.executor import exec_update
    from capture_plan.executor.errors import ExecutorError

    def refuse(raw, probes=None):
        raise ExecutorError("cuGraphGetEdges failed (CUresult 1)", where="executable reuse")

    monkeypatch.setattr(exec_update, "describe", refuse)
    shared = exec_update.SharedExecs()
    g = torch.cuda.CUDAGraph(keep_graph=True)
    assert shared.adopt("decode", "decode/8", g) is None
    ((name, why),) = shared.groups["decode"].refusals
    assert name == "decode/8" and why == "its nodes could not be read: cuGraphGetEdges failed (CUresult 1)"
    assert shared.instantiations == 0 and shared.groups["decode"].instantiations == 1


def test_an_update_error_the_driver_does_not_document_leaves_the_executable_untrusted(monkeypatch):
    """Only CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE leaves an executable as it was; after any
    other error the shared executable holds no known graph, so the next replay of any member
    updates it again instead of launching what it held."""
    from capture_plan.executor import exec_update

    rcs = iter([exec_update.UPDATE_FAILURE, 1])
    calls = {"cuGraphExecUpdate_v2": lambda handle, raw, info: next(rcs)}
    monkeypatch.setattr(exec_update, "_driver", lambda: calls)
    shared = exec_update.SharedExecs()
    ex = exec_update._Exec(handle=None, current=111)
    assert shared._update(ex, 222) is not None and ex.current == 111  # refused as documented: unchanged
    assert shared._update(ex, 222) is not None and ex.current == 0  # any other error: untrusted
