"""Writing and inspecting a graph file (``capture_plan.schemas.graph_file``): a capture's graphs, relocatable.

:func:`save_graphs` walks every graph of a GraphSet through the driver
(``capture_plan.executor.graph_walk``) right after ``capture()``, while the graphs, the
pools and the target's tensors are alive, and writes the file: every device address in a
kernel's arguments and in a memset's or copy's operands rewritten as (segment, offset),
segments named by owner (the plan's pools by the plan's pool names and the segment's place
in address order, the target's tensors by name: :func:`named_tensors`), and what the file is
valid for (:func:`current_environment`; the kernel libraries: :func:`kernel_libraries`).
``python -m capture_plan.executor.graph_file inspect FILE`` prints what a file holds and
what it is valid for (no planner, no GPU).

Kernel binaries are not in the file. Each kernel is named by its function name and its
module's identity (a digest of the module's function names:
``graph_walk.module_identity``), and the file carries the digests of the libraries the
saving process had mapped. A restore must get each kernel back as a ``CUfunction`` of a
loaded module with the same identity; the options (issue 51), none built yet: (1) the
target's own eager run before the restore (the process loads the same libraries' modules
as the saving one did; the restore then finds each kernel by module identity and name with
``cuModuleEnumerateFunctions``), cheap where the engine runs eagerly anyway, and
incomplete for kernels only a captured path launches; (2) the cubins extracted at save
time (CUPTI's module-load callback gives each module's image) and written beside the file,
loaded with ``cuModuleLoadData``: complete, but code in a file, so loaded only from a path
the operator names, its digest checked; (3) a library's cubins listed by ``cuobjdump``
from the library file whose digest the file records. Which costs least is measured, not
assumed (docs/restore.md).

Constraints: a kernel whose name, module or parameter layout the driver does not give, an
array operand of a copy, or a node of a type other than kernel, memset, copy or empty
stops the save with an :class:`ExecutorError` naming the graph and node (a file that could
not be restored is never written). Addresses outside every restorable segment are saved
(as ``torch:K``, ``outside:K``, ``host:K``) so that ``check_valid`` names them.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
import types
from bisect import bisect_right
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import msgspec

from capture_plan.schemas.errors import InputError
from capture_plan.schemas.files import read_input, write_atomic
from capture_plan.schemas.graph_file import (
    GRAPH_FILE_KIND,
    GRAPH_FILE_VERSION,
    RELOCATABLE,
    Copy,
    FileHead,
    Graph,
    GraphFile,
    Kernel,
    Library,
    Memset,
    Module,
    Node,
    Operand,
    Relocation,
    Segment,
    ValidFor,
)

from .errors import ExecutorError
from .graph_validity import GraphEnvironment, segment_uses
from .graph_walk import AddressResolver, WalkedGraph, device_addresses, module_identity, tensor_map_params
from .restore_probe import TorchSegment, segment_of, stream_workspaces, torch_segments, walk_graphs

__all__ = [
    "named_tensors",
    "kernel_libraries",
    "current_environment",
    "library_workspaces",
    "graph_tensors",
    "Segments",
    "build_file",
    "save_graphs",
    "encode",
    "read_graph_file",
    "describe",
    "main",
]

#: node types saved without parameters (their presence and edges are the graph's structure)
_PLAIN = ("empty",)


def named_tensors(obj: object, prefix: str = "", depth: int = 4) -> dict[str, object]:
    """The CUDA tensors reachable from ``obj`` by name: a module's parameters and buffers
    (``named_parameters`` and ``named_buffers``), then attributes, dict items, list and
    tuple items ``depth`` levels down (``layers.3.k_cache``). The first name found wins
    (a tensor reachable twice is named once)."""
    import torch

    found: dict[str, object] = {}
    seen: set[int] = set()

    def walk(x: object, name: str, left: int) -> None:
        if id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            if x.is_cuda and x.untyped_storage().nbytes() and name not in found:
                found[name] = x
            return
        # a Python module (a target's kernel library handle) is not the target's state
        if left <= 0 or isinstance(x, (str, bytes, int, float, bool, type(None), types.ModuleType)):
            return
        if isinstance(x, torch.nn.Module):
            for n, t in [*x.named_parameters(), *x.named_buffers()]:
                walk(t, f"{name}.{n}" if name else n, 0)
        items: Iterable = ()
        if isinstance(x, Mapping):
            items = ((str(k), v) for k, v in x.items())
        elif isinstance(x, (list, tuple)):
            items = ((str(i), v) for i, v in enumerate(x))
        elif hasattr(x, "__dict__") and not isinstance(x, type):
            items = ((k, v) for k, v in vars(x).items() if not isinstance(x, torch.nn.Module) or k != "_modules")
        for k, v in items:
            walk(v, f"{name}.{k}" if name else k, left - 1)

    walk(obj, prefix, depth)
    return found


def _has_kernels(path: str) -> bool:
    """Whether the ELF file at ``path`` has a ``.nv_fatbin`` section (CUDA kernels)."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if head[:4] != b"\x7fELF" or head[4] != 2:  # 64-bit ELF only
                return False
            shoff = int.from_bytes(head[0x28:0x30], "little")
            shentsize = int.from_bytes(head[0x3A:0x3C], "little")
            shnum = int.from_bytes(head[0x3C:0x3E], "little")
            shstrndx = int.from_bytes(head[0x3E:0x40], "little")
            f.seek(shoff)
            table = f.read(shentsize * shnum)
            sh = table[shstrndx * shentsize : (shstrndx + 1) * shentsize]
            f.seek(int.from_bytes(sh[0x18:0x20], "little"))
            names = f.read(int.from_bytes(sh[0x20:0x28], "little"))
    except (OSError, IndexError):
        return False
    for i in range(shnum):
        off = int.from_bytes(table[i * shentsize : i * shentsize + 4], "little")
        if names[off : names.find(b"\0", off)] == b".nv_fatbin":
            return True
    return False


