"""Fold a recorded capture's flat ops into prologue, repeated layer and epilogue.

A trace records a capture as one flat sequence of allocations and frees; a
model's decoder layers make most of it the same few dozen ops again and again.
The simulator skips repeated layers once the allocator's state recurs
(planner/memory/simulate.py), but only in a :class:`~capture_plan.planner.memory.program.Program`
whose body is repeated, so an unfolded trace is simulated op by op: most of a
trace-based build's time.

:func:`fold` finds the longest run of identical repetitions (same sizes and
kinds, each free releasing the block the same number of allocations back) in
which exactly one block crosses from one repetition to the next (the hidden
state a layer hands on) and nothing else outlives a repetition, and returns
the program with that run as its body. It checks its own answer: the folded
program, run as the simulator runs it, must be the original ops event for
event (ids renamed; a run found for another size of the same phase is reused
where every repetition's ops are equal, which makes it so by construction);
otherwise, and where no such run exists, the ops stay one flat prologue.
Folding changes how fast a capture is simulated, never what it does.

:func:`refold` folds the other sizes the fitter derives for the same shape
without their ops: the first derived size's folded program with their sizes,
where each repetition's sizes are the first's (the shape's structure was
checked once; a size whose repetitions differ is folded from its own ops).

What it does not do: fold a run in which two or more blocks cross between
repetitions at every point of the cycle, or a block outlives its repetition,
or nested repetitions (experts inside layers).
"""

from __future__ import annotations

import msgspec

from .program import CARRY, Alloc, Free, Op, Program, ops_from_events

__all__ = ["fold", "refold"]

#: fewest repetitions worth folding
MIN_REPEATS = 3


def _tokens(ops: tuple[Op, ...]) -> list[tuple]:
    """Each op as what a repetition must repeat: an allocation's size and kind, a free's
    distance back in allocations to the block it releases."""
    ordinal: dict[int, int] = {}
    out: list[tuple] = []
    for op in ops:
        if type(op) is Alloc:
            ordinal[op.id] = len(ordinal)
            out.append(("a", op.size, op.kind))
        else:
            out.append(("f", len(ordinal) - ordinal[op.id]))  # pyright: ignore[reportAttributeAccessIssue]
    return out


def _longest_run(tokens: list[tuple]) -> tuple[int, int, int]:
    """(start, period, repeats) of the run of identical consecutive chunks covering the
    most tokens; (0, 0, 0) when none repeats ``MIN_REPEATS`` times."""
    ids: dict[tuple, int] = {}
    seq = [ids.setdefault(t, len(ids)) for t in tokens]
    n = len(seq)
    # a period is a distance between consecutive occurrences of a token, recurring: only those
    # are scanned (tens of candidates instead of n / 3)
    last: dict[int, int] = {}
    gaps: dict[int, int] = {}
    for i, v in enumerate(seq):
        if v in last:
            g = i - last[v]
            gaps[g] = gaps.get(g, 0) + 1
        last[v] = i
    best = (0, 0, 0)
    for p in sorted(g for g, k in gaps.items() if k >= MIN_REPEATS - 1 and g * MIN_REPEATS <= n):
        run = 0
        for i in range(n - p - 1, -1, -1):  # run: how far seq[i:] equals seq[i + p:]
            run = run + 1 if seq[i] == seq[i + p] else 0
            reps = run // p + 1
            if reps >= MIN_REPEATS and reps * p > best[1] * best[2]:
                best = (i, p, reps)
    return best


Run = tuple[int, int, int]  # (start, period, repeats) of the body in the ops


def fold(ops: tuple[Op, ...], hint: Run | None = None) -> tuple[Program, Run | None]:
    """``ops`` as a program whose body is its longest repeated run (see the module
    docstring), or as one flat prologue; and the run, for the next capture of the
    same phase (``hint``: tried first, the search only when it does not fit)."""
    flat = Program(prologue=ops)
    tokens = _tokens(ops)
    if hint is not None and _repeats(tokens, *hint):
        folded = _program(ops, tokens, *hint)
        # not expanded again: exact by construction, every repetition's tokens being the first's,
        # and the run's structure checked on the capture that found it
        if folded is not None:
            return folded, hint
    start, period, repeats = _longest_run(tokens)
    if not repeats:
        return flat, None
    # The repetition may start anywhere in its cycle: a layer hands on its hidden state and its
    # residual at its own boundary, and only one block at some point inside it. The first start
    # at which exactly one block crosses is the body (a shifted one repeats once less).
    for shift in range(period):
        run = (start + shift, period, repeats - (1 if shift else 0))
        folded = _program(ops, tokens, *run)
        if folded is not None:
            if _tokens(_expand(folded)) != tokens:
                return flat, None
            return folded, run
    return flat, None


