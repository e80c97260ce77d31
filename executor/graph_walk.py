"""A recorded CUDA graph read node by node through the driver: what a graph file and the restore probe need.

:func:`walk_graph` reads a ``cudaGraph_t`` (``CUDAGraph.raw_cuda_graph()`` of a graph recorded
with ``keep_graph=True``): every node's type; per kernel node its function
(``cuGraphKernelNodeGetParams_v2``; a node recorded from a library's ``CUkernel`` is turned
into the context's function with ``cuKernelGetFunction``), name (``cuFuncGetName``), module
(``cuFuncGetModule``), parameter layout (``cuFuncGetParamInfo`` for index 0, 1, ... until
the driver answers CUDA_ERROR_INVALID_VALUE), argument bytes, grid, block, shared memory and
the launch attributes it reads back; per memset and copy node its operands; the edges with
their data. :func:`device_addresses` finds the device addresses in argument bytes
(``cuMemGetAddressRange_v2``). The driver calls come from ``capture_plan.executor.libcuda``
(or a test's fakes, passed as ``calls``); the node types and launch attributes are
``exec_update``'s tables.

Constraints: a structural call that fails (nodes, types, a kernel's or memset's or copy's
parameters, edges) raises an :class:`ExecutorError` naming the call, its CUresult and the
node; a kernel whose name, module or parameter layout the driver does not give is walked
with that CUresult recorded (``name_rc``, ``module_rc``, ``params_rc``): the probe counts
them, a graph file refuses them. Only 8-byte words at 8-byte aligned offsets inside one
parameter are read as addresses (a pointer in a parameter struct is 8-byte aligned).
"""

from __future__ import annotations

import ctypes
import hashlib
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field

from . import libcuda
from .errors import ExecutorError
from .exec_update import ATTRIBUTES, NODE_TYPES, graph_edges
from .libcuda import KernelParams, Memcpy3D, MemsetParams

__all__ = [
    "WALK_CALLS",
    "driver_calls",
    "KernelNode",
    "MemsetNode",
    "CopyNode",
    "WalkedNode",
    "WalkedGraph",
    "FunctionCache",
    "walk_graph",
    "device_addresses",
    "tensor_map_params",
    "AddressResolver",
    "module_identity",
]

#: every call the walk makes
WALK_CALLS = (
    "cuGraphGetNodes",
    "cuGraphGetEdges_v2",
    "cuGraphNodeGetType",
    "cuGraphKernelNodeGetParams_v2",
    "cuGraphKernelNodeGetAttribute",
    "cuGraphMemsetNodeGetParams",
    "cuGraphMemcpyNodeGetParams",
    "cuKernelGetFunction",
    "cuFuncGetName",
    "cuFuncGetParamInfo",
    "cuFuncGetModule",
    "cuModuleGetFunctionCount",
    "cuModuleEnumerateFunctions",
    "cuMemGetAddressRange_v2",
)

#: CUDA_ERROR_INVALID_VALUE: cuFuncGetParamInfo's answer past the last parameter
_INVALID_VALUE = 1
#: CU_LAUNCH_PARAM_END, _BUFFER_POINTER, _BUFFER_SIZE: the ``extra`` array's markers
_PARAM_END, _BUFFER_POINTER, _BUFFER_SIZE = 0, 1, 2
#: CUmemorytype of a copy's side
MEMORY_TYPES = {1: "host", 2: "device", 3: "array", 4: "unified"}
#: words below this are never taken for addresses (no driver maps the first 64 KiB)
MIN_ADDRESS = 1 << 16
#: a CUtensorMap: 128 bytes, 64-byte aligned (cuda.h: CU_TENSOR_MAP_NUM_QWORDS 16, alignas(64))
TENSOR_MAP_BYTES, TENSOR_MAP_ALIGN = 128, 64


def driver_calls() -> dict:
    """The walk's driver calls (:data:`WALK_CALLS`); an ExecutorError saying which is missing."""
    got = libcuda.calls(*WALK_CALLS)
    if isinstance(got, str):
        raise ExecutorError(
            f"the graph walk cannot run: {got}",
            where="graph walk",
            fix="run on a machine with the NVIDIA driver 12.4 or newer (cuFuncGetParamInfo)",
        )
    return got


