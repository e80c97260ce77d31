"""Every Python snippet of the docs (docs/*.md and README.md) is complete as written.

Each snippet imports what it uses. A name it uses but neither imports nor defines is
the reader's own object, which the snippet's first line declares:
``# on a GPU, with your engine's: target, n`` (``# on a GPU`` alone: it needs CUDA but
nothing of the reader's). Every snippet compiles, its imports resolve against the
installed package (``from capture_plan.executor import capture``: the name exists), and
every attribute path it reads from an imported module exists (``torch.cuda.CUDAGraph``).
Snippets that say nothing of a GPU run here, on the CPU, from the repository's root.

What this does not check: attributes of the reader's objects or of values the snippet
computes (``graphs.replay``), nor that a GPU snippet runs (it needs the reader's engine).
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import importlib
import importlib.util
import io
import os
import re
import symtable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
HEADER = re.compile(r"# (?P<gpu>on a GPU)?(?:,? ?with your engine's: (?P<names>[\w, ]+))?")


def _snippets() -> list[tuple[str, str]]:
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 2
            out.append((f"{page.relative_to(ROOT)}:{line}", m.group(1)))
    return out


SNIPPETS = _snippets()


def _header(code: str) -> tuple[bool, set[str]]:
    """(needs a GPU, the reader's own names) from the snippet's first line."""
    first = code.splitlines()[0]
    m = HEADER.fullmatch(first)
    if not first.startswith("#") or m is None or not (m["gpu"] or m["names"]):
        return False, set()
    return bool(m["gpu"]), {n.strip() for n in (m["names"] or "").split(",") if n.strip()}


def _free_names(code: str, where: str) -> set[str]:
    """Names the snippet reads but never binds (imports, assignments, loop and ``with``
    targets, parameters), in any of its scopes, builtins left out."""
    top = symtable.symtable(code, where, "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    free: set[str] = set()
    tables = [top]
    while tables:
        t = tables.pop()
        tables.extend(t.get_children())
        for s in t.get_symbols():
            if s.is_referenced() and (s.is_global() or t is top) and not (s.is_assigned() and t is top):
                free.add(s.get_name())
    return {n for n in free - bound if not hasattr(builtins, n)}


def _module_paths(tree: ast.Module) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """(name -> module it binds, for ``import x`` / ``import x.y as z``; every
    ``from m import name``)."""
    modules, names = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                modules[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0 and node.module, "a snippet imports absolutely"
            names += [(node.module, a.name) for a in node.names]
    return modules, names


def _attribute_chains(tree: ast.Module, roots: set[str]) -> set[tuple[str, ...]]:
    """``torch.cuda.CUDAGraph`` -> ("torch", "cuda", "CUDAGraph"), for chains on ``roots``."""
    chains = set()
    for node in ast.walk(tree):
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if parts and isinstance(node, ast.Name) and node.id in roots:
            chains.add((node.id, *reversed(parts)))
    return chains


#: the optional packages a module of the docs' imports needs (the executor's and adapters' lazy
#: attributes import torch on first use, so a missing one is found before any import)
NEEDS = {
    "torch": ("torch", "capture_plan.executor", "capture_plan.adapters", "capture_plan.references"),
    "transformers": ("transformers", "capture_plan.adapters.hf"),
}


def _skip_without_optional_packages(modules: list[str]) -> None:
    for package, prefixes in NEEDS.items():
        needed = [m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes)]
        if needed and importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed (the snippet imports {needed[0]})")


def _import(module: str):
    return importlib.import_module(module)


def test_the_docs_have_snippets_and_some_run_on_the_cpu():
    assert len(SNIPPETS) >= 10, [w for w, _ in SNIPPETS]
    assert any(not _header(code)[0] for _, code in SNIPPETS), "no snippet runs on the CPU"


@pytest.mark.parametrize("where, code", SNIPPETS, ids=[w for w, _ in SNIPPETS])
def test_snippet_is_complete_and_names_what_it_uses(where, code):
    tree = ast.parse(code, where)  # a syntax error fails here, naming the page and line
    compile(tree, where, "exec")
    gpu, yours = _header(code)
    free = _free_names(code, where)
    assert free == yours, (
        f"{where}: uses {sorted(free - yours)} without importing or defining them"
        if free - yours
        else f"{where}: declares {sorted(yours - free)} as the reader's but does not use them"
    )
    modules, names = _module_paths(tree)
    _skip_without_optional_packages(list(modules.values()) + [m for m, _ in names])
    for module, name in names:
        assert hasattr(_import(module), name), f"{where}: `from {module} import {name}`: no such name"
    for chain in _attribute_chains(tree, set(modules)):
        obj = _import(modules[chain[0]])
        for i, attr in enumerate(chain[1:], 1):
            if isinstance(obj, type(os)) and not hasattr(obj, attr):  # a submodule not imported yet
                with contextlib.suppress(ImportError):
                    importlib.import_module(f"{obj.__name__}.{attr}")
            assert hasattr(obj, attr), f"{where}: {'.'.join(chain[: i + 1])} does not exist"
            obj = getattr(obj, attr)
            if not isinstance(obj, type(os)) and not isinstance(obj, type):
                break  # a function or a value: what it returns is not the module's to check


CPU = [(w, c) for w, c in SNIPPETS if not _header(c)[0]]


@pytest.mark.parametrize("where, code", CPU, ids=[w for w, _ in CPU])
def test_cpu_snippet_runs_as_written(where, code, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, where, "exec"), {"__name__": "__snippet__"})
