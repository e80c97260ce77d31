"""The restore probe: where a capture's graphs point, and the floor a restore cannot beat.

A restore (issue 51, docs/restore.md) rebuilds a plan's graphs in a fresh process with every
device address in their arguments relocated. This module measures what that needs, on the
graphs of a capture (:func:`probe_graphs`): per kernel node whether its name, module and
parameter layout resolve, every device address in its arguments classified
(:func:`classify`) as inside a segment of the plan's pools (``pool``), inside another
segment of torch's caching allocator (``torch``: weights, KV cache, workspaces) or outside
every segment (``outside``: memory a restore could not relocate by (segment, offset)), and
the parameters shaped like a TMA descriptor. Memset and copy operands are classified apart
(``operands``). :func:`clone_floor` times ``cuGraphClone`` + ``cuGraphInstantiateWithFlags`` +
``cuGraphUpload`` of every graph: no file, no kernel loading, no relocation, so a floor,
not a restore.

The counting (:func:`count_graphs`, :func:`classify`) is plain data: the caller passes torch's
snapshot and the walked graphs, and the tests pass fakes.
"""

from __future__ import annotations

import ctypes
import time
from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from . import libcuda
from .errors import ExecutorError
from .graph_walk import (
    AddressResolver,
    FunctionCache,
    WalkedGraph,
    device_addresses,
    tensor_map_params,
    walk_graph,
)

__all__ = [
    "TorchSegment",
    "torch_segments",
    "segment_of",
    "stream_workspaces",
    "classify",
    "ProbeCounts",
    "count_graphs",
    "raw_graphs",
    "walk_graphs",
    "probe_graphs",
    "clone_floor",
    "summary_line",
]

CLASSES = ("pool", "torch", "outside")


@dataclass(frozen=True, order=True)
class TorchSegment:
    """A caching-allocator segment: its address, bytes and pool id ((0, 0): the ordinary allocator)."""

    address: int
    size: int
    pool: tuple[int, int] = (0, 0)


def torch_segments(snapshot: Iterable[dict]) -> list[TorchSegment]:
    """The segments of ``torch.cuda.memory_snapshot()``, sorted by address."""
    out = []
    for s in snapshot:
        a, b = s.get("segment_pool_id") or (0, 0)
        out.append(TorchSegment(int(s["address"]), int(s["total_size"]), (int(a), int(b))))
    return sorted(out)


def segment_of(addr: int, segments: list[TorchSegment], starts: list[int] | None = None) -> TorchSegment | None:
    """The segment of ``segments`` (sorted) holding ``addr``, or None. ``starts``: the
    segments' addresses, passed by a caller that looks up many addresses (a save looks up
    every address of every kernel argument: building the list per call made it quadratic)."""
    i = bisect_right(starts if starts is not None else [s.address for s in segments], addr) - 1
    if i >= 0 and addr < segments[i].address + segments[i].size:
        return segments[i]
    return None


#: the least bytes of a block taken for a library's workspace: cuBLAS's and cuBLASLt's are MiBs
WORKSPACE_LEAST = 64 << 10


def stream_workspaces(
    snapshot: Iterable[dict], streams: dict[int, str], pools: set[tuple[int, int]]
) -> dict[str, tuple[int, int]]:
    """The library workspaces the ``streams`` (``cudaStream_t`` -> name:
    ``capture_plan.executor.streams.primed_streams``) hold: every allocated block of at least
    :data:`WORKSPACE_LEAST` bytes of a caching-allocator segment made for one of them outside
    every pool of ``pools``, named ``NAME/K`` (its K-th such block, the largest first, then in
    address order) -> (address, bytes).

    What this names: cuBLAS's workspace (one per handle and stream, made by ``prime_stream``
    and kept for the life of the process: 32 MiB on sm90) and cuBLASLt's where a GEMM with a
    bias made one. The executor's streams are its own, so eager work on them outside the
    pools is the priming and the warm-ups, whose tensors are freed; a tensor the target
    allocated on such a stream in a warm-up and kept is named here too unless a name of the
    target covers it first (the file looks tensors up before workspaces), and a restore that
    lays the workspace out anew then differs from the capture: its replay check says so.

    What it leaves unnamed: torch's graph-safe RNG state, two 8-byte tensors torch allocates
    on the capture stream at a first capture, which graphs that sample read and torch
    advances at every replay. Named, a restore would relocate such a graph onto another
    process's state (or refuse it only where none is alive); unnamed, it is a ``torch:K``
    segment, which every restore refuses. Largest first: the workspace keeps its name
    wherever the small blocks lie."""
    found: dict[str, list[tuple[int, int]]] = {}
    for seg in snapshot:
        name = streams.get(int(seg.get("stream") or 0))
        pool = tuple(int(x) for x in (seg.get("segment_pool_id") or (0, 0)))
        if name is None or pool in pools:
            continue
        for b in seg.get("blocks", ()):
            if b.get("state") == "active_allocated" and int(b["size"]) >= WORKSPACE_LEAST:
                found.setdefault(name, []).append((int(b["address"]), int(b["size"])))
    return {
        f"{name}/{k}": span
        for name, spans in found.items()
        for k, span in enumerate(sorted(spans, key=lambda s: (-s[1], s[0])))
    }