_DIGESTS: dict[tuple[str, int, int], str] = {}


def _file_digest(path: str) -> str:
    st = os.stat(path)
    key = (path, st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 23):
                h.update(chunk)
        _DIGESTS[key] = "sha256:" + h.hexdigest()
    return _DIGESTS[key]


def kernel_libraries(maps: str = "/proc/self/maps") -> list[Library]:
    """The shared objects with CUDA kernels this process has mapped, by file name, with
    their digests (each file hashed once per process, several at a time)."""
    paths = set()
    try:
        text = Path(maps).read_text()
    except OSError:
        return []
    for line in text.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/") and ".so" in parts[5]:
            paths.add(parts[5].strip())
    with_kernels = [p for p in sorted(paths) if _has_kernels(p)]
    # hashlib lets go of the GIL while it hashes: the libraries (GBs: torch's, cuBLAS's) in parallel
    with ThreadPoolExecutor(max_workers=min(8, len(with_kernels) or 1)) as pool:
        digests = list(pool.map(_file_digest, with_kernels))
    libs = [Library(name=Path(p).name, digest=d, size=os.path.getsize(p)) for p, d in zip(with_kernels, digests)]
    return sorted(libs, key=lambda lib: lib.name)


def library_workspaces(
    pools: Mapping[str, object], snapshot: Iterable[dict] | None = None
) -> dict[str, tuple[int, int]]:
    """The library workspaces the executor's primed streams hold outside the ``pools``
    (name -> pool handle): ``restore_probe.stream_workspaces`` over ``snapshot`` (default:
    torch's now), name -> (address, bytes)."""
    import torch

    from .pool import pool_key
    from .streams import primed_streams

    snap = torch.cuda.memory_snapshot() if snapshot is None else snapshot
    return stream_workspaces(snap, primed_streams(), {pool_key(p) for p in pools.values()})


