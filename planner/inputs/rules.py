"""Matching rules to phases and checking strategies against them.

A rule applies to a phase when every set field of its ``when`` matches; it
then requires that at least one of its ``require`` alternatives holds. Rules
never run code: what they can say is exactly what :class:`capture_plan.schemas.spec.Rule`
can express.
"""

from __future__ import annotations

import msgspec

from capture_plan.schemas.errors import InputError
from capture_plan.schemas.plan import Strategy
from capture_plan.schemas.spec import Choice, Phase, Rule
from capture_plan.schemas.strategy import AXES

__all__ = [
    "Context",
    "applies",
    "satisfies",
    "violated",
    "choice_label",
    "rule_text",
    "phase_rules",
    "PLANNER_LABELS",
    "check_spec_rules",
]

#: what decisions and edges name where no rule decided (build.py, optimize.py,
#: graph.py): a spec rule of the same id would make them ambiguous
PLANNER_LABELS = ("optimizer", "warmup", "phase-order")


class Context(msgspec.Struct, frozen=True):
    """The build options a rule's ``when`` can test."""

    backend: str
    ci: bool


def applies(rule: Rule, phase: Phase, ctx: Context) -> bool:
    w = rule.when
    return (
        (w.backend is None or ctx.backend in w.backend)
        and (w.phase_kind is None or phase.kind in w.phase_kind)
        and (w.multi_token is None or (phase.tokens_per_request > 1) == w.multi_token)
        and (w.ci is None or ctx.ci == w.ci)
        and (w.output_lifetime is None or phase.output_lifetime == w.output_lifetime)
    )


def satisfies(strategy: Strategy, choice: Choice) -> bool:
    return all(getattr(choice, ax) is None or getattr(choice, ax) == getattr(strategy, ax) for ax in AXES)


def violated(strategy: Strategy, rules: list[Rule]) -> list[str]:
    """Ids of the rules ``strategy`` breaks (sorted, for stable output)."""
    return sorted(r.id for r in rules if r.require and not any(satisfies(strategy, c) for c in r.require))


def choice_label(choice: Choice) -> str:
    keys = [] if choice.key_order is msgspec.UNSET else [f"key_order={choice.key_order}"]
    return " ".join([*(f"{ax}={getattr(choice, ax)}" for ax in AXES if getattr(choice, ax) is not None), *keys])


def rule_text(rule: Rule) -> str:
    """What ``rule`` says, in one line (its ``why`` left out): ``when backend=fa3 ci=true
    multi_token=true; require order=smallest-first or workspace=hoisted``. What a plan
    records per rule, so a reviewer reads a rule's change, not a digest's."""
    when = " ".join(
        f"{k}={','.join(map(str, v)) if isinstance(v, list) else str(v).lower()}"
        for k, v in msgspec.structs.asdict(rule.when).items()
        if v is not None
    )
    parts = [f"when {when}" if when else "always"]
    if rule.require:
        parts.append("require " + " or ".join(choice_label(c) for c in rule.require))
    if rule.prefer is not None:
        parts.append(f"prefer {choice_label(rule.prefer)}")
    return "; ".join(parts)


def phase_rules(rules: list[Rule], phase: Phase, ctx: Context) -> list[Rule]:
    return [r for r in rules if applies(r, phase, ctx)]


def check_spec_rules(spec_rules: list[Rule], builtin: list[Rule], backends: list[str], source: str) -> None:
    """Refuse what would make a spec's rule ambiguous or silently inert:

    - an id that is a built-in rule's or one of :data:`PLANNER_LABELS`: a
      plan's decisions, edges and "breaks ID" name rules by id alone, so a
      reviewer could not tell the two apart (the spec's rule does not replace
      the built-in one; both apply);
    - a ``when.backend`` naming no backend of planner/data/backends.toml
      (``"FA3"``): the rule would never apply, a gate that silently gates
      nothing. (Phase kinds are checked with the spec: capture_plan.planner.inputs.validate.)
    - a ``when.backend`` or ``when.phase_kind`` that is an empty list: it
      matches nothing, so the rule would never apply either (left out, the
      field matches anything);
    - an empty choice in ``require`` (``{}``): every strategy meets it, so the
      rule would require nothing.
    """
    taken = {r.id: "a built-in rule's (planner/data/rules.toml)" for r in builtin}
    taken.update({label: "what plans call the planner's own decisions" for label in PLANNER_LABELS})
    for i, rule in enumerate(spec_rules):
        if rule.id in taken:
            raise InputError(
                f"rule id {rule.id!r} is {taken[rule.id]}",
                where=f"{source}: $.rules[{i}].id",
                fix="give the rule an id of its own (both rules would apply, under one name)",
            )
        for field in ("backend", "phase_kind"):
            if getattr(rule.when, field) == []:
                raise InputError(
                    "an empty list matches nothing: the rule would never apply",
                    where=f"{source}: $.rules[{i}].when.{field}",
                    fix=f"list the {field.replace('_', ' ')}s it is for, or leave {field} out to match any",
                )
        for j, choice in enumerate(rule.require):
            if all(getattr(choice, ax) is None for ax in AXES) and choice.key_order is msgspec.UNSET:
                raise InputError(
                    "an empty choice is met by every strategy: the rule would require nothing",
                    where=f"{source}: $.rules[{i}].require[{j}]",
                    fix='name the axis values it requires (e.g. { order = "smallest-first" }), or drop the choice',
                )
        for j, name in enumerate(rule.when.backend or ()):
            if name not in backends:
                raise InputError(
                    f"unknown backend {name!r}: the rule would never apply",
                    where=f"{source}: $.rules[{i}].when.backend[{j}]",
                    fix=f"use one of {', '.join(backends)}",
                )
