"""Drift check over checked-in plans, driven by the command each plan records."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterable

from schemas.errors import DriftError, InputError

__all__ = ["check_paths", "options_from_command"]


def options_from_command(cmd: list[str], where: str):
    """Parse a plan's normalized ``planner build`` command back into options."""
    from .build import BuildOptions

    if cmd[:2] != ["planner", "build"]:
        raise InputError(f"recorded command is not `planner build`: {' '.join(cmd)}", where=where)
    kw: dict = {"strategies": []}
    it = iter(cmd[2:])
    flags = {"--backend": ("backend", str), "--spec": ("spec", Path), "--speculative": ("speculative", str),
             "--max-bs": ("max_bs", int), "--tp": ("tp", int), "--allocator": ("allocator", str),
             "--trace": ("trace", Path), "-o": ("output", Path)}
    for arg in it:
        if arg in ("--ci", "--exact"):
            kw[arg[2:]] = True
        elif arg == "--strategy":
            kw["strategies"].append(next(it))
        elif arg in flags:
            name, conv = flags[arg]
            kw[name] = conv(next(it))
        else:
            raise InputError(f"unknown option {arg!r} in recorded command", where=where)
    kw["strategies"] = tuple(kw["strategies"])
    return BuildOptions(**kw)


def check_paths(paths: Iterable[Path], fix: bool = False) -> list[str]:
    """Check every plan; raise one DriftError listing all stale files.

    ``fix=True`` rebuilds stale plans in place (each from its own recorded
    command) instead of failing.
    """
    from .build import build_plan, check_plan, plan_bytes
    from schemas.codec import decode_plan
    from schemas.files import write_atomic

    files: list[Path] = []
    for p in paths:
        files += sorted(p.glob("*.json")) if p.is_dir() else [p]
    if not files:
        raise InputError("no plan files found", where=", ".join(map(str, paths)))
    ok, stale = [], []
    for f in files:
        try:
            plan = decode_plan(f.read_bytes(), str(f), check_digest=False)
        except OSError as err:
            raise InputError(f"cannot read plan: {err.strerror}", where=str(f)) from None
        opts = options_from_command(plan.command, f"{f}: $.command")
        if opts.output is None and Path(f).as_posix() != f"plans/{f.name}":
            opts = dataclasses.replace(opts, output=f)  # a plan checked where it lies
        try:
            check_plan(opts)
            ok.append(f"{f}: up to date")
        except DriftError as err:
            if not fix:
                stale.append(err)
                continue
            write_atomic(f, plan_bytes(build_plan(opts)))
            ok.append(f"{f}: rebuilt ({' '.join(plan.command)})")
    if stale:
        raise DriftError("; ".join(f"{e.where}: {e.what} ({e.fix})" for e in stale),
                         where=f"{len(stale)} of {len(files)} plan(s) stale",
                         fix="or rebuild them all with `planner check --fix`")
    return ok
