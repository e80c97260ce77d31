"""Step 1's reading: what a build's options name, each read and checked once.

The spec (the embedded one or a file, with its model config), the trace, the calibration
report and ``--device``'s estimate, each read from the options (planner/inputs/build_options.py)
with every error located. :func:`~capture_plan.planner.schedule.resolve.resolve` calls these once
per build and derives the rest from what they read (planner/schedule/resolve.py); nothing here
depends on the capture sizes, so a size choice prices its lists without reading again.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import msgspec

from capture_plan.schemas.codec import canonical_bytes, decode_trace, sha256
from capture_plan.schemas.errors import InputError
from capture_plan.schemas.files import read_input
from capture_plan.schemas.plan import ModelUsed
from capture_plan.schemas.spec import Spec
from capture_plan.schemas.trace import Trace

from ..inputs.build_options import BuildOptions, command_for_cwd, output_path, relative
from ..inputs.dimensions import MOE, model_used, preset_sources
from ..inputs.specs import default_spec, model_presets, read_spec_file
from ..inputs.validate import decode_spec_sources
from ..memory.device import Calibration

__all__ = ["SpecRead", "read_spec", "read_trace", "read_calibration_of", "device_estimate", "check_traced_on"]


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
    #: the model config's path as the build reads it (relative to the cwd, normalized), None
    #: without one: where ``--engine``'s pricing reads the config again (schedule/kv.py)
    config_path: Path | None
    #: the model the prediction uses as the plan records it: every dimension with its source
    #: (capture_plan.planner.inputs.dimensions.model_used), made once here
    model: ModelUsed
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
        used, path = None, None
        if config is not None:
            used = (relative(Path(config), base), sha256(config_raw), _model_type(config_raw))
            path = Path(os.path.normpath(base / used[0]))
        sources.update({f: "config" for f in MOE if f in config_keys})  # the MoE fields a config gives are its
        if opts.preset is not None:
            source = _on_preset(source, opts)
        spec = msgspec.structs.replace(source, model=model)
        return SpecRead(
            spec=spec,
            source=source,
            name=relative(opts.spec, base),
            raw=raw,
            model_config=used,
            config_path=path,
            model=model_used(spec, sources, config_keys),
            context_window=context_window(config_raw, config) if config is not None else None,
        )
    spec = default_spec(opts.speculative, opts.max_bs, opts.preset)
    return SpecRead(
        spec=spec,
        source=spec,
        name="embedded:" + spec.name,
        raw=canonical_bytes(spec),
        model_config=None,
        config_path=None,
        model=model_used(spec, preset_sources(spec.model), {}),
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


def read_trace(opts: BuildOptions, spec: Spec) -> tuple[Trace, Path, str] | None:
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


def read_calibration_of(opts: BuildOptions, read: SpecRead, base: Path):
    """The calibration report's measured device items, and how the plan records it.

    ``base``: the plan's folder, which the plan records the report's path relative to.
    Refused when the report measured another backend or model than ``read``'s
    (device.check_applies); and by :func:`check_traced_on` when the trace the prediction
    comes from was recorded on another device."""
    if opts.calibration is None:
        return None, None
    from ..memory.device import Applies, read_calibration

    recorded = relative(opts.calibration, base)
    without = command_for_cwd(msgspec.structs.replace(opts, calibration=None))
    cal, raw = read_calibration(
        opts.calibration,
        {p.name: p.kind for p in read.spec.phases},
        recorded,
        Applies(opts.backend, read.model, without),
    )
    return cal, (recorded, sha256(raw))


def device_estimate(
    opts: BuildOptions, read: SpecRead, calibration: Calibration | None, traced: bool
) -> Calibration | None:
    """``--device NAME`` without a calibration: its device items estimated for the reference
    decode step's graphs of ``read``'s model (a trace's model has no node count: graph-exec
    unknown then). With a calibration the device is the one it measured: another ``--device``
    is refused."""
    if opts.device is None:
        return None
    if calibration is not None:  # opts.device: torch's name (planner/inputs/devices.py build_device)
        measured = calibration.device.split(" sm")[0].strip()
        if opts.device != measured:
            raise InputError(
                f"the calibration was measured on {measured!r}, not {opts.device!r}",
                where=f"--device {opts.device} with --calibration {opts.calibration}",
                fix=f"leave --device out (the plan is then the {measured}'s), or give a calibration measured on it",
            )
        return None
    from ..memory.graph_nodes import REFERENCE, device_estimate

    model = read.model
    layers = {p.name: model.phases.get(p.name, {}).get("layers", model.dimensions["layers"]) for p in read.spec.phases}
    return device_estimate(opts.device, layers, "a trace's model" if traced else REFERENCE)


def check_traced_on(calibration: Calibration | None, traced_on: str, shown: str) -> None:
    """Refuse a calibration measured on another device than the trace (``traced_on``) was
    recorded on: its items would describe another machine than the pool."""
    if calibration is not None and traced_on and calibration.device.split(" sm")[0] not in traced_on:
        raise InputError(
            f"calibration was measured on {calibration.device!r}, the trace recorded on {traced_on!r}",
            where=f"--calibration {shown}",
            fix="calibrate with a report from the device the trace was recorded on",
        )
