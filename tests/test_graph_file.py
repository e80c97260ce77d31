"""The restore probe and the graph file on the CPU: a fake driver's graph walked, its addresses
classified and counted, the file built, encoded, read and inspected, and every refusal of
``check_valid`` (issue 51, phase 1). The same code on a real graph: tests/test_gpu_restore.py."""

from __future__ import annotations

import ctypes
import re
import struct

import msgspec
import pytest

pytest.importorskip("torch")  # the executor imports torch (its graph walk shares exec_update's tables)

from capture_plan.executor import ExecutorError, graph_file as gf
from capture_plan.executor.graph_env import kernel_libraries, torch_versions
from capture_plan.executor.graph_validity import GraphEnvironment, check_valid
from capture_plan.executor.graph_walk import device_addresses, tensor_map_params, walk_graph
from capture_plan.executor.libcuda import EdgeData
from capture_plan.executor.restore_probe import (
    TorchSegment,
    classify,
    clone_floor,
    count_graphs,
    summary_line,
    torch_segments,
)
from capture_plan.schemas.errors import InputError
from capture_plan.schemas.graph_file import GRAPH_FILE_VERSION, GraphFile, Library, Runtime, ValidFor

POOL, OTHER, OUTSIDE, NOT_AN_ADDRESS = 0x7000_0000_0000, 0x7100_0000_0000, 0x7200_0000_0000, 0x7300_0000_0000
TENSOR = OTHER + 0x1000
SNAPSHOT = [
    {"address": OTHER, "total_size": 20 << 20, "segment_pool_id": (0, 0)},
    {"address": POOL, "total_size": 2 << 20, "segment_pool_id": (1, 2)},
]
#: (offset, size): a pointer, an int, a struct holding a tensor address, 7 and an outside address,
#: a CUtensorMap-shaped parameter
LAYOUT = [(0, 8), (8, 4), (16, 24), (64, 128)]
KERNEL, MEMSET, COPY, EMPTY = 0x10, 0x20, 0x30, 0x40
FUNC, KERN, MODULE = 0x100, 0x200, 0x300


def _args() -> list[bytes]:
    return [
        struct.pack("<Q", POOL + 0x40),
        struct.pack("<i", 7),
        struct.pack("<QQQ", TENSOR + 8, 7, OUTSIDE + 16),
        struct.pack("<Q", NOT_AN_ADDRESS) + bytes(120),
    ]


