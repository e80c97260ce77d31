"""Rebuilding a graph file's graphs through the driver: the restore's last step, proven in the saving process.

A restore (issue 51, docs/restore.md) rebuilds every graph of a graph file
(``capture_plan.schemas.graph_file``) node by node. This module does that where the saved
addresses still hold, in the process that saved the file (phase 2): :func:`rebuild_from_file`
reads the file back, refuses it where ``check_valid`` or :func:`rebuild_refusals` says no,
finds every segment's address here (:func:`segment_bases`: the plan's pools' segments in
address order, the named tensors, the library workspaces), every kernel as a ``CUfunction``
(its module found by the module's identity, ``graph_walk.module_identity``, among the modules
this process has loaded, then ``cuModuleGetFunction`` by the kernel's name), and adds every
node through the driver (:func:`rebuild_graphs`: ``cuGraphAddKernelNode`` with the argument
bytes patched from the file's relocations, memset, copy and empty nodes, the edges with
their data, the launch attributes the file recorded, each read back), then instantiates
and uploads each graph. The nodes are added from C by the compiled graph builder
(executor/_graph_build.pyx, over flat records it prepares per graph) where it is built and the
driver's calls are C functions, else one ctypes call at a time; ``graph_flat.graph_builder``
says which and why, and :class:`Rebuilt` names the one that ran.
``capture_plan.executor.rebuild_proof`` launches every rebuilt graph and compares its
outputs bit for bit with the captured graph's replay on the same inputs, at the saving
process's addresses and at copies of every segment.

What a rebuild at the saving process's addresses proves: the file holds everything a
graph needs (its nodes, their parameters, its edges, its kernels by name) and adding them
through the driver is exact. A rebuild onto copies (``segment_bases`` replaced by the
copies' addresses) proves the relocation of what the file relocates. Neither proves a fresh
process's kernel loading (the modules are the saving process's), TMA re-encoding, or a
preferred cluster dimension the driver did not read back at save time (driver 580:
``exec_reuse``).

Constraints: a node of a type other than kernel, memset, copy or empty, a kernel with a
parameter shaped like a ``CUtensorMap`` (its address is encoded, not plain: a relocation
would leave it stale), a launch attribute the file names but this module does not know, an
operand in a segment with no address here: each refuses the whole rebuild with one line
naming the graph and the node (:func:`rebuild_refusals`), before any driver call. A driver
call that fails, or a launch attribute that does not read back as saved, raises an
:class:`ExecutorError` naming the call, its CUresult, the graph and the node; what was made
is destroyed.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from capture_plan.schemas.graph_file import RELOCATABLE, GraphFile, Kernel, Operand

from . import libcuda
from .errors import ExecutorError
from .exec_update import ATTRIBUTES
from .graph_flat import BUILDER_ENV, NODE_CALLS, GraphBuilder, compiled, entry_points, graph_builder
from .graph_walk import module_identity
from .libcuda import EdgeData, KernelParams, Memcpy3D, MemsetParams

__all__ = [
    "REBUILD_CALLS",
    "FETCH_CALLS",
    "REBUILDABLE",
    "rebuild_refusals",
    "segment_bases",
    "patched_args",
    "module_handles",
    "Rebuilt",
    "rebuild_graphs",
    "Prepared",
    "prepare_rebuild",
    "rebuild_from_file",
]

#: the driver calls ``kernel_loading.fetch_functions`` makes (a rebuild looks its kernels up by
#: name in their modules too)
FETCH_CALLS = (
    "cuModuleGetFunction",
    "cuModuleGetFunctionCount",
    "cuModuleEnumerateFunctions",
    "cuFuncGetName",
    "cuFuncGetAttribute",
    "cuFuncSetAttribute",
)
#: every driver call a rebuild makes
REBUILD_CALLS = (
    "cuCtxGetCurrent",
    "cuGraphCreate",
    *NODE_CALLS,
    *FETCH_CALLS,
    "cuGraphInstantiateWithFlags",
    "cuGraphUpload",
    "cuGraphLaunch",
    "cuStreamSynchronize",
    "cuGraphExecDestroy",
    "cuGraphDestroy",
)
#: the node types a rebuild adds
REBUILDABLE = ("kernel", "memset", "memcpy", "empty")
#: CU_MEMORYTYPE_DEVICE: every copy operand a rebuild sets (host operands are refused)
_DEVICE = 2
#: CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, and the dynamic shared memory a kernel gets without it
_MAX_DYNAMIC_SHARED, _DEFAULT_SHARED = 8, 48 << 10


def rebuild_refusals(file: GraphFile) -> list[str]:
    """One line per node a rebuild cannot make exactly (module docstring), naming the graph
    and the node; [] where every node can be rebuilt. Where segments are refused is
    ``check_valid``'s."""
    out = []
    known = ATTRIBUTES.keys()
    for g in file.graphs:
        for i, n in enumerate(g.nodes):
            t, k = n.type, n.kernel
            if t not in REBUILDABLE:
                out.append(f"graph {g.phase}/{g.bs} node {i}: a {t} node cannot be rebuilt (kinds rebuilt: "
                           f"{', '.join(REBUILDABLE)})")  # fmt: skip
            elif (
                (t == "kernel" and k is None)
                or (t == "memset" and n.memset is None)
                or (t == "memcpy" and n.copy is None)
            ):
                out.append(f"graph {g.phase}/{g.bs} node {i}: a {t} node without its parameters: the file is damaged")
            elif k is not None and (k.tensor_maps or not k.attributes.keys() <= known):
                where = f"graph {g.phase}/{g.bs} node {i}"
                if k.tensor_maps:
                    out.append(
                        f"{where} (kernel {k.name}): parameter(s) {k.tensor_maps} are shaped like a CUtensorMap, "
                        "whose encoded address a rebuild does not re-encode"
                    )
                unknown = sorted(set(k.attributes) - known)
                if unknown:
                    out.append(f"{where} (kernel {k.name}): launch attribute(s) {unknown} this rebuild does not set")
    return out


