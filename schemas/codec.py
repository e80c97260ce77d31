"""Reading and writing the shared types: located errors, canonical bytes.

Canonical bytes (plans, traces, reports): JSON with sorted keys, two-space
indent, trailing newline, no floats in plans. The digest of a plan is the
SHA-256 of its canonical bytes with ``digest`` set to "" -- so a plan file can
be checked for tampering or truncation without knowing how it was built.
"""

from __future__ import annotations

import hashlib
import math
import re
import shlex
import sys
from pathlib import PurePath
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import msgspec

from .errors import InputError, WrongKindError
from .keys import expand_labels, step_id, step_labels
from .limits import MAX_BS, MAX_DEPTH, MAX_INT
from .plan import PLAN_VERSION, PhasePlan, Plan, Step, record_command
from .trace import TRACE_VERSION, Trace

if TYPE_CHECKING:  # a report is decoded by decode_report only: its types load there
    from .report import CaptureReport

__all__ = [
    "canonical_bytes",
    "sha256",
    "plan_digest",
    "seal",
    "read_document",
    "short_int",
    "decode_plan",
    "decode_trace",
    "decode_report",
    "convert",
    "validate_plan",
    "sniff_kind",
    "toml_parser",
]

T = TypeVar("T")


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


def canonical_bytes(obj: Any) -> bytes:
    """Sorted keys, indent 2, trailing newline: stable across machines and runs."""
    return msgspec.json.format(msgspec.json.encode(obj, order="sorted"), indent=2) + b"\n"


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def plan_digest(plan: Plan | dict) -> str:
    """Digest over every field, known or not, with ``digest`` blanked: a reader
    of an older revision still verifies fields it does not understand."""
    raw = plan if isinstance(plan, dict) else msgspec.to_builtins(plan)
    return sha256(canonical_bytes({**raw, "digest": ""}))


def seal(plan: Plan) -> Plan:
    """Return ``plan`` with its content digest filled in."""
    return msgspec.structs.replace(plan, digest=plan_digest(plan))


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


def short_int(n: int) -> str:
    """``n`` for a message: at most 24 characters ("10000000...(301 digits)")."""
    text = str(n) if n.bit_length() < 10000 else "a number of more than 3000 digits"
    return text if len(text) <= 24 else f"{text[:8]}...({len(text)} digits)"


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


def decode_plan(data: bytes, source: str, *, check_digest: bool = True) -> Plan:
    """Decode a plan file; refuses newer versions, truncation, tampering and plans
    whose parts do not fit together (:func:`validate_plan`)."""
    raw = _expect_kind(_parse(data, source, "plan", toml=False), "plan", source)
    version = raw.get("version")
    if sniff_kind(raw) is None and not (isinstance(version, int) and version > PLAN_VERSION):
        # some other JSON object: say so, rather than "missing `version`; rebuild the plan"
        raise WrongKindError("not a plan file: a plan has `command` and `steps`", where=source, fix=_WANT["plan"])
    _check_values(raw, source, "plan")
    _check_version(raw, source, "plan", PLAN_VERSION, "rebuild it with the command recorded in the plan")
    if check_digest:
        expected = plan_digest(raw)
        if raw.get("digest") != expected:
            found = raw.get("digest") if isinstance(raw.get("digest"), str) else None
            raise InputError(
                f"digest mismatch: file says {found or '(none)'}, content is {expected}",
                where=f"{source}: $.digest",
                fix="the file was edited by hand or corrupted; rebuild it from its record: "
                f"`planner check --fix {shlex.quote(source)}`",
            )
    return validate_plan(convert(raw, Plan, source, kind="plan"), source)


