"""Small helpers shared by the command modules: read a plan or report, located errors only."""

from __future__ import annotations

from pathlib import Path

__all__ = ["read_plan", "read_report"]


def read_plan(path: Path):
    from schemas.codec import decode_plan
    from schemas.files import read_input

    return decode_plan(read_input(path, "plan"), str(path))


def read_report(path: Path):
    from schemas.codec import decode_report
    from schemas.files import read_input

    return decode_report(read_input(path, "report"), str(path))
