"""Choose each phase's strategy: the lowest predicted pool that breaks no rule.

Search: coordinate descent over phases. Each phase starts at its preferred
feasible strategy (rules' ``prefer``, then the baseline); then, phase by phase
in capture order, every feasible strategy for that phase is simulated with the
others fixed and the cheapest is kept, until a full round changes nothing.
Cost is (protected outputs overwritten, pool bytes + hoisted bytes, distance
from the preference, label), so ties resolve the same way on every machine.
Warm-ups cost no pool memory and are chosen per phase beforehand (the fewest
the rules allow). Phases with more than SCREEN_ABOVE sizes are compared on
SCREEN_SIZES of them.

What this does not do: it is not an exhaustive search over joint choices of
several phases sharing a pool (that grows as 16^phases); coordinate descent
finds the exact optimum when phases are independent (own pools) and a local
optimum otherwise. Every alternative it rejected is reported with its cost.
"""

from __future__ import annotations

import itertools

import msgspec

from capture_plan.schemas.capture_sequence import CaptureSequence
from capture_plan.schemas.errors import ConstraintError, InputError
from capture_plan.schemas.plan import Alternative, Decision, Strategy
from capture_plan.schemas.spec import Choice, Phase, Rule
from capture_plan.schemas.strategy import AXES, AXIS_VALUES, MEMORY_AXES
from capture_plan.schemas.units import mib

from ..inputs.resources import Backend
from ..inputs.rules import choice_label, satisfies, violated
from ..memory.analytic import workspace_bytes
from ..memory.simulate import PoolSetup, Simulation, Tail, pool_id
from ..memory.workload import Workload
from .keys import twin_phases
from .sequence import capture_sequence

__all__ = ["Problem", "Solution", "parse_pins", "optimize"]

#: Every preset (36 decode sizes, 51 speculative) is compared exactly; a phase
#: with more sizes is compared on SCREEN_SIZES of them, which keeps a
#: 1024-size x 4-phase build near 2 s (bench/build_bench.py). `--exact` opts out.
SCREEN_ABOVE = 64
SCREEN_SIZES = 24


def parse_pins(pins: list[str], phases: list[str]) -> dict[str | None, dict[str, str]]:
    """``axis=value`` for every phase, ``phase.axis=value`` for one phase (it
    overrides the former for that phase). The same axis pinned twice for the
    same scope with different values is refused, not "last one wins"."""
    out: dict[str | None, dict[str, str]] = {}
    for pin in pins:
        where = f"--strategy {pin!r}"
        key, sep, value = pin.partition("=")
        if not sep:
            raise InputError(
                "expected AXIS=VALUE or PHASE.AXIS=VALUE",
                where=where,
                fix="write the pin as AXIS=VALUE (order=smallest-first) or PHASE.AXIS=VALUE (decode.outputs=keep)",
            )
        phase, dot, axis = key.rpartition(".")
        target = phase if dot else None
        if target is not None and target not in phases:
            raise InputError(
                f"unknown phase {target!r}; phases are {phases}",
                where=where,
                fix="name one of the spec's phases before the dot, or leave the phase out to pin every phase",
            )
        if axis not in AXIS_VALUES:
            raise InputError(f"unknown strategy axis {axis!r}", where=where, fix=f"use one of {', '.join(AXES)}")
        if value not in AXIS_VALUES[axis]:
            raise InputError(
                f"unknown value {value!r} for {axis}", where=where, fix=f"use one of {', '.join(AXIS_VALUES[axis])}"
            )
        pinned = out.setdefault(target, {})
        if pinned.get(axis, value) != value:
            # the plan records its pins sorted, so "last one wins" would rebuild another plan
            scope = f"{target}.{axis}" if target is not None else axis
            raise InputError(
                f"{scope} is pinned twice, to {pinned[axis]} and to {value}", where=where, fix=f"pin {scope} once"
            )
        pinned[axis] = value
    return out


