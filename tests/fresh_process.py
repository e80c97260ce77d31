"""A script of tests/ run in a fresh interpreter (a process that has captured, loaded or
imported nothing yet), its result the JSON it prints on a ``RESULT`` line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def fresh_result(script: str, *args: str, timeout: float) -> dict:
    """tests/``script`` run with ``args`` in a fresh interpreter: its last RESULT line, read
    as JSON; the test fails with the script's output where it exits non-zero or prints none."""
    p = subprocess.run(
        [sys.executable, str(Path(__file__).parent / script), *args], capture_output=True, text=True, timeout=timeout
    )
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT ") :])
