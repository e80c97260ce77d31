"""A command imports what it uses: the modules the Quickstart's build loads, pinned.

Most of a quick command's time is its start-up (issue 31: the 36-size Quickstart build
spent two thirds of it importing), so a module the build does not use must not load
with it. The pinned list changes when the build's code moves between modules; a new
entry needs a reason (the build calls into it), else the import belongs inside the
function that uses it. ``bench/build_bench.py`` times the whole command against an
older commit.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from capture_plan.planner.memory.core import CORE_ENV

#: every capture_plan module `planner build --backend fa3 --ci` imports (the compiled
#: core's extension besides, where it runs): each one's code runs in that build
QUICKSTART_MODULES = {
    "capture_plan",
    "capture_plan.planner",
    "capture_plan.planner.memory.allocator",
    "capture_plan.planner.memory.analytic",
    "capture_plan.planner.memory.core",
    "capture_plan.planner.build",
    "capture_plan.planner.inputs.build_options",
    "capture_plan.planner.cli",
    "capture_plan.planner.cli._build_inputs",
    "capture_plan.planner.cli._common",
    "capture_plan.planner.cli.build",
    "capture_plan.planner.inputs",
    "capture_plan.planner.memory",
    "capture_plan.planner.report",
    "capture_plan.planner.schedule",
    "capture_plan.planner.memory.device",
    "capture_plan.planner.inputs.dimensions",
    "capture_plan.planner.memory.fidelity",
    "capture_plan.planner.schedule.graph",
    "capture_plan.planner.schedule.keys",
    "capture_plan.planner.schedule.optimize",
    "capture_plan.planner.schedule.pipeline",
    "capture_plan.planner.schedule.read",
    "capture_plan.planner.schedule.resolve",
    "capture_plan.planner.schedule.sequence",
    "capture_plan.planner.report.plan_files",
    "capture_plan.planner.memory.program",
    "capture_plan.planner.report.render",
    "capture_plan.planner.inputs.resources",
    "capture_plan.planner.inputs.rules",
    "capture_plan.planner.memory.simulate",
    "capture_plan.planner.inputs.specs",
    "capture_plan.planner.inputs.validate",
    "capture_plan.planner.memory.workload",
    "capture_plan.schemas",
    "capture_plan.schemas.build_flags",
    "capture_plan.schemas.codec",
    "capture_plan.schemas.conversion",
    "capture_plan.schemas.documents",
    "capture_plan.schemas.hashing",
    "capture_plan.schemas.errors",
    "capture_plan.schemas.extension",
    "capture_plan.schemas.files",
    "capture_plan.schemas.capture_sequence",
    "capture_plan.schemas.key_fields",
    "capture_plan.schemas.keys",
    "capture_plan.schemas.limits",
    "capture_plan.schemas.plan",
    "capture_plan.schemas.spec",
    "capture_plan.schemas.strategy",
    "capture_plan.schemas.trace",
    "capture_plan.schemas.units",
}

#: modules that cost the build's start-up and that it does not use: logging (only a core's
#: fallback logs), dataclasses (its classes are built at import), difflib (`diff` and
#: `check`), json (reading JSON inputs), importlib.metadata (the version is a constant),
#: importlib.resources (data files are plain files next to the code), tempfile and shutil
#: (a plan is written through its own temporary name), subprocess, copy, and the libraries
#: of other commands
NOT_IMPORTED = (
    "logging",
    "dataclasses",
    "difflib",
    # OpenSSL: 11 million instructions to load, for digests of a few kilobytes
    # (schemas/hashing.py)
    "hashlib",
    "json",
    "importlib.metadata",
    "importlib.resources",
    "tempfile",
    "shutil",
    "subprocess",
    "copy",
    "networkx",
    "matplotlib",
    "numpy",
    "torch",
)

_PROBE = """
import sys
from capture_plan.planner.cli import main
code = main(["build", "--backend", "fa3", "--ci"])
print(code)
print(" ".join(sorted(m for m in sys.modules if m.startswith("capture_plan"))))
print(" ".join(m for m in {not_imported!r} if m in sys.modules))
"""


def _quickstart_imports(tmp_path, core: str | None) -> tuple[set[str], list[str]]:
    env = {k: v for k, v in os.environ.items() if k != CORE_ENV}
    if core:
        env[CORE_ENV] = core
    r = subprocess.run(
        [sys.executable, "-c", _PROBE.format(not_imported=NOT_IMPORTED)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    code, modules, unwanted = (r.stdout.splitlines()[-3:] + [""])[:3]
    assert code == "0", r.stdout
    return set(modules.split()), unwanted.split()


def _differences(got: set[str], want: set[str]) -> str:
    return (
        f"the Quickstart build imports {sorted(got - want)} besides the pinned modules and not "
        f"{sorted(want - got)}: import a module inside the function that uses it, or, where the "
        "build runs its code, update QUICKSTART_MODULES in tests/test_startup_imports.py"
    )


def test_the_quickstart_build_imports_the_pinned_modules_and_nothing_it_does_not_use(tmp_path):
    """With the Python core (the same on every machine, a C compiler or not)."""
    got, unwanted = _quickstart_imports(tmp_path, "python")
    assert got == QUICKSTART_MODULES, _differences(got, QUICKSTART_MODULES)
    assert unwanted == [], f"the Quickstart build imports {unwanted}, which it does not use"


def test_with_the_compiled_core_it_imports_the_extension_besides(tmp_path):
    from capture_plan.planner.memory.core import core

    if core().name != "compiled":
        pytest.skip(f"the compiled core does not run here: {core().describe()}")
    got, unwanted = _quickstart_imports(tmp_path, None)
    want = QUICKSTART_MODULES | {"capture_plan.planner.memory._core"}
    assert got == want, _differences(got, want)
    assert unwanted == [], f"the Quickstart build imports {unwanted}, which it does not use"


def test_the_schemas_lazy_attributes_all_load_and_are_listed():
    """capture_plan.schemas loads its types on first use (PEP 562): each name it exports
    loads (``from capture_plan.schemas import *`` takes them all) and ``dir()`` lists it,
    as it did when they were imported eagerly."""
    import capture_plan.schemas as schemas

    names: dict = {}
    exec("from capture_plan.schemas import *", names)
    assert set(schemas.__all__) <= set(names)
    assert set(schemas.__all__) <= set(dir(schemas))
    assert all(
        getattr(schemas, n).__module__.startswith("capture_plan.schemas.")
        for n in schemas._WHERE
        if isinstance(getattr(schemas, n), type)
    )
