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
import sys
from collections.abc import Collection, Mapping
from pathlib import PurePath
from typing import Any, TypeVar

import msgspec

from .errors import InputError, WrongKindError
from .limits import (
    MAX_BS,
    MAX_CAPTURES,
    MAX_DEPTH,
    MAX_EVENT_BYTES,
    MAX_INT,
    MAX_MIB,
    MAX_PHASES,
    MAX_RULES,
    MAX_SIZES_PER_PHASE,
    MAX_TOKENS_PER_REQUEST,
    MODEL_MAX,
    MODEL_MAX_DEFAULT,
)
from .plan import PLAN_VERSION, Plan
from .report import CaptureReport
from .spec import SPEC_VERSION, Model, Phase, Spec, phase_model
from .strategy import PHASE_SETTINGS
from .trace import TRACE_VERSION, Trace

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = [
    "canonical_bytes",
    "sha256",
    "plan_digest",
    "seal",
    "decode_spec",
    "decode_plan",
    "decode_trace",
    "decode_report",
    "convert",
    "validate_spec",
    "validate_plan",
    "sniff_kind",
    "check_phase_kind",
]

T = TypeVar("T")


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
    "plan": "rebuild the plan with the `planner build` command it records",
    "trace": "record the trace again with capture_plan.executor.profile",
    "report": "write the report again with GraphSet.write_report",
}
_WANT = {
    "spec": "pass a spec (TOML or JSON, `planner schema spec`)",
    "plan": "pass a plan file written by `planner build` (plans/*.json)",
    "trace": "pass a trace recorded by capture_plan.executor.profile (plans/traces/*.json)",
    "report": "pass a report written by GraphSet.write_report",
}


def _located(err: msgspec.ValidationError, source: str, fix: str | None = None) -> InputError:
    # msgspec says "Expected `int` >= 1, got `0` - at `$.phases[0].sizes[3]`";
    # re-shape it to "<file>: $.phases[0].sizes[3]: Expected ..."
    text = str(err)
    what, sep, path = text.rpartition(" - at `")
    if sep:
        return InputError(what, where=f"{source}: {path.rstrip('`')}", fix=fix)
    return InputError(text, where=f"{source}: $", fix=fix)


def convert(obj: Any, type_: type[T], source: str, *, kind: str | None = None) -> T:
    try:
        return msgspec.convert(obj, type_)
    except msgspec.ValidationError as err:
        raise _located(err, source, _FIX.get(kind or "")) from None
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


def _bad_value(obj: Any, non_negative: bool) -> str | None:
    """Why one leaf value is refused, or None."""
    if isinstance(obj, bool) or not isinstance(obj, (int, float)):
        return None
    if isinstance(obj, int):
        if abs(obj) > MAX_INT:
            return f"number out of range: {_short(obj)} (the limit is 2**53)"
    elif not math.isfinite(obj) or abs(obj) > MAX_INT:
        return f"number out of range: {obj!r}"
    if non_negative and obj < 0:
        return f"must be >= 0, got {obj!r}"
    return None


