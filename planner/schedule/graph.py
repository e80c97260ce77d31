"""Capture steps as a dependency graph, and its canonical order.

Nodes are step ids (``capture/decode/256``); every edge carries the ``rule``
that added it, so ``planner explain`` can say why one step precedes another
and a cycle can be reported as the rules in conflict. The order is the
lexicographic topological sort with the key (phase rank, position in the
phase's capture order, op rank): deterministic on every machine, and it puts
each warm-up right before its capture.

The graph is a small insertion-ordered :class:`Digraph` rather than a
networkx one: a build needs only a topological sort, and importing networkx
costs more than the whole default build. networkx is imported only to name
the edges of a cycle in an error message.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, Generic, NoReturn, TypeVar

from capture_plan.schemas.capture_sequence import Capture
from capture_plan.schemas.errors import ConstraintError
from capture_plan.schemas.keys import step_id as _key_step_id
from capture_plan.schemas.plan import Edge
from capture_plan.schemas.spec import Phase

from .keys import twin_phases

if TYPE_CHECKING:
    from .sequence import Build

__all__ = ["step_id", "phase_sequence", "fixed_by_spec", "StepGraph", "Digraph", "check_acyclic"]


#: a node: any hashable (the planner's are step ids and phase names)
N = TypeVar("N", bound=Hashable)


class Digraph(Generic[N]):
    """Nodes with attributes and labelled edges, both kept in insertion order.

    Only what the planner needs: add nodes and edges, and the lexicographic
    topological sort (the same order as networkx's
    ``lexicographical_topological_sort``: Kahn's algorithm popping the
    smallest ``(key, insertion index)`` ready node). No removal.
    """

    def __init__(self) -> None:
        self.nodes: dict[N, dict[str, Any]] = {}
        #: node -> {successor: edge attributes}
        self.succ: dict[N, dict[N, dict[str, Any]]] = {}

    def add_node(self, n: N, **attrs: Any) -> None:
        if n in self.nodes:
            self.nodes[n].update(attrs)
        else:
            self.nodes[n] = dict(attrs)
            self.succ[n] = {}

    def add_edge(self, u: N, v: N, **attrs: Any) -> None:
        self.add_node(u)
        self.add_node(v)
        self.succ[u].setdefault(v, {}).update(attrs)

    def has_edge(self, u: N, v: N) -> bool:
        return v in self.succ.get(u, ())

    def reaches(self, u: N, v: N) -> bool:
        """Whether a path of one edge or more leads from ``u`` to ``v``."""
        seen, todo = set(), [u]
        while todo:
            for child in self.succ.get(todo.pop(), ()):
                if child == v:
                    return True
                if child not in seen:
                    seen.add(child)
                    todo.append(child)
        return False

    def edges(self) -> list[tuple[N, N, dict[str, Any]]]:
        return [(u, v, d) for u, out in self.succ.items() for v, d in out.items()]

    def topological_order(self, key: Callable[[N], Any]) -> list[N] | None:
        """Nodes in lexicographic topological order by ``key``; None if there is a cycle."""
        indegree = dict.fromkeys(self.nodes, 0)
        for out in self.succ.values():
            for v in out:
                indegree[v] += 1
        index = {n: i for i, n in enumerate(self.nodes)}
        ready = [(key(n), index[n], n) for n, d in indegree.items() if d == 0]
        heapq.heapify(ready)
        order = []
        while ready:
            node = heapq.heappop(ready)[2]
            order.append(node)
            for child in self.succ[node]:
                indegree[child] -= 1
                if indegree[child] == 0:
                    heapq.heappush(ready, (key(child), index[child], child))
        return order if len(order) == len(self.nodes) else None


_OP_RANK = {"provision": 0, "warmup": 1, "capture": 2}


def step_id(op: str, phase: str, bs: int, labels: tuple[tuple[str, str], ...] = ()) -> str:
    """``<op>/<phase>/<bs>``, with ``/<axis>=<label>,...`` for a graph key with labels
    (:func:`capture_plan.schemas.keys.step_id`)."""
    return _key_step_id(op, phase, bs, labels)


def check_acyclic(g: Digraph, what: str = "steps") -> None:
    """Raise the rules on a cycle as a conflict; never a traceback."""
    if g.topological_order(key=lambda n: 0) is not None:
        return
    _raise_cycle(g, what)


def _raise_cycle(g: Digraph, what: str, locate=None) -> NoReturn:
    """Name the rules along one cycle (networkx finds it: only on this error
    path). ``locate(src, dst)``, when given, says where the input sets the
    cycle's first edge (default: "rules")."""
    import networkx as nx

    ng = nx.DiGraph()
    ng.add_nodes_from(g.nodes)
    ng.add_edges_from(g.edges())
    cycle = [tuple(e[:2]) for e in nx.find_cycle(ng)]
    rules = sorted({g.succ[u][v]["rule"] for u, v in cycle})
    path = " -> ".join([cycle[0][0]] + [v for _, v in cycle])
    raise ConstraintError(
        f"rules in conflict: {', '.join(rules)} (they order {what} in a cycle: {path})",
        where=locate(*cycle[0]) if locate else "rules",
        fix="remove or relax one of these rules",
    )


