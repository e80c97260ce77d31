"""A spec as TOML a user can save, edit and pass back with ``--spec``.

``planner spec show`` prints the embedded spec this way. Every field is
written, defaults included, so the file shows what can be changed; a field
whose value is None (no budget, no trace) is left out, as TOML has no null.
The output decodes back to the same spec (tests/test_cli_spec.py).

What this does not do: keep comments or the layout of a hand-written spec
(it writes a spec object, not an edit of a file), or write specs whose
strings hold control characters other than those JSON escapes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import msgspec

from capture_plan.schemas.spec import Model, Spec

__all__ = ["spec_toml"]

#: a size list longer than this is wrapped, this many numbers a line
_PER_LINE = 16


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a TOML basic string (\uXXXX escapes included)
    if isinstance(v, list):
        if len(v) > _PER_LINE and all(isinstance(x, int) for x in v):
            rows = [", ".join(map(str, v[i : i + _PER_LINE])) for i in range(0, len(v), _PER_LINE)]
            return "[\n" + ",\n".join(f"  {r}" for r in rows) + ",\n]"
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_value(x)}" for k, x in v.items() if x is not None) + " }" if v else "{}"
    raise TypeError(f"no TOML form for {type(v).__name__}")


def _table(fields: dict) -> list[str]:
    return [f"{k} = {_value(v)}" for k, v in fields.items() if v is not None]


def spec_toml(spec: Spec, header: Sequence[str] = ()) -> str:
    """``spec`` as TOML: top-level settings, ``[model]``, one ``[[phases]]``
    table per phase, one ``[[rules]]`` table per rule; ``header`` lines first, as comments."""
    raw = msgspec.to_builtins(spec)
    model, phases, rules = raw.pop("model"), raw.pop("phases"), raw.pop("rules", [])
    if "config" in model:  # the config gives the dimensions: listing the defaults beside it is refused
        defaults = msgspec.to_builtins(Model())
        model = {k: v for k, v in model.items() if k not in defaults or defaults[k] != v}
    out = [f"# {line}" for line in header]
    out += _table(raw) + ["", "[model]"] + _table(model)
    for ph in phases:
        out += ["", "[[phases]]"] + _table(ph)
    for rule in rules:
        out += ["", "[[rules]]"] + _table(rule)
    return "\n".join(out) + "\n"
