"""The capture sequence of a set of strategies, built in one place, and the build it travels with.

:func:`capture_sequence` is the one function that orders what gets captured: each phase's
sizes in its strategy's order (:func:`capture_order`), each size once per graph key in the
phase's key order (planner/schedule/keys.py), a micro-batch twin's keys interleaved with its
phase's, each capture's pool, stream and the warm-up before it. Everything that needs the
ordered captures reads a :class:`~capture_plan.schemas.capture_sequence.CaptureSequence` it
built: the optimizer (one per pool of a candidate schedule), the step graph, the prediction,
the per-key predictions and size pricing. Nothing parses a step id back into its key.

:class:`Build` is a resolved build with its chosen strategies and their sequence: the one
value the pipeline's later steps (order, predict, assemble) take; the pipeline makes it once
per plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import msgspec

from capture_plan.schemas.capture_sequence import Capture, CaptureSequence
from capture_plan.schemas.plan import Strategy
from capture_plan.schemas.spec import Phase

from ..memory.simulate import pool_id
from .keys import key_sequence, phase_combos, twin_phases

if TYPE_CHECKING:  # resolve.py orders forced sizes with capture_order: imported only for the type
    from .optimize import Solution
    from .resolve import Resolved

__all__ = ["capture_order", "capture_sequence", "Build"]


def capture_order(sizes: Sequence[int], order: str) -> list[int]:
    """``sizes`` in a size order (largest-first or smallest-first)."""
    return sorted(sizes, reverse=order == "largest-first")


def capture_sequence(
    phases: Sequence[Phase],
    strategies: Mapping[str, Strategy],
    *,
    sizes: Mapping[str, Sequence[int]] | None = None,
    twins: bool = True,
) -> CaptureSequence:
    """What ``phases`` (in capture order: a build's phase sequence, or one pool's phases)
    capture under ``strategies`` (a phase with variant axes in its strategy's key order;
    unset: size-major). ``sizes``: a phase's sizes where not its spec's (a screened list, a
    list a size choice prices). A twin (``twin_of``) whose phase is among ``phases`` is
    captured interleaved with it, each key right after its phase's key of the same size and
    labels (``twins=False``: after its phase, as the engines' loop does)."""
    by = {p.name: p for p in phases}
    twin_of = {t: parent for t, parent in twin_phases(phases).items() if parent in by} if twins else {}
    of_parent = {parent: t for t, parent in twin_of.items()}

    def own(p: Phase) -> list[Capture]:
        st = strategies[p.name]
        listed = sizes[p.name] if sizes is not None and p.name in sizes else p.sizes
        key_order = "size-major" if st.key_order is msgspec.UNSET else str(st.key_order)
        keys = key_sequence(capture_order(listed, st.order), phase_combos(p), key_order)
        pool = pool_id(p.name, st)
        stream = None if p.stream is msgspec.UNSET else p.stream
        every, top = st.warmup == "every-size", max(listed, default=0)
        return [
            Capture(
                phase=p.name,
                bs=bs,
                labels=labels,
                pool=pool,
                stream=stream,
                warmup=bs if every else (top if i == 0 else None),
            )
            for i, (bs, labels) in enumerate(keys)
        ]

    out: list[Capture] = []
    for p in phases:
        if p.name in twin_of:
            continue  # captured with its phase
        mine = own(p)
        twin = of_parent.get(p.name)
        if twin is None:
            out.extend(mine)
            continue
        theirs = {(c.bs, c.labels): c for c in own(by[twin])}
        for c in mine:
            out.append(c)
            if (c.bs, c.labels) in theirs:
                out.append(theirs[(c.bs, c.labels)])
    return CaptureSequence.of(tuple(out))


# a msgspec struct, not a dataclass: the Quickstart build imports no dataclasses (its import
# is ~1% of the build's instructions)
class Build(msgspec.Struct, frozen=True):
    """A resolved build with its chosen strategies (key orders set), the sequence they
    capture and the optimizer's solution: what ordering, prediction and the plan read,
    built once per plan (planner/schedule/pipeline.py)."""

    resolved: Resolved
    #: each phase's strategy (its key order set), in the plan's phase order
    strategies: dict[str, Strategy]
    sequence: CaptureSequence
    #: the optimizer's solution the strategies are (its decisions, the simulations it ran)
    solution: Solution
