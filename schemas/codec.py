"""Reading and writing the shared files: canonical bytes, the plan's digest and seal, and
the decoders of plans, traces and reports.

Reading a file is three steps, each its own module's: its bytes decoded to builtins
(:mod:`~capture_plan.schemas.documents`), converted to the schema types with every
violation one located line (:mod:`~capture_plan.schemas.conversion`), and, for a plan,
its parts checked against each other (:mod:`~capture_plan.schemas.plan_check`).

Canonical bytes (plans, traces, reports): JSON with sorted keys, two-space
indent, trailing newline, no floats in plans. The digest of a plan is the
SHA-256 of its canonical bytes with ``digest`` set to "" -- so a plan file can
be checked for tampering or truncation without knowing how it was built.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import msgspec

from .conversion import _FIX, _WANT, _located, convert
from .documents import (
    _check_values,
    _check_version,
    _decode_text,
    _expect_kind,
    _invalid_json,
    _no_duplicate_keys,
    _parse,
    read_document,
    sniff_kind,
)
from .errors import InputError, WrongKindError
from .hashing import sha256_hex
from .limits import MAX_DEPTH
from .plan import PLAN_VERSION, Plan
from .trace import TRACE_VERSION, Trace

if TYPE_CHECKING:  # a report is decoded by decode_report only: its types load there
    from .report import CaptureReport

__all__ = [
    "canonical_bytes",
    "sha256",
    "plan_digest",
    "seal",
    "decode_plan",
    "decode_trace",
    "decode_report",
]


def canonical_bytes(obj: Any) -> bytes:
    """Sorted keys, indent 2, trailing newline: stable across machines and runs."""
    return msgspec.json.format(msgspec.json.encode(obj, order="sorted"), indent=2) + b"\n"


def sha256(data: bytes) -> str:
    return "sha256:" + sha256_hex(data)


def plan_digest(plan: Plan | dict) -> str:
    """Digest over every field, known or not, with ``digest`` blanked: a reader
    of an older revision still verifies fields it does not understand."""
    raw = plan if isinstance(plan, dict) else msgspec.to_builtins(plan)
    return sha256(canonical_bytes({**raw, "digest": ""}))


def seal(plan: Plan) -> Plan:
    """Return ``plan`` with its content digest filled in."""
    return msgspec.structs.replace(plan, digest=plan_digest(plan))


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
            import shlex  # only for this message: not loaded by every build and load

            found = raw.get("digest") if isinstance(raw.get("digest"), str) else None
            raise InputError(
                f"digest mismatch: file says {found or '(none)'}, content is {expected}",
                where=f"{source}: $.digest",
                fix="the file was edited by hand or corrupted; rebuild it from its record: "
                f"`planner check --fix {shlex.quote(source)}`",
            )
    from .plan_check import validate_plan  # a build writes plans without reading one: loaded here

    return validate_plan(convert(raw, Plan, source, kind="plan"), source)


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
