"""Drift check over checked-in plans, driven by the command each plan records.

Each plan is checked against a rebuild of its own command *to its own path*:
the recorded paths are relative to the plan's folder (see
:func:`planner.build.normalized_command`), so the answer is the same from any
working directory, and a copy stored under another name is a different plan
(its name and ``-o`` differ), never "up to date". The digest is verified
first: a plan that fails it (edited by hand, a merge resolved by hand) is
stale, and ``--fix`` rebuilds it from the command it records, which is parsed
defensively since it may be what was edited.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from schemas.errors import DriftError, InputError, WrongKindError

__all__ = ["check_paths", "options_from_command", "check_report_plan", "StalePlans"]

_VALUED = {"--backend": ("backend", str), "--spec": ("spec", Path), "--speculative": ("speculative", str),
           "--preset": ("preset", str),
           "--max-bs": ("max_bs", int), "--tp": ("tp", int), "--allocator": ("allocator", str),
           "--trace": ("trace", Path), "--calibration": ("calibration", Path), "-o": ("output", Path), "--strategy": ("strategies", str)}


def options_from_command(cmd: list[str], where: str, plan_path: Path):
    """Parse a plan's recorded ``planner build`` command back into options, its
    paths relative to ``plan_path``'s folder and its output ``plan_path``."""
    from .build import BuildOptions

    if cmd[:2] != ["planner", "build"]:
        raise InputError(f"recorded command is not `planner build`: {' '.join(cmd)}", where=where)
    kw: dict = {"strategies": []}
    args = cmd[2:]
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("--ci", "--exact"):
            kw[arg[2:]] = True
            i += 1
            continue
        if arg not in _VALUED:
            raise InputError(f"unknown option {arg!r} in recorded command", where=where)
        if i + 1 >= len(args):
            raise InputError(f"option {arg} has no value in recorded command", where=where)
        name, conv = _VALUED[arg]
        try:
            value = conv(args[i + 1])
        except ValueError:
            raise InputError(f"option {arg} has a bad value {args[i + 1]!r} in recorded command", where=where) from None
        if name == "strategies":
            kw[name].append(value)
        elif name in kw:
            raise InputError(f"option {arg} given twice in recorded command", where=where)
        else:
            kw[name] = value
        i += 2
    if "backend" not in kw:
        raise InputError("recorded command has no --backend", where=where)
    base = plan_path.parent
    for name in ("spec", "trace", "calibration"):
        if name in kw:
            # lexically, as build records them (build._rel): through a linked plans folder,
            # the OS would resolve plans/../specs from the link's target, another folder
            kw[name] = Path(os.path.normpath(base / kw[name]))
    # The output is where the plan lies: a copy under another name rebuilds with
    # that name (and -o), so it is never "up to date" as someone else's plan.
    kw["output"] = plan_path
    kw["strategies"] = tuple(kw["strategies"])
    return BuildOptions(**kw)


def _link_target(path: Path) -> Path:
    """``path``, or the file that the symlink(s) at ``path`` name.

    A plan is checked, and rebuilt, where it really lies: through a link
    (``plans/latest.json -> fa3.json``) its name and recorded ``-o`` would be
    the link's, so it was "stale", and ``--fix`` wrote a plan named after the
    link over the file it points to. Joined lexically, like every recorded
    path; a loop is left to the reader, which reports it.
    """
    for _ in range(40):
        try:
            if not path.is_symlink():
                return path
            path = Path(os.path.normpath(path.parent / os.readlink(path)))
        except (OSError, ValueError):
            return path
    return path


def _plan_files(paths: Iterable[Path]) -> list[tuple[Path, Path | None]]:
    """The plan files named or held (``*.json``) by ``paths``, links followed,
    each file once (a folder and a file in it, or a link beside its target),
    with the folder that held it (None: named as a file)."""
    files: list[tuple[Path, Path | None]] = []
    seen: set[str] = set()
    for p in paths:
        try:
            is_dir = p.is_dir()
        except (OSError, ValueError):
            is_dir = False
        for f in sorted(p.glob("*.json")) if is_dir else [p]:
            f = _link_target(f)
            try:
                key = os.path.realpath(f)
            except (OSError, ValueError):
                key = str(f)
            if key not in seen:
                seen.add(key)
                files.append((f, p if is_dir else None))
    return files


