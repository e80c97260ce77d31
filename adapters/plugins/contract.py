"""Check the hook points of :data:`~capture_plan.adapters.plugins.hooks.HOOKS` against a
released engine's wheel: read with :mod:`zipfile` and :mod:`ast`, nothing installed,
nothing of the engine imported.

    python -m capture_plan.adapters.plugins.contract WHEEL_FOLDER

prints one line per hook point that the wheels in the folder break (exit 1), or
one summary line (exit 0); a known release whose wheel is not in the folder is a
line too. ``tests/test_engine_contract.py`` runs the same check on the wheels
``.ci/run`` downloads (``.ci/engine_wheels.py``: one ``pip download --no-deps`` per release).

What it checks (the ``signature`` field of :class:`~capture_plan.adapters.plugins.hooks.HookPoint`):
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


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m capture_plan.adapters.plugins.contract WHEEL_FOLDER", file=sys.stderr)
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