class Problem(msgspec.Struct, frozen=True):
    phases: list[Phase]
    #: capture order of the phases
    sequence: list[str]
    rules: dict[str, list[Rule]]
    backend: Backend
    workload: Workload
    pins: dict[str | None, dict[str, str]]
    #: the engines' loop: where the search starts when no rule prefers otherwise
    baseline: Choice = Choice(**{ax: getattr(Strategy(), ax) for ax in MEMORY_AXES})
    expandable: bool = False
    library_bytes: int = 0
    #: phases with more sizes than SCREEN_ABOVE compare strategies on this many
    #: (evenly spread, smallest and largest included); None: every size. The
    #: plan's own prediction always simulates every size.
    screen: int | None = SCREEN_SIZES
    #: per phase with variant axes: (label combinations, key order, rule), planner/schedule/keys.py;
    #: each size is simulated once per combination, in that order
    keys: dict[str, tuple] = {}


class Solution(msgspec.Struct, frozen=True):
    strategies: dict[str, Strategy]
    decisions: list[Decision]
    #: exact simulations already run of every phase in one pool at every size,
    #: by ((phase, strategy), ...): (captures, SimResult); the build reuses the
    #: chosen one instead of simulating it again
    sims: dict = msgspec.field(default_factory=dict)


def _pinned(phase: str, pins: dict[str | None, dict[str, str]]) -> dict[str, str]:
    return {**pins.get(None, {}), **pins.get(phase, {})}


def _candidates(phase: Phase, pb: Problem) -> list[Strategy]:
    values = {ax: AXIS_VALUES[ax] for ax in MEMORY_AXES}
    # Hoisting makes the engine refresh the workspace before every replay (host
    # time on the hot path) and saves at most the workspace's few KiB, so it
    # is considered only where a rule asks for it or a pin names it.
    asked = any(c.workspace for r in pb.rules[phase.name] for c in r.require) or "workspace" in _pinned(
        phase.name, pb.pins
    )
    if pb.backend.workspace is None or not asked:
        values["workspace"] = ("pool",)
    if len(pb.phases) == 1:
        values["pool"] = ("shared",)  # one phase: "own" is the same pool
    combos = itertools.product(*(values[ax] for ax in MEMORY_AXES))
    # each axis's values are the Literal values of its Strategy field (str to pyright)
    return [Strategy(**dict(zip(MEMORY_AXES, c))) for c in combos]  # pyright: ignore[reportArgumentType]


def _preference(rules: list[Rule], base: Choice) -> dict[str, str]:
    pref = {ax: getattr(base, ax) for ax in AXES if getattr(base, ax) is not None}
    for r in rules:
        if r.prefer is not None:
            pref.update({ax: getattr(r.prefer, ax) for ax in AXES if getattr(r.prefer, ax) is not None})
    return pref


def _check_pins(phase: Phase, pb: Problem, cands: list[Strategy], options: list[Strategy]) -> None:
    """Refuse ``phase``'s ``--strategy`` pins of memory axes (``pb.pins``) where they leave no
    strategy of ``options`` (``cands``: those that keep the pins), or only strategies that
    break one of its rules (``pb.rules``)."""
    rules = pb.rules[phase.name]
    pins = {ax: v for ax, v in _pinned(phase.name, pb.pins).items() if ax in MEMORY_AXES}
    where = "--strategy " + " ".join(f"{k}={v}" for k, v in sorted(pins.items()))
    if pins.get("workspace") == "hoisted" and pb.backend.workspace is None:
        raise ConstraintError(
            f"phase {phase.name!r}: this backend has no workspace to hoist",
            where=where,
            fix="drop the workspace=hoisted pin: this backend's kernels allocate no workspace",
        )
    if not cands:  # e.g. pool=own in a one-phase spec: there is no other pool to keep apart from
        offered = "; ".join(f"{ax}: {', '.join(sorted({str(getattr(s, ax)) for s in options}))}" for ax in sorted(pins))
        raise ConstraintError(
            f"phase {phase.name!r} has no strategy with {where[len('--strategy ') :]} (its options: {offered})",
            where=where,
            fix="drop the pin or pin one of the options",
        )
    if all(violated(s, rules) for s in cands):
        broken = sorted({rid for s in cands for rid in violated(s, rules)})
        reqs = "; ".join(
            f"{r.id} requires {' or '.join(choice_label(c) for c in r.require)}" for r in rules if r.id in broken
        )
        raise ConstraintError(
            f"breaks rule {', '.join(broken)} for phase {phase.name!r} ({reqs})",
            where=where,
            fix="drop the pin or pin a value the rule allows",
        )


