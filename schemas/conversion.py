"""Decoded documents converted to the schema types, each violation one located line.

:func:`convert` turns builtins into a schema type; a msgspec ``ValidationError`` becomes
"<file>: <JSON path>: <what>; fix: <fix>" (:func:`_located`): a violated upper bound
worded per field (:data:`_BOUNDS`), a mistyped key with the nearest field (``did you
mean``). The fixes of each file kind (:data:`_FIX`, :data:`_WANT`) are here, for every
reader of the schemas' files.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple, TypeVar

import msgspec

from .errors import InputError
from .limits import MAX_BS, MAX_DEPTH

T = TypeVar("T")


_FIX = {
    "spec": "see `planner schema spec` for every field and its type",
    "plan": "rebuild the plan with the planner build command it records, or restore the file",
    "trace": "record the trace again with capture_plan.executor.profile",
    "report": "write the report again with GraphSet.write_report",
}


_WANT = {
    "spec": "pass a spec (TOML or JSON, `planner schema spec`)",
    "plan": "pass a plan file written by planner build (plans/*.json)",
    "trace": "pass a trace recorded by capture_plan.executor.profile (plans/traces/*.json)",
    "report": "pass a report written by GraphSet.write_report",
}


class _Bound(NamedTuple):
    """How a field's violated upper bound is worded: ``label`` (``{value}``: the
    value, or the length of a list or string; ``{field}``: the field's name) and
    ``fix``. A field not in :data:`_BOUNDS` gets ``{field} = {value}`` (lengths:
    ``{value} items`` or ``{value} characters``) and its file kind's general fix."""

    label: str
    fix: str


_SIZES_FIX = "capture fewer sizes (pad to the next one)"


_MIB_FIX = "give a real amount of memory in MiB"


#: wording of the upper bounds the schema types carry, per (file kind, field);
#: a field is its JSON path with every index written ``[]`` (a trailing index
#: kept: a field of an array-like struct), or ``parent.*`` for every field of one
#: struct (see :func:`_bound_rule`)
_BOUNDS: dict[tuple[str, str], _Bound] = {
    ("spec", "$.phases"): _Bound("{value} phases", "split the spec into several plans"),
    ("spec", "$.rules"): _Bound("{value} rules", "merge rules that say the same thing"),
    ("spec", "$.phases[].sizes"): _Bound("{value} capture sizes", _SIZES_FIX),
    ("spec", "$.phases[].sizes[]"): _Bound("capture size {value}", f"capture sizes up to {MAX_BS}"),
    ("spec", "$.model.*"): _Bound("{field} = {value}", "give the model's real dimensions"),
    ("spec", "$.phases[].model.*"): _Bound("{field} = {value}", "give the draft model's real dimensions"),
    ("spec", "$.phases[].layers"): _Bound("{field} = {value}", "give the phase's real number of decoder layers"),
    ("spec", "$.budget_mib"): _Bound("{field} = {value}", _MIB_FIX),
    ("spec", "$.library_mib"): _Bound("{field} = {value}", _MIB_FIX),
    ("trace", "$.captures[].bs"): _Bound("capture size {value}", _FIX["trace"]),
    ("trace", "$.captures[].events[][1]"): _Bound("block id {value}", _FIX["trace"]),
    ("trace", "$.captures[].events[][2]"): _Bound("allocation of {value} bytes", _FIX["trace"]),
}


# msgspec's words for a violated bound: "Expected `int` <= 65536", "Expected `array` of length <= 32".
# The patterns of this module are strings that `re`'s functions compile on first use (and cache):
# only an error or a trace needs them, and compiling them at import cost every command's start-up
_BOUND_TEXT = r"Expected `(\w+)` (of length )?(<=|<|>=|>) (\S+)"


_PATH_PART = r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]"


def _keys(path: str) -> list[str | int] | None:
    """``$.phases[0].sizes`` -> ``["phases", 0, "sizes"]``; None for a path msgspec
    cannot spell exactly (a dict's value is ``[...]``)."""
    keys: list[str | int] = []
    pos = 1
    while pos < len(path):
        m = re.compile(_PATH_PART).match(path, pos)  # compiled once: re caches it
        if m is None:
            return None
        keys.append(m[1] if m[1] is not None else int(m[2]))
        pos = m.end()
    return keys


def _value_at(doc: Any, keys: list[str | int]) -> Any:
    """The value at ``keys`` in a decoded document, or in JSON bytes (walked as
    zero-copy ``msgspec.Raw`` views, one level at a time: a trace is never decoded
    whole for this); None where it cannot be found."""
    try:
        for key in keys:
            if isinstance(doc, (bytes, msgspec.Raw)):
                level = dict[str, msgspec.Raw] if isinstance(key, str) else list[msgspec.Raw]
                doc = msgspec.json.decode(doc, type=level)
            doc = doc[key]
        return msgspec.json.decode(doc) if isinstance(doc, (bytes, msgspec.Raw)) else doc
    except (msgspec.DecodeError, KeyError, IndexError, TypeError):
        return None


def _bound_rule(kind: str, path: str) -> _Bound | None:
    """The :data:`_BOUNDS` entry of ``path``: every index written ``[]`` (a trailing
    one kept as well: a field of an array-like struct, ``events[][2]``), else the
    struct's ``.*`` entry."""
    every = re.sub(r"\[\d+\]", "[]", path)
    # the pattern matches any path (both groups may be empty): never None
    head, last = re.fullmatch(r"(.*?)(\[\d+\])?", path).groups()  # pyright: ignore[reportOptionalMemberAccess]
    tries: tuple[str, ...] = (re.sub(r"\[\d+\]", "[]", head) + last, every) if last else (every,)
    tries += (every.rpartition(".")[0] + ".*",)
    return next((_BOUNDS[kind, t] for t in tries if (kind, t) in _BOUNDS), None)


