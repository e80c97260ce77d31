"""Which graphs may share an executable (capture_plan.executor.exec_reuse): the structure
comparison over torch-free node descriptions, on the CPU."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, strategies as st

from capture_plan.executor.exec_reuse import (
    GraphDesc,
    KernelDesc,
    NodeDesc,
    ReuseGroups,
    canonical,
    difference,
    judge_cluster_probe,
    unshareable,
)

NO_CLUSTER = (("cluster_dimension", (0, 0, 0)), ("cooperative", (0, 0, 0)), ("preferred_cluster_dimension", (0, 0, 0)))


def kernel(fn: int, block=(128, 1, 1), shared=0, attrs=NO_CLUSTER, opaque=False) -> NodeDesc:
    return NodeDesc("kernel", KernelDesc((fn, fn + 1000), block, shared, attrs, opaque))


kernels = st.builds(
    kernel,
    st.integers(1, 5),
    st.sampled_from([(128, 1, 1), (256, 1, 1)]),
    st.sampled_from([0, 4096]),
)
nodes_st = st.one_of(kernels, st.just(NodeDesc("memcpy")), st.just(NodeDesc("memset")), st.just(NodeDesc("empty")))


@st.composite
def graphs(draw):
    """A DAG: edges only from a lower to a higher driver index."""
    nodes = draw(st.lists(nodes_st, min_size=1, max_size=8))
    n = len(nodes)
    pairs = [(a, b) for a in range(n) for b in range(a + 1, n)]
    edges = draw(st.lists(st.sampled_from(pairs), unique=True, max_size=10)) if pairs else []
    return nodes, edges


@given(graphs())
def test_a_graph_matches_itself_and_the_comparison_agrees_with_the_signature(g):
    nodes, edges = g
    a = canonical(nodes, edges)
    assert difference(a, a) is None and a.signature() == canonical(nodes, edges).signature()
    # the same graph listed by the driver in reverse order: whatever the comparison finds, the
    # signature (the groups' key) finds the same
    rev = list(reversed(nodes))
    n = len(nodes)
    b = canonical(rev, [(n - 1 - x, n - 1 - y) for x, y in edges])
    assert (difference(a, b) is None) == (a.signature() == b.signature())


@given(st.lists(nodes_st, min_size=1, max_size=8))
def test_a_chain_listed_in_reverse_order_matches(nodes):
    """Where the edges force the topological order (a chain), the driver's listing order does
    not matter: the reversed listing is the same graph, judged alike and keyed alike."""
    n = len(nodes)
    a = canonical(nodes, [(i, i + 1) for i in range(n - 1)])
    rev = list(reversed(nodes))  # node i is listed at n - 1 - i; the chain's edges follow it
    b = canonical(rev, [(n - 1 - i, n - 2 - i) for i in range(n - 1)])
    assert difference(a, b) is None
    assert a.signature() == b.signature()


@given(graphs(), st.data())
def test_any_changed_kernel_field_is_a_difference_named(g, data):
    nodes, edges = g
    ks = [i for i, nd in enumerate(nodes) if nd.kernel is not None]
    if not ks:
        return
    i = data.draw(st.sampled_from(ks))
    k = nodes[i].kernel
    assert k is not None
    field, value = data.draw(
        st.sampled_from(
            [
                ("function", (99, 99)),
                ("block", (64, 2, 1)),
                ("shared_bytes", 123),
                ("attributes", (("cluster_dimension", (2, 1, 1)),) + NO_CLUSTER[1:]),
            ]
        )
    )
    changed = list(nodes)
    changed[i] = NodeDesc("kernel", dataclasses.replace(k, **{field: value}))
    a, b = canonical(nodes, edges), canonical(changed, edges)
    why = difference(a, b)
    assert why is not None
    assert difference(b, a) is not None
    assert a.signature() != b.signature()


def test_a_launch_attribute_alone_refuses_sharing_and_says_which():
    """The planted mismatch: two graphs alike but one kernel's cluster dimension, which an
    executable update keeps without reading it back."""
    plain = canonical([kernel(1), kernel(2)], [(0, 1)])
    cluster = canonical([kernel(1), kernel(2, attrs=(("cluster_dimension", (2, 1, 1)),) + NO_CLUSTER[1:])], [(0, 1)])
    why = difference(plain, cluster)
    assert why == "node 1's launch attribute cluster_dimension differs ((0, 0, 0) vs (2, 1, 1))"
    groups = ReuseGroups()
    assert groups.place("decode/8", plain) == 0
    assert groups.place("decode/4", cluster) == 1
    assert groups.instantiations == 2
    assert groups.refusals == [("decode/4", f"not the structure of decode/8: {why}")]


def test_graphs_alike_share_one_executable():
    a = canonical([kernel(1), NodeDesc("memset"), kernel(2)], [(0, 2), (1, 2)])
    groups = ReuseGroups()
    for bs in (64, 32, 16):
        assert groups.place(f"decode/{bs}", a) == 0
    assert groups.instantiations == 1 and groups.refusals == []
    assert groups.groups[0][1] == ["decode/64", "decode/32", "decode/16"]


def test_edges_and_node_counts_are_compared():
    a = canonical([kernel(1), kernel(1), kernel(1)], [(0, 1), (1, 2)])
    fan = canonical([kernel(1), kernel(1), kernel(1)], [(0, 1), (0, 2)])
    assert difference(a, fan) is not None and "dependencies differ" in difference(a, fan)
    short = canonical([kernel(1), kernel(1)], [(0, 1)])
    assert difference(a, short) == "3 nodes vs 2"


def test_opaque_clusters_and_unknown_node_types_share_nothing():
    opaque = canonical([kernel(1, attrs=(("cluster_dimension", (2, 1, 1)),), opaque=True)], [])
    assert "cluster" in unshareable(opaque)
    # the driver's answer for the attribute it did not read is in the reason, and is not structure
    told = KernelDesc((1, 1001), (128, 1, 1), 0, (("cluster_dimension", (2, 1, 1)),), True, "x: CUresult 1")
    assert "(x: CUresult 1)" in unshareable(canonical([NodeDesc("kernel", told)], []))
    assert told == KernelDesc((1, 1001), (128, 1, 1), 0, (("cluster_dimension", (2, 1, 1)),), True)
    host = canonical([kernel(1), NodeDesc("host")], [(0, 1)])
    assert "host node" in unshareable(host)
    groups = ReuseGroups()
    assert groups.place("a/1", opaque) is None and groups.place("a/2", opaque) is None
    assert groups.instantiations == 2 and groups.groups == []
    assert difference(opaque, opaque) is not None  # never shared, not even with itself


def test_canonical_refuses_cycles_and_stray_edges():
    with pytest.raises(ValueError, match="cycle"):
        canonical([kernel(1), kernel(2)], [(0, 1), (1, 0)])
    with pytest.raises(ValueError, match="past the graph"):
        canonical([kernel(1)], [(0, 3)])


def test_canonical_order_is_topological():
    g = canonical([kernel(3), kernel(2), kernel(1)], [(2, 1), (1, 0)])
    assert [n.kernel.function[0] for n in g.nodes if n.kernel] == [1, 2, 3]
    assert g.edges == ((0, 1), (1, 2))
    assert isinstance(g, GraphDesc)


def test_an_edge_of_another_dependency_type_is_a_difference():
    """An edge's data (ports, dependency type: a programmatic launch dependency) is part of
    the structure: two graphs alike but for one edge's type share no executable."""
    from capture_plan.executor.exec_reuse import canonical, difference

    k = NodeDesc(type="kernel", kernel=KernelDesc(function=(1, 1), block=(128, 1, 1), shared_bytes=0))
    plain = canonical([k, k], [(0, 1)])
    programmatic = canonical([k, k], [(0, 1, 0, 0, 1)])
    assert programmatic.edges == ((0, 1, 0, 0, 1),)
    assert difference(plain, programmatic) is not None
    assert difference(programmatic, canonical([k, k], [(0, 1, 0, 0, 1)])) is None


