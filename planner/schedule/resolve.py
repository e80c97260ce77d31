"""Step 1 of a build: every input read and checked once, and what the capture sizes decide.

:func:`resolve` reads the spec (parsed and validated once: the embedded one or a file, its
model config), the trace, the calibration report and the data files, and checks the options
against them; the result, a :class:`Resolved`, is what the pipeline plans
(planner/schedule/pipeline.py). Size choice (planner/sizes/) prices other lists of sizes on it
in memory: :meth:`Resolved.with_sizes` is the same inputs capturing other sizes, with what
depends on the sizes (the workload, each phase's largest graph alone, the phase order, the
forced orders, the graph keys) derived again, and nothing read again.

What this does not do: choose strategies or order steps (the pipeline's), or refuse a budget
(a budget is a plan's figure: the pipeline checks it, and a size choice prices lists over it).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

import msgspec

from capture_plan.schemas.codec import canonical_bytes, decode_trace, sha256
from capture_plan.schemas.errors import InputError
from capture_plan.schemas.files import read_input
from capture_plan.schemas.limits import MODEL_MAX
from capture_plan.schemas.plan import DimensionSource, ModelUsed, Strategy
from capture_plan.schemas.spec import Phase, Rule, Spec, phase_model
from capture_plan.schemas.strategy import AllocatorMode, allocator_modes
from capture_plan.schemas.trace import Trace
from capture_plan.schemas.units import MiB

from ..inputs import resources
from ..inputs.build_options import BuildOptions, check_paths_encode, command_for_cwd, output_path, relative
from ..inputs.dimensions import MOE, model_used, preset_sources
from ..inputs.rules import Context, check_spec_rules, phase_rules
from ..inputs.specs import default_spec, model_presets, read_spec_file
from ..inputs.validate import decode_spec_sources
from ..memory.device import Calibration
from ..memory.simulate import PoolSetup, simulate
from ..memory.workload import Workload
from .graph import StepGraph, check_acyclic, phase_sequence
from .keys import resolve_keys
from .optimize import parse_pins
from .sequence import capture_order

if TYPE_CHECKING:  # a build that names an engine imports fit (schedule/kv.py)
    from ..fit.kv_price import KvPricer

__all__ = ["Resolved", "SpecRead", "resolve", "read_spec", "check_tp"]


class SpecRead(msgspec.Struct, frozen=True, kw_only=True):
    """The spec a build plans, as read: the embedded one or a file (with its model config)."""

    #: the spec planned: its model complete (from its preset, its config.json)
    spec: Spec
    #: the spec as its file says, before its model config is read (what a copy of it with other
    #: sizes writes: ``planner sizes --write-spec``); the embedded spec itself
    source: Spec
    #: the spec as the plan records it: relative to the plan's folder
    name: str
    raw: bytes
    #: (path relative to the plan, digest, model_type) of the model config
    model_config: tuple[str, str, str | None] | None
    #: where each model dimension came from (capture_plan.planner.inputs.dimensions)
    sources: dict[str, DimensionSource]
    #: the config.json key each dimension from a config was read from
    config_keys: dict[str, str]
    #: the model's longest context and where its config says so (``max_position_embeddings``;
    #: hf_config.context_window), None where no config names one
    context_window: tuple[int, str] | None = None


def read_spec(opts: BuildOptions, base: Path | None = None) -> SpecRead:
    """The spec of ``opts``, parsed and validated (every error located); ``base``: the plan's
    folder its paths are recorded relative to (default: that of ``opts``' output)."""
    if opts.spec is not None:
        # --speculative, --preset and --max-bs choose the embedded spec's phases and sizes; a spec
        # file lists its own, and merging the two would leave no one place that says what is
        # captured (--tp and --allocator do apply: they override the file's tp and allocator)
        # --preset (and --max-bs with it) is the one exception: the preset's phases, sizes and rules
        # for the spec's model (_on_preset), the spec's phases replaced as the docs say
        pairs = [
            (flag, str(v))
            for flag, v in (
                ("--speculative", opts.speculative),
                ("--max-bs", opts.max_bs if opts.preset is None else None),
            )
            if v is not None
        ]
        if pairs:
            given = " and ".join(f"{flag} {v}" for flag, v in pairs)
            show = shlex.join(["planner", "spec", "show", *(a for pair in pairs for a in pair)])
            raise InputError(
                f"{given} choose the embedded spec's phases and sizes, and {opts.spec} lists its own",
                where=f"--spec {opts.spec}",
                fix=f"start a spec from `{show} > my.toml` and build with --spec my.toml, "
                "or write the phases and sizes into your spec",
            )
        from ..inputs.hf_config import context_window, read_model_config  # only specs from files name a model config

        raw = read_spec_file(opts.spec)
        source, sources = decode_spec_sources(raw, str(opts.spec), presets=model_presets())
        if base is None:
            base = output_path(opts).parent
        model, config, config_raw, config_keys = read_model_config(source.model, opts.spec, str(opts.spec))
        used = None
        if config is not None:
            used = (relative(Path(config), base), sha256(config_raw), _model_type(config_raw))
        sources.update({f: "config" for f in MOE if f in config_keys})  # the MoE fields a config gives are its
        if opts.preset is not None:
            source = _on_preset(source, opts)
        return SpecRead(
            spec=msgspec.structs.replace(source, model=model),
            source=source,
            name=relative(opts.spec, base),
            raw=raw,
            model_config=used,
            sources=sources,
            config_keys=config_keys,
            context_window=context_window(config_raw, config) if config is not None else None,
        )
    spec = default_spec(opts.speculative, opts.max_bs, opts.preset)
    return SpecRead(
        spec=spec,
        source=spec,
        name="embedded:" + spec.name,
        raw=canonical_bytes(spec),
        model_config=None,
        sources=preset_sources(spec.model),
        config_keys={},
    )


def _on_preset(source: Spec, opts: BuildOptions) -> Spec:
    """``--preset NAME --spec FILE``: the preset's phases at its sizes (up to ``--max-bs``) and its
    rules, for the spec's model (its ``[model]`` as written: a config is read after), name, tp,
    allocator, budget, library workspaces and trace; the spec's own phases and rules are replaced
    (the preset's are the engine's). What ``planner sizes --write-spec`` writes of it is a spec of
    its own (the preset's phases in it) that builds without ``--preset``."""
    assert opts.preset is not None
    preset = default_spec(None, opts.max_bs, opts.preset)
    return msgspec.structs.replace(source, phases=preset.phases, rules=preset.rules)


def _model_type(config_raw: bytes) -> str | None:
    """The ``model_type`` of a config.json the reader already accepted."""
    mt = msgspec.json.decode(config_raw).get("model_type")
    return mt if isinstance(mt, str) else None


def _trace_path(opts: BuildOptions, spec: Spec) -> Path | None:
    if opts.trace is not None:
        return opts.trace
    if spec.trace is not None and opts.spec is not None:
        return opts.spec.parent / spec.trace
    return None


def check_tp(spec: Spec, tp: int, where: str = "--tp") -> None:
    """``tp`` (from ``where``: --tp, or the spec's ``tp``) divides the model's heads
    and MLP, and those of every phase with its own model (a draft is split across
    the same ranks)."""
    if tp < 1 or tp > MODEL_MAX["heads"]:
        raise InputError(
            f"must be 1..{MODEL_MAX['heads']}, got {tp}",
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


def _read_trace(opts: BuildOptions, spec: Spec) -> tuple[Trace, Path, str] | None:
    """The recorded trace when one is given (JSON from capture_plan.executor.profile, or a
    pickle from torch.cuda.memory._dump_snapshot, whose captures are labelled with the spec's
    own sizes: the ones the run captured), its path and digest; None for the analytic model."""
    path = _trace_path(opts, spec)
    if path is None:
        return None
    raw = read_input(
        path,
        "trace",
        fix="record one on a GPU with `capture_plan.executor.profile` "
        "(docs/design.md: Few-size traces), or build without --trace for the analytic model",
    )
    from capture_plan.planner.memory.snapshot import is_pickle, trace_from_snapshot  # only with a trace

    if is_pickle(raw):
        trace = trace_from_snapshot(raw, spec.phases, str(path))
    else:
        trace = decode_trace(raw, str(path))
    if trace.backend and trace.backend != opts.backend:
        raise InputError(
            f"trace was recorded with backend {trace.backend!r}, this build is for {opts.backend!r}",
            where=f"{path}: $.backend",
            fix=f"record a trace with {opts.backend}, or build for --backend {trace.backend}",
        )
    return trace, path, sha256(raw)


def _calibration(opts: BuildOptions, spec: Spec, model: ModelUsed, base: Path):
    """The calibration report's measured device items, and how the plan records it.

    ``base``: the plan's folder, which the plan records the report's path relative to.
    Refused when the report measured another backend or model than ``model``
    (device.check_applies); and by :func:`_check_traced_on` when the trace the prediction
    comes from was recorded on another device."""
    if opts.calibration is None:
        return None, None
    from ..memory.device import Applies, read_calibration

    recorded = relative(opts.calibration, base)
    without = command_for_cwd(msgspec.structs.replace(opts, calibration=None))
    cal, raw = read_calibration(
        opts.calibration, {p.name: p.kind for p in spec.phases}, recorded, Applies(opts.backend, model, without)
    )
    return cal, (recorded, sha256(raw))


def _device_estimate(
    opts: BuildOptions, model: ModelUsed, phases: list[str], calibration: Calibration | None, traced: bool
) -> Calibration | None:
    """``--device NAME`` without a calibration: its device items estimated for the reference
    decode step's graphs (a trace's model has no node count: graph-exec unknown then). With a
    calibration the device is the one it measured: another ``--device`` is refused."""
    if opts.device is None:
        return None
    if calibration is not None:
        measured = calibration.device.split(" sm")[0].strip()
        if opts.device.split(" sm")[0].strip() != measured:
            raise InputError(
                f"the calibration was measured on {measured!r}, not {opts.device!r}",
                where=f"--device {opts.device} with --calibration {opts.calibration}",
                fix=f"leave --device out (the plan is then the {measured}'s), or give a calibration measured on it",
            )
        return None
    from ..memory.graph_nodes import REFERENCE, device_estimate

    layers = {p: model.phases.get(p, {}).get("layers", model.dimensions["layers"]) for p in phases}
    return device_estimate(opts.device, layers, "a trace's model" if traced else REFERENCE)


def _check_traced_on(calibration: Calibration | None, traced_on: str, shown: str) -> None:
    """Refuse a calibration measured on another device than the trace (``traced_on``) was
    recorded on: its items would describe another machine than the pool."""
    if calibration is not None and traced_on and calibration.device.split(" sm")[0] not in traced_on:
        raise InputError(
            f"calibration was measured on {calibration.device!r}, the trace recorded on {traced_on!r}",
            where=f"--calibration {shown}",
            fix="calibrate with a report from the device the trace was recorded on",
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
    and the pins; then what the spec's sizes decide (:func:`_sized`)."""
    check_paths_encode(opts)
    output = output_path(opts)
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
    traced = _read_trace(opts, spec)
    traced_on = traced[0].device if traced is not None else ""
    used = model_used(spec, spec_read.sources, spec_read.config_keys)
    calibration, calibration_record = _calibration(opts, spec, used, output.parent)
    _check_traced_on(calibration, traced_on, str(opts.calibration))
    estimate = _device_estimate(opts, used, [p.name for p in spec.phases], calibration, traced is not None)
    kv, floor = None, opts.sizes.min_kv_tokens if opts.sizes is not None else None
    if opts.engine is not None or opts.engine_flags or floor is not None:
        from .kv import kv_pricer  # fit's tables and rules: read only for a build that names an engine

        config = spec_read.model_config[0] if spec_read.model_config is not None else None
        kv = kv_pricer(opts, used, config, calibration, tp, output.parent)
    expandable = allocator == "expandable"
    protect = frozenset(p.name for p in spec.phases if p.output_lifetime == "across-phases")
    library = int(spec.library_mib * MiB)
    read = dict(
        opts=opts,
        output=output,
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
