"""What a list of capture sizes costs a phase: padding and step time, graph memory, capture time.

Every list ``planner sizes`` weighs (planner/sizes/sizes.py) is priced here, alike: its
expected step time and padding from the traffic and a step time per size (planner/sizes/step_time.py),
its graph memory from the plan's own schedule simulated with the list (:class:`Memory`: the
other phases at their lists, every graph key; with a calibration, the device total), and its
capture seconds where a report measured them. Also the engines' default lists a choice is
weighed against, and the count of sizes a phase's priced front gives under the limits asked
(:meth:`Pricing.choose`: the padding, the count of graphs, the budget), where the prices are:
planner/sizes/sizes.py composes the phases' choices.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from capture_plan.schemas.errors import ConstraintError
from capture_plan.schemas.limits import MAX_BS
from capture_plan.schemas.plan import Step, Strategy
from capture_plan.schemas.spec import Phase
from capture_plan.schemas.units import MiB

from ..inputs.build_options import SizeChoiceOptions
from ..inputs.specs import _expand, engine_preset, sgl_sizes
from ..memory.analytic import workspace_bytes
from ..memory.device import Calibration, CaptureFigures, device_prediction
from ..memory.simulate import simulate
from ..memory.workload import Workload
from ..schedule.kv import graph_figure
from ..schedule.resolve import Resolved
from ..schedule.sequence import capture_sequence
from .size_front import Best, expected
from .step_time import Measured, StepTime

if TYPE_CHECKING:
    from ..fit.kv_price import KvPricer

__all__ = ["Priced", "Row", "Memory", "Pricing", "engine_defaults", "covering", "budget_of", "floor_error"]


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
    #: the graph memory a build for a device prices (:func:`..schedule.kv.graph_figure`: the device
    #: total, or the device items known), and the KV tokens ``--engine`` is left (None: not named)
    graph_bytes: int | None = None
    kv_tokens: int | None = None


class Priced(NamedTuple):
    """What :meth:`Memory.of` gives for a set of lists."""

    pool: int
    hoisted: int
    #: the device total (None: unknown without a calibration)
    total: int | None
    #: the graph figure a build for a device prices (None: no device named, or graph-exec unknown)
    graph: int | None


class Memory:
    """Pool bytes (and the device total) of a set of lists under the plan's schedule, memoized."""

    def __init__(self, r: Resolved, strategies: dict[str, Strategy], workload: Workload) -> None:
        """``workload``: of every size any list may hold (a trace fitted to them all: the
        workload of ``r.with_sizes`` of every such size)."""
        self.backend = r.backend
        self.phases = {p.name: p for p in r.spec.phases}
        self.workload = workload
        self.strategies = strategies
        self.sequence = list(strategies)
        self.pools = r.pools
        self.calibration: Calibration | None = r.calibration
        #: the device items a build for a device counts: measured, else estimated (``--device``)
        self.device: Calibration | None = r.calibration or r.device_estimate
        self._seen: dict[tuple, Priced] = {}

    def of(self, lists: dict[str, list[int]]) -> Priced:
        """Pool bytes, hoisted bytes, device total and graph figure of capturing ``lists``."""
        key = tuple((n, tuple(sorted(lists[n]))) for n in self.sequence)
        if key in self._seen:
            return self._seen[key]
        # every graph key of a phase with variants, in the key order the spec's build chose
        # (planner/schedule/sequence.py); each phase's captures after the one before it
        seq = capture_sequence([self.phases[n] for n in self.sequence], self.strategies, sizes=lists, twins=False)
        sim = simulate(seq.keys, self.strategies, self.workload, self.pools)
        hoisted = sum(
            workspace_bytes(self.backend, max(lists[n]), self.phases[n].tokens_per_request)
            for n in self.sequence
            if self.strategies[n].workspace == "hoisted" and lists[n]
        )
        total = graph = None
        if self.device is not None:
            steps = [Step(index=i, id=c.id, op="capture", phase=c.phase, bs=c.bs) for i, c in enumerate(seq.captures)]
            kinds = {n: p.kind for n, p in self.phases.items()}
            figures = CaptureFigures(pool=sim.pool_bytes, hoisted=hoisted, steps=steps)
            device = device_prediction(figures, kinds, self.device)
            total = device.total_bytes if self.calibration is not None else None
            graph = graph_figure(device)[0]
        out = self._seen[key] = Priced(sim.pool_bytes, hoisted, total, graph)
        return out