def refold(template: Program, sizes: list[int]) -> Program | None:
    """``template`` (the folded program of another size of the same derived shape, whose
    allocation ids are their ordinals, as the fitter builds them) with ``sizes`` in place
    of its own, or None where a repetition's sizes are not the first's.

    Exact without expanding: the shape is the template's, whose fold was checked, so the
    repetitions are equal where their sizes are; the body's allocations are one
    repetition's consecutive ordinals, and a skipped repetition's are the next ones. Costs
    the prologue, one body and the epilogue instead of every op."""
    ids = [op.id for op in template.body if type(op) is Alloc]
    if not ids:
        return None
    a0, per = ids[0], len(ids)
    first = sizes[a0 : a0 + per]
    if any(sizes[a0 + r * per : a0 + (r + 1) * per] != first for r in range(1, template.repeats)):
        return None

    def sized(ops: tuple[Op, ...]) -> tuple[Op, ...]:
        return tuple(Alloc(sizes[op.id], op.id, op.kind) if type(op) is Alloc else op for op in ops)

    return msgspec.structs.replace(
        template, prologue=sized(template.prologue), body=sized(template.body), epilogue=sized(template.epilogue)
    )


def _repeats(tokens: list[tuple], start: int, period: int, repeats: int) -> bool:
    """Whether ``tokens`` hold ``repeats`` equal chunks of ``period`` from ``start``."""
    end = start + period * repeats
    if end > len(tokens):
        return False
    first = tokens[start : start + period]
    return all(tokens[i : i + period] == first for i in range(start + period, end, period))


def _expand(prog: Program) -> tuple[Op, ...]:
    """The ops ``prog`` runs, in order, as planner/memory/simulate.py runs them, ids made unique:
    :meth:`Program.flatten`'s walk (one id space, the body's ids reused by each repetition,
    the carried block entering each as ``CARRY``) as ops. A fold made here sets no
    ``carry_kind``, so the kinds are the recorded ones."""
    return ops_from_events(prog.flatten())


def _program(ops: tuple[Op, ...], tokens: list[tuple], start: int, period: int, repeats: int) -> Program | None:
    """The program with ``ops[start : start + period]`` as a body repeated ``repeats``
    times, or None when more or less than one block crosses between repetitions, a
    block outlives its repetition otherwise, or the body allocates anything but
    temporaries (a hoisted workspace is dropped section by section, which would break
    the carry; an output in a layer the simulator skips would go uncounted in hazard
    checks). A recorded trace marks only blocks alive at its end as outputs or library
    workspaces, so its layers hold temporaries alone."""
    if repeats < MIN_REPEATS:
        return None
    body = ops[start : start + period]
    if any(type(op) is Alloc and op.kind != "temp" for op in body):
        return None
    # within one repetition: which of its frees reach back before it, and how far
    own = 0
    reach: list[tuple[int, int]] = []  # (index in body, allocations back from the repetition's start)
    for j, t in enumerate(tokens[start : start + period]):
        if t[0] == "a":
            own += 1
        elif t[1] > own:
            reach.append((j, t[1] - own))
    if len(reach) != 1:
        return None
    (free_at, back) = reach[0]
    if back > own:  # it reaches past the previous repetition: not the block it handed on
        return None
    # the block handed on: allocated `back` allocations before the end of a repetition
    carry_ordinal = own - back  # its allocation's ordinal within the body
    alloc_ids = [op.id for op in body if type(op) is Alloc]
    freed = {op.id for op in body if type(op) is Free}
    out_id = alloc_ids[carry_ordinal]
    if any(a not in freed and a != out_id for a in alloc_ids) or out_id in freed:
        return None  # a block that outlives its repetition, other than the one handed on
    # ids: the body's own ids, unique in the trace, stay; the block carried in is CARRY
    carried_in = body[free_at].id  # a prologue block (the first repetition's input)
    if carried_in not in {op.id for op in ops[:start] if type(op) is Alloc}:
        return None
    new_body = tuple(Free(CARRY) if j == free_at else op for j, op in enumerate(body))
    tail_start = start + repeats * period
    last_out = [op.id for op in ops[tail_start - period : tail_start] if type(op) is Alloc][carry_ordinal]
    epilogue = tuple(Free(CARRY) if type(op) is Free and op.id == last_out else op for op in ops[tail_start:])
    return Program(
        prologue=ops[:start],
        body=new_body,
        repeats=repeats,
        epilogue=epilogue,
        carry_in=carried_in,
        carry_out=out_id,
    )
