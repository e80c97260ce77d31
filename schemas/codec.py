"""Reading and writing the shared types: located errors, canonical bytes.

Canonical bytes (plans, traces, reports): JSON with sorted keys, two-space
indent, trailing newline, no floats in plans. The digest of a plan is the
SHA-256 of its canonical bytes with ``digest`` set to "" -- so a plan file can
be checked for tampering or truncation without knowing how it was built.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import PurePath
from typing import Any, TypeVar

import msgspec

from .errors import InputError
from .plan import PLAN_VERSION, Plan
from .spec import Spec
from .trace import TRACE_VERSION, Trace

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = [
    "canonical_bytes", "sha256", "plan_digest", "seal", "decode_spec", "decode_plan",
    "decode_trace", "convert", "validate_spec",
]

T = TypeVar("T")


def canonical_bytes(obj: Any) -> bytes:
    """Sorted keys, indent 2, trailing newline: stable across machines and runs."""
    return msgspec.json.format(msgspec.json.encode(obj, order="sorted"), indent=2) + b"\n"


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def plan_digest(plan: "Plan | dict") -> str:
    """Digest over every field, known or not, with ``digest`` blanked: a reader
    of an older revision still verifies fields it does not understand."""
    raw = plan if isinstance(plan, dict) else msgspec.to_builtins(plan)
    return sha256(canonical_bytes({**raw, "digest": ""}))


def seal(plan: Plan) -> Plan:
    """Return ``plan`` with its content digest filled in."""
    return msgspec.structs.replace(plan, digest=plan_digest(plan))


def _located(err: msgspec.ValidationError, source: str) -> InputError:
    # msgspec says "Expected `int` >= 1, got `0` - at `$.phases[0].sizes[3]`";
    # re-shape it to "<file>: $.phases[0].sizes[3]: Expected ..."
    text = str(err)
    what, sep, path = text.rpartition(" - at `")
    if sep:
        return InputError(what, where=f"{source}: {path.rstrip('`')}")
    return InputError(text, where=f"{source}: $")


def convert(obj: Any, type_: type[T], source: str) -> T:
    try:
        return msgspec.convert(obj, type_)
    except msgspec.ValidationError as err:
        raise _located(err, source) from None


def _parse(data: bytes, source: str) -> Any:
    if not data.strip():
        raise InputError("file is empty", where=source, fix="write a spec (see `planner schema`)")
    if PurePath(source).suffix.lower() == ".toml":
        try:
            return tomllib.loads(data.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
            raise InputError(f"malformed TOML: {err}", where=source) from None
    try:
        return msgspec.json.decode(data)
    except msgspec.DecodeError as err:
        raise InputError(f"malformed JSON: {err}", where=source) from None


def validate_spec(spec: Spec, source: str) -> Spec:
    """Checks a msgspec type cannot express, each located by JSON path."""
    names: dict[str, int] = {}
    for i, phase in enumerate(spec.phases):
        if phase.name in names:
            raise InputError(f"duplicate phase name {phase.name!r} (also $.phases[{names[phase.name]}])",
                             where=f"{source}: $.phases[{i}].name", fix="give every phase a unique name")
        names[phase.name] = i
        seen: dict[int, int] = {}
        for j, bs in enumerate(phase.sizes):
            if bs in seen:
                raise InputError(f"duplicate capture size {bs} (also $.phases[{i}].sizes[{seen[bs]}])",
                                 where=f"{source}: $.phases[{i}].sizes[{j}]", fix="list each size once")
            seen[bs] = j
    for i, phase in enumerate(spec.phases):
        for j, dep in enumerate(phase.after):
            if dep not in names:
                raise InputError(f"unknown phase {dep!r}; phases are {sorted(names)}",
                                 where=f"{source}: $.phases[{i}].after[{j}]")
            if dep == phase.name:
                raise InputError("a phase cannot come after itself", where=f"{source}: $.phases[{i}].after[{j}]")
    rule_ids: set[str] = set()
    for i, rule in enumerate(spec.rules):
        if rule.id in rule_ids:
            raise InputError(f"duplicate rule id {rule.id!r}", where=f"{source}: $.rules[{i}].id")
        rule_ids.add(rule.id)
    if spec.model.heads % spec.model.kv_heads:
        raise InputError("heads must be a multiple of kv_heads", where=f"{source}: $.model.kv_heads")
    return spec


def decode_spec(data: bytes, source: str) -> Spec:
    """Parse a TOML (by ``.toml`` suffix) or JSON spec; every error is located."""
    obj = _parse(data, source)
    if not isinstance(obj, dict):
        raise InputError("a spec must be a table/object", where=f"{source}: $")
    return validate_spec(convert(obj, Spec, source), source)


def decode_plan(data: bytes, source: str, *, check_digest: bool = True) -> Plan:
    """Decode a plan file; refuses newer versions, truncation and tampering."""
    if not data.strip():
        raise InputError("plan file is empty", where=source, fix="rebuild it with the command in its header")
    try:
        raw = msgspec.json.decode(data)
    except msgspec.DecodeError as err:
        raise InputError(f"not valid JSON (truncated or corrupted?): {err}", where=source,
                         fix="rebuild the plan with `planner build`") from None
    if not isinstance(raw, dict):
        raise InputError("a plan must be a JSON object", where=f"{source}: $")
    version = raw.get("version")
    if not isinstance(version, int):
        raise InputError("missing or non-integer `version`", where=f"{source}: $.version")
    if version > PLAN_VERSION:
        raise InputError(f"plan version {version} is newer than this capture-plan understands ({PLAN_VERSION})",
                         where=source, fix="upgrade capture-plan, or rebuild the plan with this version")
    if version < PLAN_VERSION:
        raise InputError(f"plan version {version} is older than this capture-plan's ({PLAN_VERSION})",
                         where=source, fix="rebuild it with the command recorded in the plan")
    plan = convert(raw, Plan, source)
    if check_digest:
        expected = plan_digest(raw)
        if plan.digest != expected:
            raise InputError(f"digest mismatch: file says {plan.digest or '(none)'}, content is {expected}",
                             where=f"{source}: $.digest",
                             fix="the file was edited by hand or corrupted; rebuild it with `planner build`")
    return plan


def decode_trace(data: bytes, source: str) -> Trace:
    if not data.strip():
        raise InputError("trace file is empty", where=source)
    try:
        raw = msgspec.json.decode(data)
    except msgspec.DecodeError as err:
        raise InputError(f"not valid JSON (truncated?): {err}", where=source,
                         fix="record it again with executor.profile") from None
    if isinstance(raw, dict) and isinstance(raw.get("version"), int) and raw["version"] > TRACE_VERSION:
        raise InputError(f"trace version {raw['version']} is newer than supported ({TRACE_VERSION})", where=source)
    return convert(raw, Trace, source)
