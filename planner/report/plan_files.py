"""Plan files: the bytes of a plan, and checking or writing one on disk.

:func:`check_plan` builds in memory (planner/build.py) and compares with the file;
:func:`write_plan` writes a plan, refusing to replace what it should not (the inputs it
was built from, another command's plan, a newer capture-plan's plan). What this does
not do: build (planner/build.py) or say what a build was asked (planner/inputs/build_options.py).
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import msgspec

from capture_plan.schemas.codec import canonical_bytes
from capture_plan.schemas.documents import sniff_kind
from capture_plan.schemas.errors import DriftError, InputError
from capture_plan.schemas.files import existing_output, read_input, write_atomic
from capture_plan.schemas.plan import PLAN_REVISION, Plan

from .. import build
from ..inputs.build_options import BuildOptions, command_for_cwd, output_path

__all__ = ["plan_bytes", "newer_revision", "check_plan", "plan_digest_ok", "write_plan", "write_atomic"]


def plan_bytes(plan: Plan) -> bytes:
    return canonical_bytes(plan)


def newer_revision(revision: object, where: str, *, force_hint: bool = False) -> None:
    """Refuse to check or replace a plan written by a newer capture-plan.

    Readers accept newer plan revisions (they only add fields), but this
    planner would rebuild such a plan without what the newer one added: the
    comparison would call it stale and a rebuild would silently downgrade it.
    """
    if isinstance(revision, int) and not isinstance(revision, bool) and revision > PLAN_REVISION:
        raise InputError(
            f"plan revision {revision} was written by a newer capture-plan (this one writes revision "
            f"{PLAN_REVISION}); checking or rebuilding it here would downgrade it",
            where=where,
            fix="upgrade capture-plan" + (", or pass --force to replace it" if force_hint else ""),
        )


def _recorded(data: bytes) -> dict:
    """The top-level fields of a plan file's bytes ({} when it is not a plan)."""
    try:
        raw = msgspec.json.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return {}
    return raw if isinstance(raw, dict) and sniff_kind(raw) == "plan" else {}


def check_plan(opts: BuildOptions, *, same_command: bool = False) -> Path:
    """Build in memory and compare with the file on disk; raise DriftError if they
    differ. InputError if the file is a newer revision (:func:`newer_revision`)
    or, with ``same_command`` (``planner build --check``), the plan of another
    command or no plan at all: a what-if (``--tp 8 --check``) compared with the
    checked-in plan of the same default name is not drift of that plan, and the
    rebuild a DriftError would advise, write_plan refuses. (``planner check``
    rebuilds a plan from its own record, where a copy under another name is
    stale.)"""
    plan = build.build_plan(opts)
    path = output_path(opts)
    fix = f"run `{command_for_cwd(opts)}`"
    # not Path.exists(): it raises on a name too long or a folder that may not be searched
    if existing_output(path, str(path), "check a plan file, not a folder", doing="check") is None:
        raise DriftError("plan is missing", where=str(path), fix=fix)
    data = read_input(path, "plan")
    if data != plan_bytes(plan):
        recorded = _recorded(data)
        newer_revision(recorded.get("revision"), f"{path}: $.revision")
        command = recorded.get("command")
        if same_command and isinstance(command, list) and command != plan.command:
            raise InputError(
                f"holds the plan of `{' '.join(map(str, command))}`, not of this command",
                where=str(path),
                fix=f"check it with `planner check {shlex.quote(str(path))}`, or give this build its own file with -o",
            )
        if same_command and not recorded:  # a rebuild would be refused too (write_plan): not drift
            raise InputError(
                "exists and is not a plan",
                where=str(path),
                fix=f"check another file with -o, or replace it with `{command_for_cwd(opts)} --force`",
            )
        if command != plan.command:  # a copy under another name: the rebuild replaces another command's plan
            fix = f"run `{command_for_cwd(opts)} --force`"
        raise DriftError(f"plan is stale: {_why_stale(data, plan, str(path))}", where=str(path), fix=fix)
    return path


