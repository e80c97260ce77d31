"""A spec's ``[model] config = "config.json"``: dimensions from a Hugging Face config.

Reads the fields ``planner/data/architectures.toml`` names for the config's
``model_type`` (hidden size, layers, heads, KV heads, head dim, intermediate
size, vocabulary, dtype, and the expert fields of MoE types) and returns the
spec's :class:`Model` with them. Keys are read under every spelling
transformers accepts: a type's ``attribute_map`` aliases (Qwen3-MoE's
``num_experts`` and ``num_local_experts``) and ``torch_dtype`` for ``dtype``;
an alias and its canonical key with different values is an error naming both.
A multimodal config (Gemma 3, Llama 4, Mistral 3) is read from its
``text_config``. Every problem is one :class:`InputError` naming the config
file and the key: a missing field, an unknown or unsupported ``model_type``
(the reason is in the data), a value that is not a positive integer or is
absurd (above the table's ``max``; heads not a multiple of KV heads; more
experts per token than experts), an unknown dtype.

MLA types (DeepSeek-V2/V3, Kimi K2) are mapped onto the ordinary attention
the analytic model describes: heads and KV heads as given, head dim = the
query/key head dim (``qk_nope_head_dim + qk_rope_head_dim``). The analytic
figure is then approximate (values are ``v_head_dim`` wide, and engines cache
a compressed latent, not per-head keys); a few-size trace gives exact
predictions. MoE routing is not modelled either (the expert fields are
recorded for traces and reports).

What it does not do: download anything, read the weights, or apply
transformers' class defaults for missing keys (they are a release's guess
about the model, not the model); quantization, rope and sliding-window
fields are ignored.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import msgspec

from capture_plan.schemas.errors import InputError
from capture_plan.schemas.files import read_input
from capture_plan.schemas.spec import Model

from .resources import typed

__all__ = [
    "model_from_config",
    "read_model_config",
    "context_window",
    "architectures",
    "ArchitecturesFile",
    "ModelType",
    "Combined",
    "DIMENSIONS",
]

DIMENSIONS = ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "vocab")
_MOE = ("experts", "experts_per_token", "expert_intermediate", "shared_expert_intermediate")


class Combined(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A dimension computed from several keys: their ``sum`` or their ``product``
    (exactly one of the two)."""

    sum: list[str] | None = None
    product: list[str] | None = None

    @property
    def keys(self) -> list[str]:
        return self.sum if self.sum is not None else self.product or []


Key = str | Combined


