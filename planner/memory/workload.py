"""What one capture allocates in the pool, per (phase, size): the workload a plan is simulated on.

Two sources, one output type (:class:`Program` of planner/memory/program.py, typed
``Alloc``/``Free`` ops, what the simulator runs):

* **analytic** -- derived from the spec's model dimensions (planner/memory/analytic.py), each
  phase's builder run once over all its sizes and each size's program picked from it;
* **trace** -- the allocation events ``capture_plan.executor.profile`` recorded on a GPU
  (every size, or a few from which planner/memory/fitting.py derives the rest), each checked
  (ids, labels) and folded into a repeated layer where the layers repeat.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from capture_plan.schemas.errors import InputError
from capture_plan.schemas.spec import Model, Phase, phase_model
from capture_plan.schemas.trace import CaptureTrace, Trace

from ..inputs.resources import Backend
from .analytic import Batches, analytic_program
from .program import Alloc, Program, ops_from_events

__all__ = ["Workload"]


class Workload:
    """What each (phase, size) capture allocates, from the analytic model or a recorded trace."""

    __slots__ = ("source", "programs", "samples", "_hoisted", "_families")

    def __init__(
        self,
        source: Literal["analytic", "trace"],
        programs: dict[tuple, Program],
        samples: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] | None = None,
        families: dict[tuple, tuple[_Family, int]] | None = None,
    ) -> None:
        self.source: Literal["analytic", "trace"] = source
        #: by (phase, size), and by (phase, size, labels) for a graph key a trace recorded
        self.programs = programs
        #: per phase, (sizes measured, sizes derived) when from a trace
        self.samples = samples or {}
        self._hoisted: dict = {}
        #: (phase, size) -> the analytic family its program was picked from, and its index there
        self._families = families or {}

    @classmethod
    def analytic(cls, model: Model, phases: list[Phase], backend: Backend, tp: int = 1) -> Workload:
        """Each phase's builder runs once, over all its sizes together (:class:`Batches`);
        each size's program, equal to ``analytic_program`` at that size, is picked from that
        one (:func:`_pick`), its hoisted variant likewise when first asked for."""
        progs: dict[tuple, Program] = {}
        families: dict[tuple, tuple[_Family, int]] = {}
        for p in phases:
            family = _Family(analytic_program(model, p, Batches(p.sizes), backend, tp))  # pyright: ignore[reportArgumentType]
            for i, bs in enumerate(p.sizes):
                progs[(p.name, bs)] = family.pick(i)
                families[(p.name, bs)] = family, i
        return cls("analytic", progs, families=families)

    @classmethod
    def from_trace(cls, trace: Trace, phases: list[Phase], source: str, model: Model | None = None) -> Workload:
        """Index a recorded trace. A planned size the trace lacks is derived
        from the phase's recorded sizes (planner/memory/fitting.py), or refused with
        the sizes to record. ``model``: the spec's, whose vocabulary (or a
        phase's own) sizes torch.topk's scratch (planner/memory/scratch_shapes.py)."""
        from .fitting import fit_phase  # only traces are fitted
        from .layers import fold, refold
        from .scratch_shapes import MBTOPK, blocked_rows_bases

        names = {p.name for p in phases}
        by_name = {p.name: p for p in phases}
        caps: dict[tuple[str, int], CaptureTrace] = {}
        keyed: dict[tuple, CaptureTrace] = {}
        for i, cap in enumerate(trace.captures):
            where = f"{source}: $.captures[{i}]"
            if cap.phase not in names:
                raise InputError(
                    f"unknown phase {cap.phase!r}; the spec has {sorted(names)}",
                    where=where + ".phase",
                    fix="record the trace of this spec's phases, or give the spec the phase",
                )
            if cap.labels is not msgspec.UNSET:
                key = (cap.phase, cap.bs, _trace_labels(cap, by_name[cap.phase], where))
                if key in keyed:
                    raise InputError(
                        f"duplicate capture {cap.phase}/{cap.bs} {dict(key[2])}",
                        where=where,
                        fix="record the trace again with capture_plan.executor.write_trace",
                    )
                _check_events(cap, where)
                keyed[key] = cap
                continue
            if (cap.phase, cap.bs) in caps:
                raise InputError(
                    f"duplicate capture {cap.phase}/{cap.bs}",
                    where=where,
                    fix="record the trace again with capture_plan.executor.write_trace",
                )
            _check_events(cap, where)
            caps[(cap.phase, cap.bs)] = cap
        # a key whose labels the reference models (lora=nolora) is the phase's plain graph at its
        # size where the trace has no unlabeled capture of that size: the sizes are fitted from it
        from ..inputs.resources import variant_axes

        reference = {name: set(axis.reference) for name, axis in variant_axes().items()} if keyed else {}
        for (phase, bs, labels), cap in sorted(keyed.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
            if all(label in reference.get(axis, ()) for axis, label in labels):
                caps.setdefault((phase, bs), cap)
        progs: dict[tuple, Program] = {}
        samples: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        for p in phases:
            widths = [] if model is None else [phase_model(model, p).vocab]
            bases = blocked_rows_bases(MBTOPK, widths, (1, p.topk, p.tokens_per_request), trace.multiprocessors)
            mine = {bs: c for (ph, bs), c in caps.items() if ph == p.name}
            fit = fit_phase(p.name, list(p.sizes), mine, source, bases)
            hint = None  # the sizes of a phase share their layer structure: found once, checked per size
            # per derived shape: the first of its sizes that folded, refolded for the others with
            # their sizes (a size whose repetitions differ is folded from its own ops, as before)
            folded: dict[int, Program] = {}
            # folds that failed (two blocks cross every layer, as in EAGLE's target phases), by
            # what decides a fold: the shape, which of its sizes are equal, and the hint; another
            # size alike stays flat without searching again (exact: the same search would fail)
            flat: set[tuple] = set()
            for bs in sorted({*fit.ops, *fit.shapes}):
                if bs in fit.ops:
                    progs[(p.name, bs)], found = fold(fit.ops[bs], hint)  # a repeated layer is simulated faster
                    hint = found or hint
                    continue
                shape, sizes = fit.shapes[bs]
                template = folded.get(id(shape))
                prog = refold(template, sizes) if template is not None else None
                if prog is None:
                    first: dict[int, int] = {}
                    alike = (id(shape), tuple([first.setdefault(n, i) for i, n in enumerate(sizes)]), hint)
                    if alike in flat:
                        prog = Program(prologue=fit.derived_ops(bs))
                    else:
                        prog, found = fold(fit.derived_ops(bs), hint)
                        hint = found or hint
                        if not prog.repeats:
                            flat.add(alike)
                        elif template is None:
                            folded[id(shape)] = prog
                progs[(p.name, bs)] = prog
            samples[p.name] = (fit.measured, fit.derived)
        for key, cap in keyed.items():  # each recorded graph key: its own program
            progs[key] = fold(ops_from_events(cap.events))[0]
        return cls("trace", progs, samples)

    def program(self, phase: str, bs: int, hoisted: bool = False, labels: tuple = ()) -> Program:
        """The capture's program; ``hoisted``: without the backend workspace,
        which then lives outside the pool. ``labels``: a graph key's (axis, label)
        pairs: its own recorded program where the trace has one, else the size's."""
        key: tuple = (phase, bs, labels) if labels and (phase, bs, labels) in self.programs else (phase, bs)
        if not hoisted:
            return self.programs[key]
        prog = self._hoisted.get(key)
        if prog is None:
            family = self._families.get(key)
            prog = family[0].hoisted().pick(family[1]) if family else self.programs[key].without_workspace()
            self._hoisted[key] = prog
        return prog


