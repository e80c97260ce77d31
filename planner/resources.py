"""The planner's data files (rules, backends, presets), loaded once.

Data lives in ``planner/data/*.toml`` so that a reviewer changes a rule by
editing data, not an if-chain. Their bytes feed ``rules_digest`` in every plan:
changing a rule makes every checked-in plan stale, which CI then reports.
"""

from __future__ import annotations

import functools
import sys
from importlib import resources
from typing import Any

from schemas.codec import convert, sha256
from schemas.errors import InputError
from schemas.spec import Choice, Rule

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["data_bytes", "data", "builtin_rules", "baseline", "backends", "rules_digest", "BACKENDS"]

_FILES = ("rules.toml", "backends.toml", "presets.toml")


def data_bytes(name: str) -> bytes:
    return resources.files("planner").joinpath("data").joinpath(name).read_bytes()


@functools.cache
def data(name: str) -> dict[str, Any]:
    try:
        return tomllib.loads(data_bytes(name).decode())
    except tomllib.TOMLDecodeError as err:  # a broken package, not user input
        raise RuntimeError(f"planner/data/{name}: {err}") from None


@functools.cache
def builtin_rules() -> tuple[Rule, ...]:
    return tuple(convert(data("rules.toml")["rules"], list[Rule], "planner/data/rules.toml"))


@functools.cache
def baseline() -> Choice:
    """The engines' hard-coded schedule, the yardstick every plan reports against."""
    raw = {k: v for k, v in data("rules.toml")["baseline"].items() if k != "why"}
    return convert(raw, Choice, "planner/data/rules.toml: $.baseline")


def backends() -> dict[str, dict[str, Any]]:
    return data("backends.toml")["backends"]


BACKENDS = ("fa3", "flashinfer", "triton", "torch")


def backend(name: str) -> dict[str, Any]:
    table = backends()
    if name not in table:
        raise InputError(f"unknown backend {name!r}", where="--backend", fix=f"use one of {', '.join(sorted(table))}")
    return table[name]


@functools.cache
def rules_digest() -> str:
    return sha256(b"".join(data_bytes(f) for f in _FILES))
