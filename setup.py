"""The compiled allocator core (planner/_core.pyx), an optional extension.

Everything else about the package is in pyproject.toml. Cython is a build
dependency ([build-system] requires), so a wheel and an editable install
compile the core wherever a C compiler and Python's headers exist. Where
either is missing the build goes on without it (``optional=True``: setuptools
prints why and skips the extension) and the planner runs its pure-Python
PoolSim instead (planner/allocator.py's ``core()``; `planner --version` says
which).
"""

from Cython.Build import cythonize
from setuptools import Extension, setup

setup(
    ext_modules=cythonize(
        [Extension("capture_plan.planner._core", ["planner/_core.pyx"], optional=True)],
        compiler_directives={"language_level": "3"},
        quiet=True,
    )
)
