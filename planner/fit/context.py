"""The longest context an engine release takes for a model: vLLM's ``--max-model-len``
(vllm/config/model.py ``_get_and_verify_max_len``), SGLang's ``--context-length``
(sglang/srt/configs/model_config.py ``ModelConfig._derive_context_length``), each step as
the release's code does it, its facts the rows of planner/data/fit_rules.toml [context.NAME].

What a config.json says of its length is read once, with the model (:func:`read_config`,
planner/fit/model.py): the length keys it gives, its rope_scaling and rope_parameters, and its
original_max_position_embeddings. :func:`context_length` then gives the engine's value: the
flag as given, else the release's default; a value above the length the release derives is
refused (a :class:`.refusal.Refusal` whose change is the longest value it takes), unless the
environment variable the engine reads (``VLLM_ALLOW_LONG_MAX_MODEL_LEN``,
``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN``) allows it, read as the engine reads it: the
engine then warns and takes the value, and so does fit, saying so in its notes.

A preset or a spec's dimensions give no length (nor does a config that gives none of the
keys: transformers' class defaults are not known to fit): a value is taken as given, and a
missing one is refused.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from capture_plan.schemas.errors import InputError

from .refusal import Refusal
from .tables import ContextRule, context_rule, context_rules

if TYPE_CHECKING:
    from .model import FitModel

__all__ = [
    "ContextConfig",
    "Length",
    "NoContextLength",
    "read_config",
    "context_length",
    "derived",
    "rope_types",
    "rope_rows",
]

_ORIGINAL = "original_max_position_embeddings"
#: the rope types transformers 5 gives the config's original_max_position_embeddings
#: (modeling_rope_utils.py: standardize_rope_params)
_WITH_ORIGINAL = ("llama3", "yarn", "longrope")
#: rope parameters a row holds itself, never a layer type's row
_ROW_KEYS = ("rope_type", "type", "factor", "rope_theta")


class ContextConfig(msgspec.Struct, frozen=True):
    """What a config.json (its text config) says of the model's context length."""

    #: every length key of either engine's list the config gives, with its value
    lengths: dict[str, int]
    rope_scaling: dict[str, Any] | None
    rope_parameters: dict[str, Any] | None
    #: the config's own original_max_position_embeddings (not a rope row's)
    original: int | None
    #: the text config's model_type
    model_type: str
    source: str


class Length(NamedTuple):
    """The engine's context length: ``value`` (given or the default), the ``limit`` the
    release derives (None: not known) and how (``how``), and ``allowed_by``, the environment
    variable that let a longer value through ("" where none did)."""

    value: int
    limit: float | None
    how: str
    allowed_by: str

    @property
    def shown(self) -> str:
        """The limit as a message shows it (vLLM's may be fractional: a rope factor of 2.5)."""
        if self.limit is None:
            return "unknown"
        return f"{self.limit:,.0f}" if self.limit == int(self.limit) else f"{self.limit:,.2f}"


def _keys() -> list[str]:
    return sorted({k for r in context_rules().values() for k in r.keys})


def config_int(d: dict, key: str, where: str, path: str | None = None) -> int | None:
    """``d[key]`` of a model's config (``where``: the file): None where it is absent or null;
    refused at its JSON path (``path``; default ``$.KEY``) unless a non-negative integer."""
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise InputError(
            f"{key} must be a non-negative integer, got {v!r:.40}",
            where=f"{where}: {path or '$.' + key}",
            fix="use the model's own config.json",
        )
    return v