def segment_bases(
    file: GraphFile,
    pools: Mapping[str, list[int]],
    tensors: Mapping[str, int],
    workspaces: Mapping[str, int],
    engine: Mapping[str, int] | None = None,
) -> list[int | None]:
    """Per segment of ``file`` its address in this process: ``pools`` (pool name -> its
    segments' addresses, item ``i`` for the file's segment of ``index`` ``i`` in that pool, as
    ``restore_layout.lay_out_pools`` lists them), ``tensors`` (name -> storage address),
    ``workspaces`` (name -> address), ``engine`` (name -> address of the engine's range here);
    None for a segment a restore cannot relocate into or that this process lacks
    (``check_valid`` names both)."""
    out: list[int | None] = []
    for seg in file.segments:
        base = None
        if seg.kind == "pool":
            here = pools.get(seg.owner, [])
            base = here[seg.index] if seg.index < len(here) else None
        elif seg.kind == "tensor":
            base = tensors.get(seg.owner)
        elif seg.kind == "workspace":
            base = workspaces.get(seg.owner)
        elif seg.kind == "engine":
            base = (engine or {}).get(seg.owner)
        out.append(base if seg.kind in RELOCATABLE else None)
    return out


def _address(op: Operand, bases: list[int | None], where: str) -> int:
    base = bases[op.segment] if op.segment < len(bases) else None
    if base is None:
        raise ExecutorError(f"an operand in segment {op.segment}, which has no address here", where=where)
    return base + op.offset


def patched_args(kernel: Kernel, bases: list[int | None], where: str = "kernel") -> bytes:
    """The kernel's argument bytes with every relocated address written back: its segment's
    address here plus its offset, 8 bytes little-endian at its position."""
    args = bytearray(kernel.args)
    for r in kernel.relocations:
        pos = r.position
        if not 0 <= pos <= len(args) - 8:  # a slice there would grow the bytes, or write from their end
            raise outside_args(kernel, f"a relocated address at byte {pos}", where)
        args[pos : pos + 8] = _address(Operand(segment=r.segment, offset=r.offset), bases, where).to_bytes(8, "little")
    return bytes(args)


