"""The import graph of capture_plan's packages has layers and no circles.

Read from the source with ast (nothing is imported), as ``tests/test_no_torch.py``
checks the planner's imports at run time. What counts as an edge:

* every ``import`` / ``from ... import`` statement, at module level or inside
  a function (a lazy import closes a circle as surely as a top-level one,
  only later);
* a package whose ``__init__`` defines a module-level ``__getattr__`` that
  calls ``importlib.import_module`` (``executor``, ``planner``) may load any
  module below it: it gets an edge to each of them, so that a submodule
  importing names from its own lazy package is a circle too.

What does not count: imports under ``if TYPE_CHECKING:`` (never executed;
type checkers resolve circles among annotations), and ``importlib`` calls
elsewhere, whose module names are computed (``capture_plan.planner.cli`` loads its
command modules that way: they sit below it, which is the direction every
package already has). Only modules of capture_plan are nodes (the
repository's folders, named as pyproject.toml's package-dir maps them): what
they import from outside (torch, networkx, the standard library) is not
looked at here.
"""

from __future__ import annotations

import ast
import pathlib

import networkx as nx
import pytest
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: package -> its folder, as the wheel maps them (capture_plan itself: the root's __init__.py)
PACKAGES = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
#: which other packages each package may import: schemas at the bottom; planner and
#: executor beside each other on it, never importing each other; adapters and the
#: reference models above the executor, which imports neither
MAY_IMPORT = {
    "capture_plan": set(),
    "schemas": {"capture_plan"},  # its __version__
    "planner": {"schemas"},
    "executor": {"schemas"},
    "adapters": {"schemas", "planner", "executor"},
    "references": {"schemas", "executor"},
}


def _modules(root: pathlib.Path, packages: dict[str, str]) -> dict[str, tuple[pathlib.Path, bool]]:
    """Dotted module name -> (its file, whether it is a package's ``__init__``), for
    ``packages`` mapping each package's name to its folder under ``root``."""
    mods = {}
    for pkg, folder in packages.items():
        base = root / folder
        # the root package's folder holds the others: only its own __init__.py is it
        paths = [base / "__init__.py"] if folder == "." else sorted(base.rglob("*.py"))
        for path in paths:
            parts = pkg.split(".") + list(path.relative_to(base).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            mods[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return mods


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``) bodies."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for stmt in node.body:
                out.update(id(n) for n in ast.walk(stmt))
    return out


def _is_lazy_package(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            return any(isinstance(n, ast.Attribute) and n.attr == "import_module" for n in ast.walk(node))
    return False


def _known(name: str, mods) -> str | None:
    """The longest prefix of ``name`` that is one of ``mods``."""
    parts = name.split(".")
    while parts and ".".join(parts) not in mods:
        parts.pop()
    return ".".join(parts) or None


def import_graph(root: pathlib.Path = ROOT, packages=PACKAGES, *, type_checking: bool = False) -> nx.DiGraph:
    """Modules of ``packages`` under ``root``; an edge a -> b when a imports b,
    with the lines that do in the edge's ``lines``. ``type_checking``: the imports
    under ``if TYPE_CHECKING:`` are edges too."""
    mods = _modules(root, packages)
    g = nx.DiGraph()
    g.add_nodes_from(mods)

    def edge(a: str, b: str | None, line: int) -> None:
        if b is not None and b != a:
            g.add_edge(a, b)
            g.edges[a, b].setdefault("lines", []).append(line)

    for mod, (path, is_pkg) in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skip = set() if type_checking else _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                for alias in node.names:
                    edge(mod, _known(alias.name, mods), node.lineno)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package holding this module
                    anchor = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    # `from pkg import mod` imports the module pkg.mod; `from mod import name`, mod
                    full = f"{base}.{alias.name}"
                    edge(mod, full if full in mods else _known(base, mods), node.lineno)
        if is_pkg and _is_lazy_package(tree):
            for other in mods:
                if other.startswith(mod + "."):
                    edge(mod, other, 0)
    return g


def missing_modules(root: pathlib.Path = ROOT, packages=PACKAGES) -> list[str]:
    """``file:line: module`` for each import of a capture_plan module (absolute or relative,
    lazy or under ``if TYPE_CHECKING:``) that names no module of ``packages``: the shape a
    lazy import keeps after its module moved, which nothing runs until that branch does. A
    compiled module counts where its source is there (``_core.pyx``: built in place)."""
    mods = _modules(root, packages)
    roots = {m.split(".")[0] for m in mods}
    bad = []
    for mod, (path, is_pkg) in mods.items():
        compiled = {f"{mod.rsplit('.', 1)[0] if not is_pkg else mod}.{p.stem}" for p in path.parent.glob("*.pyx")}
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                names = [base]
            for name in names:
                if name.split(".")[0] in roots and name not in mods and name not in compiled:
                    bad.append(f"{path.relative_to(root)}:{node.lineno}: {name}")
    return bad


def test_every_import_of_capture_plan_names_a_module_that_exists():
    """The merge of the planner's move (issue 39) left two lazy imports naming flat paths
    (planner/memory/device.py ``from .resources``, planner/report/check.py ``from .device``)
    that no test reached: any such import fails here, read from the source."""
    bad = missing_modules()
    assert not bad, "imports of modules that do not exist:\n" + "\n".join(bad)


def test_a_lazy_import_of_a_moved_module_is_found(tmp_path):
    root = _write(
        tmp_path,
        {
            "pkg/inputs/resources.py": "",
            "pkg/memory/_core.pyx": "",
            "pkg/memory/device.py": "from . import _core\n"
            "from ..inputs.resources import x\n\ndef f():\n    from .resources import backends\n",
        },
    )
    assert missing_modules(root, {"pkg": "pkg"}) == ["pkg/memory/device.py:5: pkg.memory.resources"]


def cycles(g: nx.DiGraph) -> list[list[str]]:
    """Every simple cycle, each rotated to start at its smallest module, sorted."""
    out = []
    for c in nx.simple_cycles(g):
        i = c.index(min(c))
        out.append(c[i:] + c[:i])
    return sorted(out)


def _describe(g: nx.DiGraph, cycle: list[str]) -> str:
    steps = []
    for a, b in zip(cycle, cycle[1:] + cycle[:1]):
        lines = [n for n in g.edges[a, b]["lines"] if n]
        steps.append(f"{a} (line {lines[0]})" if lines else f"{a} (lazy __getattr__)")
    return " -> ".join(steps) + f" -> {cycle[0]}"


def test_no_import_cycles():
    g = import_graph()
    found = cycles(g)
    assert not found, "import circles (move the shared piece below both):\n" + "\n".join(_describe(g, c) for c in found)


def test_the_executor_has_no_circle_even_among_type_only_imports():
    """A circle closed only under ``if TYPE_CHECKING:`` (loop -> background -> loop and
    graphs -> background -> graphs once were) still ties the modules together: each is
    read and changed with the other. The executor names what it needs of a module above
    it as a Protocol instead (background.Runner, graphs.BackgroundJob, step.StepHost)."""
    g = import_graph(type_checking=True)
    executor = g.subgraph(n for n in g if n.startswith("capture_plan.executor."))  # the package's lazy edges aside
    found = cycles(nx.DiGraph(executor))
    assert not found, "executor import circles, TYPE_CHECKING included:\n" + "\n".join(_describe(g, c) for c in found)


def layer_violations(g: nx.DiGraph, may_import=MAY_IMPORT) -> list[str]:
    """Each edge from one package into another that ``may_import`` does not allow, as text."""

    def pkg(m: str) -> str:  # capture_plan.planner.build -> planner; pkg.m -> pkg
        parts = m.split(".")
        return parts[1] if parts[0] == "capture_plan" and len(parts) > 1 else parts[0]

    return sorted(
        f"{a} imports {b} (line {g.edges[a, b]['lines'][0]})"
        for a, b in g.edges
        if pkg(b) != pkg(a) and pkg(b) not in may_import[pkg(a)]
    )


def test_packages_import_only_the_layers_below():
    bad = layer_violations(import_graph())
    assert not bad, "imports across the package layers:\n" + "\n".join(bad)


#: the planner's layers, bottom to top (docs/development.md says each one's job): a module
#: imports from its own layer and those below only. ``build`` is planner/build.py (sizes chosen,
#: then the pipeline); the package's own lazy ``__init__`` sits above them all.
PLANNER_LAYERS = ("inputs", "memory", "fit", "schedule", "sizes", "build", "report", "cli", "__main__")


def planner_layer_violations(g: nx.DiGraph, layers=PLANNER_LAYERS, pkg: str = "capture_plan.planner") -> list[str]:
    """Each edge between two of ``pkg``'s layers that goes up, as text."""

    def layer(m: str) -> int:  # -1: none of the layers (the package itself, another package)
        rest = m[len(pkg) + 1 :].split(".")[0] if m.startswith(pkg + ".") else ""
        return layers.index(rest) if rest in layers else -1

    return sorted(f"{a} imports {b} (line {g.edges[a, b]['lines'][0]})" for a, b in g.edges if 0 <= layer(a) < layer(b))


def test_the_planners_layers_import_only_the_layers_below():
    g = import_graph()
    planner = {m.split(".")[2] for m in g if m.startswith("capture_plan.planner.")}
    assert planner - {"data"} == set(PLANNER_LAYERS), "a planner subpackage without its layer in PLANNER_LAYERS"
    bad = planner_layer_violations(g)
    assert not bad, "imports up the planner's layers (move the shared piece down):\n" + "\n".join(bad)


def test_an_import_up_the_planners_layers_is_a_violation(tmp_path):
    root = _write(
        tmp_path,
        {
            "planner/schedule/pipeline.py": "def f():\n    from ..sizes.sizes import SizesResult\n",
            "planner/sizes/sizes.py": "from ..schedule import pipeline\n",
        },
    )
    g = import_graph(root, {"capture_plan.planner": "planner"})
    assert planner_layer_violations(g) == [
        "capture_plan.planner.schedule.pipeline imports capture_plan.planner.sizes.sizes (line 2)"
    ]


def test_every_package_is_read():
    """The graph holds every module of the packages, and real edges between them."""
    g = import_graph()
    assert set(PACKAGES) == {"capture_plan", *(f"capture_plan.{p}" for p in MAY_IMPORT if p != "capture_plan")}
    for pkg in PACKAGES:
        assert pkg in g and (pkg == "capture_plan" or any(n.startswith(pkg + ".") for n in g)), pkg
    cp = "capture_plan."
    assert g.has_edge(cp + "executor.loop", cp + "executor.background")  # the lazy import in CaptureLoop.start
    assert g.has_edge(cp + "executor.loop", cp + "executor.cursor") and g.has_edge(
        cp + "executor.step", cp + "executor.recording"
    )
    assert g.has_edge(cp + "executor.driver", cp + "executor.loop")  # capture() is a user of capture_loop
    assert g.has_edge(cp + "adapters.startup", cp + "planner")
    assert g.has_edge(
        cp + "planner.schedule.pipeline", cp + "planner.inputs.resources"
    )  # `from ..inputs import resources`
    assert g.has_edge(cp + "executor", cp + "executor.loop")  # executor's lazy __getattr__
    assert g.has_edge(cp + "references.speculative", cp + "references.decode")
    assert g.has_edge(cp + "schemas", "capture_plan")


def test_the_executor_imports_no_reference_model():
    """What an engine imports (capture_plan.executor and everything it reaches)
    holds no reference model, planted bug or the planner."""
    g = import_graph()
    reached = nx.descendants(g, "capture_plan.executor") | {"capture_plan.executor"}
    assert not any(
        m.startswith(("capture_plan.references", "capture_plan.planner", "capture_plan.adapters")) for m in reached
    ), sorted(reached)


def _write(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    """``files`` (path -> text) under ``root``, every folder of them a package (an empty
    ``__init__.py`` where ``files`` gives none), as the project's are."""
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for name in files:
        for folder in pathlib.PurePosixPath(name).parents[:-1]:  # each folder of it below root
            init = root / folder / "__init__.py"
            if not init.exists():
                init.write_text("")
    return root


def test_a_circle_closed_by_a_lazy_import_is_found(tmp_path):
    """The shape executor/background.py and executor/session.py had: one imports
    the other at the top, the other imports back inside a function."""
    root = _write(
        tmp_path,
        {
            "pkg/background.py": "from .session import CaptureSession\n",
            "pkg/session.py": "def start():\n    from .background import Background\n",
        },
    )
    g = import_graph(root, {"pkg": "pkg"})
    assert cycles(g) == [["pkg.background", "pkg.session"]]
    assert _describe(g, cycles(g)[0]) == "pkg.background (line 1) -> pkg.session (line 2) -> pkg.background"


@pytest.mark.parametrize("type_checking", [False, True])
def test_type_checking_imports_are_edges_only_when_asked(tmp_path, type_checking):
    root = _write(
        tmp_path,
        {
            "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n",
            "pkg/b.py": "from . import a\n",
        },
    )
    g = import_graph(root, {"pkg": "pkg"}, type_checking=type_checking)
    assert g.has_edge("pkg.b", "pkg.a") and g.has_edge("pkg.a", "pkg.b") == type_checking
    assert cycles(g) == ([["pkg.a", "pkg.b"]] if type_checking else [])


def test_a_submodule_importing_its_lazy_package_is_a_circle(tmp_path):
    root = _write(
        tmp_path,
        {
            "pkg/__init__.py": "import importlib\n\ndef __getattr__(name):\n"
            "    return getattr(importlib.import_module('.m', __name__), name)\n",
            "pkg/m.py": "import pkg.n\n",
            "pkg/n.py": "def f():\n    from pkg import thing\n",
        },
    )
    g = import_graph(root, {"pkg": "pkg"})
    assert ["pkg", "pkg.n"] in cycles(g) and g.has_edge("pkg.m", "pkg.n")


def test_a_lazy_import_across_the_layers_is_a_violation(tmp_path):
    root = _write(
        tmp_path,
        {
            "schemas/plan.py": "def f():\n    from capture_plan.planner.build import build_plan\n",
            "planner/build.py": "from capture_plan.schemas.plan import f\n",
        },
    )
    g = import_graph(root, {"capture_plan.schemas": "schemas", "capture_plan.planner": "planner"})
    assert layer_violations(g) == ["capture_plan.schemas.plan imports capture_plan.planner.build (line 2)"]
