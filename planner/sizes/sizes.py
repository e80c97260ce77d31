"""Choose the capture sizes for a traffic (``planner sizes``): the front of padding, memory and start-up.

More capture sizes pad a step less (a batch of 9 runs the graph of 16 when 16
is the next size) but take more graph memory and start-up time. For each
phase the traffic names, this prices the trade:

1. **Padding**, from the traffic (planner/sizes/traffic.py) and a step time per
   size (planner/sizes/step_time.py: measured replay times, or a roofline marked
   approximate): for every count ``k`` of sizes, the list whose expected step
   time is least (planner/sizes/size_front.py, exact over its candidates), as the
   expected time lost to padding in % of the time the same steps would take
   each at its own size.
2. **Memory**, per list on the front: the plan's own schedule (the strategies
   and key order a build of the spec chooses; every graph key of a phase with
   variants) simulated with that list, exactly as the planner predicts a
   plan's pool; with ``--calibration``, the device total as a plan records it
   (planner/memory/device.py). The chosen lists are then built as a plan, whose
   figures are the ones reported for them.
3. **Start-up**: the count of graphs, and with ``--timing`` or
   ``--calibration`` the capture seconds that report measured per size
   (interpolated between them).

The chosen list of a phase is the one with the least padding within the
budget (``budget_mib``: the device total when calibrated, else the pool and
hoisted workspaces, as ``planner build`` checks a spec's) and at most
``max_graphs`` sizes (default: as many as the spec captures now); with
``max_padding``, the fewest sizes that pad at most that much. SGLang's and
vLLM's default lists for the same largest size are priced on the same table.
Phases are chosen one after another in the plan's capture order, each with
the lists already chosen for the phases before it.

Every list is priced on the build resolved once (planner/schedule/resolve.py: the spec
parsed, the trace and reports read), in memory: ``Resolved.with_sizes`` is the same build
capturing other sizes. :func:`choose` decides, each list priced alike
(planner/sizes/pricing.py); ``choose_sizes`` (``planner sizes``: planner/sizes/command.py; its
table and the spec it writes: planner/sizes/output.py) and ``planner build --sizes auto`` (planner/build.py) each
build one plan of the chosen lists, the latter with the choice's decisions (planner/sizes/record.py).

What this does not do: choose sizes for phases the traffic does not name
(they keep the spec's), change the strategies (a list is priced under the
schedule the spec's build chose, and the chosen lists are built afresh), or
measure anything: every figure says where it comes from.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from capture_plan.schemas.build_flags import BUILD_FLAG, out_of_bounds
from capture_plan.schemas.errors import ConstraintError, InputError
from capture_plan.schemas.plan import Plan, SizeWorth, Strategy
from capture_plan.schemas.spec import Spec
from capture_plan.schemas.units import MiB

from ..inputs.build_options import BuildOptions, SizeChoiceOptions
from ..inputs.specs import speculative_kinds
from ..schedule import pipeline
from ..schedule.resolve import Resolved
from .pricing import Memory, Pricing, Row, covering, engine_defaults, floor_error
from .size_front import best_lists, candidates, expected, size_runs
from .step_time import DEFAULT_CONTEXT, capture_seconds, read_timing, step_times
from .traffic import DEFAULT_METRIC, Traffic, read_traffic

__all__ = [
    "SizesOptions",
    "PhaseChoice",
    "Choice",
    "SizesResult",
    "choose",
    "check_budget",
    "for_build",
    "size_runs",
]

#: the counts of sizes the front shows (besides the spec's, the chosen one and the largest), unless asked for all
_SHOWN = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
#: the front's largest count of sizes, unless the spec captures more or ``upto`` says
DEFAULT_UPTO = 64


class SizesOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What ``planner sizes`` was asked (``planner build --sizes auto``: its build and the
    build's own size-choice options). Paths as given (relative to the cwd)."""

    #: the build whose spec's sizes are chosen
    build: BuildOptions
    #: the options that choose the sizes, as ``planner build --sizes auto`` takes them
    choice: SizeChoiceOptions
    #: the front's largest count of sizes
    upto: int | None = None
    #: every count on the front, not a selection
    every: bool = False


