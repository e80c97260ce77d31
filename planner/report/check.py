"""Drift check over checked-in plans, driven by the command each plan records.

Each plan is checked against a rebuild of its own command *to its own path*:
the recorded paths are relative to the plan's folder (see
:func:`capture_plan.planner.inputs.build_options.normalized_command`), so the answer is the same from any
working directory, and a copy stored under another name is a different plan
(its name and ``-o`` differ), never "up to date". The digest is verified
first: a plan that fails it (edited by hand, a merge resolved by hand) is
stale, and ``--fix`` rebuilds it from the options it records (``inputs.build``:
the same structure ``planner build`` fills, typed, so an edited record is a
located decode error, not a parse).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Iterable
from pathlib import Path

import msgspec

from capture_plan.schemas.errors import CapturePlanError, DriftError, InputError, WrongKindError

__all__ = ["check_paths", "recorded_options", "check_report_plan", "StalePlans"]


def recorded_options(plan, plan_path: Path):
    """The options that rebuild ``plan`` (lying at ``plan_path``) from its record
    (``inputs.build``, :func:`capture_plan.planner.inputs.build_options.options_from_record`). A plan written
    before the record existed (revision 1) is stale: rebuild it once with the
    command it records, shown in the error."""
    from ..inputs.build_options import command_for_cwd, options_from_command, options_from_record

    rec = plan.inputs.build
    if isinstance(rec, msgspec.UnsetType):
        # the text's paths are relative to the plan's folder and its output is the default
        # name there: run verbatim from here (or there) it would write another file
        opts = options_from_command(list(map(str, plan.command)), plan_path)
        folder = os.path.dirname(str(plan_path)) or "."
        fix = (
            f"rebuild it once: `{command_for_cwd(opts)} --force`"
            if opts is not None
            else f"rebuild it once with the options of `{' '.join(map(str, plan.command))}`, "
            f"its paths relative to {folder}, and `-o {plan_path} --force`"
        )
        err = DriftError(f"plan revision {plan.revision} records its build only as text", where=str(plan_path), fix=fix)
        err.fixable = False  # `planner check --fix` has nothing to rebuild from
        raise err
    return options_from_record(rec, plan_path)


def _from_record(plan_path: Path, fn, opts):
    """``fn(opts)``; an input error of the rebuild (the record names something this
    planner refuses) is located at the plan's record as well."""
    try:
        return fn(opts)
    except DriftError:
        raise
    except InputError as err:
        err.where = f"{plan_path}: $.inputs.build ({err.where})" if err.where else f"{plan_path}: $.inputs.build"
        raise


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


def _is_plan_file(path: Path) -> bool:
    """Whether a ``*.json`` a folder holds is a plan file: a JSON object with a plan's
    ``command`` and ``steps`` (schemas/documents.py's sniff_kind, what ``decode_plan`` asks of
    a plan). A file that cannot be read or is not JSON at all counts as one: a plan cut short
    or left with merge markers is reported, never skipped; a model's config.json, a trace or a
    report beside the plans is not one."""
    from capture_plan.schemas.documents import sniff_kind
    from capture_plan.schemas.files import read_input

    try:
        raw = msgspec.json.decode(read_input(path, "plan"))
    except (CapturePlanError, msgspec.DecodeError, RecursionError):
        return True
    return sniff_kind(raw) == "plan"


def _plan_files(paths: Iterable[Path], skipped: list[str] | None = None) -> list[tuple[Path, Path | None]]:
    """The plan files named or held (``*.json``) by ``paths``, links followed,
    each file once (a folder and a file in it, or a link beside its target),
    with the folder that held it (None: named as a file). A JSON a folder holds that
    is not a plan (:func:`_is_plan_file`) is left out, one line for it in ``skipped``;
    one named as a file is kept, and refused as not a plan."""
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
            if key in seen:
                continue
            seen.add(key)
            if is_dir and not _is_plan_file(f):
                if skipped is not None:
                    skipped.append(f"{f}: skipped, not a plan file")
                continue
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
    from capture_plan.schemas.codec import decode_plan
    from capture_plan.schemas.files import read_input, write_atomic

    from ..build import build_plan
    from ..inputs.build_options import command_for_cwd, normalized_command
    from .plan_files import check_plan, newer_revision, plan_bytes

    paths = list(paths)
    skipped: list[str] = []
    files = _plan_files(paths, skipped)
    if not files:
        raise InputError(
            "no plan files found" + (f" ({len(skipped)} other JSON file(s) skipped)" if skipped else ""),
            where=", ".join(map(str, paths)),
            fix="name plan files or folders that hold them",
        )
    ok, stale, failed = list(skipped), [], []
    for f, folder in files:
        data = read_input(f, "plan")
        try:  # digest first: a plan that passes is read as written by the planner
            plan, tampered = decode_plan(data, str(f)), None
        except WrongKindError as err:  # not a plan at all: a trace, a report, some other JSON
            if folder is not None:
                err.fix = f"move it out of {folder} (planner check reads every *.json there), or name the plan files"
            raise
        except InputError as err:
            if "digest mismatch" not in err.what:
                raise
            plan = decode_plan(data, str(f), check_digest=False)
            tampered = DriftError(
                "plan is stale: its digest does not match its content (edited by hand or corrupted)",
                where=str(f),
                fix="rebuild it with the command it records",
            )
        # before trusting anything else: a newer planner's plan is never rebuilt (downgraded) here
        newer_revision(plan.revision, f"{f}: $.revision")
        try:
            opts = recorded_options(plan, f)
        except DriftError as err:  # no record to rebuild from, --fix or not
            stale.append(err)
            continue
        try:
            try:
                if tampered is not None:  # --force where the rebuild's command is not the one the file records
                    force = " --force" if plan.command != normalized_command(opts) else ""
                    tampered.fix = f"run `{command_for_cwd(opts)}{force}`"
                    raise tampered
                _from_record(f, check_plan, opts)
                ok.append(f"{f}: up to date")
            except DriftError as err:
                if not fix:
                    stale.append(err)
                    continue
                write_atomic(f, plan_bytes(_from_record(f, build_plan, opts)))
                ok.append(f"{f}: rebuilt ({command_for_cwd(opts)})")
        except DriftError:
            raise
        except CapturePlanError as err:
            # an input the plan records is gone or refused (a traffic file deleted): that plan's
            # line, and the others are still checked and listed (docs/ci.md)
            err.fixable = False  # type: ignore[attr-defined]  # `check --fix` cannot rebuild it either
            failed.append(err)
    if stale or failed:
        # the folders and files checked, but for the default (plans): the same command from here
        named = [] if paths == [Path("plans")] else [str(p) for p in paths]
        raise StalePlans(stale + failed, ok, len(files), shlex.join(["planner", "check", "--fix", *named]), len(failed))
    return ok


