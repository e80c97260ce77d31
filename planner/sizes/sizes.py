"""Choose the capture sizes for a traffic (``planner sizes``): the front of padding, memory and start-up.

More capture sizes pad a step less (a batch of 9 runs the graph of 16 when 16
is the next size) but take more graph memory and start-up time. For each
phase the traffic names, this prices the trade:

1. **Padding**, from the traffic (planner/traffic.py) and a step time per
   size (planner/step_time.py: measured replay times, or a roofline marked
   approximate): for every count ``k`` of sizes, the list whose expected step
   time is least (planner/size_front.py, exact over its candidates), as the
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
capturing other sizes. :func:`choose` decides; :func:`choose_sizes` (``planner sizes``) and
``planner build --sizes auto`` (planner/build.py) each build one plan of the chosen lists,
the latter with the choice's decisions (planner/sizes/record.py).

What this does not do: choose sizes for phases the traffic does not name
(they keep the spec's), change the strategies (a list is priced under the
schedule the spec's build chose, and the chosen lists are built afresh), or
measure anything: every figure says where it comes from.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from capture_plan.schemas.errors import ConstraintError, InputError
from capture_plan.schemas.files import existing_output, write_atomic
from capture_plan.schemas.keys import step_id
from capture_plan.schemas.limits import MAX_BS
from capture_plan.schemas.plan import Plan, SizeWorth, Step, Strategy
from capture_plan.schemas.spec import Phase, Spec
from capture_plan.schemas.units import MiB

from ..inputs import resources
from ..inputs.build_options import BuildOptions, SizeChoiceOptions
from ..inputs.spec_toml import spec_toml
from ..inputs.specs import _expand, engine_preset, sgl_sizes
from ..memory.device import Calibration, device_prediction
from ..memory.simulate import simulate
from ..memory.workload import Workload, workspace_bytes
from ..schedule import pipeline
from ..schedule.graph import capture_order
from ..schedule.keys import capture_key, key_sequence, phase_combos
from ..schedule.resolve import Resolved, resolve
from .size_front import Best, best_lists, candidates, expected, size_runs
from .step_time import (
    DEFAULT_CONTEXT,
    DEFAULT_DEVICE,
    Measured,
    StepTime,
    capture_seconds,
    device_roofline,
    measured_times,
    read_timing,
    roofline,
)
from .traffic import DEFAULT_METRIC, Traffic, read_traffic

__all__ = [
    "SizesOptions",
    "Row",
    "PhaseChoice",
    "Choice",
    "SizesResult",
    "choose",
    "choose_sizes",
    "check_budget",
    "for_build",
    "write_spec",
    "render",
    "size_runs",
]

#: the counts of sizes the front shows (besides the spec's, the chosen one and the largest), unless asked for all
_SHOWN = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
#: the front's largest count of sizes, unless the spec captures more or ``upto`` says
DEFAULT_UPTO = 64


class SizesOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What ``planner sizes`` was asked. Paths as given (relative to the cwd)."""

    #: the build whose spec's sizes are chosen (its own sizes: ``build.sizes`` is None)
    build: BuildOptions
    #: the options that choose the sizes, as ``planner build --sizes auto`` takes them
    choice: SizeChoiceOptions
    #: the front's largest count of sizes
    upto: int | None = None
    #: every count on the front, not a selection
    every: bool = False


@dataclass(frozen=True)
class Row:
    """One list of sizes for a phase and what it costs."""

    label: str
    sizes: tuple[int, ...]
    #: expected step time lost to padding, % of the unpadded step time
    padding: float
    #: expected seconds per step
    step_seconds: float
    pool_bytes: int
    #: the device total (None: unknown without a calibration)
    device_bytes: int | None
    #: seconds to capture these sizes (None: not measured)
    capture_seconds: float | None
    #: whether padding and step time are approximate (roofline, interpolated)
    approximate: bool
    capture_approximate: bool = False


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


