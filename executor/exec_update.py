"""Executables shared between graphs of one phase, switched with ``cuGraphExecUpdate``.

A phase planned with ``reuse = "exec-update"`` records its graphs with
``keep_graph=True`` as always; instead of instantiating each, :class:`SharedExecs`
describes its nodes through the driver API (:func:`describe`, a torch-free
:class:`~capture_plan.executor.exec_reuse.GraphDesc`), places it in a group of
structurally identical graphs (:class:`~capture_plan.executor.exec_reuse.ReuseGroups`)
and instantiates only a group's first graph. A member joins only once an update of the
group's executable to it succeeds (the driver's own check, on top of the structure
check); before a member replays, the executable is updated to its graph when another
member replayed last, and the update's result is checked (an :class:`ExecutorError`,
never a launch of a half-updated executable).

Constraints: replays go through ``cuGraphLaunch`` on the current stream, not torch's
``CUDAGraph.replay``, so a graph that draws random numbers from torch's CUDA generator
would replay its capture's offsets every time (torch advances them in its replay): a
phase that samples must not be planned with reuse. Switching costs one update when the
member replayed differs from the last (a launch's worth of host time, measured by the
bench, not assumed). Where ``libcuda.so.1`` or a symbol is missing, nothing is shared
(every graph instantiated as without reuse) and the report says why.

SGLang 0.5.23 has the same mechanism behind ``SGLANG_ENABLE_CUDA_GRAPH_DEDUP`` (its
breakable prefill backend only): it keys on the same node payloads and also reads the
cluster attributes; it does not check a replay against the graph's own. Where the driver
does not read a clustered kernel's preferred cluster dimension back, SGLang never shares
the graph; here a probe decides, once per device (:func:`_probe`): launches of that
kernel, captured into throwaway graphs that never run, without the attribute (the
control) and with it set to a valid value. A driver that reads the value back and reads
the control's as it read the recorded kernel's, or that refuses every valid value on
this device, proves the recorded one unset; one that takes it and does not read it back
(SGLang's B300 finding) leaves the graph unshared, as SGLang does
(:func:`~capture_plan.executor.exec_reuse.judge_cluster_probe`).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from dataclasses import dataclass, field, replace

import torch

from . import libcuda
from .errors import ExecutorError
from .exec_reuse import ClusterProbe, GraphDesc, KernelDesc, NodeDesc, ReuseGroups, canonical, judge_cluster_probe
from .libcuda import EdgeData, KernelParams, LaunchAttr, LaunchConfig, UpdateResult

__all__ = ["describe", "SharedExecs", "SharedGraph", "reuse_unavailable"]

#: CUgraphNodeType (cuda.h) -> the name exec_reuse compares
NODE_TYPES = {
    0: "kernel",
    1: "memcpy",
    2: "memset",
    3: "host",
    4: "graph",
    5: "empty",
    6: "wait_event",
    7: "event_record",
    8: "ext_semas_signal",
    9: "ext_semas_wait",
    10: "mem_alloc",
    11: "mem_free",
    12: "batch_mem_op",
    13: "conditional",
}

#: CUlaunchAttributeID (cuda.h) of the launch attributes an update keeps: each is read
#: and compared (SGLang 0.5.23's list); the cluster ones decide "opaque"
ATTRIBUTES = {
    "cooperative": 2,
    "cluster_dimension": 4,
    "cluster_scheduling_policy": 5,
    "preferred_cluster_dimension": 11,
    "preferred_shared_memory_carveout": 14,
}


#: CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE: the update was not performed, the executable unchanged
UPDATE_FAILURE = 910


#: every call reuse makes besides the probe's (a missing one: nothing is shared)
_CALLS = (
    "cuGraphGetNodes",
    "cuGraphGetEdges_v2",
    "cuGraphNodeGetType",
    "cuGraphKernelNodeGetParams_v2",
    "cuGraphKernelNodeGetAttribute",
    "cuGraphInstantiateWithFlags",
    "cuGraphExecUpdate_v2",
    "cuGraphLaunch",
    "cuGraphExecDestroy",
)
#: the cluster probe's calls (a missing one: the probe learns nothing)
_PROBE_CALLS = (
    "cuStreamCreate",
    "cuStreamBeginCapture_v2",
    "cuLaunchKernelEx",
    "cuStreamEndCapture",
    "cuGraphDestroy",
    "cuStreamDestroy_v2",
)


@functools.cache
def _driver():
    """The driver calls reuse makes, or a string saying why they are not there."""
    return libcuda.calls(*_CALLS)


#: CU_STREAM_CAPTURE_MODE_RELAXED: the probe's capture leaves other threads' captures alone
_RELAXED = 2


#: per CUDA device: what its cluster probe found (one probe per device and process)
_PROBES: dict[int, ClusterProbe] = {}


def _captured_launch(d, c, p: KernelParams, cluster, preferred) -> tuple[int, int, tuple[int, int, int] | None]:
    """Launch the kernel of ``p`` with cluster dimension ``cluster`` (and ``preferred``, if
    any) into a throwaway graph on a stream of its own, in relaxed stream capture: nothing
    runs. ``c``: the probe's driver calls (:data:`_PROBE_CALLS`). Returns (the launch's
    CUresult, the read-back's CUresult, the preferred value read back from the captured
    node; (-1, None) where there was nothing to read)."""
    stream, graph = ctypes.c_void_p(), ctypes.c_void_p()
    rc = c["cuStreamCreate"](ctypes.byref(stream), 1)  # CU_STREAM_NON_BLOCKING
    if rc != 0:
        return rc, -1, None
    try:
        rc = c["cuStreamBeginCapture_v2"](stream, _RELAXED)
        if rc != 0:
            return rc, -1, None
        attrs = (LaunchAttr * 2)()
        attrs[0].id = ATTRIBUTES["cluster_dimension"]
        attrs[0].value[0:3] = list(cluster)
        if preferred is not None:
            attrs[1].id = ATTRIBUTES["preferred_cluster_dimension"]
            attrs[1].value[0:3] = list(preferred)
        cfg = LaunchConfig(
            p.gridDimX, p.gridDimY, p.gridDimZ, p.blockDimX, p.blockDimY, p.blockDimZ, p.sharedMemBytes, stream
        )
        cfg.attrs = ctypes.cast(attrs, ctypes.POINTER(LaunchAttr))
        cfg.numAttrs = 1 if preferred is None else 2
        launch = c["cuLaunchKernelEx"](ctypes.byref(cfg), ctypes.c_void_p(p.func or p.kern), p.kernelParams, p.extra)
        end = c["cuStreamEndCapture"](stream, ctypes.byref(graph))  # ends the capture even after a refused launch
        try:
            if launch != 0 or end != 0 or not graph:
                return launch or end or -1, -1, None
            n = ctypes.c_size_t(1)
            node = (ctypes.c_void_p * 1)()
            d["cuGraphGetNodes"](graph, ctypes.cast(node, ctypes.c_void_p), ctypes.byref(n))
            buf = (ctypes.c_uint * 16)()
            aid = ATTRIBUTES["preferred_cluster_dimension"]
            read = d["cuGraphKernelNodeGetAttribute"](ctypes.c_void_p(node[0]), aid, ctypes.cast(buf, ctypes.c_void_p))
            return 0, read, (buf[0], buf[1], buf[2]) if read == 0 else None
        finally:
            if graph:  # a refused launch may still leave a graph
                c["cuGraphDestroy"](graph)
    finally:
        c["cuStreamDestroy_v2"](stream)


def _probe(d, node: ctypes.c_void_p, cluster: tuple[int, int, int], node_rc: int) -> ClusterProbe:
    """Probe, once per device, whether the driver reads back a preferred cluster dimension
    (:func:`~capture_plan.executor.exec_reuse.judge_cluster_probe`), with the clustered
    kernel of ``node``, whose own read returned ``node_rc``: the values tried are valid for
    it (a multiple of its cluster dimension that divides its grid: twice it where the grid
    allows, then itself). A verdict that proves nothing is kept too (the probe would learn
    no more the next time)."""
    dev = torch.cuda.current_device()
    if dev in _PROBES:
        return _PROBES[dev]
    c = libcuda.calls(*_PROBE_CALLS)
    if isinstance(c, str):
        found = ClusterProbe(False, f"{c}: nothing learnt")
    else:
        p = KernelParams()
        _check(d["cuGraphKernelNodeGetParams_v2"](node, ctypes.byref(p)), "cuGraphKernelNodeGetParams")
        plain, control_rc, _ = _captured_launch(d, c, p, cluster, None)
        values = [(2 * cluster[0], cluster[1], cluster[2])] if p.gridDimX % (2 * cluster[0]) == 0 else []
        tries = []
        for value in [*values, cluster] if plain == 0 else []:
            launch, read_rc, read = _captured_launch(d, c, p, cluster, value)
            tries.append((value, launch, read_rc, read))
            if launch == 0:
                break
        found = judge_cluster_probe((plain, control_rc), tries, node_rc)
    _PROBES[dev] = found
    return found


def reuse_unavailable() -> str | None:
    """Why executables cannot be shared in this process (no driver, a missing symbol), or None."""
    d = _driver()
    return d if isinstance(d, str) else None


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise ExecutorError(f"{what} failed (CUresult {rc})", where="executable reuse")


def _kernel(d, node: ctypes.c_void_p) -> tuple[KernelDesc, dict[str, int]]:
    """The kernel node's description, and the CUresult of every attribute it could not read."""
    p = KernelParams()
    _check(d["cuGraphKernelNodeGetParams_v2"](node, ctypes.byref(p)), "cuGraphKernelNodeGetParams")
    attrs, unread = [], {}
    for name, aid in ATTRIBUTES.items():
        buf = (ctypes.c_uint * 16)()  # CUlaunchAttributeValue: a 64-byte union; dims are 3 uints
        rc = d["cuGraphKernelNodeGetAttribute"](node, aid, ctypes.cast(buf, ctypes.c_void_p))
        if rc == 0:
            attrs.append((name, (buf[0], buf[1], buf[2])))
        else:
            unread[name] = rc
    got = dict(attrs)
    clustered = any(got.get("cluster_dimension", (0, 0, 0)))
    return KernelDesc(
        function=(p.func or 0, p.kern or 0),
        block=(p.blockDimX, p.blockDimY, p.blockDimZ),
        shared_bytes=p.sharedMemBytes,
        attributes=tuple(attrs),
        # a cluster whose preferred dimension the driver cannot read: it would survive an update unseen
        opaque=clustered and "preferred_cluster_dimension" not in got,
        unread=", ".join(f"{n}: CUresult {rc}" for n, rc in unread.items()),
    ), unread


