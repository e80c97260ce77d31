"""The benchmarks' modules, for the tests that drive their parts.

``bench`` is a package of the repository, not of the wheel: its scripts run as
``python -m bench.<name>`` from the repository's root, where the working folder makes
it importable. A test may run from elsewhere (``pytest`` without ``python -m``), so
:func:`bench_module` imports the package from its folder by location, without putting
the repository's root on ``sys.path`` (which would make the repository's other folders
importable under their own names too).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def bench_module(name: str):
    """``bench.<name>`` of this repository (``bench`` itself for ``""``)."""
    pkg = sys.modules.get("bench")
    if pkg is None:
        spec = importlib.util.spec_from_file_location(
            "bench", ROOT / "bench" / "__init__.py", submodule_search_locations=[str(ROOT / "bench")]
        )
        pkg = importlib.util.module_from_spec(spec)
        sys.modules["bench"] = pkg
        spec.loader.exec_module(pkg)
    elif Path(pkg.__file__).resolve().parent != ROOT / "bench":
        raise ImportError(f"another `bench` is imported ({pkg.__file__}), not {ROOT / 'bench'}")
    return importlib.import_module(f"bench.{name}") if name else pkg
