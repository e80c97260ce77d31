"""The planner's data files (rules, backends, phase kinds, presets), loaded once.

Data lives in ``planner/data/*.toml`` so that a reviewer changes a rule by
editing data, not an if-chain. Their bytes feed ``rules_digest`` in every plan:
changing a rule makes every checked-in plan stale, which CI then reports.

Backends are strict typed data (:class:`Backend`): a key the struct does not
know is an error naming the file and key. Adding a backend is one
``[backends.NAME]`` table in ``backends.toml``; the CLI's choices and help
are read from it. What this does not do: a backend whose attention allocates
in a way the fields below cannot express needs code in planner/memory/analytic.py.

Phase kinds are strict typed data too (:class:`PhaseKind`, one
``[kinds.NAME]`` table in ``phase_kinds.toml``): the analytic program a kind
uses (a builder named in planner/memory/analytic.py's ``PROGRAMS``), whether its
graph returns the hidden state, and which phase settings it accepts. A kind
that allocates like an existing one is added by data alone; one that
allocates differently needs a new program builder (code).
"""

# No `from __future__ import annotations` here: msgspec reads a struct's annotations
# when it first converts to it, and an annotation kept as a string costs a compile()
# and an eval() there, for the data files' types (a build converts backends.toml and phase_kinds.toml);
# evaluated with the class, they cost no more than that eval.

import functools
from pathlib import Path
from typing import Any, Literal, TypeVar

import msgspec

from capture_plan.schemas.errors import InputError
from capture_plan.schemas.hashing import sha256_hex
from capture_plan.schemas.strategy import PhaseSetting

__all__ = [
    "data_bytes",
    "data",
    "typed",
    "parsed_at_install",
    "PARSED_SUFFIX",
    "builtin_rules",
    "baseline",
    "backends",
    "backend",
    "backend_names",
    "rules_digest",
    "Backend",
    "BackendsFile",
    "Workspace",
    "PhaseKind",
    "PhaseKindsFile",
    "phase_kinds",
    "phase_kind_names",
    "phase_kind_settings",
    "phase_kind_axes",
    "variant_axes",
    "VariantAxisKind",
]

# phase_kinds.toml is not in the digest: a kind's table changes a plan only
# through what it predicts (program, returns_hidden), which `planner check`
# sees as a stale plan by its bytes, and a new kind changes no existing plan.
# Adding it would change every plan's digest and orphan the GPU reports in
# bench/results/ that name the plan they measured.
# presets_vllm.toml (--preset vllm) is not in it either: a preset reaches a plan
# only through the embedded spec it builds, whose digest the plan records.
_FILES = ("rules.toml", "backends.toml", "presets.toml")


_DATA = Path(__file__).resolve().parent.parent / "data"


def data_bytes(name: str) -> bytes:
    """The bytes of ``planner/data/NAME`` (next to this module: a plain file
    read, without importlib.resources and the zip support it imports)."""
    return (_DATA / name).read_bytes()


@functools.cache
def data(name: str) -> dict[str, Any]:
    """``planner/data/NAME`` as tomllib parses it: from the copy the package's build parsed
    (:func:`parsed_at_install`) where it is of these bytes, else parsed here."""
    raw = data_bytes(name)
    parsed = parsed_at_install(name, raw)
    if parsed is not None:
        return parsed
    from capture_plan.schemas.documents import toml_parser

    tomllib = toml_parser()
    try:
        return tomllib.loads(raw.decode())
    except tomllib.TOMLDecodeError as err:  # a broken package, not user input
        raise RuntimeError(f"planner/data/{name}: {err}") from None


_T = TypeVar("_T")


def typed(name: str, typ: type[_T]) -> _T:
    """``planner/data/NAME`` (:func:`data`) converted to ``typ``, strictly: a table that does
    not convert is a broken package, not user input (RuntimeError naming the file). What the
    struct cannot say (a rule across fields) is the caller's to check."""
    try:
        return msgspec.convert(data(name), typ)
    except msgspec.ValidationError as err:
        raise RuntimeError(f"planner/data/{name}: {err}") from None


