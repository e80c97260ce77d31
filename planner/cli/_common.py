"""Small helpers shared by the command modules."""

from __future__ import annotations

from pathlib import Path

__all__ = ["read_plan", "read_report"]


def read_plan(path: Path):
    from schemas.codec import decode_plan
    from schemas.errors import InputError

    try:
        data = path.read_bytes()
    except OSError as err:
        raise InputError(f"cannot read plan: {err.strerror}", where=str(path)) from None
    return decode_plan(data, str(path))


def read_report(path: Path):
    import msgspec

    from schemas.codec import convert
    from schemas.errors import InputError
    from schemas.report import CaptureReport

    try:
        raw = msgspec.json.decode(path.read_bytes())
    except OSError as err:
        raise InputError(f"cannot read report: {err.strerror}", where=str(path)) from None
    except msgspec.DecodeError as err:
        raise InputError(f"not valid JSON: {err}", where=str(path)) from None
    return convert(raw, CaptureReport, str(path))