class _Family:
    """The programs of one phase at all its sizes: ``template``, its builder's program over
    :class:`Batches`, whose allocations carry a size per batch size (or one for all).
    :meth:`pick` makes one size's program, sharing the ops that do not depend on the size;
    every program picked names the first as ``_same_structure`` (in ``__dict__``), which the
    compiled allocator core converts once for all of them (planner/memory/_core.pyx: ``compiled``)."""

    __slots__ = ("template", "sections", "first", "_hoisted")

    def __init__(self, template: Program) -> None:
        self.template = template
        # per section: (op, None, id, kind) for an op every size shares, else (None, sizes, id, kind)
        self.sections: list[list[tuple[Any, Any, Any, Any]]] = [
            [
                (None, op.size.values, op.id, op.kind)
                if type(op) is Alloc and type(op.size) is Batches
                else (op, None, 0, None)
                for op in ops
            ]
            for ops in (template.prologue, template.body, template.epilogue)
        ]
        self.first: Program | None = None
        self._hoisted: _Family | None = None

    def pick(self, i: int) -> Program:
        """The program at the ``i``-th size: equal to the builder's at that size alone."""
        t = self.template
        pro, body, epi = (
            tuple([op if sizes is None else Alloc(sizes[i], eid, kind) for op, sizes, eid, kind in section])
            for section in self.sections
        )
        prog = Program(
            prologue=pro,
            body=body,
            repeats=t.repeats,
            epilogue=epi,
            carry_in=t.carry_in,
            carry_out=t.carry_out,
            carry_kind=t.carry_kind,
            splits=t.splits,
        )
        if self.first is None:
            self.first = prog
        else:
            vars(prog)["_same_structure"] = self.first
        return prog

    def hoisted(self) -> _Family:
        """The family of the programs without the backend workspace (Program.without_workspace)."""
        if self._hoisted is None:
            self._hoisted = _Family(self.template.without_workspace())
        return self._hoisted