def graph_edges(d: dict, g: ctypes.c_void_p, index: dict, where: str = "graph") -> list[tuple[int, ...]]:
    """The edges of graph ``g`` as (from, to) node indexes (``index``: node handle -> its
    index), with (from port, to port, type) appended where not all 0 (a programmatic edge).

    Read with the edges' data: a graph with programmatic (PDL) edges, as FA3's and cuBLAS's
    kernels record on an H200, refuses a query without it (CUDA_ERROR_LOSSY_QUERY, 402:
    measured). A graph without edges (its nodes independent, or one node) is not asked for
    them: the driver refuses arrays with a count of 0 (CUDA_ERROR_INVALID_VALUE, 1: an
    SGLang-shaped target_verify graph's save on an H200)."""
    e = ctypes.c_size_t(0)
    _edges_check(d["cuGraphGetEdges_v2"](g, None, None, None, ctypes.byref(e)), where)
    if not e.value:
        return []
    src, dst, data = (ctypes.c_void_p * e.value)(), (ctypes.c_void_p * e.value)(), (EdgeData * e.value)()
    ends = ctypes.cast(src, ctypes.c_void_p), ctypes.cast(dst, ctypes.c_void_p), ctypes.cast(data, ctypes.c_void_p)
    _edges_check(d["cuGraphGetEdges_v2"](g, *ends, ctypes.byref(e)), where)
    edges: list[tuple[int, ...]] = []
    for i in range(e.value):
        x = data[i]
        extra = (x.from_port, x.to_port, x.type) if (x.from_port, x.to_port, x.type) != (0, 0, 0) else ()
        edges.append((index[src[i]], index[dst[i]], *extra))
    return edges