class FakeDriver(dict):
    """The walk's driver calls over one graph: a kernel, a memset, a device-to-device copy and
    an empty node, edges kernel->memset->copy, empty->copy (a PDL edge). ``rc`` overrides a
    call's CUresult; ``by_kernel``: the kernel node names a CUkernel, not a function."""

    def __init__(self, rc: dict | None = None, by_kernel: bool = False, layout=LAYOUT):
        super().__init__()
        self.rc = rc or {}
        self.by_kernel = by_kernel
        self.layout = layout
        self.buffers = [ctypes.create_string_buffer(a, len(a)) for a in _args()]
        self.ptrs = (ctypes.c_void_p * len(self.buffers))(*[ctypes.addressof(b) for b in self.buffers])
        self.made: list[str] = []
        for name in dir(self):
            if name.startswith("cu"):
                self[name] = self._wrap(name, getattr(self, name))

    def _wrap(self, name, fn):
        def call(*args):
            if name in self.rc:
                return self.rc[name]
            return fn(*args) or 0

        return call

    def cuGraphGetNodes(self, g, arr, n):
        if arr is None:
            n._obj.value = 4
            return
        out = ctypes.cast(arr, ctypes.POINTER(ctypes.c_void_p))
        for i, h in enumerate((KERNEL, MEMSET, COPY, EMPTY)):
            out[i] = h

    def cuGraphNodeGetType(self, node, t):
        t._obj.value = {KERNEL: 0, MEMSET: 2, COPY: 1, EMPTY: 5}[node.value]

    def cuGraphKernelNodeGetParams_v2(self, node, p):
        p = p._obj
        p.func, p.kern = (None, KERN) if self.by_kernel else (FUNC, None)
        p.gridDimX, p.gridDimY, p.gridDimZ = 132, 1, 1
        p.blockDimX, p.blockDimY, p.blockDimZ = 128, 1, 1
        p.sharedMemBytes = 4096
        p.kernelParams = ctypes.addressof(self.ptrs)

    def cuKernelGetFunction(self, out, kern):
        assert kern.value == KERN
        out._obj.value = FUNC

    def cuGraphKernelNodeGetAttribute(self, node, aid, buf):
        if aid != 4:  # only the cluster dimension reads back
            return 1
        ctypes.cast(buf, ctypes.POINTER(ctypes.c_uint))[0] = 2

    def cuFuncGetName(self, name, func):
        name._obj.value = {FUNC: b"gemm_kernel", 0x101: b"other_kernel"}[func.value]

    def cuFuncGetModule(self, mod, func):
        mod._obj.value = MODULE

    def cuFuncGetParamInfo(self, func, i, off, size):
        if i >= len(self.layout):
            return 1  # CUDA_ERROR_INVALID_VALUE past the last
        off._obj.value, size._obj.value = self.layout[i]

    def cuModuleGetFunctionCount(self, count, mod):
        count._obj.value = 2

    #: what cuFuncGetAttribute reads: the library raised the dynamic shared memory limit, allowed
    #: non-portable clusters; the scheduling policy (15) does not read (an older driver); its build
    #: fixed 96 registers and binary version 90 (the other fixed attributes do not read here)
    FUNC_ATTRIBUTES = {8: 100 << 10, 9: 50, 11: 0, 12: 0, 13: 0, 14: 1, 4: 96, 6: 90}

    def cuFuncGetAttribute(self, out, attr, func):
        if attr not in self.FUNC_ATTRIBUTES:
            return 1  # CUDA_ERROR_INVALID_VALUE
        out._obj.value = self.FUNC_ATTRIBUTES[attr]

    def cuModuleEnumerateFunctions(self, funcs, n, mod):
        out = ctypes.cast(funcs, ctypes.POINTER(ctypes.c_void_p))
        out[0], out[1] = 0x101, FUNC

    def cuGraphMemsetNodeGetParams(self, node, m):
        m = m._obj
        m.dst, m.pitch, m.value, m.elementSize, m.width, m.height = POOL + 0x100, 0, 0, 4, 64, 1

    def cuGraphMemcpyNodeGetParams(self, node, c):
        c = c._obj
        c.srcMemoryType, c.srcDevice, c.srcXInBytes = 2, TENSOR, 16
        c.dstMemoryType, c.dstDevice = 2, POOL + 0x200
        c.WidthInBytes, c.Height, c.Depth = 256, 1, 1

    def cuGraphGetEdges_v2(self, g, src, dst, data, n):
        edges = [(KERNEL, MEMSET, (0, 0, 0)), (MEMSET, COPY, (0, 0, 0)), (EMPTY, COPY, (1, 0, 1))]
        if src is None:
            n._obj.value = len(edges)
            return
        s = ctypes.cast(src, ctypes.POINTER(ctypes.c_void_p))
        d = ctypes.cast(dst, ctypes.POINTER(ctypes.c_void_p))
        e = ctypes.cast(data, ctypes.POINTER(EdgeData))
        for i, (a, b, (fp, tp, ty)) in enumerate(edges):
            s[i], d[i] = a, b
            e[i].from_port, e[i].to_port, e[i].type = fp, tp, ty

    def cuMemGetAddressRange_v2(self, base, size, value):
        v = value.value
        for lo, n in ((POOL, 2 << 20), (OTHER, 20 << 20), (OUTSIDE, 1 << 20)):
            if lo <= v < lo + n:
                base._obj.value, size._obj.value = lo, n
                return 0
        return 1

    # the clone floor's
    def cuGraphClone(self, out, raw):
        out._obj.value = 0x900 + raw.value
        self.made.append("clone")

    def cuGraphInstantiateWithFlags(self, out, graph, flags):
        out._obj.value = 0xA00 + graph.value
        self.made.append("exec")

    def cuGraphUpload(self, e, s):
        self.made.append("upload")

    def cuStreamSynchronize(self, s):
        self.made.append("sync")

    def cuGraphExecDestroy(self, e):
        self.made.append("exec destroy")

    def cuGraphDestroy(self, g):
        self.made.append("clone destroy")


def _resolve(driver: FakeDriver):
    from capture_plan.executor.graph_walk import AddressResolver

    return AddressResolver(driver)


# -- the walk and the probe's counts --------------------------------------------------------


@pytest.mark.parametrize("by_kernel", [False, True])
def test_the_walk_reads_every_node_and_edge(by_kernel):
    w = walk_graph(0x1, FakeDriver(by_kernel=by_kernel))
    assert [n.type for n in w.nodes] == ["kernel", "memset", "memcpy", "empty"]
    k = w.nodes[0].kernel
    assert k is not None and (k.name, k.module, k.function) == ("gemm_kernel", MODULE, FUNC)
    assert k.params == LAYOUT and len(k.args) == 192 and k.args[16:24] == struct.pack("<Q", TENSOR + 8)
    assert k.attributes == {"cluster_dimension": (2, 0, 0)} and (k.grid, k.shared_bytes) == ((132, 1, 1), 4096)
    c = w.nodes[2].copy
    assert c is not None and (c.src, c.dst, c.width) == (TENSOR + 16, POOL + 0x200, 256)
    assert w.edges == [(0, 1), (1, 2), (3, 2, 1, 0, 1)]  # the PDL edge keeps its data