def _trace_labels(cap: CaptureTrace, phase: Phase, where: str) -> tuple[tuple[str, str], ...]:
    """A labelled capture's labels as its phase's (axis, label) pairs in axis order;
    refused, located, where they do not name one graph key of the phase."""
    axes = {} if phase.variants is msgspec.UNSET else phase.variants
    given = cap.labels if cap.labels is not msgspec.UNSET else {}
    if cap.bs not in phase.sizes:
        raise InputError(
            f"size {cap.bs} is not a capture size of phase {phase.name!r}",
            where=where + ".bs",
            fix="record the trace of this spec's sizes, or add the size to the phase",
        )
    if set(given) != set(axes):
        have = f"its axes are {', '.join(axes)}" if axes else "it declares no variant axes"
        raise InputError(
            f"labels {sorted(given)} do not name a graph key of phase {phase.name!r} ({have})",
            where=where + ".labels",
            fix="record the trace for this spec's variants, or leave the labels out",
        )
    for axis, labels in axes.items():
        if given[axis] not in labels:
            raise InputError(
                f"{given[axis]!r} is not a label of axis {axis!r} ({', '.join(labels)})",
                where=f"{where}.labels.{axis}",
                fix="record the trace again with capture_plan.executor.write_trace",
            )
    return tuple((a, given[a]) for a in axes)


def _check_events(cap: CaptureTrace, where: str) -> None:
    live: set[int] = set()
    seen: set[int] = set()
    for j, e in enumerate(cap.events):
        if e.op == "alloc":
            if e.id in seen:
                raise InputError(
                    f"allocation id {e.id} reused",
                    where=f"{where}.events[{j}]",
                    fix="record the trace again with capture_plan.executor.write_trace",
                )
            seen.add(e.id)
            live.add(e.id)
        else:
            if e.id not in live:
                raise InputError(
                    f"free of id {e.id} that is not allocated",
                    where=f"{where}.events[{j}]",
                    fix="record the trace again with capture_plan.executor.write_trace",
                )
            live.discard(e.id)