def _check(rc: int, call: str, where: str) -> None:
    if rc != 0:
        raise ExecutorError(f"{call} failed (CUresult {rc})", where=where)


@dataclass
class KernelNode:
    function: int
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int
    name: str = ""
    module: int = 0
    #: (offset, size) per parameter; empty where params_rc is not 0
    params: list[tuple[int, int]] = field(default_factory=list)
    #: the parameters' bytes at their offsets
    args: bytes = b""
    attributes: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    #: CUresults of what could not be read (0: read)
    name_rc: int = 0
    module_rc: int = 0
    params_rc: int = 0


@dataclass
class MemsetNode:
    dst: int
    pitch: int
    value: int
    element_size: int
    width: int
    height: int


@dataclass
class CopyNode:
    #: "host", "device", "array", "unified" (MEMORY_TYPES)
    src_type: str
    src: int
    dst_type: str
    dst: int
    src_pitch: int
    src_height: int
    dst_pitch: int
    dst_height: int
    width: int
    height: int
    depth: int
    #: a Y, Z or LOD offset on either side: the operand's address is not base + X alone
    offset_beyond_x: bool = False


@dataclass
class WalkedNode:
    type: str
    kernel: KernelNode | None = None
    memset: MemsetNode | None = None
    copy: CopyNode | None = None


@dataclass
class WalkedGraph:
    nodes: list[WalkedNode]
    #: (from, to) or (from, to, from_port, to_port, type)
    edges: list[tuple[int, ...]]


def _param_layout(d, func: ctypes.c_void_p) -> tuple[list[tuple[int, int]], int]:
    """(offset, size) of each parameter of ``func`` and 0, or what was read and the CUresult
    that was not CUDA_ERROR_INVALID_VALUE past the last."""
    layout: list[tuple[int, int]] = []
    while True:
        off, size = ctypes.c_size_t(0), ctypes.c_size_t(0)
        rc = d["cuFuncGetParamInfo"](func, len(layout), ctypes.byref(off), ctypes.byref(size))
        if rc == _INVALID_VALUE:
            return layout, 0
        if rc != 0:
            return layout, rc
        layout.append((off.value, size.value))


def _arg_bytes(p: KernelParams, layout: list[tuple[int, int]], where: str) -> bytes:
    """The parameters' bytes at their offsets, from ``kernelParams`` (one pointer per
    parameter) or, where it is null, ``extra``'s buffer."""
    end = max((o + s for o, s in layout), default=0)
    buf = bytearray(end)
    if p.kernelParams:
        ptrs = ctypes.cast(p.kernelParams, ctypes.POINTER(ctypes.c_void_p))
        for i, (off, size) in enumerate(layout):
            if not ptrs[i]:
                raise ExecutorError(f"kernel parameter {i} has a null pointer", where=where)
            buf[off : off + size] = ctypes.string_at(ptrs[i], size)
        return bytes(buf)
    if not p.extra:
        if end:
            raise ExecutorError("a kernel node with parameters has neither kernelParams nor extra", where=where)
        return b""
    extra = ctypes.cast(p.extra, ctypes.POINTER(ctypes.c_void_p))
    data, size, i = None, None, 0
    while (extra[i] or 0) != _PARAM_END:
        if extra[i] == _BUFFER_POINTER:
            data = extra[i + 1]
        elif extra[i] == _BUFFER_SIZE:
            size = ctypes.cast(extra[i + 1], ctypes.POINTER(ctypes.c_size_t))[0]
        i += 2
    if data is None or size is None or size < end:
        raise ExecutorError(f"a kernel node's extra buffer is missing or shorter than its {end} B", where=where)
    return ctypes.string_at(data, end)


class FunctionCache(dict):
    """Per function handle what the walk reads of it (name, module, parameter layout and
    their CUresults): the same kernel runs in many nodes of many graphs (every layer, every
    size), so a walk shared across graphs asks the driver once per function."""


