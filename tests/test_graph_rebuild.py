"""Rebuilding a graph file's graphs on the CPU: a fake driver records every node the rebuild
adds, with the arguments patched from the file's relocations at other addresses than the
saving process's, the launch attributes set and read back, the edges with their data, and
every refusal naming its graph and node before any driver call (issue 51, phase 2). The
same code on a real GPU, replays compared bit for bit: tests/test_gpu_restore.py."""

from __future__ import annotations

import ctypes
import struct

import msgspec
import pytest

pytest.importorskip("torch")  # the executor imports torch

from capture_plan.executor import ExecutorError
from capture_plan.executor.graph_rebuild import (
    module_handles,
    patched_args,
    rebuild_graphs,
    rebuild_refusals,
    segment_bases,
)
from capture_plan.executor.libcuda import EdgeData
from test_graph_file import FUNC, LAYOUT, MODULE, FakeDriver, _ws_file

#: where the rebuilding process has the pool's segment, the tensor and cuBLAS's workspace
NEW_POOL, NEW_TENSOR, NEW_WS = 0x9000_0000_0000, 0x9100_0000_0000, 0x9200_0000_0000
#: the fake kernel without its CUtensorMap-shaped parameter
PLAIN = LAYOUT[:3]


class RebuildDriver(FakeDriver):
    """The walk's fake plus the rebuild's calls, recording what is added. ``ignore_set``: the
    driver answers 0 to a launch attribute it does not keep; ``by_name``: cuModuleGetFunction
    finds the kernel by name (else the rebuild falls back to the module's functions)."""

    def __init__(self, ignore_set: bool = False, by_name: bool = True, **kw):
        super().__init__(layout=PLAIN, **kw)
        self.ignore_set, self.by_name = ignore_set, by_name
        self.nodes: dict[int, dict] = {}
        self.edges: list[tuple] = []
        self.graphs: list[int] = []

    def _node(self, out, graph, **what) -> None:
        h = 0x5000 + len(self.nodes)
        self.nodes[h] = {"graph": graph.value, **what}
        out._obj.value = h

    def cuCtxGetCurrent(self, out):
        out._obj.value = 0xC7

    def cuGraphCreate(self, out, flags):
        out._obj.value = 0x4000 + len(self.graphs)
        self.graphs.append(out._obj.value)

    def cuModuleGetFunction(self, out, mod, name):
        if not self.by_name or (mod.value, name) != (MODULE, b"gemm_kernel"):
            return 500  # CUDA_ERROR_NOT_FOUND
        out._obj.value = FUNC

    def cuFuncGetAttribute(self, out, attr, func):
        out._obj.value = 48 << 10 if attr == 8 else 0  # a fresh load's dynamic shared memory limit

    def cuGraphAddKernelNode_v2(self, out, graph, deps, n, p):
        p = p._obj
        ptrs = ctypes.cast(p.kernelParams, ctypes.POINTER(ctypes.c_void_p))
        args = bytearray(max(off + size for off, size in self.layout))
        for i, (off, size) in enumerate(self.layout):
            args[off : off + size] = ctypes.string_at(ptrs[i], size)
        grid = (p.gridDimX, p.gridDimY, p.gridDimZ)
        self._node(out, graph, type="kernel", func=p.func, grid=grid, args=bytes(args))
        self.nodes[out._obj.value]["attrs"] = {}

    def cuGraphKernelNodeGetAttribute(self, node, aid, buf):
        if node.value not in self.nodes:
            return super().cuGraphKernelNodeGetAttribute(node, aid, buf)
        out = ctypes.cast(buf, ctypes.POINTER(ctypes.c_uint))
        out[0], out[1], out[2] = self.nodes[node.value]["attrs"].get(aid, (0, 0, 0))

    def cuGraphKernelNodeSetAttribute(self, node, aid, val):
        if not self.ignore_set:
            v = ctypes.cast(val, ctypes.POINTER(ctypes.c_uint))
            self.nodes[node.value]["attrs"][aid] = (v[0], v[1], v[2])

    def cuGraphAddMemsetNode(self, out, graph, deps, n, p, ctx):
        self._node(out, graph, type="memset", dst=p._obj.dst, width=p._obj.width, ctx=ctx.value)

    def cuGraphAddMemcpyNode(self, out, graph, deps, n, p, ctx):
        c = p._obj
        self._node(out, graph, type="memcpy", src=c.srcDevice, dst=c.dstDevice, width=c.WidthInBytes)

    def cuGraphAddEmptyNode(self, out, graph, deps, n):
        self._node(out, graph, type="empty")

    def cuGraphAddDependencies_v2(self, graph, src, dst, data, n):
        s, d = (ctypes.cast(a, ctypes.POINTER(ctypes.c_void_p)) for a in (src, dst))
        e = ctypes.cast(data, ctypes.POINTER(EdgeData))
        order = list(self.nodes)
        for i in range(n):
            ends = (order.index(s[i]), order.index(d[i]))
            self.edges.append(ends + ((e[i].from_port, e[i].to_port, e[i].type) if e[i].type else ()))


