"""Which graph builder a rebuild runs, and the flat records the compiled one takes.

A rebuild (``graph_rebuild.rebuild_graphs``) adds every node of a graph file through the
driver. Its ctypes path makes one Python-to-C call per node and per edge list; the compiled
graph builder (executor/_graph_build.pyx, an optional extension: setup.py) makes the same
calls from C over flat records that its ``flatten`` prepares once per graph (compiled too:
the same code in Python took about 2.6x as long on a CPU), through the driver's entry points
found by ctypes (:func:`entry_points`). :func:`graph_builder` says which
runs here and why (the restore's report and the graph file's ``inspect`` name it);
:data:`BUILDER_ENV` forces one. Both make the same node-adding calls with the same bytes
(tests/test_graph_build.py records both through C-callable fakes), so the choice changes speed
only. The one difference: the compiled path looks every kernel of a graph up
(``cuModuleGetFunction``, ...) and patches its arguments while flattening, before the graph's
first node is added, where the ctypes path does it node by node; a failure in either is the
same error, and the graph begun is destroyed alike.

The records (int64, ``_graph_build.flatten``): per node its kind (one byte: ``KINDS``); per kernel node
the function, grid, block, shared memory, where its arguments start in one blob of argument
buffers (each 64-byte aligned), its parameters' offsets, its function's index (the
per-function cache of launch attributes' defaults), its launch attributes (id, three words;
sorted by name) and its relocations (position in the blob, the address to write there); per
memset node its destination, pitch, value, element size, width, height; per copy node its
source, destination, pitches, heights and extent; per edge its two nodes' indices and its
data (from port, to port, type; zeros for an edge saved without data).
"""

from __future__ import annotations

import ctypes
import importlib
from collections.abc import Mapping
from typing import NamedTuple

from capture_plan.schemas.extension import Extension

from .errors import ExecutorError

__all__ = ["BUILDER_ENV", "NODE_CALLS", "GraphBuilder", "graph_builder", "compiled", "entry_points"]

#: the driver calls that add a rebuilt graph's nodes, launch attributes and edges (both paths
#: make them), in the order the compiled ``Builder`` takes their addresses
NODE_CALLS = (
    "cuGraphAddKernelNode_v2",
    "cuGraphAddMemsetNode",
    "cuGraphAddMemcpyNode",
    "cuGraphAddEmptyNode",
    "cuGraphAddDependencies_v2",
    "cuGraphKernelNodeGetAttribute",
    "cuGraphKernelNodeSetAttribute",
)

#: ``ctypes`` runs the ctypes path even where the compiled builder is built; ``compiled``
#: requires it (an error where it did not load); unset or ``auto``: compiled where it loads
BUILDER_ENV = "CAPTURE_PLAN_GRAPH_BUILDER"


class GraphBuilder(NamedTuple):
    """The graph builder a rebuild here runs: ``compiled`` or ``ctypes``, and why, when ctypes."""

    name: str
    why: str = ""

    def describe(self) -> str:
        return f"{self.name} ({self.why})" if self.why else self.name


#: the compiled graph builder, told by :data:`BUILDER_ENV`
_EXTENSION = Extension(
    f"{__package__}._graph_build",
    "graph builder",
    BUILDER_ENV,
    "ctypes",
    "the ctypes path rebuilds the same graphs",
    ExecutorError,
)


def compiled():
    """The compiled graph builder's module (an ImportError where it is not built)."""
    return importlib.import_module(_EXTENSION.module)


def graph_builder(*, log: bool = True) -> GraphBuilder:
    """The compiled graph builder where it loads, unless :data:`BUILDER_ENV` says ``ctypes``;
    an ExecutorError where it says ``compiled`` and it did not load, or names no builder.
    ``log``: the INFO line of a fallback to ctypes (a restore checks ahead, quietly, and its
    rebuild logs it once)."""
    module, why = _EXTENSION.load(log=log)
    return GraphBuilder("ctypes", why) if module is None else GraphBuilder("compiled")


def entry_points(calls: Mapping[str, object], names: tuple[str, ...]) -> dict[str, int] | str:
    """The address of each of ``names`` among ``calls`` (ctypes functions: libcuda's, or
    C-callable fakes), or a sentence saying which is no C function (a fake driver in Python)."""
    out = {}
    for name in names:
        try:
            address = ctypes.cast(calls[name], ctypes.c_void_p).value  # pyright: ignore[reportArgumentType]
        except (ctypes.ArgumentError, TypeError, KeyError):
            address = None
        if not address:
            return f"the driver call {name} is no C function"
        out[name] = address
    return out