def _warmup(phase: Phase, rules: list[Rule], pins: dict[str, str]) -> str:
    """Fewest warm-ups the rules allow: warm-ups cost time, never pool memory."""

    def allowed(value: str) -> bool:
        return all(any(c.warmup in (None, value) for c in r.require) for r in rules if r.require)

    for value in ("once-per-phase", "every-size"):
        if pins.get("warmup", value) == value and allowed(value):
            return value
    blocking = ", ".join(r.id for r in rules if any(c.warmup for c in r.require))
    raise ConstraintError(
        f"breaks rule {blocking} for phase {phase.name!r}",
        where=f"--strategy warmup={pins.get('warmup')}",
        fix="drop the pin",
    )


def screened(sizes: list[int], limit: int | None) -> list[int]:
    """``sizes`` sorted; above SCREEN_ABOVE of them, ``limit`` evenly spread by rank, ends included."""
    ordered = sorted(sizes)
    if limit is None or len(ordered) <= SCREEN_ABOVE:
        return ordered
    last = len(ordered) - 1
    return sorted({ordered[round(i * last / (limit - 1))] for i in range(limit)})


def _hoisted(strategies: dict[str, Strategy], pb: Problem) -> int:
    return sum(
        workspace_bytes(pb.backend, max(p.sizes), p.tokens_per_request)
        for p in pb.phases
        if strategies[p.name].workspace == "hoisted"
    )