def _function(d, func: ctypes.c_void_p, cache: FunctionCache) -> tuple:
    key = func.value or 0
    got = cache.get(key)
    if got is None:
        name = ctypes.c_char_p()
        name_rc = d["cuFuncGetName"](ctypes.byref(name), func)
        text = (name.value or b"").decode(errors="replace") if name_rc == 0 else ""
        mod = ctypes.c_void_p()
        module_rc = d["cuFuncGetModule"](ctypes.byref(mod), func)
        params, params_rc = _param_layout(d, func)
        got = cache[key] = (text, name_rc, (mod.value or 0) if module_rc == 0 else 0, module_rc, params, params_rc)
    return got


def _kernel(d, node: ctypes.c_void_p, where: str, cache: FunctionCache) -> KernelNode:
    p = KernelParams()
    _check(d["cuGraphKernelNodeGetParams_v2"](node, ctypes.byref(p)), "cuGraphKernelNodeGetParams_v2", where)
    func = ctypes.c_void_p(p.func)
    if not p.func:
        if not p.kern:
            raise ExecutorError("a kernel node with neither a function nor a kernel", where=where)
        _check(d["cuKernelGetFunction"](ctypes.byref(func), ctypes.c_void_p(p.kern)), "cuKernelGetFunction", where)
    k = KernelNode(
        function=func.value or 0,
        grid=(p.gridDimX, p.gridDimY, p.gridDimZ),
        block=(p.blockDimX, p.blockDimY, p.blockDimZ),
        shared_bytes=p.sharedMemBytes,
    )
    k.name, k.name_rc, k.module, k.module_rc, params, k.params_rc = _function(d, func, cache)
    k.params = list(params)
    if k.params_rc == 0:
        k.args = _arg_bytes(p, k.params, where)
    for attr, aid in ATTRIBUTES.items():
        buf = (ctypes.c_uint * 16)()
        if d["cuGraphKernelNodeGetAttribute"](node, aid, ctypes.cast(buf, ctypes.c_void_p)) == 0:
            k.attributes[attr] = (buf[0], buf[1], buf[2])
    return k


def _memset(d, node: ctypes.c_void_p, where: str) -> MemsetNode:
    m = MemsetParams()
    _check(d["cuGraphMemsetNodeGetParams"](node, ctypes.byref(m)), "cuGraphMemsetNodeGetParams", where)
    return MemsetNode(m.dst, m.pitch, m.value, m.elementSize, m.width, m.height)


def _copy(d, node: ctypes.c_void_p, where: str) -> CopyNode:
    c = Memcpy3D()
    _check(d["cuGraphMemcpyNodeGetParams"](node, ctypes.byref(c)), "cuGraphMemcpyNodeGetParams", where)

    def side(kind: int, host: int | None, dev: int) -> tuple[str, int]:
        t = MEMORY_TYPES.get(kind, f"type-{kind}")
        return t, (host or 0) if t == "host" else dev

    st, src = side(c.srcMemoryType, c.srcHost, c.srcDevice)
    dt, dst = side(c.dstMemoryType, c.dstHost, c.dstDevice)
    return CopyNode(
        st,
        src + c.srcXInBytes,
        dt,
        dst + c.dstXInBytes,
        c.srcPitch,
        c.srcHeight,
        c.dstPitch,
        c.dstHeight,
        c.WidthInBytes,
        c.Height,
        c.Depth,
        any((c.srcY, c.srcZ, c.srcLOD, c.dstY, c.dstZ, c.dstLOD)),
    )


def walk_graph(
    raw_graph: int, calls: dict | None = None, where: str = "graph", cache: FunctionCache | None = None
) -> WalkedGraph:
    """Every node and edge of the ``cudaGraph_t`` ``raw_graph`` (module docstring). ``calls``:
    the driver calls (default :func:`driver_calls`); ``where`` names the graph in errors;
    ``cache``: what was read of each function, shared by the walks of one process's graphs."""
    d = driver_calls() if calls is None else calls
    cache = FunctionCache() if cache is None else cache
    g = ctypes.c_void_p(raw_graph)
    n = ctypes.c_size_t(0)
    _check(d["cuGraphGetNodes"](g, None, ctypes.byref(n)), "cuGraphGetNodes", where)
    handles = (ctypes.c_void_p * n.value)()
    _check(d["cuGraphGetNodes"](g, ctypes.cast(handles, ctypes.c_void_p), ctypes.byref(n)), "cuGraphGetNodes", where)
    nodes = []
    for i in range(n.value):
        node, here = ctypes.c_void_p(handles[i]), f"{where}, node {i}"
        t = ctypes.c_int(-1)
        _check(d["cuGraphNodeGetType"](node, ctypes.byref(t)), "cuGraphNodeGetType", here)
        kind = NODE_TYPES.get(t.value, f"type-{t.value}")
        w = WalkedNode(kind)
        if kind == "kernel":
            w.kernel = _kernel(d, node, here, cache)
        elif kind == "memset":
            w.memset = _memset(d, node, here)
        elif kind == "memcpy":
            w.copy = _copy(d, node, here)
        nodes.append(w)
    return WalkedGraph(nodes, graph_edges(d, g, {handles[i]: i for i in range(n.value)}, where))


