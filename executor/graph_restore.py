"""``restore(plan, target, file)``: a plan's graphs rebuilt from a graph file in a fresh process instead of captured.

Start-up with a graph file an earlier start-up wrote after its capture
(``graph_file.save_graphs``)::

    graphs = restore_or_capture(plan, target, "graphs.cpgraphs")  # else capture, one WARNING
    out = graphs.replay("decode", n)

:func:`restore` runs once the target's weights are loaded and the target is as ready as the
saving process's was before its capture, and returns the ``GraphSet`` ``capture`` returns
(the same dispatch, ``replay``, ``verify`` and ``release``), its ``restored`` a
:class:`RestoreReport`. In order:

1. **Checks** (``restore_checks.restore_refusals``, before any GPU work but the capture stream's
   priming): the file read back (another version or a damaged file refused), what it is
   valid for against this process (``graph_validity.check_valid``: the plan's digest, the
   device, driver, torch, every kernel library by digest, every named tensor by name and
   size, no address in a segment a restore cannot relocate), the plan's graph keys and
   pools against the file's, its pools' segments sizes torch's allocator cuts
   (``restore_layout.layout_refusals``), every node one the rebuild makes exactly
   (``graph_rebuild.rebuild_refusals``: no TMA-shaped parameter among them), no argument
   word left at a saved address (``graph_validity.stale_addresses``), this driver's TMA
   descriptors keeping their address as a plain word (``tensor_map_probe``: else a
   descriptor inside a parameter struct would go unrelocated), one process (no
   ``torch.distributed`` group of several).
2. **Kernels**: the plan's hoisted workspaces allocated, the target run eagerly and
   recorded at a few graph keys, until every module of the file is loaded, then every kernel
   fetched from its module by name with the function attributes the file recorded set on it
   (``kernel_loading``); then checked: every kernel of the file fetched and its attributes
   set, every kernel library the file names mapped by then with its
   digest, every library workspace the file names made (cuBLAS's on the capture stream: the
   priming), every named tensor read again and as saved.
3. **Memory**: every plan pool a ``torch.cuda.MemPool`` holding the file's segments, each
   held whole by torch's allocator for the restored graphs (``restore_layout``).
4. **Graphs**: every graph rebuilt through the driver at this process's addresses
   (``graph_rebuild.rebuild_graphs``), instantiated and uploaded, its outputs re-created
   over the restored memory, added to the GraphSet in the saved (capture) order, each
   served by a :class:`RestoredGraph`.

Each refusal is a :class:`~capture_plan.executor.errors.RestoreRefused` (an ExecutorError)
whose message is the first reason and counts the others; whatever the restore made is let
go before anything is raised. :func:`restore_or_capture` turns any ExecutorError of a
restore into one WARNING and a ``capture``.

Refused, so captured: tensor-parallel graphs (each rank's communicator memory lies outside
torch's allocator), graphs that sample (torch's graph-safe RNG state is a ``torch:K``
segment of the file: ``restore_probe.stream_workspaces``), piecewise phases, a TMA
descriptor passed as a parameter of its own. Not restored as captured: executables are not
shared (a plan's ``reuse = "exec-update"`` phase gets one per graph), no capture report
(``report`` None) and no allocation history (``verify``'s footprint check cannot run; its
interleave and scribble checks can). No kernel binary is loaded from a file.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from capture_plan.schemas.errors import CapturePlanError
from capture_plan.schemas.graph_file import GraphFile, read_graph_file
from capture_plan.schemas.plan import Plan

from .errors import ExecutorError, RestoreRefused
from .graph_validity import check_valid
from .restore_checks import Here, planned_workspaces, restore_refusals

__all__ = [
    "RestoreReport",
    "process_environment",
    "RestoredGraph",
    "restore",
    "restore_or_capture",
]


@dataclass
class RestoreReport:
    """What a restore did: the file, the seconds in all (read to graphs ready) and by part,
    the graphs and nodes rebuilt, the keys the target ran at to load the kernels' modules, the
    kernels fetched by name, the segments its addresses were relocated into."""

    path: str
    seconds: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)
    graphs: int = 0
    nodes: int = 0
    keys: list[str] = field(default_factory=list)
    #: segments laid out or found here, and how many of them lie elsewhere than in the saving process
    segments: int = 0
    moved: int = 0
    #: kernel functions fetched by name, and function attributes set on them (kernel_loading)
    functions: int = 0
    attributes: int = 0
    #: the graph builder that added the nodes: compiled, or ctypes and why (``graph_flat.graph_builder``)
    builder: str = ""


def process_environment(
    plan: Plan, target, file: GraphFile, device=None, tensors: Mapping | None = None, engine: Mapping | None = None
) -> Here:
    """This process as a restore of ``file`` for ``plan`` and ``target`` on ``device`` (default:
    the current one) finds it (:class:`Here`), the capture stream primed first (its cuBLAS
    workspace, outside every pool, as a capture makes it): the kernel libraries the file
    names hashed, the planned hoisted workspaces counted at the sizes a capture allocates,
    the engine's ranges (``engine``: name -> (address, bytes)) by size, the tensor-map probe."""
    import torch

    from .distributed import is_distributed
    from .graph_env import current_environment, named_tensors, trust_saved_digests
    from .streams import prime_stream, workspace_streams
    from .tensor_map_probe import probe_tensor_map

    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    parts: dict[str, float] = {}
    t = time.perf_counter()
    named = named_tensors(target)
    named.update(dict(tensors or {}))
    t = _lap(parts, "tensors", t)
    with torch.cuda.device(dev):
        prime_stream(dev)
        # the file's other streams' workspaces (an engine's own capture stream), on streams of ours
        workspace_streams(
            dev, [(seg.owner.rpartition("/")[0], seg.size) for seg in file.segments if seg.kind == "workspace"]
        )
        t = _lap(parts, "prime", t)
        libraries = {lib.name for lib in file.valid_for.libraries}
        trust_saved_digests(file.valid_for.libraries)  # the same files as saved: their digests unhashed
        env = current_environment(plan.digest, named, {}, {}, libraries=libraries)
        t = _lap(parts, "libraries", t)
    env.tensors.update(planned_workspaces(plan))
    env.engine = {n: size for n, (_, size) in (engine or {}).items()}
    why = ""
    try:
        layout = probe_tensor_map()
        if not layout.plain:
            why = (
                f"this driver's TMA descriptors keep their address in words {layout.address_words}, not as one plain "
                "word: a descriptor inside a kernel's parameter struct would not be relocated"
            )
    except ExecutorError:  # a driver that encodes no descriptor: no graph of it holds one
        pass
    t = _lap(parts, "tensor_map", t)
    ranks = 1
    if is_distributed():
        import torch.distributed as dist

        ranks = dist.get_world_size()
    return Here(device=dev, env=env, tensors=named, tensor_map=why, ranks=ranks, engine=dict(engine or {}), parts=parts)


