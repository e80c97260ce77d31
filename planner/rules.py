"""Matching rules to phases and checking strategies against them.

A rule applies to a phase when every set field of its ``when`` matches; it
then requires that at least one of its ``require`` alternatives holds. Rules
never run code: what they can say is exactly what :class:`schemas.spec.Rule`
can express.
"""

from __future__ import annotations

import msgspec

from schemas.plan import Strategy
from schemas.spec import Choice, Phase, Rule
from schemas.strategy import AXES

__all__ = ["Context", "applies", "satisfies", "violated", "choice_label", "phase_rules"]


class Context(msgspec.Struct, frozen=True):
    """The build options a rule's ``when`` can test."""

    backend: str
    ci: bool


def applies(rule: Rule, phase: Phase, ctx: Context) -> bool:
    w = rule.when
    return ((w.backend is None or ctx.backend in w.backend)
            and (w.phase_kind is None or phase.kind in w.phase_kind)
            and (w.multi_token is None or (phase.tokens_per_request > 1) == w.multi_token)
            and (w.ci is None or ctx.ci == w.ci)
            and (w.output_lifetime is None or phase.output_lifetime == w.output_lifetime))


def satisfies(strategy: Strategy, choice: Choice) -> bool:
    return all(getattr(choice, ax) is None or getattr(choice, ax) == getattr(strategy, ax) for ax in AXES)


def violated(strategy: Strategy, rules: list[Rule]) -> list[str]:
    """Ids of the rules ``strategy`` breaks (sorted, for stable output)."""
    return sorted(r.id for r in rules if r.require and not any(satisfies(strategy, c) for c in r.require))


def choice_label(choice: Choice) -> str:
    return " ".join(f"{ax}={getattr(choice, ax)}" for ax in AXES if getattr(choice, ax) is not None)


def phase_rules(rules: list[Rule], phase: Phase, ctx: Context) -> list[Rule]:
    return [r for r in rules if applies(r, phase, ctx)]
