#!/usr/bin/env python3
"""Download every known engine release's wheel, one ``pip download`` per pin, for the wheel contract.

``python3 .ci/engine_wheels.py DIR`` asks ``python -m capture_plan.adapters.plugins.hooks`` for the
pins (every known release: vLLM 0.33.0 and 0.34.0 both) and runs ``pip download --no-deps -d DIR
PIN`` once per pin with the interpreter that runs this script. One command per pin because pip
refuses two versions of one distribution in one command (``ResolutionImpossible``, pip 23.2 to
26.3): the single command .ci/run used before never downloaded anything, and the contract's seven
wheel tests skipped on every clean clone (issue 49). A pin that fails to download ends the script
with pip's exit code and a line naming the pin: CI fails instead of skipping the contract.
"""

from __future__ import annotations

import subprocess
import sys


def pins(python: str) -> list[str]:
    """The pins the hook table names (``engine==version``), from the installed capture_plan."""
    out = subprocess.run(
        [python, "-m", "capture_plan.adapters.plugins.hooks"], check=True, capture_output=True, text=True
    ).stdout
    return out.split()


def download_commands(python: str, dest: str, wanted: list[str]) -> list[list[str]]:
    """One ``pip download`` command per pin: never two versions of one distribution in a command."""
    return [
        [python, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps", "-d", dest, pin]
        for pin in wanted
    ]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python3 .ci/engine_wheels.py DIR", file=sys.stderr)
        return 2
    wanted = pins(sys.executable)
    if not wanted:
        print("ci: the hook table names no engine release: nothing for the wheel contract to check", file=sys.stderr)
        return 1
    for cmd in download_commands(sys.executable, argv[0], wanted):
        code = subprocess.run(cmd).returncode
        if code:
            print(f"ci: pip download of {cmd[-1]} failed (exit {code}): {' '.join(cmd)}", file=sys.stderr)
            return code
    print(f"ci: engine wheels in {argv[0]}: {' '.join(wanted)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
