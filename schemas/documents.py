"""A file's bytes decoded to builtins, before they are converted to a schema type.

JSON (or TOML for a spec named ``*.toml``): UTF-8 only, not empty, no duplicate keys,
every number finite and within ``MAX_INT``, nesting at most ``MAX_DEPTH``, of the kind
asked for (:func:`sniff_kind`) and of a version this capture-plan reads; each error
one located line (:mod:`capture_plan.schemas.conversion`'s fixes).
"""

from __future__ import annotations

import math
import sys
from pathlib import PurePath
from typing import Any

import msgspec

from .conversion import _FIX, _WANT, short_int
from .errors import InputError, WrongKindError
from .limits import MAX_DEPTH, MAX_INT


def toml_parser():
    """tomllib (tomli before Python 3.11), imported by the first TOML read: importing it
    compiles its patterns, a cost a command that reads no TOML (an installed planner's
    build reads its data files parsed at install: planner/inputs/resources.py) need not pay."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on 3.10 only
        # tomli: a dependency on Python 3.10 only; pyright runs in a 3.11+ venv without it
        import tomli as tomllib  # pyright: ignore[reportMissingImports]
    return tomllib


def sniff_kind(raw: Any) -> str | None:
    """Which of our file kinds a decoded document looks like (None: none of them)."""
    if not isinstance(raw, dict):
        return None
    if "steps" in raw and "command" in raw:
        return "plan"
    if "captures" in raw:
        return "trace"
    if "plan_digest" in raw:
        return "report"
    if "phases" in raw:
        return "spec"
    return None


def _expect_kind(raw: Any, kind: str, source: str) -> dict:
    if not isinstance(raw, dict):
        got = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(raw), "a number")
        raise WrongKindError(
            f"a {kind} must be a JSON object (a TOML table), got {got}", where=f"{source}: $", fix=_WANT[kind]
        )
    got = sniff_kind(raw)
    if got is not None and got != kind:
        raise WrongKindError(f"this is a {got} file, not a {kind}", where=source, fix=_WANT[kind])
    return raw


def _dup_keys(pairs: list) -> dict:
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise _Duplicate(key)
        seen[key] = value
    return seen


class _Duplicate(Exception):
    pass


def _bad_value(obj: Any) -> str | None:
    """Why one leaf value is refused, or None."""
    if isinstance(obj, bool) or not isinstance(obj, (int, float)):
        return None
    if isinstance(obj, int):
        if abs(obj) > MAX_INT:
            return f"number out of range: {short_int(obj)} (the limit is 2**53)"
    elif not math.isfinite(obj) or abs(obj) > MAX_INT:
        return f"number out of range: {obj!r}"
    return None


def _check_values(raw: Any, source: str, kind: str) -> None:
    """Every number finite and within ``MAX_INT``, nesting at most ``MAX_DEPTH``
    (unknown fields included, which no type bounds): absurd values are refused
    here, located, instead of overflowing deep inside a build. The bounds of each
    field are its type's (checked when the document is converted). Iterative: no
    recursion limit.
    Paths are only spelled out for the value that fails (plans are walked at
    every engine start)."""
    stack: list[tuple[Any, tuple, int]] = [(raw, (), 0)]
    while stack:
        obj, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise InputError(
                f"nested deeper than {MAX_DEPTH} levels", where=f"{source}: {_spell(path)}", fix=_FIX[kind]
            )
        if isinstance(obj, dict):
            depth += 1
            stack.extend((v, (path, k), depth) for k, v in obj.items() if isinstance(v, (dict, list, int, float)))
        elif isinstance(obj, list):
            depth += 1
            stack.extend((v, (path, i), depth) for i, v in enumerate(obj) if isinstance(v, (dict, list, int, float)))
        else:
            why = _bad_value(obj)
            if why:
                raise InputError(why, where=f"{source}: {_spell(path)}", fix=_FIX[kind])


def _spell(path: tuple) -> str:
    """``(((), "a"), 0)`` -> ``$.a[0]``; a linked list keeps the walk cheap."""
    parts = []
    while path:
        path, key = path
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    return "$" + "".join(reversed(parts))


def _decode_text(data: bytes, source: str, kind: str) -> bytes:
    """``data`` without a UTF-8 byte-order mark; other encodings are refused."""
    if data.startswith(b"\xef\xbb\xbf"):
        return data[3:]
    if data[:2] in (b"\xff\xfe", b"\xfe\xff") or b"\x00" in data[:4]:
        raise InputError("file is UTF-16 or UTF-32 encoded", where=source, fix="save it as UTF-8")
    return data


def _parse(data: bytes, source: str, kind: str = "spec", *, toml: bool | None = None) -> Any:
    """Decode JSON (or TOML when ``source`` ends in ``.toml``); located errors only.

    Beyond the decoders' own checks: duplicate keys in a JSON object are an
    error (the JSON decoders keep the last one silently; TOML refuses them
    itself), and so are nesting past ``MAX_DEPTH`` and out-of-range numbers.
    """
    data = _decode_text(data, source, kind)
    if not data.strip():
        fix = "write a spec (see `planner schema`)" if kind == "spec" else _FIX[kind]
        raise InputError(f"{kind} file is empty" if kind != "spec" else "file is empty", where=source, fix=fix)
    if toml is None:
        toml = PurePath(source).suffix.lower() == ".toml"
    if toml:
        tomllib = toml_parser()
        try:
            raw = tomllib.loads(data.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
            raise InputError(
                f"malformed TOML: {err}",
                where=source,
                fix="mend the TOML at the line and column it names (`planner spec show` prints a valid spec)",
            ) from None
        except RecursionError:
            raise InputError(f"nested deeper than {MAX_DEPTH} levels", where=source, fix=_FIX[kind]) from None
        except ValueError as err:  # e.g. an integer of more than 4300 digits
            raise InputError(f"malformed TOML: {err}", where=source, fix=_FIX[kind]) from None
        return raw
    what = "malformed JSON" if kind == "spec" else "not valid JSON (truncated or corrupted?)"
    try:
        raw = msgspec.json.decode(data)
    except msgspec.DecodeError as err:
        if kind != "spec":
            raise _invalid_json(data, source, kind, err) from None
        fix = "mend the JSON at the position it names (`planner schema spec` is the spec's schema)"
        if kind == "spec" and PurePath(source).suffix.lower() != ".json":
            # a TOML spec named spec.txt or spec.tml is read as JSON: say why
            fix = "a spec is read as TOML only when its name ends in .toml, else as JSON: rename a TOML spec"
        raise InputError(f"{what}: {err}", where=source, fix=fix) from None
    except RecursionError:
        raise InputError(f"nested deeper than {MAX_DEPTH} levels", where=source, fix=_FIX[kind]) from None
    _no_duplicate_keys(data, source, kind)
    return raw


def _invalid_json(data: bytes, source: str, kind: str, err: Exception) -> InputError:
    """A plan, trace or report file that does not decode: one that starts as a JSON
    object was damaged (truncated, corrupted: rebuild or record it again); anything
    else is some other file given where one of ours belongs (``planner diff README.md
    plan.json``), and rebuilding would not help."""
    if data.lstrip()[:1] == b"{":
        return InputError(f"not valid JSON (truncated or corrupted?): {err}", where=source, fix=_FIX[kind])
    return WrongKindError(f"not a {kind} file: not a JSON object ({err})", where=source, fix=_WANT[kind])


def _no_duplicate_keys(data: bytes, source: str, kind: str) -> None:
    if b'"' not in data:
        return
    import json  # only JSON inputs are read back this way (a build of the embedded spec reads none)

    try:
        json.loads(data, object_pairs_hook=_dup_keys, parse_constant=float)
    except _Duplicate as dup:
        raise InputError(
            f"duplicate key {str(dup.args[0])!r} in an object (a JSON reader would silently keep the last one)",
            where=source,
            fix="write each key once",
        ) from None
    except (ValueError, RecursionError):  # msgspec accepted it; a json-module limit (e.g. digits) is no error
        return


def read_document(data: bytes, source: str, kind: str) -> dict:
    """A spec or report file decoded to builtins: a JSON (or, for a spec named
    ``*.toml``, TOML) object of that kind, no duplicate keys, every number in
    range, nesting bounded; each error located. The caller converts it to its type
    (:func:`convert`) and checks what the type cannot say."""
    raw = _expect_kind(_parse(data, source, kind, toml=None if kind == "spec" else False), kind, source)
    _check_values(raw, source, kind)
    return raw


def _check_version(raw: dict, source: str, kind: str, current: int, fix_older: str) -> None:
    version = raw.get("version", current if kind == "trace" else None)
    if not isinstance(version, int) or isinstance(version, bool):
        raise InputError("missing or non-integer `version`", where=f"{source}: $.version", fix=_FIX[kind])
    if version > current:
        raise InputError(
            f"{kind} version {version} is newer than this capture-plan understands ({current})",
            where=source,
            fix=f"upgrade capture-plan, or {_FIX[kind]} with this version",
        )
    if version < current:
        raise InputError(
            f"{kind} version {version} is {'older than' if version > 0 else 'not'} this capture-plan's ({current})",
            where=f"{source}: $.version",
            fix=fix_older,
        )
