"""``restore`` on the CPU: every refusal of a fresh process's restore, each from a faked process
or an edited graph file, raised before any GPU work; the fallback to capture with one WARNING;
the pure parts (the pools' segments, the keys the target runs at to load the kernels, the
kernels those runs did not launch, the stale-word scan, the outputs re-created over memory
that is not the saving process's) and ``graph_file inspect --plan`` (issue 51). The same
restore in a fresh process on a GPU: tests/test_gpu_restore.py."""

from __future__ import annotations

import ctypes
import logging
import struct
import sys
from types import SimpleNamespace

import msgspec
import pytest

pytest.importorskip("torch")  # the executor imports torch

import torch

from capture_plan.executor import ExecutorError, RestoreRefused, graph_file as gf, graph_restore as rs
from capture_plan.executor.graph_validity import GraphEnvironment, check_valid, stale_addresses
from capture_plan.executor.graph_walk import AddressResolver, walk_graph
from capture_plan.executor.kernel_loading import loading_keys, unloaded_kernels
from capture_plan.executor.restore_checks import Here, restore_refusals
from capture_plan.executor.restore_layout import (
    RestoredPools,
    layout_differences,
    output_tensor,
    segment_requests,
)
from capture_plan.executor.restore_probe import torch_segments
from capture_plan.schemas.graph_file import (
    Function,
    Graph,
    GraphFile,
    Kernel,
    Module,
    Node,
    Operand,
    Output,
    Segment,
    ValidFor,
)
from restore_device import track_pool_tensors
from test_graph_file import OUTSIDE, POOL, SNAPSHOT, TENSOR, VALID, WORKSPACE, FakeDriver, offered
from test_graph_rebuild import RebuildDriver

MiB = 1 << 20


class FakeOut:
    """What the save reads of an output tensor."""

    def __init__(self, ptr: int, shape: tuple, stride: tuple, dtype=torch.float32):
        self.ptr, self.shape, self._stride, self.dtype = ptr, shape, stride, dtype

    def data_ptr(self) -> int:
        return self.ptr

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def stride(self) -> tuple:
        return self._stride


#: the GraphSet's entry for the fake graph: an output in the pool's segment, one of no elements
SERVED = SimpleNamespace(
    pool="shared",
    held="keep",
    rows=None,
    key_phase="decode",
    labels=(),
    piece=None,
    outputs=(FakeOut(POOL + 0x1000, (8, 16), (16, 1)), FakeOut(0, (0, 16), (16, 1))),
)


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    """A torch-backend plan capturing decode at 8, into pool "shared" (the fake graph's key)."""
    from capture_plan.planner import BuildOptions, build_plan

    spec = tmp_path_factory.mktemp("restore") / "spec.toml"
    spec.write_text('[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [8]\n')
    return build_plan(BuildOptions(backend="torch", spec=spec, strategies=("outputs=keep",)))


def _saved(plan, driver: FakeDriver | None = None, word: int = WORKSPACE + 0x80, served=SERVED) -> GraphFile:
    """The fake graph saved for ``plan``: a kernel (a pointer into the pool, a struct holding a
    tensor address and ``word``: by default in cuBLAS's workspace), a memset, a copy, an empty
    node; its outputs as ``served`` holds them."""
    d = driver or RebuildDriver()
    d.buffers[2] = ctypes.create_string_buffer(struct.pack("<QQQ", TENSOR + 8, 7, word), 24)
    d.ptrs[2] = ctypes.addressof(d.buffers[2])
    snap = torch_segments([*SNAPSHOT, {"address": WORKSPACE, "total_size": 32 * MiB, "segment_pool_id": (0, 0)}])
    segs = gf.Segments(
        snap,
        {"shared": (1, 2)},
        {"model.w": (TENSOR, 4096)},
        AddressResolver(d, known=snap),
        {"capture/0": (WORKSPACE, 32 * MiB)},
    )
    valid = msgspec.structs.replace(VALID, plan_digest=plan.digest)
    held = {("decode", 8): served} if served else None
    return gf.build_file([("decode", 8, walk_graph(0x1, d))], segs, valid, d, held)


def _env(plan, **changes) -> GraphEnvironment:
    """This process as the file asks for it, with ``changes``: no pools or library workspaces
    yet (a restore makes them after its checks)."""
    return offered(plan_digest=plan.digest, **changes)


@pytest.fixture
def restoring(monkeypatch, tmp_path):
    """``restore`` with this process faked: ``process_environment`` answers ``state.here``,
    and the GPU part records that it was reached instead of running."""
    state = SimpleNamespace(here=None, reached=[], asked=[], path=tmp_path / "g.cpgraphs")

    def environment(plan, target, file, device=None, tensors=None, engine=None):
        state.asked.append(file)
        return state.here

    monkeypatch.setattr(rs, "process_environment", environment)
    monkeypatch.setattr(rs, "_restore", lambda *a: state.reached.append(a) or "restored")
    return state


def _refused(state, plan, file: GraphFile | None, here=None) -> RestoreRefused:
    if file is not None:
        state.path.write_bytes(gf.encode(file))
    state.here = here if here is not None else Here(device="cuda:0", env=_env(plan))
    with pytest.raises(RestoreRefused) as got:
        rs.restore(plan, None, state.path)
    assert state.reached == [], "the restore went past its checks"
    err = got.value
    assert isinstance(err, ExecutorError) and "\n" not in str(err) and err.reasons
    assert str(err).startswith(f"graph file {state.path}: not restored: {err.reasons[0]}")
    return err


# -- the checks, each a refusal before any GPU work ----------------------------------------


