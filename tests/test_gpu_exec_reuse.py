"""Executable reuse on a real GPU (marked ``gpu``; skipped where CUDA is absent): graphs of a
phase planned with ``reuse = "exec-update"`` share executables, verify proves replays
through them exact, and a planted launch-attribute mismatch is refused before any replay.

Run on the device: ``python -m pytest -m gpu -q tests/test_gpu_exec_reuse.py``.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

SMALL = dict(layers=2, hidden=1024, heads=8, kv_heads=2, head_dim=128, intermediate=2048, vocab=32000)


def _plan(tmp_path: Path, sizes, backend: str, *, reuse: bool, ci: bool = False):
    from capture_plan.planner import BuildOptions, build_plan

    text = "[model]\n" + "".join(f"{k} = {v}\n" for k, v in SMALL.items())
    text += f'\n[[phases]]\nname = "decode"\nkind = "decode"\nsizes = {list(sizes)}\n'
    text += 'reuse = "exec-update"\n' if reuse else ""
    spec = tmp_path / "spec.toml"
    spec.write_text(text)
    return build_plan(BuildOptions(backend=backend, ci=ci, spec=spec))


def test_graphs_alike_share_an_executable_and_verify_clean(tmp_path):
    import torch

    from capture_plan.executor import capture, verify
    from capture_plan.executor.exec_update import SharedGraph
    from gpu_targets import Synthetic

    plan = _plan(tmp_path, [1, 2, 4, 8, 16], "torch", reuse=True)
    gs = capture(plan, Synthetic(max_bs=16), progress=False, record=True)
    try:
        rep = gs.report
        assert rep is not None and rep.reuse is not None
        reuse = rep.reuse
        # the largest size allocates and zeroes a 64 MiB temporary (one node more): alone;
        # the four others run the same elementwise kernel at other grids: one executable
        assert reuse.graphs == 5 and reuse.instantiations == 2, reuse
        assert [g.graphs for g in reuse.groups] == [["decode/16"], ["decode/8", "decode/4", "decode/2", "decode/1"]]
        assert [r.graph for r in reuse.refusals] == ["decode/8"] and "nodes" in reuse.refusals[0].reason
        assert sum(isinstance(c.graph, SharedGraph) for c in gs.graphs.values()) == 5
        res = verify(gs, checks=("interleave", "scribble", "footprint"), rounds=2)
        assert "reuse" in res.checks
        assert res.ok, res.summary()
        gen = torch.Generator(device="cuda")
        gen.manual_seed(1)
        for n in (1, 3, 5, 9, 16, 2, 7):  # after verify, in an order that switches executables
            gs.target.prepare("decode", n, gs.padded("decode", n), gen)
            out = gs.replay("decode", n)[0].clone()
            assert out.equal(gs.eager("decode", n)[0])
    finally:
        gs.release()


def test_the_reference_model_with_reuse_verifies_clean_and_shares_what_the_driver_reads_back(tmp_path):
    """Fewer executables than graphs wherever the driver reads every kernel's launch back; where
    it hides one (driver 580 on the H100: clustered sm90 kernels whose preferred cluster
    dimension reads back CUresult 1), the graphs holding it are refused, each saying so."""
    from capture_plan.executor import capture, verify
    from test_gpu_executor import small_model

    sizes = [1, 2, 4, 8, 16, 24, 32]
    off = capture(_plan(tmp_path, sizes, "fa3", reuse=False, ci=True), small_model(), progress=False)
    try:
        nodes_off = [m.graph_nodes for m in off.report.steps if m.id.startswith("capture/")]
    finally:
        off.release()
    gs = capture(_plan(tmp_path, sizes, "fa3", reuse=True, ci=True), small_model(), progress=False, record=True)
    try:
        reuse = gs.report.reuse
        assert reuse.graphs == len(sizes) and 1 <= reuse.instantiations <= len(sizes), reuse
        # every graph is either in a group or refused one, with a reason
        grouped = [g for grp in reuse.groups for g in grp.graphs]
        refused = [r.graph for r in reuse.refusals]
        assert sorted(grouped + refused) == sorted(f"decode/{b}" for b in sizes)
        assert all(r.reason for r in reuse.refusals)
        assert reuse.instantiations == len(refused) + len(reuse.groups)
        # a clustered kernel whose preferred cluster dimension the driver does not read back
        # is shared exactly when this device's probe proved it unset, and the report says so
        cluster_refusals = [r for r in reuse.refusals if "does not read back" in r.reason]
        if cluster_refusals:
            assert reuse.clusters and all(reuse.clusters in r.reason for r in cluster_refusals)
        else:  # nothing hidden: at least two graphs share an executable (`<=` held with none shared)
            assert reuse.instantiations < len(sizes), reuse
        nodes_on = [m.graph_nodes for m in gs.report.steps if m.id.startswith("capture/")]
        assert nodes_on == nodes_off  # reuse changes no graph, only how many executables run them
        res = verify(gs, rounds=2)
        assert res.ok, res.summary()
    finally:
        gs.release()


def _first_kernel_node(raw_graph: int) -> ctypes.c_void_p:
    lib = ctypes.CDLL("libcuda.so.1")
    n = ctypes.c_size_t(0)
    assert lib.cuGraphGetNodes(ctypes.c_void_p(raw_graph), None, ctypes.byref(n)) == 0
    nodes = (ctypes.c_void_p * n.value)()
    assert lib.cuGraphGetNodes(ctypes.c_void_p(raw_graph), nodes, ctypes.byref(n)) == 0
    for i in range(n.value):
        t = ctypes.c_int(-1)
        assert lib.cuGraphNodeGetType(ctypes.c_void_p(nodes[i]), ctypes.byref(t)) == 0
        if t.value == 0:  # CU_GRAPH_NODE_TYPE_KERNEL
            return ctypes.c_void_p(nodes[i])
    raise AssertionError("no kernel node")


def _record(fn, x):
    import torch

    g = torch.cuda.CUDAGraph(keep_graph=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(x)  # warm-up on the side stream
        g.capture_begin()
        out = fn(x)
        g.capture_end()
    torch.cuda.current_stream().wait_stream(s)
    return g, out


@pytest.mark.parametrize("planted", [False, True])
def test_a_launch_attribute_mismatch_is_refused_before_any_replay(planted):
    """Two graphs of the same code; in one, a kernel gets a launch attribute the other lacks
    (the preferred shared-memory carveout: harmless to run, kept by an update unseen).
    Planted, the second graph is refused its group at capture, never replayed through it;
    unplanted, it shares the executable and replays exactly as through its own."""
    import torch

    from capture_plan.executor.exec_update import SharedExecs, SharedGraph

    x = torch.randn(4096, device="cuda")

    def fn(t):
        return torch.sin(t) * 3 + 1

    a, out_a = _record(fn, x)
    b, out_b = _record(fn, x)
    if planted:
        lib = ctypes.CDLL("libcuda.so.1")
        value = (ctypes.c_uint * 16)(50)  # CUlaunchAttributeValue.sharedMemCarveout = 50 (%)
        rc = lib.cuGraphKernelNodeSetAttribute(_first_kernel_node(b.raw_cuda_graph()), 14, value)
        assert rc == 0, f"cuGraphKernelNodeSetAttribute: CUresult {rc}"
    shared = SharedExecs()
    try:
        sa = shared.adopt("decode", "decode/a", a)
        sb = shared.adopt("decode", "decode/b", b)
        assert isinstance(sa, SharedGraph)
        groups = shared.groups["decode"]
        assert isinstance(sb, SharedGraph)
        if planted:
            # refused a's executable at capture: an executable of its own, never updated from a's
            assert sb.exec is not sa.exec and shared.instantiations == groups.instantiations == 2
            ((name, why),) = groups.refusals
            assert name == "decode/b" and "launch attribute preferred_shared_memory_carveout differs" in why, why
        else:
            assert sb.exec is sa.exec and shared.instantiations == 1 and groups.refusals == []
        for g, out in ((sb, out_b), (sa, out_a), (sb, out_b)):  # shared: each switch is an update
            out.zero_()
            g.replay()
            torch.cuda.synchronize()
            assert out.equal(fn(x))
    finally:
        torch.cuda.synchronize()
        shared.close()
        a.reset()
        b.reset()
