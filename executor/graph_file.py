"""Writing and inspecting a graph file (``capture_plan.schemas.graph_file``): a capture's graphs, relocatable.

:func:`save_graphs` walks every graph of a GraphSet through the driver
(``capture_plan.executor.graph_walk``) right after ``capture()``, while the graphs, the
pools and the target's tensors are alive, and writes the file: every device address in a
kernel's arguments and in a memset's or copy's operands rewritten as (segment, offset),
segments named by owner (the plan's pools by the plan's pool names and the segment's place
in address order, the target's tensors by name: ``graph_env.named_tensors``), what a
GraphSet serves each graph with (its pool, key, outputs held: ``Graph.outputs``), and what
the file is valid for (``graph_env.current_environment``; the kernel libraries:
``graph_env.kernel_libraries``). ``python -m capture_plan.executor.graph_file inspect FILE
[--plan PLAN]`` prints what a file holds, what it is valid for and what a restore would
refuse in it from the file alone (and against the plan): no GPU.

Kernel binaries are not in the file. Each kernel is named by its function name and its
module's identity (a digest of the module's function names:
``graph_walk.module_identity``), and the file carries the digests of the libraries the
saving process had mapped (with each file's identity, so that a restore on the same machine
need not hash them again). A restore (``capture_plan.executor.graph_restore``) gets every kernel
back from the restoring process itself: the target's own eager runs load the modules, and
each kernel is fetched by module identity and name (``capture_plan.executor.kernel_loading``),
the function attributes its library set before a first launch (recorded per function here,
``GraphFile.functions``) set on it again.
Binaries extracted at save time (CUPTI's module-load callback) or listed from a library
(``cuobjdump``) are not loaded: a kernel is code, and no restore loads code from a file.

Constraints: a kernel whose name, module or parameter layout the driver does not give, an
array operand of a copy, or a node of a type other than kernel, memset, copy or empty
stops the save with an :class:`ExecutorError` naming the graph and node (a file that could
not be restored is never written). Addresses outside every restorable segment are saved
(as ``torch:K``, ``outside:K``, ``host:K``) so that ``check_valid`` names them.
"""

from __future__ import annotations

import sys
import time
from bisect import bisect_right
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TypeVar

import msgspec

from capture_plan.schemas.errors import InputError
from capture_plan.schemas.files import write_atomic
from capture_plan.schemas.graph_file import (
    GRAPH_FILE_VERSION,
    RELOCATABLE,
    Copy,
    Function,
    Graph,
    GraphFile,
    Kernel,
    Memset,
    Module,
    Node,
    Operand,
    Output,
    Relocation,
    Segment,
    ValidFor,
    encode,
    read_graph_file,
)

from .errors import ExecutorError
from .graph_env import current_environment, graph_tensors, kernel_libraries, library_workspaces
from .graph_validity import segment_uses
from .graph_walk import AddressResolver, WalkedGraph, device_addresses, module_identity, tensor_map_params
from .kernel_loading import FIXED_ATTRIBUTES, function_attributes
from .restore_probe import TorchSegment, segment_of, torch_segments, walk_graphs