@dataclass(frozen=True)
class PhaseChoice:
    """A phase's front, the engines' default lists priced alike, and the chosen list."""

    phase: str
    top: int
    steps: float
    candidates: str
    time_source: str
    front: list[Row]
    defaults: list[Row]
    chosen: Row
    #: why the chosen list is the chosen one
    why: str
    #: the spec's own list, priced alike
    current: Row
    #: why each chosen size is in (only when asked: ``choose_sizes(..., worth=True)``), and the
    #: graph memory (pool and hoisted) of every phase at its chosen list, which ``worth`` is against
    worth: list[SizeWorth] = field(default_factory=list)
    worth_pool_bytes: int = 0
    worth_device_bytes: int | None = None
    #: the graph figure a build for a device prices, and the KV tokens ``--engine`` is left, with
    #: every phase at its chosen list (None: no device, no engine)
    worth_graph_bytes: int | None = None
    worth_kv_tokens: int | None = None


@dataclass(frozen=True)
class Choice:
    """The lists :func:`choose` chose for a traffic, before a plan is built of them."""

    phases: list[PhaseChoice]
    traffic: Traffic
    #: phase -> its sizes: the chosen list of each traffic phase, the spec's of the others
    lists: dict[str, list[int]]
    #: the strategies every list was priced under (the spec's build's), in the plan's phase order
    schedule: dict[str, Strategy]
    #: the budget, in words, and in MiB (``--budget-mib``, else the spec's ``budget_mib``)
    budget: str
    budget_mib: float | None
    #: whether the budget is of the device total (a calibration given), else of the pool and hoisted
    calibrated: bool
    #: what was asked (the budget a plan of the lists is checked against: :func:`check_budget`),
    #: and of which build
    opts: SizeChoiceOptions
    build: BuildOptions
    #: the engine, device and settings KV tokens are priced under ("": the build names no engine)
    kv: str = ""


@dataclass(frozen=True)
class SizesResult:
    phases: list[PhaseChoice]
    traffic: Traffic
    #: the spec with every chosen list in place (what ``write_spec`` writes)
    spec: Spec
    #: the plan built from ``spec``: the chosen lists' figures are its own
    plan: Plan
    memory_source: str
    device_source: str
    budget: str
    notes: list[str] = field(default_factory=list)


def for_build(r: Resolved, *, worth: bool = True) -> Choice:
    """The sizes ``planner build --sizes auto`` captures: :func:`choose` with the build's own
    size-choice options (``r.opts.sizes``); with ``worth``, each chosen size with why it is in."""
    assert r.opts.sizes is not None  # a build that chooses its sizes
    return choose(r, SizesOptions(build=r.opts, choice=r.opts.sizes), worth=worth)


def _bad_option(what: str, where: str, flag: str, field: str) -> InputError:
    """An option value out of its range, whose fix is to leave the option out (``planner
    build --sizes auto`` appends the command without it: ``retry``)."""
    err = InputError(what, where=where, fix=f"give {flag} a value in the range this names, or leave it out")
    if field != "upto":  # --upto is planner sizes' own; the others are build options too
        err.retry = {field: None}
    return err


def _context(context: int | None, window: tuple[int, str] | None) -> int:
    """The tokens of KV cache a request reads, for the roofline: ``--context``, 1 to the model's
    context window (its config's ``max_position_embeddings``: ``window``), else to
    limits.MAX_CONTEXT (a request longer than the model attends over prices no step the engine
    runs); not given, step_time.DEFAULT_CONTEXT, or the window where that is shorter."""
    if context is None:
        return DEFAULT_CONTEXT if window is None else min(DEFAULT_CONTEXT, window[0])
    bounds = BUILD_FLAG["context"].bounds
    assert bounds is not None, "the context row declares its bounds"
    hi = bounds.limits()[1]
    assert hi is not None, "the context row declares an upper bound"
    top, why = window if window is not None else (int(hi), "the planner's bound (no model config names one)")
    if window is not None:
        why = f"the model's max_position_embeddings ({why})"
    if not 1 <= context <= top:
        raise _bad_option(f"must be 1..{top:,}, {why}, got {context:,}", f"--context {context}", "--context", "context")
    return context