def read_config(text: dict, where: str, model_type: str) -> ContextConfig:
    """The length keys, rope rows and original_max_position_embeddings of a text config; a
    length that is not a non-negative integer, or a rope factor that is not a positive number
    (or null), is refused at its JSON path."""

    def integer(d: dict, key: str, path: str) -> int | None:
        return config_int(d, key, where, path)

    lengths = {k: v for k in _keys() if (v := integer(text, k, f"$.{k}")) is not None}
    ropes: dict[str, dict[str, Any] | None] = {}
    for key in ("rope_scaling", "rope_parameters"):
        rope = text.get(key)
        if rope is not None and not isinstance(rope, dict):
            raise InputError(
                f"{key} must be an object, got {rope!r:.40}",
                where=f"{where}: $.{key}",
                fix="use the model's own config.json",
            )
        ropes[key] = rope
        for path, row in _rows_of(rope or {}, f"$.{key}"):
            factor = row.get("factor")
            if factor is not None and (
                isinstance(factor, bool)
                or not isinstance(factor, (int, float))
                or not factor > 0
                or not math.isfinite(factor)
            ):
                raise InputError(
                    f"a rope factor must be a positive number, got {factor!r:.40}",
                    where=f"{where}: {path}.factor",
                    fix="use the model's own config.json",
                )
            integer(row, _ORIGINAL, f"{path}.{_ORIGINAL}")
            kind = row.get("rope_type", row.get("type"))
            if kind is not None and not isinstance(kind, str):
                raise InputError(
                    f"a rope type must be a string, got {kind!r:.40}",
                    where=f"{where}: {path}.rope_type",
                    fix="use the model's own config.json",
                )
    return ContextConfig(
        lengths=lengths,
        rope_scaling=ropes["rope_scaling"],
        rope_parameters=ropes["rope_parameters"],
        original=integer(text, _ORIGINAL, f"$.{_ORIGINAL}"),
        model_type=model_type,
        source=where,
    )


def _nested(rope: dict) -> bool:
    """Rope rows by layer type (``{"full_attention": {...}, "sliding_attention": {...}}``):
    every value an object or null, none of a row's own keys at the top."""
    return (
        bool(rope)
        and all(v is None or isinstance(v, dict) for v in rope.values())
        and not any(k in rope for k in _ROW_KEYS)
    )


def _rows_of(rope: dict, path: str) -> list[tuple[str, dict]]:
    if _nested(rope):
        return [(f"{path}.{k}", v) for k, v in rope.items() if isinstance(v, dict) and v]
    return [(path, rope)] if rope else []


def rope_types(c: ContextConfig | None) -> list[str]:
    """The rope type of each of the config's rope rows (its rope_parameters, else its
    rope_scaling; a row per layer type where nested), "default" where a row names none or the
    config gives no rope."""
    rope = (c.rope_parameters or c.rope_scaling or {}) if c is not None else {}
    rows = [row for _, row in _rows_of(rope, "$")]
    return [str(row.get("rope_type", row.get("type", "default"))) for row in rows] or ["default"]


def _rows(r: ContextRule, c: ContextConfig, version: str) -> tuple[list[dict], bool]:
    """The rope rows the release reads, as its transformers pin makes them (fit_rules.toml's
    [context] comment), each with its ``rope_type`` renamed as the release renames legacy
    names; and whether they were nested by layer type."""
    if version in r.transformers_4:  # patch_rope_parameters: rope_scaling, the config's original put in
        rope = dict(c.rope_scaling) if c.rope_scaling is not None else None
        if rope is not None and c.original is not None and not _nested(rope):
            rope[_ORIGINAL] = c.original
    else:  # convert_rope_params_to_dict: rope_scaling or rope_parameters
        rope = c.rope_scaling or c.rope_parameters
    nested = _nested(rope or {})
    rows = []
    for _, row in _rows_of(rope or {}, ""):
        row = dict(row)
        kind = str(row.get("rope_type", row.get("type", "default")))
        row["rope_type"] = r.legacy_rope_types.get(kind, kind)
        if version not in r.transformers_4 and row["rope_type"] in _WITH_ORIGINAL:  # standardize_rope_params
            if c.original is not None and not nested:
                row[_ORIGINAL] = c.original
            elif "max_position_embeddings" in c.lengths:
                row.setdefault(_ORIGINAL, c.lengths["max_position_embeddings"])
        rows.append(row)
    return rows, nested


def rope_rows(c: ContextConfig | None, engine: str, version: str) -> list[dict]:
    """The config's rope rows as ``engine==version`` reads them (:func:`_rows`: its transformers
    pin's rope_scaling or rope_parameters, each row's rope_type renamed as the release renames
    legacy names, original_max_position_embeddings put in); none where it gives no rope."""
    if c is None:
        return []
    return _rows(context_rule(engine, version)[1], c, version)[0]