# -- the cluster probe's verdict (exec_update runs the launches; the verdict is pure) --------
# plain: the control launch (only the kernel's own cluster) and its read-back; node_rc: the
# recorded node's read of its preferred cluster dimension (CUresult 1 on the H200)


def test_a_driver_that_reads_back_what_a_launch_set_proves_an_unreadable_one_unset():
    v = judge_cluster_probe((0, 1), [((8, 1, 1), 0, 0, (8, 1, 1))], node_rc=1)
    assert v.proves_unset and "reads back" in v.found


def test_an_unset_control_that_reads_otherwise_than_the_recorded_node_proves_nothing():
    # the driver reads a set value back, but an unset one reads 0 where the recorded node read 1:
    # the recorded node's failure is not "unset"
    v = judge_cluster_probe((0, 0), [((8, 1, 1), 0, 0, (8, 1, 1))], node_rc=1)
    assert not v.proves_unset and "may be set" in v.found


def test_a_driver_that_holds_one_it_does_not_read_back_proves_nothing():
    # SGLang 0.5.23's B300 finding, and the H200's driver 580 (measured): the launch takes the
    # attribute, the node does not return it
    for read_rc, read in [(1, None), (0, (4, 1, 1)), (0, (0, 0, 0))]:
        v = judge_cluster_probe((0, 1), [((8, 1, 1), 0, read_rc, read)], node_rc=1)
        assert not v.proves_unset, (read_rc, read)
        assert "does not read back" in v.found


def test_a_device_that_refuses_every_valid_value_proves_none_is_set():
    v = judge_cluster_probe((0, 1), [((8, 1, 1), 1, -1, None), ((4, 1, 1), 801, -1, None)], node_rc=1)
    assert v.proves_unset and "refuses every launch" in v.found and "CUresult 801" in v.found


def test_a_refusal_for_another_cause_proves_nothing():
    # out of memory (2) or an invalidated capture (901) says nothing of the attribute
    for rc in (2, 901):
        v = judge_cluster_probe((0, 1), [((8, 1, 1), 1, -1, None), ((4, 1, 1), rc, -1, None)], node_rc=1)
        assert not v.proves_unset and "nothing learnt" in v.found, rc


def test_the_first_value_a_launch_takes_decides():
    # refused at twice the cluster, taken at the cluster itself and not read back: not proven
    v = judge_cluster_probe((0, 1), [((8, 1, 1), 1, -1, None), ((4, 1, 1), 0, 1, None)], node_rc=1)
    assert not v.proves_unset


def test_a_failed_control_launch_or_no_value_tried_proves_nothing():
    assert not judge_cluster_probe((700, -1), [((8, 1, 1), 1, -1, None)], node_rc=1).proves_unset
    assert not judge_cluster_probe((0, 1), [], node_rc=1).proves_unset