def validate_plan(plan: Plan, source: str) -> Plan:
    """Consistency a digest cannot prove (a sealed plan may come from a buggy or
    hostile writer): unique phases and step ids, steps indexed in order, every
    step's phase known, sizes among its phase's (listed once each), each step's
    id ``<op>/<phase>/<bs>`` (with its labels, :func:`capture_plan.schemas.keys.step_id`),
    captures one-to-one with the phases' graph keys (no key captured twice, none left
    out), edges between known steps, one timeline entry per step, and a build record
    that says the build ``command``, ``inputs`` and ``requires`` say
    (:func:`_record_agrees`). Graph keys
    (revision 3): a phase's variant axes and each axis's labels unique; a capture or
    warm-up step of a phase with variants has one label per axis, each the axis's,
    and no other step has labels; a capture step's ``pieces`` is its phase's; only
    warm-up steps keep bytes; ``predicted.keys``, when present, one per capture step
    in step order. The bounds of single fields (sizes 1..``MAX_BS``, tp >= 1, counts
    >= 0) are the plan types' own, checked when the plan is converted."""

    def bad(what: str, path: str) -> InputError:
        return InputError(what, where=f"{source}: {path}", fix=_FIX["plan"])

    phases: dict[str, set[int]] = {}
    by_name = {}
    for i, ph in enumerate(plan.phases):
        if ph.name in phases:
            raise bad(f"duplicate phase {ph.name!r}", f"$.phases[{i}].name")
        first: dict[int, int] = {}
        for j, bs in enumerate(ph.sizes):
            if bs in first:
                raise bad(
                    f"size {bs} listed twice (also $.phases[{i}].sizes[{first[bs]}])", f"$.phases[{i}].sizes[{j}]"
                )
            first[bs] = j
        _check_variants(ph, f"$.phases[{i}]", bad)
        phases[ph.name] = set(ph.sizes)
        by_name[ph.name] = ph
    ids: dict[str, int] = {}
    captured: set[tuple[str, int, tuple]] = set()
    for i, st in enumerate(plan.steps):
        path = f"$.steps[{i}]"
        if st.index != i:
            raise bad(f"step index {st.index} at position {i}", f"{path}.index")
        if st.phase not in phases:
            raise bad(f"unknown phase {st.phase!r}; phases are {sorted(phases)}", f"{path}.phase")
        # warm-ups and provisions run at a capture size too (every size, or the phase's largest)
        if st.bs not in phases[st.phase]:
            raise bad(f"size {st.bs} is not a capture size of phase {st.phase!r}", f"{path}.bs")
        ph = by_name[st.phase]
        _check_step_keys(ph, st, path, bad)
        labels = step_labels(ph, st)
        # the id is what edges, reports and logs name, so it must say what the step does;
        # unique ids that do then make every (op, key) unique: no key captured twice
        expected = step_id(st.op, st.phase, st.bs, labels)
        if st.id != expected:
            raise bad(f"step id {st.id!r} does not match its op, phase, size and labels ({expected!r})", f"{path}.id")
        if st.id in ids:
            what = "a graph key captured twice" if st.op == "capture" else "a step listed twice"
            raise bad(f"duplicate step id {st.id!r} (also $.steps[{ids[st.id]}]): {what}", f"{path}.id")
        ids[st.id] = i
        if st.op == "capture":
            captured.add((st.phase, st.bs, labels))
    for i, ph in enumerate(plan.phases):
        # a key never captured is padded past at replay or refused (the largest): not what the plan says
        axes = [] if ph.variants is msgspec.UNSET else [(a.name, a.labels) for a in ph.variants]
        combos = expand_labels(axes)
        missing = [(bs, c) for bs in ph.sizes for c in combos if (ph.name, bs, c) not in captured]
        if missing:
            if axes:
                shown = [step_id("capture", ph.name, bs, c) for bs, c in missing[:8]]
                what = "graph key(s) "
            else:
                shown = [str(bs) for bs, _ in missing[:8]]
                what = "size(s) "
            what += ", ".join(shown) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise bad(f"phase {ph.name!r} lists {what} that no capture step captures", f"$.phases[{i}].sizes")
    for i, e in enumerate(plan.edges):
        for end in ("src", "dst"):
            if getattr(e, end) not in ids:
                raise bad(f"edge to unknown step {getattr(e, end)!r}", f"$.edges[{i}].{end}")
    _record_agrees(plan, bad)
    timeline = plan.predicted.timeline
    if len(timeline) != len(plan.steps):
        raise bad(f"{len(timeline)} timeline entries for {len(plan.steps)} steps", "$.predicted.timeline")
    for i, m in enumerate(timeline):
        if m.step != i:
            raise bad(f"timeline entry for step {m.step} at position {i}", f"$.predicted.timeline[{i}].step")
    keys = plan.predicted.keys
    if keys:
        capture_ids = [s.id for s in plan.steps if s.op == "capture"]
        if len(keys) != len(capture_ids):
            raise bad(f"{len(keys)} key predictions for {len(capture_ids)} capture steps", "$.predicted.keys")
        for i, (k, sid) in enumerate(zip(keys, capture_ids)):
            if k.step != sid:
                raise bad(f"key prediction for {k.step!r} where {sid!r} is expected", f"$.predicted.keys[{i}].step")
    return plan