class StalePlans(DriftError):
    """Some plans are stale: ``stale`` holds one DriftError per plan (which
    input changed, how far the prediction moved, the command that fixes it),
    ``ok`` the lines of the plans that were fine. ``str()`` is the summary
    line; the CLI prints each plan's error on its own line before it (one
    line of 1,100 characters for five plans could not be read)."""

    def __init__(
        self,
        stale: list[CapturePlanError],
        ok: list[str],
        checked: int,
        fix_command: str = "planner check --fix",
        failed: int = 0,
    ):
        self.stale, self.ok = stale, ok
        #: the command that rebuilds them all: ``planner check --fix`` and the paths that were checked
        self.fix_command = fix_command
        drifted = len(stale) - failed
        what = f"{drifted} of {checked} plan(s) stale" if drifted else ""
        if failed:  # the last ``failed`` errors: plans whose recorded inputs cannot be read or built
            what += (", " if what else "") + f"{failed} of {checked} plan(s) cannot be rebuilt from what they record"
        super().__init__(
            what,
            fix=f"run the command each line above names, or rebuild them all with `{fix_command}`"
            if drifted
            else "mend what each line above names",
        )


def check_report_plan(report, plan, report_source: str, plan_source: str, report_digest: str = "") -> None:
    """Refuse a capture report checked against a plan it was not captured from
    (``planner report R --plan P``): the digests differ. Reports are read
    leniently across revisions; the digest is what ties one to its plan. The
    plan's own calibration report (``report_digest`` equal to the one the plan
    records) is accepted: it was captured from the plan before its device
    items were added, the same steps."""
    own = bool(report_digest) and report_digest == getattr(plan.inputs, "calibration_digest", None)
    if own and report.plan_digest != plan.digest and not isinstance(plan.inputs.model, msgspec.UnsetType):
        from ..memory.device import Applies, check_applies

        # a plan built from a calibration of another model (before builds refused one) is no match either
        check_applies(report, report_digest, report_source, Applies(plan.requires.backend, plan.inputs.model))
    if report.plan_digest != plan.digest and not own:
        raise InputError(
            f"report was captured from plan {report.plan!r} ({report.plan_digest}), not from "
            f"{plan_source} ({plan.name!r}, {plan.digest})",
            where=f"{report_source}: $.plan_digest",
            fix=f"pass the plan it was captured from, or capture again with {plan_source}",
        )
    calibrated = plan.predicted.device.device if plan.predicted.device is not None else ""
    measured = report.device + (f", driver {report.driver}" if report.driver else "")
    if calibrated and measured != calibrated:  # another device or driver: the items would not compare
        raise InputError(
            f"the plan's device items were measured on {calibrated!r}, this report on {measured!r}",
            where=f"{report_source}: $.device",
            fix=f"compare a report from that device and driver, or rebuild {plan_source} with "
            f"--calibration {report_source}",
        )


def check_kv_recorded(plan, path: str) -> None:
    """Refuse a plan that records no KV tokens (``planner diff --fail-above-kv-tokens``): built
    without ``--engine``, or its graph memory unknown on its device. The fix builds one that
    does, beside it (``-kv.json``): the plan's own options with an engine and a device."""
    kv = plan.predicted.kv
    if kv is not None and kv.kv_tokens is not None:
        return
    why = "records no KV tokens (built without --engine)" if kv is None else f"has no KV tokens: {kv.graph}"
    try:
        opts = recorded_options(plan, Path(path)) if path != "-" else None
    except CapturePlanError:
        opts = None
    if opts is None:
        fix = "build both plans with --engine ENGINE==VERSION and --device NAME (planner build --help)"
    elif kv is None:
        from ..schedule.kv import fixed_command  # the one filler of a build's KV inputs

        out = Path(path).with_name(Path(path).stem + "-kv.json")
        has_config = plan.inputs.model_config is not msgspec.UNSET
        command = fixed_command(msgspec.structs.replace(opts, output=out), has_config)
        fix = f"build it with an engine: `{command}`, the other plan alike, and diff those"
    elif kv.graph_bytes is not None:  # its graphs known, the engine's not: a speculative draft's (kv_price.py)
        fix = (
            "build it with the speculative phases (--speculative NAME) and --calibration REPORT, a capture "
            "report of that plan measured on the device, which measures the verify and draft graphs"
        )
    else:
        fix = "build it with --calibration REPORT, a capture report measured on the device"
    raise InputError(f"plan {plan.name!r} {why}", where=f"--fail-above-kv-tokens ({path})", fix=fix)
