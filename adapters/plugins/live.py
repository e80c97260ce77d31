"""Which known release's hook points the imported engine has: the check every plugin's
registration runs (``core.register``) and ``python -m capture_plan.adapters.plugins.contract
--installed`` runs without a GPU.

Three outcomes other than a release, told apart because their fixes differ:

* :class:`EngineUnavailable`, the engine is not installed (fix: install a known release);
* :class:`EngineUnavailable`, the engine is installed but a module the plugin uses fails to
  import: a dependency of the engine's is missing (named, fix: install it, at the engine's
  own requirement where its metadata lists it), or another error (fix: the command that
  shows it);
* :class:`HooksMoved`, the engine imports but its objects are not those of any release the
  plugin knows (:func:`live_problem` names the first mismatched row). A module of the
  engine's own package that is not there is this case: the release moved it.

Importing this module imports neither torch nor an engine.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import inspect
import re
from typing import Any

from capture_plan.adapters.plugins.hook_point import HookPoint
from capture_plan.adapters.plugins.hooks import HOOKS, KNOWN
from capture_plan.adapters.plugins.refusal import ENV_PLAN, EngineUnavailable, HooksMoved

__all__ = [
    "NOT_INSTALLED",
    "EngineUnavailable",
    "HooksMoved",
    "live_problem",
    "live_release",
    "import_problem",
    "checked",
]

#: what ``core.installed`` says of a distribution that is not installed
NOT_INSTALLED = "(not installed)"


def _resolve_static(h: HookPoint) -> Any:
    """The object a hook point names, as its class holds it (a classmethod as the
    classmethod: its signature has ``cls``); inherited members count (a release may move a
    method to a base class). ImportError or AttributeError where it is not there."""
    obj: Any = importlib.import_module(h.module)
    for part in h.name.split("."):
        obj = inspect.getattr_static(obj, part) if isinstance(obj, type) else getattr(obj, part)
    return obj


def params_of_table(signature: str) -> list[tuple[str, str, str | None]]:
    """(name, kind, default as written) of a table's ``(params)`` spelling."""
    fn = ast.parse(f"def f{signature}: pass").body[0]
    assert isinstance(fn, ast.FunctionDef)
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out = [
        (p.arg, "POSITIONAL_ONLY" if i < len(a.posonlyargs) else "POSITIONAL_OR_KEYWORD", d)
        for i, (p, d) in enumerate(zip(positional, defaults))
    ]
    if a.vararg:
        out.append((a.vararg.arg, "VAR_POSITIONAL", None))
    out += [(p.arg, "KEYWORD_ONLY", d) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append((a.kwarg.arg, "VAR_KEYWORD", None))
    return [(name, kind, None if d is None else ast.unparse(d)) for name, kind, d in out]


def same_default(written: str | None, value: Any) -> bool:
    """Whether a default as the table writes it is the live one: presence always, the
    value where the table's is a literal (``1 << 20`` is an expression: presence only)."""
    if written is None or value is inspect.Parameter.empty:
        return (written is None) == (value is inspect.Parameter.empty)
    try:
        want = ast.literal_eval(written)
    except ValueError:
        return True
    return type(want) is type(value) and want == value


def live_problem(h: HookPoint) -> str | None:
    """What the imported engine breaks of row ``h`` (one line), or None: the object is
    there, a class where the row says ``class``, a callable whose parameters are the
    row's (names, kinds, defaults: :func:`same_default`) where the row is a signature.
    Other rows (assignments, instance attributes) are the wheel contract's alone."""
    where = f"{h.engine} {h.version} row {h.qualified}"
    try:
        obj = _resolve_static(h)
    except (ImportError, AttributeError) as err:
        return f"{where}: not in the installed {h.engine} ({type(err).__name__}: {err})"
    if h.signature == "class":
        return None if isinstance(obj, type) else f"{where}: is not a class"
    if not h.signature.startswith("("):
        return None
    fn = obj.__func__ if isinstance(obj, classmethod | staticmethod) else obj
    try:
        got = inspect.signature(fn)
    except (TypeError, ValueError):
        return f"{where}: is not a function"
    want = params_of_table(h.signature)
    params = list(got.parameters.values())
    same = len(params) == len(want) and all(
        p.name == name and p.kind.name == kind and same_default(d, p.default)
        for p, (name, kind, d) in zip(params, want)
    )
    return None if same else f"{where}: is {got}, the release's is {h.signature}"


def _candidates(engine: str, version: str) -> list[str]:
    """The known releases the installed ``version`` is checked against: itself where known,
    else every known release, the newest first."""
    known = KNOWN.get(engine, ())
    return [version] if version in known else list(reversed(known))


def _rows(engine: str, release: str, names: tuple[str, ...]) -> list[HookPoint]:
    return [h for h in HOOKS if (h.engine, h.version) == (engine, release) and h.name in names]


def _requirement(engine: str, module: str) -> str | None:
    """The engine's own requirement (its metadata's ``Requires-Dist``, markers left out)
    of the distribution named like ``module``; None where it lists none."""
    try:
        requires = importlib.metadata.requires(engine) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    norm = re.sub(r"[-_.]+", "-", module).lower()
    for req in requires:
        name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
        if name and re.sub(r"[-_.]+", "-", name.group(1)).lower() == norm:
            return req.split(";")[0].strip()
    return None


def import_problem(engine: str, version: str, names: tuple[str, ...]) -> EngineUnavailable | None:
    """Why the modules of ``engine``'s rows ``names`` (of every candidate release) cannot be
    imported, where that is not the release having moved them: the engine not installed, a
    dependency of it missing, another error at import. None where they import (or only a
    module of the engine's own package is missing: :func:`live_problem` names that row)."""
    known = KNOWN.get(engine, ())
    newest = f"{engine}=={known[-1]}" if known else engine
    where = f"the installed {engine}"
    modules = dict.fromkeys(h.module for r in _candidates(engine, version) for h in _rows(engine, r, names))
    for module in modules:
        top = module.split(".")[0]
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            missing = err.name or str(err)
            if missing.split(".")[0] == top:
                if version == NOT_INSTALLED:
                    return EngineUnavailable(
                        f"{engine} is not installed (import {module}: No module named {missing!r})",
                        where=where,
                        fix=f"pip install {newest}, or unset {ENV_PLAN}",
                    )
                if missing == top:
                    return EngineUnavailable(
                        f"{engine} {version} is listed as installed but its package is not there ({err})",
                        where=where,
                        fix=f"pip install --force-reinstall {engine}=={version}",
                    )
                continue  # a module of the engine's that this release does not have: a moved row
            dep = missing.split(".")[0]
            req = _requirement(engine, dep)
            return EngineUnavailable(
                f"{engine} {version} is installed but its import fails: {module} needs module {dep!r}, "
                "which is not installed",
                where=where,
                fix=f"pip install '{req}' ({engine} {version}'s requirement)"
                if req
                else f"pip install {dep} (or the package that provides module {dep!r}; "
                f"{engine} {version}'s metadata does not list it)",
            )
        except Exception as err:  # an engine's import runs its code: any error stops it
            return EngineUnavailable(
                f"{engine} {version} is installed but its import fails ({type(err).__name__}: {err})",
                where=f"{where}: {module}",
                fix=f"python -c 'import {module}' shows the whole error: repair what it names",
            )
    return None


def live_release(engine: str, version: str, names: tuple[str, ...]) -> str:
    """The known release whose rows ``names`` the imported engine matches (:func:`live_problem`):
    the installed ``version`` where it is known and matches; for an unknown release, the
    newest known one that matches. :class:`EngineUnavailable` where the rows' modules do not
    import (:func:`import_problem`); :class:`HooksMoved` naming the first mismatched row where
    no release matches (the installed release's rows, else the newest's)."""
    unavailable = import_problem(engine, version, names)
    if unavailable is not None:
        raise unavailable
    known = KNOWN.get(engine, ())
    first: str | None = None
    for release in _candidates(engine, version):
        problem = next((p for p in map(live_problem, _rows(engine, release, names)) if p is not None), None)
        if problem is None:
            return release
        first = first or problem
    raise HooksMoved(
        f"{engine} {version}: the hook points moved ({first or 'no release known'})",
        where=f"the installed {engine}",
        fix=(
            f"pip install --force-reinstall {engine}=={version} (its objects are not the release's)"
            if version in known
            else f"pip install {engine}=={known[-1]}, or a capture-plan that knows {engine} {version}"
        )
        if known
        else f"unset {ENV_PLAN}",
    )


def checked(engine: str, version: str, release: str, names: tuple[str, ...]) -> str:
    """What the check found, for the INFO line of a registration and the contract's
    ``--installed``: the release and the rows checked."""
    rows = ", ".join(names)
    if release == version:
        return f"{engine} {version}: its {len(names)} hook points checked live hold ({rows})"
    return (
        f"{engine} {version} is not a release capture-plan knows; its {len(names)} hook points checked live "
        f"are {engine} {release}'s ({rows})"
    )
