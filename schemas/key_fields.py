"""The graph-key fields: numbers of a phase that every one of its graph keys carries and
that an engine keys its graphs by, declared once in :class:`KeyFields`.

A key field is one annotated field of :class:`KeyFields`: its type and bound (the bound a
spec and a plan are checked against, and ``planner schema`` publishes), its ``#:`` doc,
and a :class:`KeyField` of what it means beyond its type (the plan revision it needs, the
value a phase without it has, how the planner predicts a graph that sets it, the words
that show it, and where each engine's value comes from). The spec's phase
(:class:`~capture_plan.schemas.spec.Phase`), the plan's
(:class:`~capture_plan.schemas.plan.PhasePlan`) and a graph key
(:class:`~capture_plan.schemas.keys.GraphKey`'s ``fields``) get the fields from here; the
code that copies, lists, answers or compares them iterates over :data:`KEY_FIELDS`
(docs/development.md, "A new graph-key field"). Each field is UNSET unless a spec gives
it, so specs and plans without it keep their bytes.

What is not here: which phase kinds accept a field (``settings`` in
planner/data/phase_kinds.toml, with the name in ``schemas/strategy.py``'s ``PhaseSetting``;
a field no kind lists is accepted on every kind), and what the field does to a graph's
allocations beyond marking its prediction approximate (a field the planner models needs
its own code in the memory model).
"""

# No `from __future__ import annotations` (as in spec.py): the annotations are evaluated
# once with the class, not compiled again from strings by msgspec and get_type_hints.

from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, get_args, get_origin, get_type_hints

import msgspec

from .limits import MAX_MICRO_BATCHES

__all__ = [
    "EngineSource",
    "KeyField",
    "KeyFields",
    "KEY_FIELDS",
    "key_fields",
    "set_key_fields",
    "key_value",
    "approximate_fields",
    "engine_fields",
    "shown",
]


class EngineSource(msgspec.Struct, frozen=True, kw_only=True):
    """Where one engine's value of a key field comes from: an attribute of the object
    that names one of its graphs (vLLM's ``BatchExecutionDescriptor``), read from the
    engine's released code. The engine's hook table lists the same attribute
    (tests/test_key_fields.py checks it)."""

    #: the engine's plugin name ("vllm")
    engine: str
    #: the engine's source file that defines it, as its wheel names it
    file: str
    #: ``Class.attribute``: the plugin reads ``attribute`` of the object it is handed
    attribute: str


class KeyField(msgspec.Struct, frozen=True, kw_only=True):
    """What a key field means beyond its type and bound (the metadata of its annotation
    in :class:`KeyFields`)."""

    #: the plan revision that introduced it: a plan that sets it is written as that
    #: revision at least, which an older planner's ``planner check`` refuses. An older
    #: executor still loads the plan and ignores the field (readers ignore unknown fields:
    #: schemas/plan.py): a field no executor may ignore needs a new ``PLAN_VERSION``
    revision: int
    #: the value a phase that leaves the field out has (and an engine's graph without it)
    unset_means: int = 1
    #: the value as a key shows it (``{}``: the value), e.g. in a plugin's refusal
    shown: str
    #: what a phase's graphs do at a value (``{}``: the value), in ``planner show``
    graphs: str
    #: how the planner predicts a graph whose value is not ``unset_means`` where the
    #: prediction is approximate (``planner show``'s words); "" where it is exact
    approximate: str = ""
    #: what of the field a prediction from a trace does not model (``planner show``)
    unmodelled: str = ""
    #: where each engine's value comes from (none: no engine keys by it yet)
    engines: tuple[EngineSource, ...] = ()