def derived(model: FitModel, engine: str, version: str) -> tuple[float | None, int | None, str]:
    """(the length ``engine==version`` derives for ``model``, its default value, how); (None,
    None, why) where the model gives no length."""
    c = model.context
    if c is None:
        return None, None, f"{model.source}: no config.json"
    _, r = context_rule(engine, version)
    given = [k for k in r.keys if k in c.lengths]
    if not given:
        return None, None, f"{c.source}: none of {', '.join(r.keys)}"
    key = min(given, key=lambda k: c.lengths[k]) if r.pick == "smallest" else given[0]
    if r.override_key and c.lengths.get(r.override_key):
        key = r.override_key
    length: float = c.lengths[key]
    how = f"{key} {c.lengths[key]:,}"
    rows, nested = _rows(r, c, version)
    factor: float | None = 1.0
    if rows and not any(t in c.model_type for t in r.unscaled_model_types) and not (nested and r.nested_unscaled):
        for row in rows:
            if row["rope_type"] in r.unscaled_rope_types or (r.original_unscaled and _ORIGINAL in row):
                continue
            factor = row.get("factor", factor)
            if r.yarn_from_original and row["rope_type"] == "yarn":
                if _ORIGINAL not in row:  # vLLM 0.19.0 reads the key: a KeyError at start
                    raise InputError(
                        f"vllm {version} reads a yarn rope's original_max_position_embeddings, which the config lacks",
                        where=f"{c.source}: $.rope_scaling",
                        fix="use the model's own config.json",
                    )
                length = row[_ORIGINAL]
                how = f"the yarn rope's original_max_position_embeddings {length:,}"
        if factor is None and r.null_factor_fails:
            raise InputError(
                f"{engine} {version} multiplies the context length by the rope factor, and it is null",
                where=f"{c.source}: $.rope_scaling.factor",
                fix="use the model's own config.json",
            )
        factor = 1.0 if factor is None else factor
        if factor != 1.0:
            how += f" x rope factor {factor:g}"
    length = int(factor * length) if r.int_length else length * factor
    default = int(length)
    if r.longrope_default_original and c.original is not None and any(x["rope_type"] == "longrope" for x in rows):
        default = c.original
    return length, default, how


def _allowed(r: ContextRule, environ: Mapping[str, str]) -> str:
    """The first of the rule's environment variables set to true as the engine reads it."""
    for name in r.allow_env:
        value = environ.get(name)
        if value is not None and (value.strip() if r.env_strip else value).lower() in r.env_true:
            return name
    return ""


class NoContextLength(Refusal):
    """A model that gives no context length (no config.json, or none of the release's keys),
    and none given: the one refusal of it, which a build names in its own words
    (planner/schedule/kv.py)."""


def context_length(model: FitModel, engine: str, version: str, given: int | None) -> Length:
    """The context length ``engine==version`` runs ``model`` at: ``given`` (the flag), else
    the release's default. ``given`` above what the release takes is a :class:`Refusal` whose
    change is the longest it takes, unless the process's environment allows it as the engine
    reads its variable."""
    _, r = context_rule(engine, version)
    limit, default, how = derived(model, engine, version)
    name = f"{'vLLM' if engine == 'vllm' else 'SGLang'} {version}"
    if limit is not None and limit < 1:
        raise InputError(
            f"{model.name}'s config gives a context length of {limit:g} ({how})",
            where=model.context.source if model.context is not None else "--model",
            fix="use the model's own config.json",
        )
    if given is None:
        if default is None or default < 1:
            raise NoContextLength(
                f"{model.name} gives no context length ({how})",
                where=f"--{r.flag}",
                hint="add the engine's context length",
                changes={r.flag: 8192},
            )
        return Length(default, limit, how, "")
    if limit is None:
        return Length(given, None, how, "")
    top = math.floor(limit)
    if r.model_max_length_allows and model.context is not None:
        top = max(top, model.context.lengths.get("model_max_length", 0))
    if given <= top:
        return Length(given, limit, how, "")
    allowed = _allowed(r, os.environ)
    if allowed:
        return Length(given, limit, how, allowed)
    shown = Length(given, limit, how, "").shown
    raise Refusal(
        f"{given:,} tokens are more than the {shown} {name} derives from {model.name}'s config ({how}); "
        f"it refuses a longer --{r.flag} unless {r.allow_env[0]}=1",
        where=f"--{r.flag} {given}",
        hint=f"the longest {name} takes",
        changes={r.flag: top},
    )