def _plain_file():
    """The fake graph saved without its CUtensorMap-shaped parameter, an address in cuBLAS's workspace."""
    return _ws_file(driver=RebuildDriver())


BASES = [NEW_POOL, NEW_TENSOR, NEW_WS]


def test_the_bases_are_each_segments_address_here():
    f = _plain_file()
    assert [s.name for s in f.segments] == ["pool:shared/0", "tensor:model.w", "workspace:capture/0"]
    got = segment_bases(f, {"shared": [NEW_POOL]}, {"model.w": NEW_TENSOR}, {"capture/0": NEW_WS})
    assert got == BASES
    assert segment_bases(f, {}, {}, {}) == [None, None, None]
    torch_seg = msgspec.structs.replace(f.segments[2], kind="torch", name="torch:0")
    moved = msgspec.structs.replace(f, segments=[*f.segments[:2], torch_seg])
    assert segment_bases(moved, {"shared": [NEW_POOL]}, {"model.w": NEW_TENSOR}, {"": NEW_WS})[2] is None


def test_a_kernels_arguments_are_patched_at_the_new_addresses():
    k = _plain_file().graphs[0].nodes[0].kernel
    assert k is not None
    args = patched_args(k, BASES)
    assert struct.unpack_from("<Q", args, 0)[0] == NEW_POOL + 0x40
    assert struct.unpack_from("<iI", args, 8)[0] == 7
    assert struct.unpack_from("<QQQ", args, 16) == (NEW_TENSOR + 8, 7, NEW_WS + 0x80)
    with pytest.raises(ExecutorError, match="segment 2, which has no address here"):
        patched_args(k, [NEW_POOL, NEW_TENSOR, None])


def test_every_node_is_rebuilt_at_the_new_addresses_with_its_attributes_and_edges():
    d = RebuildDriver()
    f = _plain_file()
    out = rebuild_graphs(f, BASES, [MODULE], 0x5, d)
    assert list(out.execs) == [("decode", 8)] and out.nodes == 4 and out.seconds >= 0
    kernel, memset, copy, empty = d.nodes.values()
    assert (kernel["type"], kernel["func"], kernel["grid"]) == ("kernel", FUNC, (132, 1, 1))
    assert kernel["args"] == patched_args(f.graphs[0].nodes[0].kernel, BASES)  # pyright: ignore[reportArgumentType]
    assert kernel["attrs"] == {4: (2, 0, 0)}  # the cluster dimension, set and read back
    assert (memset["dst"], memset["width"], memset["ctx"]) == (NEW_POOL + 0x100, 64, 0xC7)
    assert (copy["src"], copy["dst"], copy["width"]) == (NEW_TENSOR + 16, NEW_POOL + 0x200, 256)
    assert empty["type"] == "empty"
    assert d.edges == [(0, 1), (1, 2), (3, 2, 1, 0, 1)]  # the PDL edge keeps its data
    assert d.made == ["exec", "upload", "sync"]
    out.destroy()
    assert d.made[3:] == ["exec destroy", "clone destroy"] and out.execs == {}


def test_a_kernel_the_lookup_by_name_misses_is_found_among_its_modules_functions():
    d = RebuildDriver(by_name=False)
    rebuild_graphs(_plain_file(), BASES, [MODULE], 0x5, d)
    assert next(iter(d.nodes.values()))["func"] == FUNC


def test_a_module_not_loaded_here_is_refused_naming_the_kernel_and_what_was_made_is_destroyed():
    d = RebuildDriver()
    with pytest.raises(ExecutorError, match=r"graph decode/8 node 0: kernel gemm_kernel: no module with .*\(sha256:"):
        rebuild_graphs(_plain_file(), BASES, [None], 0x5, d)
    assert d.made == ["clone destroy"]  # the graph begun, destroyed