def phase_sequence(phases: list[Phase], weight: dict[str, int], source: str | None = None) -> list[str]:
    """Phase capture order: ``after`` constraints first, then the phase whose
    largest graph needs the most memory (so smaller phases reuse its blocks),
    then spec order. A micro-batch twin (``twin_of``) comes right after the phase
    it is the twin of, whose captures it is interleaved with (:func:`build_steps`);
    an ``after`` naming a twin names that phase. ``after`` lists in a cycle are a
    ConstraintError located at an ``after`` entry of the spec ``source``."""
    index = {p.name: i for i, p in enumerate(phases)}
    twins = twin_phases(phases)
    g, entry = _phase_graph(phases, twins)
    order = g.topological_order(key=lambda n: (-weight[n], index[n]))
    if order is None:

        def locate(u: str, v: str) -> str:  # the edge is phases[name].after's entry dep
            dep, name = entry[(u, v)]
            i = index[name]
            return f"{source or 'spec'}: $.phases[{i}].after[{phases[i].after.index(dep)}]"

        _raise_cycle(g, "phases", locate)
    of = {parent: twin for twin, parent in twins.items()}
    return [n for name in order for n in (name, of.get(name)) if n is not None]


def _phase_graph(
    phases: list[Phase], twins: dict[str, str]
) -> tuple[Digraph[str], dict[tuple[str, str], tuple[str, str]]]:
    """The phases' order constraints: a node per phase that is no twin (a twin is placed
    by its phase, and an ``after`` naming a twin names that phase), an edge per ``after``
    entry; and for each edge the first ``after`` entry (dep, phase) that made it."""
    group = {p.name: twins.get(p.name, p.name) for p in phases}
    g = Digraph[str]()
    for p in phases:
        if p.name not in twins:
            g.add_node(p.name)
    entry: dict[tuple[str, str], tuple[str, str]] = {}
    for p in phases:
        for dep in p.after:
            g.add_edge(group[dep], group[p.name], rule=f"after:{p.name}")
            entry.setdefault((group[dep], group[p.name]), (dep, p.name))
    return g, entry


def fixed_by_spec(phases: list[Phase], sequence: list[str]) -> list[str]:
    """Which consecutive pairs of :func:`phase_sequence`'s ``sequence`` the spec orders
    itself, each as text (``"full_decode after piecewise"``, ``"t twin of p"``): the later
    phase is ``after`` the earlier one, directly or through other phases' ``after``, or
    is its micro-batch twin. The other pairs are ordered by pool weight (a choice)."""
    twins = twin_phases(phases)
    g, _ = _phase_graph(phases, twins)
    out = []
    for a, b in zip(sequence, sequence[1:]):
        if twins.get(b) == a:
            out.append(f"{b} twin of {a}")
        elif g.reaches(twins.get(a, a), twins.get(b, b)):
            out.append(f"{b} after {a}")
    return out