__all__ = [
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


class Segments:
    """The file's segments, named as addresses are found (module docstring): pools first,
    every segment of each (the layout a restore must match), then the engine's ranges,
    tensors, workspaces, torch, outside and host segments as the graphs point into them.
    Every lookup is a bisection (a save looks up every address of every kernel argument).

    ``engine``: ranges of memory the engine owns outside torch's allocator, name ->
    (address, bytes) (vLLM's cuMem-backed KV cache). Every argument word inside one is an
    address of it, whether the driver resolves it or not (a reserved range is mapped only in
    part while graphs are captured: a word into its unmapped part is an address all the
    same); a tensor inside one is named by the range (vLLM's KV views over the reservation)."""

    def __init__(
        self,
        torch_segs: list[TorchSegment],
        pools: Mapping[str, tuple[int, int]],
        tensors: Mapping[str, tuple[int, int]],
        resolve,
        workspaces: Mapping[str, tuple[int, int]] | None = None,
        engine: Mapping[str, tuple[int, int]] | None = None,
    ):
        self.list: list[Segment] = []
        self._base: list[int] = []
        self._index: dict[tuple[str, int], int] = {}
        self.torch = torch_segs
        self._starts = [s.address for s in torch_segs]
        self.engine = sorted((ptr, size, name) for name, (ptr, size) in (engine or {}).items() if size > 0)
        self._engine_starts = [e[0] for e in self.engine]
        self.resolve = _EngineFirst(resolve, self._in_engine) if self.engine else resolve
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
            self.list.append(msgspec.structs.replace(seg, address=base))  # for the stale-word check alone
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

    def _in_engine(self, addr: int) -> tuple[int, int, str] | None:
        i = bisect_right(self._engine_starts, addr) - 1
        if i >= 0 and addr < self.engine[i][0] + self.engine[i][1]:
            return self.engine[i]
        return None

    def operand(self, addr: int, host: bool = False) -> Operand:
        """(segment index, offset) of ``addr``, naming its segment on first use."""
        if host:
            i = self._add(("host", addr), Segment(name=f"host:{self._count('host')}", kind="host", size=0), addr)
            return Operand(segment=i, offset=0)
        seg = segment_of(addr, self.torch, self._starts)
        if seg is not None and ("pool", seg.address) in self._index:
            i = self._index[("pool", seg.address)]
            return Operand(segment=i, offset=addr - seg.address)
        rng = self._in_engine(addr) if self.engine else None
        if rng is not None:
            ptr, size, name = rng
            i = self._add(("engine", ptr), Segment(name=f"engine:{name}", kind="engine", size=size, owner=name), ptr)
            return Operand(segment=i, offset=addr - ptr)
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


class _EngineFirst:
    """A resolver that takes every word inside one of the engine's ranges for an address (its
    range: (base, bytes)) before asking ``resolve`` (the driver, through the known segments)."""

    def __init__(self, resolve, in_engine):
        self._resolve, self._in_engine = resolve, in_engine

    def __call__(self, value: int) -> tuple[int, int] | None:
        rng = self._in_engine(value)
        return (rng[0], rng[1]) if rng is not None else self._resolve(value)


def _attribute_calls(calls) -> dict:
    """``cuFuncGetAttribute`` from ``calls`` (driver calls given to the save), else the driver's."""
    from . import libcuda

    got = calls if calls is not None and "cuFuncGetAttribute" in calls else libcuda.calls("cuFuncGetAttribute")
    if isinstance(got, str):
        raise ExecutorError(f"the kernels' attributes cannot be read: {got}", where="save_graphs")
    return got


def _kernel(
    k,
    segments: Segments,
    modules: dict[int, int],
    module_ids: list[Module],
    calls,
    where: str,
    functions: dict[tuple[int, str], Function] | None = None,
) -> Kernel:
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
    if functions is not None and (modules[k.module], k.name) not in functions:
        # what a restore that fetches the kernel by name must set on it (kernel_loading.FUNCTION_ATTRIBUTES)
        got = _attribute_calls(calls)
        attributes = function_attributes(k.function, got)
        fixed = function_attributes(k.function, got, FIXED_ATTRIBUTES)  # twins told apart by them
        functions[(modules[k.module], k.name)] = Function(
            module=modules[k.module], name=k.name, attributes=attributes, fixed=fixed
        )
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


def _served(cap, segments: Segments) -> dict:
    """What a GraphSet serves graph ``cap`` (a ``Captured``) with, as a :class:`Graph`'s fields:
    its pool, how its outputs are held and their rows, its key, each output where it lies."""
    outputs = [
        Output(
            at=segments.operand(t.data_ptr()) if t.numel() else None,
            dtype=str(t.dtype).removeprefix("torch."),
            shape=list(t.shape),
            stride=list(t.stride()),
        )
        for t in cap.outputs
    ]
    rows = list(cap.rows) if cap.rows is not None else None
    labels = [tuple(pair) for pair in cap.labels]
    return dict(pool=cap.pool, held=cap.held, rows=rows, key_phase=cap.key_phase, labels=labels, piece=cap.piece,
                outputs=outputs)  # fmt: skip


def build_file(
    walked: Iterable[tuple[str, int, WalkedGraph]],
    segments: Segments,
    valid_for: ValidFor,
    calls=None,
    served: Mapping | None = None,
) -> GraphFile:
    """The graph file of ``walked`` graphs ((phase, bs, walk)), addresses named by ``segments``;
    ``served``: the GraphSet's graphs ((phase, bs) -> ``Captured``), whose pools, keys and
    outputs the file records (a graph not in it is recorded without them)."""
    modules: dict[int, int] = {}
    module_ids: list[Module] = []
    functions: dict[tuple[int, str], Function] = {}
    graphs = []
    for phase, bs, w in walked:
        nodes = []
        for i, n in enumerate(w.nodes):
            where = f"graph {phase}/{bs} node {i}"
            if n.kernel is not None:
                kernel = _kernel(n.kernel, segments, modules, module_ids, calls, where, functions)
                nodes.append(Node(type=n.type, kernel=kernel))
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
        cap = (served or {}).get((phase, bs))
        extra = _served(cap, segments) if cap is not None else {}
        graphs.append(Graph(phase=phase, bs=bs, nodes=nodes, edges=list(w.edges), **extra))
    return GraphFile(
        valid_for=valid_for,
        segments=segments.list,
        modules=module_ids,
        functions=list(functions.values()),
        graphs=graphs,
    )


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
    engine: Mapping[str, tuple[int, int]] | None = None,
) -> GraphFile:
    """The graph file of the GraphSet ``gs`` captured for ``plan``, written to ``path`` when
    given. Tensors are named from ``target`` (``graph_env.named_tensors``) and ``tensors``
    (name -> tensor, on top); the library workspaces of the executor's streams by
    ``graph_env.library_workspaces``; ``engine``: the engine's ranges of memory outside
    torch's allocator, name -> (address, bytes) (:class:`Segments`: ``engine:NAME``
    segments, which a restore relocates to the range its caller names alike). ``walked``: the
    graphs' walk where the caller made it already (``restore_probe.walk_graphs``: the probe's);
    ``timings``: filled with the seconds of each part (``libraries``, ``walk``, ``build``,
    ``write``). Call it with the graphs, pools and tensors alive."""
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
    valid = ValidFor(**msgspec.structs.asdict(env.runtime), libraries=libs)
    segments = torch_segments(snapshot)
    resolve = AddressResolver(calls, known=segments)
    spans = {n: (t_.untyped_storage().data_ptr(), t_.untyped_storage().nbytes()) for n, t_ in named.items()}  # pyright: ignore[reportAttributeAccessIssue]
    segs = Segments(segments, {n: pool_key(p) for n, p in gs.pools.items()}, spans, resolve, workspaces, engine)
    t0 = time.perf_counter()
    graphs = walked if walked is not None else walk_graphs(gs, calls)
    t.update(walk=time.perf_counter() - t0 if walked is None else 0.0)
    t0 = time.perf_counter()
    file = build_file(graphs, segs, valid, calls, gs.graphs)
    t.update(build=time.perf_counter() - t0)
    t0 = time.perf_counter()
    if path is not None:
        write_atomic(path, encode(file))
    t.update(write=time.perf_counter() - t0)
    return file