def test_a_file_that_matches_goes_past_every_check(restoring, plan):
    restoring.path.write_bytes(gf.encode(_saved(plan)))
    restoring.here = Here(device="cuda:0", env=_env(plan))
    assert rs.restore(plan, None, restoring.path) == "restored"
    assert len(restoring.reached) == 1 and len(restoring.asked) == 1


@pytest.mark.parametrize(
    "changes, said",
    [
        (dict(device="NVIDIA H200"), "device differs"),
        (dict(driver="575.1"), "driver differs"),
        (dict(torch="2.10.0"), "torch differs"),
        (dict(libraries={"libcublasLt.so.13": "sha256:new"}), "kernel library libcublasLt.so.13 differs"),
        (dict(tensors={}), "tensor model.w is missing"),
        (dict(tensors={"model.w": 8192}), "tensor model.w is resized"),
    ],
)
def test_each_difference_of_this_process_is_one_refusal(restoring, plan, changes, said):
    err = _refused(restoring, plan, _saved(plan), Here(device="cuda:0", env=_env(plan, **changes)))
    assert len(err.reasons) == 1 and said in err.reasons[0], err.reasons


def test_a_library_not_mapped_before_the_kernels_run_is_checked_once_they_ran(restoring, plan):
    """A library the target maps at its first use (the saving process had used it) is not
    refused before the loading runs; the restore checks it again after them (check_valid
    without "library" deferred: test_graph_file.py)."""
    here = Here(device="cuda:0", env=_env(plan, libraries={}))
    assert restore_refusals(plan, _saved(plan), here) == []
    got = check_valid(_saved(plan), _env(plan, libraries={}, workspaces={"capture/0": 32 * MiB}), later=("pool",))
    assert len(got) == 1 and "kernel library libcublasLt.so.13 is not loaded" in got[0]


def test_a_file_saved_for_another_plan_is_refused(restoring, plan):
    f = _saved(plan)
    other = msgspec.structs.replace(f, valid_for=msgspec.structs.replace(f.valid_for, plan_digest="sha256:other"))
    err = _refused(restoring, plan, other)
    said = f"plan digest differs: the file was saved with 'sha256:other', this process has '{plan.digest}'"
    assert err.reasons == [said]


def test_an_argument_address_outside_every_segment_is_refused(restoring, plan):
    err = _refused(restoring, plan, _saved(plan, word=OUTSIDE + 16))
    assert len(err.reasons) == 1
    assert "1 address(es) point into outside:0" in err.reasons[0] and "graph decode/8 node 0" in err.reasons[0]


def test_a_planted_stale_argument_is_refused(restoring, plan):
    """The tensor's relocation undone and its saving-process address written back into the
    argument bytes: rebuilt elsewhere, the kernel would read the saving process's memory."""
    f = _saved(plan)
    node = f.graphs[0].nodes[0]
    k = node.kernel
    assert k is not None
    r = next(r for r in k.relocations if f.segments[r.segment].name == "tensor:model.w")
    args = bytearray(k.args)
    args[r.position : r.position + 8] = (f.segments[r.segment].address + r.offset).to_bytes(8, "little")
    stale = msgspec.structs.replace(k, args=bytes(args), relocations=[x for x in k.relocations if x is not r])
    nodes = [msgspec.structs.replace(node, kernel=stale), *f.graphs[0].nodes[1:]]
    g = msgspec.structs.replace(f.graphs[0], nodes=nodes)
    err = _refused(restoring, plan, msgspec.structs.replace(f, graphs=[g]))
    assert len(err.reasons) == 1, err.reasons
    said = f"the argument word at byte {r.position} holds {TENSOR + 8:#x}, inside tensor:model.w as saved"
    assert said in err.reasons[0]
    assert "graph decode/8 node 0 (kernel gemm_kernel)" in err.reasons[0]


def test_a_pool_segment_torchs_allocator_does_not_cut_is_refused(restoring, plan):
    f = _saved(plan)
    seg = f.segments[0]
    assert seg.name == "pool:shared/0"
    odd = msgspec.structs.replace(f, segments=[msgspec.structs.replace(seg, size=3 * MiB), *f.segments[1:]])
    err = _refused(restoring, plan, odd)
    assert (
        len(err.reasons) == 1
        and "pool:shared/0 is 3145728 B, a segment torch's caching allocator does not cut" in (err.reasons[0])
    )


def test_a_graph_in_a_pool_the_plan_does_not_lay_out_is_refused(restoring, plan):
    f = _saved(plan)
    segs = [msgspec.structs.replace(f.segments[0], owner="other", name="pool:other/0"), *f.segments[1:]]
    moved = msgspec.structs.replace(f, segments=segs, graphs=[msgspec.structs.replace(f.graphs[0], pool="other")])
    err = _refused(restoring, plan, moved)
    assert err.reasons == [
        "graph decode/8 was saved in pool 'other'; the plan captures it into 'shared'",
        "pool:other/0 lies in pool other, which the plan does not have (['shared'])",
    ]


def test_a_file_without_a_graph_the_plan_captures_is_refused(restoring, tmp_path):
    from capture_plan.planner import BuildOptions, build_plan

    spec = tmp_path / "spec.toml"
    spec.write_text('[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [4, 8]\n')
    two = build_plan(BuildOptions(backend="torch", spec=spec, strategies=("outputs=keep",)))
    err = _refused(restoring, two, _saved(two))
    assert err.reasons == ["the file lacks graph decode/4, which the plan captures"]


def test_a_tma_shaped_parameter_is_refused(restoring, plan):
    err = _refused(restoring, plan, _saved(plan, driver=FakeDriver()))  # its kernel's fourth parameter
    assert len(err.reasons) == 1 and "parameter(s) [3] are shaped like a CUtensorMap" in err.reasons[0]