#: the suffix of a data file's parsed copy: setup.py writes ``NAME.toml`` + this, beside it
PARSED_SUFFIX = ".parsed.json"


def parsed_at_install(name: str, raw: bytes) -> dict[str, Any] | None:
    """``NAME`` as the package's build parsed it, or None.

    A wheel (``pip install .``) holds, beside each data file, the document tomllib
    parsed from it at build time and the SHA-256 of the bytes it parsed (setup.py's
    ``parse_data``), as JSON: reading it costs a small part of importing tomllib and
    parsing, a visible share of the Quickstart build's instructions (``bench.build_bench``).
    The copy counts only where its
    digest is that of ``raw``, the file as it is now: an edited data file, an editable
    install or a source tree (which have none) are parsed from the TOML, so the data
    files stay the one source (tests/test_wheel.py checks a wheel's copies against
    tomllib)."""
    try:
        doc = msgspec.json.decode((_DATA / (name + PARSED_SUFFIX)).read_bytes())
    except (OSError, msgspec.DecodeError):
        return None
    if not isinstance(doc, dict) or doc.get("sha256") != sha256_hex(raw):
        return None
    parsed = doc.get("data")
    return parsed if isinstance(parsed, dict) else None


@functools.cache
def builtin_rules() -> tuple:
    """The rules of ``rules.toml`` as :class:`capture_plan.schemas.spec.Rule`."""
    from capture_plan.schemas.conversion import convert
    from capture_plan.schemas.spec import Rule

    rules = tuple(convert(data("rules.toml")["rules"], list[Rule], "planner/data/rules.toml"))
    for i, rule in enumerate(rules):  # the shared Rule type takes any kind name: these are the planner's
        for j, kind in enumerate(rule.when.phase_kind or ()):
            check_phase_kind(kind, f"planner/data/rules.toml: $.rules[{i}].when.phase_kind[{j}]")
    return rules


@functools.cache
def baseline():
    """The engines' hard-coded schedule (a :class:`capture_plan.schemas.spec.Choice`), the yardstick
    every plan reports against."""
    from capture_plan.schemas.conversion import convert
    from capture_plan.schemas.spec import Choice

    raw = {k: v for k, v in data("rules.toml")["baseline"].items() if k != "why"}
    return convert(raw, Choice, "planner/data/rules.toml: $.baseline")


class Workspace(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A per-call workspace the backend allocates in the pool unless hoisted:
    ``elem_bytes * (per_request * round_up(batch, round_batch_to) + fixed)`` bytes."""

    name: str
    elem_bytes: int
    per_request: int
    fixed: int
    round_batch_to: int


class Backend(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One ``[backends.NAME]`` table of ``planner/data/backends.toml``."""

    description: str
    #: importable modules providing the kernels (any one suffices; the executor checks)
    modules: list[str]
    min_compute_capability: list[int]
    workspace: Workspace | None = None
    #: the kernel allocates a float32 log-sum-exp per token and head
    lse: bool = False
    #: bytes per (token, head, head-dim element) of temporaries allocated and freed inside each call
    attention_temp_factor: float = 0.0


class BackendsFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``planner/data/backends.toml`` as a whole (its JSON Schema: ``planner schema backends``)."""

    backends: dict[str, Backend]


@functools.cache
def backends() -> dict[str, Backend]:
    from capture_plan.schemas.conversion import convert

    return {
        name: convert(table, Backend, f"planner/data/backends.toml: $.backends.{name}")
        for name, table in data("backends.toml")["backends"].items()
    }


def backend_names() -> list[str]:
    """The backends' names, sorted, without converting the tables (for the CLI's help)."""
    return sorted(data("backends.toml")["backends"])


class PhaseKind(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One ``[kinds.NAME]`` table of ``planner/data/phase_kinds.toml``."""

    #: one line for help texts and the JSON Schema
    description: str
    #: the analytic program builder (a key of planner/memory/analytic.py's ``PROGRAMS``)
    program: str
    #: which of :data:`capture_plan.schemas.strategy.PHASE_SETTINGS` shape this kind's graph (others
    #: are refused in a spec)
    settings: list[PhaseSetting]
    #: the graph also returns the last layer's hidden state (a draft reads it)
    returns_hidden: bool = False
    #: the variant axes (``[axes.NAME]``) a phase of this kind may declare
    axes: list[str] = []
    #: the graph computes the logits (final norm and lm_head inside it)
    lm_head: bool = False
    #: the rows one request puts through the graph's GEMMs: its tokens, or a draft step's candidates
    rows_per_request: Literal["tokens_per_request", "topk"] = "tokens_per_request"
    #: the graph is pieces between eagerly run attention ops (vLLM's PIECEWISE); recorded in the plan
    piecewise: bool = False
    #: the draft model's graph: "extend" (over the accepted tokens) or "steps" (its tree steps)
    draft: Literal["", "extend", "steps"] = ""
    #: what a capture size counts: requests (SGLang) or tokens (vLLM's descriptors)
    sizes: Literal["requests", "tokens"] = "requests"


