"""Where a spec comes from: the embedded default (presets.toml, SGLang's
conventions; presets_vllm.toml with ``--preset vllm``) or a file."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Literal

import msgspec

from capture_plan.schemas.codec import convert
from capture_plan.schemas.errors import InputError
from capture_plan.schemas.files import read_input
from capture_plan.schemas.limits import MAX_BS
from capture_plan.schemas.spec import Model, Name, Phase, Positive, Spec
from capture_plan.schemas.strategy import PhaseKind

from .resources import data, phase_kind_settings
from .validate import validate_spec

__all__ = [
    "sgl_sizes",
    "default_spec",
    "read_spec_file",
    "speculative_names",
    "preset_names",
    "model_presets",
    "engine_preset",
    "preset_max_bs",
    "EnginePreset",
    "DEFAULT_MAX_BS",
]

DEFAULT_MAX_BS = 256

#: ``--preset NAME``: the engine-convention file each name reads (the default, no
#: ``--preset``, is SGLang's presets.toml)
_PRESET_FILES = {"vllm": "presets_vllm.toml"}


class SizeList(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A union of explicit sizes and ``[start, stop, step]`` ranges (stop
    exclusive, as Python's range); a stop of ``"max"`` is ``--max-bs`` + 1."""

    explicit: list[int] = []
    ranges: list[tuple[int, int | Literal["max"], int]] = []