def outside_args(kernel: Kernel, what: str, where: str) -> ExecutorError:
    """The error for ``what`` (a parameter, a relocated address) lying outside ``kernel``'s
    argument bytes: the driver would read past them (a damaged file)."""
    return ExecutorError(
        f"kernel {kernel.name}: {what} lies outside its {len(kernel.args)} argument bytes: the file is damaged",
        where=where,
    )


def _an_edge(e: tuple[int, ...], n: int) -> bool:
    """Whether ``e`` is (from, to) or (from, to, from port, to port, type) of ``n`` nodes."""
    return (len(e) == 2 or (len(e) == 5 and 0 <= min(e[2:]) and max(e[2:]) < 256)) and 0 <= e[0] < n and 0 <= e[1] < n


def bad_edge(g, j: int, e: tuple[int, ...]) -> ExecutorError:
    """The error for edge ``j`` of graph ``g``, ``e``, which is no edge of its nodes (a damaged
    file: an index past the nodes, or negative, which a list would take from the end)."""
    return ExecutorError(
        f"edge {j} {tuple(e)} is no edge of the graph's {len(g.nodes)} nodes: the file is damaged",
        where=f"graph {g.phase}/{g.bs}",
    )


def module_handles(
    file: GraphFile, loaded: list[int], calls: dict | None = None, twin: Callable[[int, int], bool] | None = None
) -> list[int | None]:
    """Per module of ``file`` the handle among ``loaded`` (this process's ``CUmodule``s, in the
    order the walk met them) of the same identity (``graph_walk.module_identity``), or None.
    Twins (an identity not one module's alone: two builds of one Triton kernel) are told apart
    by ``twin(m, handle)`` (``kernel_loading.twin_check``), then taken in the order met. A handle
    is never given twice: a module left without is None (the loading seeks or refuses it)."""
    by_identity: dict[str, list[int]] = {}
    for handle in dict.fromkeys(loaded):
        by_identity.setdefault(module_identity(handle, calls, where="rebuild")[0], []).append(handle)
    in_file: dict[str, int] = {}
    for m in file.modules:
        in_file[m.digest] = in_file.get(m.digest, 0) + 1
    out: list[int | None] = []
    taken: set[int] = set()
    for i, m in enumerate(file.modules):
        handles = [h for h in by_identity.get(m.digest, []) if h not in taken]
        if twin is not None and (in_file[m.digest] > 1 or len(by_identity.get(m.digest, [])) > 1):
            handles = [h for h in handles if twin(i, h)]
        out.append(handles[0] if handles else None)
        taken.update(handles[:1])
    return out


@dataclass
class Rebuilt:
    """The graphs rebuilt from a file: per (phase, bs) its ``CUgraphExec``, instantiated and
    uploaded; the seconds it took, by part; the graph builder that added the nodes
    (``graph_flat.GraphBuilder.describe``). :meth:`destroy` frees them."""

    calls: dict
    builder: str = ""
    graphs: dict[tuple[str, int], int] = field(default_factory=dict)
    execs: dict[tuple[str, int], int] = field(default_factory=dict)
    nodes: int = 0
    seconds: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)

    def launch(self, key: tuple[str, int], stream: int) -> None:
        _check(self.calls["cuGraphLaunch"](ctypes.c_void_p(self.execs[key]), ctypes.c_void_p(stream)), "cuGraphLaunch")

    def destroy(self) -> None:
        for e in self.execs.values():
            self.calls["cuGraphExecDestroy"](ctypes.c_void_p(e))
        for g in self.graphs.values():
            self.calls["cuGraphDestroy"](ctypes.c_void_p(g))
        self.execs.clear()
        self.graphs.clear()


def _check(rc: int, call: str, where: str = "rebuild") -> None:
    if rc != 0:
        raise ExecutorError(f"{call} failed (CUresult {rc})", where=where)


