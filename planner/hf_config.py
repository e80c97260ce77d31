"""A spec's ``[model] config = "config.json"``: dimensions from a Hugging Face config.

Reads the fields ``planner/data/architectures.toml`` names for the config's
``model_type`` (hidden size, layers, heads, KV heads, head dim, intermediate
size, vocabulary, dtype, and the expert fields of MoE types) and returns the
spec's :class:`Model` with them. Every problem is one :class:`InputError`
naming the config file and the key: a missing field, an unknown
``model_type``, a value that is not a positive integer or is absurd (above
the table's ``max``; heads not a multiple of KV heads; more experts per
token than experts), an unknown dtype.

What it does not do: download anything, or read the weights; quantization
and rope fields are ignored.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from schemas.errors import InputError
from schemas.files import read_input
from schemas.spec import Model

from .resources import data

__all__ = ["model_from_config", "read_model_config", "DIMENSIONS"]

DIMENSIONS = ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "vocab")
_MOE = ("experts", "experts_per_token", "expert_intermediate", "shared_expert_intermediate")


def _positive(cfg: dict, key: str, field: str, where: str) -> int:
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise InputError(f"{key} must be a positive integer, got {v!r}", where=f"{where}: $.{key}")
    top = data("architectures.toml")["max"][field]
    if v > top:
        raise InputError(f"{key} = {v} is absurd (more than {top})", where=f"{where}: $.{key}",
                         fix="check that this is the model's config.json")
    return v


def model_from_config(cfg: object, where: str, base: Model = Model()) -> Model:
    """``base`` with the dimensions, dtype and MoE fields of config ``cfg``."""
    table = data("architectures.toml")
    if not isinstance(cfg, dict):
        raise InputError("a config.json must be a JSON object", where=f"{where}: $")
    mt = cfg.get("model_type")
    if mt is None:
        raise InputError("missing field model_type", where=f"{where}: $.model_type",
                         fix="use the model's own config.json")
    if not isinstance(mt, str):  # a list or object here was an internal error (unhashable)
        raise InputError(f"model_type must be a string, got {mt!r:.60}", where=f"{where}: $.model_type",
                         fix="use the model's own config.json")
    types = table["model_types"]
    if mt not in types:
        raise InputError(f"unknown model_type {mt!r}; known: {', '.join(sorted(types))}",
                         where=f"{where}: $.model_type", fix="list the dimensions in [model] instead of config")
    keys = {**table["fields"], **types[mt]}
    out: dict = {}
    for f in DIMENSIONS + _MOE:
        key = keys.get(f)
        if key is None:
            continue
        if key not in cfg or cfg[key] is None:
            if f == "kv_heads" and "heads" in out:
                out[f] = out["heads"]  # Hugging Face's default: multi-head attention
                continue
            if f == "head_dim" and "heads" in out:
                if out["hidden"] % out["heads"]:
                    raise InputError(f"hidden_size {out['hidden']} is not a multiple of num_attention_heads "
                                     f"{out['heads']} and head_dim is missing", where=f"{where}: $.head_dim")
                out[f] = out["hidden"] // out["heads"]
                continue
            raise InputError(f"missing field {key} (the model's {f.replace('_', ' ')})", where=f"{where}: $.{key}",
                             fix=f"add {key} to the config, or list the dimensions in [model]")
        out[f] = _positive(cfg, key, f, where)
    if out["heads"] % out["kv_heads"]:
        raise InputError(f"num_attention_heads {out['heads']} is not a multiple of num_key_value_heads "
                         f"{out['kv_heads']}", where=f"{where}: $.{keys['kv_heads']}")
    if "experts" in out and out["experts_per_token"] > out["experts"]:
        raise InputError(f"{keys['experts_per_token']} {out['experts_per_token']} exceeds {keys['experts']} "
                         f"{out['experts']}", where=f"{where}: $.{keys['experts_per_token']}")
    dkey = "dtype" if cfg.get("dtype") is not None else "torch_dtype"
    dtype = cfg.get(dkey)
    if dtype is None:
        raise InputError("missing field dtype (or torch_dtype)", where=f"{where}: $.dtype",
                         fix='add "dtype": "bfloat16" (the dtype the engine runs)')
    dtypes = table["dtypes"]
    name = str(dtype).removeprefix("torch.")
    if name not in dtypes:
        raise InputError(f"unsupported dtype {dtype!r}; supported: {', '.join(sorted(dtypes))}",
                         where=f"{where}: $.{dkey}")
    out["dtype_bytes"] = dtypes[name]
    model_name = base.name if base.name != Model().name else mt
    return msgspec.structs.replace(base, name=model_name, **out)


def read_model_config(model: Model, spec_path: Path | None, spec_name: str) -> tuple[Model, str | None, bytes]:
    """Resolve ``model.config`` relative to the spec file: (model, path, bytes).

    A spec whose ``[model]`` sets ``config`` and also a dimension (a value
    other than the default) is refused: which one holds would be a guess.
    """
    if model.config is msgspec.UNSET:
        return model, None, b""
    listed = [f for f in DIMENSIONS + ("dtype_bytes",) if getattr(model, f) != getattr(Model(), f)]
    if listed:
        raise InputError(f"[model] names a config and also lists {', '.join(listed)}",
                         where=f"{spec_name}: $.model.config", fix="keep one: the config or the dimensions")
    base = spec_path.parent if spec_path is not None else Path.cwd()
    path = base / model.config
    try:
        os.stat(path)
    except (OSError, ValueError) as err:
        raise InputError(f"cannot read model config {model.config!r}: {getattr(err, 'strerror', None) or err}",
                         where=f"{spec_name}: $.model.config",
                         fix="the path is relative to the spec file") from None
    # like every input: a regular file within a size limit (a FIFO hung the build, /dev/zero filled memory)
    raw = read_input(path, "config", fix="point [model] config at the model's config.json")
    try:
        cfg = msgspec.json.decode(raw)
    except msgspec.DecodeError as err:
        raise InputError(f"not valid JSON: {err}", where=str(path)) from None
    except RecursionError:  # msgspec's own depth limit
        raise InputError("nested too deeply to read", where=str(path), fix="use the model's own config.json") from None
    return model_from_config(cfg, str(path), model), str(path), raw