@pytest.mark.parametrize(
    "change, said",
    [
        (dict(tensor_map="this driver's TMA descriptors keep their address in words [0, 1]"), "in words [0, 1]"),
        (dict(ranks=2), "torch.distributed runs 2 ranks"),
    ],
)
def test_a_driver_that_encodes_descriptors_otherwise_and_several_ranks_are_refused(restoring, plan, change, said):
    err = _refused(restoring, plan, _saved(plan), Here(device="cuda:0", env=_env(plan), **change))
    assert len(err.reasons) == 1 and said in err.reasons[0]


@pytest.mark.parametrize(
    "data, said",
    [
        (msgspec.msgpack.encode({"kind": "capture-plan graph file", "version": 2}), "graph file version 2"),
        (b"\xc1 not msgpack", "not a graph file"),
        (None, "No such file or directory"),
    ],
)
def test_a_file_of_another_version_a_damaged_or_a_missing_one_is_refused_unread(restoring, plan, data, said):
    if data is not None:
        restoring.path.write_bytes(data)
    with pytest.raises(RestoreRefused, match=said):
        rs.restore(plan, None, restoring.path)
    assert restoring.asked == [] and restoring.reached == []


def test_the_first_reason_leads_and_the_others_are_counted(restoring, plan):
    err = _refused(restoring, plan, _saved(plan), Here(device="cuda:0", env=_env(plan, driver="1", torch="2")))
    assert len(err.reasons) == 2 and "driver differs" in err.reasons[0] and str(err).count("(and 1 more)") == 1


# -- falling back to capture ------------------------------------------------------------------


@pytest.fixture
def capturing(monkeypatch):
    from capture_plan.executor import driver

    calls = []
    monkeypatch.setattr(driver, "capture", lambda plan, target, **kw: calls.append(kw) or "captured")
    return calls


def test_a_refused_file_falls_back_to_capture_with_one_warning(restoring, plan, capturing, caplog):
    caplog.set_level(logging.WARNING, logger="capture_plan.executor")
    got = rs.restore_or_capture(plan, None, restoring.path, device="cuda:0", progress=False)  # no file yet
    assert got == "captured" and capturing == [{"device": "cuda:0", "progress": False}]
    assert len(caplog.records) == 1 and caplog.records[0].levelno == logging.WARNING
    text = caplog.records[0].getMessage()
    assert text.startswith(f"capture-plan: graph file {restoring.path}: not restored: cannot read graph file: No such")
    assert text.endswith("; capturing instead") and text.count("graph file") == 2  # where, and what was not read


def test_a_restore_that_fails_past_its_checks_falls_back_too(restoring, plan, capturing, caplog, monkeypatch):
    def fail(*a):
        raise ExecutorError("cuGraphAddKernelNode_v2 failed (CUresult 700)", where="rebuild")

    monkeypatch.setattr(rs, "_restore", fail)
    restoring.path.write_bytes(gf.encode(_saved(plan)))
    restoring.here = Here(device="cuda:0", env=_env(plan))
    caplog.set_level(logging.WARNING, logger="capture_plan.executor")
    assert rs.restore_or_capture(plan, None, restoring.path) == "captured"
    assert len(caplog.records) == 1 and "CUresult 700" in caplog.records[0].getMessage()


def test_a_restored_set_captures_nothing_and_warns_nothing(restoring, plan, capturing, caplog):
    restoring.path.write_bytes(gf.encode(_saved(plan)))
    restoring.here = Here(device="cuda:0", env=_env(plan))
    caplog.set_level(logging.WARNING, logger="capture_plan.executor")
    assert rs.restore_or_capture(plan, None, restoring.path) == "restored"
    assert capturing == [] and caplog.records == []


def test_saving_a_background_capture_is_refused_up_front(plan, tmp_path):
    with pytest.raises(ExecutorError, match="a background capture has not all made yet"):
        rs.restore_or_capture(plan, None, tmp_path / "g", save=True, background=True)


# -- what the save records for the restore ------------------------------------------------------


def test_the_file_records_how_each_graph_is_served_and_where_its_outputs_lie(plan):
    g = _saved(plan).graphs[0]
    assert (g.pool, g.held, g.rows, g.key_phase, g.labels, g.piece) == ("shared", "keep", None, "decode", [], None)
    assert g.outputs == [
        Output(at=Operand(segment=0, offset=0x1000), dtype="float32", shape=[8, 16], stride=[16, 1]),
        Output(at=None, dtype="float32", shape=[0, 16], stride=[16, 1]),
    ]
    bare = _saved(plan, served=None).graphs[0]  # a graph the GraphSet does not serve: no outputs recorded
    assert (bare.pool, bare.outputs) == ("", [])


def test_an_output_outside_every_segment_is_refused_like_an_argument(plan):
    served = SimpleNamespace(**{**vars(SERVED), "outputs": (FakeOut(OUTSIDE + 64, (4,), (1,)),)})
    f = _saved(plan, served=served)
    got = check_valid(f, _env(plan), later=("workspace", "pool"))
    assert got and "point into outside:0" in got[0] and "graph decode/8 output 0" in got[0]


def test_library_workspaces_and_pools_are_checked_later_where_the_caller_says_so(plan):
    f = _saved(plan)
    assert check_valid(f, _env(plan), later=("workspace", "pool")) == []
    got = check_valid(f, _env(plan), later=("pool",))
    assert len(got) == 1 and "library workspace capture/0 is missing" in got[0]
    assert "pool shared is not laid out" in check_valid(f, _env(plan, workspaces={"capture/0": 32 * MiB}))[0]