def optimize(pb: Problem) -> Solution:
    by_name = {p.name: p for p in pb.phases}
    cands: dict[str, list[Strategy]] = {}
    feasible: dict[str, list[Strategy]] = {}
    prefs: dict[str, dict[str, str]] = {}
    for p in pb.phases:
        rules = pb.rules[p.name]
        pins = _pinned(p.name, pb.pins)
        warm = _warmup(p, rules, pins)
        allc = [Strategy(**{**{ax: getattr(s, ax) for ax in MEMORY_AXES}, "warmup": warm}) for s in _candidates(p, pb)]
        pinned = [s for s in allc if all(getattr(s, ax) == v for ax, v in pins.items() if ax in MEMORY_AXES)]
        _check_pins(p, pb, pinned, allc)
        ok = [s for s in pinned if not violated(s, rules)]
        if not ok:
            broken = sorted({rid for s in allc for rid in violated(s, rules)})
            raise ConstraintError(
                f"rules in conflict for phase {p.name!r}: {', '.join(broken)}; no strategy satisfies all of them",
                where=f"phase {p.name}",
                fix="remove or relax one of these rules in the spec",
            )
        cands[p.name], feasible[p.name] = allc, ok
        prefs[p.name] = _preference(rules, Choice(**{ax: getattr(pb.baseline, ax) for ax in MEMORY_AXES}))

    # a micro-batch twin captures in its phase's size order, interleaved with it (planner/schedule/keys.py)
    twins = twin_phases(pb.phases)
    twin_of_phase = {parent: twin for twin, parent in twins.items()}

    def synced(strats: dict[str, Strategy]) -> dict[str, Strategy]:
        out = dict(strats)
        for t, parent in twins.items():
            if out[t].order != out[parent].order:
                out[t] = msgspec.structs.replace(out[t], order=out[parent].order)
        return out

    for t, parent in twins.items():
        if not any(s.order == o for s in feasible[t] for o in {s.order for s in feasible[parent]}):
            raise ConstraintError(
                f"no strategy the rules allow for twin phase {t!r} captures in an order phase {parent!r} can have",
                where=f"phase {t}",
                fix=f"let the rules give {t!r} and {parent!r} the same order",
            )

    memo: dict[tuple, tuple] = {}
    sims: dict[tuple, object] = {}
    protect = frozenset(p.name for p in pb.phases if p.output_lifetime == "across-phases")
    captures_for = {name: screened(by_name[name].sizes, pb.screen) for name in pb.sequence}

    # a phase with variant axes captures its keys in the order its rules set (its strategy's here)
    key_orders = {n: k[1] for n, k in pb.keys.items()}

    def units_of(members: tuple[tuple[str, Strategy], ...]) -> tuple[tuple[tuple[str, Strategy], ...], ...]:
        # what one pool captures as units: a phase, or a phase and its twin when both are in it
        names = {n for n, _ in members}
        units = []
        for m in members:
            if m[0] in twins and twins[m[0]] in names:
                continue  # captured with its phase
            twin = next((x for x in members if x[0] == twin_of_phase.get(m[0])), None)
            units.append((m, twin) if twin is not None else (m,))
        return tuple(units)

    unit_sequences: dict[tuple, CaptureSequence] = {}

    def unit_sequence(unit: tuple[tuple[str, Strategy], ...]) -> CaptureSequence:
        # what one unit captures, in order: its sizes compared (screened), each once per graph key
        seq = unit_sequences.get(unit)
        if seq is None:
            strats = {
                n: msgspec.structs.replace(st, key_order=key_orders[n]) if n in key_orders else st for n, st in unit
            }
            seq = capture_sequence([by_name[n] for n in strats], strats, sizes=captures_for)
            unit_sequences[unit] = seq
        return seq

    prefixes: dict[tuple, Simulation] = {}
    tails: dict[tuple, Tail] = {}

    def simulate_pool(members: tuple[tuple[str, Strategy], ...]):
        # This run holds one pool: protected phases outside it overwrite nothing
        # in it, and a capture records the blocks it touches only where another
        # phase's outputs are protected (Simulation). What a prefix or tail
        # recorded depends on that set, so it is part of their keys.
        guarded = protect & {n for n, _ in members}
        # Descent varies one phase at a time: resume from the state after the
        # longest prefix of phases already simulated (same phases, same
        # strategies, same order) instead of simulating it again. A phase and
        # its twin are one unit: their captures interleave.
        units = units_of(members)
        j = len(units) - 1
        while j > 0 and (units[:j], guarded) not in prefixes:
            j -= 1
        if j:
            run = prefixes[(units[:j], guarded)].copy()
        else:
            first = members[0][0] == pb.sequence[0]  # the library lands in the first capture's pool
            run = Simulation(pb.workload, PoolSetup(pb.expandable, guarded, pb.library_bytes if first else 0))
        # Different strategies for a phase often leave its pool in the same
        # state (outputs freed, the same segments): the phases after it then
        # do exactly what they did before, so they are taken as recorded.
        starts, hit = [], None
        for k in range(j, len(units)):
            key = (units[k:], run.state(), guarded)
            hit = tails.get(key)
            if hit is not None:
                break
            starts.append((key, run.mark()))
            strats = dict(units[k])
            for c in unit_sequence(units[k]).captures:
                run.capture(c.phase, c.bs, strats[c.phase], c.labels)
            if k + 1 < len(units):
                prefixes[(units[: k + 1], guarded)] = run.copy()
        for key, mark in starts:
            tails[key] = run.since(mark) if hit is None else run.since(mark).then(hit)
        return run.result() if hit is None else run.result_with(hit)

    def pool_cost(members: tuple[tuple[str, Strategy], ...]) -> tuple[int, int]:
        # Pools are independent: a freed block is only ever reused inside its
        # own pool. Simulating (and memoizing) each pool by itself means that
        # trying a strategy for a phase with its own pool never re-simulates
        # the shared one.
        if members not in memo:
            sim = simulate_pool(members)
            memo[members] = (sim.pool_bytes, len(sim.hazards))
            if len(members) == len(pb.sequence) and all(
                len(captures_for[n]) == len(by_name[n].sizes) for n, _ in members
            ):
                # every phase, every size: a whole plan's simulation, by the captures it ran
                keys = tuple(k for u in units_of(members) for k in unit_sequence(u).keys)
                sims[members] = (keys, sim)
        return memo[members]

    def cost(strats: dict[str, Strategy]) -> tuple:
        strats = synced(strats)
        groups: dict[str, list[tuple[str, Strategy]]] = {}
        for n in pb.sequence:
            groups.setdefault(pool_id(n, strats[n]), []).append((n, strats[n]))
        parts = [pool_cost(tuple(g)) for g in groups.values()]
        total = sum(b for b, _ in parts) + _hoisted(strats, pb)
        hazard = sum(h for _, h in parts)  # counted, so that descent can make progress
        dev = sum(getattr(strats[n], ax) != v for n in pb.sequence for ax, v in prefs[n].items())
        # a schedule whose protected outputs get overwritten is never chosen
        return (hazard, total, dev, tuple(strats[n].label() for n in pb.sequence))

    def first_pref(name: str) -> Strategy:
        return min(feasible[name], key=lambda s: (sum(getattr(s, ax) != v for ax, v in prefs[name].items()), s.label()))

    def options(name: str, current: dict[str, Strategy]) -> list[Strategy]:
        # a twin's: those in its phase's current order
        if name not in twins:
            return feasible[name]
        return [s for s in feasible[name] if s.order == current[twins[name]].order] or feasible[name]

    current = synced({n: first_pref(n) for n in pb.sequence})
    for _ in range(8):
        changed = False
        for n in pb.sequence:
            best = min(options(n, current), key=lambda s: cost({**current, n: s}))
            if best != current[n]:
                current, changed = synced({**current, n: best}), True
        if not changed:
            break
    for t, parent in twins.items():
        pinned = _pinned(t, pb.pins).get("order")
        if pinned is not None and pinned != current[t].order:
            raise ConstraintError(
                f"twin phase {t!r} captures in phase {parent!r}'s order ({current[t].order}), not {pinned}",
                where=f"--strategy {t}.order={pinned}",
                fix=f"pin {parent}.order instead",
            )
        broken = violated(current[t], pb.rules[t])
        if broken:
            raise ConstraintError(
                f"twin phase {t!r} captures in phase {parent!r}'s order ({current[t].order}), which breaks "
                f"rule {', '.join(broken)} for it",
                where=f"phase {t}",
                fix=f"let the rules give {t!r} and {parent!r} the same order",
            )

    if cost(current)[0]:
        raise ConstraintError(
            "every schedule the rules allow overwrites outputs that must outlive other phases' replays",
            where="phases " + ", ".join(sorted(protect)),
            fix="allow pool=own for those phases",
        )
    decisions: list[Decision] = []
    for n in pb.sequence:
        mine = [s for s in cands[n] if n not in twins or s.order == current[n].order]
        # each candidate with the other phases as they are: (hazard, total)
        priced = [(s, *cost({**current, n: s})[:2]) for s in mine]
        decisions.extend(_explain_phase(by_name[n], current[n], priced, pb))
        if n in twins:
            decisions.append(
                Decision(
                    phase=n,
                    rule="twin_of",
                    constraint=f"twin_of = {twins[n]}",
                    choice=f"each graph right after {twins[n]}'s of the same size and labels",
                    why=f"a micro-batch twin is captured right after the graph it is the twin of, in that phase's "
                    f"order ({current[n].order}), as vLLM does (planner/data/presets_vllm.toml: "
                    "capture.micro_batch_twin)",
                )
            )
    return Solution(strategies=current, decisions=decisions, sims=sims)