def current_environment(
    plan_digest: str,
    tensors: Mapping[str, object],
    pools: Mapping[str, object],
    workspaces: Mapping[str, tuple[int, int]] | None = None,
) -> GraphEnvironment:
    """This process's :class:`GraphEnvironment`: the device, driver, torch, the kernel libraries,
    ``tensors`` (name -> tensor) by storage size, ``pools`` (name -> pool handle) by
    their segments' sizes in address order, ``workspaces`` (name -> (address, bytes);
    default :func:`library_workspaces`) by size."""
    import torch

    from .device import driver_version
    from .pool import pool_segments

    spans = library_workspaces(pools) if workspaces is None else workspaces

    major, minor = torch.cuda.get_device_capability()
    return GraphEnvironment(
        plan_digest=plan_digest,
        device=torch.cuda.get_device_name(),
        capability=f"{major}.{minor}",
        driver=driver_version(),
        torch=torch_versions()[0],
        cuda=torch_versions()[1],
        libraries={lib.name: lib.digest for lib in kernel_libraries()},
        tensors={n: t.untyped_storage().nbytes() for n, t in tensors.items()},  # pyright: ignore[reportAttributeAccessIssue]
        pools={n: [size for _, size in pool_segments([p])] for n, p in pools.items()},
        workspaces={n: size for n, (_, size) in spans.items()},
    )


def torch_versions() -> tuple[str, str]:
    """(torch's version, its CUDA's) as plain strings: ``torch.__version__`` is a
    ``TorchVersion``, which msgpack does not encode (every save failed on the GPU)."""
    import torch

    return str(torch.__version__), str(torch.version.cuda)


class Segments:
    """The file's segments, named as addresses are found (module docstring): pools first,
    every segment of each (the layout a restore must match), then tensors, workspaces,
    torch, outside and host segments as the graphs point into them. Every lookup is a
    bisection (a save looks up every address of every kernel argument)."""

    def __init__(
        self,
        torch_segs: list[TorchSegment],
        pools: Mapping[str, tuple[int, int]],
        tensors: Mapping[str, tuple[int, int]],
        resolve,
        workspaces: Mapping[str, tuple[int, int]] | None = None,
    ):
        self.list: list[Segment] = []
        self._base: list[int] = []
        self._index: dict[tuple[str, int], int] = {}
        self.torch = torch_segs
        self._starts = [s.address for s in torch_segs]
        self.resolve = resolve
        by_pool = {tuple(v): k for k, v in pools.items()}
        counts: dict[str, int] = {}
        for s in torch_segs:
            if s.pool in by_pool:
                name = by_pool[s.pool]
                k = counts.get(name, 0)
                counts[name] = k + 1
                self._add(
                    ("pool", s.address),
                    Segment(name=f"pool:{name}/{k}", kind="pool", size=s.size, owner=name, index=k),
                    s.address,
                )
        # one storage under the first name, then the workspaces no tensor covers; sorted by address
        spans = {ptr: (ptr, size, "tensor", name) for name, (ptr, size) in sorted(tensors.items(), reverse=True)}
        for name, (ptr, size) in sorted((workspaces or {}).items()):
            spans.setdefault(ptr, (ptr, size, "workspace", name))
        self.spans = sorted(spans.values())
        self._span_starts = [s[0] for s in self.spans]
        # storages and blocks are disjoint allocations; where two overlap (a caller's own
        # spans), the lookup falls back to the first match in address order
        self._disjoint = all(a[0] + a[1] <= b[0] for a, b in zip(self.spans, self.spans[1:]))

    def _add(self, key: tuple[str, int], seg: Segment, base: int) -> int:
        if key not in self._index:
            self._index[key] = len(self.list)
            self.list.append(seg)
            self._base.append(base)
        return self._index[key]

    def _count(self, kind: str) -> int:
        return sum(s.kind == kind for s in self.list)

    def _span(self, addr: int) -> tuple[int, int, str, str] | None:
        if self._disjoint:
            i = bisect_right(self._span_starts, addr) - 1
            if i >= 0 and addr < self.spans[i][0] + self.spans[i][1]:
                return self.spans[i]
            return None
        return next((s for s in self.spans if s[0] <= addr < s[0] + s[1]), None)

    def operand(self, addr: int, host: bool = False) -> Operand:
        """(segment index, offset) of ``addr``, naming its segment on first use."""
        if host:
            i = self._add(("host", addr), Segment(name=f"host:{self._count('host')}", kind="host", size=0), addr)
            return Operand(segment=i, offset=0)
        seg = segment_of(addr, self.torch, self._starts)
        if seg is not None and ("pool", seg.address) in self._index:
            i = self._index[("pool", seg.address)]
            return Operand(segment=i, offset=addr - seg.address)
        span = self._span(addr)
        if span is not None:
            ptr, size, kind, name = span
            i = self._add((kind, ptr), Segment(name=f"{kind}:{name}", kind=kind, size=size, owner=name), ptr)  # pyright: ignore[reportArgumentType]
            return Operand(segment=i, offset=addr - ptr)
        if seg is not None:
            i = self._add(
                ("torch", seg.address),
                Segment(name=f"torch:{self._count('torch')}", kind="torch", size=seg.size),
                seg.address,
            )
            return Operand(segment=i, offset=addr - seg.address)
        base, size = self.resolve(addr) or (addr, 0)
        i = self._add(
            ("outside", base), Segment(name=f"outside:{self._count('outside')}", kind="outside", size=size), base
        )
        return Operand(segment=i, offset=addr - base)