def _rebased(spec: Spec, opts: BuildOptions, folder: Path | None) -> Spec:
    """``spec``'s paths (model config, trace), relative to the spec file, made relative to
    ``folder`` (absolute when None): for a copy of the spec written elsewhere."""
    if opts.spec is None:
        return spec
    base = opts.spec.parent

    def move(p: str) -> str:
        path = os.path.abspath(base / p)
        return path if folder is None else Path(os.path.relpath(path, os.path.abspath(folder))).as_posix()

    model = spec.model
    if isinstance(model.config, str):
        model = msgspec.structs.replace(model, config=move(model.config))
    trace = move(spec.trace) if spec.trace is not None else None
    return msgspec.structs.replace(spec, model=model, trace=trace)


def _with_sizes(spec: Spec, lists: dict[str, list[int]]) -> Spec:
    return msgspec.structs.replace(
        spec, phases=[msgspec.structs.replace(p, sizes=sorted(lists.get(p.name, p.sizes))) for p in spec.phases]
    )


class _Memory:
    """Pool bytes (and the device total) of a set of lists under the plan's schedule, memoized."""

    def __init__(self, r: Resolved, strategies: dict[str, Strategy], all_sizes: dict[str, list[int]]) -> None:
        self.backend = r.backend
        self.phases = {p.name: p for p in r.spec.phases}
        # one workload for every size any list may hold (a trace fitted to them all)
        self.workload: Workload = r.with_sizes(all_sizes).workload
        self.strategies = strategies
        self.sequence = list(strategies)
        self.expandable = r.expandable
        self.library = r.library
        self.protect = r.protect
        self.calibration: Calibration | None = r.calibration
        self._seen: dict[tuple, tuple[int, int, int | None]] = {}

    def of(self, lists: dict[str, list[int]]) -> tuple[int, int, int | None]:
        """(pool bytes, hoisted bytes, device total or None) of capturing ``lists``."""
        key = tuple((n, tuple(sorted(lists[n]))) for n in self.sequence)
        if key in self._seen:
            return self._seen[key]
        # every graph key of a phase with variants, in the key order the spec's build chose (planner/keys.py)
        keys = [
            (n, bs, labels)
            for n in self.sequence
            for bs, labels in key_sequence(
                capture_order(lists[n], self.strategies[n].order),
                phase_combos(self.phases[n]),
                "size-major" if self.strategies[n].key_order is msgspec.UNSET else str(self.strategies[n].key_order),
            )
        ]
        captures = [capture_key(n, bs, labels) for n, bs, labels in keys]
        sim = simulate(captures, self.strategies, self.workload, self.expandable, self.protect, self.library)
        hoisted = sum(
            workspace_bytes(self.backend, max(lists[n]), self.phases[n].tokens_per_request)
            for n in self.sequence
            if self.strategies[n].workspace == "hoisted" and lists[n]
        )
        total = None
        if self.calibration is not None:
            steps = [
                Step(index=i, id=step_id("capture", n, bs, labels), op="capture", phase=n, bs=bs)
                for i, (n, bs, labels) in enumerate(keys)
            ]
            kinds = {n: p.kind for n, p in self.phases.items()}
            total = device_prediction(sim.pool_bytes, hoisted, steps, kinds, self.calibration).total_bytes
        out = self._seen[key] = (sim.pool_bytes, hoisted, total)
        return out


def _step_time(opts: SizeChoiceOptions, spec: Spec, phase: Phase, tp: int, timing, backend) -> StepTime:
    if timing is not None:
        rep, shown = timing
        return measured_times(rep, shown, phase.name)
    device = device_roofline(opts.device or DEFAULT_DEVICE)
    context = DEFAULT_CONTEXT if opts.context is None else opts.context
    return roofline(spec.model, phase, tp, device, context, backend)