class KeyFields(msgspec.Struct, frozen=True, kw_only=True):
    """The graph-key fields, each ``Annotated[int, Meta(bounds), KeyField(...)] |
    UnsetType = UNSET`` with its ``#:`` doc: a new key field is one more such
    declaration here (and its tests). The base of the spec's phase and of the plan's, so
    its fields come first in theirs: plans and ``planner schema`` sort their keys, so no
    bytes change (a spec written back as TOML lists a phase's key fields first)."""

    #: micro-batches one graph runs (vLLM's num_ubatches); 1 when left out
    micro_batches: (
        Annotated[
            int,
            msgspec.Meta(ge=1, le=MAX_MICRO_BATCHES),
            KeyField(
                revision=3,
                shown="x{} micro-batches",
                graphs="run the batch as {} micro-batches",
                approximate="as the whole batch of its size: the reference runs the batch whole, not split",
                unmodelled="the split",
                engines=(
                    EngineSource(
                        engine="vllm",
                        file="vllm/v1/worker/gpu/cudagraph_utils.py",
                        attribute="BatchExecutionDescriptor.num_ubatches",
                    ),
                ),
            ),
        ]
        | msgspec.UnsetType
    ) = msgspec.UNSET


def _facts(cls: type[KeyFields]) -> Mapping[str, KeyField]:
    """Each field of ``cls`` -> the :class:`KeyField` of its annotation, in declared order.
    TypeError (at import) for a field declared without one."""
    out: dict[str, KeyField] = {}
    for name, hint in get_type_hints(cls, include_extras=True).items():
        metadata = [m for arg in get_args(hint) if get_origin(arg) is Annotated for m in arg.__metadata__]
        facts = [m for m in metadata if isinstance(m, KeyField)]
        if len(facts) != 1:
            raise TypeError(f"KeyFields.{name} needs one KeyField(...) in its Annotated[...] (it has {len(facts)})")
        out[name] = facts[0]
    return MappingProxyType(out)


#: every key field's name -> what it means, in declared order: what the generic code
#: iterates over
KEY_FIELDS: Mapping[str, KeyField] = _facts(KeyFields)


def set_key_fields(source: KeyFields) -> dict[str, int]:
    """The key fields ``source`` (a spec's or a plan's phase) sets, as it sets them: what
    the build copies from the spec's phase to the plan's."""
    return {n: v for n in KEY_FIELDS if (v := getattr(source, n)) is not msgspec.UNSET}


def key_fields(source: KeyFields) -> KeyFields:
    """``source``'s key fields alone, each UNSET where it is the value a phase without
    it has (``unset_means``), so that two keys compare equal however they spell it (a
    plan's ``micro_batches = 1`` and a phase without it)."""
    return KeyFields(**{n: v for n, v in set_key_fields(source).items() if v != KEY_FIELDS[n].unset_means})


def key_value(fields: KeyFields, name: str) -> int:
    """The value of key field ``name`` in ``fields`` (its ``unset_means`` where unset);
    KeyError for a name that is no key field."""
    facts = KEY_FIELDS[name]
    v = getattr(fields, name)
    return facts.unset_means if v is msgspec.UNSET else v


def approximate_fields(source: KeyFields) -> dict[str, int]:
    """The key fields that make ``source``'s graphs' prediction approximate (set to a value
    other than ``unset_means``, of a field whose facts say so), with their values."""
    return {n: v for n, v in set_key_fields(key_fields(source)).items() if KEY_FIELDS[n].approximate}


def engine_fields(engine: str, native: object) -> KeyFields:
    """The key fields of one of ``engine``'s graphs, read from ``native`` (the object that
    names the graph: vLLM's descriptor) by each field's :class:`EngineSource` for that
    engine; a field with none for it is its ``unset_means``."""
    values = {
        n: getattr(native, src.attribute.rpartition(".")[2])
        for n, facts in KEY_FIELDS.items()
        for src in facts.engines
        if src.engine == engine
    }
    return key_fields(KeyFields(**values))


def shown(fields: KeyFields) -> str:
    """``fields`` as a key shows them: each set one's ``shown``, after a space ("" when none)."""
    return "".join(f" {KEY_FIELDS[n].shown.format(v)}" for n, v in set_key_fields(key_fields(fields)).items())