def _kernel(k, segments: Segments, modules: dict[int, int], module_ids: list[Module], calls, where: str) -> Kernel:
    if k.name_rc or not k.name or k.module_rc or not k.module or k.params_rc:
        raise ExecutorError(
            f"kernel {k.name or hex(k.function)} cannot be saved: name CUresult {k.name_rc}, module CUresult "
            f"{k.module_rc}, parameter layout CUresult {k.params_rc}",
            where=where,
            fix="python -m bench.restore_floor prints which kernels the driver does not describe",
        )
    if k.module not in modules:
        digest, count = module_identity(k.module, calls, where=where)
        modules[k.module] = len(module_ids)
        module_ids.append(Module(digest=digest, functions=count))
    args = bytearray(k.args)
    relocs = []
    for pos, value in device_addresses(k.args, k.params, segments.resolve):
        op = segments.operand(value)
        relocs.append(Relocation(position=pos, segment=op.segment, offset=op.offset))
        args[pos : pos + 8] = bytes(8)
    return Kernel(
        name=k.name,
        module=modules[k.module],
        grid=k.grid,
        block=k.block,
        shared_bytes=k.shared_bytes,
        attributes=dict(k.attributes),
        params=list(k.params),
        args=bytes(args),
        relocations=relocs,
        tensor_maps=tensor_map_params(k.params),
    )


#: a graph file's record of a node's parameters (Memset, Copy)
_R = TypeVar("_R", Memset, Copy)


def _relocated(node, record: type[_R], **operands: Operand) -> _R:
    """The file's ``record`` (Memset, Copy) of a walked ``node``: every field read from the
    node by its name, but the address ``operands``, given named by segment and offset."""
    fields: dict[str, object] = {f: getattr(node, f) for f in record.__struct_fields__}
    return record(**{**fields, **operands})  # pyright: ignore[reportArgumentType]  (read by name: the walk's types)