def test_a_graph_without_edges_is_not_asked_for_them():
    """An H200's driver refused a query for 0 edges with arrays (CUresult 1): the save of an
    SGLang-shaped target_verify graph failed there. This fake refuses as that driver did."""

    class NoEdges(FakeDriver):
        def cuGraphGetEdges_v2(self, g, src, dst, data, n):
            if src is not None and n._obj.value == 0:
                return 1
            n._obj.value = 0

    w = walk_graph(0x1, NoEdges())
    assert len(w.nodes) == 4 and w.edges == []


def test_walks_sharing_a_cache_ask_the_driver_once_per_function():
    """The save walked every node's function through the driver again (8.7 s for the reference)."""
    from capture_plan.executor.graph_walk import FunctionCache

    d, asked = FakeDriver(), []
    name = d["cuFuncGetName"]
    d["cuFuncGetName"] = lambda *a: asked.append(1) or name(*a)
    cache = FunctionCache()
    first, second = walk_graph(0x1, d, cache=cache), walk_graph(0x2, d, cache=cache)
    assert len(asked) == 1 and first == second
    walk_graph(0x1, d)  # a walk of its own asks again
    assert len(asked) == 2


def test_the_walk_fails_loudly_on_a_structural_call_and_records_the_rest():
    with pytest.raises(ExecutorError, match=r"cuGraphGetNodes failed \(CUresult 999\)"):
        walk_graph(0x1, FakeDriver(rc={"cuGraphGetNodes": 999}), where="graph decode/8")
    with pytest.raises(ExecutorError, match=r"graph decode/8, node 1: cuGraphMemsetNodeGetParams failed"):
        walk_graph(0x1, FakeDriver(rc={"cuGraphMemsetNodeGetParams": 700}), where="graph decode/8")
    w = walk_graph(0x1, FakeDriver(rc={"cuFuncGetName": 500, "cuFuncGetParamInfo": 801}))
    k = w.nodes[0].kernel
    assert k is not None and (k.name_rc, k.name, k.params_rc, k.params, k.args) == (500, "", 801, [], b"")


def test_addresses_are_words_inside_one_parameter_that_the_driver_resolves():
    args = bytearray(192)
    args[0:8] = struct.pack("<Q", POOL)
    args[12:20] = struct.pack("<Q", POOL)  # unaligned: not a pointer position
    args[24:32] = struct.pack("<Q", OUTSIDE)
    args[40:48] = struct.pack("<Q", 7)  # too small to be an address
    got = device_addresses(bytes(args), LAYOUT, _resolve(FakeDriver()))
    assert got == [(0, POOL), (24, OUTSIDE)]
    assert device_addresses(bytes(args), [(0, 4)], _resolve(FakeDriver())) == []  # a word past its parameter
    assert tensor_map_params(LAYOUT) == [3] and tensor_map_params([(32, 128), (64, 64)]) == []


def test_addresses_are_classified_by_segment_and_pool():
    segs = torch_segments(SNAPSHOT)
    assert segs == [TorchSegment(POOL, 2 << 20, (1, 2)), TorchSegment(OTHER, 20 << 20, (0, 0))]
    pools = {(1, 2)}
    assert classify(POOL, segs, pools) == "pool" and classify(POOL + (2 << 20) - 1, segs, pools) == "pool"
    assert classify(POOL + (2 << 20), segs, pools) == "outside"  # one past the segment's end
    assert classify(TENSOR, segs, pools) == "torch" and classify(TENSOR, segs, set()) == "torch"
    assert classify(OUTSIDE, segs, pools) == "outside" and classify(POOL - 1, segs, pools) == "outside"