def _engine_defaults(phase: Phase, top: int, speculative: bool) -> list[tuple[str, list[int]]]:
    """SGLang's and vLLM's default lists up to ``top`` (the largest added where a list stops below it)."""
    sgl = sgl_sizes("speculative" if speculative else "decode", min(top, MAX_BS))
    tpr = phase.tokens_per_request
    vllm = [t // tpr for t in _expand(engine_preset("vllm").sizes, top * tpr) if t % tpr == 0]
    return [_covering("SGLang default", sgl, top), _covering("vLLM default", vllm, top)]


def _covering(label: str, sizes: list[int], top: int) -> tuple[str, list[int]]:
    """``sizes`` up to ``top``, and ``top`` itself where they stop below it (said in the label):
    a list is priced as one that runs no step eagerly."""
    sizes = sorted({s for s in sizes if s <= top})
    if not sizes or sizes[-1] != top:
        return f"{label} (+{top})", [*sizes, top]
    return label, sizes


@dataclass
class _Pricing:
    """What every list of one phase is priced with: its traffic, step time and memory (the
    other phases at ``others``' lists), and the best list of each count once found."""

    phase: str
    traffic: dict[int, float]
    time: StepTime
    memory: _Memory
    others: dict[str, list[int]]
    captured: dict[int, float]
    best: dict[int, Best] = field(default_factory=dict)
    _rows: dict[int, Row] = field(default_factory=dict)

    @functools.cached_property
    def ideal(self) -> float:
        """Expected seconds per step with every size captured: the unpadded step time."""
        t = self.traffic
        return sum(w * self.time.cost(n, n) for n, w in t.items()) / sum(t.values())

    def padding(self, seconds: float) -> float:
        """``seconds`` per step as padding, % of the unpadded step time (at least 0: floating
        point may say -0.0 where a list pads nothing)."""
        return max(0.0, 100.0 * (seconds - self.ideal) / self.ideal) if self.ideal > 0 else 0.0

    def at(self, k: int) -> Row:
        """The best list of ``k`` sizes, priced (memoized: memory is simulated once)."""
        if k not in self._rows:
            self._rows[k] = self.row(f"{k}", self.best[k].sizes, self.best[k].seconds)
        return self._rows[k]

    def row(self, label: str, sizes: list[int] | tuple[int, ...], seconds: float | None = None) -> Row:
        sizes = tuple(sorted(sizes))
        step = expected(self.traffic, sizes, self.time.cost) if seconds is None else seconds
        pool, hoisted, total = self.memory.of({**self.others, self.phase: list(sizes)})
        cap, cap_approx = None, False
        if len(self.captured) >= 2:
            cap = sum(Measured(times=self.captured, source="").at(s) for s in sizes)
            cap_approx = any(s not in self.captured for s in sizes)
        exact = self.time.provenance == "measured" and all(self.time.exact(s) for s in {*sizes, *self.traffic})
        return Row(
            label=label,
            sizes=sizes,
            padding=self.padding(step),
            step_seconds=step,
            pool_bytes=pool + hoisted,
            device_bytes=total,
            capture_seconds=cap,
            approximate=not exact,
            capture_approximate=cap_approx,
        )


def for_build(r: Resolved, *, worth: bool = True) -> Choice:
    """The sizes ``planner build --sizes auto`` captures: :func:`choose` with the build's own
    size-choice options (``r.opts.sizes``); with ``worth``, each chosen size with why it is in."""
    assert r.opts.sizes is not None  # a build that chooses its sizes
    return choose(r, r.opts.sizes, worth=worth)


def _budget_of(row: Row, calibrated: bool) -> int | None:
    return row.device_bytes if calibrated else row.pool_bytes


def choose_sizes(opts: SizesOptions, *, worth: bool = False) -> SizesResult:
    """Everything ``planner sizes`` computes: each traffic phase's front, the engines'
    defaults priced alike, the chosen lists (:func:`choose`), and the plan built with them.
    With ``worth``, also why each chosen size is in (:func:`_worth`: one more simulation per size)."""
    r = resolve(opts.build)
    choice = choose(r, opts.choice, upto=opts.upto, every=opts.every, worth=worth)
    plan = pipeline.plan(r.with_sizes(choice.lists))
    check_budget(choice, plan)
    device = plan.predicted.device
    calibrated = r.calibration is not None
    fid = plan.predicted
    return SizesResult(
        phases=choice.phases,
        traffic=choice.traffic,
        spec=_with_sizes(r.spec_read.source, choice.lists),
        plan=plan,
        memory_source=f"simulated ({fid.source} model, {fid.allocator} allocator) under the spec's schedule: "
        + "; ".join(f"{n} {st.label()}" for n, st in choice.schedule.items()),
        device_source=(
            f"device total: {device.device} ({'; '.join(f'{i.name} {i.provenance}' for i in device.items)})"
            if calibrated and device is not None
            else "device total: unknown (build with --calibration REPORT, a capture report measured on the device)"
        ),
        budget=choice.budget,
        notes=list(choice.traffic.notes) + ([fid.caveat] if fid.caveat else []),
    )


def choose(
    r: Resolved, opts: SizeChoiceOptions, *, upto: int | None = None, every: bool = False, worth: bool = False
) -> Choice:
    """Each traffic phase's front (up to ``upto`` sizes; with ``every``, each count on it), the
    engines' defaults priced alike, and the chosen lists, priced on ``r`` (the build resolved
    once) in memory. With ``worth``, also why each chosen size is in (:func:`_worth`)."""
    b = r.opts
    resolved = r.spec
    names = [p.name for p in resolved.phases]
    for p in opts.traffic_phases:
        if p not in names:
            raise InputError(f"unknown phase {p!r}; the spec has {', '.join(names)}", where=f"--phase {p}")
    default_phases = list(opts.traffic_phases) or names
    if opts.max_size is not None and not 1 <= opts.max_size <= MAX_BS:
        raise InputError(
            f"must be 1..{MAX_BS}, got {opts.max_size}",
            where="--max-size",
            fix="give the largest batch the engine schedules",
        )
    for flag, v in (("--max-graphs", opts.max_graphs), ("--upto", upto), ("--context", opts.context)):
        if v is not None and v < 1:
            raise InputError(f"must be 1 or more, got {v}", where=f"{flag} {v}")
    if opts.max_padding is not None and not 0 <= opts.max_padding < 1e6:
        raise InputError(f"must be a percentage of 0 or more, got {opts.max_padding:g}", where="--max-padding")
    if opts.budget_mib is not None and not 0 < opts.budget_mib < 2**30:
        raise InputError(f"must be more than 0 MiB, got {opts.budget_mib:g}", where="--budget-mib")
    top = {p.name: opts.max_size or max(p.sizes) for p in resolved.phases}
    traffic = read_traffic(
        opts.traffic,
        phases={p.name: p.tokens_per_request for p in resolved.phases},
        default_phases=default_phases,
        max_size=top,
        metric=opts.metric or DEFAULT_METRIC,
    )
    timing = read_timing(opts.timing) if opts.timing is not None else None
    # the capture seconds per size: the timing report's, else the calibration's (both are capture reports)
    measured_in = timing or (read_timing(b.calibration) if b.calibration is not None else None)
    tp = b.tp if b.tp is not None else resolved.tp
    # SGLang's speculative size list where a phase is one of its speculative algorithms' (presets.toml)
    spec_kinds = {ph["kind"] for alg in resources.data("presets.toml")["speculative"].values() for ph in alg["phases"]}
    speculative = any(p.kind in spec_kinds for p in resolved.phases)

    reference = pipeline.schedule(r)  # the schedule every list is priced under: the spec's build's
    cands: dict[str, tuple[list[int], str]] = {n: candidates(traffic.phases[n], top[n]) for n in traffic.phases}
    all_sizes = {
        p.name: sorted(
            {*p.sizes, top[p.name], *cands.get(p.name, ([], ""))[0]}
            | {s for _, d in _engine_defaults(p, top[p.name], speculative) for s in d}
        )
        for p in resolved.phases
    }
    memory = _Memory(r, reference, all_sizes)
    calibrated = memory.calibration is not None
    budget_mib = opts.budget_mib if opts.budget_mib is not None else resolved.budget_mib
    budget = None if budget_mib is None else budget_mib * MiB
    measure = "device total" if calibrated else "pool and hoisted workspaces"
    budget_text = "none" if budget_mib is None else f"{budget_mib:g} MiB of {measure}"

    lists = {p.name: list(p.sizes) for p in resolved.phases}
    by_name = {p.name: p for p in resolved.phases}
    choices: list[PhaseChoice] = []
    prices: dict[str, _Pricing] = {}
    for name in [n for n in reference if n in traffic.phases]:
        phase = by_name[name]
        price = _Pricing(
            phase=name,
            traffic=traffic.phases[name],
            time=_step_time(opts, resolved, phase, tp, timing, r.backend),
            memory=memory,
            others=dict(lists),
            captured=capture_seconds(measured_in[0], name) if measured_in is not None else {},
        )
        count = upto or max(DEFAULT_UPTO, len(phase.sizes), opts.max_graphs or 0)
        price.best = best_lists(price.traffic, cands[name][0], price.time.cost, count)
        kmax = max(price.best)
        chosen_k, why = _choose(opts, b.spec, price, kmax, len(phase.sizes), budget, calibrated, budget_mib)
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
                defaults=[price.row(*d) for d in _engine_defaults(phase, top[name], speculative)],
                chosen=price.at(chosen_k),
                why=why,
                current=price.row(*_covering("the spec's", lists[name], top[name])),
            )
        )
        lists[name] = list(price.best[chosen_k].sizes)
    if worth:
        pool, hoisted, total = memory.of(lists)
        choices = [
            dataclasses.replace(
                c, worth=_worth(prices[c.phase], lists), worth_pool_bytes=pool + hoisted, worth_device_bytes=total
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


def _choose(
    opts: SizeChoiceOptions,
    spec: Path | None,
    price: _Pricing,
    kmax: int,
    spec_count: int,
    budget: float | None,
    calibrated: bool,
    budget_mib: float | None,
) -> tuple[int, str]:
    """The count of sizes chosen for ``price.phase`` and why."""
    phase, at = price.phase, price.at
    limit = opts.max_graphs if opts.max_graphs is not None else (kmax if opts.max_padding is not None else spec_count)
    limit = min(limit, kmax)
    limit_text = f"--max-graphs {opts.max_graphs}" if opts.max_graphs is not None else f"{limit} sizes"

    def fits(k: int) -> bool:
        if budget is None:
            return True
        used = _budget_of(at(k), calibrated)
        return used is not None and used <= budget

    def padding(k: int) -> float:
        return price.padding(price.best[k].seconds)

    if opts.max_padding is not None:
        for k in range(1, limit + 1):
            if padding(k) <= opts.max_padding and fits(k):
                return k, f"the fewest sizes that pad at most {opts.max_padding:g}% within {limit_text}" + (
                    f" and the budget ({budget_mib:g} MiB)" if budget is not None else ""
                )
        least = padding(limit)
        err = ConstraintError(
            f"phase {phase!r}: no list of at most {limit} sizes pads at most {opts.max_padding:g}%"
            + (" within the budget" if budget is not None else "")
            + f"; the least padding there is {least:.2f}% ({limit} sizes)",
            where=f"--max-padding {opts.max_padding:g}",
            fix="allow more sizes with --max-graphs, or more padding",
        )
        if fits(limit):  # the least padding there, allowed: a list that exists
            err.retry = {"max_padding": math.ceil(least * 100) / 100}
        raise err
    for k in range(limit, 0, -1):  # padding falls as k grows: the largest count that fits
        if fits(k):
            why = f"the least padding within {limit_text}"
            return k, why + (f" and the budget ({budget_mib:g} MiB)" if budget is not None else "")
    one = at(1)
    used = _budget_of(one, calibrated)
    shown = "unknown" if used is None else f"{used / MiB:,.1f} MiB"
    err = ConstraintError(
        f"phase {phase!r}: no list fits the budget of {budget_mib:g} MiB; one size alone takes {shown}",
        where="--budget-mib"
        if opts.budget_mib is not None
        else f"{spec}: $.budget_mib"
        if spec is not None
        else "the spec's budget_mib",
        fix=f"raise the budget to at least {-(-(used or 0) // MiB)} MiB"
        if used is not None
        else "calibrate with --calibration REPORT, or give a budget of the pool with no --calibration",
    )
    if used is not None and opts.budget_mib is not None:  # the spec's budget_mib is the spec's to raise
        err.retry = {"budget_mib": float(-(-used // MiB))}
    raise err


def _worth(price: _Pricing, lists: dict[str, list[int]]) -> list[SizeWorth]:
    """Why each size of ``price.phase``'s chosen list is in: the steps that run its graph, the
    padding the list would add without it (the steps then run the next larger size's graph),
    and the graph memory it adds (the lists simulated with and without it; the other phases
    at their chosen lists). The largest size is always captured: no padding figure."""
    name, sizes = price.phase, sorted(lists[price.phase])
    padding = price.padding(expected(price.traffic, sizes, price.time.cost))
    out, low = [], 0
    for s in sizes:
        rest = [x for x in sizes if x != s]
        p2, h2, _ = price.memory.of({**lists, name: rest})
        saved = None
        if s != sizes[-1]:
            # at least 0: a list without the size runs its steps on a larger graph, never faster
            # (floating point may say -0.0 where the two take the same time)
            saved = max(0.0, round(price.padding(expected(price.traffic, rest, price.time.cost)) - padding, 6))
        steps = sum(w for n, w in price.traffic.items() if low < n <= s)
        out.append(SizeWorth(size=s, steps=round(steps, 6), padding_saved=saved, pool_bytes_without=p2 + h2))
        low = s
    return out


def _mib(x: int | None) -> str:
    return "-" if x is None else f"{x / MiB:,.1f}"


def _line(r: Row, width: int) -> str:
    mark = "~" if r.approximate else " "
    cap = "-" if r.capture_seconds is None else ("~" if r.capture_approximate else " ") + f"{r.capture_seconds:.2f}"
    return (
        f"  {r.label:<{width}} {len(r.sizes):>6} {mark}{r.padding:>8.2f} {mark}{r.step_seconds * 1e3:>8.3f} "
        f"{_mib(r.pool_bytes):>9} {_mib(r.device_bytes):>10} {cap:>9}  {size_runs(r.sizes)}"
    )


def render(res: SizesResult) -> str:
    """The table ``planner sizes`` prints."""
    tr = res.traffic
    out = [
        f"traffic: {tr.source} ({tr.form}, {tr.digest[:19]}): "
        + ", ".join(f"{p} {sum(s.values()):,.0f} steps at sizes {min(s)}..{max(s)}" for p, s in tr.phases.items())
    ]
    out += [f"  note: {n}" for n in res.notes]
    out += [
        f"graph memory: {res.memory_source}",
        res.device_source,
        f"budget: {res.budget}",
        "~: approximate (a roofline, or step times interpolated between measured sizes)",
    ]
    for ph in res.phases:
        width = max(12, *(len(r.label) for r in ph.defaults))
        out += [
            "",
            f"{ph.phase}: {ph.steps:,.0f} steps, largest size {ph.top}; candidates: {ph.candidates}",
            f"  step time: {ph.time_source}",
            f"  {'list':<{width}} {'graphs':>6} {'padding %':>9} {'step ms':>9} {'pool MiB':>9} {'device MiB':>10} "
            f"{'capture s':>9}  sizes",
        ]
        out += [_line(r, width) for r in ph.front]
        out += [_line(r, width) for r in [ph.current, *ph.defaults]]
        c = ph.chosen
        out.append(f"  chosen: {len(c.sizes)} sizes ({ph.why}): {size_runs(c.sizes)}")
        for d in ph.defaults:
            if d.padding > 0 and c.padding >= 0:
                if c.padding <= 0:
                    times = "none left"
                elif c.padding <= d.padding:
                    times = f"{d.padding / c.padding:.1f}x less"
                else:
                    times = f"{c.padding / d.padding:.1f}x more"
                out.append(
                    f"    against {d.label} ({len(d.sizes)} sizes): padding {c.padding:.2f}% vs {d.padding:.2f}% "
                    f"({times}), pool {_mib(c.pool_bytes)} vs {_mib(d.pool_bytes)} MiB"
                    + (
                        f", device {_mib(c.device_bytes)} vs {_mib(d.device_bytes)} MiB"
                        if c.device_bytes is not None
                        else ""
                    )
                )
    p = res.plan.predicted
    known = p.device.total_bytes if p.device is not None else None
    total = "unknown" if known is None else f"{known / MiB:,.1f} MiB"
    out += [
        "",
        f"plan of the chosen sizes: {sum(s.op == 'capture' for s in res.plan.steps)} captures, "
        f"pool {p.pool_bytes / MiB:,.1f} MiB (simulated), device total {total}",
    ]
    return "\n".join(out) + "\n"


#: the first line of every spec ``write_spec`` writes: a file that starts otherwise is not replaced
_WRITTEN = "# Capture sizes chosen by `planner sizes`"


def write_spec(res: SizesResult, opts: SizesOptions, path: Path) -> str:
    """Write the spec with the chosen sizes to ``path`` (TOML, its header saying what chose
    them and with what figures); returns the ``planner build`` command that builds it.

    The build's own options that a spec can hold go into it (``--tp``, ``--allocator``,
    ``--trace``); ``--ci`` and ``--calibration`` are in the command. Paths in it are relative
    to its own folder, so the same choice writes the same bytes from any directory. Replaces
    only a spec this function wrote before: never the spec, traffic or reports it read, nor
    any other file."""
    where = f"--write-spec {path}"
    b, given = opts.build, opts.choice
    if existing_output(path, where, "name a spec file, not a folder") is not None:
        for what, src in (("spec", b.spec), ("traffic", given.traffic), ("timing report", given.timing)):
            if src is not None and os.path.samefile(path, src):
                raise InputError(f"the output is the {what} file", where=where, fix="name another file")
        with open(path, "rb") as f:
            head = f.read(len(_WRITTEN))
        if head and head != _WRITTEN.encode():
            raise InputError(
                "exists and is not a spec planner sizes wrote; writing would replace it",
                where=where,
                fix="name a new file",
            )
    folder = path.parent

    def rel(p: Path) -> str:
        return Path(os.path.relpath(os.path.abspath(p), os.path.abspath(folder))).as_posix()

    header = [f"{_WRITTEN[2:]} for the traffic {rel(given.traffic)} ({res.traffic.digest})."]
    header += [f"note: {n}" for n in res.traffic.notes]
    for ph in res.phases:
        c = ph.chosen
        # a measured step time names its report as the user gave it: here relative to this file
        time = f"measured replay times in {rel(given.timing)}" if given.timing is not None else ph.time_source
        header.append(
            f"{ph.phase}: {len(c.sizes)} sizes, padding {'~' if c.approximate else ''}{c.padding:.2f}% of step time "
            f"({ph.why}), pool {_mib(c.pool_bytes)} MiB, device total "
            f"{'unknown' if c.device_bytes is None else _mib(c.device_bytes) + ' MiB'}; step time: {time}"
        )
    header.append(f"graph memory: {res.memory_source}")
    spec = _rebased(res.spec, b, folder)
    own = {"tp": b.tp, "allocator": b.allocator, "trace": rel(b.trace) if b.trace is not None else None}
    spec = msgspec.structs.replace(spec, **{k: v for k, v in own.items() if v is not None})
    ci = ["--ci"] if b.ci else []
    cal = ["--calibration", str(b.calibration)] if b.calibration is not None else []
    cmd = ["planner", "build", "--backend", b.backend, *ci, *cal, "--spec", str(path)]
    shown = ["--calibration", "REPORT"] if cal else []  # the header is the same bytes from any directory
    header.append(f"Build: {' '.join(['planner', 'build', '--backend', b.backend, *ci, *shown])} --spec THIS.toml")
    write_atomic(path, spec_toml(spec, header).encode("utf-8"))
    return " ".join(cmd)
