#!/usr/bin/env python3
"""The README's Quickstart commands, read from README.md, so CI runs exactly what a newcomer types.

``python3 .ci/quickstart.py`` prints them, one a line; ``--run`` runs each with ``bash -euo pipefail -c``
in the repository's root and stops at the first that fails (its exit code). The README's block is
the one fenced ``sh`` block under ``## Quickstart``; each non-blank line is one command. It reads
nothing else and installs nothing itself: what the commands install is all the machine gets.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def commands(readme: str) -> list[str]:
    """The non-blank lines of the first ``sh`` block under ``## Quickstart``."""
    block = readme.split("## Quickstart", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def main(argv: list[str]) -> int:
    cmds = commands((ROOT / "README.md").read_text(encoding="utf-8"))
    if argv != ["--run"]:
        print("\n".join(cmds))
        return 0
    for cmd in cmds:
        print(f"quickstart: {cmd}", flush=True)
        code = subprocess.run(["bash", "-euo", "pipefail", "-c", cmd], cwd=ROOT).returncode
        if code:
            print(f"quickstart: exit {code}: {cmd}", file=sys.stderr)
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