class AddressResolver:
    """Whether a value is a device address (``cuMemGetAddressRange_v2`` succeeds), and the
    allocation's (base, size) where it is; answers cached per value. ``known``: segments
    (sorted, with ``address`` and ``size``: the caching allocator's) answered without the
    driver: a value inside one is an address of that segment (an allocation of its own)."""

    def __init__(self, calls: dict | None = None, known: list | None = None):
        self._range = (driver_calls() if calls is None else calls)["cuMemGetAddressRange_v2"]
        self._seen: dict[int, tuple[int, int] | None] = {}
        self._known = known or []
        self._starts = [s.address for s in self._known]

    def __call__(self, value: int) -> tuple[int, int] | None:
        if value in self._seen:
            return self._seen[value]
        i = bisect_right(self._starts, value) - 1
        if i >= 0 and value < self._starts[i] + self._known[i].size:
            got = self._seen[value] = (self._starts[i], self._known[i].size)
            return got
        base, size = ctypes.c_ulonglong(0), ctypes.c_size_t(0)
        rc = self._range(ctypes.byref(base), ctypes.byref(size), ctypes.c_ulonglong(value))
        got = (base.value, size.value) if rc == 0 else None
        self._seen[value] = got
        return got


def device_addresses(
    args: bytes, params: list[tuple[int, int]], resolve: Callable[[int], object]
) -> list[tuple[int, int]]:
    """(byte position, value) of every 8-byte word of ``args`` inside one parameter, at an
    8-byte aligned position, that ``resolve`` takes for a device address (truthy), in order."""
    found = []
    words = memoryview(args[: len(args) // 8 * 8]).cast("Q")  # the 8-byte aligned words, little-endian (x86, arm64)
    for off, size in params:
        for i in range((off + 7) // 8, (off + size) // 8):
            v = words[i]
            if v >= MIN_ADDRESS and resolve(v):
                found.append((i * 8, v))
    return found


def tensor_map_params(params: list[tuple[int, int]]) -> list[int]:
    """Indexes of parameters shaped like a CUtensorMap: 128 bytes at a 64-byte aligned
    offset (a descriptor inside a larger parameter struct is not seen)."""
    return [i for i, (off, size) in enumerate(params) if size == TENSOR_MAP_BYTES and off % TENSOR_MAP_ALIGN == 0]


def module_identity(module: int, calls: dict | None = None, where: str = "module") -> tuple[str, int]:
    """("sha256:<hex>" of the sorted names of ``module``'s functions, one a line; their
    count): the same cubin loaded in another process has the same identity. An
    ExecutorError where the driver does not enumerate them."""
    d = driver_calls() if calls is None else calls
    mod = ctypes.c_void_p(module)
    count = ctypes.c_uint(0)
    _check(d["cuModuleGetFunctionCount"](ctypes.byref(count), mod), "cuModuleGetFunctionCount", where)
    funcs = (ctypes.c_void_p * count.value)()
    rc = d["cuModuleEnumerateFunctions"](ctypes.cast(funcs, ctypes.c_void_p), count.value, mod)
    _check(rc, "cuModuleEnumerateFunctions", where)
    names = []
    for f in funcs:
        name = ctypes.c_char_p()
        _check(d["cuFuncGetName"](ctypes.byref(name), ctypes.c_void_p(f)), "cuFuncGetName", where)
        names.append((name.value or b"").decode(errors="replace"))
    text = "\n".join(sorted(names)).encode()
    return "sha256:" + hashlib.sha256(text).hexdigest(), count.value
