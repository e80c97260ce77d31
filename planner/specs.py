"""Where a spec comes from: the embedded default (presets.toml) or a file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from schemas.codec import convert, validate_spec
from schemas.errors import InputError
from schemas.files import read_input
from schemas.limits import MAX_BS
from schemas.spec import Model, Phase, Spec

from .resources import data, phase_kind_settings

__all__ = ["sgl_sizes", "default_spec", "read_spec_file", "speculative_names", "DEFAULT_MAX_BS"]

DEFAULT_MAX_BS = 256


def speculative_names() -> list[str]:
    """The ``--speculative`` algorithms: the ``[speculative.NAME]`` tables of presets.toml."""
    return sorted(data("presets.toml")["speculative"])


def sgl_sizes(preset: str, max_bs: int) -> list[int]:
    """SGLang's default capture sizes up to ``max_bs``, as ``presets.toml`` lists them:
    ``[1,2,4,8,12] + range(16,257,8) + range(272,512,16) + range(512,max+1,32)``, and
    with speculative decoding ``range(1,9) + range(10,33,2) + range(40,65,4) +
    range(72,257,8) + range(272,max+1,16)``."""
    if not 1 <= max_bs <= MAX_BS:
        raise InputError(f"must be 1..{MAX_BS}, got {max_bs}", where="--max-bs",
                         fix="give the largest batch size to capture")
    table = data("presets.toml")["sizes"][preset]
    sizes = set(table.get("explicit", []))
    for start, stop, step in table.get("ranges", []):
        stop = max_bs + 1 if stop == "max" else stop
        sizes.update(range(start, stop, step))
    return sorted(s for s in sizes if s <= max_bs)


def default_spec(speculative: str | None = None, max_bs: int = DEFAULT_MAX_BS) -> Spec:
    """The embedded spec: a Llama-3-8B-shaped decode step with SGLang's sizes.

    ``speculative="eagle"`` adds target_verify, draft_decode and draft_extend
    phases (EAGLE, 1-layer draft) and switches every phase to SGLang's
    speculative size list, as SGLang does when speculative decoding is on.
    """
    presets = data("presets.toml")
    model = convert(presets["model"], Model, "planner/data/presets.toml: $.model")
    if speculative is None:
        sizes = sgl_sizes("decode", max_bs)
        phases = [Phase(name="decode", kind="decode", sizes=sizes)]
        return validate_spec(Spec(name="default", model=model, phases=phases),
                             f"embedded default spec (--max-bs {max_bs})", phase_kinds=phase_kind_settings())
    if speculative not in speculative_names():
        raise InputError(f"unknown speculative algorithm {speculative!r}", where="--speculative",
                         fix=f"use one of {', '.join(speculative_names())}")
    sizes = sgl_sizes("speculative", max_bs)
    phases = [Phase(name="decode", kind="decode", sizes=sizes)]
    for extra in presets["speculative"][speculative]["phases"]:
        fields: dict[str, Any] = dict(extra)
        if fields["kind"].startswith("draft"):
            fields["layers"] = 1
        phases.append(convert({**fields, "sizes": sizes}, Phase, f"planner/data/presets.toml: $.speculative.{speculative}"))
    return validate_spec(Spec(name=f"default-{speculative}", model=model, phases=phases),
                         f"embedded default spec (--max-bs {max_bs})", phase_kinds=phase_kind_settings())


def read_spec_file(path: Path) -> bytes:
    """The spec file's bytes (decoded by :func:`schemas.codec.decode_spec`)."""
    return read_input(path, "spec", fix="check the path given to --spec")
