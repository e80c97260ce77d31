# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""The compiled graph builder: a rebuilt graph's nodes, launch attributes and edges added through the driver, in C.

``capture_plan.executor.graph_rebuild`` adds a graph file's nodes one driver call at a time;
through ctypes each call costs tens of microseconds of Python. Here the same calls are made
from C over flat arrays that ``capture_plan.executor.graph_flat.flatten`` prepares once per
graph (its docstring lays the records out), through function pointers handed in as integers:
the addresses of libcuda's own entry points (ctypes finds them), so the build needs neither
CUDA's headers nor its toolkit. The structures the calls take are declared below from the
CUDA driver API (cuda.h) and must match executor/libcuda.py's ctypes structures byte for byte:
:func:`layouts` gives each one's size and its fields' offsets, and tests/test_graph_build.py
compares them. The ctypes path is the reference: the same test drives both over the same files
through C-callable fakes and compares every call and every byte it received.

An optional extension (setup.py): where it is not built, the ctypes path runs
(``graph_flat.graph_builder`` says which and why).
"""

cimport cython
from libc.stdint cimport int64_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcpy, memset

# CUDA_KERNEL_NODE_PARAMS_v2
ctypedef struct KernelParams:
    void* func
    unsigned int gridDimX
    unsigned int gridDimY
    unsigned int gridDimZ
    unsigned int blockDimX
    unsigned int blockDimY
    unsigned int blockDimZ
    unsigned int sharedMemBytes
    void** kernelParams
    void** extra
    void* kern
    void* ctx

# CUDA_MEMSET_NODE_PARAMS
ctypedef struct MemsetParams:
    unsigned long long dst
    size_t pitch
    unsigned int value
    unsigned int elementSize
    size_t width
    size_t height

# CUDA_MEMCPY3D
ctypedef struct Memcpy3D:
    size_t srcXInBytes
    size_t srcY
    size_t srcZ
    size_t srcLOD
    int srcMemoryType
    const void* srcHost
    unsigned long long srcDevice
    void* srcArray
    void* reserved0
    size_t srcPitch
    size_t srcHeight
    size_t dstXInBytes
    size_t dstY
    size_t dstZ
    size_t dstLOD
    int dstMemoryType
    void* dstHost
    unsigned long long dstDevice
    void* dstArray
    void* reserved1
    size_t dstPitch
    size_t dstHeight
    size_t WidthInBytes
    size_t Height
    size_t Depth

# CUgraphEdgeData
ctypedef struct EdgeData:
    unsigned char from_port
    unsigned char to_port
    unsigned char type
    unsigned char reserved[5]

# the driver's entry points: (node out, graph, dependencies, count, params[, CUcontext]) -> CUresult
ctypedef int (*AddKernel)(void**, void*, const void*, size_t, const KernelParams*) noexcept
ctypedef int (*AddMemset)(void**, void*, const void*, size_t, const MemsetParams*, void*) noexcept
ctypedef int (*AddMemcpy)(void**, void*, const void*, size_t, const Memcpy3D*, void*) noexcept
ctypedef int (*AddEmpty)(void**, void*, const void*, size_t) noexcept
# (graph, from, to, edge data, count)
ctypedef int (*AddDeps)(void*, const void*, const void*, const EdgeData*, size_t) noexcept
# (node, CUlaunchAttributeID, CUlaunchAttributeValue: a 64-byte union)
ctypedef int (*GetAttr)(void*, int, void*) noexcept
ctypedef int (*SetAttr)(void*, int, const void*) noexcept

#: the driver calls, in the order :class:`Builder` takes their addresses (graph_flat owns the
#: list: the ctypes path makes the same calls)
from capture_plan.executor.graph_flat import NODE_CALLS as CALLS

cdef enum:
    # node kinds
    KIND_KERNEL = 0
    KIND_MEMSET = 1
    KIND_MEMCPY = 2
    KIND_EMPTY = 3
    # int64 fields per record: kernel, launch attribute, relocation, memset, copy, edge
    KERNEL_W = 16
    ATTR_W = 4
    RELOC_W = 2
    MEMSET_W = 6
    COPY_W = 9
    EDGE_W = 5
    # launch attribute ids below this have a slot in the per-function cache
    ATTRIBUTE_IDS = 16
    # per (function, attribute) cached: known?, CUresult, the three words read back
    SLOT = 5
    # CU_MEMORYTYPE_DEVICE
    DEVICE = 2

#: the record layout graph_flat.flatten writes (it checks these): node kinds, int64 fields per record
KINDS = {"kernel": KIND_KERNEL, "memset": KIND_MEMSET, "memcpy": KIND_MEMCPY, "empty": KIND_EMPTY}
WIDTHS = {"kernel": KERNEL_W, "attribute": ATTR_W, "relocation": RELOC_W, "memset": MEMSET_W, "copy": COPY_W,
          "edge": EDGE_W}
#: launch attribute ids below this are cached per function
MAX_ATTRIBUTE = ATTRIBUTE_IDS


def layouts():
    """Per structure its size and its fields' offsets, as this build lays them out (the ctypes
    structures of executor/libcuda.py must match: tests/test_graph_build.py)."""
    cdef KernelParams k
    cdef MemsetParams m
    cdef Memcpy3D c
    cdef EdgeData e
    cdef char* kb = <char*>&k
    cdef char* mb = <char*>&m
    cdef char* cb = <char*>&c
    cdef char* eb = <char*>&e
    return {
        "KernelParams": (sizeof(KernelParams), {
            "func": <char*>&k.func - kb, "gridDimX": <char*>&k.gridDimX - kb, "gridDimY": <char*>&k.gridDimY - kb,
            "gridDimZ": <char*>&k.gridDimZ - kb, "blockDimX": <char*>&k.blockDimX - kb,
            "blockDimY": <char*>&k.blockDimY - kb, "blockDimZ": <char*>&k.blockDimZ - kb,
            "sharedMemBytes": <char*>&k.sharedMemBytes - kb, "kernelParams": <char*>&k.kernelParams - kb,
            "extra": <char*>&k.extra - kb, "kern": <char*>&k.kern - kb, "ctx": <char*>&k.ctx - kb,
        }),
        "MemsetParams": (sizeof(MemsetParams), {
            "dst": <char*>&m.dst - mb, "pitch": <char*>&m.pitch - mb, "value": <char*>&m.value - mb,
            "elementSize": <char*>&m.elementSize - mb, "width": <char*>&m.width - mb, "height": <char*>&m.height - mb,
        }),
        "Memcpy3D": (sizeof(Memcpy3D), {
            "srcXInBytes": <char*>&c.srcXInBytes - cb, "srcY": <char*>&c.srcY - cb, "srcZ": <char*>&c.srcZ - cb,
            "srcLOD": <char*>&c.srcLOD - cb, "srcMemoryType": <char*>&c.srcMemoryType - cb,
            "srcHost": <char*>&c.srcHost - cb, "srcDevice": <char*>&c.srcDevice - cb,
            "srcArray": <char*>&c.srcArray - cb, "reserved0": <char*>&c.reserved0 - cb,
            "srcPitch": <char*>&c.srcPitch - cb, "srcHeight": <char*>&c.srcHeight - cb,
            "dstXInBytes": <char*>&c.dstXInBytes - cb, "dstY": <char*>&c.dstY - cb, "dstZ": <char*>&c.dstZ - cb,
            "dstLOD": <char*>&c.dstLOD - cb, "dstMemoryType": <char*>&c.dstMemoryType - cb,
            "dstHost": <char*>&c.dstHost - cb, "dstDevice": <char*>&c.dstDevice - cb,
            "dstArray": <char*>&c.dstArray - cb, "reserved1": <char*>&c.reserved1 - cb,
            "dstPitch": <char*>&c.dstPitch - cb, "dstHeight": <char*>&c.dstHeight - cb,
            "WidthInBytes": <char*>&c.WidthInBytes - cb, "Height": <char*>&c.Height - cb,
            "Depth": <char*>&c.Depth - cb,
        }),
        "EdgeData": (sizeof(EdgeData), {
            "from_port": <char*>&e.from_port - eb, "to_port": <char*>&e.to_port - eb, "type": <char*>&e.type - eb,
            "reserved": <char*>&e.reserved - eb,
        }),
    }


#: zero bytes, by count: the padding that aligns each kernel's arguments to 64 bytes
_PADS = tuple(bytes(i) for i in range(64))
#: the largest address a record holds (int64); a larger one is written by ``patched_args``
_MAX = (1 << 63) - 1


@cython.boundscheck(True)
@cython.wraparound(True)
def flatten(g, list bases, function, dict functions, dict index, attribute_ids):
    """Graph ``g`` of a graph file as the records :meth:`Builder.add` takes (graph_flat's
    docstring lays them out), a tuple: kinds, kernels, blob, params, relocs, attrs, memsets,
    copies, edges (int64 arrays but kinds and blob), and per attribute record its name. Every
    address at ``bases`` (``graph_rebuild.segment_bases``); every kernel's function from
    ``functions`` (keyed by (module, name)) or ``function(kernel, where)``
    (``graph_rebuild._Builder.function``, which raises naming the node), numbered by ``index``
    (function -> its number, shared by a builder's graphs); launch attribute ids by
    ``attribute_ids``. An operand in a segment with no address here raises graph_rebuild's
    error naming the node (its own ``patched_args`` and ``_address`` do: the values here are
    the file's Python ints, compared as Python compares them, so what they accept is the same)."""
    from array import array

    from capture_plan.executor.graph_rebuild import _address, _an_edge, bad_edge, outside_args, patched_args

    label = f"graph {g.phase}/{g.bs}"
    cdef list nodes = g.nodes
    cdef Py_ssize_t n = len(nodes), i, nb = len(bases), size = 0, start, mark, first
    cdef bytearray node_kinds = bytearray(n)
    cdef list kernels = [], params = [], relocs = [], attrs = [], memsets = [], copies = [], edges = []
    cdef list names = [], parts = []
    cdef bytes args
    cdef dict looked = {}  # (module, name) -> (function, its number): this graph's kernels
    cdef object big = _MAX, pads = _PADS
    for i in range(n):
        node = nodes[i]
        k = node.kernel
        if k is not None:
            node_kinds[i] = KIND_KERNEL
            args = k.args
            start = (size + 63) & ~63
            if start > size:
                parts.append(pads[start - size])
            parts.append(args)
            mark, end = len(relocs), len(args) - 8
            for r in k.relocations:  # graph_rebuild.patched_args, with the write left to the builder
                pos, seg = r.position, r.segment
                base = bases[seg] if seg < nb else None
                address = None if base is None else base + r.offset
                if base is None or not (0 <= pos <= end and 0 <= address <= big):
                    del relocs[mark:]  # patched_args raises (outside the bytes, no address here), or writes it
                    parts[len(parts) - 1] = args = patched_args(k, bases, f"{label} node {i}")
                    break
                relocs.append(start + pos)
                relocs.append(address)
            j = 0
            for p in k.params:  # refused as the ctypes path refuses them: the driver would read past the bytes
                if p[0] < 0 or p[1] < 0 or p[0] + p[1] > len(args):
                    raise outside_args(k, f"parameter {j} ({p[0]}, {p[1]})", f"{label} node {i}")
                j += 1
            size = start + len(args)
            key = (k.module, k.name)
            got = looked.get(key)
            if got is None:
                f = functions.get(key)
                if f is None:
                    f = function(k, f"{label} node {i}")
                fv = f.value or 0
                fi = index.get(fv)
                if fi is None:
                    fi = index[fv] = len(index)
                got = looked[key] = (fv, fi)
            fv, fi = got
            first = len(names)
            if k.attributes:
                for name, value in sorted(k.attributes.items()):
                    attrs.append(attribute_ids[name])
                    attrs.extend(value)
                    names.append(name)
            grid, block = k.grid, k.block
            kernels.extend((fv, grid[0], grid[1], grid[2], block[0], block[1], block[2], k.shared_bytes, start,
                            len(params), len(k.params), fi, first, len(names) - first, mark // 2,
                            (len(relocs) - mark) // 2))
            for p in k.params:
                params.append(p[0])
        elif node.memset is not None:
            node_kinds[i] = KIND_MEMSET
            m = node.memset
            memsets.extend((_address(m.dst, bases, f"{label} node {i}"), m.pitch, m.value, m.element_size, m.width,
                            m.height))
        elif node.copy is not None:
            node_kinds[i] = KIND_MEMCPY
            c, where = node.copy, f"{label} node {i}"
            copies.extend((_address(c.src, bases, where), _address(c.dst, bases, where), c.src_pitch, c.src_height,
                           c.dst_pitch, c.dst_height, c.width, c.height, c.depth))
        else:
            node_kinds[i] = KIND_EMPTY
    for j, e in enumerate(g.edges):  # refused as the ctypes path refuses them
        if not _an_edge(e, n):
            raise bad_edge(g, j, e)
        if len(e) == 5:
            edges.extend((e[0], e[1], e[2], e[3], e[4]))
        else:
            edges.extend((e[0], e[1], 0, 0, 0))
    return (bytes(node_kinds), array("q", kernels), b"".join(parts), array("q", params), array("q", relocs),
            array("q", attrs), array("q", memsets), array("q", copies), array("q", edges), names)


cdef int _check(
    const unsigned char[::1] kinds,
    const int64_t[::1] kernels,
    Py_ssize_t nblob,
    const int64_t[::1] params,
    const int64_t[::1] relocs,
    const int64_t[::1] attrs,
    const int64_t[::1] memsets,
    const int64_t[::1] copies,
    const int64_t[::1] edges,
    Py_ssize_t functions,
) except -1:
    """A ValueError where a record points outside the arrays (the loop reads them unchecked)."""
    cdef Py_ssize_t n = kinds.shape[0], i, j
    cdef Py_ssize_t counts[4]
    cdef const int64_t* k
    cdef const int64_t* r
    counts[0] = counts[1] = counts[2] = counts[3] = 0
    for i in range(n):
        if kinds[i] > KIND_EMPTY:
            raise ValueError(f"node {i}: kind {kinds[i]}")
        counts[kinds[i]] += 1
    if (kernels.shape[0] != counts[KIND_KERNEL] * KERNEL_W or memsets.shape[0] != counts[KIND_MEMSET] * MEMSET_W
            or copies.shape[0] != counts[KIND_MEMCPY] * COPY_W or edges.shape[0] % EDGE_W
            or relocs.shape[0] % RELOC_W or attrs.shape[0] % ATTR_W):
        raise ValueError("the records do not match the nodes' kinds")
    for i in range(counts[KIND_KERNEL]):
        k = &kernels[i * KERNEL_W]
        if (k[8] < 0 or k[8] % 64 or k[8] > nblob or k[9] < 0 or k[10] < 0 or k[9] + k[10] > params.shape[0]
                or k[11] < 0 or k[11] >= functions or k[12] < 0 or k[13] < 0
                or (k[12] + k[13]) * ATTR_W > attrs.shape[0] or k[14] < 0 or k[15] < 0
                or (k[14] + k[15]) * RELOC_W > relocs.shape[0]):
            raise ValueError(f"kernel record {i} points outside the arrays")
        for j in range(k[9], k[9] + k[10]):
            if params[j] < 0 or k[8] + params[j] > nblob:
                raise ValueError(f"kernel record {i}: a parameter outside the argument bytes")
        for j in range(k[14], k[14] + k[15]):
            r = &relocs[j * RELOC_W]
            if r[0] < 0 or r[0] + 8 > nblob:
                raise ValueError(f"kernel record {i}: a relocation outside the argument bytes")
        for j in range(k[12], k[12] + k[13]):
            if attrs[j * ATTR_W] < 0 or attrs[j * ATTR_W] >= ATTRIBUTE_IDS:
                raise ValueError(f"kernel record {i}: launch attribute id {attrs[j * ATTR_W]}")
    for j in range(edges.shape[0] // EDGE_W):
        if not (0 <= edges[j * EDGE_W] < n and 0 <= edges[j * EDGE_W + 1] < n):
            raise ValueError(f"edge {j}: a node outside the graph")
    return 0


cdef class Builder:
    """Adds flat graphs' nodes through the driver entry points at ``addresses`` (one per name
    of :data:`CALLS`), memset and copy nodes in context ``ctx``. What a new node of a function
    reads back for a launch attribute is read once per builder, as graph_rebuild's ``_Builder``
    does: a node whose saved value is that costs no call."""

    cdef AddKernel add_kernel
    cdef AddMemset add_memset
    cdef AddMemcpy add_memcpy
    cdef AddEmpty add_empty
    cdef AddDeps add_deps
    cdef GetAttr get_attr
    cdef SetAttr set_attr
    cdef void* ctx
    cdef int64_t* cache
    cdef Py_ssize_t functions

    def __cinit__(self, addresses, uint64_t ctx):
        cdef list got = [int(addresses[name]) for name in CALLS]
        if not all(got):
            raise ValueError("a driver entry point at address 0")
        self.add_kernel = <AddKernel><size_t><uint64_t>got[0]
        self.add_memset = <AddMemset><size_t><uint64_t>got[1]
        self.add_memcpy = <AddMemcpy><size_t><uint64_t>got[2]
        self.add_empty = <AddEmpty><size_t><uint64_t>got[3]
        self.add_deps = <AddDeps><size_t><uint64_t>got[4]
        self.get_attr = <GetAttr><size_t><uint64_t>got[5]
        self.set_attr = <SetAttr><size_t><uint64_t>got[6]
        self.ctx = <void*><size_t>ctx
        self.cache = NULL
        self.functions = 0

    def __dealloc__(self):
        free(self.cache)

    cdef int _grow(self, Py_ssize_t functions) except -1:
        if functions <= self.functions:
            return 0
        cdef Py_ssize_t per = ATTRIBUTE_IDS * SLOT
        cdef int64_t* more = <int64_t*>realloc(self.cache, functions * per * sizeof(int64_t))
        if more == NULL:
            raise MemoryError()
        memset(more + self.functions * per, 0, (functions - self.functions) * per * sizeof(int64_t))
        self.cache, self.functions = more, functions
        return 0

    def add(
        self,
        uint64_t graph,
        const unsigned char[::1] kinds,
        const int64_t[::1] kernels,
        const unsigned char[::1] blob,
        const int64_t[::1] params,
        const int64_t[::1] relocs,
        const int64_t[::1] attrs,
        const int64_t[::1] memsets,
        const int64_t[::1] copies,
        const int64_t[::1] edges,
        Py_ssize_t functions,
    ):
        """Every node of one flat graph added to ``graph``, in order, then its edges. None where
        every call succeeded; else what failed, for graph_rebuild to raise as its ctypes path
        does: ``("call", name, node, CUresult)`` (node -1: the edges), or ``("attribute", node,
        attribute record, set's CUresult, read's CUresult, (three words read))``."""
        self._grow(functions)
        cdef Py_ssize_t n = kinds.shape[0], i, j, a, at
        cdef Py_ssize_t ki = 0, mi = 0, ci = 0
        cdef Py_ssize_t nblob = blob.shape[0], nparams = params.shape[0], nedges = edges.shape[0] // EDGE_W
        _check(kinds, kernels, nblob, params, relocs, attrs, memsets, copies, edges, functions)
        cdef void** nodes = <void**>calloc(n if n > 0 else 1, sizeof(void*))
        # 64-byte aligned, as a launch's own parameter buffer is (a CUtensorMap parameter is alignas(64))
        cdef char* raw = <char*>malloc(nblob + 64)
        cdef void** ptrs = <void**>malloc((nparams if nparams > 0 else 1) * sizeof(void*))
        cdef void** src = <void**>malloc((nedges if nedges > 0 else 1) * sizeof(void*))
        cdef void** dst = <void**>malloc((nedges if nedges > 0 else 1) * sizeof(void*))
        cdef EdgeData* data = <EdgeData*>calloc(nedges if nedges > 0 else 1, sizeof(EdgeData))
        if nodes == NULL or raw == NULL or ptrs == NULL or src == NULL or dst == NULL or data == NULL:
            free(nodes); free(raw); free(ptrs); free(src); free(dst); free(data)
            raise MemoryError()
        cdef char* args = <char*>((<size_t>raw + 63) // 64 * 64)
        cdef const int64_t* k
        cdef const int64_t* r
        cdef const int64_t* v
        cdef int64_t* slot
        cdef uint64_t word
        cdef KernelParams p
        cdef MemsetParams ms
        cdef Memcpy3D cp
        cdef unsigned int buf[16]
        cdef unsigned int val[16]
        cdef int rc, set_rc
        cdef unsigned char kind
        try:
            if nblob:
                memcpy(args, &blob[0], nblob)
            for i in range(n):
                kind = kinds[i]
                if kind == KIND_KERNEL:
                    k = &kernels[ki * KERNEL_W]
                    ki += 1
                    for j in range(k[15]):  # the relocated addresses, written over the saved ones
                        r = &relocs[(k[14] + j) * RELOC_W]
                        word = <uint64_t>r[1]  # little-endian, as CUDA's hosts are
                        memcpy(args + r[0], &word, 8)
                    for j in range(k[10]):
                        ptrs[k[9] + j] = args + k[8] + params[k[9] + j]
                    memset(&p, 0, sizeof(KernelParams))
                    p.func = <void*><size_t>k[0]
                    p.gridDimX, p.gridDimY, p.gridDimZ = <unsigned int>k[1], <unsigned int>k[2], <unsigned int>k[3]
                    p.blockDimX, p.blockDimY, p.blockDimZ = <unsigned int>k[4], <unsigned int>k[5], <unsigned int>k[6]
                    p.sharedMemBytes = <unsigned int>k[7]
                    p.kernelParams = &ptrs[k[9]] if k[10] > 0 else NULL
                    rc = self.add_kernel(&nodes[i], <void*><size_t>graph, NULL, 0, &p)
                    if rc != 0:
                        return ("call", "cuGraphAddKernelNode_v2", i, rc)
                    for j in range(k[13]):
                        a = k[12] + j
                        v = &attrs[a * ATTR_W]
                        slot = self.cache + (k[11] * ATTRIBUTE_IDS + v[0]) * SLOT
                        if slot[0] == 0:  # what a new node of this function reads, once
                            memset(buf, 0, sizeof(buf))
                            slot[1] = self.get_attr(nodes[i], <int>v[0], buf)
                            slot[2], slot[3], slot[4] = buf[0], buf[1], buf[2]
                            slot[0] = 1
                        if slot[1] == 0 and slot[2] == v[1] and slot[3] == v[2] and slot[4] == v[3]:
                            continue
                        memset(val, 0, sizeof(val))
                        val[0], val[1], val[2] = <unsigned int>v[1], <unsigned int>v[2], <unsigned int>v[3]
                        set_rc = self.set_attr(nodes[i], <int>v[0], val)
                        memset(buf, 0, sizeof(buf))
                        rc = self.get_attr(nodes[i], <int>v[0], buf)
                        if set_rc != 0 or rc != 0 or buf[0] != v[1] or buf[1] != v[2] or buf[2] != v[3]:
                            return ("attribute", i, a, set_rc, rc, (buf[0], buf[1], buf[2]))
                elif kind == KIND_MEMSET:
                    v = &memsets[mi * MEMSET_W]
                    mi += 1
                    ms.dst, ms.pitch, ms.value = <unsigned long long>v[0], <size_t>v[1], <unsigned int>v[2]
                    ms.elementSize, ms.width, ms.height = <unsigned int>v[3], <size_t>v[4], <size_t>v[5]
                    rc = self.add_memset(&nodes[i], <void*><size_t>graph, NULL, 0, &ms, self.ctx)
                    if rc != 0:
                        return ("call", "cuGraphAddMemsetNode", i, rc)
                elif kind == KIND_MEMCPY:
                    v = &copies[ci * COPY_W]
                    ci += 1
                    memset(&cp, 0, sizeof(Memcpy3D))
                    cp.srcMemoryType = cp.dstMemoryType = DEVICE
                    cp.srcDevice, cp.dstDevice = <unsigned long long>v[0], <unsigned long long>v[1]
                    cp.srcPitch, cp.srcHeight = <size_t>v[2], <size_t>v[3]
                    cp.dstPitch, cp.dstHeight = <size_t>v[4], <size_t>v[5]
                    cp.WidthInBytes, cp.Height, cp.Depth = <size_t>v[6], <size_t>v[7], <size_t>v[8]
                    rc = self.add_memcpy(&nodes[i], <void*><size_t>graph, NULL, 0, &cp, self.ctx)
                    if rc != 0:
                        return ("call", "cuGraphAddMemcpyNode", i, rc)
                else:
                    rc = self.add_empty(&nodes[i], <void*><size_t>graph, NULL, 0)
                    if rc != 0:
                        return ("call", "cuGraphAddEmptyNode", i, rc)
            if nedges:
                for j in range(nedges):
                    v = &edges[j * EDGE_W]
                    src[j], dst[j] = nodes[v[0]], nodes[v[1]]
                    data[j].from_port, data[j].to_port = <unsigned char>v[2], <unsigned char>v[3]
                    data[j].type = <unsigned char>v[4]
                rc = self.add_deps(<void*><size_t>graph, src, dst, data, nedges)
                if rc != 0:
                    return ("call", "cuGraphAddDependencies_v2", -1, rc)
            return None
        finally:
            free(nodes); free(raw); free(ptrs); free(src); free(dst); free(data)
