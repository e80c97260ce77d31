"""The rotary cos/sin cache an engine release keeps for a model, counted with its weights (a
buffer the engine computes at load, in no checkpoint): its rows and element by rope type, as
each release's rotary_embedding classes size it (planner/data/fit_rules.toml [rope.NAME], each
class's file and function named there).

The config's rope rows are read as the release reads them for its context length
(:func:`.context.rope_rows`: its transformers pin's rope_scaling or rope_parameters, legacy
names renamed, original_max_position_embeddings put in); each distinct row is one cache (both
engines keep one per key, process-wide), ``max_position`` rows for the default rope,
``original x factor`` for YaRN (not max_position_embeddings: the class is built with the
original as its length), ``max x factor`` for linear scaling, a short and a long cache for
LongRoPE. A rope type the rule does not list, or a row with a key of its ``refused_keys``, is
refused in one line: its rows are not modelled.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from capture_plan.schemas.errors import InputError

from .context import rope_rows
from .tables import RopeRule, rope_rule

if TYPE_CHECKING:
    from .model import FitModel

__all__ = ["Rotary", "rotary_cache"]

_ORIGINAL = "original_max_position_embeddings"


class Rotary(NamedTuple):
    """A model's rotary caches on every rank: their bytes, the error bar (an element the release
    may keep wider: ``element_bar``) and what they are, in words."""

    bytes: int
    error: int
    how: str


def _refuse(what: str, m: FitModel, fix: str) -> InputError:
    where = m.context.source if m.context is not None else m.source
    return InputError(what, where=f"{where}: $.rope_scaling", fix=fix)


def _rows(r: RopeRule, row: dict, max_position: int, lacks: Callable[[str], InputError]) -> int:
    """The rows of one cache of the rope ``row`` (its ``rope_type`` the class's), by the rule's
    ``rows``; a key the release reads and the row lacks is ``lacks(key)``."""
    how = r.rows[row["rope_type"]]
    if how == "max":
        return max_position
    factor: float = r.factor_default
    if how in ("max_x_factor", "original_x_factor"):
        if row.get("factor") is None and not r.factor_default:
            raise lacks("factor")
        factor = float(row.get("factor") or r.factor_default)
    if how == "max_x_factor":
        return math.ceil(max_position * factor)
    original = row.get(_ORIGINAL)
    if original is None:
        if not r.original_default_max:
            raise lacks(_ORIGINAL)
        original = max_position
    if how == "original_x_factor":
        return math.ceil(original * factor)
    short_long = original + max_position
    return short_long if how == "original_plus_max" else 2 * short_long


def rotary_cache(
    m: FitModel, engine: str, version: str, *, max_position: int | None = None, dtype_bytes: int | None = None
) -> Rotary:
    """``m``'s rotary caches as ``engine==version`` keeps them: ``max_position`` the length the
    model passes get_rope (default: its max_position_embeddings; 0: no rotary cache),
    ``dtype_bytes`` the dtype a "model" element is kept in (default: ``m``'s)."""
    rows_at = m.max_positions if max_position is None else max_position
    if not rows_at or not m.rotary_dim:
        return Rotary(0, 0, "no rotary cache")
    rule_name, r, read = rope_rule(engine, version)
    name = f"{'vLLM' if engine == 'vllm' else 'SGLang'} {version}"
    model_dtype = dtype_bytes or m.dtype_bytes
    seen: list[dict] = []
    total = error = 0
    parts: list[str] = []
    bars: list[str] = []
    for row in rope_rows(m.context, engine, version) or [{"rope_type": "default"}]:
        if row in seen:  # the same key: one cache
            continue
        seen.append(row)
        kind = str(row.get("rope_type", "default"))
        if kind != "default" and m.model_type in r.deepseek_model_types:  # the model code's own rope
            kind = r.deepseek_type
        refused = [k for k in r.refused_keys if row.get(k)]
        if refused or kind not in r.rows:
            why = r.refused_keys[refused[0]] if refused else f"modelled: {', '.join(r.rows)}"
            raise _refuse(
                f"{name}'s rotary cache for rope type {kind!r} is not modelled ({why})",
                m,
                "fit models the rope types its fit_rules.toml [rope] rows list; give --weights-index and count the "
                "cache yourself, or use a model of those",
            )

        def lacks(key: str, kind: str = kind) -> InputError:
            return _refuse(f"{name} reads a {kind} rope's {key}, which the config lacks", m, f"give the rope's {key}")

        rows = _rows(r, {**row, "rope_type": kind}, rows_at, lacks)
        element = 4 if r.element[kind] == "float32" else model_dtype
        b = rows * m.rotary_dim * element
        total += b
        if kind in r.element_bar and element < 4:
            error += rows * m.rotary_dim * (4 - element)
            bars.append(r.element_bar[kind])
        parts.append(f"{kind}: {rows:,} rows x {m.rotary_dim} x {element} B")
    src = f"fit_rules.toml [rope.{rule_name}]" + ("" if read else f" (read from {', '.join(r.releases)})")
    bar = f"; error bar: {'; '.join(dict.fromkeys(bars))}" if bars else ""
    return Rotary(total, error, f"{'; '.join(parts)} ({src}{bar})")