def test_the_stale_scan_reads_each_argument_block_once_and_caps_its_lines(plan):
    f = _saved(plan)
    assert stale_addresses(f) == []
    k = f.graphs[0].nodes[0].kernel
    assert k is not None
    args = bytearray(k.args)
    args[24:32] = (POOL + 8).to_bytes(8, "little")  # the struct's 7: inside the pool's segment as saved
    node = msgspec.structs.replace(f.graphs[0].nodes[0], kernel=msgspec.structs.replace(k, args=bytes(args)))
    many = [msgspec.structs.replace(f.graphs[0], bs=b, nodes=[node]) for b in range(1, 13)]
    lines = stale_addresses(msgspec.structs.replace(f, graphs=many))
    assert len(lines) == 11 and lines[-1] == "2 more stale argument word(s)"
    assert "graph decode/1 node 0 (kernel gemm_kernel): the argument word at byte 24 holds" in lines[0]


def test_the_stale_scan_reads_the_same_bytes_again_under_another_parameter_layout(plan):
    """Blocks are read once per (bytes, layout): the same bytes with the word outside every
    parameter (not scanned) and then inside one (a stale address) give one line, the second's."""
    f = _saved(plan)
    k = f.graphs[0].nodes[0].kernel
    assert k is not None
    args = bytearray(k.args)
    args[24:32] = (POOL + 8).to_bytes(8, "little")
    narrow = msgspec.structs.replace(k, args=bytes(args), params=[(o, sz) for o, sz in k.params if o + sz <= 24])
    wide = msgspec.structs.replace(k, args=bytes(args))
    nodes = [msgspec.structs.replace(f.graphs[0].nodes[0], kernel=x) for x in (narrow, wide)]
    lines = stale_addresses(msgspec.structs.replace(f, graphs=[msgspec.structs.replace(f.graphs[0], nodes=nodes)]))
    assert len(lines) == 1
    assert lines[0].startswith("graph decode/8 node 1 (kernel gemm_kernel): the argument word at byte 24")


def test_the_stale_scan_finds_a_word_in_a_segment_that_holds_a_named_tensor_before_it(plan):
    """A caching-allocator segment saved whole (``torch:K``: an address of it no name covered)
    can hold a named tensor's storage too (``tensor:model.w`` lies in OTHER's segment). A word
    left at the saving process's address past that tensor, inside the segment, is stale all the
    same. Before: the scan looked in the span starting last at or before the word alone (the
    tensor's), which does not hold it, and said nothing."""
    f = _saved(plan)
    assert any(s.name == "tensor:model.w" and s.address == TENSOR for s in f.segments)
    whole = Segment(name=f"torch:{len(f.segments)}", kind="torch", size=20 * MiB, address=TENSOR - 0x1000)
    k = f.graphs[0].nodes[0].kernel
    assert k is not None
    args = bytearray(k.args)
    args[24:32] = (TENSOR + MiB).to_bytes(8, "little")  # the struct's 7: past the tensor, inside its segment
    node = msgspec.structs.replace(f.graphs[0].nodes[0], kernel=msgspec.structs.replace(k, args=bytes(args)))
    g = msgspec.structs.replace(f.graphs[0], nodes=[node, *f.graphs[0].nodes[1:]])
    lines = stale_addresses(msgspec.structs.replace(f, segments=[*f.segments, whole], graphs=[g]))
    assert lines == [
        f"graph decode/8 node 0 (kernel gemm_kernel): the argument word at byte 24 holds {TENSOR + MiB:#x}, "
        f"inside {whole.name} as saved, and is not relocated: a stale address"
    ]


# -- the pools' segments, the outputs over them -----------------------------------------------


def test_segment_requests_fill_each_segment_the_allocator_cuts():
    assert segment_requests(2 * MiB) == [MiB, MiB]  # the small pool's segment: two halves
    assert segment_requests(20 * MiB) == [20 * MiB]  # a 1-10 MiB request's segment
    assert segment_requests(10 * MiB) == [10 * MiB] and segment_requests(64 * MiB) == [64 * MiB]
    for never in (MiB, 4 * MiB, 8 * MiB, 11 * MiB, 3 * MiB + 512):
        assert segment_requests(never) is None, never


def test_layout_differences_name_each_segment_made_otherwise():
    wanted = [(0x1000_0000, 2 * MiB), (0x2000_0000, 20 * MiB)]
    assert layout_differences("shared", wanted, [(0x2000_0000, 20 * MiB), (0x1000_0000, 2 * MiB)]) == []
    got = layout_differences("shared", wanted, [(0x1000_0000, 4 * MiB), (0x3000_0000, 20 * MiB), (0x4, 2 * MiB)])
    assert got == [
        "pool shared: segment 0 came out 4194304 B, the file's is 2097152 B",
        "pool shared: segment 1 (20971520 B) did not start a segment of its own here",
        "pool shared: 1 segment(s) more than the file's 2",
    ]


