"""Reading and checking a spec: the rules over several fields its types cannot say.

The bounds of single fields (sizes 1..``MAX_BS``, at most ``MAX_PHASES`` phases,
each model dimension within ``MODEL_MAX``) are msgspec constraints on the spec
types (``capture_plan.schemas.spec``), located and worded by
:func:`capture_plan.schemas.conversion.convert`, and published by ``planner schema
spec``. What is checked here: the version, unique phase names, sizes and rule
ids, ``MAX_CAPTURES`` over all phases, known ``after`` targets, micro-batch twins
(``twin_of``: :func:`_check_twins`), phase kinds and
the settings each accepts, heads a multiple of kv_heads, a phase's own model
setting at least one dimension, and graph keys: the variant axes each kind may
have, labels unique per axis, ``MAX_KEYS_PER_PHASE`` keys (sizes x labels of every
axis) per phase and ``MAX_CAPTURES`` keys over all phases. Only the planner reads specs; the executor reads
plans (``capture_plan.schemas.codec``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TypeVar

import msgspec

from capture_plan.schemas.conversion import convert, short_int
from capture_plan.schemas.documents import read_document
from capture_plan.schemas.errors import InputError
from capture_plan.schemas.limits import MAX_CAPTURES, MAX_KEYS_PER_PHASE
from capture_plan.schemas.plan import DimensionSource
from capture_plan.schemas.spec import SPEC_VERSION, Model, Phase, Spec, phase_model
from capture_plan.schemas.strategy import PHASE_SETTINGS

from . import resources
from .dimensions import resolve_model

__all__ = ["decode_spec_sources", "validate_spec"]

#: a phase setting left at this value is unset (no kind needs to accept it): Phase's
#: defaults, read from the class as msgspec.structs.fields reads them (not through fields(),
#: which resolves every annotation of Phase at import), in PHASE_SETTINGS' order
#: (schemas/strategy.py), not the fields' order: the first setting a kind refuses is the one
#: reported, whichever base class (schemas/key_fields.py's KeyFields) declares it
_DEFAULTS = dict(
    zip(
        Phase.__struct_fields__[len(Phase.__struct_fields__) - len(Phase.__struct_defaults__) :],
        Phase.__struct_defaults__,
    )
)
_UNSET_SETTING = {name: _DEFAULTS[name] for name in PHASE_SETTINGS}


def decode_spec_sources(
    data: bytes, source: str, *, presets: Mapping[str, Model]
) -> tuple[Spec, dict[str, DimensionSource]]:
    """Parse a TOML (by ``.toml`` suffix) or JSON spec, every error located, and where each
    model dimension comes from: its ``[model]`` is completed from its preset; a ``[model]``
    that leaves dimensions out must name a config or one of ``presets`` (the model
    presets: ``capture_plan.planner.inputs.specs.model_presets()``) for them
    (:func:`capture_plan.planner.inputs.dimensions.resolve_model`)."""
    doc = read_document(data, source, "spec")
    spec = convert(doc, Spec, source, kind="spec")
    table = doc.get("model") if isinstance(doc, dict) else None
    named = doc.get("name") if isinstance(doc, dict) else None  # the spec's own name, where it gives one
    model, sources = resolve_model(table, spec.model, source, presets, named if isinstance(named, str) else None)
    spec = msgspec.structs.replace(spec, model=model)
    return _check_rules(spec, source), sources


def validate_spec(spec: Spec, source: str) -> Spec:
    """Check a spec built in code (the embedded ones): the bounds of its types, as
    a decoded spec's are (a struct built in code is not checked by msgspec), then
    the rules of :func:`decode_spec_sources`."""
    convert(msgspec.to_builtins(spec), Spec, source, kind="spec")
    return _check_rules(spec, source)


def _check_rules(spec: Spec, source: str) -> Spec:
    """The rules over several fields (module docstring), each located by JSON path. The
    kinds are planner/data/phase_kinds.toml's (:mod:`.resources`): the settings
    (:data:`capture_plan.schemas.strategy.PHASE_SETTINGS`) each accepts, a setting a phase's
    kind does not accept refused rather than silently ignored, and the variant axes each may
    declare (its ``axes``; a kind that lists none may declare none)."""
    phase_kinds, phase_axes = resources.phase_kind_settings(), resources.phase_kind_axes()
    if spec.version != SPEC_VERSION:
        newer = spec.version > SPEC_VERSION
        raise InputError(
            f"spec version {spec.version} is {'newer than' if newer else 'not'} the supported version {SPEC_VERSION}",
            where=f"{source}: $.version",
            fix="upgrade capture-plan" if newer else f"write version = {SPEC_VERSION} or leave it out",
        )
    captures = 0
    names: dict[str, int] = {}
    for i, phase in enumerate(spec.phases):
        _note_first(
            names,
            phase.name,
            i,
            "phase name",
            f"{source}: $.phases[{i}].name",
            "give every phase a unique name",
            "$.phases",
        )
        resources.check_phase_kind(phase.kind, f"{source}: $.phases[{i}].kind")
        keys = _check_variants(phase, source, f"$.phases[{i}]", phase_axes)
        captures += keys
        if captures > MAX_CAPTURES:
            what = "capture sizes" if phase.variants is msgspec.UNSET else "graph keys"
            raise InputError(
                f"over {MAX_CAPTURES} {what} in all phases together",
                where=f"{source}: $.phases[{i}].sizes",
                fix="capture fewer sizes (pad to the next one)",
            )
        # e.g. draft steps and top-k shape only the draft phases' graphs: elsewhere they would be ignored
        for field, unset in _UNSET_SETTING.items():
            value = getattr(phase, field)
            if value != unset and field not in phase_kinds[phase.kind]:
                kinds = sorted(k for k, accepted in phase_kinds.items() if field in accepted)
                what = f"{field} = {short_int(value)}" if isinstance(value, int) else field
                raise InputError(
                    f"{what} has no meaning for a {phase.kind} phase",
                    where=f"{source}: $.phases[{i}].{field}",
                    fix=f"set {field} on {' or '.join(kinds)} phases only" if kinds else f"leave {field} out",
                )
        if phase.model is not msgspec.UNSET:
            _check_phase_model(spec.model, phase, f"{source}: $.phases[{i}].model")
        seen: dict[int, int] = {}
        for j, bs in enumerate(phase.sizes):
            _note_first(
                seen,
                bs,
                j,
                "capture size",
                f"{source}: $.phases[{i}].sizes[{j}]",
                "list each size once",
                f"$.phases[{i}].sizes",
            )
    for i, phase in enumerate(spec.phases):
        for j, dep in enumerate(phase.after):
            _check_phase_ref(
                dep,
                phase.name,
                names,
                f"{source}: $.phases[{i}].after[{j}]",
                "name a phase of this spec in after, or drop the name",
                ("a phase cannot come after itself", "drop the phase's own name from its after list"),
            )
    _check_twins(spec, source, names)
    rule_ids: dict[str, int] = {}
    for i, rule in enumerate(spec.rules):
        _note_first(rule_ids, rule.id, i, "rule id", f"{source}: $.rules[{i}].id", "give each rule an id of its own")
        for j, kind in enumerate(rule.when.phase_kind or ()):
            resources.check_phase_kind(kind, f"{source}: $.rules[{i}].when.phase_kind[{j}]")
    if spec.model.heads % spec.model.kv_heads:
        raise InputError(
            "heads must be a multiple of kv_heads",
            where=f"{source}: $.model.kv_heads",
            fix="give kv_heads a divisor of heads (grouped-query attention shares each KV head among heads / kv_heads)",
        )
    if spec.trace is not None and "\x00" in spec.trace:
        raise InputError("trace path contains a NUL byte", where=f"{source}: $.trace", fix="check the path")
    return spec


_K = TypeVar("_K")


def _note_first(
    seen: dict[_K, int], value: _K, index: int, what: str, where: str, fix: str, first: str | None = None
) -> None:
    """Note in ``seen`` that ``value`` first stands at ``index``. A value noted already is
    a repeat: an InputError ``duplicate {what} {value!r}`` at ``where``, which names the
    first place (``{first}[k]``, a path of the spec) where ``first`` is given. Called per
    item, so a repeat is found in the order the other checks of each item run."""
    if value in seen:
        also = f" (also {first}[{seen[value]}])" if first is not None else ""
        raise InputError(f"duplicate {what} {value!r}{also}", where=where, fix=fix)
    seen[value] = index


def _check_phase_ref(
    ref: str, phase: str, names: Collection[str], where: str, fix: str, itself: tuple[str, str]
) -> None:
    """A phase's reference to a phase of the spec (``after``, ``twin_of``), located at
    ``where``: a name no phase has is an InputError (``fix`` says what to name), and so
    is the phase's own name (``itself``: that error's message and fix)."""
    if ref not in names:
        raise InputError(f"unknown phase {ref!r}; phases are {sorted(names)}", where=where, fix=fix)
    if ref == phase:
        raise InputError(itself[0], where=where, fix=itself[1])


def _check_twins(spec: Spec, source: str, names: Mapping[str, int]) -> None:
    """Micro-batch twins (``twin_of``): each names another phase that is no twin
    itself and has no other twin, runs as many tokens per request and has the same
    variant axes, and captures some of its sizes; a twin is placed by that phase,
    so it has no ``after`` of its own (another phase's ``after`` may name it)."""
    twinned: dict[str, int] = {}
    for i, phase in enumerate(spec.phases):
        if phase.twin_of is msgspec.UNSET:
            continue
        where = f"{source}: $.phases[{i}]"
        parent_name = phase.twin_of
        _check_phase_ref(
            parent_name,
            phase.name,
            names,
            f"{where}.twin_of",
            "name the phase whose graphs this one is the micro-batch twin of",
            ("a phase cannot be its own twin", "leave twin_of out"),
        )
        parent = spec.phases[names[parent_name]]
        if parent.twin_of is not msgspec.UNSET:
            raise InputError(
                f"phase {parent_name!r} is itself a twin (of {parent.twin_of!r})",
                where=f"{where}.twin_of",
                fix=f"name {parent.twin_of!r}, the phase whose graphs are not twins",
            )
        if parent_name in twinned:
            raise InputError(
                f"phase {parent_name!r} already has a twin ($.phases[{twinned[parent_name]}])",
                where=f"{where}.twin_of",
                fix="give each phase one micro-batch twin at most",
            )
        twinned[parent_name] = i
        if phase.after:
            raise InputError(
                f"a twin is captured with phase {parent_name!r}, so it has no `after` of its own",
                where=f"{where}.after",
                fix=f"leave after out (put it on {parent_name!r})",
            )
        if phase.tokens_per_request != parent.tokens_per_request:
            raise InputError(
                f"tokens_per_request = {phase.tokens_per_request} differs from its phase's "
                f"({parent.tokens_per_request}): a twin runs the same batches",
                where=f"{where}.tokens_per_request",
                fix=f"set tokens_per_request = {parent.tokens_per_request}",
            )
        if phase.variants != parent.variants:
            raise InputError(
                f"variants differ from phase {parent_name!r}'s: a twin has a graph per key of its phase",
                where=f"{where}.variants",
                fix=f"give it the variants of {parent_name!r}",
            )
        theirs = set(parent.sizes)
        for j, bs in enumerate(phase.sizes):
            if bs not in theirs:
                raise InputError(
                    f"size {bs} is not one of phase {parent_name!r}'s: a twin's graph is the twin of one of its graphs",
                    where=f"{where}.sizes[{j}]",
                    fix=f"capture only sizes that {parent_name!r} captures",
                )


def _check_variants(phase: Phase, source: str, path: str, phase_axes: Mapping[str, Collection[str]]) -> int:
    """A phase's variant axes (the phase at ``path`` of ``source``): each one its kind may
    have, labels unique, at most ``MAX_KEYS_PER_PHASE`` keys; returns the phase's number of
    graph keys. Call after the kind is checked."""
    where = f"{source}: {path}"
    if phase.variants is msgspec.UNSET:
        return len(phase.sizes)
    allowed = phase_axes.get(phase.kind, ())
    keys = len(phase.sizes)
    for axis, labels in phase.variants.items():
        if axis not in allowed:
            kinds = sorted(k for k, axes in phase_axes.items() if axis in axes)
            have = f"its axes are {', '.join(sorted(allowed))}" if allowed else "it has none"
            raise InputError(
                f"a {phase.kind} phase cannot have the variant axis {axis!r} ({have})",
                where=f"{where}.variants.{axis}",
                fix=f"declare {axis} on {' or '.join(kinds)} phases only" if kinds else f"leave {axis} out",
            )
        seen: dict[str, int] = {}
        for j, label in enumerate(labels):
            _note_first(
                seen,
                label,
                j,
                "label",
                f"{where}.variants.{axis}[{j}]",
                "list each label once",
                f"{path}.variants.{axis}",
            )
        keys *= len(labels)
    if keys > MAX_KEYS_PER_PHASE:
        shape = " x ".join([f"{len(phase.sizes)} sizes", *(f"{len(v)} {a}" for a, v in phase.variants.items())])
        raise InputError(
            f"{short_int(keys)} graph keys ({shape}), over the limit of {MAX_KEYS_PER_PHASE} per phase",
            where=f"{where}.variants",
            fix="capture fewer sizes or fewer labels",
        )
    return keys


def _check_phase_model(model: Model, phase: Phase, where: str) -> None:
    """A phase's own dimensions: at least one, and heads a multiple of kv_heads
    once merged with the spec's ``[model]`` (each within its bound: the types)."""
    # called only for a phase that has a model (not UNSET)
    own = {f: v for f, v in msgspec.structs.asdict(phase.model).items() if v is not msgspec.UNSET}  # pyright: ignore[reportArgumentType]
    if not own:
        raise InputError(
            "model sets no dimension",
            where=where,
            fix="give the dimensions this phase's model differs in (e.g. hidden, vocab), or leave it out",
        )
    merged = phase_model(model, phase)
    if merged.heads % merged.kv_heads:
        field = "kv_heads" if "kv_heads" in own else "heads"
        raise InputError(
            f"heads = {merged.heads} must be a multiple of kv_heads = {merged.kv_heads} (the phase's "
            "own, else [model]'s)",
            where=f"{where}.{field}",
            fix="give the draft's heads and kv_heads",
        )