def _shown(value: Any) -> str:
    return short_int(value) if isinstance(value, int) and not isinstance(value, bool) else repr(value)


def _fields_at(type_: Any, keys: list[str | int]) -> set[str]:
    """The field names (as the file spells them) of the struct(s) at ``keys`` under
    ``type_``: what a mistyped key there could have meant. Empty where none is known."""
    import msgspec.inspect as mi

    infos = [mi.type_info(type_)]
    for key in [*keys, None]:
        flat = []
        for info in infos:  # unions and optionals: every struct they may be
            flat += list(info.types) if isinstance(info, mi.UnionType) else [info]
        if key is None:
            return {f.encode_name for info in flat if isinstance(info, mi.StructType) for f in info.fields}
        nxt = []
        for info in flat:
            if isinstance(info, mi.StructType) and isinstance(key, str):
                nxt += [f.type for f in info.fields if f.encode_name == key]
            elif isinstance(info, (mi.ListType, mi.VarTupleType, mi.SetType)) and isinstance(key, int):
                nxt.append(info.item_type)
            elif isinstance(info, mi.TupleType) and isinstance(key, int) and key < len(info.item_types):
                nxt.append(info.item_types[key])
            elif isinstance(info, mi.DictType):
                nxt.append(info.value_type)
        infos = nxt
    return set()


def _did_you_mean(what: str, path: str, type_: Any) -> str:
    """`` (did you mean `layers`?)`` for msgspec's "Object contains unknown field `layer`",
    from the fields the struct at ``path`` has; "" where none is near."""
    m = re.fullmatch(r"Object contains unknown field `(.*)`", what, re.S)
    keys = _keys(path) if m and type_ is not None else None
    if m is None or keys is None:
        return ""
    import difflib

    try:
        near = difflib.get_close_matches(m[1], sorted(_fields_at(type_, keys)), n=1, cutoff=0.6)
    except (TypeError, IndexError, AttributeError):  # a type msgspec.inspect describes otherwise
        return ""
    return f" (did you mean `{near[0]}`?)" if near else ""


def _located(
    err: msgspec.ValidationError, source: str, kind: str | None, doc: Any = None, type_: Any = None
) -> InputError:
    """The one place a msgspec ``ValidationError`` becomes the project's one line:
    "<file>: <JSON path>: <what>; fix: <fix>". A violated upper bound of a schema
    type reads "<label> is over the limit of <bound>" with the fix of
    :data:`_BOUNDS`; a lower bound keeps msgspec's words ("Expected `int` >= 1")
    and adds the value; any other error is msgspec's message as it is.
    ``doc``: the decoded document (or its JSON bytes) the value is read from; ``type_``:
    the type it was read as (a mistyped key gets the nearest field: ``did you mean``)."""
    text = str(err)
    what, sep, path = text.rpartition(" - at `")
    if not sep:  # the document itself: msgspec names no path
        what, path = text, "$`"
    path = path.rstrip("`")
    fix = _FIX.get(kind or "")
    near = _did_you_mean(what, path, type_)
    if near:
        what += near
        fix = f"rename the key to {near[len(' (did you mean ') : -2]}, or " + (fix or "drop it")
    bound = re.fullmatch(_BOUND_TEXT, what)
    keys = _keys(path) if bound and doc is not None else None
    value = _value_at(doc, keys) if keys is not None else None
    if bound and value is not None:
        type_name, length, op, limit = bound.groups()
        if length and isinstance(value, (list, str, dict)):
            value = len(value)
        if op in ("<=", "<"):
            rule = _bound_rule(kind or "", path)
            # `or []` for the checker: value is read only through keys, so keys is not None here
            field = next((k for k in reversed(keys or []) if isinstance(k, str)), "value")
            unit = "characters" if type_name == "str" else "items"
            label = rule.label if rule else (f"{{value}} {unit}" if length else "{field} = {value}")
            what = label.format(value=_shown(value), field=field)
            what += f", over the limit of {limit}" if length else f" is over the limit of {limit}"
            fix = rule.fix if rule else fix
        else:
            what += f", got {_shown(value)}"
    return InputError(what, where=f"{source}: {path}", fix=fix)


def convert(obj: Any, type_: type[T], source: str, *, kind: str | None = None) -> T:
    """``obj`` (decoded builtins) as ``type_``, its bounds checked; a violation is
    one located line (see :func:`_located`). ``kind``: which of our file kinds
    ``obj`` is (its fixes), None for the planner's data files."""
    try:
        return msgspec.convert(obj, type_)
    except msgspec.ValidationError as err:
        raise _located(err, source, kind, obj, type_) from None
    except RecursionError:
        raise InputError(f"nested deeper than {MAX_DEPTH} levels", where=source, fix=_FIX.get(kind or "")) from None


def short_int(n: int) -> str:
    """``n`` for a message: at most 24 characters ("10000000...(301 digits)")."""
    text = str(n) if n.bit_length() < 10000 else "a number of more than 3000 digits"
    return text if len(text) <= 24 else f"{text[:8]}...({len(text)} digits)"