def _check_values(raw: Any, source: str, kind: str, *, non_negative: bool = False) -> None:
    """Every number finite and within ``MAX_INT`` (``non_negative``: also >= 0),
    nesting at most ``MAX_DEPTH``: absurd values are refused here, located,
    instead of overflowing deep inside a build. Iterative: no recursion limit.
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
            why = _bad_value(obj, non_negative)
            if why:
                raise InputError(why, where=f"{source}: {_spell(path)}", fix=_FIX[kind])


def _spell(path: tuple) -> str:
    """``(((), "a"), 0)`` -> ``$.a[0]``; a linked list keeps the walk cheap."""
    parts = []
    while path:
        path, key = path
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    return "$" + "".join(reversed(parts))


def _short(n: int) -> str:
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
        try:
            raw = tomllib.loads(data.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
            raise InputError(f"malformed TOML: {err}", where=source) from None
        except RecursionError:
            raise InputError(f"nested deeper than {MAX_DEPTH} levels", where=source, fix=_FIX[kind]) from None
        except ValueError as err:  # e.g. an integer of more than 4300 digits
            raise InputError(f"malformed TOML: {err}", where=source, fix=_FIX[kind]) from None
        return raw
    what = "malformed JSON" if kind == "spec" else "not valid JSON (truncated or corrupted?)"
    try:
        raw = msgspec.json.decode(data)
    except msgspec.DecodeError as err:
        fix = _FIX[kind] if kind != "spec" else None
        if kind == "spec" and PurePath(source).suffix.lower() != ".json":
            # a TOML spec named spec.txt or spec.tml is read as JSON: say why
            fix = "a spec is read as TOML only when its name ends in .toml, else as JSON: rename a TOML spec"
        raise InputError(f"{what}: {err}", where=source, fix=fix) from None
    except RecursionError:
        raise InputError(f"nested deeper than {MAX_DEPTH} levels", where=source, fix=_FIX[kind]) from None
    _no_duplicate_keys(data, source, kind)
    return raw


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


#: a phase setting left at this value is unset (no kind needs to accept it)
_UNSET_SETTING = {f.name: f.default for f in msgspec.structs.fields(Phase) if f.name in PHASE_SETTINGS}


def validate_spec(spec: Spec, source: str, *, phase_kinds: Mapping[str, Collection[str]]) -> Spec:
    """Checks a msgspec type cannot express, each located by JSON path: version,
    unique names and sizes, known ``after`` targets, the resource limits of
    :mod:`capture_plan.schemas.limits`, and phase kinds: ``phase_kinds`` maps each kind a
    spec may name to the settings (:data:`capture_plan.schemas.strategy.PHASE_SETTINGS`)
    it accepts; the planner passes planner/data/phase_kinds.toml's (this
    package does not read the planner's data). A setting a phase's kind does
    not accept is refused rather than silently ignored."""
    if spec.version != SPEC_VERSION:
        newer = spec.version > SPEC_VERSION
        raise InputError(
            f"spec version {spec.version} is {'newer than' if newer else 'not'} the supported version {SPEC_VERSION}",
            where=f"{source}: $.version",
            fix="upgrade capture-plan" if newer else f"write version = {SPEC_VERSION} or leave it out",
        )
    if len(spec.phases) > MAX_PHASES:
        raise InputError(
            f"{len(spec.phases)} phases, over the limit of {MAX_PHASES}",
            where=f"{source}: $.phases",
            fix="split the spec into several plans",
        )
    if len(spec.rules) > MAX_RULES:
        raise InputError(
            f"{len(spec.rules)} rules, over the limit of {MAX_RULES}",
            where=f"{source}: $.rules",
            fix="merge rules that say the same thing",
        )
    for field, value in msgspec.structs.asdict(spec.model).items():
        bound = MODEL_MAX.get(field, MODEL_MAX_DEFAULT)
        if isinstance(value, int) and not isinstance(value, bool) and value > bound:
            raise InputError(
                f"{field} = {_short(value)} is over the limit of {bound:,}",
                where=f"{source}: $.model.{field}",
                fix="give the model's real dimensions",
            )
    for field in ("budget_mib", "library_mib"):
        value = getattr(spec, field)
        if value is not None and not (math.isfinite(value) and value <= MAX_MIB):
            raise InputError(
                f"{field} = {value!r} is over the limit of {MAX_MIB:,.0f} (1 PiB)",
                where=f"{source}: $.{field}",
                fix="give a real amount of memory in MiB",
            )
    captures = 0
    names: dict[str, int] = {}
    for i, phase in enumerate(spec.phases):
        if phase.name in names:
            raise InputError(
                f"duplicate phase name {phase.name!r} (also $.phases[{names[phase.name]}])",
                where=f"{source}: $.phases[{i}].name",
                fix="give every phase a unique name",
            )
        names[phase.name] = i
        if len(phase.sizes) > MAX_SIZES_PER_PHASE:
            raise InputError(
                f"{len(phase.sizes)} capture sizes, over the limit of {MAX_SIZES_PER_PHASE} per phase",
                where=f"{source}: $.phases[{i}].sizes",
                fix="capture fewer sizes (pad to the next one)",
            )
        captures += len(phase.sizes)
        if captures > MAX_CAPTURES:
            raise InputError(
                f"over {MAX_CAPTURES} capture sizes in all phases together",
                where=f"{source}: $.phases[{i}].sizes",
                fix="capture fewer sizes (pad to the next one)",
            )
        if phase.tokens_per_request > MAX_TOKENS_PER_REQUEST:
            raise InputError(
                f"tokens_per_request = {_short(phase.tokens_per_request)} is over the limit of "
                f"{MAX_TOKENS_PER_REQUEST}",
                where=f"{source}: $.phases[{i}].tokens_per_request",
            )
        check_phase_kind(phase.kind, phase_kinds, f"{source}: $.phases[{i}].kind")
        # e.g. draft steps and top-k shape only the draft phases' graphs: elsewhere they would be ignored
        for field, unset in _UNSET_SETTING.items():
            value = getattr(phase, field)
            if value != unset and field not in phase_kinds[phase.kind]:
                kinds = sorted(k for k, accepted in phase_kinds.items() if field in accepted)
                what = f"{field} = {_short(value)}" if isinstance(value, int) else field
                raise InputError(
                    f"{what} has no meaning for a {phase.kind} phase",
                    where=f"{source}: $.phases[{i}].{field}",
                    fix=f"set {field} on {' or '.join(kinds)} phases only" if kinds else f"leave {field} out",
                )
        for field in ("steps", "topk"):
            value = getattr(phase, field)
            if value > MAX_TOKENS_PER_REQUEST:
                raise InputError(
                    f"{field} = {_short(value)} is over the limit of {MAX_TOKENS_PER_REQUEST}",
                    where=f"{source}: $.phases[{i}].{field}",
                )
        if phase.model is not msgspec.UNSET:
            _check_phase_model(spec.model, phase, f"{source}: $.phases[{i}].model")
        if phase.layers is not None and phase.layers > MODEL_MAX["layers"]:
            raise InputError(
                f"layers = {_short(phase.layers)} is over the limit of {MODEL_MAX['layers']}",
                where=f"{source}: $.phases[{i}].layers",
            )
        seen: dict[int, int] = {}
        for j, bs in enumerate(phase.sizes):
            if bs > MAX_BS:
                raise InputError(
                    f"capture size {_short(bs)} is over the limit of {MAX_BS}",
                    where=f"{source}: $.phases[{i}].sizes[{j}]",
                    fix=f"capture sizes up to {MAX_BS}",
                )
            if bs in seen:
                raise InputError(
                    f"duplicate capture size {bs} (also $.phases[{i}].sizes[{seen[bs]}])",
                    where=f"{source}: $.phases[{i}].sizes[{j}]",
                    fix="list each size once",
                )
            seen[bs] = j
    for i, phase in enumerate(spec.phases):
        for j, dep in enumerate(phase.after):
            if dep not in names:
                raise InputError(
                    f"unknown phase {dep!r}; phases are {sorted(names)}", where=f"{source}: $.phases[{i}].after[{j}]"
                )
            if dep == phase.name:
                raise InputError("a phase cannot come after itself", where=f"{source}: $.phases[{i}].after[{j}]")
    rule_ids: set[str] = set()
    for i, rule in enumerate(spec.rules):
        if rule.id in rule_ids:
            raise InputError(f"duplicate rule id {rule.id!r}", where=f"{source}: $.rules[{i}].id")
        rule_ids.add(rule.id)
        for j, kind in enumerate(rule.when.phase_kind or ()):
            check_phase_kind(kind, phase_kinds, f"{source}: $.rules[{i}].when.phase_kind[{j}]")
    if spec.model.heads % spec.model.kv_heads:
        raise InputError("heads must be a multiple of kv_heads", where=f"{source}: $.model.kv_heads")
    if spec.trace is not None and "\x00" in spec.trace:
        raise InputError("trace path contains a NUL byte", where=f"{source}: $.trace", fix="check the path")
    return spec


def _check_phase_model(model: Model, phase: Phase, where: str) -> None:
    """A phase's own dimensions: at least one, each within :data:`MODEL_MAX`, and
    heads a multiple of kv_heads once merged with the spec's ``[model]``."""
    own = {f: v for f, v in msgspec.structs.asdict(phase.model).items() if v is not msgspec.UNSET}
    if not own:
        raise InputError(
            "model sets no dimension",
            where=where,
            fix="give the dimensions this phase's model differs in (e.g. hidden, vocab), or leave it out",
        )
    for field, value in own.items():
        bound = MODEL_MAX.get(field, MODEL_MAX_DEFAULT)
        if value > bound:
            raise InputError(
                f"{field} = {_short(value)} is over the limit of {bound:,}",
                where=f"{where}.{field}",
                fix="give the draft model's real dimensions",
            )
    merged = phase_model(model, phase)
    if merged.heads % merged.kv_heads:
        field = "kv_heads" if "kv_heads" in own else "heads"
        raise InputError(
            f"heads = {merged.heads} must be a multiple of kv_heads = {merged.kv_heads} (the phase's "
            "own, else [model]'s)",
            where=f"{where}.{field}",
            fix="give the draft's heads and kv_heads",
        )