def choose(r: Resolved, ask: SizesOptions, *, worth: bool = False) -> Choice:
    """Each traffic phase's front (up to ``ask.upto`` sizes; with ``ask.every``, each count on
    it), the engines' defaults priced alike, and the lists ``ask.choice`` chooses, priced on
    ``r`` (the build resolved once) in memory. With ``worth``, also why each chosen size is in
    (:func:`_worth`)."""
    b, opts, upto, every = r.opts, ask.choice, ask.upto, ask.every
    resolved = r.spec
    names = [p.name for p in resolved.phases]
    for p in opts.traffic_phases:
        if p not in names:
            raise InputError(
                f"unknown phase {p!r}; the spec has {', '.join(names)}",
                where=f"--phase {p}",
                fix="name one of them with --phase, or leave --phase out for every phase",
            )
    # each option's bounds are its row's (schemas/build_flags.py)
    bad = out_of_bounds("max_size", opts.max_size)
    if bad is not None:
        raise InputError(bad, where="--max-size", fix="give the largest batch the engine schedules")
    for name in ("max_graphs", "upto", "max_padding", "budget_mib", "min_kv_tokens"):
        if name == "upto":  # planner sizes' own option, no build option
            if upto is not None and upto < 1:
                raise _bad_option(f"must be 1 or more, got {upto}", f"--upto {upto}", "--upto", "upto")
            continue
        value = getattr(opts, name)
        bad = out_of_bounds(name, value)
        if bad is not None:
            flag = BUILD_FLAG[name].flag
            raise _bad_option(bad, f"{flag} {value}" if BUILD_FLAG[name].kind == "int" else flag, flag, name)
    if opts.min_kv_tokens is not None and r.kv is None:
        raise _floor_without_engine(r, opts.min_kv_tokens)
    context = _context(opts.context, r.spec_read.context_window)
    if opts.metric is not None and not opts.metric.strip():  # read as the default one before
        err = InputError(
            "names no histogram",
            where="--metric ''",
            fix=f"name the histogram that counts tokens per step ({DEFAULT_METRIC}), or leave --metric out",
        )
        err.retry = {"metric": None}
        raise err
    top = {p.name: opts.max_size or max(p.sizes) for p in resolved.phases}
    traffic = read_traffic(opts, {p.name: p.tokens_per_request for p in resolved.phases}, top)
    timing = read_timing(opts.timing) if opts.timing is not None else None
    # the capture seconds per size: the timing report's, else the calibration's (both are capture reports)
    measured_in = timing or (read_timing(b.calibration) if b.calibration is not None else None)
    # SGLang's speculative size list where a phase is one of its speculative algorithms' (presets.toml)
    speculative = any(p.kind in speculative_kinds() for p in resolved.phases)

    # the size-choice options as priced: the bounded context resolved
    priced = msgspec.structs.replace(opts, context=context)
    # each traffic phase's step times, before the schedule: the size choice enters step_time.py
    # once, for the roofline's device and every phase's times (tests/test_opts_walk.py counts it)
    times = step_times(r, priced, timing, [n for n in r.sequence if n in traffic.phases])
    reference = pipeline.schedule(r)  # the schedule every list is priced under: the spec's build's
    cands: dict[str, tuple[list[int], str]] = {n: candidates(traffic.phases[n], top[n]) for n in traffic.phases}
    all_sizes = {
        p.name: sorted(
            {*p.sizes, top[p.name], *cands.get(p.name, ([], ""))[0]}
            | {s for _, d in engine_defaults(p, top[p.name], speculative) for s in d}
        )
        for p in resolved.phases
    }
    # one workload for every size any list may hold (a trace fitted to them all)
    memory = Memory(r, reference, r.with_sizes(all_sizes).workload)
    calibrated = memory.calibration is not None
    budget_mib = opts.budget_mib if opts.budget_mib is not None else resolved.budget_mib
    measure = "device total" if calibrated else "pool and hoisted workspaces"
    budget_text = "none" if budget_mib is None else f"{budget_mib:g} MiB of {measure}"

    lists = {p.name: list(p.sizes) for p in resolved.phases}
    by_name = {p.name: p for p in resolved.phases}
    choices: list[PhaseChoice] = []
    prices: dict[str, Pricing] = {}
    for name in [n for n in reference if n in traffic.phases]:
        phase = by_name[name]
        price = Pricing(
            phase=name,
            traffic=traffic.phases[name],
            time=times[name],
            memory=memory,
            others=dict(lists),
            captured=capture_seconds(measured_in[0], name) if measured_in is not None else {},
            kv=r.kv,
        )
        count = upto or max(DEFAULT_UPTO, len(phase.sizes), opts.max_graphs or 0)
        price.best = best_lists(price.traffic, cands[name][0], price.time.cost, count)
        kmax = max(price.best)
        if opts.min_kv_tokens is not None:
            _check_kv_priced(price, r.kv.label if r.kv is not None else "", b.calibration)
        chosen_k, why = price.choose(opts, len(phase.sizes), budget_mib, b.spec)
        shown = (
            range(1, kmax + 1)
            if every
            else sorted({*(k for k in _SHOWN if k <= kmax), kmax, chosen_k, min(len(phase.sizes), kmax)})
        )
        prices[name] = price
        choices.append(
            PhaseChoice(
                phase=name,
                top=top[name],
                steps=sum(price.traffic.values()),
                candidates=cands[name][1],
                time_source=price.time.source,
                front=[price.at(k) for k in shown],
                defaults=[price.row(*d) for d in engine_defaults(phase, top[name], speculative)],
                chosen=price.at(chosen_k),
                why=why,
                current=price.row(*covering("the spec's", lists[name], top[name])),
            )
        )
        lists[name] = list(price.best[chosen_k].sizes)
    if worth:
        pool, hoisted, total, graph = memory.of(lists)
        kv_tokens = (
            r.kv.tokens(graph, r.kv.sizes_of(lists.values())) if r.kv is not None and graph is not None else None
        )
        choices = [
            dataclasses.replace(
                c,
                worth=_worth(prices[c.phase], lists),
                worth_pool_bytes=pool + hoisted,
                worth_device_bytes=total,
                worth_graph_bytes=graph,
                worth_kv_tokens=kv_tokens,
            )
            for c in choices
        ]
    return Choice(
        phases=choices,
        traffic=traffic,
        lists=lists,
        schedule=reference,
        budget=budget_text,
        budget_mib=budget_mib,
        calibrated=calibrated,
        opts=opts,
        build=b,
        kv=r.kv.label if r.kv is not None else "",
    )