def _edges_check(rc: int, where: str) -> None:
    if rc != 0:
        raise ExecutorError(f"cuGraphGetEdges_v2 failed (CUresult {rc})", where=where)


def describe(raw_graph: int, probes: list[ClusterProbe] | None = None) -> GraphDesc:
    """The nodes and edges of the ``cudaGraph_t`` ``raw_graph`` (``CUDAGraph.raw_cuda_graph()``).
    ``probes``: where given, the cluster probe's verdict is appended to it when a kernel of
    this graph needed one."""
    d = _driver()
    if isinstance(d, str):
        raise ExecutorError(d, where="executable reuse")
    g = ctypes.c_void_p(raw_graph)
    n = ctypes.c_size_t(0)
    _check(d["cuGraphGetNodes"](g, None, ctypes.byref(n)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * n.value)()
    _check(d["cuGraphGetNodes"](g, ctypes.cast(nodes, ctypes.c_void_p), ctypes.byref(n)), "cuGraphGetNodes")
    descs = []
    for i in range(n.value):
        t = ctypes.c_int(-1)
        node = ctypes.c_void_p(nodes[i])
        _check(d["cuGraphNodeGetType"](node, ctypes.byref(t)), "cuGraphNodeGetType")
        kind = NODE_TYPES.get(t.value, f"type-{t.value}")
        k, unread = _kernel(d, node) if kind == "kernel" else (None, {})
        if k is not None and k.opaque:
            # a cluster whose preferred dimension the driver does not read: shared only where
            # this device's probe proves an unreadable one unset
            cx, cy, cz = dict(k.attributes)["cluster_dimension"]
            probe = _probe(d, node, (cx, cy, cz), unread["preferred_cluster_dimension"])
            if probes is not None:
                probes.append(probe)
            if not probe.proves_unset:  # refused (exec_reuse.unshareable): the rest need not be read
                descs.append(NodeDesc(type=kind, kernel=replace(k, unread=f"{k.unread}; {probe.found}")))
                return canonical(descs, [])
            k = replace(k, opaque=False, unread="")
        descs.append(NodeDesc(type=kind, kernel=k))
    index = {nodes[i]: i for i in range(n.value)}
    return canonical(descs, graph_edges(d, g, index, "executable reuse"))


@dataclass(eq=False)
class _Exec:
    handle: ctypes.c_void_p
    #: the raw graph the executable holds now
    current: int


@dataclass(eq=False)
class SharedGraph:
    """A recorded graph replayed through its group's executable; stands where a
    ``torch.cuda.CUDAGraph`` stands in a ``Captured`` (``replay``, ``reset``)."""

    graph: torch.cuda.CUDAGraph
    raw: int
    owner: SharedExecs
    exec: _Exec

    def replay(self) -> None:
        self.owner.launch(self)

    def reset(self) -> None:
        self.graph.reset()

    def raw_cuda_graph(self) -> int:
        return self.raw

    def __getattr__(self, name: str):
        # the rest of torch.cuda.CUDAGraph's surface (an engine's pool(), debug calls) is the graph's
        if name == "graph":  # not set yet (copying, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.graph, name)


@dataclass(eq=False)
class SharedExecs:
    """The shared executables of one capture, per phase (``ReuseGroups`` each)."""

    groups: dict[str, ReuseGroups] = field(default_factory=dict)
    _execs: dict[tuple[str, int], _Exec] = field(default_factory=dict)
    #: every executable this object instantiated (destroyed by :meth:`close`)
    _made: list[_Exec] = field(default_factory=list)
    #: an update and the launch after it are one step: a background capture's validation
    #: update must not land between a serving thread's switch and its launch
    _lock: threading.Lock = field(default_factory=threading.Lock)
    #: every graph served through a shared executable
    _graphs: list[SharedGraph] = field(default_factory=list)
    #: what the device's cluster probe found, where a graph of this capture needed it ("" else)
    clusters: str = ""

    def _update(self, ex: _Exec, raw: int) -> str | None:
        """Update ``ex`` to ``raw``; None when the driver did, else why not (the
        executable is left unchanged by a refused update)."""
        d = _driver()
        assert not isinstance(d, str)
        info = UpdateResult()
        rc = d["cuGraphExecUpdate_v2"](ex.handle, ctypes.c_void_p(raw), ctypes.byref(info))
        if rc != 0 or info.result != 0:
            if rc not in (0, UPDATE_FAILURE):
                # only a refusal the driver documents leaves the executable as it was: after
                # any other error it holds no known graph, so the next replay updates it again
                ex.current = 0
            return f"cuGraphExecUpdate refused it (CUresult {rc}, CUgraphExecUpdateResult {info.result})"
        ex.current = raw
        return None

    def adopt(self, phase: str, name: str, graph: torch.cuda.CUDAGraph) -> SharedGraph | None:
        """Place a just-recorded ``graph`` (``keep_graph=True``, not instantiated) of
        ``phase``: a :class:`SharedGraph` replaying through its group's executable, or
        None where it shares nothing (the caller instantiates it as usual; the reason is
        in ``groups[phase].refusals``)."""
        with self._lock:
            return self._adopt(phase, name, graph)

    def _adopt(self, phase: str, name: str, graph: torch.cuda.CUDAGraph) -> SharedGraph | None:
        groups = self.groups.setdefault(phase, ReuseGroups())
        why = reuse_unavailable()
        if why is not None:
            groups.refusals.append((name, why))
            groups.alone.append(name)
            return None
        try:
            raw = graph.raw_cuda_graph()
        except (RuntimeError, AttributeError):  # an engine's own graph, recorded without keep_graph
            groups.refusals.append((name, "recorded without keep_graph=True: its graph cannot be read"))
            groups.alone.append(name)
            return None
        probes: list[ClusterProbe] = []
        try:
            desc = describe(raw, probes)
        except ExecutorError as err:  # a node the driver does not describe: shared with nothing, not fatal
            groups.refusals.append((name, f"its nodes could not be read: {err.what}"))
            groups.alone.append(name)
            return None
        if probes:
            self.clusters = probes[0].found
        before = len(groups.groups)
        i = groups.place(name, desc)
        if i is None:
            return None
        if i == before:  # a new group: its first graph is instantiated
            d = _driver()
            assert not isinstance(d, str)
            out = ctypes.c_void_p()
            _check(d["cuGraphInstantiateWithFlags"](ctypes.byref(out), ctypes.c_void_p(raw), 0), "cuGraphInstantiate")
            ex = _Exec(out, raw)
            self._made.append(ex)
            self._execs[(phase, i)] = ex
        else:
            ex = self._execs[(phase, i)]
            why = self._update(ex, raw)  # the driver's check, before the graph is ever served
            if why is not None:
                groups.groups[i][1].remove(name)
                groups.refusals.append((name, why))
                groups.alone.append(name)
                return None
        shared = SharedGraph(graph, raw, self, ex)
        self._graphs.append(shared)
        return shared

    def launch(self, g: SharedGraph) -> None:
        """Replay ``g`` on the current stream, its group's executable updated to it first
        where another member replayed last."""
        ex = g.exec
        d = _driver()
        assert not isinstance(d, str)
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        with self._lock:
            if ex.current != g.raw:
                why = self._update(ex, g.raw)
                if why is not None:
                    raise ExecutorError(
                        f"a shared executable could not be switched to a graph of its group: {why}",
                        where="executable reuse",
                    )
            _check(d["cuGraphLaunch"](ex.handle, stream), "cuGraphLaunch")

    def launch_own(self, g: SharedGraph) -> None:
        """Replay ``g`` through an executable of its own, instantiated for this replay and
        destroyed after it (verify's reference for the shared one; the driver keeps the
        memory it took for later graphs). Synchronizes the current stream."""
        d = _driver()
        assert not isinstance(d, str)
        out = ctypes.c_void_p()
        _check(d["cuGraphInstantiateWithFlags"](ctypes.byref(out), ctypes.c_void_p(g.raw), 0), "cuGraphInstantiate")
        try:
            stream = torch.cuda.current_stream()
            _check(d["cuGraphLaunch"](out, ctypes.c_void_p(stream.cuda_stream)), "cuGraphLaunch")
            stream.synchronize()
        finally:
            d["cuGraphExecDestroy"](out)

    def members(self, g: SharedGraph) -> int:
        """How many graphs share ``g``'s executable."""
        return sum(1 for m in self._graphs if m.exec is g.exec)

    @property
    def instantiations(self) -> int:
        return len(self._made)

    def close(self) -> None:
        """Destroy every shared executable (after the device finished with them)."""
        d = _driver()
        while self._made:
            ex = self._made.pop()
            if not isinstance(d, str):
                d["cuGraphExecDestroy"](ex.handle)
        self._execs.clear()
        self._graphs.clear()