def classify(
    addr: int, segments: list[TorchSegment], pools: set[tuple[int, int]], starts: list[int] | None = None
) -> str:
    """ "pool" (a segment of one of ``pools``), "torch" (another segment) or "outside"."""
    seg = segment_of(addr, segments, starts)
    if seg is None:
        return "outside"
    return "pool" if seg.pool in pools else "torch"


@dataclass
class ProbeCounts:
    graphs: int = 0
    nodes: int = 0
    kernel_nodes: int = 0
    memset_nodes: int = 0
    copy_nodes: int = 0
    other_nodes: int = 0
    #: the most nodes of one graph
    largest_graph: int = 0
    #: kernel nodes whose name, module, parameter layout the driver gave
    names: int = 0
    modules: int = 0
    layouts: int = 0
    #: distinct modules the kernels come from
    distinct_modules: int = 0
    #: device addresses in kernel arguments, per class (CLASSES)
    addresses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))
    #: memset and copy operands on the device, per class
    operands: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))
    #: copy operands in host memory
    host_operands: int = 0
    #: parameters shaped like a CUtensorMap, and the kernel nodes that have one
    tensor_map_params: int = 0
    tensor_map_kernels: int = 0
    #: a few kernel names with a TMA-shaped parameter, and of kernels with an outside address
    tensor_map_names: list[str] = field(default_factory=list)
    outside_names: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def count_graphs(
    walked: Iterable[WalkedGraph],
    resolve,
    segments: list[TorchSegment],
    pools: set[tuple[int, int]],
    examples: int = 5,
) -> ProbeCounts:
    """The probe's counts over ``walked`` graphs; ``resolve(value)`` says whether a value is a
    device address (:class:`~capture_plan.executor.graph_walk.AddressResolver`)."""
    c = ProbeCounts()
    modules: set[int] = set()
    starts = [s.address for s in segments]
    for g in walked:
        c.graphs += 1
        c.nodes += len(g.nodes)
        c.largest_graph = max(c.largest_graph, len(g.nodes))
        for n in g.nodes:
            if n.kernel is not None:
                k = n.kernel
                c.kernel_nodes += 1
                c.names += k.name_rc == 0 and bool(k.name)
                c.modules += k.module_rc == 0 and bool(k.module)
                c.layouts += k.params_rc == 0
                if k.module_rc == 0 and k.module:
                    modules.add(k.module)
                outside = False
                for _, v in device_addresses(k.args, k.params, resolve):
                    cls = classify(v, segments, pools, starts)
                    c.addresses[cls] += 1
                    outside |= cls == "outside"
                if outside and len(c.outside_names) < examples and k.name not in c.outside_names:
                    c.outside_names.append(k.name)
                tm = tensor_map_params(k.params)
                c.tensor_map_params += len(tm)
                c.tensor_map_kernels += bool(tm)
                if tm and len(c.tensor_map_names) < examples and k.name not in c.tensor_map_names:
                    c.tensor_map_names.append(k.name)
            elif n.memset is not None:
                c.memset_nodes += 1
                c.operands[classify(n.memset.dst, segments, pools, starts)] += 1
            elif n.copy is not None:
                c.copy_nodes += 1
                for kind, addr in ((n.copy.src_type, n.copy.src), (n.copy.dst_type, n.copy.dst)):
                    if kind == "host":
                        c.host_operands += 1
                    else:
                        c.operands[classify(addr, segments, pools, starts)] += 1
            else:
                c.other_nodes += 1
    c.distinct_modules = len(modules)
    return c


def raw_graphs(gs) -> list[tuple[str, int, int]]:
    """(phase, bs, ``cudaGraph_t``) of every graph of a GraphSet, in capture order; an
    ExecutorError for a graph recorded without ``keep_graph=True`` (nothing to read)."""
    out = []
    for (phase, bs), cap in sorted(gs.graphs.items(), key=lambda kv: kv[1].order):
        try:
            raw = cap.graph.raw_cuda_graph()
        except (RuntimeError, AttributeError) as err:
            raise ExecutorError(
                f"graph {phase}/{bs} keeps no cudaGraph_t ({err})",
                where="restore probe",
                fix="capture with the executor on torch 2.8 or newer (it records with keep_graph=True)",
            ) from None
        out.append((phase, bs, int(raw)))
    return out


