"""Check the hook points of :data:`~capture_plan.adapters.plugins.hooks.HOOKS` against a
released engine's wheel: read with :mod:`zipfile` and :mod:`ast`, nothing installed,
nothing of the engine imported.

    python -m capture_plan.adapters.plugins.contract WHEEL_FOLDER

prints one line per hook point that the wheels in the folder break (exit 1), or
one summary line (exit 0); a known release whose wheel is not in the folder is a
line too. ``tests/test_engine_contract.py`` runs the same check on the wheels
``.ci/run`` downloads (``.ci/engine_wheels.py``: one ``pip download --no-deps`` per release).

    python -m capture_plan.adapters.plugins.contract --installed [ENGINE ...]

checks the engine installed in this Python instead (each named, or every one installed) as
the plugin's registration does (:func:`check_installed`: its modules imported, the rows the
plugin uses checked live by signature; no GPU, no plan): one line per engine, exit 1 where
one is not installed, does not import (a dependency missing: named) or has hook points that
moved (the first row named).

What the wheel check checks (the ``signature`` field of :class:`~capture_plan.adapters.plugins.hooks.HookPoint`):
that the file is in the wheel, that each part of the qualified name is a class,
function or assignment defined at that level (not inherited, not imported), and
that a function's parameters (:func:`signature_of`), or an assignment's value as
written (a field without one: its annotation), are the table's; an instance attribute
(``"attribute"``) is assigned as ``self.<name>`` in a method of its class. Not checked:
a function's annotations, bodies, behaviour.
"""

from __future__ import annotations

import ast
import re
import sys
import zipfile
from collections.abc import Iterable
from pathlib import Path

from capture_plan.adapters.plugins.hook_point import HookPoint
from capture_plan.adapters.plugins.hooks import HOOKS

_Def = ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef


