"""A hook point's row (:class:`HookPoint`), and how a release's rows follow the release
before (:func:`follow`, :class:`Moved`, :data:`GONE`). The rows themselves are the
``hooks_*`` modules'; :mod:`capture_plan.adapters.plugins.hooks` gathers them.

``signature`` spells what the contract checks:

* ``"(self, stream)"``: a function or method, its parameters as
  :func:`~capture_plan.adapters.plugins.contract.signature_of` writes them (names,
  defaults as written in the source, ``*``/``/``/``*args``/``**kw``; annotations
  are not compared: a plugin calls by name, and annotations change with every
  refactor);
* ``"class"``: a class defined in the file;
* ``"= <expr>"``: a module- or class-level assignment and its value as written
  (``= 'sglang.srt.plugins'``, ``= EnvBool(False)``);
* ``": <annotation>"``: a class-level field declared without a value (a dataclass's
  ``num_tokens: int``);
* ``"attribute"``: an instance attribute, ``self.<name>`` assigned in a method of the
  class the rest of the name gives (``ModelCudaGraphManager.hidden_states``).

No torch, no engine import: the plugins' entry points import this first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class HookPoint:
    """One name in one engine release."""

    #: the engine's distribution name ("sglang", "vllm")
    engine: str
    #: the release it was read from ("0.5.23")
    version: str
    #: the file inside the release's wheel ("sglang/srt/plugins/__init__.py")
    file: str
    #: the qualified name in that file ("FullCudaGraphBackend.capture_one")
    name: str
    #: what the contract checks: "(params)", "class" or "= <expr>" (module docstring)
    signature: str
    #: what capture-plan does with it (the adoption guide's table)
    role: str

    @property
    def module(self) -> str:
        """The dotted module of :attr:`file` (``sglang.srt.plugins``)."""
        parts = self.file.removesuffix(".py").split("/")
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    @property
    def qualified(self) -> str:
        """``module:name``, as an entry point spells it."""
        return f"{self.module}:{self.name}"


@dataclass(frozen=True)
class Moved:
    """What a later release changed of one row of the release before: the fields given
    replace the row's (``file``, ``signature``, ``role``; ``name`` where it was renamed
    or now lives on another class)."""

    file: str | None = None
    name: str | None = None
    signature: str | None = None
    role: str | None = None


#: a row a later release no longer has (a value of :func:`follow`'s ``changes``)
GONE = None


def follow(
    rows: tuple[HookPoint, ...],
    version: str,
    changes: Mapping[str, Moved | None],
    added: tuple[tuple[str, str, str, str], ...] = (),
) -> tuple[HookPoint, ...]:
    """The hook points of the release after ``rows``' (``version``): each row kept, moved
    as ``changes[name]`` says (:class:`Moved`), or dropped (:data:`GONE`), then ``added``
    as (file, name, signature, role). A name of ``changes`` that ``rows`` lacks is a
    ValueError: the change table is checked against the release it edits."""
    names = {h.name for h in rows}
    unknown = sorted(set(changes) - names)
    if unknown:
        raise ValueError(f"{rows[0].engine} {version}: changes name rows the release before lacks: {unknown}")
    out = []
    for h in rows:
        if h.name not in changes:
            out.append(replace(h, version=version))
            continue
        moved = changes[h.name]
        if moved is None:
            continue
        given = {k: v for k, v in vars(moved).items() if v is not None}
        out.append(replace(h, version=version, **given))
    out += [HookPoint(rows[0].engine, version, *row) for row in added]
    return tuple(out)