def check_phase_kind(kind: str, phase_kinds: Mapping[str, Collection[str]], where: str) -> None:
    """Refuse a phase kind that is not a key of ``phase_kinds`` (see :func:`validate_spec`)."""
    if kind not in phase_kinds:
        raise InputError(
            f"unknown phase kind {kind!r}", where=where, fix=f"use one of {', '.join(sorted(phase_kinds))}"
        )


def decode_spec(data: bytes, source: str, *, phase_kinds: Mapping[str, Collection[str]]) -> Spec:
    """Parse a TOML (by ``.toml`` suffix) or JSON spec; every error is located."""
    raw = _expect_kind(_parse(data, source, "spec"), "spec", source)
    _check_values(raw, source, "spec")
    return validate_spec(convert(raw, Spec, source, kind="spec"), source, phase_kinds=phase_kinds)


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
    _check_values(raw, source, "plan", non_negative=True)
    _check_version(raw, source, "plan", PLAN_VERSION, "rebuild it with the command recorded in the plan")
    if check_digest:
        expected = plan_digest(raw)
        if raw.get("digest") != expected:
            found = raw.get("digest") if isinstance(raw.get("digest"), str) else None
            raise InputError(
                f"digest mismatch: file says {found or '(none)'}, content is {expected}",
                where=f"{source}: $.digest",
                fix="the file was edited by hand or corrupted; rebuild it with `planner build`",
            )
    return validate_plan(convert(raw, Plan, source, kind="plan"), source)


