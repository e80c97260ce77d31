"""The engines' hook points the plugins use and the docs name, as typed data.

One row per name: the engine (its distribution name), the release it was read
from, the file inside that release's wheel, the qualified name in the file and
its signature. The plugins look their patch targets up here (:func:`hook`), the
adoption guide's table is generated from here (``docs/generate.py``), and
``tests/test_engine_contract.py`` reads the released wheels (``pip download
--no-deps``, zipfile + ast; nothing installed or imported) and fails, naming the
row, where a release no longer has a name or its signature changed
(:mod:`capture_plan.adapters.plugins.contract`).

The rows are each release's data file's (``planner/data/releases/ENGINE-VERSION.toml``,
read by :mod:`capture_plan.planner.inputs.releases`: a later release follows the one
before through a change table); their type and its ``signature`` spelling are
:mod:`capture_plan.adapters.plugins.hook_point`'s. A release is added by its file alone.

What this table does not know: behaviour. A release that keeps every name and
signature but reorders what ``capture_one`` does passes the contract; the
behaviour tests (tests/test_plugins.py, on engine-shaped runners) and the GPU run
are what check behaviour, for the releases in :data:`KNOWN`.

No torch, no engine import: the plugins' entry points import this first.
"""

from __future__ import annotations

from capture_plan.adapters.plugins.hook_point import HookPoint, Moved, follow
from capture_plan.planner.inputs.releases import Release, releases


def rows_of(release: Release, before: tuple[HookPoint, ...] = ()) -> tuple[HookPoint, ...]:
    """``release``'s hook points: its own rows, or (``follows``) the rows ``before`` of the
    release it follows as its ``changes`` move them, then its own."""
    own = tuple((h.file, h.name, h.signature, h.role) for h in release.hooks)
    if release.follows is None:
        return tuple(HookPoint(release.engine, release.version, *row) for row in own)
    changes = {
        name: None if c.gone else Moved(file=c.file, name=c.name, signature=c.signature, role=c.role)
        for name, c in release.changes.items()
    }
    return follow(before, release.version, changes, own)


def _gather() -> tuple[HookPoint, ...]:
    by_release: dict[tuple[str, str], tuple[HookPoint, ...]] = {}
    for r in releases():  # oldest first: the release a file follows is gathered before it
        by_release[r.engine, r.version] = rows_of(r, by_release.get((r.engine, r.follows or ""), ()))
    return tuple(h for rows in by_release.values() for h in rows)


#: every hook point, engine by engine, release by release
HOOKS: tuple[HookPoint, ...] = _gather()

#: engine -> the releases whose hook points :data:`HOOKS` holds, oldest first
KNOWN: dict[str, tuple[str, ...]] = {}
for _h in HOOKS:
    if _h.version not in KNOWN.setdefault(_h.engine, ()):
        KNOWN[_h.engine] += (_h.version,)


def hook(engine: str, version: str, name: str) -> HookPoint:
    """The row of ``engine`` ``version`` named ``name``; KeyError where there is none
    (a programming error: the plugins name rows of this table)."""
    for h in HOOKS:
        if (h.engine, h.version, h.name) == (engine, version, name):
            return h
    raise KeyError(f"{engine} {version}: no hook point {name!r} in capture_plan.adapters.plugins.hooks.HOOKS")


def requirements() -> list[str]:
    """``engine==version`` for every known release (what ``.ci/run`` downloads)."""
    return [f"{e}=={v}" for e, versions in KNOWN.items() for v in versions]


if __name__ == "__main__":  # `python -m capture_plan.adapters.plugins.hooks`: the pins, for .ci/run
    print(" ".join(requirements()))