class _Builder:
    """Adds one file's nodes to graphs: kernels looked up once per (module, name); from C
    where ``addresses`` (the compiled builder's driver entry points) are given."""

    def __init__(
        self,
        file: GraphFile,
        bases: list[int | None],
        modules: list[int | None],
        d: dict,
        addresses: dict[str, int] | None = None,
    ):
        self.file, self.bases, self.modules, self.d = file, bases, modules, d
        self.functions: dict[tuple[int, str], ctypes.c_void_p] = {}
        self.by_module: dict[int, dict[str, int]] = {}
        #: (function, attribute) -> what a new node of it reads back: (CUresult, value)
        self.defaults: dict[tuple[int, int], tuple[int, tuple[int, int, int]]] = {}
        ctx = ctypes.c_void_p()
        _check(d["cuCtxGetCurrent"](ctypes.byref(ctx)), "cuCtxGetCurrent")
        self.ctx = ctx
        self.compiled = None
        #: function -> its number in the compiled builder's cache of launch attributes' defaults
        self.index: dict[int, int] = {}
        if addresses is not None:
            self.compiled = compiled().Builder(addresses, ctx.value or 0)

    def function(self, k: Kernel, where: str) -> ctypes.c_void_p:
        key = (k.module, k.name)
        f = self.functions.get(key)
        if f is None:
            mod = self.modules[k.module] if k.module < len(self.modules) else None
            if mod is None:
                ident = self.file.modules[k.module].digest if k.module < len(self.file.modules) else "?"
                raise ExecutorError(
                    f"kernel {k.name}: no module with its module's identity ({ident}) is loaded in this process",
                    where=where,
                )
            f = ctypes.c_void_p()
            rc = self.d["cuModuleGetFunction"](ctypes.byref(f), ctypes.c_void_p(mod), k.name.encode())
            if rc != 0:  # a name the lookup does not take: the module's functions by the name the walk read
                f.value = self.enumerated(mod, where).get(k.name)
                if not f.value:
                    raise ExecutorError(
                        f"kernel {k.name} is not in its module (cuModuleGetFunction: CUresult {rc}; not among "
                        "the module's functions either)",
                        where=where,
                    )
            if k.shared_bytes > _DEFAULT_SHARED:  # what the library set for it once; a fresh load has 48 KiB
                have = ctypes.c_int(0)
                _check(
                    self.d["cuFuncGetAttribute"](ctypes.byref(have), _MAX_DYNAMIC_SHARED, f),
                    "cuFuncGetAttribute",
                    where,
                )
                if have.value < k.shared_bytes:
                    rc = self.d["cuFuncSetAttribute"](f, _MAX_DYNAMIC_SHARED, k.shared_bytes)
                    _check(rc, "cuFuncSetAttribute", where)
            self.functions[key] = f
        return f

    def enumerated(self, mod: int, where: str) -> dict[str, int]:
        """Name -> function of every function of module ``mod`` (``cuFuncGetName``: the names the walk read)."""
        got = self.by_module.get(mod)
        if got is None:
            count, m = ctypes.c_uint(0), ctypes.c_void_p(mod)
            _check(self.d["cuModuleGetFunctionCount"](ctypes.byref(count), m), "cuModuleGetFunctionCount", where)
            funcs = (ctypes.c_void_p * count.value)()
            rc = self.d["cuModuleEnumerateFunctions"](ctypes.cast(funcs, ctypes.c_void_p), count.value, m)
            _check(rc, "cuModuleEnumerateFunctions", where)
            got = self.by_module[mod] = {}
            for f in funcs:
                name = ctypes.c_char_p()
                if self.d["cuFuncGetName"](ctypes.byref(name), ctypes.c_void_p(f)) == 0 and name.value:
                    got.setdefault(name.value.decode(errors="replace"), f)
        return got

    def kernel(self, graph: ctypes.c_void_p, k: Kernel, where: str) -> ctypes.c_void_p:
        args = patched_args(k, self.bases, where)
        # 64-byte aligned, as the launch's own parameter buffer is (a CUtensorMap parameter is alignas(64))
        buf = ctypes.create_string_buffer(len(args) + 64)
        at = (ctypes.addressof(buf) + 63) // 64 * 64
        ctypes.memmove(at, args, len(args))
        for j, (off, size) in enumerate(k.params):
            if off < 0 or size < 0 or off + size > len(args):
                raise outside_args(k, f"parameter {j} ({off}, {size})", where)
        ptrs = (ctypes.c_void_p * max(len(k.params), 1))(*[at + off for off, _ in k.params])
        p = KernelParams()
        p.func = self.function(k, where).value
        p.gridDimX, p.gridDimY, p.gridDimZ = k.grid
        p.blockDimX, p.blockDimY, p.blockDimZ = k.block
        p.sharedMemBytes = k.shared_bytes
        p.kernelParams = ctypes.addressof(ptrs) if k.params else None
        node = ctypes.c_void_p()
        _check(
            self.d["cuGraphAddKernelNode_v2"](ctypes.byref(node), graph, None, 0, ctypes.byref(p)),
            "cuGraphAddKernelNode_v2",
            where,
        )
        for name, value in sorted(k.attributes.items()):
            self.attribute(node, p.func, name, value, f"{where} (kernel {k.name})")
        return node

    def attribute(self, node: ctypes.c_void_p, func, name: str, value: tuple[int, int, int], where: str) -> None:
        """Set launch attribute ``name`` where the new node does not read back ``value`` already,
        then check that it does. What a new node of ``func`` reads before anything is set is
        read once per function and attribute: a node whose saved value is that costs no call."""
        aid = ATTRIBUTES[name]

        def read() -> tuple[int, tuple[int, int, int]]:
            buf = (ctypes.c_uint * 16)()
            rc = self.d["cuGraphKernelNodeGetAttribute"](node, aid, ctypes.cast(buf, ctypes.c_void_p))
            return rc, (buf[0], buf[1], buf[2])

        default = self.defaults.get((func, aid))
        if default is None:
            default = self.defaults[(func, aid)] = read()
        rc, got = default
        if rc == 0 and got == tuple(value):
            return
        val = (ctypes.c_uint * 16)()
        val[0], val[1], val[2] = value
        set_rc = self.d["cuGraphKernelNodeSetAttribute"](node, aid, ctypes.cast(val, ctypes.c_void_p))
        rc, got = read()
        if set_rc != 0 or rc != 0 or got != tuple(value):
            raise ExecutorError(
                f"launch attribute {name} saved as {tuple(value)} reads back {got} (set: CUresult {set_rc}, read: "
                f"CUresult {rc})",
                where=where,
            )

    def flat(self, graph: ctypes.c_void_p, g) -> int:
        """Graph ``g``'s nodes and edges added by the compiled builder; its errors raised as the
        ctypes path raises them."""
        b = self.compiled
        assert b is not None
        flat = compiled().flatten(g, self.bases, self.function, self.functions, self.index, ATTRIBUTES)
        kinds, kernels, blob, params, relocs, attrs, memsets, copies, edges, names = flat
        failed = b.add(
            graph.value or 0, kinds, kernels, blob, params, relocs, attrs, memsets, copies, edges, len(self.index)
        )
        label = f"graph {g.phase}/{g.bs}"
        if failed is not None and failed[0] == "call":
            _, call, i, rc = failed
            _check(rc, call, f"{label} node {i}" if i >= 0 else label)
        elif failed is not None:
            _, i, a, set_rc, rc, got = failed
            k, name = g.nodes[i].kernel, names[a]
            raise ExecutorError(
                f"launch attribute {name} saved as {tuple(k.attributes[name])} reads back {got} (set: CUresult "
                f"{set_rc}, read: CUresult {rc})",
                where=f"{label} node {i} (kernel {k.name})",
            )
        return len(g.nodes)

    def graph(self, g) -> tuple[ctypes.c_void_p, int]:
        d, graph = self.d, ctypes.c_void_p()
        _check(d["cuGraphCreate"](ctypes.byref(graph), 0), "cuGraphCreate", f"graph {g.phase}/{g.bs}")
        try:
            if self.compiled is not None:
                return graph, self.flat(graph, g)
            nodes = []
            for i, n in enumerate(g.nodes):
                where = f"graph {g.phase}/{g.bs} node {i}"
                node = ctypes.c_void_p()
                if n.kernel is not None:
                    node = self.kernel(graph, n.kernel, where)
                elif n.memset is not None:
                    m = n.memset
                    p = MemsetParams(
                        _address(m.dst, self.bases, where), m.pitch, m.value, m.element_size, m.width, m.height
                    )
                    rc = d["cuGraphAddMemsetNode"](ctypes.byref(node), graph, None, 0, ctypes.byref(p), self.ctx)
                    _check(rc, "cuGraphAddMemsetNode", where)
                elif n.copy is not None:
                    c, p3 = n.copy, Memcpy3D()
                    p3.srcMemoryType = p3.dstMemoryType = _DEVICE
                    p3.srcDevice, p3.dstDevice = _address(c.src, self.bases, where), _address(c.dst, self.bases, where)
                    p3.srcPitch, p3.srcHeight, p3.dstPitch, p3.dstHeight = (
                        c.src_pitch,
                        c.src_height,
                        c.dst_pitch,
                        c.dst_height,
                    )
                    p3.WidthInBytes, p3.Height, p3.Depth = c.width, c.height, c.depth
                    rc = d["cuGraphAddMemcpyNode"](ctypes.byref(node), graph, None, 0, ctypes.byref(p3), self.ctx)
                    _check(rc, "cuGraphAddMemcpyNode", where)
                else:
                    _check(d["cuGraphAddEmptyNode"](ctypes.byref(node), graph, None, 0), "cuGraphAddEmptyNode", where)
                nodes.append(node.value)
            if g.edges:
                n_e = len(g.edges)
                src, dst, data = (ctypes.c_void_p * n_e)(), (ctypes.c_void_p * n_e)(), (EdgeData * n_e)()
                for j, e in enumerate(g.edges):
                    if not _an_edge(e, len(nodes)):
                        raise bad_edge(g, j, e)
                    src[j], dst[j] = nodes[e[0]], nodes[e[1]]
                    if len(e) == 5:
                        data[j].from_port, data[j].to_port, data[j].type = e[2], e[3], e[4]
                ends = (ctypes.cast(a, ctypes.c_void_p) for a in (src, dst, data))
                rc = d["cuGraphAddDependencies_v2"](graph, *ends, n_e)
                _check(rc, "cuGraphAddDependencies_v2", f"graph {g.phase}/{g.bs}")
        except BaseException:
            d["cuGraphDestroy"](graph)
            raise
        return graph, len(nodes)