def describe(file: GraphFile, size: int | None = None) -> list[str]:
    """What ``file`` holds and what it is valid for, a few lines."""
    v = file.valid_for
    nodes = [n for g in file.graphs for n in g.nodes]
    kinds: dict[str, int] = {}
    for n in nodes:
        kinds[n.type] = kinds.get(n.type, 0) + 1
    relocs = sum(len(n.kernel.relocations) for n in nodes if n.kernel is not None)
    outputs = sum(len(g.outputs) for g in file.graphs)
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
        + f"), {len(file.modules)} modules, {len(file.functions)} kernel functions, {relocs} relocated argument "
        f"addresses, {tmaps} TMA-shaped parameters, "
        f"{outputs} outputs",
        "segments: " + ", ".join(f"{k} {n}" for k, n in sorted(seg_kinds.items())),
        "not relocatable: " + (", ".join(stuck) if stuck else "none"),
    ]
    return lines


#: the commands of ``python -m capture_plan.executor.graph_file``
_COMMANDS, _PLAN_FLAG = frozenset({"inspect"}), frozenset({"--plan"})
_USAGE = "usage: python -m capture_plan.executor.graph_file inspect FILE [--plan PLAN]"


def main(argv: list[str] | None = None) -> int:
    """``python -m capture_plan.executor.graph_file inspect FILE [--plan PLAN]``: what the file
    holds, what it is valid for, and every reason a restore refuses it that needs no process
    (``restore.inspect_refusals``: the file alone, and against PLAN where given). Exit 0, or
    1 where the file or the plan cannot be read, or PLAN is given and a restore refuses."""
    args = sys.argv[1:] if argv is None else argv
    # matches, not `args[0] == "inspect"`: bench/torch_entry_points.py reads a constant this module
    # compares with as a memory-snapshot key, since the module takes a snapshot
    plan_path = args[3] if len(args) == 4 and args[2] in _PLAN_FLAG else None
    if len(args) not in (2, 4) or args[0] not in _COMMANDS or (len(args) == 4 and plan_path is None):
        print(_USAGE, file=sys.stderr)
        return 2
    from .load import load_plan
    from .restore_checks import inspect_refusals

    try:
        file = read_graph_file(args[1])
        plan = load_plan(plan_path, check_env=False) if plan_path is not None else None
    except InputError as err:
        print(f"graph_file: {err}", file=sys.stderr)
        return err.exit_code
    for line in describe(file, Path(args[1]).stat().st_size):
        print(line)
    refused = inspect_refusals(file, plan)
    against = f" and the plan {plan_path}" if plan_path is not None else ""
    print(f"a restore refuses (from the file alone{against}): {f'{len(refused)} reason(s)' if refused else 'nothing'}")
    for line in refused[:20]:
        print(f"  {line}")
    if len(refused) > 20:
        print(f"  ... {len(refused) - 20} more")
    print(f"graph builder here: {_builder_here()}")
    return 1 if refused and plan is not None else 0


def _builder_here() -> str:
    """The graph builder a restore here would add the nodes with (``graph_flat.graph_builder``)."""
    from .graph_flat import graph_builder

    try:
        return graph_builder().describe()
    except ExecutorError as err:
        return f"none ({err.what})"


if __name__ == "__main__":
    sys.exit(main())