def _floor_without_engine(r: Resolved, floor: int) -> InputError:
    """``planner sizes --min-kv-tokens`` with no ``--engine`` (a build's floor is refused by
    schedule/kv.py's kv_pricer, which reads the build's own size options): the command with
    an engine, a device and a context length filled in (a ``planner sizes`` command while
    one runs: planner/inputs/build_options.py sizes_run)."""
    from ..schedule.kv import fixed_command

    return InputError(
        "--min-kv-tokens prices KV tokens under an engine release, and --engine names none",
        where=f"--min-kv-tokens {floor}",
        fix=f"name the release: `{fixed_command(r.opts, r.spec_read.model_config is not None)}`",
    )


def _check_kv_priced(price: Pricing, engine: str, calibration: Path | None) -> None:
    """``--min-kv-tokens`` needs each list's graph memory on the device: refused, naming why,
    where it is unknown (a device with no per-node graph-exec figure, and no calibration)."""
    one = price.at(1)
    unpriced = price.kv.unpriced if price.kv is not None else ""
    if one.kv_tokens is None and unpriced:  # the engine captures graphs no list of the plan holds
        err = InputError(
            f"the graph memory under {engine} is unknown ({unpriced}), so the KV tokens it leaves cannot be priced",
            where="--min-kv-tokens",
            fix="choose the sizes without a KV-token floor",
        )
        err.retry = {"min_kv_tokens": None}
        raise err
    if one.kv_tokens is None:
        raise InputError(
            f"graph memory on the device is unknown (no graph-exec figure for it), so the KV tokens {engine} is "
            "left cannot be priced",
            where="--min-kv-tokens",
            fix="build with --calibration REPORT (a capture report measured on the device)"
            if calibration is None
            else "give a calibration whose report counted graph nodes",
        )