def _why_stale(data: bytes, plan: Plan, source: str) -> str:
    """Which recorded input changed and how far the prediction moved
    (:func:`capture_plan.planner.report.compare_text.stale_reason`); "it differs from what the planner
    builds now" when the file cannot be read as a plan to compare with."""
    from capture_plan.schemas.codec import decode_plan
    from capture_plan.schemas.errors import CapturePlanError

    from .compare_text import stale_reason

    try:
        old = decode_plan(data, source, check_digest=False)
    except CapturePlanError:
        return "it differs from what the planner builds now"
    if plan_digest_ok(data) is False:  # what it records was edited, not built: comparing it says nothing
        return "its digest does not match its content (edited by hand or corrupted)"
    return stale_reason(old, plan)


def plan_digest_ok(data: bytes) -> bool | None:
    """Whether a plan file's recorded digest matches its content (None: not a JSON object)."""
    from capture_plan.schemas.codec import plan_digest

    try:
        raw = msgspec.json.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return None
    return raw.get("digest") == plan_digest(raw) if isinstance(raw, dict) else None


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return os.path.abspath(a) == os.path.abspath(b)


def write_plan(opts: BuildOptions, plan: Plan, *, force: bool = False) -> Path:
    """Write ``plan`` to its output path; refuse to clobber what it should not.

    Never overwrites the spec, trace or model config it was built from. Replaces an existing
    file only when that file is a plan recorded with the same command (a
    rebuild) and not written by a newer capture-plan, or with ``force``: a
    what-if build (``--tp 8``, ``-s ...``) does not silently replace the
    checked-in plan of the same default name, nor an older planner a newer
    one's plan.
    """
    path = output_path(opts)
    # every file the plan was built from, --force or not: the trace a spec names
    # (a GPU recording) and a model config too, found from the plan's own record
    inputs = plan.inputs
    sources = [
        ("spec", "--spec ", opts.spec),
        ("trace", "--trace ", opts.trace),
        ("calibration report", "--calibration ", opts.calibration),
        ("traffic", "--traffic ", opts.sizes.traffic if opts.sizes is not None else None),
        ("timing report", "--timing ", opts.sizes.timing if opts.sizes is not None else None),
    ]
    sources += [
        (what, "", path.parent / rel)
        for what, rel in (("trace", inputs.trace), ("model config", inputs.model_config))
        if rel
    ]
    for what, flag, src in sources:
        if src is not None and _same_file(path, src):
            raise InputError(
                f"the output is the {what} file",
                where=str(path),
                fix=f"name another output with -o (it would overwrite {flag}{src})",
            )
    # a folder at the path is refused here, not after "pass --force" (which the
    # write then refused too); a name too long or a folder that may not be searched
    # is "cannot write", not an internal error (Path.exists() raises on both)
    existing = existing_output(
        path,
        str(path),
        "name a plan file with -o, not a folder",
        # a build never writes to a device or a pipe; what `-o /dev/null` is typed for is the dry run
        special_fix="to build without writing a plan, pass --dry-run instead of -o: "
        f"`{command_for_cwd(msgspec.structs.replace(opts, output=None))} --dry-run`",
    )
    if existing is not None and not force:
        try:
            recorded = _recorded(read_input(path, "plan"))
        except InputError:  # unreadable as a plan: not one this build may replace
            recorded = {}
        command = recorded.get("command")
        if command is not None:
            newer_revision(recorded.get("revision"), f"{path}: $.revision", force_hint=True)
        if command != plan.command:
            what = (
                f"holds a plan built by `{shlex.join(map(str, command))}`"
                if isinstance(command, list)
                else "exists and is not a plan"
            )
            raise InputError(
                f"{what}; this build would replace it",
                where=str(path),
                fix="write a what-if plan elsewhere with -o, or pass --force to replace it",
            )
    write_atomic(path, plan_bytes(plan))
    return path
