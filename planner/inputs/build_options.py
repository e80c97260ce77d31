"""What ``planner build`` was asked: its options, their record in the plan, and their command.

A build option lives in three places that must say the same: :class:`BuildOptions`
(what the library takes), :class:`capture_plan.schemas.plan.BuildRecord` (what a plan
records, what ``planner check`` rebuilds from) and the command text (what a user
reruns). The record and the command are written from one table,
:data:`capture_plan.schemas.plan.BUILD_FLAGS`, so a new option is a field here, a field
of the record and a row of that table; its meaning is the pipeline's (planner/build.py)
and its flag the CLI's (planner/cli/build.py).

Paths: :class:`BuildOptions` holds them as given (relative to the current directory);
the record holds them relative to the plan's own folder, lexically, so the same build
records the same bytes from any directory of any clone.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import msgspec

from capture_plan.schemas.errors import InputError
from capture_plan.schemas.plan import BUILD_FLAGS, BuildRecord, record_command

from .specs import preset_max_bs

__all__ = [
    "BuildOptions",
    "relative",
    "default_output",
    "output_path",
    "build_record",
    "options_from_record",
    "options_from_command",
    "normalized_command",
    "command_for_cwd",
    "check_paths_encode",
    "SIZE_CHOICE",
    "without_size_choice",
    "check_size_choice",
]

#: the options that choose sizes for a traffic (``--sizes auto``), as BuildOptions fields
SIZE_CHOICE = (
    "sizes",
    "traffic",
    "traffic_phases",
    "metric",
    "max_size",
    "timing",
    "device",
    "context",
    "budget_mib",
    "max_graphs",
    "max_padding",
)


class BuildOptions(msgspec.Struct, frozen=True):
    """What ``planner build`` was asked. Paths are as given (relative to cwd)."""

    backend: str
    ci: bool = False
    speculative: str | None = None
    max_bs: int | None = None
    spec: Path | None = None
    strategies: tuple[str, ...] = ()
    trace: Path | None = None
    tp: int | None = None
    output: Path | None = None
    allocator: str | None = None
    #: compare strategies on every size, however many (slower; see optimize.SCREEN_ABOVE)
    exact: bool = False
    #: a capture report measured on the device: the plan's measured device items (planner/device.py)
    calibration: Path | None = None
    #: another engine's conventions for the embedded spec (specs.preset_names(): vllm)
    preset: str | None = None
    #: "auto": capture the sizes chosen for ``traffic`` (planner/sizes.py) instead of the spec's;
    #: the fields below are planner/sizes.py's SizesOptions, read only with it
    sizes: str | None = None
    traffic: Path | None = None
    #: the phases traffic that names none is for (default: every phase)
    traffic_phases: tuple[str, ...] = ()
    #: the histogram read from a Prometheus scrape (default: traffic.DEFAULT_METRIC)
    metric: str | None = None
    #: the largest size the engine schedules, always captured (default: the spec's largest)
    max_size: int | None = None
    #: a capture report with replay times; else step times from a roofline
    timing: Path | None = None
    #: the roofline's device (default: step_time.DEFAULT_DEVICE)
    device: str | None = None
    #: KV tokens per request, for the roofline (default: step_time.DEFAULT_CONTEXT)
    context: int | None = None
    budget_mib: float | None = None
    max_graphs: int | None = None
    #: percent of step time
    max_padding: float | None = None


def relative(path: Path, base: Path) -> str:
    """``path`` relative to the folder ``base``, forward slashes. Lexical on purpose
    (no symlink resolution): a spec given through a link is recorded as the
    link, so the plan does not depend on where the link points today."""
    return Path(os.path.relpath(os.path.abspath(path), os.path.abspath(base))).as_posix()


def default_output(opts: BuildOptions) -> Path:
    parts = [opts.backend]
    if opts.spec is not None:
        parts.append(opts.spec.stem)
    elif opts.speculative:
        parts.append(opts.speculative)
    elif opts.preset:
        parts.append(opts.preset)
    if opts.sizes is not None:  # not the spec's sizes: not the spec's plan's name
        parts.append(f"sizes-{opts.traffic.stem}" if opts.traffic is not None else "sizes")
    if opts.ci:
        parts.append("ci")
    return Path("plans") / ("-".join(parts) + ".json")


def output_path(opts: BuildOptions) -> Path:
    return opts.output if opts.output is not None else default_output(opts)


def _record(opts: BuildOptions, base: Path, output: str | None) -> BuildRecord:
    """``opts`` as a record whose paths are relative to ``base``: the strategy pins sorted and
    once each, ``--max-bs`` left out when it is the preset's own (the same spec either way)."""
    fields: dict = {"backend": opts.backend}
    for field, _flag, kind in BUILD_FLAGS:
        if field == "output":
            continue
        value = getattr(opts, field)
        if kind == "path" and value is not None:
            value = relative(value, base)
        elif kind == "repeat":
            value = sorted(set(value or ()))
        fields[field] = value
    if opts.max_bs == preset_max_bs(opts.preset):
        fields["max_bs"] = None
    return BuildRecord(**fields, output=output)


def build_record(opts: BuildOptions) -> BuildRecord:
    """``opts`` as the plan records them (:class:`capture_plan.schemas.plan.BuildRecord`): paths
    relative to the plan's own folder, ``output`` only the file name and only
    when it is not the default one, pins sorted and once each -- the same record
    whichever directory the plan was built from, in any clone."""
    name = output_path(opts).name
    return _record(opts, output_path(opts).parent, name if name != default_output(opts).name else None)