def signature_of(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """A function's parameters as :data:`HOOKS` spells them: ``(self, a, b=None, *, c=1)``
    (names and defaults as written, no annotations)."""
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    parts = []
    for i, (p, d) in enumerate(zip(positional, defaults)):
        parts.append(p.arg if d is None else f"{p.arg}={ast.unparse(d)}")
        if a.posonlyargs and i == len(a.posonlyargs) - 1:
            parts.append("/")
    if a.vararg:
        parts.append(f"*{a.vararg.arg}")
    elif a.kwonlyargs:
        parts.append("*")
    for p, d in zip(a.kwonlyargs, a.kw_defaults):
        parts.append(p.arg if d is None else f"{p.arg}={ast.unparse(d)}")
    if a.kwarg:
        parts.append(f"**{a.kwarg.arg}")
    return f"({', '.join(parts)})"


def _member(body: list[ast.stmt], name: str) -> ast.AST | None:
    """The last definition or assignment of ``name`` directly in ``body`` (the one a
    reader of the module gets); None where there is none."""
    found = None
    for node in body:
        if isinstance(node, _Def) and node.name == name:
            found = node
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            found = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            found = node
    return found


def describe(node: ast.AST) -> str:
    """What a definition is, in the table's spelling: its signature, "class", "= value",
    or ": annotation" (a field declared without a value)."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return signature_of(node)
    if isinstance(node, ast.ClassDef):
        return "class"
    value = getattr(node, "value", None)
    if value is None and isinstance(node, ast.AnnAssign):
        return f": {ast.unparse(node.annotation)}"
    return "=" if value is None else f"= {ast.unparse(value)}"


def _assigns_self(cls: ast.ClassDef, name: str) -> bool:
    """Whether a method of ``cls`` assigns ``self.<name>`` (an instance attribute)."""
    for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if isinstance(node, ast.Assign | ast.AnnAssign) and any(
                isinstance(t, ast.Attribute) and t.attr == name and ast.unparse(t.value) == "self" for t in targets
            ):
                return True
    return False


def check_source(h: HookPoint, source: str) -> str | None:
    """What ``source`` (the text of ``h.file``) breaks of ``h``: one line, or None."""
    tree = ast.parse(source)
    body: list[ast.stmt] = tree.body
    node: ast.AST | None = None
    parts = h.name.split(".")
    if h.signature == "attribute":  # self.<last> in a method of the class the rest names
        if len(parts) < 2:
            return f"{h.engine} {h.version} {h.file}: {h.name}: an attribute is named with its class"
        owner = HookPoint(h.engine, h.version, h.file, ".".join(parts[:-1]), "class", h.role)
        problem = check_source(owner, source)
        if problem:  # named by this row
            return problem.replace(f"{h.file}: {owner.name}: ", f"{h.file}: {h.name}: ", 1)
        cls: ast.AST | None = None
        for part in parts[:-1]:
            cls = _member(body, part)
            body = getattr(cls, "body", [])
        assert isinstance(cls, ast.ClassDef)
        if not _assigns_self(cls, parts[-1]):
            return f"{h.engine} {h.version} {h.file}: {h.name}: no method of {parts[-2]} assigns self.{parts[-1]}"
        return None
    for depth, part in enumerate(parts):
        node = _member(body, part)
        if node is None:
            where = h.name.rsplit(".", len(h.name.split(".")) - depth)[0] if depth else h.file
            return f"{h.engine} {h.version} {h.file}: {h.name}: {part!r} is not defined in {where}"
        body = getattr(node, "body", [])
    assert node is not None
    got = describe(node)
    if _norm(got) != _norm(h.signature):
        return f"{h.engine} {h.version} {h.file}: {h.name}: is {got}, the table has {h.signature}"
    return None


def _norm(sig: str) -> str:
    return re.sub(r"\s+", " ", sig.replace('"', "'")).strip()


def find_wheel(folder: str | Path, engine: str, version: str) -> Path | None:
    """The wheel of ``engine`` ``version`` in ``folder`` (any platform tag), or None."""
    for path in sorted(Path(folder).glob(f"{engine}-{version}-*.whl")):
        return path
    return None


def check_wheel(wheel: str | Path, hooks: Iterable[HookPoint]) -> list[str]:
    """One line per hook point of ``hooks`` that ``wheel`` breaks (a missing file, a name
    no longer defined, another signature)."""
    problems = []
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for h in hooks:
            if h.file not in names:
                problems.append(f"{h.engine} {h.version}: {h.file} is not in {Path(wheel).name} (for {h.name})")
                continue
            problem = check_source(h, z.read(h.file).decode())
            if problem:
                problems.append(problem)
    return problems


def check_folder(folder: str | Path, hooks: Iterable[HookPoint] = HOOKS) -> tuple[list[str], list[str]]:
    """``(problems, missing)``: the broken hook points of every release in ``hooks`` whose
    wheel is in ``folder``, and ``engine==version`` of those whose wheel is not."""
    by_release: dict[tuple[str, str], list[HookPoint]] = {}
    for h in hooks:
        by_release.setdefault((h.engine, h.version), []).append(h)
    problems, missing = [], []
    for (engine, version), rows in by_release.items():
        wheel = find_wheel(folder, engine, version)
        if wheel is None:
            missing.append(f"{engine}=={version}")
        else:
            problems += check_wheel(wheel, rows)
    return problems, missing


def check_installed(engine: str) -> str:
    """What the installed ``engine`` gives the plugin's registration (``core.register``'s check,
    ``live.live_release`` on the plugin's ``LIVE`` rows): one line naming the release and the rows
    checked; ``live.EngineUnavailable`` or ``live.HooksMoved`` (one line) where it fails."""
    import importlib

    from capture_plan.adapters.plugins import core, live

    rows = importlib.import_module(f"capture_plan.adapters.plugins.{engine}").LIVE
    version = core.installed(engine)
    release = live.live_release(engine, version, rows)
    return f"{live.checked(engine, version, release, rows)}: the plugin captures through a plan"


def installed_main(names: list[str]) -> int:
    """``--installed [ENGINE ...]``: :func:`check_installed` for each engine named, or for every
    engine of the plugins that is installed."""
    from capture_plan.adapters.plugins import core
    from capture_plan.adapters.plugins.hooks import KNOWN
    from capture_plan.schemas.errors import CapturePlanError

    engines = sorted(KNOWN)
    unknown = [n for n in names if n not in KNOWN]
    if unknown:
        print(
            f"--installed {' '.join(unknown)}: no plugin for engine {unknown[0]!r}; "
            f"fix: name one of {', '.join(engines)}, or none for every one installed",
            file=sys.stderr,
        )
        return 1
    chosen = names or [e for e in engines if core.installed(e) != "(not installed)"]
    if not chosen:
        pins = [f"{e}=={KNOWN[e][-1]}" for e in engines]
        print(
            f"the installed engines: neither {' nor '.join(engines)} is installed; fix: pip install {pins[0]} "
            f"(or {', '.join(pins[1:])}), then python -m capture_plan.adapters.plugins.contract --installed",
            file=sys.stderr,
        )
        return 1
    failed = False
    for engine in chosen:
        try:
            print(check_installed(engine))
        except CapturePlanError as err:
            print(err, file=sys.stderr)
            failed = True
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--installed"]:
        return installed_main(argv[1:])
    if len(argv) != 1 or argv[0].startswith("-"):
        print(
            "usage: python -m capture_plan.adapters.plugins.contract WHEEL_FOLDER | --installed [ENGINE ...]",
            file=sys.stderr,
        )
        return 2
    problems, missing = check_folder(argv[0])
    for name in missing:
        problems.append(f"{name}: no wheel in {argv[0]}; fix: pip download --no-deps -d {argv[0]} {name}")
    for line in problems:
        print(line, file=sys.stderr)
    if not problems:
        print(f"{len(HOOKS)} hook points hold in {argv[0]}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