def test_an_output_is_a_view_of_the_tensor_holding_it_or_of_the_memory_alone():
    seg = torch.arange(64, dtype=torch.float32)  # the host stands in for a restored segment
    base = seg.data_ptr()
    out = Output(at=Operand(segment=0, offset=16), dtype="float32", shape=[2, 3], stride=[4, 1])
    pools = RestoredPools(backing={"shared": [[seg]]})
    assert pools.owner(base + 16, 40) is seg and pools.owner(base + 250, 16) is None
    owned = output_tensor(out, base + 16, seg, "cpu")
    assert owned.tolist() == [[4.0, 5.0, 6.0], [8.0, 9.0, 10.0]]
    assert owned.untyped_storage().data_ptr() == base  # it holds the segment's tensor's memory
    weak = output_tensor(out, base + 16, None, "cpu")
    assert torch.equal(weak, owned) and weak.untyped_storage().data_ptr() == base + 16
    empty = output_tensor(Output(at=None, dtype="bfloat16", shape=[0, 8], stride=[8, 1]), None, None, "cpu")
    assert empty.shape == (0, 8) and empty.dtype == torch.bfloat16
    with pytest.raises(ExecutorError, match="its tensor here does not hold"):
        output_tensor(out, base + 240, seg, "cpu")
    with pytest.raises(ExecutorError, match="dtype 'float99'"):
        output_tensor(msgspec.structs.replace(out, dtype="float99"), base, seg, "cpu")


# -- the kernels: the keys the target runs at, and what those runs did not launch ---------------


def _graph(phase: str, bs: int, kernels: list[tuple[int, str]]) -> Graph:
    k = [Kernel(name=n, module=m, grid=(1, 1, 1), block=(32, 1, 1), shared_bytes=0) for m, n in kernels]
    return Graph(phase=phase, bs=bs, nodes=[Node(type="kernel", kernel=x) for x in k])


def test_the_loading_runs_are_each_phases_largest_then_the_keys_adding_most_modules():
    graphs = [
        _graph("decode", 256, [(0, "gemm_big"), (1, "norm")]),
        _graph("decode", 8, [(0, "gemm_small"), (1, "norm")]),
        _graph("decode", 1, [(0, "gemv"), (3, "split_k")]),
        _graph("verify", 64, [(0, "gemm_big"), (2, "attn")]),
        _graph("verify", 4, [(2, "attn"), (3, "split_k")]),
    ]
    f = GraphFile(valid_for=VALID, graphs=graphs)
    # decode/256, verify/64, then decode/1 for module 3 (verify/4 ties, later in the file); decode/8's
    # gemm_small comes from module 0, reached already: fetched by name, not run for
    assert loading_keys(f) == [0, 3, 2]
    assert loading_keys(GraphFile(valid_for=VALID)) == []


def test_keys_whose_kernels_share_one_module_load_with_one_run():
    """cuBLAS picks another kernel per size from the same module: one run loads the module,
    and the others are fetched from it by name (a cover of kernels ran at every key)."""
    f = GraphFile(valid_for=VALID, graphs=[_graph("decode", b, [(0, f"gemm_{b}"), (1, "norm")]) for b in (4, 2, 1)])
    assert loading_keys(f) == [0]


def test_a_module_the_covers_runs_missed_is_sought_at_the_other_keys_holding_it(monkeypatch):
    """decode/4's run (the cover: modules 0 and 1) reaches module 0 alone here (a library chose
    otherwise): the other keys whose saved graphs hold module 1 are run in turn, decode/1 (which
    reaches nothing here) then decode/2 (which reaches it); where none does, it stays missing
    (and its kernels are refused)."""
    from types import SimpleNamespace as NS

    from capture_plan.executor import graph_rebuild, graph_walk, kernel_loading as kl

    graphs = [
        _graph("decode", 4, [(0, "a"), (1, "b")]),
        _graph("decode", 1, [(1, "b")]),
        _graph("decode", 2, [(1, "c")]),
    ]
    f = GraphFile(valid_for=VALID, modules=[Module(digest=f"sha256:{m}", functions=1) for m in range(2)], graphs=graphs)
    assert loading_keys(f) == [0]
    reached = {4: [0x10], 1: [], 2: [0x11]}  # by size: the module handles each run's recording holds

    def recorded(target, name, bs, ws, stream, device, calls, cache, parts):
        return NS(nodes=[NS(kernel=NS(module=h)) for h in reached[bs]])

    def matched(file, loaded, calls, twin=None):
        return [0x10 if 0x10 in loaded else None, 0x11 if 0x11 in loaded else None]

    monkeypatch.setattr(kl, "_run_and_record", recorded)
    monkeypatch.setattr(graph_walk, "driver_calls", lambda: {})
    monkeypatch.setattr(graph_rebuild, "module_handles", matched)
    monkeypatch.setattr(kl, "fetch_functions", lambda file, modules: kl.Fetched())
    got = kl.load_kernels(f, None, {}, None, None)
    assert got.keys == ["decode/4", "decode/1", "decode/2"] and got.modules == [0x10, 0x11]
    reached[2] = []
    got = kl.load_kernels(f, None, {}, None, None)
    assert got.keys == ["decode/4", "decode/1", "decode/2"] and got.modules == [0x10, None]


def test_a_kernel_the_restore_does_not_have_is_named_once_at_its_first_node():
    f = GraphFile(valid_for=VALID, graphs=[_graph("decode", 8, [(0, "a"), (1, "b"), (0, "a"), (1, "b")])])
    assert unloaded_kernels(f, {}, "decode/8") == []
    got = unloaded_kernels(f, {(1, "b"): "its module was not loaded"}, "decode/8")
    assert got == [
        "graph decode/8 node 1 (kernel b): its module was not loaded after the target's eager runs at decode/8, so "
        "this process has it from no run of its library"
    ]


# -- inspect: the refusals no process is needed to see ----------------------------------------


