"""Which model dimensions a spec gives, where the others come from, and the plan's record of both.

A spec's ``[model]`` gives every dimension the prediction uses
(:data:`REQUIRED`), or names where the ones it leaves out come from: a
``config.json`` (``config = "config.json"``, read by
:mod:`capture_plan.planner.inputs.hf_config`) or a preset (``preset = "llama-3-8b"``,
the embedded default model of ``planner/data/presets.toml``). A ``[model]``
that does neither and leaves a dimension out is refused, naming every missing
key: before this, ``[model] name = "qwen-72b"`` silently planned Llama-3-8B.
A spec with no ``[model]`` at all plans the embedded default model, and says
so (its dimensions are recorded as the preset's). ``dtype_bytes`` (2: bf16
activations) and ``logits_dtype_bytes`` (4: float32 logits, what engines
return) are element sizes rather than dimensions of the model: left out, they
take those values, recorded as ``default``.

What a build used is recorded in the plan (``inputs.model``: every value and
its source), printed by ``planner build`` and ``planner show``, and compared by
``planner diff`` and ``planner check``.

What this does not do: tell a preset's dimensions from the same numbers typed
into ``[model]`` (both are recorded as given), or check that dimensions belong
to the model ``name`` says.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from capture_plan.schemas.errors import InputError
from capture_plan.schemas.plan import DimensionSource, ModelUsed
from capture_plan.schemas.spec import Model, Spec

__all__ = [
    "REQUIRED",
    "ELEMENT_SIZES",
    "MOE",
    "DEFAULT_PRESET",
    "resolve_model",
    "preset_sources",
    "model_used",
    "dimensions_text",
]

#: what a ``[model]`` without ``config`` or ``preset`` must give
REQUIRED = ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab")
#: element sizes with a default (bf16 activations, float32 logits) when a spec leaves them out
ELEMENT_SIZES = ("dtype_bytes", "logits_dtype_bytes")
#: mixture-of-experts fields: recorded only when given
MOE = ("experts", "experts_per_token", "expert_intermediate", "shared_expert_intermediate")
#: the embedded default model (planner/data/presets.toml's [model])
DEFAULT_PRESET = "llama-3-8b"


def preset_sources(model: Model) -> dict[str, DimensionSource]:
    """Every dimension of ``model`` from its preset (the embedded specs, a spec without ``[model]``)."""
    return {f: "preset" for f in REQUIRED + ELEMENT_SIZES + MOE if getattr(model, f) is not msgspec.UNSET}


def resolve_model(
    table: object, model: Model, source: str, presets: Mapping[str, Model], spec_name: str | None = None
) -> tuple[Model, dict[str, DimensionSource]]:
    """``model`` (decoded from the spec's ``[model]`` ``table``, a dict of the keys
    the file gives, or None when it has none) completed from its preset, and the
    source of every dimension; dimensions from a ``config`` are marked ``config``
    here and read by the build. ``presets``: the preset names and their models
    (``capture_plan.planner.inputs.specs.model_presets``, passed in as the phase kinds are:
    this module reads no data). Refuses a ``[model]`` that leaves dimensions out
    and names neither a config nor a preset, one naming both, and an unknown preset.
    A ``[model]`` that lists every dimension and no name is named after the spec
    (``spec_name``, the spec's own ``name`` where it gives one), else ``unnamed``: never
    after the default preset it did not use."""
    if not isinstance(table, dict):  # no [model]: the embedded default model, recorded as such
        preset = presets[DEFAULT_PRESET]
        return msgspec.structs.replace(preset, preset=DEFAULT_PRESET), preset_sources(preset)
    given = set(table)
    where = f"{source}: $.model"
    if "config" in given and "preset" in given:
        raise InputError(
            "[model] names both a config and a preset for the dimensions it leaves out",
            where=f"{where}.preset",
            fix="keep one: the config.json (it gives every dimension) or the preset",
        )
    if "config" in given:
        listed = [f for f in REQUIRED + ("dtype_bytes",) if f in given]
        if listed:
            raise InputError(
                f"[model] names a config and also lists {', '.join(listed)}",
                where=f"{where}.config",
                fix="keep one: the config or the dimensions",
            )
        sources: dict[str, DimensionSource] = {f: "config" for f in REQUIRED + ("dtype_bytes",)}
        sources["logits_dtype_bytes"] = "spec" if "logits_dtype_bytes" in given else "default"
        return model, {**sources, **{f: "spec" for f in MOE if f in given}}
    if "preset" in given:
        name = model.preset
        if name not in presets:
            raise InputError(
                f"unknown model preset {name!r}",
                where=f"{where}.preset",
                fix=f"use one of {', '.join(sorted(presets))}, or list every dimension in [model]",
            )
        base = presets[str(name)]
        own = {f: getattr(model, f) for f in given if f != "preset"}
        resolved = msgspec.structs.replace(base, **own, preset=name)
        fields = REQUIRED + ELEMENT_SIZES + tuple(f for f in MOE if getattr(resolved, f) is not msgspec.UNSET)
        return resolved, {f: "spec" if f in given else "preset" for f in fields}
    missing = [f for f in REQUIRED if f not in given]
    if missing:
        named = f"names model {model.name!r} but " if "name" in given else ""
        raise InputError(
            f"[model] {named}gives no {', '.join(missing)}",
            where=where,
            fix='list them in [model], read them from the model\'s config.json (config = "config.json", '
            f'relative to the spec), or take the missing ones from a preset (preset = "{DEFAULT_PRESET}")',
        )
    sources = {f: "spec" if f in given else "default" for f in REQUIRED + ELEMENT_SIZES}
    if "name" not in given:  # Model's default name is the default preset's, which this model is not
        model = msgspec.structs.replace(model, name=spec_name or "unnamed")
    return model, {**sources, **{f: "spec" for f in MOE if f in given}}


def model_used(spec: Spec, sources: dict[str, DimensionSource], config_keys: dict[str, str]) -> ModelUsed:
    """The plan's record of the model the prediction used: every dimension of
    ``spec.model`` with its source (and the config key of those from a config.json),
    and each phase's own dimensions."""
    m = spec.model
    dims = {f: getattr(m, f) for f in REQUIRED + ELEMENT_SIZES + MOE if getattr(m, f) is not msgspec.UNSET}
    phases: dict[str, dict[str, int]] = {}
    for p in spec.phases:
        own = {} if p.layers is None else {"layers": p.layers}  # a draft's one layer
        if p.model is not msgspec.UNSET:
            own.update({f: v for f, v in msgspec.structs.asdict(p.model).items() if v is not msgspec.UNSET})
        if own:
            phases[p.name] = own
    # the embedded specs' model is the preset itself (its name is the preset's)
    named = m.preset if isinstance(m.preset, str) else m.name
    preset = named if "preset" in sources.values() else ""
    keys = {f: k for f, k in config_keys.items() if f in dims and sources.get(f) == "config"}
    return ModelUsed(
        name=m.name,
        dimensions=dims,
        sources={f: sources[f] for f in dims},
        preset=preset,
        config_keys=keys,
        phases=phases,
    )


def dimensions_text(used: ModelUsed, config: str | None = None) -> list[str]:
    """``model NAME: layers 32, hidden 4096, ... (spec); dtype_bytes 2 (default)``: the
    dimensions grouped by source in their fixed order, then each phase's own."""
    groups: list[tuple[str, list[str]]] = []
    for f in [f for f in REQUIRED + ELEMENT_SIZES + MOE if f in used.dimensions]:
        v = used.dimensions[f]
        src = used.sources.get(f, "spec")
        label = {"preset": f"preset {used.preset}", "config": f"config {config}" if config else "config"}.get(src, src)
        if groups and groups[-1][0] == label:
            groups[-1][1].append(f"{f} {v}")
        else:
            groups.append((label, [f"{f} {v}"]))
    out = [f"model {used.name}: " + "; ".join(f"{', '.join(parts)} ({label})" for label, parts in groups)]
    order = REQUIRED + ELEMENT_SIZES + MOE
    out += [
        f"phase {name}: "
        + ", ".join(f"{f} {dims[f]}" for f in order if f in dims)
        + " (its own; the others the model's)"
        for name, dims in sorted(used.phases.items())
    ]
    return out