def test_the_probe_counts_nodes_addresses_and_tensor_maps():
    d = FakeDriver()
    walked = [walk_graph(0x1, d), walk_graph(0x2, d)]
    c = count_graphs(walked, _resolve(d), torch_segments(SNAPSHOT), {(1, 2)})
    assert (c.graphs, c.nodes, c.largest_graph) == (2, 8, 4)
    assert (c.kernel_nodes, c.memset_nodes, c.copy_nodes, c.other_nodes) == (2, 2, 2, 2)
    assert (c.names, c.modules, c.layouts, c.distinct_modules) == (2, 2, 2, 1)
    assert c.addresses == {"pool": 2, "torch": 2, "outside": 2}
    assert c.operands == {"pool": 4, "torch": 2, "outside": 0} and c.host_operands == 0
    assert (c.tensor_map_params, c.tensor_map_kernels, c.tensor_map_names) == (2, 2, ["gemm_kernel"])
    assert c.outside_names == ["gemm_kernel"]
    line = summary_line("reference", c, 0.25, 1.0)
    assert "2 graphs, 8 nodes (2 kernel, 2 memset, 2 copy, 2 other; largest 4)" in line
    assert "addresses pool/other-torch/outside 2/2/2" in line and "(0.25x)" in line
    unresolved = count_graphs([walk_graph(0x1, FakeDriver(rc={"cuFuncGetModule": 500}))], _resolve(d), [], set())
    assert (unresolved.names, unresolved.modules, unresolved.addresses["outside"]) == (1, 0, 3)


def test_the_clone_floor_times_every_graph_and_destroys_what_it_made():
    d = FakeDriver()
    seconds, made = clone_floor([1, 2], 0x5, d)
    assert made == 2 and seconds >= 0
    assert d.made == [*["clone", "exec", "upload"] * 2, "sync", *["exec destroy"] * 2, *["clone destroy"] * 2]
    bad = FakeDriver(rc={"cuGraphUpload": 2})
    with pytest.raises(ExecutorError, match=r"cuGraphUpload failed \(CUresult 2\) on graph 0"):
        clone_floor([1, 2], 0x5, bad)
    assert bad.made == ["clone", "exec", "exec destroy", "clone destroy"]  # what it made, destroyed


# -- the file -------------------------------------------------------------------------------

VALID = ValidFor(
    plan_digest="sha256:plan",
    device="NVIDIA H100 80GB HBM3",
    capability="9.0",
    driver="580.95.05",
    torch="2.11.0",
    cuda="13.0",
    libraries=[Library(name="libcublasLt.so.13", digest="sha256:lt", size=10)],
)


def _file(driver: FakeDriver | None = None) -> GraphFile:
    d = driver or FakeDriver()
    segs = gf.Segments(torch_segments(SNAPSHOT), {"shared": (1, 2)}, {"model.w": (TENSOR, 4096)}, _resolve(d))
    return gf.build_file([("decode", 8, walk_graph(0x1, d))], segs, VALID, d)


def offered(**changes) -> GraphEnvironment:
    """What the file asks for (VALID) offered as it asks, its tensor model.w included, with
    ``changes`` in place (a :class:`Runtime` field's among them)."""
    runtime = {k: changes.pop(k) for k in Runtime.__struct_fields__ if k in changes}
    env = GraphEnvironment(
        runtime=msgspec.structs.replace(VALID.runtime, **runtime),
        libraries={lib.name: lib.digest for lib in VALID.libraries},
        tensors={"model.w": 4096},
    )
    for k, v in changes.items():
        setattr(env, k, v)
    return env


def _env(**changes) -> GraphEnvironment:
    return offered(**{"pools": {"shared": [2 << 20]}, **changes})


def test_the_file_names_every_address_by_segment_and_offset():
    f = _file()
    assert [(s.name, s.kind, s.size) for s in f.segments] == [
        ("pool:shared/0", "pool", 2 << 20),
        ("tensor:model.w", "tensor", 4096),
        ("outside:0", "outside", 1 << 20),
    ]
    k = f.graphs[0].nodes[0].kernel
    assert k is not None and k.name == "gemm_kernel" and k.tensor_maps == [3]
    assert [(r.position, f.segments[r.segment].name, r.offset) for r in k.relocations] == [
        (0, "pool:shared/0", 0x40),
        (16, "tensor:model.w", 8),
        (32, "outside:0", 16),
    ]
    assert k.args[0:8] == k.args[16:24] == k.args[32:40] == bytes(8)  # addresses zeroed
    assert k.args[24:32] == struct.pack("<Q", 7)  # the rest kept
    assert f.modules[0].functions == 2 and f.modules[0].digest.startswith("sha256:")
    m, c = f.graphs[0].nodes[1].memset, f.graphs[0].nodes[2].copy
    assert m is not None and (m.dst.segment, m.dst.offset) == (0, 0x100)
    assert c is not None and (c.src.segment, c.src.offset, c.dst.offset) == (1, 16, 0x200)
    assert f.graphs[0].edges == [(0, 1), (1, 2), (3, 2, 1, 0, 1)]
    # the same graph makes the same file; of the saving process's addresses it keeps each segment's
    # alone (for the stale-word check: test_restore.py), and nothing is rebuilt at them
    assert gf.encode(f) == gf.encode(_file())
    assert [s.address for s in f.segments] == [POOL, TENSOR, OUTSIDE]


