"""SHA digests of small inputs without loading OpenSSL.

Importing :mod:`hashlib` loads OpenSSL: about 11 million instructions (valgrind's
callgrind, CPython 3.11), 3.5% of the whole Quickstart build, whose digests are of a few
kilobytes (the plan, the spec, a data file, an output file's name). CPython's own
SHA-256 and SHA-1 (``_sha2`` from 3.12, ``_sha256`` before; ``_sha1``) cost nothing to
import and give the same digests, slower per byte: an input of :data:`SMALL` bytes or
more (a long trace, a model's config) goes to hashlib, loaded then. An interpreter without
the built-in modules (built without them) uses hashlib for everything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["SMALL", "sha256_hex", "sha1_hex"]

#: inputs this long or longer are hashed by hashlib (OpenSSL: faster per byte)
SMALL = 1 << 20


def _builtin(modules: tuple[str, ...], name: str) -> Callable[[bytes], Any] | None:
    import importlib

    for module in modules:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    return None


_SHA256 = _builtin(("_sha2", "_sha256"), "sha256")
_SHA1 = _builtin(("_sha1",), "sha1")


def sha256_hex(data: bytes) -> str:
    """The SHA-256 of ``data``, as hex."""
    if _SHA256 is not None and len(data) < SMALL:
        return _SHA256(data).hexdigest()
    import hashlib

    return hashlib.sha256(data).hexdigest()


def sha1_hex(data: bytes) -> str:
    """The SHA-1 of ``data``, as hex (for names, not for trust)."""
    if _SHA1 is not None and len(data) < SMALL:
        return _SHA1(data).hexdigest()
    import hashlib

    return hashlib.sha1(data).hexdigest()