def check_paths(paths: Iterable[Path], fix: bool = False) -> list[str]:
    """Check every plan; raise :class:`StalePlans` (a DriftError) naming every stale file.

    ``fix=True`` rebuilds stale plans in place (each from its own recorded
    command) instead of failing. A plan whose digest does not match, or whose
    recorded command cannot be read, or that a newer capture-plan wrote (a
    newer plan revision, which a rebuild here would downgrade), is an
    :class:`InputError` either way.
    """
    from .build import build_plan, check_plan, command_for_cwd, newer_revision, plan_bytes
    from schemas.codec import decode_plan
    from schemas.files import read_input, write_atomic

    paths = list(paths)
    files = _plan_files(paths)
    if not files:
        raise InputError("no plan files found", where=", ".join(map(str, paths)),
                         fix="name plan files or folders that hold them")
    ok, stale = [], []
    for f, folder in files:
        data = read_input(f, "plan")
        try:  # digest first: a plan that passes is read as written by the planner
            plan, tampered = decode_plan(data, str(f)), None
        except WrongKindError as err:  # not a plan at all: a trace, a report, some other JSON
            if folder is not None:
                err.fix = (f"move it out of {folder} (`planner check` reads every *.json there), "
                           "or name the plan files")
            raise
        except InputError as err:
            if "digest mismatch" not in err.what:
                raise
            plan = decode_plan(data, str(f), check_digest=False)
            tampered = DriftError("plan is stale: its digest does not match its content (edited by hand or "
                                  "corrupted)", where=str(f))
        # before trusting anything else: a newer planner's plan is never rebuilt (downgraded) here
        newer_revision(plan.revision, f"{f}: $.revision")
        opts = options_from_command(plan.command, f"{f}: $.command", f)
        try:
            if tampered is not None:
                tampered.fix = f"run `{command_for_cwd(opts)}`"
                raise tampered
            check_plan(opts)
            ok.append(f"{f}: up to date")
        except DriftError as err:
            if not fix:
                stale.append(err)
                continue
            write_atomic(f, plan_bytes(build_plan(opts)))
            ok.append(f"{f}: rebuilt ({command_for_cwd(opts)})")
    if stale:
        raise StalePlans(stale, ok, len(files))
    return ok


class StalePlans(DriftError):
    """Some plans are stale: ``stale`` holds one DriftError per plan (which
    input changed, how far the prediction moved, the command that fixes it),
    ``ok`` the lines of the plans that were fine. ``str()`` is the summary
    line; the CLI prints each plan's error on its own line before it (one
    line of 1,100 characters for five plans could not be read)."""

    def __init__(self, stale: list[DriftError], ok: list[str], checked: int):
        self.stale, self.ok = stale, ok
        super().__init__(f"{len(stale)} of {checked} plan(s) stale", fix="run the command each line above names, "
                         "or rebuild them all with `planner check --fix`")


def check_report_plan(report, plan, report_source: str, plan_source: str, report_digest: str = "") -> None:
    """Refuse a capture report checked against a plan it was not captured from
    (``planner report R --plan P``): the digests differ. Reports are read
    leniently across revisions; the digest is what ties one to its plan. The
    plan's own calibration report (``report_digest`` equal to the one the plan
    records) is accepted: it was captured from the plan before its device
    items were added, the same steps."""
    own = bool(report_digest) and report_digest == getattr(plan.inputs, "calibration_digest", None)
    if report.plan_digest != plan.digest and not own:
        raise InputError(f"report was captured from plan {report.plan!r} ({report.plan_digest}), not from "
                         f"{plan_source} ({plan.name!r}, {plan.digest})", where=f"{report_source}: $.plan_digest",
                         fix=f"pass the plan it was captured from, or capture again with {plan_source}")
    calibrated = plan.predicted.device.device if plan.predicted.device is not None else ""
    measured = report.device + (f", driver {report.driver}" if report.driver else "")
    if calibrated and measured != calibrated:  # another device or driver: the items would not compare
        raise InputError(f"the plan's device items were measured on {calibrated!r}, this report on {measured!r}",
                         where=f"{report_source}: $.device",
                         fix=f"compare a report from that device and driver, or rebuild {plan_source} with "
                             f"--calibration {report_source}")
