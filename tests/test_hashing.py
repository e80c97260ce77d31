"""Digests without OpenSSL for small inputs (schemas/hashing.py): the same digests as
hashlib's at every length, on either side of the threshold and without the built-in
modules."""

from __future__ import annotations

import hashlib

import pytest

from capture_plan.schemas import hashing


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 4096, hashing.SMALL - 1, hashing.SMALL, hashing.SMALL + 1])
def test_digests_equal_hashlibs_at_every_length(n):
    data = bytes(i * 7 % 251 for i in range(n))
    assert hashing.sha256_hex(data) == hashlib.sha256(data).hexdigest()
    assert hashing.sha1_hex(data) == hashlib.sha1(data).hexdigest()


def test_an_interpreter_without_the_builtin_modules_uses_hashlib(monkeypatch):
    monkeypatch.setattr(hashing, "_SHA256", None)
    monkeypatch.setattr(hashing, "_SHA1", None)
    assert hashing.sha256_hex(b"plan") == hashlib.sha256(b"plan").hexdigest()
    assert hashing.sha1_hex(b"plan") == hashlib.sha1(b"plan").hexdigest()


def test_this_interpreter_has_the_builtin_sha256():
    """CPython ships _sha2 (3.12+) or _sha256: where it is missing the Quickstart build
    loads OpenSSL again, which tests/test_startup_imports.py would also show."""
    assert hashing._SHA256 is not None and hashing._SHA1 is not None