class PresetPhase(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One phase an engine preset captures, at every size of the preset's list
    unless ``uniform_decode`` (then only sizes of at most ``max_num_seqs *
    tokens_per_request`` tokens, as vLLM bounds its uniform-decode graphs)."""

    name: Name
    kind: PhaseKind
    tokens_per_request: Positive = 1
    uniform_decode: bool = False


class EnginePreset(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An engine's conventions (planner/data/presets_NAME.toml), strict."""

    #: the engine's name for the graph mode these phases make up
    mode: str
    #: ``--max-bs`` when none is given
    max_bs: Positive
    #: the scheduler's maximum requests per batch
    max_num_seqs: Positive
    sizes: SizeList
    phases: list[PresetPhase]


@functools.cache
def model_presets() -> dict[str, Model]:
    """The ``[model] preset`` names and their models: the embedded default model
    (presets.toml's ``[model]``; ``capture_plan.planner.dimensions``)."""
    model = convert(data("presets.toml")["model"], Model, "planner/data/presets.toml: $.model")
    return {model.name: model}


def preset_names() -> list[str]:
    """The ``--preset`` names (besides the default, SGLang's)."""
    return sorted(_PRESET_FILES)


def engine_preset(name: str) -> EnginePreset:
    """The ``--preset`` ``name``'s table, typed; an unknown name is a located error."""
    if name not in _PRESET_FILES:
        raise InputError(
            f"unknown preset {name!r}",
            where="--preset",
            fix=f"use one of {', '.join(preset_names())} (leave it out for SGLang's conventions)",
        )
    file = _PRESET_FILES[name]
    return convert(data(file), EnginePreset, f"planner/data/{file}")


def preset_max_bs(preset: str | None) -> int:
    """``--max-bs`` when none is given: 256 for SGLang's sizes, the preset's own otherwise."""
    return DEFAULT_MAX_BS if preset is None else engine_preset(preset).max_bs


def _check_max_bs(max_bs: int) -> None:
    if not 1 <= max_bs <= MAX_BS:
        raise InputError(
            f"must be 1..{MAX_BS}, got {max_bs}", where="--max-bs", fix="give the largest batch size to capture"
        )


def _expand(table: SizeList, max_bs: int) -> list[int]:
    sizes = set(table.explicit)
    for start, stop, step in table.ranges:
        sizes.update(range(start, max_bs + 1 if stop == "max" else stop, step))
    return sorted(s for s in sizes if s <= max_bs)


def speculative_names() -> list[str]:
    """The ``--speculative`` algorithms: the ``[speculative.NAME]`` tables of presets.toml."""
    return sorted(data("presets.toml")["speculative"])


def sgl_sizes(preset: str, max_bs: int) -> list[int]:
    """SGLang's default capture sizes up to ``max_bs``, as ``presets.toml`` lists them:
    ``[1,2,4,8,12] + range(16,257,8) + range(272,512,16) + range(512,max+1,32)``, and
    with speculative decoding ``range(1,9) + range(10,33,2) + range(40,65,4) +
    range(72,257,8) + range(272,max+1,16)``."""
    _check_max_bs(max_bs)
    where = f"planner/data/presets.toml: $.sizes.{preset}"
    return _expand(convert(data("presets.toml")["sizes"][preset], SizeList, where), max_bs)


def _preset_spec(name: str, max_bs: int | None, model: Model) -> Spec:
    """The embedded spec of ``--preset name``: the preset's phases in its capture
    order, each at the preset's sizes up to ``max_bs`` (uniform-decode phases
    only up to ``max_num_seqs`` requests)."""
    preset = engine_preset(name)
    max_bs = preset.max_bs if max_bs is None else max_bs
    _check_max_bs(max_bs)
    sizes = _expand(preset.sizes, max_bs)
    phases = []
    for i, p in enumerate(preset.phases):
        # a size counts tokens; a uniform-decode graph of n tokens serves n / tokens_per_request requests
        own = [
            t // p.tokens_per_request
            for t in sizes
            if t % p.tokens_per_request == 0
            and (not p.uniform_decode or t <= preset.max_num_seqs * p.tokens_per_request)
        ]
        # the preset's fields are checked here; its sizes (from --max-bs) by validate_spec, located there
        phase = convert(
            {"name": p.name, "kind": p.kind, "sizes": [1], "tokens_per_request": p.tokens_per_request},
            Phase,
            f"planner/data/{_PRESET_FILES[name]}: $.phases[{i}]",
        )
        phases.append(msgspec.structs.replace(phase, sizes=own))
    return validate_spec(
        Spec(name=f"default-{name}", model=model, phases=phases),
        f"embedded {name} spec (--max-bs {max_bs})",
        phase_kinds=phase_kind_settings(),
    )


def default_spec(speculative: str | None = None, max_bs: int | None = None, preset: str | None = None) -> Spec:
    """The embedded spec: a Llama-3-8B-shaped decode step with SGLang's sizes
    (``max_bs`` None: up to 256).

    ``speculative="eagle"`` adds target_verify, draft_decode and draft_extend
    phases (EAGLE, 1-layer draft) and switches every phase to SGLang's
    speculative size list, as SGLang does when speculative decoding is on.
    ``preset="vllm"``: vLLM's conventions instead (presets_vllm.toml: its
    sizes up to 512 tokens, a PIECEWISE and a FULL phase); not with
    ``speculative``.
    """
    presets = data("presets.toml")
    model = convert(presets["model"], Model, "planner/data/presets.toml: $.model")
    if preset is not None:
        if speculative is not None:
            raise InputError(
                f"--speculative shapes SGLang's embedded spec; --preset {preset} has no speculative phases",
                where="--speculative",
                fix="leave out one of them, or write the phases in a spec file (--spec)",
            )
        return _preset_spec(preset, max_bs, model)
    max_bs = DEFAULT_MAX_BS if max_bs is None else max_bs
    if speculative is None:
        sizes = sgl_sizes("decode", max_bs)
        phases = [Phase(name="decode", kind="decode", sizes=sizes)]
        return validate_spec(
            Spec(name="default", model=model, phases=phases),
            f"embedded default spec (--max-bs {max_bs})",
            phase_kinds=phase_kind_settings(),
        )
    if speculative not in speculative_names():
        raise InputError(
            f"unknown speculative algorithm {speculative!r}",
            where="--speculative",
            fix=f"use one of {', '.join(speculative_names())}",
        )
    sizes = sgl_sizes("speculative", max_bs)
    phases = [Phase(name="decode", kind="decode", sizes=sizes)]
    for extra in presets["speculative"][speculative]["phases"]:
        fields: dict[str, Any] = dict(extra)
        if fields["kind"].startswith("draft"):
            fields["layers"] = 1
        where = f"planner/data/presets.toml: $.speculative.{speculative}"
        phase = convert({**fields, "sizes": [1]}, Phase, where)  # the sizes: validate_spec's, as above
        phases.append(msgspec.structs.replace(phase, sizes=sizes))
    return validate_spec(
        Spec(name=f"default-{speculative}", model=model, phases=phases),
        f"embedded default spec (--max-bs {max_bs})",
        phase_kinds=phase_kind_settings(),
    )


def read_spec_file(path: Path) -> bytes:
    """The spec file's bytes (decoded by :func:`capture_plan.planner.validate.decode_spec`)."""
    return read_input(path, "spec", fix="check the path given to --spec")