def _explain_phase(
    phase: Phase, chosen: Strategy, priced: list[tuple[Strategy, int, int]], pb: Problem
) -> list[Decision]:
    """Why ``phase`` has the strategy ``chosen``: each candidate, priced with the other phases
    as they are (``priced``: strategy, protected outputs it overwrites, pool and hoisted bytes;
    ``chosen`` among them), each rule met, and its warm-ups (``pb``: its rules, pins and the
    sizes it compared strategies on)."""
    rules = pb.rules[phase.name]
    compared = len(screened(phase.sizes, pb.screen))
    pins = _pinned(phase.name, pb.pins)
    alts = []
    for s, hazard, total in priced:
        v = violated(s, rules)
        pin_broken = [
            f"--strategy {ax}={val}" for ax, val in pins.items() if ax in MEMORY_AXES and getattr(s, ax) != val
        ]
        v = v + (["output-overlap"] if hazard else [])
        alts.append(
            Alternative(strategy=s, pool_bytes=total, feasible=not v and not pin_broken, violates=v + pin_broken)
        )
    alts.sort(key=lambda a: (not a.feasible, a.pool_bytes, a.strategy.label()))
    chosen_bytes = next(total for s, _, total in priced if s == chosen)
    runner = next((a for a in alts if a.feasible and a.strategy != chosen), None)
    why = f"lowest predicted total of {len([a for a in alts if a.feasible])} feasible strategies: {mib(chosen_bytes)}"
    if runner is not None:
        why += f"; next best {runner.strategy.label()} at {mib(runner.pool_bytes)}"
    why += "; " + (
        "views allowed: outputs are consumed before the next replay"
        if phase.output_lifetime == "next-replay"
        else "outputs must survive other phases' replays"
    )
    if compared < len(phase.sizes):
        why += (
            f"; strategies compared on {compared} of {len(phase.sizes)} sizes (evenly spread), so the "
            "alternatives' bytes are estimates; the plan's prediction simulates every size"
        )
    required = [r for r in rules if r.require]
    out = [
        Decision(
            phase=phase.name,
            rule="optimizer",
            constraint="; ".join(f"{r.id}: {' | '.join(choice_label(c) for c in r.require)}" for r in required)
            or "none",
            choice=chosen.label(),
            why=why,
            alternatives=alts,
            sizes_compared=compared,
        )
    ]
    for r in required:
        met = [c for c in r.require if satisfies(chosen, c)]
        parts = []
        for c in r.require:
            best = min(
                (a for a in alts if a.feasible and satisfies(a.strategy, c)), key=lambda a: a.pool_bytes, default=None
            )
            parts.append(f"{choice_label(c)}: " + (mib(best.pool_bytes) if best else "no feasible schedule"))
        out.append(
            Decision(
                phase=phase.name,
                rule=r.id,
                constraint=" | ".join(choice_label(c) for c in r.require),
                choice=" and ".join(choice_label(c) for c in met),
                why=f"{r.why}. Cheapest way to meet each alternative: " + "; ".join(parts),
            )
        )
    warm_rules = [r.id for r in rules if any(c.warmup for c in r.require)]
    out.append(
        Decision(
            phase=phase.name,
            rule=",".join(warm_rules) or "warmup",
            constraint="warm-up at every size" if warm_rules else "none",
            choice=f"warmup={chosen.warmup}",
            why=(
                "kernels autotune or JIT per shape"
                if chosen.warmup == "every-size"
                else "no per-shape compilation: one eager run at the largest size before the "
                "phase's first capture suffices, saving "
                f"{len(phase.sizes) - 1} warm-up runs"
            ),
        )
    )
    return out
