"""Which recorded graphs may share one instantiated executable: a pure function over
torch-free node descriptions.

Executable reuse (a plan phase's ``reuse = "exec-update"``) instantiates one
``CUgraphExec`` for a group of graphs and, before replaying a member, updates it with
that member's graph (``cuGraphExecUpdate``): kernel arguments, grid dimensions and
copy/memset parameters change, the structure must not. The driver's own check covers
what the update changes and refuses the rest; what it does NOT cover is launch
attributes it keeps without reading back (SGLang 0.5.23 found that cluster
dimensions survive an update silently: a deterministic hang on one GPU family), so
those are part of the signature here. A clustered kernel whose preferred cluster
dimension the driver does not read back is shared only where a probe of this device
(:class:`ClusterProbe`) proves such a one unset: measured on an H200 (driver
580.159.04), every sm90 cuBLAS and FA3 kernel is clustered and none reads it back.

A graph is described (:class:`GraphDesc`) by its nodes in a canonical topological
order (ties broken by the driver's node order) and its edges between those positions.
Two graphs share an executable only when :func:`difference` finds nothing: the same
node count, per node the same type and, for kernels, the same function handles
(``CUfunction`` and ``CUkernel``), block dimensions, dynamic shared memory and launch
attributes, and the same edges. Grid dimensions and kernel arguments may differ (the
update sets them). Node types other than kernels, copies, memsets and empty nodes
(host callbacks, events, child graphs, conditionals) are refused: their update rules
differ and nothing here checks them.

What it does not do: call CUDA (``capture_plan.executor.exec_update`` reads the nodes
and updates executables), or decide which phases try (the plan does).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "KernelDesc",
    "NodeDesc",
    "GraphDesc",
    "SHAREABLE_TYPES",
    "canonical",
    "difference",
    "unshareable",
    "ReuseGroups",
    "ClusterProbe",
    "judge_cluster_probe",
    "DEVICE_REFUSALS",
]

#: node types an executable update is trusted with here (cuda.h CUgraphNodeType names)
SHAREABLE_TYPES = frozenset({"kernel", "memcpy", "memset", "empty"})


@dataclass(frozen=True)
class KernelDesc:
    """What a kernel node must keep for an update to be exact (its grid and arguments may change)."""

    #: (CUfunction, CUkernel) handles: the same code in the same context
    function: tuple[int, int]
    block: tuple[int, int, int]
    shared_bytes: int
    #: (launch attribute name, value) for every attribute read; the update keeps them
    attributes: tuple[tuple[str, tuple[int, ...]], ...] = ()
    #: an attribute that matters (a cluster's) could not be read: never shared
    opaque: bool = False
    #: why it could not be read (the driver's answer), for the refusal's reason; not compared
    unread: str = field(default="", compare=False)


@dataclass(frozen=True)
class NodeDesc:
    #: "kernel", "memcpy", "memset", "empty", or another CUgraphNodeType name (refused)
    type: str
    kernel: KernelDesc | None = None


@dataclass(frozen=True)
class GraphDesc:
    """A graph's nodes in canonical order (:func:`canonical`) and its edges between positions."""

    nodes: tuple[NodeDesc, ...]
    #: (from, to) positions, then the edge's data where the driver reports any: (from port,
    #: to port, dependency type), e.g. a programmatic (PDL) dependency
    edges: tuple[tuple[int, ...], ...] = ()

    def signature(self) -> tuple:
        """A hashable key: equal for graphs :func:`difference` finds no difference between."""
        return (self.nodes, self.edges)


