"""Few-size traces: derive every capture of a phase from a few recorded ones.

A capture's allocation requests are a function of the batch size only (the
pool's state changes where blocks land, never what is requested), so a trace
of a few sizes determines the others when their event sequences line up. For
each phase this module:

1. aligns the recorded samples: the same sequence of allocations and frees
   (op, kind, and which allocation each free releases), ignoring ``library``
   allocations (workspaces a library creates once per process, in whichever
   capture runs first; they stay with the sample that recorded them);
2. fits each allocation's size as an exact integer function of the batch
   size, ``a * f(bs) + b`` with integers ``a, b`` and a basis ``f``:
   ``round_up(bs, k)`` for ``k`` in :data:`ROUNDINGS` (``k = 1``: affine in
   ``bs``; kernels that pad the batch, such as FA3's scheduler metadata padded
   to 4, need ``k > 1``), and any basis the caller adds
   (``planner/memory/scratch_shapes.py``: torch.topk's blocks), from the smallest and
   largest sample of a run of aligned samples, and checks it on every sample in
   between, which the fit did not use;
3. derives each planned size strictly inside such a run.

It refuses, naming the sizes and what to record, rather than guess: a planned
size outside the recorded range (no extrapolation), between two samples whose
sequences differ (a kernel changed its workspace or algorithm there), in a run
of two samples (nothing would check the fit), an allocation no candidate
function fits, or one that several candidates fit but predict differently
at a planned size (a fit with a negative fixed part is set aside while one
without fits).

What it does not do: fit a shape no basis describes (a size that doubles
every few batch sizes is reported, not approximated), or derive a phase from
another phase's samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from capture_plan.schemas.errors import RecordMoreError
from capture_plan.schemas.trace import CaptureTrace, default_samples

from .program import Alloc, Free, Op, ops_from_events
from .scratch_shapes import Basis, rounding

__all__ = ["ROUNDINGS", "PhaseFit", "fit_phase", "default_samples"]

#: batch roundings tried, in order: 1 (plain affine) first
ROUNDINGS = (1, 2, 4, 8, 16, 32, 64, 128)
_ROUNDING_BASES = tuple(rounding(k) for k in ROUNDINGS)


@dataclass(frozen=True)
class PhaseFit:
    """Result for one phase: the ops of each recorded planned size, the shape and
    allocation sizes of each derived one, and which sizes were measured (recorded)
    and which derived."""

    ops: dict[int, tuple[Op, ...]]
    measured: tuple[int, ...]
    derived: tuple[int, ...]
    #: derived size -> (its run's event shape, its allocation sizes by ordinal); the sizes
    #: of one aligned run share one shape object (``derived_ops`` builds the ops)
    shapes: dict[int, tuple[tuple, list[int]]] = field(default_factory=dict)

    def derived_ops(self, bs: int) -> tuple[Op, ...]:
        """A derived size's ops: its shape's allocations (ids are their ordinals) with its sizes."""
        return _rebuild(*self.shapes[bs])


def _skeleton(cap: CaptureTrace) -> tuple[tuple, list[int]]:
    """(shape, sizes): the event sequence without library allocations, each
    free naming the ordinal of the allocation it releases; and the sizes of
    those allocations in order."""
    index: dict[int, int] = {}
    shape: list = []
    sizes: list[int] = []
    for e in cap.events:
        if e.op == "alloc":
            if e.kind == "library":
                continue
            index[e.id] = len(sizes)
            sizes.append(e.size)
            shape.append(("a", e.kind))
        else:
            shape.append(("f", index[e.id]))  # frees of library blocks cannot occur: they outlive the capture
    return tuple(shape), sizes


def _rebuild(shape: tuple, sizes: list[int]) -> tuple[Op, ...]:
    """Ops of a derived size: the shape's allocations (ids are their ordinals) with ``sizes``."""
    ops: list[Op] = []
    n = 0
    for item in shape:
        if item[0] == "a":
            ops.append(Alloc(sizes[n], n, item[1]))
            n += 1
        else:
            ops.append(Free(item[1]))
    return tuple(ops)