def test_a_kernel_the_driver_does_not_describe_is_not_saved():
    with pytest.raises(ExecutorError, match=r"kernel gemm_kernel cannot be saved: .*parameter layout CUresult 801"):
        _file(FakeDriver(rc={"cuFuncGetParamInfo": 801}))


def test_a_copy_with_an_offset_beyond_x_is_not_saved():
    """Its operand is base + X + Y * pitch (+ Z ...): relocated as base + X it would point elsewhere."""

    class Offset(FakeDriver):
        def cuGraphMemcpyNodeGetParams(self, node, c):
            super().cuGraphMemcpyNodeGetParams(node, c)
            c._obj.srcY = 1

    with pytest.raises(ExecutorError, match=r"a copy with a Y, Z or LOD offset cannot be saved"):
        _file(Offset())


def test_the_file_records_torchs_version_as_a_string_msgpack_encodes():
    """torch.__version__ is a TorchVersion, which msgpack refuses: every save failed on the GPU."""
    torch = pytest.importorskip("torch")
    f = msgspec.structs.replace(_file(), valid_for=msgspec.structs.replace(_file().valid_for, torch="x"))
    assert gf.encode(f)
    with pytest.raises(TypeError, match="TorchVersion"):
        gf.encode(msgspec.structs.replace(f, valid_for=msgspec.structs.replace(f.valid_for, torch=torch.__version__)))
    versions = torch_versions()
    assert all(type(v) is str for v in versions) and versions[0] == torch.__version__
    assert gf.encode(msgspec.structs.replace(f, valid_for=msgspec.structs.replace(f.valid_for, torch=versions[0])))


def test_the_file_round_trips_and_inspect_says_what_it_holds(tmp_path, capsys):
    path = tmp_path / "g.cpgraphs"
    path.write_bytes(gf.encode(_file()))
    assert gf.read_graph_file(path) == _file()
    assert gf.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"graph file version {GRAPH_FILE_VERSION}" in out and "device NVIDIA H100 80GB HBM3" in out
    assert "1 graphs, 4 nodes (empty 1, kernel 1, memcpy 1, memset 1)" in out and "3 relocated" in out
    assert "not relocatable: outside:0" in out and "library libcublasLt.so.13 sha256:lt" in out
    from capture_plan.executor.graph_flat import graph_builder

    assert out.splitlines()[-1] == f"graph builder here: {graph_builder().describe()}"


@pytest.mark.parametrize(
    "data, said",
    [
        (b"not msgpack at all \xc1", "not a graph file"),
        (msgspec.msgpack.encode({"kind": "capture-plan plan", "version": 1}), "not a graph file (kind"),
        (msgspec.msgpack.encode({"kind": "capture-plan graph file", "version": 99}), "graph file version 99"),
        (msgspec.msgpack.encode({"kind": "capture-plan graph file", "version": GRAPH_FILE_VERSION}), "damaged"),
    ],
)
def test_a_bad_file_is_one_line_and_exit_1(tmp_path, capsys, data, said):
    path = tmp_path / "g.cpgraphs"
    path.write_bytes(data)
    with pytest.raises(InputError, match=re.escape(said)):
        gf.read_graph_file(path)
    assert gf.main(["inspect", str(path)]) == 1
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1
    assert gf.main(["inspect"]) == 2


# -- check_valid: every refusal -------------------------------------------------------------


def _file_without_outside() -> GraphFile:
    d = FakeDriver()
    d.buffers[2] = ctypes.create_string_buffer(struct.pack("<QQQ", TENSOR + 8, 7, 0), 24)
    d.ptrs[2] = ctypes.addressof(d.buffers[2])
    return _file(d)


def test_a_file_restores_where_everything_matches():
    assert check_valid(_file_without_outside(), _env()) == []


@pytest.mark.parametrize(
    "changes, said",
    [
        (dict(plan_digest="sha256:other"), "plan digest differs"),
        (dict(device="NVIDIA H200"), "device differs"),
        (dict(capability="10.0"), "compute capability 10.0"),
        (dict(driver="575.1"), "driver differs"),
        (dict(torch="2.10.0"), "torch differs"),
        (dict(cuda="12.8"), "(CUDA 12.8)"),
        (dict(libraries={"libcublasLt.so.13": "sha256:new"}), "kernel library libcublasLt.so.13 differs"),
        (dict(libraries={}), "kernel library libcublasLt.so.13 is not loaded"),
        (dict(tensors={}), "tensor model.w is missing"),
        (dict(tensors={"model.w": 8192}), "tensor model.w is resized"),
        (dict(pools={}), "pool shared is not laid out"),
        (dict(pools={"shared": [2 << 20, 2 << 20]}), "pool shared is laid out differently"),
    ],
)
def test_every_difference_is_one_refusal(changes, said):
    got = check_valid(_file_without_outside(), _env(**changes))
    assert len(got) == 1 and said in got[0], got
    assert "\n" not in got[0]


