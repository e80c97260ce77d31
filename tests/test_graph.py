"""planner/graph.py's Digraph: the same order and cycle reports as networkx."""

from __future__ import annotations

import networkx as nx
import pytest
from hypothesis import given, settings, strategies as st

from capture_plan.planner.graph import Digraph, check_acyclic
from capture_plan.schemas.errors import ConstraintError


@st.composite
def _dags(draw):
    n = draw(st.integers(1, 12))
    edges = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=30))
    keys = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))  # ties broken by insertion order
    perm = draw(st.permutations(range(n)))  # insertion order differs from node value
    return n, [(a, b) for a, b in edges if a < b], keys, perm


@settings(max_examples=150, deadline=None)
@given(_dags())
def test_topological_order_is_networkx_lexicographic_order(case):
    n, edges, keys, perm = case
    g, ng = Digraph(), nx.DiGraph()
    for v in perm:
        g.add_node(v)
        ng.add_node(v)
    for a, b in edges:
        g.add_edge(a, b, rule="r")
        ng.add_edge(a, b)
    key = keys.__getitem__
    assert g.topological_order(key) == list(nx.lexicographical_topological_sort(ng, key=key))


def test_cycle_names_its_rules():
    g = Digraph()
    g.add_edge("a", "b", rule="r1")
    g.add_edge("b", "c", rule="r2")
    g.add_edge("c", "a", rule="r3")
    g.add_edge("c", "d", rule="r4")
    assert g.topological_order(lambda n: n) is None
    with pytest.raises(ConstraintError, match=r"rules in conflict: r1, r2, r3 .*a -> b -> c -> a"):
        check_acyclic(g)