def walk_graphs(gs, calls: dict | None = None) -> list[tuple[str, int, WalkedGraph]]:
    """(phase, bs, walk) of every graph of the GraphSet ``gs``, in capture order: one walk
    that the probe and the graph file share (``graph_file.save_graphs(walked=...)``), the
    kernels' names, modules and layouts read once per function."""
    cache = FunctionCache()
    return [
        (phase, bs, walk_graph(raw, calls, where=f"graph {phase}/{bs}", cache=cache))
        for phase, bs, raw in raw_graphs(gs)
    ]


def probe_graphs(
    gs, snapshot: Iterable[dict], calls: dict | None = None, walked: list[tuple[str, int, WalkedGraph]] | None = None
) -> ProbeCounts:
    """The probe's counts for every graph of the GraphSet ``gs``, against ``snapshot``
    (``torch.cuda.memory_snapshot()`` taken with the graphs alive); ``walked``: the graphs'
    walk (:func:`walk_graphs`) where the caller has it already."""
    from .pool import pool_key

    segments = torch_segments(snapshot)
    pools = {pool_key(p) for p in gs.pools.values()}
    resolve = AddressResolver(calls, known=segments)
    graphs = walked if walked is not None else walk_graphs(gs, calls)
    return count_graphs((w for _, _, w in graphs), resolve, segments, pools)


def clone_floor(raws: list[int], stream: int, calls: dict | None = None) -> tuple[float, int]:
    """Seconds to clone, instantiate and upload every graph of ``raws`` on ``stream`` (a
    ``CUstream``), the stream synchronized at the end, and the graphs done; everything made
    is destroyed afterwards, outside the timing. Every CUresult is checked (an
    ExecutorError naming the call and the graph)."""
    names = ("cuGraphClone", "cuGraphInstantiateWithFlags", "cuGraphUpload", "cuGraphExecDestroy", "cuGraphDestroy")
    d = calls if calls is not None else libcuda.calls(*names, "cuStreamSynchronize")
    if isinstance(d, str):
        raise ExecutorError(f"the clone floor cannot run: {d}", where="restore probe")
    clones: list[ctypes.c_void_p] = []
    execs: list[ctypes.c_void_p] = []
    s = ctypes.c_void_p(stream)
    try:
        t0 = time.perf_counter()
        for i, raw in enumerate(raws):
            c, e = ctypes.c_void_p(), ctypes.c_void_p()
            _check(d["cuGraphClone"](ctypes.byref(c), ctypes.c_void_p(raw)), "cuGraphClone", i)
            clones.append(c)
            _check(d["cuGraphInstantiateWithFlags"](ctypes.byref(e), c, 0), "cuGraphInstantiateWithFlags", i)
            execs.append(e)
            _check(d["cuGraphUpload"](e, s), "cuGraphUpload", i)
        _check(d["cuStreamSynchronize"](s), "cuStreamSynchronize", len(raws))
        seconds = time.perf_counter() - t0
    finally:
        for e in execs:
            d["cuGraphExecDestroy"](e)
        for c in clones:
            d["cuGraphDestroy"](c)
    return seconds, len(execs)


def _check(rc: int, call: str, graph: int) -> None:
    if rc != 0:
        raise ExecutorError(f"{call} failed (CUresult {rc}) on graph {graph}", where="restore probe: the clone floor")


def summary_line(case: str, c: ProbeCounts, floor_s: float | None, capture_s: float | None) -> str:
    """One line per case: graphs, nodes, kernel nodes, addresses per class, tensor-map
    parameters, the floor against the capture."""
    a = c.addresses
    ratio = f"{floor_s / capture_s:.2f}x" if floor_s is not None and capture_s else "n/a"
    floor = f"{floor_s:.3f}" if floor_s is not None else "n/a"
    cap = f"{capture_s:.3f}" if capture_s is not None else "n/a"
    return (
        f"{case}: {c.graphs} graphs, {c.nodes} nodes ({c.kernel_nodes} kernel, {c.memset_nodes} memset, "
        f"{c.copy_nodes} copy, {c.other_nodes} other; largest {c.largest_graph}), resolved name/module/layout "
        f"{c.names}/{c.modules}/{c.layouts} of {c.kernel_nodes}, addresses pool/other-torch/outside "
        f"{a['pool']}/{a['torch']}/{a['outside']}, tensor-map params {c.tensor_map_params} "
        f"(in {c.tensor_map_kernels} kernels), clone+instantiate+upload {floor} s vs capture {cap} s ({ratio})"
    )