def test_an_attribute_that_does_not_read_back_as_saved_is_refused():
    """Set and not kept (a driver that ignores it): the rebuilt graph would launch otherwise."""
    d = RebuildDriver(ignore_set=True)
    with pytest.raises(ExecutorError, match=r"node 0 \(kernel gemm_kernel\).*cluster_dimension saved as \(2, 0, 0\)"):
        rebuild_graphs(_plain_file(), BASES, [MODULE], 0x5, d)


def test_a_failing_driver_call_names_the_node():
    d = RebuildDriver(rc={"cuGraphAddMemsetNode": 700})
    with pytest.raises(ExecutorError, match=r"graph decode/8 node 1: cuGraphAddMemsetNode failed \(CUresult 700\)"):
        rebuild_graphs(_plain_file(), BASES, [MODULE], 0x5, d)


def test_what_a_rebuild_cannot_make_exactly_is_refused_by_node_before_any_driver_call():
    tma = _ws_file(driver=FakeDriver())  # the fake kernel's fourth parameter is shaped like a CUtensorMap
    g = tma.graphs[0]
    odd = msgspec.structs.replace(g.nodes[3], type="event_record")
    k = g.nodes[0].kernel
    assert k is not None
    unknown = msgspec.structs.replace(k, attributes={**k.attributes, "access_policy_window": (1, 2, 3)})
    nodes = [msgspec.structs.replace(g.nodes[0], kernel=unknown), *g.nodes[1:3], odd]
    f = msgspec.structs.replace(tma, graphs=[msgspec.structs.replace(g, nodes=nodes)])
    got = rebuild_refusals(f)
    assert got == [
        "graph decode/8 node 0 (kernel gemm_kernel): parameter(s) [3] are shaped like a CUtensorMap, whose encoded "
        "address a rebuild does not re-encode",
        "graph decode/8 node 0 (kernel gemm_kernel): launch attribute(s) ['access_policy_window'] this rebuild "
        "does not set",
        "graph decode/8 node 3: a event_record node cannot be rebuilt (kinds rebuilt: kernel, memset, memcpy, empty)",
    ]
    d = RebuildDriver()
    with pytest.raises(ExecutorError, match=r"cannot be rebuilt: graph decode/8 node 0 .*CUtensorMap.* \(and 2 more\)"):
        rebuild_graphs(f, BASES, [MODULE], 0x5, d)
    assert d.nodes == {} and d.graphs == [] and d.made == []
    assert rebuild_refusals(_plain_file()) == []


def test_modules_are_matched_by_identity_in_the_order_met():
    d = RebuildDriver()
    f = _plain_file()
    assert module_handles(f, [MODULE, MODULE], d) == [MODULE]
    assert module_handles(f, [], d) == [None]
    twice = msgspec.structs.replace(f, modules=[f.modules[0], f.modules[0]])  # two modules, the same names
    assert module_handles(twice, [MODULE, MODULE + 1], d) == [MODULE, MODULE + 1]
    # one of them loaded here: the other is not matched to it (review: it ran the other build's binary)
    assert module_handles(twice, [MODULE], d) == [MODULE, None]


def test_twins_are_matched_by_their_functions_fixed_attributes_not_by_the_order_met():
    """Two builds of one kernel share their function names, so their modules share an identity;
    a restore's runs may meet them in another order than the save's walk did (review: the
    order alone would run the other build's binary)."""
    d = RebuildDriver()
    f = _plain_file()
    twice = msgspec.structs.replace(f, modules=[f.modules[0], f.modules[0]])
    met = [MODULE + 1, MODULE]  # the restore met the file's second module first
    assert module_handles(twice, met, d) == [MODULE + 1, MODULE]  # by order: swapped
    which = {0: MODULE, 1: MODULE + 1}
    assert module_handles(twice, met, d, lambda m, h: which[m] == h) == [MODULE, MODULE + 1]
    # a module whose twin check fails everywhere is not matched: its kernels are sought or refused
    assert module_handles(twice, met, d, lambda m, h: m == 0 and h == MODULE) == [MODULE, None]