def options_from_record(rec: BuildRecord, plan_path: Path) -> BuildOptions:
    """The options that rebuild the plan at ``plan_path`` from its record: its
    paths joined to the plan's folder lexically, as :func:`build_record` made
    them (through a linked plans folder the OS would resolve ``plans/../specs``
    from the link's target), its output ``plan_path`` itself (a copy under
    another name rebuilds under that name, so it is never "up to date" as
    another plan)."""
    base = plan_path.parent
    fields: dict = {"backend": rec.backend, "output": plan_path}
    for field, _flag, kind in BUILD_FLAGS:
        if field == "output":
            continue
        value = getattr(rec, field)
        if kind == "path" and value is not None:
            value = Path(os.path.normpath(base / value))
        elif kind == "repeat":
            value = tuple(value or ())
        fields[field] = value
    return BuildOptions(**fields)


def options_from_command(command: list[str], plan_path: Path) -> BuildOptions | None:
    """The options of a recorded command's text (a revision-1 plan records nothing
    else), its paths joined to the plan's folder as :func:`options_from_record` joins
    a record's, its output ``plan_path``: what :func:`command_for_cwd` turns into the
    command that rebuilds the plan from the current directory. None when the text
    holds anything but the long options :func:`normalized_command` writes."""
    if command[:2] != ["planner", "build"]:
        return None
    by_flag = {flag: (field, kind) for field, flag, kind in BUILD_FLAGS}
    by_flag["--backend"] = ("backend", "text")
    fields: dict = {}
    args = iter(command[2:])
    for flag in args:
        if flag not in by_flag:
            return None
        field, kind = by_flag[flag]
        if kind == "switch":
            fields[field] = True
            continue
        value = next(args, None)
        if value is None:
            return None
        if kind == "int":
            if not value.isdigit():
                return None
            fields[field] = int(value)
        elif kind == "float":
            try:
                fields[field] = float(value)
            except ValueError:
                return None
        elif kind == "repeat":
            fields[field] = (*fields.get(field, ()), value)
        elif kind == "path":
            fields[field] = Path(os.path.normpath(plan_path.parent / value))
        else:
            fields[field] = value
    if "backend" not in fields:
        return None
    return BuildOptions(**{**fields, "output": plan_path})


def normalized_command(opts: BuildOptions) -> list[str]:
    """The command recorded in the plan, the text of :func:`build_record`: its
    paths are relative to the plan's own folder, and ``-o`` is only the file
    name, recorded when it is not the default one."""
    return record_command(build_record(opts))


def command_for_cwd(opts: BuildOptions) -> str:
    """The ``planner build`` command that rebuilds the plan when run from the
    current directory: what error messages tell the user to run."""
    cwd = Path.cwd()
    out = relative(output_path(opts), cwd)
    return shlex.join(record_command(_record(opts, cwd, out if out != default_output(opts).as_posix() else None)))


def check_paths_encode(opts: BuildOptions) -> None:
    """The paths a plan records (its name, ``-o``, and every path option) must be
    text: a file name that is not valid UTF-8 (bytes a POSIX name may hold)
    cannot go into the plan's JSON, and was an internal error when it was written."""
    paths = [(flag, getattr(opts, field)) for field, flag, kind in BUILD_FLAGS if kind == "path" and field != "output"]
    for flag, path in [*paths, ("-o", output_path(opts))]:
        if path is None:
            continue
        try:
            str(path).encode("utf-8")
        except UnicodeEncodeError:
            shown = os.fsencode(path).decode("utf-8", "backslashreplace")  # its bytes, printable anywhere
            raise InputError(
                "path is not valid UTF-8, and the plan records it as text",
                where=f"{flag} {shown}",
                fix="rename the file (or the folders on its path) to a UTF-8 name",
            ) from None


def without_size_choice(opts: BuildOptions) -> BuildOptions:
    """``opts`` building the spec's own sizes: what a size choice prices its lists with."""
    blank = BuildOptions(backend=opts.backend)
    return msgspec.structs.replace(opts, **{f: getattr(blank, f) for f in SIZE_CHOICE})


def check_size_choice(opts: BuildOptions) -> None:
    """The size-choice options come with ``--sizes auto`` and a traffic, and only then: a
    ``--traffic`` without ``--sizes auto`` would be recorded and read by nothing."""
    blank = BuildOptions(backend=opts.backend)
    flags = {field: flag for field, flag, _kind in BUILD_FLAGS}
    given = [flags[f] for f in SIZE_CHOICE[1:] if getattr(opts, f) != getattr(blank, f)]
    if opts.sizes is None and given:
        fix = f"capture the spec's sizes: `{command_for_cwd(without_size_choice(opts))}`"
        if opts.traffic is not None:
            auto = command_for_cwd(msgspec.structs.replace(opts, sizes="auto"))
            fix = f"choose the sizes for the traffic: `{auto}`, or {fix}"
        verb = "choose" if len(given) > 1 else "chooses"
        raise InputError(
            f"{', '.join(given)} {verb} sizes for a traffic, with --sizes auto only", where=given[0], fix=fix
        )
    if opts.sizes not in (None, "auto"):
        raise InputError(f"unknown sizes {opts.sizes!r}", where=f"--sizes {opts.sizes}", fix="use --sizes auto")
    if opts.sizes == "auto" and opts.traffic is None:
        raise InputError(
            "--sizes auto chooses the sizes for a traffic, and none is given",
            where="--sizes auto",
            fix="give the batch sizes the engine ran with --traffic FILE (planner sizes --help says the forms), "
            f"or capture the spec's sizes: `{command_for_cwd(without_size_choice(opts))}`",
        )