def test_inspect_lists_what_a_restore_refuses_from_the_file_and_against_the_plan(plan, tmp_path, capsys):
    from capture_plan.schemas.codec import canonical_bytes

    plan_path = tmp_path / "plan.json"
    plan_path.write_bytes(canonical_bytes(plan))
    path = tmp_path / "g.cpgraphs"
    path.write_bytes(gf.encode(_saved(plan)))
    assert gf.main(["inspect", str(path), "--plan", str(plan_path)]) == 0
    out = capsys.readouterr().out
    assert f"a restore refuses (from the file alone and the plan {plan_path}): nothing" in out and "2 outputs" in out
    f = _saved(plan, word=OUTSIDE + 16)
    path.write_bytes(gf.encode(msgspec.structs.replace(f, valid_for=ValidFor(**{**msgspec.structs.asdict(VALID)}))))
    assert gf.main(["inspect", str(path)]) == 0  # the file alone: reported, not failed
    assert "a restore refuses (from the file alone): 1 reason(s)" in capsys.readouterr().out
    assert gf.main(["inspect", str(path), "--plan", str(plan_path)]) == 1
    out = capsys.readouterr().out
    assert "2 reason(s)" in out and "plan digest differs" in out and "point into outside:0" in out
    assert gf.main(["inspect", str(path), "--plan"]) == 2


# -- the whole restore past its checks, on fakes: CUDA (tests/fake_cuda.py) and the driver -------


class LaunchDriver(RebuildDriver):
    """The rebuild's fake driver, also launching and destroying executables, keeping the
    function attributes set (``ignore_func_set``: a driver that takes none) and logging each
    attribute set and kernel node added, in order."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.launched: list[tuple[int, int]] = []
        self.func_attrs: dict[tuple[int, int], int] = {}
        self.ignore_func_set = False
        self.log: list[tuple] = []

    def cuGraphLaunch(self, e, s):
        self.launched.append((e.value, s.value or 0))

    def cuFuncGetAttribute(self, out, attr, func):
        if (func.value, attr) not in self.func_attrs:
            return super().cuFuncGetAttribute(out, attr, func)
        out._obj.value = self.func_attrs[(func.value, attr)]

    def cuFuncSetAttribute(self, func, attr, value):
        self.log.append(("set", func.value, attr, value))
        if not self.ignore_func_set:
            self.func_attrs[(func.value, attr)] = value

    def cuGraphAddKernelNode_v2(self, out, graph, deps, n, p):
        self.log.append(("node", p._obj.func))
        return super().cuGraphAddKernelNode_v2(out, graph, deps, n, p)


class WalkedTarget:
    """A target whose every run (eager or recorded) is the fake graph's (the walk of graph 0x1)."""

    def __init__(self):
        self.runs: list[tuple[str, int, bool]] = []

    def run(self, phase, bs, ws):
        self.runs.append((phase, bs, torch.cuda.is_current_stream_capturing()))
        return torch.zeros(bs, 16)

    def prepare(self, phase, n, bs, gen):
        pass

    def refresh(self, phase, n, bs, ws):
        pass


@pytest.fixture
def faked(fake, monkeypatch, plan):
    """This process on fakes, as a restore past its checks sees it: torch.cuda (``fake``), the
    driver (LaunchDriver for the walk, the rebuild and the launches), the capture stream
    primed with a 32 MiB cuBLAS workspace, every tensor made in a MemPool a segment of its
    own (as the allocator cuts them: one request per segment here), the model's tensor."""
    import contextlib

    from capture_plan.executor import graph_env, graph_rebuild, graph_walk, pool, restore_layout, streams
    from fake_cuda import FakeGraph

    driver = LaunchDriver()
    monkeypatch.setattr(graph_walk, "driver_calls", lambda: driver)
    monkeypatch.setattr(graph_rebuild.libcuda, "calls", lambda *names: driver)
    monkeypatch.setattr(FakeGraph, "raw_cuda_graph", lambda self: 0x1)  # the walk reads the fake driver's graph
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(graph_env, "kernel_libraries", lambda maps="/proc/self/maps", only=None: VALID.libraries)
    monkeypatch.setattr(restore_layout, "segment_requests", lambda size: [size])
    made = track_pool_tensors(fake, monkeypatch)

    def segments(pools):
        keys = {tuple(p) for p in pools}
        live = [r() for k, refs in made.items() if k in keys for r in refs]
        return sorted((t.data_ptr(), t.untyped_storage().nbytes()) for t in live if t is not None)

    monkeypatch.setattr(pool, "pool_segments", segments)
    monkeypatch.setattr(streams, "_primed", {})
    cpu = torch.device("cpu")
    streams.prime_stream(cpu)
    stream = streams.capture_stream(cpu).cuda_stream
    ws = 0x7700_0000_0000
    fake.segments.append(
        {"address": ws, "total_size": 32 * MiB, "stream": stream, "segment_pool_id": (0, 0),
         "blocks": [{"address": ws, "size": 32 * MiB, "state": "active_allocated"}]}
    )  # fmt: skip
    weights = torch.zeros(1024)  # the file's model.w: 4096 B
    here = Here(device=cpu, env=_env(plan), tensors={"model.w": weights})
    return SimpleNamespace(driver=driver, here=here, ws=ws, weights=weights, stream=stream, fake=fake, made=made)


def _restored(faked, plan, file: GraphFile, target=None):
    report = rs.RestoreReport("g.cpgraphs")
    return rs._restore(plan, target or WalkedTarget(), file, faked.here, report, 0.0, {"model.w": faked.weights})