class StepGraph:
    """The Digraph plus helpers to add steps and labelled edges."""

    def __init__(self, g: Digraph[str]) -> None:
        self.g = g

    @classmethod
    def empty(cls) -> StepGraph:
        return cls(Digraph[str]())

    def add_step(self, op: str, phase: str, bs: int, rank: int, pos: int, labels: tuple = ()) -> str:
        sid = step_id(op, phase, bs, labels)
        self.g.add_node(sid, op=op, phase=phase, bs=bs, labels=labels, key=(rank, pos, _OP_RANK[op], bs))
        return sid

    def add_edge(self, src: str, dst: str, rule: str) -> None:
        # Two rules may add the same edge; keep the first for a stable label.
        if not self.g.has_edge(src, dst):
            self.g.add_edge(src, dst, rule=rule)

    def chain(self, phase: str, keys: list[tuple[int, tuple]], rule: str) -> None:
        """Edges between consecutive captures of ``keys`` ((size, labels) in order)."""
        ids = [step_id("capture", phase, bs, labels) for bs, labels in keys]
        for a, b in zip(ids, ids[1:]):
            self.add_edge(a, b, rule)

    def order(self) -> list[str]:
        nodes = self.g.nodes
        order = self.g.topological_order(key=lambda n: nodes[n]["key"])
        if order is None:
            _raise_cycle(self.g, "steps")
        return order

    def edges(self, index: dict[str, int]) -> list[Edge]:
        out = [Edge(src=u, dst=v, rule=d["rule"]) for u, v, d in self.g.edges()]
        return sorted(out, key=lambda e: (index[e.dst], index[e.src], e.rule))


def _reordered(keys: list[tuple[int, tuple]], order: str, key_order: str) -> list[tuple[int, tuple]]:
    """``keys`` (one phase's, in capture order) in another size ``order``, each size's
    labels (size-major) or each combination's sizes (variant-major) kept together."""
    sign = -1 if order == "largest-first" else 1
    pos = {c: i for i, c in enumerate(dict.fromkeys(labels for _, labels in keys))}
    if key_order == "variant-major":
        return sorted(keys, key=lambda k: (pos[k[1]], sign * k[0]))
    return sorted(keys, key=lambda k: (sign * k[0], pos[k[1]]))


