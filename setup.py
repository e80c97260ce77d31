"""The compiled allocator core (planner/_core.pyx), an optional extension.

Everything else about the package is in pyproject.toml. Cython is a build
dependency ([build-system] requires), so a wheel and an editable install
compile the core wherever a C compiler and Python's headers exist. Where
either is missing (or Cython is: a build without isolation), the build goes
on without it, saying why in one warning, and the planner runs its
pure-Python PoolSim instead (planner/allocator.py's ``core()``; `planner
--version` says which).
"""

import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext


def _skip(why: object) -> None:
    print(
        f"warning: capture-plan: the compiled allocator core was not built ({why}); the Python core runs",
        file=sys.stderr,
    )


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
            _skip(e)


try:
    from Cython.Build import cythonize
except ImportError as e:  # a build without build isolation, and no Cython installed
    _skip(e)
    extensions = []
else:
    from setuptools import Extension

    extensions = cythonize(
        [Extension("capture_plan.planner._core", ["planner/_core.pyx"])],
        compiler_directives={"language_level": "3"},
        quiet=True,
    )

setup(ext_modules=extensions, cmdclass={"build_ext": OptionalBuildExt})
