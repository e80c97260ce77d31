"""Atomic file writes, shared by planner and executor."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .errors import InputError

__all__ = ["write_atomic"]


def write_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary file beside ``path`` and rename: never half-written."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as err:
        raise InputError(f"cannot write: {err.strerror}", where=str(path), fix="choose a writable path") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as err:
        os.unlink(tmp)
        raise InputError(f"cannot write: {err.strerror}", where=str(path), fix="choose a writable path") from None
