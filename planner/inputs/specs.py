"""Where a spec comes from: the embedded default (presets.toml, SGLang's
conventions; presets_vllm.toml with ``--preset vllm``) or a file."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Literal

import msgspec

from capture_plan.schemas.build_flags import out_of_bounds
from capture_plan.schemas.conversion import convert
from capture_plan.schemas.errors import InputError
from capture_plan.schemas.files import read_input
from capture_plan.schemas.spec import Choice, Model, Name, Phase, Pieces, Positive, Rule, Spec, WarmupKeeps
from capture_plan.schemas.strategy import PhaseKind

from .resources import data
from .validate import validate_spec

__all__ = [
    "sgl_sizes",
    "default_spec",
    "read_spec_file",
    "speculative_names",
    "speculative_kinds",
    "preset_names",
    "model_presets",
    "engine_preset",
    "preset_max_bs",
    "EnginePreset",
    "CaptureFacts",
    "mode_ranks",
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
    #: a piecewise phase's piece graphs per capture (the spec's ``pieces``; "attention": layers + 1)
    pieces: Pieces | msgspec.UnsetType = msgspec.UNSET
    #: what the phase's warm-up keeps (the spec's ``warmup_keeps``)
    warmup_keeps: WarmupKeeps | msgspec.UnsetType = msgspec.UNSET


class CaptureFacts(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How an engine release orders its capture (a preset's ``[capture]`` table),
    each fact read from the engine's source: ``sources`` names the file and
    function of every field (a fact without one is refused)."""

    #: the engine release the facts were read from
    release: str
    #: phase kinds in the order the engine captures them (its modes)
    mode_order: list[PhaseKind]
    #: where a micro-batch twin is captured: ``after-its-graph``, right after the
    #: graph of the same size it is the twin of (a spec's ``twin_of``)
    micro_batch_twin: Literal["after-its-graph"]
    #: eager warm-up runs before each graph's capture
    warmups_per_graph: Positive
    #: whether the engine's default configuration captures micro-batch twins
    default_micro_batch_twins: bool
    #: the fewest tokens a graph has a twin at, when twins are on
    twin_min_tokens: Positive
    #: fact name -> "file: function" it comes from
    sources: dict[str, str]

    def __post_init__(self) -> None:
        from .releases import check_sources  # only --preset vllm reads these facts: not at import

        check_sources(self, "[capture.sources]")