def _fmt(sizes) -> str:
    s = list(sizes)
    return str(s[:8])[:-1] + (", ...]" if len(s) > 8 else "]")


def _between(planned: list[int], lo: int, hi: int) -> list[int]:
    return [s for s in planned if lo < s < hi]


@dataclass(frozen=True)
class _Fitted:
    """The phase whose sizes are being fitted and where its trace is: what a refusal names."""

    phase: str
    where: str

    def record_more(self, what: str, sizes: list[int], fix: str) -> RecordMoreError:
        """The refusal ``phase {phase!r}: {what}``, asking for ``sizes`` to be recorded."""
        return RecordMoreError(
            f"phase {self.phase!r}: {what}", phase=self.phase, sizes=sizes, where=self.where, fix=fix
        )


class _Run:
    """Aligned samples (sorted by batch size) and their fitted size functions."""

    def __init__(self, samples: list[int], shape: tuple, sizes: dict[int, list[int]], extra: Sequence[Basis]):
        self.samples, self.shape, self.sizes = samples, shape, sizes
        self.extra, self.bases = extra, (*_ROUNDING_BASES, *extra)

    def _shapes(self) -> str:
        return f"a*round_up(bs, k) + b (k in {list(ROUNDINGS)})" + "".join(f", a*{b.label} + b" for b in self.extra)

    def fit(self, targets: list[int], fitted: _Fitted) -> dict[int, list[int]]:
        """Sizes of every allocation at each target batch size."""
        xs = self.samples
        columns: list[list[int]] = []  # per allocation: its size at each target
        kinds = [s[1] for s in self.shape if s[0] == "a"]  # each allocation's kind, by ordinal
        # each basis at the samples and the targets, once for every allocation
        at = [(b, [b.at(x) for x in xs], [b.at(t) for t in targets]) for b in self.bases]
        # a model's layers repeat their allocations: sizes seen already have their fit already
        # (only fits are kept: the first allocation that fits nothing raises, naming itself)
        seen: dict[tuple[int, ...], list[int]] = {}
        for j in range(len(self.sizes[xs[0]])):
            ys = tuple(self.sizes[x][j] for x in xs)
            col = seen.get(ys)
            if col is None:
                col = seen[ys] = self._one(ys, j, kinds[j], at, targets, fitted)
            columns.append(col)
        return {t: [c[i] for c in columns] for i, t in enumerate(targets)}

    def _one(self, ys: tuple[int, ...], j: int, kind: str, at: list, targets: list[int], fitted: _Fitted):
        """One allocation's size at each target, from its sizes ``ys`` at the samples."""
        xs = self.samples
        if len(set(ys)) == 1:  # constant: every candidate agrees
            return [ys[0]] * len(targets)
        fits = []
        for basis, fx, ft in at:
            if fx[-1] == fx[0]:
                continue
            a, rem = divmod(ys[-1] - ys[0], fx[-1] - fx[0])
            if rem:
                continue
            b = ys[0] - a * fx[0]
            if all(a * f + b == y for f, y in zip(fx, ys)):
                fits.append((basis, a, b, ft))
        if not fits:
            raise fitted.record_more(
                f"allocation #{j} ({kind}) has sizes {dict(zip(xs, ys))} that no exact function {self._shapes()} fits",
                targets,
                f"record every planned size between {xs[0]} and {xs[-1]} "
                f"(capture_plan.executor.profile(plan, target, sizes='all'))",
            )
        # A size is elements * (per request * padded batch + fixed): the
        # fixed part is not negative. A fit with a negative intercept is a
        # coincidence of few samples (8192*bs also equals 8704*round_up(bs,
        # 16) - 131072 at 1, 120 and 256) and is used only when nothing
        # else fits. Fits that remain and disagree anywhere are refused.
        fits = [f for f in fits if f[2] >= 0] or fits
        col = []
        for i, t in enumerate(targets):
            preds = {a * ft[i] + b for _, a, b, ft in fits}
            if len(preds) > 1:
                names = " and ".join(f"{a}*{basis.label} + {b}" for basis, a, b, _ in fits)
                raise fitted.record_more(
                    f"allocation #{j} ({kind}) with sizes {dict(zip(xs, ys))} fits both {names}, "
                    f"which differ at bs {t}",
                    [t],
                    f"record size {t} as well",
                )
            (v,) = preds
            if v < 0:
                raise fitted.record_more(f"allocation #{j} fits a size of {v} B at bs {t}", [t], f"record size {t}")
            col.append(v)
        return col


