"""Where a capture loop stands in its plan: which step runs next, the warm-ups pending
before a capture, the checks on the key the engine asks for, and which steps a
profiling pass runs. Torch-free: ``tests/test_executor_cursor.py`` drives it on the CPU
without importing torch.

:class:`Cursor` is the loop's position over ``run_steps`` (the plan's steps, or a
profiling pass's share of them: :func:`selected`). The engine's loop names a graph key
(phase, size, labels); :meth:`Cursor.check` refuses one the plan does not hold,
:meth:`Cursor.upcoming` gives the provision and warm-up steps before the next capture,
and :meth:`Cursor.take` refuses a key asked for out of the plan's order, then moves
past the capture. :class:`Warmups` is one capture's planned warm-ups, each recorded
once the engine has run it. Every refusal is an
:class:`~capture_plan.executor.errors.ExecutorError` that names the plan step or the
call and says what to do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from capture_plan.schemas.keys import GraphKey, PlanIndex, order_labels
from capture_plan.schemas.plan import PhasePlan, Plan, Step

from .dispatch import dispatch_name
from .errors import ExecutorError

__all__ = ["Cursor", "Warmups", "selected", "key_text", "step_where"]


def key_text(phase: str, bs: int, labels: Iterable[tuple[str, str]]) -> str:
    """``decode/8``, ``decode/8/lora=nolora``: a key as messages name it."""
    return dispatch_name(f"{phase}/{bs}", tuple(labels))


def step_where(step: Step) -> str:
    """``step 3 (capture/decode/8)``: a plan step as errors name it."""
    return f"step {step.index} ({step.id})"


def selected(plan: Plan, profiling: Mapping[str, int] | None) -> list[Step]:
    """The plan's steps a loop runs: all of them, or for a profiling pass the first
    ``profiling[phase]`` capture keys of each named phase (every key of the others),
    with the warm-ups before a kept capture and every provision step."""
    if profiling is None:
        return list(plan.steps)
    names = PlanIndex.of(plan).phases
    unknown = sorted(set(profiling) - set(names))
    if unknown:
        raise ExecutorError(
            f"the profiling pass names phase {unknown[0]!r}, which the plan does not have",
            where="capture_loop(profiling=)",
            fix=f"name the plan's phases {sorted(names)}",
        )
    seen: dict[str, int] = {}
    keep: list[Step] = []
    warmups: list[Step] = []
    for s in plan.steps:
        if s.op == "warmup":
            warmups.append(s)
        elif s.op == "capture":
            seen[s.phase] = seen.get(s.phase, 0) + 1
            if seen[s.phase] <= profiling.get(s.phase, seen[s.phase]):
                keep += warmups + [s]
            warmups = []
        else:
            keep.append(s)
    return keep  # warm-ups after the last kept capture precede nothing the pass captures


class Cursor:
    """The loop's position in the steps it runs (``run_steps``: :func:`selected`)."""

    def __init__(self, plan: Plan, profiling: Mapping[str, int] | None = None):
        self.plan = plan
        #: the plan's one index (phases by name, step keys)
        self.index = PlanIndex.of(plan)
        #: a declared partial pass: per phase, how many of its first keys it captures
        self.profiling = dict(profiling) if profiling is not None else None
        #: the plan's steps this loop runs (all of them, but for a profiling pass)
        self.run_steps: list[Step] = selected(plan, self.profiling)
        #: index of the next step to run
        self.next = 0
        self._phases = list(dict.fromkeys(s.phase for s in self.run_steps if s.op == "capture"))
        #: (phase, bs, labels) of every key the loop captures, for check()
        self._held = {(s.phase, s.bs, tuple(s.labels or ())) for s in self.run_steps if s.op == "capture"}
        #: the index of the capture upcoming() gave
        self._capture_at = 0

    @property
    def captures(self) -> int:
        """Graph keys the loop captures."""
        return len(self._held)

    @property
    def phases(self) -> list[str]:
        """The phases the loop captures, in the plan's order."""
        return list(self._phases)

    def phase(self, phase: str, where: str) -> PhasePlan:
        """The plan's phase ``phase``; an ExecutorError (at ``where``) when the loop captures none of it."""
        if phase not in self._phases:
            raise ExecutorError(
                f"phase {phase!r} is not in the plan; it captures {self._phases}",
                where=where,
                fix="name the phase as the plan does",
            )
        return self.index.phase(phase)

    def key(self, step: Step) -> GraphKey:
        """The graph key of the plan's ``step`` (``schemas.keys.step_key``)."""
        return self.index.key(step)

    def keys(self, phase: str | None = None) -> list[GraphKey]:
        """The phase's graph keys (every phase's, without ``phase``) in the order the loop captures them."""
        if phase is not None:
            self.phase(phase, "CaptureLoop.keys")
        return [self.key(s) for s in self.run_steps if s.op == "capture" and (phase is None or s.phase == phase)]

    def sizes(self, phase: str) -> list[int]:
        """The phase's capture sizes in the plan's order, each once."""
        self.phase(phase, "CaptureLoop.sizes")
        return list(dict.fromkeys(s.bs for s in self.run_steps if s.op == "capture" and s.phase == phase))

    def labels(self, phase: str, bs: int) -> list[dict[str, str]]:
        """The labels of the phase's keys at size ``bs``, in the plan's order."""
        return [dict(k.labels) for k in self.keys(phase) if k.bs == bs]

    def pairs(self, pp: PhasePlan, labels: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
        """``labels`` (axis -> label) as the phase's ``(axis, label)`` pairs; an
        ExecutorError saying how to call ``loop.step`` for a missing or unknown one."""
        try:
            return order_labels(pp, labels)
        except ValueError as err:
            axes = ", ".join(f"{a.name}=..." for a in pp.variants) if isinstance(pp.variants, list) else ""
            raise ExecutorError(
                str(err), where="CaptureLoop.step", fix=f"loop.step({pp.name!r}, bs{', ' + axes if axes else ''})"
            ) from None

    def check(self, pp: PhasePlan, bs: int, pairs: tuple[tuple[str, str], ...]) -> None:
        """Refuse a key the loop cannot capture: a piecewise phase whose plan does not
        say how many pieces a capture records, or a key the plan does not hold."""
        if self.index.piecewise(pp.name) and not isinstance(pp.pieces, int):
            raise ExecutorError(
                f"phase {pp.name!r} is {pp.kind!r} but the plan does not say how many piece graphs a capture records",
                where="CaptureLoop.step",
                fix='rebuild the plan with the phase\'s pieces (pieces = N or "attention" in its spec)',
            )
        if (pp.name, bs, tuple(lbl for _, lbl in pairs)) not in self._held:
            have = self.keys(pp.name)
            raise ExecutorError(
                f"the plan holds no graph key {key_text(pp.name, bs, pairs)}; phase {pp.name} has {len(have)} "
                f"keys, sizes {self.sizes(pp.name)}",
                where="CaptureLoop.step",
                fix="iterate loop.keys(phase) (or loop.sizes(phase) and loop.labels(phase, bs))",
            )

    def upcoming(self) -> tuple[list[Step], list[Step], Step | None]:
        """From the next step up to the next capture: the provision steps (to run now,
        in order), the warm-up steps (the engine runs them with the capture) and the
        capture (None when every capture was made)."""
        steps, i = self.run_steps, self.next
        provisions: list[Step] = []
        warmups: list[Step] = []
        while i < len(steps) and steps[i].op != "capture":
            (warmups if steps[i].op == "warmup" else provisions).append(steps[i])
            i += 1
        self._capture_at = i
        return provisions, warmups, steps[i] if i < len(steps) else None

    def take(self, capture: Step, phase: str, bs: int, pairs: tuple[tuple[str, str], ...]) -> GraphKey:
        """Move past ``capture`` (what :meth:`upcoming` gave) when it is the key the engine
        asked for; an ExecutorError naming the plan's next key otherwise."""
        key = self.key(capture)
        if (key.phase, key.bs, key.labels) != (phase, bs, pairs):
            raise ExecutorError(
                f"the engine's loop asked for {key_text(phase, bs, pairs)} out of the plan's order: the plan's next "
                f"capture is {key_text(key.phase, key.bs, key.labels)}",
                where=step_where(capture),
                fix=f"iterate loop.keys(phase) (loop.sizes(phase)), the phases in the plan's order {self._phases}",
            )
        self.next = self._capture_at + 1
        return key

    def left(self) -> list[Step]:
        """The captures not made yet."""
        return [s for s in self.run_steps[self.next :] if s.op == "capture"]

    def rest(self) -> list[Step]:
        """Every step not run yet."""
        return self.run_steps[self.next :]

    def unfinished(self) -> ExecutorError | None:
        """The error for a loop that ends here, or None when every capture was made."""
        left = self.left()
        if not left:
            return None
        return ExecutorError(
            f"the engine's loop ended with {len(left)} of the plan's captures not made",
            where=step_where(left[0]),
            fix=f"capture every size of loop.sizes(phase) for the phases {self._phases}",
        )

    def profiled(self) -> dict[str, int]:
        """Per phase, the graph keys captured so far (a profiling pass's figure)."""
        counts: dict[str, int] = {}
        for s in self.run_steps[: self.next]:
            if s.op == "capture":
                counts[s.phase] = counts.get(s.phase, 0) + 1
        return counts


class Warmups:
    """The plan's warm-up steps before one capture, each recorded once the engine has run it."""

    def __init__(self, planned: Iterable[Step] = ()):
        #: the plan's warm-up steps before the capture (each with its phase, bs and runs), in order
        self.planned: tuple[Step, ...] = tuple(planned)
        declared = [w.keeps for w in self.planned if isinstance(w.keeps, int)]
        #: bytes they may allocate and keep, None where the plan declares none
        self.keeps: int | None = sum(declared) if declared else None
        #: eager runs the plan wants before the capture
        self.runs = sum(max(w.runs, 1) for w in self.planned)
        #: those not yet recorded
        self.pending: list[Step] = list(self.planned)

    def select(self, of: Step | None, at: str) -> list[Step]:
        """The steps one ``warmup()`` block runs: ``of`` alone (it must be pending), or
        every pending one. ``at``: the capture step, as errors name it."""
        if of is None:
            return list(self.pending)
        if of not in self.pending:
            raise ExecutorError(
                f"{of.id} is not a warm-up of this step still to run", where=at, fix="pass one of step.planned"
            )
        return [of]

    def done(self, steps: Iterable[Step]) -> None:
        """``steps`` were run and recorded."""
        for w in steps:
            self.pending.remove(w)