def build_file(
    walked: Iterable[tuple[str, int, WalkedGraph]], segments: Segments, valid_for: ValidFor, calls=None
) -> GraphFile:
    """The graph file of ``walked`` graphs ((phase, bs, walk)), addresses named by ``segments``."""
    modules: dict[int, int] = {}
    module_ids: list[Module] = []
    graphs = []
    for phase, bs, w in walked:
        nodes = []
        for i, n in enumerate(w.nodes):
            where = f"graph {phase}/{bs} node {i}"
            if n.kernel is not None:
                nodes.append(Node(type=n.type, kernel=_kernel(n.kernel, segments, modules, module_ids, calls, where)))
            elif n.memset is not None:
                memset = _relocated(n.memset, Memset, dst=segments.operand(n.memset.dst))
                nodes.append(Node(type=n.type, memset=memset))
            elif n.copy is not None:
                c = n.copy
                if (
                    "array" in (c.src_type, c.dst_type)
                    or c.src_type.startswith("type-")
                    or c.dst_type.startswith("type-")
                ):
                    raise ExecutorError(
                        f"a copy between {c.src_type} and {c.dst_type} memory cannot be saved", where=where
                    )
                if c.offset_beyond_x:  # its operands would be relocated from the wrong base
                    raise ExecutorError("a copy with a Y, Z or LOD offset cannot be saved", where=where)
                src, dst = segments.operand(c.src, c.src_type == "host"), segments.operand(c.dst, c.dst_type == "host")
                copy = _relocated(c, Copy, src=src, dst=dst)
                nodes.append(Node(type=n.type, copy=copy))
            elif n.type in _PLAIN:
                nodes.append(Node(type=n.type))
            else:
                raise ExecutorError(f"a {n.type} node cannot be saved in a graph file", where=where)
        graphs.append(Graph(phase=phase, bs=bs, nodes=nodes, edges=list(w.edges)))
    return GraphFile(valid_for=valid_for, segments=segments.list, modules=module_ids, graphs=graphs)


def graph_tensors(gs, target: object = None, tensors: Mapping | None = None) -> dict[str, object]:
    """The tensors a graph file names: the target's (:func:`named_tensors`), the GraphSet's
    hoisted workspaces (``workspace.PHASE``), then ``tensors`` (name -> tensor) on top."""
    named = named_tensors(target) if target is not None else {}
    named.update({f"workspace.{phase}": t for phase, t in sorted(gs.workspaces.items())})
    named.update(dict(tensors or {}))
    return named


def save_graphs(
    gs,
    plan,
    target: object = None,
    path: str | Path | None = None,
    tensors: Mapping | None = None,
    calls=None,
    *,
    walked: list | None = None,
    timings: dict | None = None,
) -> GraphFile:
    """The graph file of the GraphSet ``gs`` captured for ``plan``, written to ``path`` when
    given. Tensors are named from ``target`` (:func:`named_tensors`) and ``tensors``
    (name -> tensor, on top); the library workspaces of the executor's streams by
    :func:`library_workspaces`. ``walked``: the graphs' walk where the caller made it
    already (``restore_probe.walk_graphs``: the probe's); ``timings``: filled with the
    seconds of each part (``libraries``, ``walk``, ``build``, ``write``). Call it with the
    graphs, pools and tensors alive."""
    import torch

    from .pool import pool_key

    t = timings if timings is not None else {}
    t0 = time.perf_counter()
    libs = kernel_libraries()
    t.update(libraries=time.perf_counter() - t0)
    named = graph_tensors(gs, target, tensors)
    snapshot = torch.cuda.memory_snapshot()
    workspaces = library_workspaces(gs.pools, snapshot)
    env = current_environment(plan.digest, named, gs.pools, workspaces)
    valid = ValidFor(
        plan_digest=env.plan_digest,
        device=env.device,
        capability=env.capability,
        driver=env.driver,
        torch=env.torch,
        cuda=env.cuda,
        libraries=libs,
    )
    segments = torch_segments(snapshot)
    resolve = AddressResolver(calls, known=segments)
    spans = {n: (t_.untyped_storage().data_ptr(), t_.untyped_storage().nbytes()) for n, t_ in named.items()}  # pyright: ignore[reportAttributeAccessIssue]
    segs = Segments(segments, {n: pool_key(p) for n, p in gs.pools.items()}, spans, resolve, workspaces)
    t0 = time.perf_counter()
    graphs = walked if walked is not None else walk_graphs(gs, calls)
    t.update(walk=time.perf_counter() - t0 if walked is None else 0.0)
    t0 = time.perf_counter()
    file = build_file(graphs, segs, valid, calls)
    t.update(build=time.perf_counter() - t0)
    t0 = time.perf_counter()
    if path is not None:
        write_atomic(path, encode(file))
    t.update(write=time.perf_counter() - t0)
    return file


