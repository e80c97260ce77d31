"""A build's KV-token pricing: ``--engine`` (and its ``--engine-flag`` settings) on the build's
device, for the build's model (planner/fit/kv_price.py runs ``planner fit``'s rule).

The device is ``--device`` or the one the calibration measured; the model is the spec's (its
config.json where it names one, else its dimensions). :func:`kv_pricer` refuses, in one line
with a command that works, an engine without a device, settings without an engine, and a
``--min-kv-tokens`` without both. :func:`graph_figure` is what a plan's graph memory is priced
as: its device total where every item is known, else the items known where graph-exec is among
them (``--device`` without a calibration: allocator-other unknown, not counted).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import msgspec

from capture_plan.schemas.errors import InputError
from capture_plan.schemas.plan import DevicePrediction, KvCost

from ..inputs.build_options import BuildOptions, fix_command

if TYPE_CHECKING:  # fit is imported only by a build that names an engine (kv_pricer)
    from ..fit.kv_price import KvPricer
    from ..memory.device import Calibration
    from .read import SpecRead

__all__ = [
    "kv_pricer",
    "kv_cost",
    "graph_figure",
    "fixed_command",
    "changed_command",
    "EXAMPLE_ENGINE",
    "EXAMPLE_DEVICE",
]

#: what a refusal's fix suggests where nothing is given
EXAMPLE_ENGINE = "vllm==0.34.0"
EXAMPLE_DEVICE = "NVIDIA H100 80GB HBM3"


def fixed_command(opts: BuildOptions, has_config: bool) -> str:
    """The command with the KV inputs a refusal names filled in: an engine, a device, and the
    engine's context length where the spec's model has no config to give it."""
    engine = opts.engine or EXAMPLE_ENGINE
    flags = opts.engine_flags
    if not has_config and not any(f.split("=")[0] in ("max-model-len", "context-length") for f in flags):
        flags = (*flags, ("context-length" if engine.startswith("sglang") else "max-model-len") + "=8192")
    device = opts.device if opts.device is not None or opts.calibration is not None else EXAMPLE_DEVICE
    return fix_command(msgspec.structs.replace(opts, engine=engine, engine_flags=flags, device=device))


def _changed(opts: BuildOptions, changes: dict[str, object]) -> BuildOptions:
    """``opts`` with a fit refusal's ``changes`` (planner/fit/refusal.py): an engine flag as
    ``--engine-flag NAME=VALUE`` (None: left out), ``tp``, ``engine`` and ``device`` as the
    build's own options."""
    from ..fit.kv_price import changed_flags

    engine, flags = changed_flags(opts.engine_flags, opts.engine or EXAMPLE_ENGINE, changes)
    tp = changes.get("tp", opts.tp)
    device = changes.get("device", opts.device)
    return msgspec.structs.replace(
        opts,
        engine=engine,
        engine_flags=flags,
        tp=None if tp is None else int(str(tp)),
        device=None if device is None else str(device),
    )


def changed_command(opts: BuildOptions, changes: dict[str, object], has_config: bool = True) -> str:
    """The build command with a fit refusal's ``changes`` (:func:`_changed`), and the engine's
    context length where the spec's model has no config to give it (a change that drops the
    flag: ``--engine-flag bogus=1`` refused, the fix leaves it out; :func:`fixed_command`)."""
    return fixed_command(_changed(opts, changes), has_config)


def kv_pricer(opts: BuildOptions, read: SpecRead, calibration: Calibration | None, tp: int) -> KvPricer | None:
    """The build's pricer (None: no ``--engine``) for ``read``'s model: its config.json where
    it names one (``read.config_path``), else the dimensions the plan records."""
    from ..fit.context import NoContextLength
    from ..fit.inputs import FitRequest
    from ..fit.kv_price import KvPricer, parse_engine_flags, spec_model
    from ..fit.refusal import Refusal
    from ..inputs.specs import speculative_kinds

    floor = opts.sizes.min_kv_tokens if opts.sizes is not None else None
    has_config = read.config_path is not None
    if opts.engine is None:
        if opts.engine_flags or floor is not None:
            given = "--engine-flag" if opts.engine_flags else "--min-kv-tokens"
            raise InputError(
                f"{given} prices KV tokens under an engine release, and --engine names none",
                where=f"{given} {opts.engine_flags[0] if opts.engine_flags else floor}",
                fix=f"name the release: `{fixed_command(opts, has_config)}`",
            )
        return None
    device = opts.device
    if device is None and calibration is not None:
        device = calibration.device.split(" sm")[0].strip()
    if device is None:
        raise InputError(
            "--engine prices KV tokens on a device, and the build names none",
            where=f"--engine {opts.engine}",
            fix=f"name the device: `{fixed_command(opts, has_config)}`",
        )
    try:
        flags = parse_engine_flags(opts.engine, opts.engine_flags)
    except Refusal as err:  # its fix: this build with the change
        fixed = changed_command(opts, err.changes, has_config)
        raise InputError(err.what, where=err.where, fix=f"{err.hint}: `{fixed}`") from None
    model = spec_model(read.model.name, dict(read.model.dimensions), read.config_path)
    # a plan with speculative phases holds the draft's graphs itself; a calibration of it
    # measured them (its verify and draft graphs)
    kinds = speculative_kinds()
    holds = any(p.kind in kinds for p in read.spec.phases)
    try:
        command = functools.partial(changed_command, opts, has_config=has_config)
        request = FitRequest(
            model,
            device,
            opts.engine,
            tp,
            flags,
            measured_speculative=holds and calibration is not None,
            figure_speculative=holds,
        )
        return KvPricer(request, command)
    except InputError as err:
        if isinstance(err.__cause__, NoContextLength) and not has_config:
            raise InputError(
                "the spec's model names no config.json, so the engine's context length is not known",
                where=f"--engine {opts.engine}",
                fix=f"give it: `{fixed_command(opts, has_config)}`",
            ) from None
        raise


def graph_figure(device: DevicePrediction | None) -> tuple[int | None, str]:
    """(bytes, what they are) a plan's graph memory is priced as in KV tokens: the device total,
    else the device items known where graph-exec is among them, else None (unknown)."""
    if device is None:
        return None, "no device items (build with --device or --calibration)"
    if device.total_bytes is not None:
        return device.total_bytes, "the device total (graph-exec included)"
    known = {i.name: i.bytes for i in device.items if i.bytes is not None}
    if "graph-exec" not in known:
        return None, f"graph-exec unknown on {device.device}"
    unknown = [i.name for i in device.items if i.bytes is None]
    return sum(known.values()), f"the device items known (graph-exec included; {', '.join(unknown)} unknown)"


def kv_cost(pricer: KvPricer | None, device: DevicePrediction | None, sizes: tuple[int, ...]) -> KvCost | None:
    """The plan's graph memory (:func:`graph_figure`), of its capture ``sizes`` (every phase's),
    in the pricer's KV tokens (None: no engine)."""
    if pricer is None:
        return None
    graph, what = graph_figure(device)
    if graph is not None and pricer.unpriced:  # the engine captures graphs the plan's do not hold
        what += f"; KV tokens unknown: {pricer.unpriced}"
    return KvCost(
        engine=pricer.label,
        graph_bytes=graph,
        graph=what,
        kv_tokens=None if graph is None else pricer.tokens(graph, sizes),
        kv_tokens_without_graphs=pricer.none_tokens,
        overflow="" if graph is None or pricer.unpriced else pricer.why_not(graph, sizes),
    )