class _Owner:
    """What the restored graphs of one GraphSet share: the driver calls, the pools' memory
    (let go when the last graph is reset)."""

    def __init__(self, calls: dict, pools):
        self.calls, self.pools, self.live = calls, pools, 0

    def drop(self) -> None:
        self.live -= 1
        if self.live == 0:
            self.pools.close()


class RestoredGraph:
    """A graph rebuilt from a graph file, where a ``torch.cuda.CUDAGraph`` stands in a
    ``Captured``: ``replay()`` launches it on the current stream, ``reset()`` destroys it
    (once), ``raw_cuda_graph()`` is its ``CUgraph`` (a restored set can be walked and saved
    again)."""

    def __init__(self, graph: int, executable: int, owner: _Owner, name: str):
        self._graph, self._exec, self.name = graph, executable, name
        self._owner: _Owner | None = owner
        self._launch = owner.calls["cuGraphLaunch"]
        owner.live += 1

    def replay(self) -> None:
        import torch

        rc = self._launch(ctypes.c_void_p(self._exec), ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
        if rc != 0:
            raise ExecutorError(f"cuGraphLaunch failed (CUresult {rc})", where=f"restored graph {self.name}")

    def raw_cuda_graph(self) -> int:
        return self._graph

    def reset(self) -> None:
        owner, self._owner = self._owner, None
        if owner is None:
            return
        owner.calls["cuGraphExecDestroy"](ctypes.c_void_p(self._exec))
        owner.calls["cuGraphDestroy"](ctypes.c_void_p(self._graph))
        self._exec = self._graph = 0
        owner.drop()

    def __del__(self):
        try:
            self.reset()
        except Exception:  # noqa: BLE001  # at interpreter exit the driver may be gone: nothing to free then
            pass


_FIX = "capture instead, and save the graphs again after it (restore_or_capture(..., save=True) does both)"


def _refuse(lines: list[str], path, made: bool = False) -> RestoreRefused:
    return RestoreRefused(lines, where=f"graph file {path}", fix=_FIX, made=made)


def restore(
    plan: Plan, target, path: str | Path, *, device=None, tensors: Mapping | None = None, engine: Mapping | None = None
):
    """The GraphSet of ``plan``'s graphs of ``target`` restored from the graph file at ``path``
    on ``device`` (default: the current one; module docstring); ``tensors``: tensors the file
    names besides the target's (as given to ``save_graphs``); ``engine``: the engine's ranges
    of memory outside torch's allocator here, name -> (address, bytes), as ``save_graphs``
    was given them in the saving process (each ``engine:NAME`` segment relocated to its range
    here). A :class:`RestoreRefused` naming the first reason it cannot, with nothing of it left
    behind."""
    t0 = time.perf_counter()
    try:
        file = read_graph_file(path)
    except CapturePlanError as err:
        raise _refuse([err.what], path) from None
    t1 = time.perf_counter()
    here = process_environment(plan, target, file, device, tensors, engine)
    t2 = time.perf_counter()
    checks: dict[str, float] = {}
    lines = restore_refusals(plan, file, here, checks)
    parts = {"read": t1 - t0, "environment": t2 - t1, "check": time.perf_counter() - t2}
    parts.update({f"environment.{k}": v for k, v in here.parts.items()})
    parts.update({f"check.{k}": v for k, v in checks.items()})
    if lines:
        raise _refuse(lines, path)
    return _restore(plan, target, file, here, RestoreReport(str(path), parts=parts), t0, tensors)


def _restore(plan: Plan, target, file: GraphFile, here: Here, report: RestoreReport, t0: float, tensors):
    """Steps 2 to 4 of the module docstring, once the checks passed, on ``here.device``."""
    import torch

    with torch.cuda.device(here.device):  # pyright: ignore[reportArgumentType]  # a torch.device
        return _rebuild_set(plan, target, file, here, here.device, report, t0, tensors)


def _rebuild_set(plan: Plan, target, file: GraphFile, here: Here, dev, report: RestoreReport, t0: float, tensors):
    import torch

    from .graph_env import graph_tensors, kernel_libraries, library_workspaces
    from .graph_rebuild import rebuild_graphs, segment_bases
    from .graphs import Captured, GraphSet
    from .kernel_loading import load_kernels
    from .restore_layout import lay_out_pools
    from .streams import capture_stream

    stream, parts, path = capture_stream(dev), report.parts, report.path
    gs = GraphSet(plan, target, dev)
    pools = rebuilt = None
    graphs: list[RestoredGraph] = []
    caps: list[Captured] = []  # no loop variable holds one: a failure's frames would keep its outputs' memory
    try:
        t = time.perf_counter()
        for s in plan.steps:  # outside every pool, as a capture's provision steps allocate them
            if s.op == "provision":
                gs.workspaces[s.phase] = torch.zeros(max(s.bytes, 1), dtype=torch.uint8, device=dev)
        # the loading runs go on the capture stream: after the weights' and inputs' writes and
        # the workspaces' zeroing queued on this one (as CaptureLoop.open synchronizes first)
        stream.wait_stream(torch.cuda.current_stream(dev))
        loaded = load_kernels(file, target, gs.workspaces, stream, dev)
        ran = time.perf_counter()
        parts.update({f"load.{k}": v for k, v in loaded.parts.items()})
        report.keys, report.attributes = loaded.keys, loaded.fetched.set
        report.functions = len(loaded.fetched.functions)
        lines = loaded.refusals(file)
        # read again: the runs may have mapped libraries and made or replaced tensors
        named = graph_tensors(gs, target, tensors)
        spans = library_workspaces({})
        libraries = {lib.name: lib.digest for lib in kernel_libraries(only={x.name for x in file.valid_for.libraries})}
        sizes = {n: t_.untyped_storage().nbytes() for n, t_ in named.items()}  # pyright: ignore[reportAttributeAccessIssue]
        workspaces = {n: size for n, (_, size) in spans.items()}
        env = replace(here.env, libraries=libraries, tensors=sizes, workspaces=workspaces)
        lines += check_valid(file, env, later=("pool",))
        if lines:
            raise _refuse(lines, path, made=True)
        parts["load.check"] = time.perf_counter() - ran  # the libraries, workspaces and tensors read again
        t = _lap(parts, "load", t)
        names = {g.pool for g in file.graphs}
        try:
            pools = lay_out_pools(file, dev, sorted(names))
        except ExecutorError as err:
            raise _refuse([err.what], path, made=True) from None
        addresses = {n: t_.untyped_storage().data_ptr() for n, t_ in named.items()}  # pyright: ignore[reportAttributeAccessIssue]
        engine = {n: a for n, (a, _) in here.engine.items()}
        bases = segment_bases(file, pools.bases, addresses, {n: a for n, (a, _) in spans.items()}, engine)
        placed = [(seg, b) for seg, b in zip(file.segments, bases) if b is not None]
        report.segments, report.moved = len(placed), sum(b != seg.address for seg, b in placed)
        t = _lap(parts, "layout", t)
        rebuilt = rebuild_graphs(file, bases, loaded.modules, stream.cuda_stream)
        report.nodes, report.builder = rebuilt.nodes, rebuilt.builder
        parts.update({f"rebuild.{k}": v for k, v in rebuilt.parts.items()})
        t = _lap(parts, "rebuild", t)
        owner = _Owner(rebuilt.calls, pools)
        for g in file.graphs:
            key = (g.phase, g.bs)
            graphs.append(RestoredGraph(rebuilt.graphs.pop(key), rebuilt.execs.pop(key), owner, f"{g.phase}/{g.bs}"))
        caps += [
            Captured(
                phase=g.phase,
                bs=g.bs,
                pool=g.pool,
                graph=rg,  # pyright: ignore[reportArgumentType]  # duck-typed: replay, reset, raw_cuda_graph
                outputs=tuple(_output(o, file, bases, pools, named, dev) for o in g.outputs),
                held=g.held,
                rows=tuple(g.rows) if g.rows is not None else None,
                key_phase=g.key_phase,
                labels=tuple((a, b) for a, b in g.labels),
                piece=g.piece,
            )
            for g, rg in zip(file.graphs, graphs)
        ]
        gs.pools.update(pools.handles)
        for i in range(len(caps)):
            gs.add(caps[i])
        caps.clear()
        _lap(parts, "outputs", t)
    except BaseException:
        caps.clear()
        for rg in graphs:  # the last lets the pools go
            rg.reset()
        if rebuilt is not None:
            rebuilt.destroy()  # those not handed to a RestoredGraph
        if pools is not None:
            pools.close()
        gs.release(reason="the restore failed")
        raise
    report.seconds, report.graphs = time.perf_counter() - t0, len(gs.graphs)
    gs.restored = report
    return gs


def _lap(parts: dict[str, float], name: str, since: float) -> float:
    now = time.perf_counter()
    parts[name] = now - since
    return now


def _output(o, file: GraphFile, bases: list[int | None], pools, named: Mapping[str, object], dev):
    """Output ``o`` of a graph re-created here (``restore_layout.output_tensor``)."""
    from .restore_layout import output_bytes, output_tensor

    if o.at is None:
        return output_tensor(o, None, None, dev)
    seg, base = file.segments[o.at.segment], bases[o.at.segment]
    nbytes = output_bytes(o)
    if base is None or o.at.offset + nbytes > seg.size or seg.kind not in ("pool", "tensor", "engine"):
        raise ExecutorError(f"an output of {nbytes} B at {o.at.offset} in {seg.name} is not made", where="restore")
    address = base + o.at.offset
    if seg.kind == "engine":  # the engine's memory: the output views it without holding it
        owner = None
    else:
        owner = named.get(seg.owner) if seg.kind == "tensor" else pools.owner(address, nbytes)
    return output_tensor(o, address, owner, dev)


def restore_or_capture(
    plan: Plan,
    target,
    path: str | Path,
    *,
    device=None,
    tensors: Mapping | None = None,
    save: bool = False,
    engine: Mapping | None = None,
    **capture_options,
):
    """The plan's graphs restored from the graph file at ``path`` (:func:`restore`), or, where
    the restore refuses or fails (any ExecutorError: nothing of it is left), captured
    (``capture(plan, target, device=device, **capture_options)``) after one WARNING on the
    ``capture_plan.executor`` logger naming why. ``save``: a captured set's graphs written to
    ``path`` for the next start-up (a foreground capture only); ``tensors`` and ``engine`` as
    :func:`restore` takes them, for the save too. The set's ``restored`` says which happened
    (None: captured)."""
    from .driver import capture
    from .logs import log, rank_tag

    if save and capture_options.get("background"):
        raise ExecutorError(
            "save=True writes the captured graphs, which a background capture has not all made yet",
            where="restore_or_capture",
            fix="leave save out, and call graph_file.save_graphs once gs.wait() returns",
        )
    try:
        return restore(plan, target, path, device=device, tensors=tensors, engine=engine)
    except ExecutorError as err:
        why = str(err) if isinstance(err, RestoreRefused) else f"graph file {path}: not restored: {err}"
        log.warning("capture-plan%s: %s; capturing instead", rank_tag(), why)
        failed_late = not isinstance(err, RestoreRefused) or bool(err.made)
    if failed_late:  # the error's frames held the last of what it made: gone with them, returned now
        import torch

        torch.cuda.empty_cache()
    gs = capture(plan, target, device=device, **capture_options)
    if save:
        from .graph_file import save_graphs

        save_graphs(gs, plan, target, path, tensors, engine=engine)
    return gs