def validate_plan(plan: Plan, source: str) -> Plan:
    """Consistency a digest cannot prove (a sealed plan may come from a buggy or
    hostile writer): unique phases and step ids, steps indexed in order, every
    step's phase known, sizes within ``MAX_BS`` and among its phase's (listed
    once each), each step's id ``<op>/<phase>/<bs>``, captures one-to-one with
    the phases' sizes (no (phase, size) captured twice, none left out), edges
    between known steps, one timeline entry per step, tp >= 1."""

    def bad(what: str, path: str) -> InputError:
        return InputError(what, where=f"{source}: {path}", fix=_FIX["plan"])

    phases: dict[str, set[int]] = {}
    for i, ph in enumerate(plan.phases):
        if ph.name in phases:
            raise bad(f"duplicate phase {ph.name!r}", f"$.phases[{i}].name")
        if not ph.sizes or any(not 1 <= bs <= MAX_BS for bs in ph.sizes):
            raise bad(f"capture sizes must be 1..{MAX_BS}, at least one", f"$.phases[{i}].sizes")
        first: dict[int, int] = {}
        for j, bs in enumerate(ph.sizes):
            if bs in first:
                raise bad(
                    f"size {bs} listed twice (also $.phases[{i}].sizes[{first[bs]}])", f"$.phases[{i}].sizes[{j}]"
                )
            first[bs] = j
        phases[ph.name] = set(ph.sizes)
    ids: dict[str, int] = {}
    captured: set[tuple[str, int]] = set()
    for i, st in enumerate(plan.steps):
        path = f"$.steps[{i}]"
        if st.index != i:
            raise bad(f"step index {st.index} at position {i}", f"{path}.index")
        if st.phase not in phases:
            raise bad(f"unknown phase {st.phase!r}; phases are {sorted(phases)}", f"{path}.phase")
        # warm-ups and provisions run at a capture size too (every size, or the phase's largest)
        if not 1 <= st.bs <= MAX_BS or st.bs not in phases[st.phase]:
            raise bad(f"size {st.bs} is not a capture size of phase {st.phase!r}", f"{path}.bs")
        # the id is what edges, reports and logs name, so it must say what the step does;
        # unique ids that do then make every (op, phase, size) unique: no size captured twice
        expected = f"{st.op}/{st.phase}/{st.bs}"
        if st.id != expected:
            raise bad(f"step id {st.id!r} does not match its op, phase and size ({expected!r})", f"{path}.id")
        if st.id in ids:
            what = "a size captured twice" if st.op == "capture" else "a step listed twice"
            raise bad(f"duplicate step id {st.id!r} (also $.steps[{ids[st.id]}]): {what}", f"{path}.id")
        ids[st.id] = i
        if st.op == "capture":
            captured.add((st.phase, st.bs))
    for i, ph in enumerate(plan.phases):
        # a size never captured is padded past at replay or refused (the largest): not what the plan says
        missing = sorted(bs for bs in ph.sizes if (ph.name, bs) not in captured)
        if missing:
            shown = ", ".join(map(str, missing[:8])) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise bad(f"phase {ph.name!r} lists size(s) {shown} that no capture step captures", f"$.phases[{i}].sizes")
    for i, e in enumerate(plan.edges):
        for end in ("src", "dst"):
            if getattr(e, end) not in ids:
                raise bad(f"edge to unknown step {getattr(e, end)!r}", f"$.edges[{i}].{end}")
    timeline = plan.predicted.timeline
    if len(timeline) != len(plan.steps):
        raise bad(f"{len(timeline)} timeline entries for {len(plan.steps)} steps", "$.predicted.timeline")
    for i, m in enumerate(timeline):
        if m.step != i:
            raise bad(f"timeline entry for step {m.step} at position {i}", f"$.predicted.timeline[{i}].step")
    for path, tp in (("$.inputs.tp", plan.inputs.tp), ("$.requires.tp", plan.requires.tp)):
        if tp < 1:
            raise bad(f"tp must be >= 1, got {tp}", path)
    if len(plan.requires.min_compute_capability) != 2:
        raise bad("must be [major, minor]", "$.requires.min_compute_capability")
    return plan