class EnginePreset(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An engine's conventions (planner/data/presets_NAME.toml), strict."""

    #: the engine's name for the graph mode these phases make up
    mode: str
    #: ``--max-bs`` when none is given
    max_bs: Positive
    #: the scheduler's maximum requests per batch
    max_num_seqs: Positive
    sizes: SizeList
    #: the engine's capture order (:class:`CaptureFacts`)
    capture: CaptureFacts
    phases: list[PresetPhase]
    #: release -> what it does differently (a ``releases.ReleaseFacts``): every release file of the
    #: preset's engine that has facts (planner/inputs/releases.py), filled in by :func:`engine_preset`
    releases: dict[str, Any] = {}


@functools.cache
def model_presets() -> dict[str, Model]:
    """The ``[model] preset`` names and their models: the embedded default model
    (presets.toml's ``[model]``; ``capture_plan.planner.inputs.dimensions``)."""
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
    from .releases import releases  # not at import: the Quickstart build reads no release

    file = _PRESET_FILES[name]
    preset = convert(data(file), EnginePreset, f"planner/data/{file}")
    facts = {r.version: r.facts for r in releases() if r.engine == name and r.facts is not None}
    if not facts:
        return preset
    # the planner models the buffer a warm-up keeps as the first warm-up's (warmup_keeps): the
    # release [capture] was read from must say so (its persistent_buffer fact, one owner)
    read_from = facts.get(preset.capture.release)
    if read_from is None or read_from.persistent_buffer != "first-warmup":
        said = "no facts" if read_from is None else f"persistent_buffer = {read_from.persistent_buffer!r}"
        raise RuntimeError(
            f"planner/data/{file}: capture.release {preset.capture.release}'s release file has {said}; "
            "the preset's phases model the first warm-up's buffer"
        )
    return msgspec.structs.replace(preset, releases=facts)


def mode_ranks(facts: CaptureFacts, kinds: list[str], where: str) -> list[int]:
    """Each phase kind's place in the engine's mode order (``facts.mode_order``); an
    InputError, located at ``where``'s phases, for a kind the order does not name or
    a list of phases out of that order."""
    ranks = []
    for i, kind in enumerate(kinds):
        if kind not in facts.mode_order:
            raise InputError(
                f"phase kind {kind!r} is not one of the engine's modes ({', '.join(facts.mode_order)})",
                where=f"{where}: $.phases[{i}].kind",
                fix="list the kinds of capture.mode_order only",
            )
        ranks.append(facts.mode_order.index(kind))
        if ranks[-1] < max(ranks):
            raise InputError(
                f"a {kind} phase after a {facts.mode_order[max(ranks)]} one: the engine captures "
                f"{' then '.join(facts.mode_order)}",
                where=f"{where}: $.phases[{i}]",
                fix="list the phases in capture.mode_order",
            )
    return ranks


def preset_max_bs(preset: str | None) -> int:
    """``--max-bs`` when none is given: 256 for SGLang's sizes, the preset's own otherwise."""
    return DEFAULT_MAX_BS if preset is None else engine_preset(preset).max_bs


def _check_max_bs(max_bs: int) -> None:
    bad = out_of_bounds("max_bs", max_bs)  # the option's row (schemas/build_flags.py)
    if bad is not None:
        raise InputError(bad, where="--max-bs", fix="give the largest batch size to capture")


def _expand(table: SizeList, max_bs: int) -> list[int]:
    sizes = set(table.explicit)
    for start, stop, step in table.ranges:
        sizes.update(range(start, max_bs + 1 if stop == "max" else stop, step))
    return sorted(s for s in sizes if s <= max_bs)


def speculative_names() -> list[str]:
    """The ``--speculative`` algorithms: the ``[speculative.NAME]`` tables of presets.toml."""
    return sorted(data("presets.toml")["speculative"])


def speculative_kinds() -> frozenset[str]:
    """The phase kinds of speculative decoding: those the ``--speculative`` algorithms' phases
    have (presets.toml: the target's verify graph, the draft's graphs)."""
    return frozenset(ph["kind"] for alg in data("presets.toml")["speculative"].values() for ph in alg["phases"])


def sgl_sizes(preset: str, max_bs: int) -> list[int]:
    """SGLang's default capture sizes up to ``max_bs``, as ``presets.toml`` lists them:
    ``[1,2,4,8,12] + range(16,257,8) + range(272,512,16) + range(512,max+1,32)``, and
    with speculative decoding ``range(1,9) + range(10,33,2) + range(40,65,4) +
    range(72,257,8) + range(272,max+1,16)``."""
    _check_max_bs(max_bs)
    where = f"planner/data/presets.toml: $.sizes.{preset}"
    return _expand(convert(data("presets.toml")["sizes"][preset], SizeList, where), max_bs)


def engine_rules(name: str) -> list[Rule]:
    """The rules an engine's capture facts impose on every phase of its preset
    (``--preset name``; a spec written for the engine repeats them): one eager
    warm-up before each graph (``warmups_per_graph``; a warm-up step of a plan
    runs once), so that the plan's warm-ups, and its capture time, are the engine's."""
    facts = engine_preset(name).capture
    if facts.warmups_per_graph != 1:
        raise InputError(
            f"capture.warmups_per_graph = {facts.warmups_per_graph}: a plan's warm-up step runs once",
            where=f"planner/data/{_PRESET_FILES[name]}",
            fix="model one warm-up per graph (warmups_per_graph = 1)",
        )
    source = " ".join(facts.sources["warmups_per_graph"].split())
    why = f"{name} {facts.release} runs one eager warm-up before each graph it captures ({source})"
    return [Rule(id=f"{name}-warmup-per-graph", why=why, require=[Choice(warmup="every-size")])]


def _preset_spec(name: str, max_bs: int | None, model: Model) -> Spec:
    """The embedded spec of ``--preset name``: the preset's phases in its capture
    order, each at the preset's sizes up to ``max_bs`` (uniform-decode phases
    only up to ``max_num_seqs`` requests)."""
    preset = engine_preset(name)
    max_bs = preset.max_bs if max_bs is None else max_bs
    _check_max_bs(max_bs)
    sizes = _expand(preset.sizes, max_bs)
    where = f"planner/data/{_PRESET_FILES[name]}"
    ranks = mode_ranks(preset.capture, [p.kind for p in preset.phases], where)
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
        # the engine captures its modes in a fixed order: each phase after the phases of
        # earlier modes, so that no choice of the planner's reorders them
        after = [q.name for q, r in zip(preset.phases, ranks) if r < ranks[i]]
        fields = {"name": p.name, "kind": p.kind, "sizes": [1], "tokens_per_request": p.tokens_per_request}
        fields.update({k: getattr(p, k) for k in ("pieces", "warmup_keeps") if getattr(p, k) is not msgspec.UNSET})
        phase = convert({**fields, "after": after}, Phase, f"{where}: $.phases[{i}]")
        phases.append(msgspec.structs.replace(phase, sizes=own))
    return validate_spec(
        Spec(name=f"default-{name}", model=model, phases=phases, rules=engine_rules(name)),
        f"embedded {name} spec (--max-bs {max_bs})",
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
    )


def read_spec_file(path: Path) -> bytes:
    """The spec file's bytes (decoded by :func:`capture_plan.planner.inputs.validate.decode_spec_sources`)."""
    return read_input(path, "spec", fix="check the path given to --spec")
