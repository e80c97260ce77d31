"""Graphs the engine captured itself, as a GraphSet that ``verify`` checks.

An engine that tries capture-plan first in its own CI keeps its capture loop
exactly as it is (plain ``torch.cuda.graph`` into one pool) and hands over
what it has after the loop::

    with record_graphs() as rec:                  # optional: the footprint check needs it
        runner.capture()                          # the engine's own loop, unchanged
    gs = adopt({("decode", bs): g for bs, g in runner.graphs.items()},
               {("decode", bs): out for bs, out in runner.outputs.items()},
               pool=runner.pool, eager=lambda phase, bs: runner.forward_eager(bs),
               prepare=runner.random_inputs, read_only=runner.weights(), recorded=rec)
    verify(gs).raise_for_faults()

``adopt`` builds the same GraphSet as ``capture()`` (one ``Captured`` per
graph, O(1) dispatch over the adopted sizes), with an :class:`EngineFunctions`
target that runs the engine's eager function and input preparation, so every
check of ``verify`` applies: interleave and scribble always, footprint with
the allocation history (``record_graphs`` around the loop, or
``capture_loop(plan, record=True)``), read-only with ``read_only``.

:func:`record_graphs` records the allocation history while it is open and
marks the bounds of every ``torch.cuda.CUDAGraph`` capture made meanwhile (it
wraps ``CUDAGraph.capture_begin`` and ``capture_end`` for that time): the
engine's code is unchanged. Markers are small allocations made outside the
captures; they change nothing the graphs allocate.

What it does not do: know which outputs the engine still holds, which
inputs are valid, or what its graphs should compute. ``held`` says whether
the outputs are owning tensors ("keep": interleave re-checks them after
other replays) or non-owning views ("view"); ``prepare`` (or, without it,
``inputs``) gives each replay fresh inputs; ``eager`` is the reference.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping

import torch

from .errors import ExecutorError
from .graphs import Captured, GraphSet, as_outputs, dispatch_name
from .pool import AllocationRecorder, Window

__all__ = ["adopt", "EngineFunctions", "record_graphs", "GraphRecording"]


class EngineFunctions:
    """A CaptureTarget made of the engine's own functions (``verify`` needs no more).

    * ``eager(phase, bs)`` runs the engine's forward eagerly at the padded
      size ``bs`` on its static inputs and returns the outputs (a tensor or a
      tuple of tensors, as the graph's are held);
    * ``prepare(phase, n, bs, generator)`` writes random *valid* inputs for
      ``n`` requests padded to ``bs`` into the static inputs; without it,
      every floating-point tensor of ``inputs`` is refilled from a normal
      distribution and integer inputs keep the values the engine left
      (indices stay valid; they are then not varied between replays);
    * ``read_only`` names tensors no graph may write (weights, lookup tables).

    ``refresh`` does nothing: graphs captured by the engine compute their
    own metadata (a hoisted workspace is ``capture_loop``'s, with a target).
    """

    def __init__(
        self,
        eager: Callable,
        *,
        prepare: Callable | None = None,
        inputs=(),
        read_only: Mapping[str, torch.Tensor] | None = None,
    ):
        self._eager, self._prepare = eager, prepare
        self._inputs = tuple(inputs.values() if isinstance(inputs, Mapping) else inputs)
        self._read_only = dict(read_only or {})

    def run(self, phase: str, bs: int, workspace) -> tuple[torch.Tensor, ...]:
        return as_outputs(self._eager(phase, bs))

    def prepare(self, phase: str, n: int, bs: int, generator: torch.Generator) -> None:
        if self._prepare is not None:
            self._prepare(phase, n, bs, generator)
            return
        for t in self._inputs:
            if t.is_floating_point():
                t.normal_(generator=generator)

    def refresh(self, phase: str, n: int, bs: int, workspace) -> None:
        pass

    def read_only(self) -> dict[str, torch.Tensor]:
        return self._read_only


class GraphRecording:
    """What :func:`record_graphs` saw: the graphs captured, in order, and
    (after the block) each one's allocation window."""

    def __init__(self) -> None:
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.windows: list[Window] = []

    def window(self, graph) -> Window | None:
        for g, w in zip(self.graphs, self.windows):
            if g is graph:
                return w
        return None


_patch_lock = threading.Lock()


@contextlib.contextmanager
def record_graphs(max_entries: int = 2_000_000):
    """Record the allocation history and the bounds of every graph capture in the block.

    Yields a :class:`GraphRecording`, complete when the block ends. Only one
    block at a time per process (it wraps ``torch.cuda.CUDAGraph``'s methods);
    captures on other threads meanwhile are recorded too. A capture that
    fails inside the block is not listed."""
    if not _patch_lock.acquire(blocking=False):
        raise ExecutorError("record_graphs() is already recording", where="record_graphs", fix="one block at a time")
    cls = torch.cuda.CUDAGraph
    begin, end = cls.capture_begin, cls.capture_end
    rec, out = AllocationRecorder(max_entries), GraphRecording()
    #: per begin/end pair of the recorder, in order: its graph, or None for a capture that failed
    owners: list = []

    def capture_begin(self, *a, **kw):
        rec.begin()  # the marker is allocated before capturing: outside the pool
        try:
            return begin(self, *a, **kw)
        except BaseException:
            rec.end()
            owners.append(None)
            raise

    def capture_end(self, *a, **kw):
        try:
            done = end(self, *a, **kw)
        except BaseException:
            rec.end()
            owners.append(None)
            raise
        rec.end()
        owners.append(self)
        return done

    cls.capture_begin, cls.capture_end = capture_begin, capture_end
    ok = False
    try:
        yield out
        ok = True
    finally:
        cls.capture_begin, cls.capture_end = begin, end
        _patch_lock.release()
        if ok:
            kept = [(g, w) for g, w in zip(owners, rec.stop()) if g is not None]
            out.graphs, out.windows = [g for g, _ in kept], [w for _, w in kept]
        else:
            rec.close()


def _key(k) -> tuple[str, int, tuple[tuple[str, str], ...]]:
    """``(phase, bs, labels)`` of an engine's graph key: a batch size (phase
    "decode"), ``(phase, bs)``, ``(phase, bs, labels)`` with labels a mapping or
    ``(axis, label)`` pairs, or a :class:`~capture_plan.schemas.keys.GraphKey`."""
    if isinstance(k, int) and not isinstance(k, bool):
        return ("decode", k, ())
    if isinstance(k, tuple) and len(k) >= 2 and isinstance(k[0], str) and isinstance(k[1], int):
        labels = k[2] if len(k) > 2 else ()
        pairs = tuple(labels.items()) if isinstance(labels, Mapping) else tuple(labels)
        if all(isinstance(p, tuple) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in pairs):
            return (k[0], k[1], pairs)
    raise ExecutorError(
        f"graph key {k!r} is neither (phase, bs[, labels]) nor a batch size",
        where="adopt",
        fix="key the graphs by (phase, bs), (phase, bs, {axis: label}) or a GraphKey",
    )


def _rows(tensors: tuple[torch.Tensor, ...], bs: int, ragged: bool, where: str) -> tuple[int, ...]:
    """Rows per request of each output (0: held whole; see LoopStep.hold)."""
    rows = []
    for t in tensors:
        per, rem = divmod(t.shape[0], bs) if t.dim() else (0, 0)
        if rem and not ragged:
            raise ExecutorError(f"output has {t.shape[0]} rows, not a multiple of bs {bs}", where=where)
        rows.append(0 if rem else per)
    return tuple(rows)


def adopt(
    graphs: Mapping,
    outputs: Mapping,
    *,
    pool,
    eager: Callable | None = None,
    target=None,
    prepare: Callable | None = None,
    inputs=(),
    read_only: Mapping[str, torch.Tensor] | None = None,
    held: str = "keep",
    recorded: GraphRecording | None = None,
    device=None,
    ragged: bool = False,
) -> GraphSet:
    """A GraphSet of graphs the engine captured itself; see the module docstring.

    ``graphs`` and ``outputs`` are keyed alike by graph key: ``(phase, bs)``
    (a bare batch size means phase "decode"), ``(phase, bs, labels)`` with the
    key's labels (``{"lora": "nolora"}``), or a
    :class:`~capture_plan.schemas.keys.GraphKey`; ``graphs`` in capture order (a
    dict's order; ``recorded`` overrides it with the order they were captured
    in). A key's graph may be a list of piece graphs (a piecewise capture),
    its outputs then a list with each piece's (None for a piece that writes
    into buffers); outputs may be None. A key with labels is dispatched as
    ``phase/axis=label,...`` (``GraphSet.variant``), piece ``k`` as ``...#k``.
    ``pool`` is the pool handle they share, or a mapping from phase to handle.
    ``eager`` (with ``prepare``, ``inputs``, ``read_only``) makes an
    :class:`EngineFunctions` target; ``target`` gives a CaptureTarget
    instead. ``ragged``: outputs whose rows are no multiple of the size are
    held whole (an error otherwise). The set shares the engine's graphs: its
    ``release`` resets them (call it only to be rid of them); ``verify``
    leaves them servable.
    """
    if held not in ("keep", "view"):
        raise ExecutorError(f"held={held!r}", where="adopt", fix='use "keep" or "view"')
    if (eager is None) == (target is None):
        raise ExecutorError(
            "adopt needs the engine's eager function (eager=) or a CaptureTarget (target=)",
            where="adopt",
            fix="pass eager=lambda phase, bs: <the forward run eagerly>",
        )
    if target is None:
        # eager is given: exactly one of eager and target is (checked above)
        target = EngineFunctions(eager, prepare=prepare, inputs=inputs, read_only=read_only)  # pyright: ignore[reportArgumentType]
    keys = [_key(k) for k in graphs]
    outs = {_key(k): v for k, v in outputs.items()}
    missing = [k for k in keys if k not in outs]
    if missing:
        raise ExecutorError(
            f"no outputs for graph {dispatch_name(missing[0][0], missing[0][2])}/{missing[0][1]}",
            where="adopt",
            fix="give outputs for every graph",
        )
    by_key = dict(zip(keys, graphs.values()))
    # one entry per graph: (key, piece or None, graph, outputs)
    entries = []
    for k in keys:
        g, o = by_key[k], outs[k]
        if isinstance(g, (list, tuple)):
            per = list(o) if isinstance(o, (list, tuple)) and len(o) == len(g) else [None] * len(g)
            entries += [(k, i, gi, oi) for i, (gi, oi) in enumerate(zip(g, per))]
        else:
            entries.append((k, None, g, o))
    if recorded is not None:
        order = {id(g): i for i, g in enumerate(recorded.graphs)}
        unseen = [e for e in entries if id(e[2]) not in order]
        if unseen:
            (phase, bs, labels), piece = unseen[0][0], unseen[0][1]
            raise ExecutorError(
                f"graph {dispatch_name(phase, labels, piece)}/{bs} was not captured inside record_graphs()",
                where="adopt",
                fix="open record_graphs() around the engine's whole capture loop",
            )
        entries.sort(key=lambda e: order[id(e[2])])
    pools = dict(pool) if isinstance(pool, Mapping) else None
    sizes: dict[str, list[int]] = {}
    for (phase, bs, labels), piece, _, _ in entries:
        sizes.setdefault(dispatch_name(phase, labels, piece), []).append(bs)
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    gs = GraphSet(None, target, dev, sizes=sizes)
    for (phase, bs, labels), piece, graph, out in entries:
        handle = pools.get(phase) if pools is not None else pool
        if handle is None:
            raise ExecutorError(f"no pool for phase {phase!r}", where="adopt", fix="give pool= for every phase")
        name = f"phase:{phase}" if pools is not None else "shared"
        gs.pools.setdefault(name, handle)  # pyright: ignore[reportArgumentType]  # a handle: a Mapping pool is read per phase above
        tensors = as_outputs(out)
        where = f"adopt, graph {dispatch_name(phase, labels, piece)}/{bs}"
        rows = _rows(tensors, bs, ragged, where)
        cap = Captured(
            phase=dispatch_name(phase, labels, piece),
            bs=bs,
            pool=name,
            graph=graph,
            outputs=tensors,
            held=held,
            rows=rows,
            key_phase=phase,
            labels=labels,
            piece=piece,
        )
        if recorded is not None:
            cap.window = recorded.window(graph)
        gs.add(cap)
    return gs
