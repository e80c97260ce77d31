"""A runner's adoption diff, counted from its own source.

A runner in this folder is the adopted version; each line the adoption adds
ends with ``# +`` (a comment may follow: ``# + was range(2)``), and each line
it removed stays as a comment ``# - <the original code>`` at the code's
indentation. :func:`versions` reads both versions back from that one file;
:func:`counted` is the diff's size (lines added, lines removed) by
``difflib.ndiff``; :func:`before_module` imports the version before the adoption,
which the tests run without capture-plan, so the count is of two programs
that both work, not of markers typed by hand.
"""

from __future__ import annotations

import difflib
import importlib.util
import re
import sys
from pathlib import Path

ADDED = re.compile(r"\s+# \+(?: .*)?$")
REMOVED = re.compile(r"^(\s*)# - (.*)$")


def versions(path: Path) -> tuple[str, str]:
    """(before, after) of the runner at ``path``."""
    before, after = [], []
    for line in Path(path).read_text().splitlines():
        gone = REMOVED.match(line)
        if gone:
            before.append(gone.group(1) + gone.group(2))
        elif ADDED.search(line):
            after.append(ADDED.sub("", line))
        else:
            before.append(line)
            after.append(line)
    return "\n".join(before) + "\n", "\n".join(after) + "\n"


def counted(path: Path) -> tuple[int, int]:
    """Lines the adoption adds and removes in the runner at ``path`` (a unified diff's + and - lines)."""
    before, after = versions(path)
    diff = list(difflib.ndiff(before.splitlines(), after.splitlines()))
    return sum(d.startswith("+ ") for d in diff), sum(d.startswith("- ") for d in diff)


def before_module(path: Path, tmp_path: Path, name: str):
    """The runner at ``path`` as it was before the adoption, imported as ``name``."""
    before, _ = versions(path)
    file = Path(tmp_path) / f"{name}.py"
    file.write_text(before)
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