#: a run of trace events as JSON writes them, ``["alloc", 12, 4096, "temp"], ...`` (any
#: whitespace): arrays of scalars that hold no object key, so the duplicate-key check
#: reads each run as one ``0`` (an event written otherwise is checked as it is). A match
#: cannot start inside a string: its quotes would end the string where JSON allows none.
_EVENT = rb'\[\s*"(?:alloc|free)"\s*,\s*-?\d+\s*(?:,\s*-?\d+\s*(?:,\s*"[a-z]+"\s*)?)?\]'
_EVENTS = re.compile(_EVENT + rb"(?:\s*,\s*" + _EVENT + rb")*")
_GOT = {"array": [], "str": "", "bool": True, "null": None}


def decode_trace(data: bytes, source: str) -> Trace:
    """Decode a recorded allocation trace: version, sizes within limits, kinds.

    Memory stays near the file's size, not a multiple of it (traces may be
    hundreds of MiB; the generic path of the other kinds built three copies of
    the document): the top-level keys are read as zero-copy ``msgspec.Raw``
    views, the trace is decoded straight into its typed structs, and the
    duplicate-key check reads a copy in which every run of events is one ``0``
    (events are arrays and hold no keys, so no duplicate is hidden).
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
        raise InputError(f"not valid JSON (truncated or corrupted?): {err}", where=source, fix=_FIX["trace"]) from None
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
    except msgspec.ValidationError as err:
        raise _located(err, source, _FIX["trace"]) from None
    _no_duplicate_keys(_EVENTS.sub(b"0", data), source, "trace")
    for i, cap in enumerate(trace.captures):
        if cap.bs > MAX_BS:
            raise InputError(
                f"capture size {_short(cap.bs)} is over the limit of {MAX_BS}",
                where=f"{source}: $.captures[{i}].bs",
                fix=_FIX["trace"],
            )
        for j, ev in enumerate(cap.events):
            if ev.size > MAX_EVENT_BYTES:
                raise InputError(
                    f"allocation of {_short(ev.size)} bytes is over the limit of {MAX_EVENT_BYTES:,}",
                    where=f"{source}: $.captures[{i}].events[{j}]",
                    fix=_FIX["trace"],
                )
            if ev.id > MAX_INT:
                raise InputError(
                    f"block id {_short(ev.id)} is out of range",
                    where=f"{source}: $.captures[{i}].events[{j}]",
                    fix=_FIX["trace"],
                )
    return trace


def decode_report(data: bytes, source: str) -> CaptureReport:
    """Decode a capture report; every number in it is a size, a count or seconds (>= 0)."""
    raw = _expect_kind(_parse(data, source, "report", toml=False), "report", source)
    _check_values(raw, source, "report", non_negative=True)
    return convert(raw, CaptureReport, source, kind="report")