class VariantAxisKind(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One ``[axes.NAME]`` table of ``planner/data/phase_kinds.toml``: a variant axis."""

    #: one line for help texts
    description: str
    #: labels whose graph the reference step models exactly (others: approximate)
    reference: list[str] = []


class PhaseKindsFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``planner/data/phase_kinds.toml`` as a whole (its JSON Schema: ``planner schema phase-kinds``)."""

    kinds: dict[str, PhaseKind]
    axes: dict[str, VariantAxisKind] = {}


@functools.cache
def phase_kinds() -> dict[str, PhaseKind]:
    """The phase kinds of ``phase_kinds.toml``, in file order. A key the
    struct does not know is an :class:`InputError` naming file and key."""
    from capture_plan.schemas.conversion import convert

    return {
        name: convert(table, PhaseKind, f"planner/data/phase_kinds.toml: $.kinds.{name}")
        for name, table in data("phase_kinds.toml")["kinds"].items()
    }


@functools.cache
def variant_axes() -> dict[str, VariantAxisKind]:
    """The variant axes of ``phase_kinds.toml`` (``[axes.NAME]``), in file order; a kind
    naming an axis with no table is an :class:`InputError` naming file and key."""
    from capture_plan.schemas.conversion import convert

    raw = data("phase_kinds.toml").get("axes", {})
    axes = {
        name: convert(t, VariantAxisKind, f"planner/data/phase_kinds.toml: $.axes.{name}") for name, t in raw.items()
    }
    for name, kind in phase_kinds().items():
        for j, axis in enumerate(kind.axes):
            if axis not in axes:
                raise InputError(
                    f"axis {axis!r} has no [axes.{axis}] table",
                    where=f"planner/data/phase_kinds.toml: $.kinds.{name}.axes[{j}]",
                    fix="add the table or remove the axis",
                )
    return axes


def phase_kind_axes() -> dict[str, frozenset[str]]:
    """Each kind's variant axes (what :mod:`capture_plan.planner.inputs.validate` checks a spec against)."""
    variant_axes()  # every axis a kind names has its table
    return {name: frozenset(k.axes) for name, k in phase_kinds().items()}


def phase_kind_names() -> list[str]:
    """The phase kinds' names, sorted (for help texts and the JSON Schema)."""
    return sorted(phase_kinds())


def phase_kind_settings() -> dict[str, frozenset[str]]:
    """Each kind's accepted settings (what :mod:`capture_plan.planner.inputs.validate` checks a spec against)."""
    return {name: frozenset(k.settings) for name, k in phase_kinds().items()}


def check_phase_kind(kind: str, where: str) -> None:
    """Refuse a phase kind that is not one of :func:`phase_kinds`, located at ``where``."""
    kinds = phase_kinds()
    if kind not in kinds:
        raise InputError(f"unknown phase kind {kind!r}", where=where, fix=f"use one of {', '.join(sorted(kinds))}")


def backend(name: str) -> Backend:
    table = backends()
    if name not in table:
        raise InputError(f"unknown backend {name!r}", where="--backend", fix=f"use one of {', '.join(sorted(table))}")
    return table[name]


@functools.cache
def rules_digest() -> str:
    from capture_plan.schemas.codec import sha256

    return sha256(b"".join(data_bytes(f) for f in _FILES))