def rebuild_graphs(
    file: GraphFile, bases: list[int | None], modules: list[int | None], stream: int, calls: dict | None = None
) -> Rebuilt:
    """Every graph of ``file`` rebuilt (module docstring): ``bases`` per segment
    (:func:`segment_bases`), ``modules`` per module (:func:`module_handles`), instantiated
    and uploaded on ``stream`` (a ``CUstream``), synchronized. Refused before any driver
    call where :func:`rebuild_refusals` names a node."""
    refused = rebuild_refusals(file)
    if refused:
        raise ExecutorError(
            f"the graph file cannot be rebuilt: {refused[0]}"
            + (f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""),
            where="rebuild",
            fix="capture instead (python -m capture_plan.executor.graph_file inspect FILE says what the file holds)",
        )
    d = calls if calls is not None else libcuda.calls(*REBUILD_CALLS)
    if isinstance(d, str):
        raise ExecutorError(f"the rebuild cannot run: {d}", where="rebuild")
    chosen, addresses = _builder(d)
    out = Rebuilt(calls=d, builder=chosen.describe())
    s = ctypes.c_void_p(stream)
    try:
        t0 = time.perf_counter()
        b = _Builder(file, bases, modules, d, addresses)
        for g in file.graphs:
            graph, n = b.graph(g)
            out.graphs[(g.phase, g.bs)] = graph.value or 0
            out.nodes += n
        t1 = time.perf_counter()
        for key, graph in out.graphs.items():
            e = ctypes.c_void_p()
            where = f"graph {key[0]}/{key[1]}"
            _check(
                d["cuGraphInstantiateWithFlags"](ctypes.byref(e), ctypes.c_void_p(graph), 0),
                "cuGraphInstantiateWithFlags",
                where,
            )
            out.execs[key] = e.value or 0
            _check(d["cuGraphUpload"](e, s), "cuGraphUpload", where)
        _check(d["cuStreamSynchronize"](s), "cuStreamSynchronize")
        t2 = time.perf_counter()
    except BaseException:
        out.destroy()
        raise
    out.parts.update(nodes=t1 - t0, instantiate=t2 - t1)
    out.seconds = t2 - t0
    return out