def fit_phase(
    phase: str, planned: list[int], samples: dict[int, CaptureTrace], where: str, bases: Sequence[Basis] = ()
) -> PhaseFit:
    """Programs' ops for every planned size of ``phase`` from ``samples``.

    Planned sizes that were recorded use their own events unchanged; the
    others are derived as the module docstring describes, or an
    :class:`~capture_plan.schemas.errors.RecordMoreError` names the sizes to record. ``bases``: shapes
    tried after the roundings (``planner/memory/scratch_shapes.py``).
    """
    recorded = sorted(samples)
    missing = sorted(s for s in planned if s not in samples)
    ops = {s: ops_from_events(samples[s].events) for s in planned if s in samples}
    if not missing:
        return PhaseFit(ops=ops, measured=tuple(sorted(ops)), derived=())
    if not recorded:
        raise RecordMoreError(
            f"trace has no capture for phase {phase!r}",
            phase=phase,
            sizes=default_samples(planned),
            where=where,
            fix="record it with capture_plan.executor.profile for this spec",
        )
    fitted = _Fitted(phase, where)
    outside = [s for s in missing if s < recorded[0] or s > recorded[-1]]
    if outside:
        raise fitted.record_more(
            f"planned sizes {_fmt(outside)} lie outside the recorded sizes "
            f"{recorded[0]}..{recorded[-1]}; sizes are never extrapolated",
            [min(outside), max(outside)],
            f"record sizes {min(outside)} and {max(outside)} as well"
            if min(outside) != max(outside)
            else f"record size {min(outside)} as well",
        )
    skel = {s: _skeleton(samples[s]) for s in recorded}
    # consecutive samples with the same event sequence form a run
    runs: list[list[int]] = [[recorded[0]]]
    for prev, s in zip(recorded, recorded[1:]):
        if skel[s][0] == skel[prev][0]:
            runs[-1].append(s)
        else:
            runs.append([s])
    for a, b in zip(runs, runs[1:]):
        gap = _between(missing, a[-1], b[0])
        if gap:
            raise fitted.record_more(
                f"the captures at sizes {a} and {b} do not line up "
                f"({len(skel[a[-1]][0])} vs {len(skel[b[0]][0])} events, first difference at event "
                f"{_first_difference(skel[a[-1]][0], skel[b[0]][0])}): a kernel changes its allocations "
                f"between {a[-1]} and {b[0]}, so sizes {_fmt(gap)} cannot be derived",
                gap,
                f"record the sizes between {a[-1]} and {b[0]} ({_fmt(gap)}), or enough of them that "
                f"each side has 3 aligned samples",
            )
    derived: list[int] = []
    shapes: dict[int, tuple[tuple, list[int]]] = {}
    for run in runs:
        targets = _between(missing, run[0], run[-1])
        if not targets:
            continue
        if len(run) < 3:
            mid = targets[len(targets) // 2]
            raise fitted.record_more(
                f"sizes {_fmt(targets)} would be derived from the 2 samples {run} with none left to check the fit",
                [mid],
                f"record one more size between {run[0]} and {run[-1]}, e.g. {mid}",
            )
        r = _Run(run, skel[run[0]][0], {s: skel[s][1] for s in run}, bases)
        for t, sizes in r.fit(targets, fitted).items():
            shapes[t] = (r.shape, sizes)
            derived.append(t)
    return PhaseFit(
        ops=ops,
        measured=tuple(s for s in recorded if s in set(planned)),
        derived=tuple(sorted(derived)),
        shapes=shapes,
    )


def _first_difference(a: tuple, b: tuple) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))