class ModelType(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One ``[model_types.NAME]`` table: the keys that differ from ``[fields]``
    and transformers' ``attribute_map`` of the type's config class."""

    hidden: Key | None = None
    layers: Key | None = None
    heads: Key | None = None
    kv_heads: Key | None = None
    head_dim: Key | None = None
    intermediate: Key | None = None
    vocab: Key | None = None
    experts: Key | None = None
    experts_per_token: Key | None = None
    expert_intermediate: Key | None = None
    shared_expert_intermediate: Key | None = None
    #: alias -> canonical key, as transformers' ``attribute_map``
    aliases: dict[str, str] = {}


class Wrapper(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A multimodal config whose decoder is its ``text_config``, of ``model_type``
    unless text_config names one."""

    model_type: str


class ArchitecturesFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``planner/data/architectures.toml`` as a whole."""

    fields: dict[str, str]
    aliases: dict[str, str]
    max: dict[str, int]
    dtypes: dict[str, int]
    model_types: dict[str, ModelType]
    unsupported: dict[str, str] = {}
    wrappers: dict[str, Wrapper] = {}


@functools.cache
def architectures() -> ArchitecturesFile:
    """The table, typed (a malformed table is a broken package: RuntimeError)."""
    table = typed("architectures.toml", ArchitecturesFile)
    for name, mt in table.model_types.items():
        for f in DIMENSIONS + _MOE:
            k = getattr(mt, f)
            if isinstance(k, Combined) and (k.sum is None) == (k.product is None):
                raise RuntimeError(
                    f"planner/data/architectures.toml: model_types.{name}.{f}: give exactly one of sum and product"
                )
    return table


class _Config:
    """A config's keys under their canonical names, remembering which spelling
    each value came from (errors name the key as the file spells it)."""

    def __init__(self, cfg: dict, aliases: dict[str, str], where: str, prefix: str):
        self.where, self.prefix = where, prefix
        self.values = {k: v for k, v in cfg.items() if v is not None}
        self.spelled = {k: k for k in self.values}
        self.others: dict[str, list[str]] = {}
        for alias, canon in sorted(aliases.items()):
            self.others.setdefault(canon, []).append(alias)
            if alias not in self.values:
                continue
            if canon in self.values and self.values[canon] != self.values[alias]:
                other = self.spelled[canon]  # the canonical key, or an earlier alias of it
                raise InputError(
                    f"{alias} = {self.values[alias]!r:.40} and {other} = {self.values[canon]!r:.40} "
                    f"disagree (transformers reads {alias} as {canon})",
                    where=self.at(alias),
                    fix=f"keep one of {alias} and {other}",
                )
            if canon not in self.values:
                self.values[canon] = self.values[alias]
                self.spelled[canon] = alias

    def at(self, key: str) -> str:
        return f"{self.where}: $.{self.prefix}{self.spelled.get(key, key)}"

    def missing(self, key: str, field: str) -> InputError:
        also = self.others.get(key)
        also_text = f"; also read as {' or '.join(also)}" if also else ""
        return InputError(
            f"missing field {key} (the model's {field.replace('_', ' ')}{also_text})",
            where=self.at(key),
            fix=f"add {key} to the config, or list the dimensions in [model]",
        )

    def positive(self, key: str, field: str) -> int:
        v = self.values[key]
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise InputError(
                f"{self.spelled[key]} must be a positive integer, got {v!r:.60}",
                where=self.at(key),
                fix="use the model's own config.json, or list the dimensions in [model] instead of config",
            )
        return v


def _last(key: Key) -> str:
    """The key an error about ``key``'s value points at."""
    return key.keys[-1] if isinstance(key, Combined) else key


def _dimension(c: _Config, key: Key, field: str) -> int | None:
    """The value of ``field`` (None: its one key is absent; the caller decides)."""
    keys = key.keys if isinstance(key, Combined) else [key]
    absent = [k for k in keys if k not in c.values]
    if absent and not isinstance(key, Combined):
        return None
    if absent:  # a computed dimension has no Hugging Face default
        raise c.missing(absent[0], field)
    vals = [c.positive(k, field) for k in keys]
    v = vals[0]
    if isinstance(key, Combined):
        v = sum(vals) if key.sum is not None else functools.reduce(lambda a, b: a * b, vals)
    top = architectures().max[field]
    if v > top:
        spelled = " + ".join(keys) if isinstance(key, Combined) and key.sum else " * ".join(keys)
        raise InputError(
            f"{spelled} = {v} is absurd (more than {top})",
            where=c.at(keys[-1]),
            fix="check that this is the model's config.json",
        )
    return v


def _text_config(cfg: dict, table: ArchitecturesFile, where: str) -> tuple[dict, str, str]:
    """(the decoder's config, its model_type, the JSON path prefix of its keys)."""
    mt = cfg.get("model_type")
    if mt is None:
        raise InputError(
            "missing field model_type", where=f"{where}: $.model_type", fix="use the model's own config.json"
        )
    if not isinstance(mt, str):  # a list or object here was an internal error (unhashable)
        raise InputError(
            f"model_type must be a string, got {mt!r:.60}",
            where=f"{where}: $.model_type",
            fix="use the model's own config.json",
        )
    wrapper = table.wrappers.get(mt)
    if wrapper is None:
        return cfg, mt, ""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise InputError(
            f"a {mt} config keeps its decoder's dimensions in text_config, got {text!r:.60}",
            where=f"{where}: $.text_config",
            fix="use the model's own config.json",
        )
    inner = text.get("model_type", wrapper.model_type)
    if not isinstance(inner, str):
        raise InputError(
            f"model_type must be a string, got {inner!r:.60}",
            where=f"{where}: $.text_config.model_type",
            fix="use the model's own config.json",
        )
    return text, inner, "text_config."


def model_from_config(cfg: object, where: str, base: Model = Model()) -> Model:
    """``base`` with the dimensions, dtype and MoE fields of config ``cfg``."""
    return _read_config(cfg, where, base)[0]


def _read_config(cfg: object, where: str, base: Model) -> tuple[Model, dict[str, str]]:
    """:func:`model_from_config`, and per field the config key(s) it was read from as the
    file spells them (``num_hidden_layers``, ``text_config.hidden_size``, ``qk_nope_head_dim +
    qk_rope_head_dim``, ``hidden_size / num_attention_heads`` for a missing head_dim)."""
    table = architectures()
    if not isinstance(cfg, dict):
        raise InputError(
            "a config.json must be a JSON object",
            where=f"{where}: $",
            fix="use the model's own config.json, or list the dimensions in [model] instead of config",
        )
    outer = cfg
    cfg, mt, prefix = _text_config(cfg, table, where)
    if mt in table.unsupported:
        raise InputError(
            f"model_type {mt!r} is not supported: {table.unsupported[mt]}",
            where=f"{where}: $.{prefix}model_type",
            fix="list the dimensions in [model] instead of config",
        )
    types = table.model_types
    if mt not in types:
        raise InputError(
            f"unknown model_type {mt!r}; known: {', '.join(sorted(types))}",
            where=f"{where}: $.{prefix}model_type",
            fix="list the dimensions in [model] instead of config",
        )
    kind = types[mt]
    c = _Config(cfg, {**table.aliases, **kind.aliases}, where, prefix)
    keys: dict[str, Key] = {
        **table.fields,
        **{f: getattr(kind, f) for f in DIMENSIONS + _MOE if getattr(kind, f) is not None},
    }
    out: dict = {}
    read: dict[str, str] = {}

    def spelled(k: str) -> str:
        return prefix + c.spelled.get(k, k)

    for f in DIMENSIONS + _MOE:
        key = keys.get(f)
        if key is None:
            continue
        v = _dimension(c, key, f)
        if isinstance(key, Combined):
            read[f] = (" + " if key.sum is not None else " * ").join(spelled(k) for k in key.keys)
        else:
            read[f] = spelled(key)
        if v is None:
            if f == "kv_heads":
                v = out["heads"]  # Hugging Face's default: multi-head attention
                read[f] = f"{read['heads']} ({key} absent)"
            elif f == "head_dim":
                if out["hidden"] % out["heads"]:
                    raise InputError(
                        f"hidden_size {out['hidden']} is not a multiple of num_attention_heads "
                        f"{out['heads']} and head_dim is missing",
                        where=c.at("head_dim"),
                        fix="add head_dim to the config, or list the dimensions in [model] instead of config",
                    )
                v = out["hidden"] // out["heads"]
                read[f] = f"{read['hidden']} / {read['heads']}"
            else:  # _dimension gives None only for a one-key dimension: key is a str
                raise c.missing(key, f)  # pyright: ignore[reportArgumentType]
        out[f] = v
    if out["heads"] % out["kv_heads"]:
        raise InputError(
            f"num_attention_heads {out['heads']} is not a multiple of num_key_value_heads {out['kv_heads']}",
            where=c.at(_last(keys["kv_heads"])),
            fix="use the model's own config.json, or list the dimensions in [model] instead of config",
        )
    if "experts" in out and out["experts_per_token"] > out["experts"]:
        per, n = (c.spelled.get(_last(keys[f]), _last(keys[f])) for f in ("experts_per_token", "experts"))
        raise InputError(
            f"{per} {out['experts_per_token']} exceeds {n} {out['experts']}",
            where=c.at(_last(keys["experts_per_token"])),
            fix="use the model's own config.json, or list the dimensions in [model] instead of config",
        )
    if "dtype" not in c.values and prefix:  # a multimodal config's text_config without one: the outer config's
        c = _Config(outer, table.aliases, where, "")
    dtype = c.values.get("dtype")
    if dtype is None:
        raise InputError(
            "missing field dtype (or torch_dtype)",
            where=c.at("dtype"),
            fix='add "dtype": "bfloat16" (the dtype the engine runs)',
        )
    name = str(dtype).removeprefix("torch.")
    if name not in table.dtypes:
        raise InputError(
            f"unsupported dtype {dtype!r}; supported: {', '.join(sorted(table.dtypes))}",
            where=c.at("dtype"),
            fix="list the dimensions in [model] with dtype_bytes, or use a config of a dtype listed",
        )
    out["dtype_bytes"] = table.dtypes[name]
    read["dtype_bytes"] = c.prefix + c.spelled.get("dtype", "dtype")
    model_name = base.name if base.name != Model().name else mt
    return msgspec.structs.replace(base, name=model_name, **out), read


def read_model_config(
    model: Model, spec_path: Path | None, spec_name: str
) -> tuple[Model, str | None, bytes, dict[str, str]]:
    """Resolve ``model.config`` relative to the spec file: (model, path, bytes, the config
    key each field was read from).

    A spec whose ``[model]`` sets ``config`` and also a dimension (a value
    other than the default) is refused: which one holds would be a guess.
    """
    if model.config is msgspec.UNSET:
        return model, None, b"", {}
    listed = [f for f in DIMENSIONS + ("dtype_bytes",) if getattr(model, f) != getattr(Model(), f)]
    if listed:
        raise InputError(
            f"[model] names a config and also lists {', '.join(listed)}",
            where=f"{spec_name}: $.model.config",
            fix="keep one: the config or the dimensions",
        )
    base = spec_path.parent if spec_path is not None else Path.cwd()
    path = base / model.config
    try:
        os.stat(path)
    except (OSError, ValueError) as err:
        raise InputError(
            f"cannot read model config {model.config!r}: {getattr(err, 'strerror', None) or err}",
            where=f"{spec_name}: $.model.config",
            fix="the path is relative to the spec file",
        ) from None
    # like every input: a regular file within a size limit (a FIFO hung the build, /dev/zero filled memory)
    raw = read_input(path, "config", fix="point [model] config at the model's config.json")
    try:
        cfg = msgspec.json.decode(raw)
    except msgspec.DecodeError as err:
        raise InputError(
            f"not valid JSON: {err}",
            where=str(path),
            fix="use the model's own config.json, or list the dimensions in [model] instead of config",
        ) from None
    except RecursionError:  # msgspec's own depth limit
        raise InputError("nested too deeply to read", where=str(path), fix="use the model's own config.json") from None
    resolved, read = _read_config(cfg, str(path), model)
    return resolved, str(path), raw, read


def context_window(raw: bytes, where: str) -> tuple[int, str] | None:
    """The longest context the model of a config.json (``raw``, one :func:`read_model_config`
    accepted) attends over: its decoder's ``max_position_embeddings`` and where it was read
    (``config.json: $.text_config.max_position_embeddings``); None where the config names no
    positive whole number there (the bound is then the planner's own: limits.MAX_CONTEXT)."""
    cfg, _mt, prefix = _text_config(msgspec.json.decode(raw), architectures(), where)
    n = cfg.get("max_position_embeddings")
    if type(n) is not int or n < 1:
        return None
    return n, f"{where}: $.{prefix}max_position_embeddings"
