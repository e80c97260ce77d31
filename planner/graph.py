"""Capture steps as a dependency graph (networkx), and its canonical order.

Nodes are step ids (``capture/decode/256``); every edge carries the ``rule``
that added it, so ``planner explain`` can say why one step precedes another
and a cycle can be reported as the rules in conflict. The order is
networkx's lexicographic topological sort with the key
(phase rank, position in the phase's capture order, op rank): deterministic
on every machine, and it puts each warm-up right before its capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from schemas.errors import ConstraintError
from schemas.plan import Edge, Strategy
from schemas.spec import Phase

__all__ = ["step_id", "phase_sequence", "StepGraph", "check_acyclic", "capture_order"]

_OP_RANK = {"provision": 0, "warmup": 1, "capture": 2}


def step_id(op: str, phase: str, bs: int) -> str:
    return f"{op}/{phase}/{bs}"


def capture_order(sizes: list[int], order: str) -> list[int]:
    return sorted(sizes, reverse=order == "largest-first")


def check_acyclic(g: nx.DiGraph, what: str = "steps") -> None:
    """Raise the rules on a cycle as a conflict; never a traceback."""
    try:
        cycle = nx.find_cycle(g)
    except nx.NetworkXNoCycle:
        return
    rules = sorted({g.edges[u, v]["rule"] for u, v, *_ in cycle})
    path = " -> ".join([cycle[0][0]] + [v for _, v, *_ in cycle])
    raise ConstraintError(f"rules in conflict: {', '.join(rules)} (they order {what} in a cycle: {path})",
                          where="rules", fix="remove or relax one of these rules")


def phase_sequence(phases: list[Phase], weight: dict[str, int]) -> list[str]:
    """Phase capture order: ``after`` constraints first, then the phase whose
    largest graph needs the most memory (so smaller phases reuse its blocks),
    then spec order."""
    index = {p.name: i for i, p in enumerate(phases)}
    g = nx.DiGraph()
    g.add_nodes_from(index)
    for p in phases:
        for dep in p.after:
            g.add_edge(dep, p.name, rule=f"after:{p.name}")
    check_acyclic(g, "phases")
    return list(nx.lexicographical_topological_sort(g, key=lambda n: (-weight[n], index[n])))


@dataclass
class StepGraph:
    """The DiGraph plus helpers to add steps and labelled edges."""

    g: nx.DiGraph

    @classmethod
    def empty(cls) -> "StepGraph":
        return cls(nx.DiGraph())

    def add_step(self, op: str, phase: str, bs: int, rank: int, pos: int) -> str:
        sid = step_id(op, phase, bs)
        self.g.add_node(sid, op=op, phase=phase, bs=bs, key=(rank, pos, _OP_RANK[op], bs))
        return sid

    def add_edge(self, src: str, dst: str, rule: str) -> None:
        # Two rules may add the same edge; keep the first for a stable label.
        if not self.g.has_edge(src, dst):
            self.g.add_edge(src, dst, rule=rule)

    def chain(self, phase: str, sizes: list[int], rule: str) -> None:
        ids = [step_id("capture", phase, bs) for bs in sizes]
        for a, b in zip(ids, ids[1:]):
            self.add_edge(a, b, rule)

    def order(self) -> list[str]:
        check_acyclic(self.g)
        return list(nx.lexicographical_topological_sort(self.g, key=lambda n: self.g.nodes[n]["key"]))

    def edges(self, index: dict[str, int]) -> list[Edge]:
        out = [Edge(src=u, dst=v, rule=d["rule"]) for u, v, d in self.g.edges(data=True)]
        return sorted(out, key=lambda e: (index[e.dst], index[e.src], e.rule))


def build_steps(phases: dict[str, Phase], sequence: list[str], strategies: dict[str, Strategy],
                order_rule: dict[str, str], warmup_rule: dict[str, str], hoist_rule: dict[str, str],
                forced: dict[str, list[tuple[str, str]]]) -> StepGraph:
    """The full step graph for chosen strategies.

    ``forced`` holds, per phase, (order, rule) pairs that rules or pins demand
    outright; they are added as edges too, so two that disagree form a cycle.
    """
    sg = StepGraph.empty()
    for rank, name in enumerate(sequence):
        p, st = phases[name], strategies[name]
        sizes = capture_order(p.sizes, st.order)
        for pos, bs in enumerate(sizes):
            sg.add_step("capture", name, bs, rank, pos)
            if st.warmup == "every-size":
                sg.add_step("warmup", name, bs, rank, pos)
                sg.add_edge(step_id("warmup", name, bs), step_id("capture", name, bs), warmup_rule[name])
        first = step_id("capture", name, sizes[0])
        if st.warmup == "once-per-phase":
            w = sg.add_step("warmup", name, max(sizes), rank, -1)
            sg.add_edge(w, first, warmup_rule[name])
        if st.workspace == "hoisted":
            prov = sg.add_step("provision", name, max(sizes), rank, -2)
            sg.add_edge(prov, first, hoist_rule[name])
        for order, rule in forced.get(name, []):
            sg.chain(name, capture_order(p.sizes, order), rule)
        sg.chain(name, sizes, order_rule[name])
    for prev, nxt in zip(sequence, sequence[1:]):
        last = step_id("capture", prev, capture_order(phases[prev].sizes, strategies[prev].order)[-1])
        rule = f"after:{nxt}" if prev in phases[nxt].after else "phase-order"
        for n in [n for n, d in sg.g.nodes(data=True) if d["phase"] == nxt and d["op"] != "capture"]:
            sg.add_edge(last, n, rule)  # the next phase's warm-ups and provisions too
        first = step_id("capture", nxt, capture_order(phases[nxt].sizes, strategies[nxt].order)[0])
        sg.add_edge(last, first, rule)
    # `after` constraints between non-adjacent phases still hold by transitivity
    # through the phase-order chain, which phase_sequence derived from them.
    return sg