def _check_variants(ph: PhasePlan, path: str, bad) -> None:
    """A phase's variant axes: names unique, each axis's labels unique."""
    if ph.variants is msgspec.UNSET:
        return
    names: dict[str, int] = {}
    for a, axis in enumerate(ph.variants):
        if axis.name in names:
            raise bad(f"variant axis {axis.name!r} listed twice", f"{path}.variants[{a}].name")
        names[axis.name] = a
        seen: set[str] = set()
        for j, label in enumerate(axis.labels):
            if label in seen:
                raise bad(f"label {label!r} listed twice", f"{path}.variants[{a}].labels[{j}]")
            seen.add(label)


def _check_step_keys(ph: PhasePlan, st: Step, path: str, bad) -> None:
    """A step's graph-key fields against its phase (see :func:`validate_plan`)."""
    axes = [] if ph.variants is msgspec.UNSET else ph.variants
    keyed = st.op in ("capture", "warmup") and bool(axes)
    if st.labels is msgspec.UNSET:
        if keyed:
            raise bad(f"no labels for phase {ph.name!r}'s variant axes", f"{path}.labels")
    elif not keyed:
        why = f"phase {ph.name!r} has no variant axes" if not axes else f"a {st.op} step has no graph key"
        raise bad(f"labels on a step that takes none ({why})", f"{path}.labels")
    elif len(st.labels) != len(axes):
        raise bad(f"{len(st.labels)} labels for {len(axes)} variant axes", f"{path}.labels")
    else:
        for j, (label, axis) in enumerate(zip(st.labels, axes)):
            if label not in axis.labels:
                raise bad(f"{label!r} is not a label of axis {axis.name!r}", f"{path}.labels[{j}]")
    want_pieces = ph.pieces if st.op == "capture" else msgspec.UNSET
    if st.pieces != want_pieces:
        what = f"phase {ph.name!r} records {ph.pieces} pieces" if want_pieces is not msgspec.UNSET else "no pieces"
        raise bad(f"pieces = {st.pieces} where the plan says {what}", f"{path}.pieces")
    if st.keeps is not msgspec.UNSET and (st.op != "warmup" or ph.warmup_keeps is msgspec.UNSET):
        raise bad(f"a {st.op} step keeps bytes only a warm-up of a phase with warmup_keeps keeps", f"{path}.keeps")


def _record_agrees(plan: Plan, bad) -> None:
    """A plan that records its build (``inputs.build``, revision 2) says the same in
    the fields that repeat it: ``command`` is the record's text
    (:func:`capture_plan.schemas.plan.record_command`), and the backend, ``--ci``,
    ``--speculative``, pins, ``--tp`` and ``--calibration`` the record holds are the
    ones ``inputs`` and ``requires`` name. ``show`` and ``diff`` read those fields while
    ``planner check --fix`` rebuilds from the record: a plan whose two disagree (edited
    and sealed again) would be shown as one build and rebuilt as another."""
    rec = plan.inputs.build
    if isinstance(rec, msgspec.UnsetType):
        return
    recorded = " ".join(record_command(rec))
    if plan.command != record_command(rec):
        raise bad(
            f"`command` is `{' '.join(map(str, plan.command))}` but `inputs.build` records `{recorded}`",
            "$.command",
        )
    pairs: list[tuple[str, object, object]] = [
        ("$.inputs.backend", plan.inputs.backend, rec.backend),
        ("$.requires.backend", plan.requires.backend, rec.backend),
        ("$.inputs.ci", plan.inputs.ci, rec.ci),
        ("$.inputs.speculative", plan.inputs.speculative, rec.speculative),
        ("$.inputs.strategies", plan.inputs.strategies, rec.strategies),
        ("$.requires.tp", plan.requires.tp, plan.inputs.tp),
    ]
    if rec.tp is not None:
        pairs.append(("$.inputs.tp", plan.inputs.tp, rec.tp))
    calibration = None if isinstance(plan.inputs.calibration, msgspec.UnsetType) else plan.inputs.calibration
    pairs.append(("$.inputs.calibration", calibration, rec.calibration))
    for path, value, wanted in pairs:
        if value != wanted:
            raise bad(f"says {value!r} but the build it records (`{recorded}`) says {wanted!r}", path)


