"""Which graph builder a rebuild runs, and the flat arrays the compiled one takes.

A rebuild (``graph_rebuild.rebuild_graphs``) adds every node of a graph file through the
driver. Its ctypes path makes one Python-to-C call per node and per edge list; the compiled
graph builder (executor/_graph_build.pyx, an optional extension: setup.py) makes the same
calls from C over flat arrays that :func:`flatten` prepares once per graph, through the
driver's entry points found by ctypes (:func:`entry_points`). :func:`graph_builder` says which
runs here and why (the restore's report and the graph file's ``inspect`` name it);
:data:`BUILDER_ENV` forces one. Both make the same node-adding calls with the same bytes
(tests/test_graph_build.py records both through C-callable fakes), so the choice changes speed
only. The one difference: the compiled path looks every kernel of a graph up
(``cuModuleGetFunction``, ...) and patches its arguments while flattening, before the graph's
first node is added, where the ctypes path does it node by node; a failure in either is the
same error, and the graph begun is destroyed alike.

The records (int64, :func:`flatten`): per node its kind (one byte: ``KINDS``); per kernel node
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
import os
from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from .errors import ExecutorError

__all__ = ["BUILDER_ENV", "GraphBuilder", "graph_builder", "entry_points", "Flat", "flatten"]

#: ``ctypes`` runs the ctypes path even where the compiled builder is built; ``compiled``
#: requires it (an error where it did not load); unset or ``auto``: compiled where it loads
BUILDER_ENV = "CAPTURE_PLAN_GRAPH_BUILDER"
#: the largest address a record holds (int64); a larger one goes through ``patched_args``
_MAX = (1 << 63) - 1
_PAD = bytes(64)


class GraphBuilder(NamedTuple):
    """The graph builder a rebuild here runs: ``compiled`` or ``ctypes``, and why, when ctypes."""

    name: str
    why: str = ""

    def describe(self) -> str:
        return f"{self.name} ({self.why})" if self.why else self.name


def graph_builder() -> GraphBuilder:
    """The compiled graph builder where it loads, unless :data:`BUILDER_ENV` says ``ctypes``;
    an ExecutorError where it says ``compiled`` and it did not load, or names no builder."""
    want = os.environ.get(BUILDER_ENV, "").strip().lower()
    if want not in ("", "auto", "ctypes", "compiled"):
        raise ExecutorError(
            f"{BUILDER_ENV}={os.environ[BUILDER_ENV]!r} names no graph builder (ctypes, compiled or auto)",
            where=f"environment variable {BUILDER_ENV}",
            fix=f"unset {BUILDER_ENV}",
        )
    if want == "ctypes":
        return GraphBuilder("ctypes", f"{BUILDER_ENV}=ctypes")
    try:
        importlib.import_module(f"{__package__}._graph_build")
    except ImportError as e:  # not built here (no C compiler at install time), or built for another Python
        why = f"the compiled graph builder did not load: {e}"
        if want == "compiled":
            raise ExecutorError(
                f"{BUILDER_ENV}=compiled, but {why}",
                where=f"environment variable {BUILDER_ENV}",
                fix=f"unset {BUILDER_ENV} (the ctypes path rebuilds the same graphs), or reinstall with a C "
                "compiler: pip install --force-reinstall --no-deps .",
            ) from None
        return GraphBuilder("ctypes", why)
    return GraphBuilder("compiled")


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


@dataclass
class Flat:
    """One graph as the compiled builder takes it (the module docstring lays the records out)."""

    kinds: bytes
    kernels: array
    blob: bytes
    params: array
    relocs: array
    attrs: array
    memsets: array
    copies: array
    edges: array
    #: per attribute record, its name (an error names it)
    attribute_names: list[str]


def flatten(
    g,
    bases: list[int | None],
    function: Callable[[object, str], ctypes.c_void_p],
    functions: Mapping[tuple[int, str], ctypes.c_void_p],
    index: dict[int, int],
    attribute_ids: Mapping[str, int],
    kinds: Mapping[str, int],
) -> Flat:
    """Graph ``g`` of a graph file as :class:`Flat` records: every address at ``bases``
    (``graph_rebuild.segment_bases``), every kernel's function from ``functions`` (keyed by
    (module, name)) or ``function(kernel, where)`` (``graph_rebuild._Builder.function``: the
    lookup, which raises naming the node), numbered by ``index`` (function -> its number,
    shared by a builder's graphs), launch attributes by ``attribute_ids``. An operand in a
    segment with no address here raises graph_rebuild's error, naming the node."""
    from .graph_rebuild import _address, patched_args

    label = f"graph {g.phase}/{g.bs}"
    node_kinds = bytearray(len(g.nodes))
    kernels, params, relocs, attrs = array("q"), array("q"), array("q"), array("q")
    memsets, copies, edges = array("q"), array("q"), array("q")
    names: list[str] = []
    parts: list[bytes] = []
    size, nb = 0, len(bases)
    kernel, memset, copy, empty = kinds["kernel"], kinds["memset"], kinds["memcpy"], kinds["empty"]
    for i, n in enumerate(g.nodes):
        k = n.kernel
        if k is not None:
            node_kinds[i] = kernel
            args = k.args
            start = (size + 63) & ~63
            if start > size:
                parts.append(_PAD[: start - size])
            parts.append(args)
            mark, end = len(relocs), len(args) - 8
            for r in k.relocations:  # graph_rebuild.patched_args, with the write left to the builder
                pos, seg = r.position, r.segment
                base = bases[seg] if seg < nb else None
                if base is None:
                    raise ExecutorError(
                        f"an operand in segment {seg}, which has no address here", where=f"{label} node {i}"
                    )
                address = base + r.offset
                if not (0 <= pos <= end and 0 <= address <= _MAX):  # as patched_args has it, whatever that is
                    del relocs[mark:]
                    parts[-1] = args = patched_args(k, bases, f"{label} node {i}")
                    break
                relocs.append(start + pos)
                relocs.append(address)
            size = start + len(args)
            f = functions.get((k.module, k.name))
            if f is None:
                f = function(k, f"{label} node {i}")
            fv = f.value or 0
            fi = index.get(fv)
            if fi is None:
                fi = index[fv] = len(index)
            first_attr = len(names)
            if k.attributes:
                for name, value in sorted(k.attributes.items()):
                    attrs.append(attribute_ids[name])
                    attrs.extend(value)
                    names.append(name)
            grid, block = k.grid, k.block
            kernels.extend((fv, grid[0], grid[1], grid[2], block[0], block[1], block[2], k.shared_bytes, start))
            kernels.extend((len(params), len(k.params), fi, first_attr, len(names) - first_attr))
            kernels.extend((mark // 2, (len(relocs) - mark) // 2))
            for off, _ in k.params:
                params.append(off)
        elif n.memset is not None:
            node_kinds[i] = memset
            m = n.memset
            dst = _address(m.dst, bases, f"{label} node {i}")
            memsets.extend((dst, m.pitch, m.value, m.element_size, m.width, m.height))
        elif n.copy is not None:
            node_kinds[i] = copy
            c, where = n.copy, f"{label} node {i}"
            src, dst = _address(c.src, bases, where), _address(c.dst, bases, where)
            copies.extend((src, dst, c.src_pitch, c.src_height, c.dst_pitch, c.dst_height, c.width, c.height, c.depth))
        else:
            node_kinds[i] = empty
    at = range(len(g.nodes))  # an index as the ctypes path's list takes it: negative from the end, else IndexError
    for e in g.edges:
        edges.extend((at[e[0]], at[e[1]], e[2], e[3], e[4]) if len(e) == 5 else (at[e[0]], at[e[1]], 0, 0, 0))
    return Flat(bytes(node_kinds), kernels, b"".join(parts), params, relocs, attrs, memsets, copies, edges, names)
