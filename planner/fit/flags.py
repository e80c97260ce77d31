"""The engines' own flags fit reads, as typed rows (planner/data/fit_flags.toml).

One declaration per flag: the CLI's options and their help (planner/cli/fit.py) and
:func:`check`, which refuses a value out of its type or bounds, are derived from the row.
A flag not given (None) takes the release's default, which the engine's layer resolves
(:mod:`.vllm`, :mod:`.sglang`); the row's ``default`` says where it comes from.
"""

from __future__ import annotations

import functools
from typing import Literal

import msgspec

from capture_plan.planner.inputs.resources import typed

from .refusal import Refusal

__all__ = ["EngineFlag", "engine_flags", "flags_of", "check", "changes_of"]


class EngineFlag(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    #: the engines that have this flag ("vllm", "sglang")
    engines: list[str]
    type: Literal["int", "float", "choice", "bool", "sizes", "json", "str"]
    #: where the release's default comes from when the flag is not given
    default: str
    #: bounds of an int (inclusive) or a float (an end open where ``*_open``)
    lo: float = 1
    hi: float = 1 << 24
    lo_open: bool = False
    hi_open: bool = False
    #: a value the fix of a refused value suggests (every int and float row has one: tests/test_fit.py)
    example: str = ""
    choices: list[str] = []
    #: a choice compared upper-cased (vLLM parses --cudagraph-mode so)
    upper: bool = False
    #: the other engine's flag of the same meaning (vLLM's max-model-len is SGLang's
    #: context-length): a flag given to the engine without it is refused naming this one
    same_as: str = ""
    #: what the flag does, where its name does not say
    help: str = ""

    def describe(self) -> str:
        """The CLI option's help: whose flag, what it does, where the default comes from."""
        names = {"vllm": "vLLM", "sglang": "SGLang"}
        owner = " and ".join(names[e] for e in self.engines)
        what = f"{owner}: {self.help}" if self.help else f"{owner}'s own flag"
        choices = f", one of {', '.join(self.choices)}" if self.choices else ""
        return f"{what}{choices} [default: {self.default}]."

    def within(self, v: float) -> bool:
        """``v`` inside the float bounds (NaN is not)."""
        return (self.lo < v if self.lo_open else self.lo <= v) and (v < self.hi if self.hi_open else v <= self.hi)

    def bounds(self) -> str:
        if self.type == "float":
            return f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
        return f"{int(self.lo)} to {int(self.hi)}"


class _Flags(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    flags: dict[str, EngineFlag]


@functools.cache
def engine_flags() -> dict[str, EngineFlag]:
    """Every flag fit reads, in the table's order."""
    return typed("fit_flags.toml", _Flags).flags


def flags_of(engine: str) -> list[str]:
    return [n for n, f in engine_flags().items() if engine in f.engines]


def _refuse(name: str, msg: str, hint: str, value: object) -> Refusal:
    return Refusal(msg, where=f"--{name}", hint=hint, changes={name: value})


def _sizes(name: str, v: object) -> list[int]:
    """A list of capture sizes, or the CLI's comma-separated string of them."""
    if isinstance(v, str):
        try:
            v = [int(s) for s in v.split(",") if s.strip()]
        except ValueError:
            raise _refuse(name, f"capture sizes must be integers, got {v!r:.40}", _SIZES, "1,2,4,8") from None
    if not isinstance(v, (list, tuple)) or any(isinstance(s, bool) or not isinstance(s, int) for s in v):
        raise _refuse(name, f"capture sizes must be integers, got {v!r:.40}", _SIZES, "1,2,4,8")
    if not v or min(v) < 1:
        raise _refuse(name, "capture sizes must be positive", _SIZES, "1,2,4,8")
    return list(v)


_SIZES = "positive integers, comma-separated"


def _json(name: str, v: object) -> str:
    """A JSON object (the CLI's string, or a dict) as compact JSON, keys in the order given."""
    if isinstance(v, str):
        try:
            v = msgspec.json.decode(v)
        except (msgspec.DecodeError, RecursionError):
            raise _refuse(name, f"--{name} is not a JSON object: {v!r:.40}", "leave it out", None) from None
    if not isinstance(v, dict):
        raise _refuse(name, f"--{name} must be a JSON object, got {v!r:.40}", "leave it out", None)
    try:
        return msgspec.json.encode(v).decode()
    except (TypeError, RecursionError):
        raise _refuse(name, f"--{name} must be a JSON object, got {v!r:.40}", "leave it out", None) from None


def _value(name: str, f: EngineFlag, v: object) -> object:
    if f.type == "int":
        if not isinstance(v, int) or isinstance(v, bool) or not f.lo <= v <= f.hi:
            example = int(f.example) if f.example not in (None, "") else int(f.lo)
            raise _refuse(
                name, f"--{name} must be an integer from {f.bounds()}, got {v!r:.30}", "a value in bounds", example
            )
    elif f.type == "float":
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not f.within(v):
            raise _refuse(name, f"must be in {f.bounds()}, got {v!r:.30}", "a value in bounds", float(f.example))
    elif f.type == "choice":
        v = str(v).upper() if f.upper else v
        if v not in f.choices:
            raise _refuse(name, f"unknown --{name} value {v!r:.30}", f"one of {', '.join(f.choices)}", f.choices[0])
    elif f.type == "bool":
        v = bool(v)
    elif f.type == "json":
        v = _json(name, v)
    elif f.type == "str":
        if not isinstance(v, str) or not v.strip():
            raise _refuse(name, f"--{name} must be a non-empty path or name, got {v!r:.40}", "a value", None)
    else:
        v = _sizes(name, v)
    return v


def check(engine: str, flags: dict) -> dict:
    """``flags`` (None: not given) checked against ``engine``'s rows: a flag the engine does
    not have, or a value out of its type or bounds, is refused naming the flag. Returns the
    given values normalized (sizes as a list, a mode upper-cased)."""
    rows = engine_flags()
    allowed = flags_of(engine)
    out = {}
    for name, v in flags.items():
        if v is None:
            continue
        if name not in allowed:
            same = rows[name].same_as if name in rows else ""
            if same in allowed:  # the other engine's flag of the same meaning: this engine's, same value
                what, hint = f"{engine} has no flag --{name}", f"{engine}'s flag for it is --{same}"
                raise Refusal(what, where=f"--{name}", hint=hint, changes={name: None, same: v})
            raise _refuse(
                name,
                f"{engine} has no flag --{name}",
                f"leave it out ({engine}'s flags fit reads: --{', --'.join(allowed)})",
                None,
            )
        out[name] = _value(name, rows[name], v)
    return out


def changes_of(fix: str) -> dict[str, object]:
    """One of fit's verified fixes (``--max-model-len 4096``, ``--kv-cache-dtype fp8``, ``--tp 2``,
    ``--disable-hybrid-swa-memory``: each flag with its value, a switch alone) as changes, each
    value of its flag's type (planner/data/fit_flags.toml; ``tp`` an integer)."""
    rows, words, out = engine_flags(), fix.split(), {}
    while words:
        name = words.pop(0).removeprefix("--")
        row = rows.get(name)
        if row is not None and row.type == "bool":
            out[name] = True
            continue
        text = words.pop(0)
        kind = "int" if name == "tp" else row.type if row is not None else "str"
        out[name] = int(text) if kind == "int" else float(text) if kind == "float" else text
    return out