def engine_defaults(phase: Phase, top: int, speculative: bool) -> list[tuple[str, list[int]]]:
    """SGLang's and vLLM's default lists up to ``top`` (the largest added where a list stops below it)."""
    sgl = sgl_sizes("speculative" if speculative else "decode", min(top, MAX_BS))
    tpr = phase.tokens_per_request
    vllm = [t // tpr for t in _expand(engine_preset("vllm").sizes, top * tpr) if t % tpr == 0]
    return [covering("SGLang default", sgl, top), covering("vLLM default", vllm, top)]


def covering(label: str, sizes: list[int], top: int) -> tuple[str, list[int]]:
    """``sizes`` up to ``top``, and ``top`` itself where they stop below it (said in the label):
    a list is priced as one that runs no step eagerly."""
    sizes = sorted({s for s in sizes if s <= top})
    if not sizes or sizes[-1] != top:
        return f"{label} (+{top})", [*sizes, top]
    return label, sizes


@dataclass
class Pricing:
    """What every list of one phase is priced with: its traffic, step time and memory (the
    other phases at ``others``' lists), the best list of each count once found, and the count
    chosen from them (:meth:`choose`)."""

    phase: str
    traffic: dict[int, float]
    time: StepTime
    memory: Memory
    others: dict[str, list[int]]
    captured: dict[int, float]
    #: ``--engine``'s pricer (planner/fit/kv_price.py), None where the build names no engine
    kv: KvPricer | None = None
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

    def figure_sizes(self, sizes) -> tuple[int, ...]:
        """Every phase's capture sizes with this phase's at ``sizes``: what a row's graph figure
        is of (planner/fit/kv_price.py KvPricer.result)."""
        assert self.kv is not None, "a row is priced in KV tokens under an engine"
        return self.kv.sizes_of([*self.others.values(), sizes])

    def at(self, k: int) -> Row:
        """The best list of ``k`` sizes, priced (memoized: memory is simulated once)."""
        if k not in self._rows:
            self._rows[k] = self.row(f"{k}", self.best[k].sizes, self.best[k].seconds)
        return self._rows[k]

    def row(self, label: str, sizes: list[int] | tuple[int, ...], seconds: float | None = None) -> Row:
        sizes = tuple(sorted(sizes))
        step = expected(self.traffic, sizes, self.time.cost) if seconds is None else seconds
        pool, hoisted, total, graph = self.memory.of({**self.others, self.phase: list(sizes)})
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
            graph_bytes=graph,
            kv_tokens=None if self.kv is None or graph is None else self.kv.tokens(graph, self.figure_sizes(sizes)),
        )

    def choose(
        self, opts: SizeChoiceOptions, spec_count: int, budget_mib: float | None, spec: Path | None
    ) -> tuple[int, str]:
        """The count of sizes chosen for the phase (of :attr:`best`) and why: under ``opts``'
        limits (``--max-graphs``, else the spec's ``spec_count`` sizes; ``--max-padding``) and
        the budget (``budget_mib``: ``--budget-mib``, else the spec's, whose file ``spec`` is;
        of the device total where :attr:`memory` is calibrated)."""
        phase, at = self.phase, self.at
        kmax = max(self.best)
        calibrated = self.memory.calibration is not None
        budget = None if budget_mib is None else budget_mib * MiB
        unpadded = kmax if opts.max_padding is not None else spec_count
        limit = min(opts.max_graphs if opts.max_graphs is not None else unpadded, kmax)
        limit_text = f"--max-graphs {opts.max_graphs}" if opts.max_graphs is not None else f"{limit} sizes"

        def fits(k: int) -> bool:
            if opts.min_kv_tokens is not None and (at(k).kv_tokens or 0) < opts.min_kv_tokens:
                return False
            if budget is None:
                return True
            used = budget_of(at(k), calibrated)
            return used is not None and used <= budget

        floor = f" and --min-kv-tokens {opts.min_kv_tokens}" if opts.min_kv_tokens is not None else ""

        def padding(k: int) -> float:
            return self.padding(self.best[k].seconds)

        if opts.max_padding is not None:
            for k in range(1, limit + 1):
                if padding(k) <= opts.max_padding and fits(k):
                    return k, f"the fewest sizes that pad at most {opts.max_padding:g}% within {limit_text}" + (
                        f" and the budget ({budget_mib:g} MiB)" if budget is not None else ""
                    ) + floor
            # lists that pad little enough exist, and the floor is what none of them meets:
            # say so (more sizes would leave fewer tokens, not more)
            padded = [k for k in range(1, limit + 1) if padding(k) <= opts.max_padding]
            if padded and opts.min_kv_tokens is not None:
                best = max(padded, key=lambda k: at(k).kv_tokens or 0)
                left = at(best).kv_tokens or 0
                if left < opts.min_kv_tokens:
                    assert self.kv is not None, "a floor is priced under an engine"
                    graph = at(best).graph_bytes
                    at_sizes = self.figure_sizes(self.best[best].sizes)
                    why = self.kv.why_not(graph, at_sizes) if graph is not None else ""
                    what = f"phase {phase!r}: the best list that pads at most {opts.max_padding:g}% ({best} sizes)"
                    if why and graph is not None:  # not a floor to lower: the engine would not start
                        best_list = f"the best list of phase {phase!r} that pads at most {opts.max_padding:g}%"
                        raise self.kv.not_starting(self.kv.result(graph, at_sizes), f"with the graphs of {best_list}")
                    raise floor_error(opts.min_kv_tokens, left, self.kv.label, what)
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
                return k, why + (f" and the budget ({budget_mib:g} MiB)" if budget is not None else "") + floor
        one = at(1)
        if opts.min_kv_tokens is not None and (one.kv_tokens or 0) < opts.min_kv_tokens:
            # one size leaves the most tokens a list leaves: no list meets the floor
            assert self.kv is not None, "a floor is priced under an engine"
            one_sizes = self.figure_sizes(self.best[1].sizes)
            why = self.kv.why_not(one.graph_bytes, one_sizes) if one.graph_bytes is not None else ""
            if why and one.graph_bytes is not None:  # not a floor to lower: the engine would not start
                raise self.kv.not_starting(
                    self.kv.result(one.graph_bytes, one_sizes), f"with one size's graphs in phase {phase!r}"
                )
            raise floor_error(opts.min_kv_tokens, one.kv_tokens or 0, self.kv.label, f"phase {phase!r}: one size")
        used = budget_of(one, calibrated)
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


def floor_error(floor: int, left: int, engine: str, what: str) -> ConstraintError:
    """No list leaves ``floor`` KV tokens: ``what`` (the best there is) leaves ``left``, more than
    0 (where the engine would not start at all, :meth:`KvPricer.not_starting` refuses instead).
    The fix that works: the floor it leaves."""
    err = ConstraintError(
        f"{what} leaves {left:,} KV tokens under {engine}, below --min-kv-tokens {floor:,}",
        where=f"--min-kv-tokens {floor}",
        fix=f"lower the floor to {left:,} tokens",
    )
    err.retry = {"min_kv_tokens": left}
    return err


def budget_of(row: Row, calibrated: bool) -> int | None:
    return row.device_bytes if calibrated else row.pool_bytes