def test_the_twin_check_compares_a_modules_functions_fixed_attributes():

    from capture_plan.executor.kernel_loading import FIXED_ATTRIBUTES, twin_check
    from capture_plan.schemas.graph_file import Function

    regs = {0x61: 32, 0x62: 64}  # per function here: its registers
    by_module = {0xA: 0x61, 0xB: 0x62}

    def get_function(out, mod, name):
        if name != b"k" or mod.value not in by_module:
            return 500
        out._obj.value = by_module[mod.value]
        return 0

    def get_attribute(out, attr, func):
        out._obj.value = regs[func.value] if attr == FIXED_ATTRIBUTES["num_regs"] else 0
        return 0

    calls = {"cuModuleGetFunction": get_function, "cuFuncGetAttribute": get_attribute}
    fixed = dict.fromkeys(FIXED_ATTRIBUTES, 0)
    f = msgspec.structs.replace(
        _plain_file(),
        functions=[
            Function(module=0, name="k", fixed={**fixed, "num_regs": 64}),
            Function(module=1, name="k", fixed={**fixed, "num_regs": 32}),
        ],
    )
    check = twin_check(f, calls)
    assert (check(0, 0xB), check(0, 0xA), check(1, 0xA), check(1, 0xB)) == (True, False, True, False)
    assert twin_check(msgspec.structs.replace(f, functions=[]), calls)(0, 0xA)  # no record: no objection


def test_an_output_is_read_where_the_copies_hold_it():
    """compare_moved reads each output from its segment's copy: same offset, shape and strides."""
    import torch

    from capture_plan.executor.rebuild_proof import _Copies

    original = torch.arange(64, dtype=torch.float32)
    out = original[8:40].view(4, 8)[:, ::2]  # not contiguous
    copies = object.__new__(_Copies)
    copy = torch.zeros(64 * 4 + 8192, dtype=torch.uint8)
    new = (copy.data_ptr() + 4095) // 4096 * 4096
    copies.spans, copies.buffers = {0: (original.data_ptr(), new, 64 * 4)}, [copy]
    assert copies.bases(2) == [new, None]
    at = new - copy.data_ptr()
    copy[at : at + 256] = original.view(torch.uint8)
    moved = copies.moved(out)
    assert moved is not None and moved.data_ptr() == new + 8 * 4 and moved.stride() == out.stride()
    assert torch.equal(moved, out)
    assert copies.moved(torch.zeros(4)) is None  # in no copied segment


# -- where a TMA descriptor keeps its address -----------------------------------------------


def _encoder(layout):
    """A fake cuTensorMapEncodeTiled writing ``layout(address)`` (16 words)."""

    def encode(desc, dtype, rank, address, dims, strides, box, steps, *modes):
        out = ctypes.cast(desc, ctypes.POINTER(ctypes.c_uint64))
        for i, w in enumerate(layout(address.value)):
            out[i] = w
        return 0

    return {"cuTensorMapEncodeTiled": encode}


@pytest.mark.parametrize(
    "layout, words, plain",
    [
        (lambda a: [a, *[7] * 15], [0], True),  # the address as word 0, nothing else depends on it
        (lambda a: [a, a >> 4, *[7] * 14], [0, 1], False),  # and again, shifted: a relocation must re-encode
        (lambda a: [a >> 4, *[7] * 15], [0], False),  # only encoded
    ],
)
def test_the_tensor_map_probe_says_which_words_hold_the_address(layout, words, plain):
    from capture_plan.executor.tensor_map_probe import probe_tensor_map

    got = probe_tensor_map(_encoder(layout))
    assert got.address_words == words and got.plain is plain
    assert got.as_dict()["plain"] is plain and set(got.values) == set(words)


def test_a_refused_encoding_is_an_error():
    from capture_plan.executor.tensor_map_probe import probe_tensor_map

    with pytest.raises(ExecutorError, match=r"cuTensorMapEncodeTiled failed \(CUresult 1\)"):
        probe_tensor_map({"cuTensorMapEncodeTiled": lambda *a: 1})


def test_a_functions_default_attributes_are_read_once():
    """A saved value a new node of the function reads back already costs no call after the first."""
    f = _plain_file()
    g = f.graphs[0]
    k = g.nodes[0].kernel
    assert k is not None
    plain = msgspec.structs.replace(k, attributes={"cluster_dimension": (0, 0, 0)})
    g = msgspec.structs.replace(g, nodes=[msgspec.structs.replace(g.nodes[0], kernel=plain), *g.nodes[1:]])
    two = msgspec.structs.replace(f, graphs=[g, msgspec.structs.replace(g, bs=16)])
    d, reads = RebuildDriver(), []
    get = d["cuGraphKernelNodeGetAttribute"]
    d["cuGraphKernelNodeGetAttribute"] = lambda node, aid, buf: reads.append(node.value) or get(node, aid, buf)
    out = rebuild_graphs(two, BASES, [MODULE], 0x5, d)
    assert len(out.execs) == 2 and len(reads) == 1
    assert [n["attrs"] for n in d.nodes.values() if n["type"] == "kernel"] == [{}, {}]  # nothing set