def test_an_address_outside_every_known_segment_is_refused():
    got = check_valid(_file(), _env())
    assert len(got) == 1
    assert "1 address(es) point into outside:0" in got[0] and "graph decode/8 node 0" in got[0]
    f = _file()
    torchseg = msgspec.structs.replace(f.segments[1], kind="torch", name="torch:0", owner="")
    host = msgspec.structs.replace(f.segments[1], kind="host", name="host:0", owner="")
    for seg, said in ((torchseg, "no named tensor or library workspace covered"), (host, "host memory")):
        got = check_valid(msgspec.structs.replace(f, segments=[f.segments[0], seg, f.segments[2]]), _env())
        assert any(said in line for line in got), got
    damaged = msgspec.structs.replace(f, segments=f.segments[:1])
    assert any("the file is damaged" in line for line in check_valid(damaged, _env()))


# -- library workspaces: cuBLAS's on the capture stream -----------------------------------

CAPTURE_STREAM, OTHER_STREAM = 0x5A, 0x5B
WORKSPACE = 0x7400_0000_0000


def _ws_snapshot() -> list[dict]:
    """The capture stream's 32 MiB cuBLAS workspace, a freed warm-up block beside a kept one on
    it, a pool segment recorded on it, and a segment of another stream."""
    block = lambda a, n, state="active_allocated": {"address": a, "size": n, "state": state}  # noqa: E731
    return [
        {"address": WORKSPACE, "total_size": 32 << 20, "stream": CAPTURE_STREAM, "segment_pool_id": (0, 0),
         "blocks": [block(WORKSPACE, 32 << 20)]},
        {"address": WORKSPACE + (64 << 20), "total_size": 2 << 20, "stream": CAPTURE_STREAM,
         "segment_pool_id": (0, 0),
         "blocks": [block(WORKSPACE + (64 << 20), 1 << 20), block(WORKSPACE + (65 << 20), 1 << 20, "inactive")]},
        {"address": POOL, "total_size": 2 << 20, "stream": CAPTURE_STREAM, "segment_pool_id": (1, 2),
         "blocks": [block(POOL, 2 << 20)]},
        {"address": OTHER, "total_size": 20 << 20, "stream": OTHER_STREAM, "segment_pool_id": (0, 0),
         "blocks": [block(OTHER, 20 << 20)]},
    ]  # fmt: skip


def test_the_library_workspaces_are_the_primed_streams_blocks_outside_every_pool():
    from capture_plan.executor.restore_probe import stream_workspaces

    got = stream_workspaces(_ws_snapshot(), {CAPTURE_STREAM: "capture"}, {(1, 2)})
    assert got == {"capture/0": (WORKSPACE, 32 << 20), "capture/1": (WORKSPACE + (64 << 20), 1 << 20)}
    assert stream_workspaces(_ws_snapshot(), {}, {(1, 2)}) == {}  # a stream the executor did not prime
    # torch's graph-safe RNG state (512-byte blocks on the capture stream, below cuBLAS's workspace
    # here) is no library's workspace: unnamed (a graph reading it is refused), and no rename
    low = {"address": WORKSPACE - (2 << 20), "total_size": 2 << 20, "stream": CAPTURE_STREAM,
           "segment_pool_id": (0, 0), "blocks": [{"address": WORKSPACE - (2 << 20), "size": 512,
                                                  "state": "active_allocated"}]}  # fmt: skip
    assert stream_workspaces([low, *_ws_snapshot()], {CAPTURE_STREAM: "capture"}, {(1, 2)}) == got
    # the largest first: a smaller workspace lying below cuBLAS's does not rename it
    low["blocks"][0]["size"] = 2 << 20
    again = stream_workspaces([low, *_ws_snapshot()], {CAPTURE_STREAM: "capture"}, {(1, 2)})
    assert again["capture/0"] == (WORKSPACE, 32 << 20) and again["capture/1"] == (WORKSPACE - (2 << 20), 2 << 20)


def _ws_file(workspace: int = WORKSPACE, driver: FakeDriver | None = None) -> GraphFile:
    """The fake graph with its struct's outside address in cuBLAS's workspace instead."""
    d = driver or FakeDriver()
    d.buffers[2] = ctypes.create_string_buffer(struct.pack("<QQQ", TENSOR + 8, 7, workspace + 0x80), 24)
    d.ptrs[2] = ctypes.addressof(d.buffers[2])
    from capture_plan.executor.graph_walk import AddressResolver

    snap = torch_segments([*SNAPSHOT, {"address": workspace, "total_size": 32 << 20, "segment_pool_id": (0, 0)}])
    segs = gf.Segments(
        snap,
        {"shared": (1, 2)},
        {"model.w": (TENSOR, 4096)},
        AddressResolver(d, known=snap),  # the fake driver knows no workspace: the allocator's segments answer
        {"capture/0": (workspace, 32 << 20)},
    )
    return gf.build_file([("decode", 8, walk_graph(0x1, d))], segs, VALID, d)