def canonical(nodes: Sequence[NodeDesc], edges: Sequence[tuple[int, ...]]) -> GraphDesc:
    """``nodes`` (in the driver's order) and ``edges`` (pairs of their indices, each followed
    by the edge's data, if any, which is kept and compared) as a
    :class:`GraphDesc`: nodes in topological order, the lowest driver index first among
    the ready ones, edges renumbered and sorted. ValueError for a cycle or an edge past the nodes."""
    n = len(nodes)
    children: list[list[int]] = [[] for _ in range(n)]
    indegree = [0] * n
    for a, b, *_ in edges:
        if not (0 <= a < n and 0 <= b < n):
            raise ValueError(f"edge ({a}, {b}) names a node past the graph's {n}")
        children[a].append(b)
        indegree[b] += 1
    ready = [i for i in range(n) if indegree[i] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for c in sorted(children[i]):
            indegree[c] -= 1
            if indegree[c] == 0:
                heapq.heappush(ready, c)
    if len(order) != n:
        raise ValueError("the graph's edges form a cycle")
    pos = {old: new for new, old in enumerate(order)}
    return GraphDesc(
        nodes=tuple(nodes[i] for i in order), edges=tuple(sorted((pos[a], pos[b], *data) for a, b, *data in edges))
    )


@dataclass(frozen=True)
class ClusterProbe:
    """What this process's driver showed about the preferred cluster dimension, the one
    cluster attribute a driver may hold without reading it back (SGLang 0.5.23's B300
    finding). Made once per device by ``capture_plan.executor.exec_update`` from a launch
    of a recorded clustered kernel, captured into a throwaway graph (never run) with the
    attribute set (:func:`judge_cluster_probe`)."""

    #: True: on this device an unreadable preferred cluster dimension is proven unset
    proves_unset: bool
    #: what the probe did and saw, in words (the report's ``clusters``)
    found: str


#: CUresults by which a driver refuses an attribute value on a device (cuda.h: CUDA_ERROR_INVALID_VALUE,
#: CUDA_ERROR_NOT_SUPPORTED); any other refusal (out of memory, a capture error) says nothing of it
DEVICE_REFUSALS = frozenset({1, 801})


def judge_cluster_probe(
    plain: tuple[int, int],
    tries: Sequence[tuple[tuple[int, int, int], int, int, tuple[int, int, int] | None]],
    node_rc: int,
) -> ClusterProbe:
    """The probe's verdict. ``plain``: the captured launch of the kernel with only its own
    cluster dimension (the control), as (the launch's CUresult, the CUresult of reading its
    preferred cluster dimension back); a failed control launch and the probe learnt nothing.
    ``tries``: per preferred value tried (each a valid one: a multiple of the cluster
    dimension that divides the grid), (value, the launch's CUresult, the read-back's
    CUresult, the value read back), in order; a refused launch moves on to the next value.
    ``node_rc``: what reading the recorded node's preferred cluster dimension returned.

    Proven unset when the driver reads back the value a captured launch set and reads the
    control's (unset) as it read the recorded node's (the same CUresult), or when it
    refuses every valid value on this device with a CUresult that refuses a value
    (:data:`DEVICE_REFUSALS`), so no launch can have set one. Not proven when a launch
    that set one reads back anything else (that driver may hold one unseen, as SGLang
    found on B300), when the control reads otherwise than the recorded node, or when a
    refusal has another cause."""
    plain_rc, control_rc = plain
    if plain_rc != 0:
        failed = f"a captured launch of a clustered kernel failed (CUresult {plain_rc})"
        return ClusterProbe(False, f"{failed}: nothing learnt")
    for value, launch_rc, read_rc, read in tries:
        if launch_rc != 0:
            continue
        if read_rc == 0 and read == value:
            if control_rc != node_rc:
                return ClusterProbe(
                    False,
                    f"the driver reads back a preferred cluster dimension a captured launch sets ({value}), but an "
                    f"unset one reads CUresult {control_rc} and the recorded kernel's CUresult {node_rc}: "
                    "the recorded one may be set",
                )
            return ClusterProbe(
                True,
                f"the driver reads back a preferred cluster dimension a captured launch sets ({value}) and an "
                f"unset one reads CUresult {control_rc}, as the recorded kernel's does: that one is unset",
            )
        got = f"CUresult {read_rc}" if read_rc != 0 else f"{read}"
        return ClusterProbe(
            False,
            f"a captured launch that sets a preferred cluster dimension ({value}) reads back {got}: "
            "the driver may hold one it does not read back",
        )
    if not tries:
        return ClusterProbe(False, "no preferred cluster dimension could be tried: nothing learnt")
    rcs = ", ".join(f"{v}: CUresult {rc}" for v, rc, _, _ in tries)
    if any(rc not in DEVICE_REFUSALS for _, rc, _, _ in tries):
        return ClusterProbe(
            False, f"a captured launch with a preferred cluster dimension failed ({rcs}): nothing learnt"
        )
    refused = f"the driver refuses every launch that sets a preferred cluster dimension on this device ({rcs})"
    return ClusterProbe(True, f"{refused}: none is set")


def unshareable(g: GraphDesc) -> str | None:
    """Why ``g`` may share no executable (a node type the update is not trusted with, a
    kernel whose cluster attributes could not be read), or None."""
    for i, node in enumerate(g.nodes):
        if node.type not in SHAREABLE_TYPES:
            return f"node {i} is a {node.type} node (only {', '.join(sorted(SHAREABLE_TYPES))} nodes are updated)"
        if node.kernel is not None and node.kernel.opaque:
            why = f" ({node.kernel.unread})" if node.kernel.unread else ""
            return f"node {i}'s kernel has a cluster whose attributes the driver does not read back{why}"
    return None


def _kernel_difference(i: int, a: KernelDesc, b: KernelDesc) -> str | None:
    if a.function != b.function:
        return f"node {i} runs another kernel function"
    if a.block != b.block:
        return f"node {i}'s block dimensions differ ({a.block} vs {b.block})"
    if a.shared_bytes != b.shared_bytes:
        return f"node {i}'s dynamic shared memory differs ({a.shared_bytes} vs {b.shared_bytes} B)"
    if a.attributes != b.attributes:
        da, db = dict(a.attributes), dict(b.attributes)
        names = sorted(k for k in set(da) | set(db) if da.get(k) != db.get(k))
        return f"node {i}'s launch attribute {names[0]} differs ({da.get(names[0])} vs {db.get(names[0])})"
    return None


def difference(a: GraphDesc, b: GraphDesc) -> str | None:
    """The first structural difference between ``a`` and ``b`` in words, or None when an
    executable of one may be updated to the other exactly. Either graph being
    :func:`unshareable` is a difference too."""
    for g in (a, b):
        why = unshareable(g)
        if why is not None:
            return why
    if len(a.nodes) != len(b.nodes):
        return f"{len(a.nodes)} nodes vs {len(b.nodes)}"
    for i, (na, nb) in enumerate(zip(a.nodes, b.nodes)):
        if na.type != nb.type:
            return f"node {i} is a {na.type} node vs a {nb.type} node"
        if na.kernel is not None and nb.kernel is not None:
            why = _kernel_difference(i, na.kernel, nb.kernel)
            if why is not None:
                return why
        elif (na.kernel is None) != (nb.kernel is None):
            return f"node {i}'s kernel was read in one graph only"
    if a.edges != b.edges:
        first = next((e for e in sorted(set(a.edges) ^ set(b.edges))), None)
        return f"the dependencies differ (edge {first} in one graph only)"
    return None


@dataclass
class ReuseGroups:
    """Graphs of one phase sorted into groups that share an executable.

    :meth:`place` puts a graph in the first group whose structure it matches, or starts
    a group; a graph :func:`unshareable` is left alone. ``refusals`` says, per graph
    not placed in an earlier group, why (the difference from the group it came
    closest to: the same node count, else the first)."""

    #: per group: its signature and the names of its members, the first the one instantiated
    groups: list[tuple[GraphDesc, list[str]]] = field(default_factory=list)
    #: (graph name, reason) for every graph that started a group of its own or was left alone
    refusals: list[tuple[str, str]] = field(default_factory=list)
    #: graphs that may share nothing (instantiated alone)
    alone: list[str] = field(default_factory=list)

    def place(self, name: str, g: GraphDesc) -> int | None:
        """The index of the group ``name`` joins (a new one when none matches); None when
        ``g`` may share nothing."""
        why = unshareable(g)
        if why is not None:
            self.refusals.append((name, why))
            self.alone.append(name)
            return None
        sig = g.signature()
        for i, (desc, members) in enumerate(self.groups):
            if desc.signature() == sig:
                members.append(name)
                return i
        if self.groups:
            near = next((d for d, _ in self.groups if len(d.nodes) == len(g.nodes)), self.groups[0][0])
            first = next(m for d, m in self.groups if d is near)[0]
            self.refusals.append((name, f"not the structure of {first}: {difference(near, g)}"))
        self.groups.append((g, [name]))
        return len(self.groups) - 1

    @property
    def instantiations(self) -> int:
        """Executables instantiated: one per group, one per graph left alone."""
        return len(self.groups) + len(self.alone)