#: a run of trace events as JSON writes them, ``["alloc", 12, 4096, "temp"], ...`` (any
#: whitespace): arrays of scalars that hold no object key, so the duplicate-key check
#: reads each run as one ``0`` (an event written otherwise is checked as it is). A match
#: cannot start inside a string: its quotes would end the string where JSON allows none.
_EVENT = rb'\[\s*"(?:alloc|free)"\s*,\s*-?\d+\s*(?:,\s*-?\d+\s*(?:,\s*"[a-z]+"\s*)?)?\]'
#: at most 100 events a match: the regex engine keeps state for every repetition of a group
#: until its match ends (~800 B each: a run of 10 million events took 7.8 GiB), so a run is
#: replaced by a ``0`` per hundred events instead of one ``0``
_EVENTS = _EVENT + rb"(?:\s*,\s*" + _EVENT + rb"){0,100}"
_GOT = {"array": [], "str": "", "bool": True, "null": None}


def decode_trace(data: bytes, source: str) -> Trace:
    """Decode a recorded allocation trace: version, kinds, and the trace types'
    bounds (sizes 1..``MAX_BS``, allocations up to ``MAX_EVENT_BYTES``).

    Memory is the file and the decoded trace (about 4x a compact file's size,
    tests/test_traces.py measures it; the generic path of the other kinds built
    three copies of the document): the top-level keys are read as zero-copy
    ``msgspec.Raw`` views, the trace is decoded straight into its typed structs,
    and the duplicate-key check reads a copy in which every hundred events are
    one ``0`` (events are arrays and hold no keys, so no duplicate is hidden).
    Text that is not UTF-8 is a located error like any other malformed JSON.
    """
    data = _decode_text(data, source, "trace")
    if not data.strip():
        raise InputError("trace file is empty", where=source, fix=_FIX["trace"])
    try:
        head = msgspec.json.decode(data, type=dict[str, msgspec.Raw])
    except msgspec.ValidationError as err:  # valid JSON, not an object
        got = str(err).partition("got `")[2].partition("`")[0]
        _expect_kind(_GOT.get(got, 0), "trace", source)  # refuses every non-object, naming its type
        raise  # not reached
    except msgspec.DecodeError as err:
        raise _invalid_json(data, source, "trace", err) from None
    except RecursionError:
        raise InputError(f"nested deeper than {MAX_DEPTH} levels", where=source, fix=_FIX["trace"]) from None
    _expect_kind(head, "trace", source)
    _check_version(
        {"version": msgspec.json.decode(head["version"])} if "version" in head else {},
        source,
        "trace",
        TRACE_VERSION,
        "record the trace again with capture_plan.executor.profile",
    )
    del head
    try:  # nesting is bounded already: the first decode read the whole document
        trace = msgspec.json.decode(data, type=Trace)
    except msgspec.ValidationError as err:  # a bound of the types: the value is read from the bytes
        raise _located(err, source, "trace", data, Trace) from None
    except msgspec.DecodeError as err:  # what the Raw views skipped: invalid UTF-8 inside a string
        raise _invalid_json(data, source, "trace", err) from None
    _no_duplicate_keys(re.sub(_EVENTS, b"0", data), source, "trace")
    return trace


def decode_report(data: bytes, source: str) -> CaptureReport:
    """Decode a capture report; every number in it is a size, a count or seconds
    (>= 0, the report types' bounds)."""
    from .report import CaptureReport

    return convert(read_document(data, source, "report"), CaptureReport, source, kind="report")