def _unplaced(f: GraphFile) -> GraphFile:
    """``f`` with its segments' saved addresses left out."""
    return msgspec.structs.replace(f, segments=[msgspec.structs.replace(s, address=0) for s in f.segments])


def test_cublass_workspace_is_a_named_segment_the_saving_process_accepts():
    """Before, the workspace was a torch:K segment and every file was refused in its own process."""
    f = _ws_file()
    assert [(s.name, s.kind, s.size) for s in f.segments][-1] == ("workspace:capture/0", "workspace", 32 << 20)
    k = f.graphs[0].nodes[0].kernel
    assert k is not None and (f.segments[k.relocations[-1].segment].name, k.relocations[-1].offset) == (
        "workspace:capture/0",
        0x80,
    )
    assert check_valid(f, _env(workspaces={"capture/0": 32 << 20})) == []
    # where it lay is recorded (the stale-word check), and nothing else of it
    assert gf.encode(_unplaced(f)) == gf.encode(_unplaced(_ws_file(WORKSPACE + (1 << 30))))
    for ws, said in (({}, "library workspace capture/0 is missing"), ({"capture/0": 8 << 20}, "is resized")):
        got = check_valid(f, _env(workspaces=ws))
        assert len(got) == 1 and said in got[0], got


def test_a_tensor_covering_a_workspace_block_keeps_its_tensor_name():
    segs = gf.Segments([], {}, {"kept": (WORKSPACE, 4096)}, lambda v: None, {"capture/0": (WORKSPACE, 32 << 20)})
    assert segs.list == [] and segs.operand(WORKSPACE + 8) == gf.Operand(segment=0, offset=8)
    assert segs.list[0].name == "tensor:kept"


# -- the kernel libraries -------------------------------------------------------------------


def _elf(sections: list[bytes]) -> bytes:
    """A minimal 64-bit ELF with empty sections of these names (and .shstrtab)."""
    names = b"\0" + b"".join(n + b"\0" for n in [*sections, b".shstrtab"])
    offs = [1]
    for n in sections:
        offs.append(offs[-1] + len(n) + 1)
    data_at = 64
    sh_at = data_at + len(names)
    head = bytearray(64)
    head[:5] = b"\x7fELF\x02"
    head[0x28:0x30] = sh_at.to_bytes(8, "little")
    head[0x3A:0x3C] = (64).to_bytes(2, "little")
    head[0x3C:0x3E] = (len(sections) + 2).to_bytes(2, "little")
    head[0x3E:0x40] = (len(sections) + 1).to_bytes(2, "little")
    table = bytes(64)  # the null section
    for off in offs[:-1]:
        table += off.to_bytes(4, "little") + bytes(60)
    strtab = bytearray(64)
    strtab[0:4] = offs[-1].to_bytes(4, "little")
    strtab[0x18:0x20] = data_at.to_bytes(8, "little")
    strtab[0x20:0x28] = len(names).to_bytes(8, "little")
    return bytes(head) + names + table + bytes(strtab)


def test_the_file_records_each_kernel_functions_attributes_once_those_the_driver_reads():
    """What a library set on a kernel before its first launch (its dynamic shared memory limit,
    non-portable clusters) is in the file, once per function: a restore that fetches the kernel
    by name, not by a run, sets it again (kernel_loading). Version 4 recorded none."""
    from capture_plan.schemas.graph_file import Function

    d = FakeDriver()
    segs = gf.Segments(torch_segments(SNAPSHOT), {"shared": (1, 2)}, {"model.w": (TENSOR, 4096)}, _resolve(d))
    f = gf.build_file([("decode", 8, walk_graph(0x1, d)), ("decode", 4, walk_graph(0x1, d))], segs, VALID, d)
    want = {"max_dynamic_shared_size_bytes": 100 << 10, "preferred_shared_memory_carveout": 50,
            "required_cluster_width": 0, "required_cluster_height": 0, "required_cluster_depth": 0,
            "non_portable_cluster_size_allowed": 1}  # fmt: skip
    fixed = {"num_regs": 96, "binary_version": 90}  # what tells twins apart (kernel_loading.twin_check)
    assert f.functions == [Function(module=0, name="gemm_kernel", attributes=want, fixed=fixed)]
    back = msgspec.msgpack.decode(gf.encode(f), type=GraphFile)
    assert back.functions == f.functions


