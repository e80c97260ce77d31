"""What a list of capture sizes costs a phase: padding and step time, graph memory, capture time.

Every list ``planner sizes`` weighs (planner/sizes/sizes.py) is priced here, alike: its
expected step time and padding from the traffic and a step time per size (planner/sizes/step_time.py),
its graph memory from the plan's own schedule simulated with the list (:class:`Memory`: the
other phases at their lists, every graph key; with a calibration, the device total), and its
capture seconds where a report measured them. Also the engines' default lists a choice is
weighed against.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from capture_plan.schemas.errors import InputError
from capture_plan.schemas.limits import MAX_BS
from capture_plan.schemas.plan import Step, Strategy
from capture_plan.schemas.spec import Phase

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
from .step_time import (
    DEFAULT_DEVICE,
    Measured,
    StepTime,
    device_names,
    device_roofline,
    measured_times,
    roofline,
)

if TYPE_CHECKING:
    from ..fit.kv_price import KvPricer

__all__ = [
    "Priced",
    "Row",
    "Memory",
    "Pricing",
    "phase_step_time",
    "roofline_device",
    "engine_defaults",
    "covering",
    "budget_of",
]


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


def roofline_device(device: str | None, calibration: Calibration | None, calibration_path: object) -> str:
    """The device whose roofline prices a step: ``--device``, else the calibration's (a list's
    device total is that device's: its step times are then of the same one), else
    :data:`DEFAULT_DEVICE`. ``--device`` naming another device than the calibration was
    measured on is refused: the figures of two devices would sit in one row, unsaid."""
    if calibration is None:  # not `or`: --device '' is a device no table has, refused (it priced the H200)
        return DEFAULT_DEVICE if device is None else device
    measured = calibration.device.split(" sm")[0].strip()
    if device is None:
        if measured not in device_names():
            raise InputError(
                f"no roofline figures for {measured!r}, the device the calibration was measured on",
                where=f"--calibration {calibration_path}",
                fix="measure step times on it with --timing REPORT, or add it to planner/data/devices.toml [roofline]",
            )
        return measured
    named = device_roofline(device).name
    if named != measured:
        err = InputError(
            f"the calibration was measured on {measured!r}, the roofline is of {named!r}: a list's device "
            "total and its step time would be of two devices",
            where=f"--device {device} with --calibration {calibration_path}",
            fix=f"leave --device out (the roofline is then the {measured}'s), or give a calibration "
            f"(a capture report) measured on the {named}",
        )
        err.retry = {"device": None}
        raise err
    return named


def phase_step_time(opts: SizeChoiceOptions, device: str, r: Resolved, phase: Phase, timing) -> StepTime:
    """``phase``'s step time per size: measured (``timing``: a report with replay times and
    how to name it), else the roofline of ``r``'s model on ``device`` (:func:`roofline_device`'s)
    and ``opts``' context, as :func:`capture_plan.planner.sizes.sizes.choose` resolved it
    (bounded by the model's window)."""
    if timing is not None:
        rep, shown = timing
        return measured_times(rep, shown, phase.name)
    assert opts.context is not None, "choose() resolves it"
    return roofline(r.spec.model, phase, r.tp, device_roofline(device), opts.context, r.backend)


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
    other phases at ``others``' lists), and the best list of each count once found."""

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
            kv_tokens=None if self.kv is None or graph is None else self.kv.tokens(graph),
        )


def budget_of(row: Row, calibrated: bool) -> int | None:
    return row.device_bytes if calibrated else row.pool_bytes