def test_a_restore_past_its_checks_relocates_every_address_to_this_processs_memory(faked, plan):
    target = WalkedTarget()
    gs = _restored(faked, plan, _saved(plan), target)
    assert target.runs == [("decode", 8, False), ("decode", 8, True)]  # the loading key: eager, then recorded
    r = gs.restored
    assert isinstance(r, rs.RestoreReport) and (r.graphs, r.nodes, r.keys) == (1, 4, ["decode/8"])
    assert r.segments == r.moved == 3  # the pool's segment, the tensor, cuBLAS's workspace: none where saved
    # the fake driver is Python: the ctypes path ran, and the report says why (a built compiled
    # builder, or why it did not load; tests/test_graph_build.py runs both through C-callable fakes)
    assert r.builder.startswith("ctypes (") and r.builder != "ctypes ()"
    assert list(gs.pools) == ["shared"]
    (base,) = [t().data_ptr() for refs in faked.made.values() for t in refs if t() is not None]  # the pool's segment
    nodes = list(faked.driver.nodes.values())
    kernel = next(n for n in nodes if n["type"] == "kernel")
    words = struct.unpack("<QiiQQQ", kernel["args"][:40])  # the pointer, the int, the struct
    assert words[0] == base + 0x40 and words[1] == 7
    assert (words[3], words[4], words[5]) == (faked.weights.data_ptr() + 8, 7, faked.ws + 0x80)
    assert next(n for n in nodes if n["type"] == "memset")["dst"] == base + 0x100
    copy = next(n for n in nodes if n["type"] == "memcpy")
    assert (copy["src"], copy["dst"]) == (faked.weights.data_ptr() + 16, base + 0x200)
    cap = gs.graphs[("decode", 8)]
    assert (cap.pool, cap.held, cap.key_phase, cap.order) == ("shared", "keep", "decode", 0)
    out, none = cap.outputs
    assert out.data_ptr() == base + 0x1000 and out.shape == (8, 16) and none.shape == (0, 16)
    got = gs.replay("decode", 3)
    assert faked.driver.launched == [(0xA00 + faked.driver.graphs[0], torch.cuda.current_stream().cuda_stream)]
    assert got[0].shape == (3, 16) and got[0].data_ptr() == out.data_ptr()
    del out, none, got, cap
    gs.release()
    assert faked.driver.made[-2:] == ["exec destroy", "clone destroy"]  # the executable and the graph
    assert [r() for refs in faked.made.values() for r in refs if r() is not None] == []  # the pool's memory let go
    assert faked.fake.mempools_freed == faked.fake.mempools == 3  # the loading run's two pools and the restored one


def test_the_loading_runs_wait_for_the_work_queued_before_the_restore(faked, plan):
    """The loading runs go on the capture stream: it waits on the current stream first (the
    weights' and inputs' writes, the hoisted workspaces' zeroing), as CaptureLoop.open
    synchronizes before a capture. Without the wait the runs raced them (the review's finding)."""
    from capture_plan.executor import streams

    target = WalkedTarget()
    stream = streams.capture_stream(torch.device("cpu"))
    waited_at_runs, run = [], target.run

    def watched(*a, **kw):
        waited_at_runs.append(list(stream.waited_streams))
        return run(*a, **kw)

    target.run = watched
    gs = _restored(faked, plan, _saved(plan), target)
    assert waited_at_runs and torch.cuda.current_stream() in waited_at_runs[0]
    gs.release()


def _with_kernel(f: GraphFile, **changes) -> GraphFile:
    """``f`` with its first node's kernel changed."""
    node = f.graphs[0].nodes[0]
    assert node.kernel is not None
    node = msgspec.structs.replace(node, kernel=msgspec.structs.replace(node.kernel, **changes))
    graph = msgspec.structs.replace(f.graphs[0], nodes=[node, *f.graphs[0].nodes[1:]])
    return msgspec.structs.replace(f, graphs=[graph])


def test_a_kernel_no_loading_run_launched_is_fetched_from_its_module_by_name(faked, plan):
    """The target's run launches gemm_kernel alone; other_kernel, of the same module, is fetched
    by name (a kernel cover refused it: the runs had not launched it)."""
    target = WalkedTarget()
    gs = _restored(faked, plan, _with_kernel(_saved(plan), name="other_kernel"), target)
    assert target.runs == [("decode", 8, False), ("decode", 8, True)]
    kernel = next(n for n in faked.driver.nodes.values() if n["type"] == "kernel")
    assert kernel["func"] == 0x101  # the module's other function (FakeDriver.cuModuleEnumerateFunctions)
    assert gs.restored.functions == 1
    loading = {"load.eager", "load.eager.first", "load.record", "load.walk", "load.modules", "load.functions"}
    assert loading | {"load.check"} <= set(gs.restored.parts)
    gs.release()


def test_a_kernel_whose_module_no_loading_run_reaches_refuses_in_one_line(faked, plan):
    f = _saved(plan)
    f = msgspec.structs.replace(f, modules=[*f.modules, Module(digest="sha256:elsewhere", functions=1)])
    f = _with_kernel(f, module=1, name="lonely_kernel")
    with pytest.raises(RestoreRefused) as got:
        _restored(faked, plan, f)
    assert got.value.reasons == [
        "graph decode/8 node 0 (kernel lonely_kernel): its module was not loaded after the target's eager runs at "
        "decode/8, so this process has it from no run of its library"
    ]
    assert got.value.made and faked.driver.nodes == {}  # refused before any node was added


def _prepared(f: GraphFile, **attributes: int) -> GraphFile:
    """``f`` with its kernel function's recorded attributes replaced by ``attributes``."""
    return msgspec.structs.replace(f, functions=[Function(module=0, name="gemm_kernel", attributes=attributes)])