def test_a_library_as_saved_is_taken_at_its_saved_digest_and_hashed_once_changed(tmp_path):
    """A restore on the machine that saved the file hashes no library whose file is as the file
    recorded it (path and identity); a touched or rewritten one is hashed again, so that a
    changed library is still refused."""
    import hashlib
    import os

    from capture_plan.executor import graph_env

    lib = tmp_path / "libkernels.so.1"
    lib.write_bytes(_elf([b".text", b".nv_fatbin"]))
    maps = tmp_path / "maps"
    maps.write_text(f"7f00-7f10 r-xp 00000000 08:01 1 {lib}\n")
    (saved,) = kernel_libraries(str(maps))
    assert saved.path == str(lib) and saved.stat[2] == lib.stat().st_size
    graph_env._DIGESTS.clear()
    claimed = msgspec.structs.replace(saved, digest="sha256:as-saved")  # what only the trust can give
    assert graph_env.trust_saved_digests([claimed]) == 1
    assert [x.digest for x in kernel_libraries(str(maps))] == ["sha256:as-saved"]
    st = lib.stat()
    os.utime(lib, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # touched: its identity changes
    graph_env._DIGESTS.clear()
    assert graph_env.trust_saved_digests([claimed]) == 0
    real = "sha256:" + hashlib.sha256(lib.read_bytes()).hexdigest()
    assert [x.digest for x in kernel_libraries(str(maps))] == [real]
    elsewhere = msgspec.structs.replace(claimed, path=str(tmp_path / "absent.so"))
    assert graph_env.trust_saved_digests([elsewhere, msgspec.structs.replace(claimed, stat=[])]) == 0


def test_kernel_libraries_are_the_mapped_objects_with_a_fatbin(tmp_path):
    lib, plain = tmp_path / "libkernels.so.1", tmp_path / "libplain.so"
    lib.write_bytes(_elf([b".text", b".nv_fatbin"]))
    plain.write_bytes(_elf([b".text", b".data"]))
    maps = tmp_path / "maps"
    maps.write_text(
        f"7f00-7f10 r-xp 00000000 08:01 1 {lib}\n7f10-7f20 r--p 00000000 08:01 1 {lib}\n"
        f"7f20-7f30 r-xp 00000000 08:01 2 {plain}\n7f30-7f40 rw-p 00000000 00:00 0 \n"
    )
    got = kernel_libraries(str(maps))
    assert [(x.name, x.size) for x in got] == [("libkernels.so.1", lib.stat().st_size)]
    import hashlib

    assert got[0].digest == "sha256:" + hashlib.sha256(lib.read_bytes()).hexdigest()
    assert kernel_libraries(str(tmp_path / "absent")) == []


def test_a_library_rewritten_after_its_hashing_is_recorded_with_the_identity_it_was_hashed_at(tmp_path, monkeypatch):
    """The save records each library's identity beside its digest, and a restore that finds that
    identity takes the digest unhashed: the identity must be the one the bytes hashed had. A
    library rewritten between its hashing and the record would otherwise be recorded with its
    new identity and its old digest, and a restore would trust the old digest for the new bytes."""
    import hashlib
    import os

    from capture_plan.executor import graph_env

    lib = tmp_path / "libkernels.so.1"
    lib.write_bytes(_elf([b".text", b".nv_fatbin"]))
    maps = tmp_path / "maps"
    maps.write_text(f"7f00-7f10 r-xp 00000000 08:01 1 {lib}\n")
    hashed = "sha256:" + hashlib.sha256(lib.read_bytes()).hexdigest()
    identity, calls = graph_env.file_identity, []

    def rewritten_after_the_first_look(path):  # a package upgrade writing the file while the save runs
        calls.append(path)
        if len(calls) == 2:
            data = bytearray(lib.read_bytes())
            data[-1] ^= 0xFF
            lib.write_bytes(bytes(data))
            st = lib.stat()
            os.utime(lib, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        return identity(path)

    graph_env._DIGESTS.clear()
    monkeypatch.setattr(graph_env, "file_identity", rewritten_after_the_first_look)
    (saved,) = kernel_libraries(str(maps))
    monkeypatch.setattr(graph_env, "file_identity", identity)
    assert saved.digest == hashed
    graph_env._DIGESTS.clear()
    graph_env.trust_saved_digests([saved])  # a restore: trusted only at the identity the digest was taken at
    assert [x.digest for x in kernel_libraries(str(maps))] == ["sha256:" + hashlib.sha256(lib.read_bytes()).hexdigest()]