def encode(file: GraphFile) -> bytes:
    """The file's bytes: msgpack (argument bytes stay binary)."""
    return msgspec.msgpack.encode(file)


def read_graph_file(path: str | Path) -> GraphFile:
    """A graph file, refused in one line where it is not one, of another version, or damaged."""
    data = read_input(path, "graph file")
    where = str(path)
    try:
        head = msgspec.msgpack.decode(data, type=FileHead)
    except msgspec.DecodeError as err:
        raise InputError(f"not a graph file ({err})", where=where, fix="pass a file save_graphs wrote") from None
    if head.kind != GRAPH_FILE_KIND:
        raise InputError(f"not a graph file (kind {head.kind!r})", where=where, fix="pass a file save_graphs wrote")
    if head.version != GRAPH_FILE_VERSION:
        raise InputError(
            f"graph file version {head.version}, this capture-plan reads version {GRAPH_FILE_VERSION}",
            where=where,
            fix="save the graphs again with this capture-plan",
        )
    try:
        return msgspec.msgpack.decode(data, type=GraphFile)
    except msgspec.DecodeError as err:
        raise InputError(f"a damaged graph file ({err})", where=where, fix="save the graphs again") from None


def describe(file: GraphFile, size: int | None = None) -> list[str]:
    """What ``file`` holds and what it is valid for, a few lines."""
    v = file.valid_for
    nodes = [n for g in file.graphs for n in g.nodes]
    kinds: dict[str, int] = {}
    for n in nodes:
        kinds[n.type] = kinds.get(n.type, 0) + 1
    relocs = sum(len(n.kernel.relocations) for n in nodes if n.kernel is not None)
    tmaps = sum(len(n.kernel.tensor_maps) for n in nodes if n.kernel is not None)
    seg_kinds: dict[str, int] = {}
    for s in file.segments:
        seg_kinds[s.kind] = seg_kinds.get(s.kind, 0) + 1
    uses = segment_uses(file)
    stuck = [
        file.segments[i].name
        for i in sorted(uses)
        if i < len(file.segments) and file.segments[i].kind not in RELOCATABLE
    ]
    lines = [
        f"graph file version {GRAPH_FILE_VERSION}" + (f", {size:,} bytes" if size is not None else ""),
        f"valid for: plan {v.plan_digest}; device {v.device} (compute capability {v.capability}); driver {v.driver}; "
        f"torch {v.torch} (CUDA {v.cuda}); {len(v.libraries)} kernel libraries",
        *(f"  library {lib.name} {lib.digest} ({lib.size:,} B)" for lib in v.libraries),
        f"holds: {len(file.graphs)} graphs, {len(nodes)} nodes ("
        + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
        + f"), {len(file.modules)} modules, {relocs} relocated argument addresses, {tmaps} TMA-shaped parameters",
        "segments: " + ", ".join(f"{k} {n}" for k, n in sorted(seg_kinds.items())),
        "not relocatable: " + (", ".join(stuck) if stuck else "none"),
    ]
    return lines


#: the commands of ``python -m capture_plan.executor.graph_file``
_COMMANDS = frozenset({"inspect"})


def main(argv: list[str] | None = None) -> int:
    """``python -m capture_plan.executor.graph_file inspect FILE``."""
    args = sys.argv[1:] if argv is None else argv
    # a match, not `args[0] == "inspect"`: bench/torch_entry_points.py reads a constant this module
    # compares with as a memory-snapshot key, since the module takes a snapshot
    if len(args) != 2 or args[0] not in _COMMANDS:
        print("usage: python -m capture_plan.executor.graph_file inspect FILE", file=sys.stderr)
        return 2
    try:
        file = read_graph_file(args[1])
    except InputError as err:
        print(f"graph_file: {err}", file=sys.stderr)
        return err.exit_code
    for line in describe(file, Path(args[1]).stat().st_size):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
