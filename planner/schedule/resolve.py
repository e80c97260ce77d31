"""Step 1 of a build: every input read and checked once, and what the capture sizes decide.

:func:`resolve` reads the spec (parsed and validated once: the embedded one or a file, its
model config), the trace, the calibration report (each read by planner/schedule/read.py) and
the data files, and checks the options against them; it records the options as the plan will
(``Resolved.record``: made once, read by the pipeline); the result, a :class:`Resolved`, is what the pipeline plans
(planner/schedule/pipeline.py). Size choice (planner/sizes/) prices other lists of sizes on it
in memory: :meth:`Resolved.with_sizes` is the same inputs capturing other sizes, with what
depends on the sizes (the workload, each phase's largest graph alone, the phase order, the
forced orders, the graph keys) derived again, and nothing read again.

What this does not do: choose strategies or order steps (the pipeline's), or refuse a budget
(a budget is a plan's figure: the pipeline checks it, and a size choice prices lists over it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

import msgspec

from capture_plan.schemas.build_flags import out_of_bounds
from capture_plan.schemas.errors import InputError
from capture_plan.schemas.plan import BuildRecord, Strategy
from capture_plan.schemas.spec import Phase, Rule, Spec, phase_model
from capture_plan.schemas.strategy import AllocatorMode, allocator_modes
from capture_plan.schemas.trace import Trace
from capture_plan.schemas.units import MiB

from ..inputs import resources
from ..inputs.build_options import BuildOptions, build_record, check_paths_encode, output_path
from ..inputs.rules import Context, check_spec_rules, phase_rules
from ..memory.device import Calibration
from ..memory.simulate import PoolSetup, simulate
from ..memory.workload import Workload
from .graph import StepGraph, check_acyclic, phase_sequence
from .keys import resolve_keys
from .optimize import parse_pins
from .read import SpecRead, check_traced_on, device_estimate, read_calibration_of, read_spec, read_trace
from .sequence import capture_order

if TYPE_CHECKING:  # a build that names an engine imports fit (schedule/kv.py)
    from ..fit.kv_price import KvPricer

__all__ = ["Resolved", "resolve", "check_tp"]


def check_tp(spec: Spec, tp: int, where: str = "--tp") -> None:
    """``tp`` (from ``where``: --tp, or the spec's ``tp``) divides the model's heads
    and MLP, and those of every phase with its own model (a draft is split across
    the same ranks)."""
    bad = out_of_bounds("tp", tp)  # the option's row (schemas/build_flags.py)
    if bad is not None:
        raise InputError(
            bad,
            where=where,
            fix="give the tensor-parallel size (GPUs per model replica)",
        )
    models = [(spec.model, where)] + [
        (phase_model(spec.model, p), f"{where} (phase {p.name!r}, its own model: $.phases[{i}].model)")
        for i, p in enumerate(spec.phases)
        if p.model is not msgspec.UNSET
    ]
    for m, at in models:
        bad = [f"{name}={v}" for name, v in (("heads", m.heads), ("intermediate", m.intermediate)) if v % tp]
        if m.kv_heads % tp and tp % m.kv_heads:  # KV heads may be replicated when tp > kv_heads
            bad.append(f"kv_heads={m.kv_heads}")
        if bad:
            raise InputError(
                f"tp={tp} does not divide {', '.join(bad)}",
                where=at,
                fix="use a tensor-parallel size that divides the model's heads and MLP",
            )


def _forced_orders(spec: Spec, rules: dict, pins: dict) -> dict[str, list[tuple[str, str]]]:
    """Orders demanded outright: by a rule whose every alternative names the same
    order, or by a pin. They become edges before anything is chosen, so two
    that disagree make a cycle, reported as the rules in conflict."""
    forced: dict[str, list[tuple[str, str]]] = {}
    for p in spec.phases:
        for r in rules[p.name]:
            orders = {c.order for c in r.require}
            if r.require and len(orders) == 1 and None not in orders:
                forced.setdefault(p.name, []).append((orders.pop(), r.id))
        pin = {**pins.get(None, {}), **pins.get(p.name, {})}.get("order")
        if pin:
            forced.setdefault(p.name, []).append((pin, f"--strategy order={pin}"))
    pre = StepGraph.empty()
    sizes = {p.name: p.sizes for p in spec.phases}
    for name, pairs in forced.items():
        for order, rule in pairs:
            pre.chain(name, [(bs, ()) for bs in capture_order(sizes[name], order)], rule)
    check_acyclic(pre.g)
    return forced


class Resolved(msgspec.Struct, frozen=True, kw_only=True):
    """Step 1 of a build: every input read, checked and matched to rules (:func:`resolve`),
    and what the capture sizes decide (:meth:`with_sizes` derives it again for others)."""

    opts: BuildOptions
    #: the plan's path (``-o``, else the default name: build_options.output_path), read once;
    #: the paths a plan records are relative to its folder
    output: Path
    #: the options as the plan records them (build_options.build_record: its paths relative to
    #: ``output``'s folder), made once here; the plan's command is its text
    record: BuildRecord
    backend: resources.Backend
    #: the spec planned, capturing the sizes this resolution is of
    spec: Spec
    spec_read: SpecRead
    #: the spec as the user named it (relative to the cwd): where errors point
    spec_source: str
    tp: int
    allocator: AllocatorMode
    #: whether the pool grows by expandable segments (``allocator == "expandable"``)
    expandable: bool
    #: the phases whose outputs live across phases (``output_lifetime = "across-phases"``):
    #: a capture's size never changes them
    protect: frozenset[str]
    #: the built-in rules and the spec's
    all_rules: list[Rule]
    pins: dict[str | None, dict[str, str]]
    trace: Trace | None
    trace_path: Path | None
    trace_digest: str | None
    #: the device the trace was recorded on ("" for the analytic model)
    traced_on: str
    library: int
    #: how its pools are simulated: ``expandable``, ``protect`` and ``library`` together
    pools: PoolSetup
    calibration: Calibration | None
    #: (path relative to the plan, digest) of the calibration report
    calibration_record: tuple[str, str] | None
    #: ``--device`` without a calibration: the device items estimated for it (graph_nodes.py)
    device_estimate: Calibration | None
    #: ``--engine``: graph memory priced in the release's KV tokens on the device (schedule/kv.py)
    kv: KvPricer | None
    # what the sizes decide (derived by _sized)
    rules: dict[str, list]
    by_name: dict[str, Phase]
    workload: Workload
    #: pool bytes of each phase's largest graph alone
    alone: dict[str, int]
    sequence: list[str]
    forced: dict[str, list[tuple[str, str]]]
    #: per phase with variant axes: (label combinations, key order, its rule) (planner/schedule/keys.py)
    keys: dict[str, tuple] = {}

    def with_sizes(self, lists: Mapping[str, Sequence[int]]) -> Resolved:
        """These inputs capturing ``lists`` (phase -> sizes; a phase it does not name keeps its
        own), sorted as a spec lists them. Nothing is read or parsed again."""
        phases = [msgspec.structs.replace(p, sizes=sorted(lists.get(p.name, p.sizes))) for p in self.spec.phases]
        read = {f: getattr(self, f) for f in self.__struct_fields__ if f not in _SIZED}
        return _sized(read, msgspec.structs.replace(self.spec, phases=phases))

    def without_pins(self) -> Resolved:
        """These inputs without the ``--strategy`` pins (what the cheapest schedule the rules
        allow is priced with)."""
        return msgspec.structs.replace(self, pins={}, forced=_forced_orders(self.spec, self.rules, {}))


#: the fields of a Resolved that its sizes decide (:func:`_sized`)
_SIZED = ("spec", "rules", "by_name", "workload", "alone", "sequence", "forced", "keys")


def _sized(read: dict, spec: Spec) -> Resolved:
    """The Resolved of the inputs ``read`` (every field but :data:`_SIZED`) capturing ``spec``'s
    sizes: the rules per phase, the workload (the analytic model, or the trace fitted to these
    sizes), each phase's largest graph alone, the phase order, the orders forced outright and
    the graph keys."""
    opts, trace = read["opts"], read["trace"]
    ctx = Context(backend=opts.backend, ci=opts.ci)
    rules = {p.name: phase_rules(read["all_rules"], p, ctx) for p in spec.phases}
    if trace is None:
        workload = Workload.analytic(spec.model, spec.phases, read["backend"], read["tp"])
    else:
        workload = Workload.from_trace(trace, spec.phases, str(read["trace_path"]), spec.model)
    alone = {
        p.name: simulate(
            [(p.name, max(p.sizes))],
            {p.name: Strategy()},
            workload,
            PoolSetup(read["expandable"], library_bytes=read["library"]),
        ).pool_bytes
        for p in spec.phases
    }
    return Resolved(
        **read,
        spec=spec,
        rules=rules,
        by_name={p.name: p for p in spec.phases},
        workload=workload,
        alone=alone,
        sequence=phase_sequence(spec.phases, alone, read["spec_source"]),
        forced=_forced_orders(spec, rules, read["pins"]),
        keys=resolve_keys(spec.phases, rules),
    )


def resolve(opts: BuildOptions) -> Resolved:
    """Read spec, trace and data once; check the output's name, tp, allocator, the spec's rules
    and the pins; then what the spec's sizes decide (:func:`_sized`). ``--device`` is read as
    every command reads it, and the build uses and records torch's name for it
    (planner/inputs/devices.py ``build_device``)."""
    if opts.device is not None:  # the devices tables: read only for a build that names one
        from ..inputs.devices import build_device

        opts = build_device(opts)
    check_paths_encode(opts)
    output = output_path(opts)
    record = build_record(opts)
    backend = resources.backend(opts.backend)
    spec_read = read_spec(opts, output.parent)
    spec = spec_read.spec
    spec_source = str(opts.spec) if opts.spec is not None else spec_read.name
    tp = opts.tp if opts.tp is not None else spec.tp
    check_tp(spec, tp, "--tp" if opts.tp is not None else f"{spec_source}: $.tp")
    if not output.name:
        raise InputError(f"{str(output)!r} names no file", where="-o", fix="give a plan file name")
    allocator = spec.allocator if opts.allocator is None else opts.allocator
    if allocator not in allocator_modes():
        raise InputError(
            f"unknown allocator mode {allocator!r}", where="--allocator", fix=f"use {' or '.join(allocator_modes())}"
        )
    allocator = cast(AllocatorMode, allocator)  # one of allocator_modes(), checked above
    check_spec_rules(spec.rules, list(resources.builtin_rules()), resources.backend_names(), spec_source)
    # in the order the plan records them (sorted): the optimizer lists broken pins in
    # pin order, so the order typed would change the bytes and `planner check` would call them stale
    pins = parse_pins(sorted(set(opts.strategies)), [p.name for p in spec.phases])
    traced = read_trace(opts, spec)
    traced_on = traced[0].device if traced is not None else ""
    calibration, calibration_record = read_calibration_of(opts, spec_read, output.parent)
    check_traced_on(calibration, traced_on, str(opts.calibration))
    estimate = device_estimate(opts, spec_read, calibration, traced is not None)
    kv, floor = None, opts.sizes.min_kv_tokens if opts.sizes is not None else None
    if opts.engine is not None or opts.engine_flags or floor is not None:
        from .kv import kv_pricer  # fit's tables and rules: read only for a build that names an engine

        kv = kv_pricer(opts, spec_read, calibration, tp)
    expandable = allocator == "expandable"
    protect = frozenset(p.name for p in spec.phases if p.output_lifetime == "across-phases")
    library = int(spec.library_mib * MiB)
    read = dict(
        opts=opts,
        output=output,
        record=record,
        backend=backend,
        spec_read=spec_read,
        spec_source=spec_source,
        tp=tp,
        allocator=allocator,
        expandable=expandable,
        protect=protect,
        all_rules=list(resources.builtin_rules()) + list(spec.rules),
        pins=pins,
        trace=traced[0] if traced is not None else None,
        trace_path=traced[1] if traced is not None else None,
        trace_digest=traced[2] if traced is not None else None,
        traced_on=traced_on,
        library=library,
        pools=PoolSetup(expandable, protect, library),
        calibration=calibration,
        calibration_record=calibration_record,
        device_estimate=estimate,
        kv=kv,
    )
    return _sized(read, spec)