def test_the_recorded_function_attributes_are_set_before_any_node_is_added(faked, plan):
    """What the library set before the saving process's first launch (a 100 KiB dynamic shared
    memory limit, non-portable clusters) is set on the kernel fetched by name, then read back."""
    f = _prepared(_saved(plan), max_dynamic_shared_size_bytes=100 << 10, non_portable_cluster_size_allowed=1,
                  preferred_shared_memory_carveout=0)  # fmt: skip
    gs = _restored(faked, plan, f)
    func = 0x100  # test_graph_file's FUNC: gemm_kernel
    sets = [e for e in faked.driver.log if e[0] == "set"]
    assert sets == [("set", func, 8, 100 << 10), ("set", func, 14, 1)]  # the carveout read as saved: not set
    first_node = faked.driver.log.index(("node", func))
    assert all(faked.driver.log.index(e) < first_node for e in sets)
    assert gs.restored.attributes == 2
    gs.release()


def test_a_dynamic_shared_memory_limit_raised_further_here_is_not_lowered(faked, plan):
    """The restore's own run raised gemm_kernel's limit past the saved one: kept, not lowered."""
    func = 0x100
    faked.driver.func_attrs[(func, 8)] = 200 << 10
    gs = _restored(faked, plan, _prepared(_saved(plan), max_dynamic_shared_size_bytes=100 << 10))
    assert [e for e in faked.driver.log if e[0] == "set"] == [] and faked.driver.func_attrs[(func, 8)] == 200 << 10
    gs.release()


def test_a_function_attribute_the_driver_does_not_take_refuses_before_any_node(faked, plan):
    faked.driver.ignore_func_set = True
    with pytest.raises(RestoreRefused) as got:
        _restored(faked, plan, _prepared(_saved(plan), max_dynamic_shared_size_bytes=100 << 10))
    (line,) = got.value.reasons
    assert "(kernel gemm_kernel): its function attribute max_dynamic_shared_size_bytes saved as 102400 reads " in line
    assert "49152 here (set: CUresult 0, read: CUresult 0)" in line
    assert faked.driver.nodes == {}


def test_a_function_attribute_this_restore_does_not_know_is_refused_from_the_file(restoring, plan):
    f = msgspec.structs.replace(_saved(plan), functions=[Function(module=0, name="gemm_kernel", attributes={"x": 1})])
    err = _refused(restoring, plan, f)
    assert err.reasons == ["kernel gemm_kernel: function attribute(s) ['x'] this restore does not set"]


def test_the_environments_parts_are_in_the_restores_report(restoring, plan):
    restoring.path.write_bytes(gf.encode(_saved(plan)))
    restoring.here = Here(device="cuda:0", env=_env(plan), parts={"prime": 0.25, "libraries": 0.5})
    rs.restore(plan, None, restoring.path)
    report = restoring.reached[0][4]
    assert report.parts["environment.prime"] == 0.25 and report.parts["environment.libraries"] == 0.5
    checks = {k for k in report.parts if k.startswith("check.")}
    assert checks == {f"check.{k}" for k in ("valid", "plan", "layout", "nodes", "functions", "stale")}


def test_a_rebuild_that_fails_lets_go_of_everything_it_made(faked, plan):
    faked.driver.rc["cuGraphAddMemsetNode"] = 700
    with pytest.raises(ExecutorError, match=r"cuGraphAddMemsetNode failed \(CUresult 700\)"):
        _restored(faked, plan, _saved(plan))
    live = [r() for refs in faked.made.values() for r in refs if r() is not None]
    assert live == [], "the restored pool's memory is still held"


def test_the_executor_exports_restore_as_a_function():
    """With the module named restore.py, ``from capture_plan.executor import restore`` gave the
    module (a submodule of the name wins over the lazy attribute)."""
    import capture_plan.executor as ex

    assert ex.restore is rs.restore and callable(ex.restore) and ex.restore_or_capture is rs.restore_or_capture


def test_a_graph_builder_the_environment_cannot_give_is_refused_before_the_loading_runs(restoring, plan, monkeypatch):
    """CAPTURE_PLAN_GRAPH_BUILDER names the rebuild's builder: a name of none (or ``compiled``
    where it did not load) refused with the file's other checks, before any kernel runs, not
    after the loading runs' seconds."""
    from capture_plan.executor import graph_flat

    monkeypatch.setenv(graph_flat.BUILDER_ENV, "fast")
    err = _refused(restoring, plan, _saved(plan))
    assert err.reasons == [
        f"{graph_flat.BUILDER_ENV}='fast' names no graph builder (ctypes, compiled or auto) "
        f"(fix: unset {graph_flat.BUILDER_ENV})"
    ]
    monkeypatch.setenv(graph_flat.BUILDER_ENV, "compiled")
    monkeypatch.setitem(sys.modules, "capture_plan.executor._graph_build", None)  # its import raises ImportError
    err = _refused(restoring, plan, _saved(plan))
    assert err.reasons[0].startswith(f"{graph_flat.BUILDER_ENV}=compiled, but the compiled graph builder did not load")


def test_the_restores_early_builder_check_logs_nothing_its_rebuild_logs_the_fallback_once(plan, monkeypatch, caplog):
    """Where the compiled builder is not built, the checks ahead of a restore find the ctypes
    fallback quietly: the rebuild's own choice logs its one INFO line (the checks logged it too)."""
    from capture_plan.executor import graph_flat

    monkeypatch.delenv(graph_flat.BUILDER_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "capture_plan.executor._graph_build", None)
    caplog.set_level(logging.INFO)
    assert restore_refusals(plan, _saved(plan), Here(device="cuda:0", env=_env(plan))) == []
    assert not [r for r in caplog.records if "graph builder" in r.getMessage()]
    assert graph_flat.graph_builder().name == "ctypes"
    assert len([r for r in caplog.records if "graph builder: running ctypes" in r.getMessage()]) == 1