def build_steps(
    b: Build, order_rule: dict[str, str], warmup_rule: dict[str, str], hoist_rule: dict[str, str]
) -> StepGraph:
    """The full step graph of a build's chosen strategies, its steps placed by its capture
    sequence (``b.sequence``: planner/schedule/sequence.py).

    The resolved build's ``forced`` orders, per phase (order, rule) pairs that rules or
    pins demand outright, are added as edges too, so two that disagree form a cycle.
    A phase with variant axes (``keys``: label combinations, key order, the rule that set
    it; planner/schedule/keys.py) captures each size once per combination, in that order;
    a once-per-phase warm-up runs the first combination.

    A micro-batch twin (``twin_of``; the phase sequence has it right after its phase) is
    interleaved with its phase: each twin key right after the phase's key of the same
    size and labels (its warm-ups and provision just before it), by edges labelled
    ``twin_of:<twin>``; the twin's own size order must be its phase's (the optimizer
    gives it that), another is a cycle reported as the rules in conflict.
    """
    r = b.resolved
    phases, sequence, strategies, keys = r.by_name, r.sequence, b.strategies, r.keys
    twins = twin_phases(list(phases.values()))
    #: each phase's keys (size, labels) in capture order
    own: dict[str, list[tuple[int, tuple]]] = {name: [] for name in sequence}
    #: each phase that is no twin: its captures with its twin's interleaved
    captured: dict[str, list[Capture]] = {name: [] for name in sequence}
    for c in b.sequence.captures:
        own[c.phase].append((c.bs, c.labels))
        captured[twins.get(c.phase, c.phase)].append(c)

    sg = StepGraph.empty()
    #: a phase's rank in the sequence (a twin: its phase's)
    rank_of: dict[str, int] = {}
    #: each key's position among its phase's captures, its twin's interleaved
    place: dict[tuple[str, int, tuple], int] = {}
    for rank, name in enumerate(sequence):
        rank_of[name] = rank_of[twins[name]] if name in twins else rank
        if name not in twins:
            for pos, c in enumerate(captured[name]):
                place[(c.phase, c.bs, c.labels)] = pos
    for name in sequence:
        st = strategies[name]
        ordered = own[name]
        top = max(bs for bs, _ in ordered)
        rank = rank_of[name]
        for bs, labels in ordered:
            pos = place[(name, bs, labels)]
            sg.add_step("capture", name, bs, rank, pos, labels)
            if st.warmup == "every-size":
                sg.add_step("warmup", name, bs, rank, pos, labels)
                sg.add_edge(
                    step_id("warmup", name, bs, labels), step_id("capture", name, bs, labels), warmup_rule[name]
                )
        first = step_id("capture", name, *ordered[0])
        # a twin's once-per-phase warm-up and provision come right before its first capture
        head = place[(name, *ordered[0])] if name in twins else -1
        if st.warmup == "once-per-phase":
            w = sg.add_step("warmup", name, top, rank, head, ordered[0][1])
            sg.add_edge(w, first, warmup_rule[name])
        if st.workspace == "hoisted":
            prov = sg.add_step("provision", name, top, rank, head if name in twins else -2)
            sg.add_edge(prov, first, hoist_rule[name])
        key_order = keys[name][1] if name in keys else "size-major"
        for order, rule in r.forced.get(name, []):
            sg.chain(name, ordered if order == st.order else _reordered(ordered, order, key_order), rule)
        if name in keys:
            # the key order's own rule labels the edges between keys of one size (size-major)
            # or of one combination (variant-major); the size order's the rest
            combos, key_order, key_rule = keys[name]
            sizes = list(dict.fromkeys(bs for bs, _ in ordered))
            inner = [[(bs, c) for c in combos] for bs in sizes] if key_order == "size-major" else []
            inner += [[(bs, c) for bs in sizes] for c in combos] if key_order == "variant-major" else []
            for group in inner:
                sg.chain(name, group, key_rule)
        sg.chain(name, ordered, order_rule[name])
    for twin, parent in twins.items():
        # each twin capture between its phase's capture of the same key and the next one;
        # its warm-ups and provision (at its capture's position) after the capture before it
        ids = [c.id for c in captured[parent]]
        for i in range(1, len(ids)):
            if twin in (sg.g.nodes[ids[i - 1]]["phase"], sg.g.nodes[ids[i]]["phase"]):
                sg.add_edge(ids[i - 1], ids[i], f"twin_of:{twin}")
        for n, d in list(sg.g.nodes.items()):
            if d["phase"] == twin and d["op"] != "capture" and d["key"][1] > 0:
                sg.add_edge(ids[d["key"][1] - 1], n, f"twin_of:{twin}")
    # phases in sequence; a twin goes with its phase, and the next phase after both
    groups = [name for name in sequence if name not in twins]
    for prev, nxt in zip(groups, groups[1:]):
        last = captured[prev][-1].id
        after = {twins.get(d, d) for d in phases[nxt].after}
        rule = f"after:{nxt}" if prev in after else "phase-order"
        for n in [n for n, d in sg.g.nodes.items() if d["phase"] == nxt and d["op"] != "capture"]:
            sg.add_edge(last, n, rule)  # the next phase's warm-ups and provisions too
        first = step_id("capture", nxt, *own[nxt][0])
        sg.add_edge(last, first, rule)
    # `after` constraints between non-adjacent phases still hold by transitivity
    # through the phase-order chain, which phase_sequence derived from them.
    return sg
