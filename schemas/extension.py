"""An optional compiled extension, or the Python code it speeds up: which one a process runs.

Two are built at install time where a C compiler exists (setup.py): the allocator core
(planner/memory/_core.pyx; in Python, ``PoolSim``) and the graph builder (executor/_graph_build.pyx;
in Python, the ctypes path). Each does what its Python twin does (tests compare them), so the
choice changes speed only. An environment variable forces one: ``compiled`` requires the
extension (an error where it did not load), the twin's name runs the twin; unset or ``auto``
runs the extension where it loads, else the twin, with one INFO line saying why.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NamedTuple

from .errors import CapturePlanError

__all__ = ["Extension"]


class Extension(NamedTuple):
    """One optional extension and how its choice is told: ``module`` (its dotted name), ``what``
    it is ("allocator core"), the environment variable ``env`` that forces a choice, its
    ``python`` twin's name there ("python", "ctypes"), why the twin is ``same`` (the fix of a
    required extension that did not load says it) and the ``error`` a wrong choice raises."""

    module: str
    what: str
    env: str
    python: str
    same: str
    error: type[CapturePlanError]

    def load(self, *, log: bool = True) -> tuple[ModuleType | None, str]:
        """The extension's module, or None where the twin runs and why (``ENV=python``, or why the
        module did not load); an :attr:`error` where ``env`` names neither or requires the
        extension that did not load. ``log``: the fallback's INFO line (off for a check ahead
        of the run that logs it)."""
        env, what = self.env, self.what
        want = os.environ.get(env, "").strip().lower()
        if want not in ("", "auto", self.python, "compiled"):
            raise self.error(
                f"{env}={os.environ[env]!r} names no {what} ({self.python}, compiled or auto)",
                where=f"environment variable {env}",
                fix=f"unset {env}",
            )
        if want == self.python:
            return None, f"{env}={self.python}"
        try:
            # by name: the extension is no module of the source tree
            return importlib.import_module(self.module), ""
        except ImportError as e:  # not built here (no C compiler at install time), or built for another Python
            why = f"the compiled {what} did not load: {e}"
        if want == "compiled":
            raise self.error(
                f"{env}=compiled, but {why}",
                where=f"environment variable {env}",
                fix=f"unset {env} ({self.same}), or reinstall with a C compiler: "
                "pip install --force-reinstall --no-deps .",
            )
        if not log:
            return None, why
        import logging  # only here: importing it is a tenth of a quick build's start-up

        logging.getLogger(__name__).info("%s: running %s; %s", what, self.python, why)
        return None, why