def _builder(d: dict) -> tuple[GraphBuilder, dict[str, int] | None]:
    """The graph builder this rebuild runs (``graph_flat.graph_builder``) and, for the compiled
    one, the driver's entry points; ctypes where a call of ``d`` is no C function (a fake)."""
    import os

    chosen = graph_builder()
    if chosen.name != "compiled":
        return chosen, None
    got = entry_points(d, NODE_CALLS)
    if isinstance(got, str):
        if os.environ.get(BUILDER_ENV, "").strip().lower() == "compiled":
            raise ExecutorError(f"{BUILDER_ENV}=compiled, but {got}", where="rebuild")
        return GraphBuilder("ctypes", got), None
    return chosen, got


@dataclass
class Prepared:
    """What a rebuild needs of a graph file in the process that saved it: the file, each
    segment's address and each module's handle here, the seconds each step took."""

    file: GraphFile
    bases: list[int | None]
    modules: list[int | None]
    parts: dict[str, float] = field(default_factory=dict)


def prepare_rebuild(path: str | Path, gs, target: object = None, walked=None, tensors=None) -> Prepared:
    """The graph file at ``path`` read, checked against the process that captured ``gs`` for
    ``target`` (``check_valid``: an ExecutorError with its first line and the count), every
    segment's address (:func:`segment_bases`) and every module's handle (the modules of
    ``walked``, the graphs' walk: ``restore_probe.walk_graphs``) found here."""
    from capture_plan.schemas.graph_file import read_graph_file

    from .graph_env import current_environment, graph_tensors, library_workspaces
    from .graph_validity import check_valid
    from .pool import pool_segments
    from .restore_probe import walk_graphs

    t0 = time.perf_counter()
    file = read_graph_file(path)
    t1 = time.perf_counter()
    named = graph_tensors(gs, target, tensors)
    workspaces = library_workspaces(gs.pools)
    digest = gs.plan.digest if gs.plan is not None else ""
    refused = check_valid(file, current_environment(digest, named, gs.pools, workspaces))
    if refused:
        raise ExecutorError(
            f"the graph file is not valid here: {refused[0]}"
            + (f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""),
            where=str(path),
            fix="capture instead, and save the graphs again",
        )
    bases = segment_bases(
        file,
        {n: [a for a, _ in pool_segments([p])] for n, p in gs.pools.items()},
        {n: t.untyped_storage().data_ptr() for n, t in named.items()},  # pyright: ignore[reportAttributeAccessIssue]
        {n: a for n, (a, _) in workspaces.items()},
    )
    t2 = time.perf_counter()
    graphs = walked if walked is not None else walk_graphs(gs)
    loaded = [n.kernel.module for _, _, w in graphs for n in w.nodes if n.kernel is not None and n.kernel.module]
    modules = module_handles(file, loaded)
    t3 = time.perf_counter()
    return Prepared(file, bases, modules, {"read": t1 - t0, "check": t2 - t1, "modules": t3 - t2})


def rebuild_from_file(path: str | Path, gs, target: object = None, walked=None, tensors=None) -> Rebuilt:
    """The graphs of the graph file at ``path`` rebuilt in the process that captured ``gs``
    for ``target`` and saved the file (module docstring; :func:`prepare_rebuild`), on the
    current stream. ``seconds`` counts all of it, the file's read included; ``parts`` by step."""
    import torch

    prep = prepare_rebuild(path, gs, target, walked, tensors)
    out = rebuild_graphs(prep.file, prep.bases, prep.modules, torch.cuda.current_stream().cuda_stream)
    out.parts.update(prep.parts)
    out.seconds += sum(prep.parts.values())
    return out