def check_budget(choice: Choice, plan: Plan) -> None:
    """Refuse the plan of ``choice``'s lists (the chosen lists of all phases together) over the
    budget: the device total when calibrated, else the pool and hoisted workspaces."""
    opts, b, budget_mib, calibrated = choice.opts, choice.build, choice.budget_mib, choice.calibrated
    budget = None if budget_mib is None else budget_mib * MiB
    device = plan.predicted.device
    device_total = device.total_bytes if device is not None else None
    if budget is not None:
        total = device_total if calibrated else plan.predicted.pool_bytes + plan.predicted.hoisted_bytes
        if total is not None and total > budget:
            err = ConstraintError(
                f"the chosen lists together take {total / MiB:,.1f} MiB, over the budget of {budget_mib:g} MiB",
                where="--budget-mib" if opts.budget_mib is not None else f"{b.spec}: $.budget_mib",
                fix="raise the budget, or allow fewer graphs with --max-graphs",
            )
            if opts.budget_mib is not None:  # the spec's budget_mib is the spec's to raise
                err.retry = {"budget_mib": float(-(-total // MiB))}
            raise err
    kv = plan.predicted.kv
    if opts.min_kv_tokens is not None and kv is not None and (kv.kv_tokens or 0) < opts.min_kv_tokens:
        # the plan's graphs leave the engine able to start (KvPricer.check_plan refused it before)
        raise floor_error(opts.min_kv_tokens, kv.kv_tokens or 0, kv.engine, "the chosen lists together")


def _worth(price: Pricing, lists: dict[str, list[int]]) -> list[SizeWorth]:
    """Why each size of ``price.phase``'s chosen list is in: the steps that run its graph, the
    padding the list would add without it (the steps then run the next larger size's graph),
    and the graph memory it adds (the lists simulated with and without it; the other phases
    at their chosen lists). The largest size is always captured: no padding figure."""
    name, sizes = price.phase, sorted(lists[price.phase])
    padding = price.padding(expected(price.traffic, sizes, price.time.cost))
    out, low = [], 0
    for s in sizes:
        rest = [x for x in sizes if x != s]
        p2, h2, _, g2 = price.memory.of({**lists, name: rest})
        kv2 = (
            price.kv.tokens(g2, price.kv.sizes_of({**lists, name: rest}.values()))
            if price.kv is not None and g2 is not None
            else None
        )
        saved = None
        if s != sizes[-1]:
            # at least 0: a list without the size runs its steps on a larger graph, never faster
            # (floating point may say -0.0 where the two take the same time)
            saved = max(0.0, round(price.padding(expected(price.traffic, rest, price.time.cost)) - padding, 6))
        steps = sum(w for n, w in price.traffic.items() if low < n <= s)
        out.append(
            SizeWorth(
                size=s,
                steps=round(steps, 6),
                padding_saved=saved,
                pool_bytes_without=p2 + h2,
                device_bytes_without=g2,
                kv_tokens_without=kv2,
            )
        )
        low = s
    return out
