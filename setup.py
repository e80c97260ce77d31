"""Two optional extensions: planner/memory/_core.pyx and executor/_graph_build.pyx.

The compiled allocator core and the compiled graph builder.

Everything else about the package is in pyproject.toml. Cython is a build
dependency ([build-system] requires), so a wheel and an editable install
compile both wherever a C compiler and Python's headers exist. Where
either is missing (or Cython is: a build without isolation), the build goes
on without them, saying why in one warning each, and the planner runs its
pure-Python PoolSim instead (planner/memory/core.py's ``core()``; `planner
--version` says which), a restore its ctypes graph builder
(executor/graph_flat.py's ``graph_builder()``; the restore's report says which).
Neither needs CUDA to build: the graph builder calls the driver through
addresses it is handed at run time.

The build also parses each data file once (planner/data/*.toml; ``parse_data``): an
installed planner reads the parsed copy instead of importing tomllib and parsing.
"""

import hashlib
import json
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

#: planner/inputs/resources.py's PARSED_SUFFIX (this file cannot import the package it builds;
#: tests/test_wheel.py checks a wheel's copies are read)
PARSED_SUFFIX = ".parsed.json"


#: per extension: what is not built, and what runs instead
_WITHOUT = {
    "capture_plan.planner.memory._core": ("the compiled allocator core", "the Python core runs"),
    "capture_plan.executor._graph_build": ("the compiled graph builder", "a restore adds nodes through ctypes"),
}


def _skip(why: object, name: str | None = None) -> None:
    for ext, (what, instead) in _WITHOUT.items():
        if name in (None, ext):
            print(f"warning: capture-plan: {what} was not built ({why}); {instead}", file=sys.stderr)


class OptionalBuildExt(build_ext):
    """build_ext that never fails the install: no compiler, no headers and a failed compile
    all leave the package without its extension (setuptools' ``optional=True`` lets a
    missing compiler's OSError through)."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as e:  # e.g. no compiler found for this platform at all
            _skip(e)

    def build_extension(self, ext) -> None:
        try:
            super().build_extension(ext)
        except Exception as e:
            _skip(e, ext.name)


try:
    from Cython.Build import cythonize
except ImportError as e:  # a build without build isolation, and no Cython installed
    _skip(e)
    extensions = []
else:
    from setuptools import Extension

    extensions = cythonize(
        [
            Extension("capture_plan.planner.memory._core", ["planner/memory/_core.pyx"]),
            Extension("capture_plan.executor._graph_build", ["executor/_graph_build.pyx"]),
        ],
        compiler_directives={"language_level": "3"},
        quiet=True,
    )


def parse_data(folder: Path) -> None:
    """Beside each ``NAME.toml`` in ``folder`` and its ``releases/``, ``NAME.toml`` + PARSED_SUFFIX: the document
    tomllib parses from it and the SHA-256 of its bytes, as JSON (planner/inputs/resources.py's
    ``parsed_at_install`` reads it where the digest is the file's). None on Python 3.10
    (no tomllib, and tomli is no build dependency) or for a document JSON cannot hold
    (TOML dates): the installed planner parses those itself."""
    try:
        import tomllib
    except ImportError:
        return
    for toml in sorted([*folder.glob("*.toml"), *folder.glob("releases/*.toml")]):
        raw = toml.read_bytes()
        try:
            text = json.dumps({"sha256": hashlib.sha256(raw).hexdigest(), "data": tomllib.loads(raw.decode())})
        except (TypeError, ValueError):
            continue
        toml.with_name(toml.name + PARSED_SUFFIX).write_text(text, encoding="utf-8")


class BuildPy(build_py):
    """build_py without this file, then the data files parsed once (:func:`parse_data`).

    The package capture_plan is the repository's root (pyproject's package-dir), so
    build_py would ship this build script as the module ``capture_plan.setup``, whose
    import runs a build."""

    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if (m[0], m[1]) != ("capture_plan", "setup")]

    def run(self) -> None:
        super().run()
        if not self.editable_mode:  # an editable install reads the checkout's files
            parse_data(Path(self.build_lib) / "capture_plan" / "planner" / "data")


setup(ext_modules=extensions, cmdclass={"build_ext": OptionalBuildExt, "build_py": BuildPy})
