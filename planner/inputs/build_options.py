"""What ``planner build`` was asked: its options, their record in the plan, and their command.

A build option is a row of one table, :data:`capture_plan.schemas.build_flags.BUILD_OPTIONS`
(field, flag, kind, help, bounds), and a field of :class:`BuildOptions` (what the library takes;
the size-choice options one nested :class:`SizeChoiceOptions`) and of
:class:`capture_plan.schemas.plan.BuildRecord` (what a plan records, what ``planner check``
rebuilds from; made from the rows). The record, the command text (what a user reruns) and the click options of
``planner build`` and ``planner sizes`` (planner/cli/_build_inputs.py) are made from the table;
options given flat (the CLI's, a record's, a command's) become a BuildOptions through
:func:`from_flat`, which checks that the size-choice options come together. Its meaning is
the pipeline's (planner/build.py). tests/test_build_options_table.py checks the three agree.

Paths: :class:`BuildOptions` holds them as given (relative to the current directory);
the record holds them relative to the plan's own folder, lexically, so the same build
records the same bytes from any directory of any clone.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import shlex
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from capture_plan.schemas.build_flags import SIZE_CHOICE
from capture_plan.schemas.errors import CapturePlanError, InputError
from capture_plan.schemas.plan import BUILD_FLAGS, BuildRecord, record_command

from .specs import preset_max_bs

__all__ = [
    "BuildOptions",
    "SizeChoiceOptions",
    "flat",
    "from_flat",
    "relative",
    "default_output",
    "output_path",
    "build_record",
    "options_from_record",
    "options_from_command",
    "normalized_command",
    "command_for_cwd",
    "fix_command",
    "retry_fix",
    "size_choice",
    "sizes_run",
    "check_paths_encode",
    "SIZE_CHOICE",
    "without_size_choice",
    "check_size_choice",
]


class SizeChoiceOptions(msgspec.Struct, frozen=True, kw_only=True):
    """The options that choose the capture sizes for a traffic (``planner sizes``, and
    ``planner build --sizes auto``): planner/sizes/sizes.py's. Paths as given (relative to cwd)."""

    traffic: Path
    #: the phases traffic that names none is for (default: every phase)
    traffic_phases: tuple[str, ...] = ()
    #: the histogram read from a Prometheus scrape (default: traffic.DEFAULT_METRIC)
    metric: str | None = None
    #: the largest size the engine schedules, always captured (default: the spec's largest)
    max_size: int | None = None
    #: a capture report with replay times; else step times from a roofline
    timing: Path | None = None
    #: KV tokens per request, for the roofline (default: step_time.DEFAULT_CONTEXT)
    context: int | None = None
    budget_mib: float | None = None
    max_graphs: int | None = None
    #: percent of step time
    max_padding: float | None = None
    #: the fewest KV tokens the chosen lists may leave under ``BuildOptions.engine`` (no floor: None)
    min_kv_tokens: int | None = None


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
    #: a capture report measured on the device: the plan's measured device items (planner/memory/device.py)
    calibration: Path | None = None
    #: another engine's conventions for the embedded spec (specs.preset_names(): vllm)
    preset: str | None = None
    #: capture the sizes chosen for a traffic (``--sizes auto`` and the options with it:
    #: planner/sizes/) instead of the spec's; None: the spec's
    sizes: SizeChoiceOptions | None = None
    #: the target device (torch's name): the plan's device items estimated for it without a
    #: calibration (planner/memory/graph_nodes.py), and the roofline of a size choice
    #: (default: step_time.DEFAULT_DEVICE)
    device: str | None = None
    #: the engine release (``ENGINE==VERSION``) whose KV tokens the plan's graph memory is priced in
    #: (planner/fit/kv_price.py), and its own settings as ``NAME=VALUE``
    engine: str | None = None
    engine_flags: tuple[str, ...] = ()


#: the fields of SizeChoiceOptions as the table names them (SIZE_CHOICE after ``sizes``), each
#: with its value when not given
_CHOICE = SIZE_CHOICE[1:]
_NOT_GIVEN: dict[str, Any] = {
    f: None if f == "traffic" else getattr(SizeChoiceOptions(traffic=Path()), f) for f in _CHOICE
}


def flat(opts: BuildOptions) -> dict[str, Any]:
    """``opts`` as one value per row of the table of build options: ``sizes`` "auto" (or None)
    and the size-choice options beside it, each as not given without a choice."""
    out = {f: getattr(opts, f) for f in BuildOptions.__struct_fields__ if f != "sizes"}
    choice = opts.sizes
    out["sizes"] = "auto" if choice is not None else None
    out.update({f: getattr(choice, f) for f in _CHOICE} if choice is not None else _NOT_GIVEN)
    return out


def from_flat(fields: Mapping[str, Any]) -> BuildOptions:
    """The options of ``fields`` given flat (a row's field -> its value; ``sizes`` "auto" or
    None, the size-choice options beside it: the CLI's, a record's, a command's), the
    size-choice ones nested in one :class:`SizeChoiceOptions`. They come together or not at
    all (:func:`check_size_choice`)."""
    plain = BuildOptions(**{f: v for f, v in fields.items() if f not in SIZE_CHOICE})
    choice = {f: fields[f] for f in _CHOICE if f in fields and fields[f] != _NOT_GIVEN[f]}
    sizes = fields.get("sizes")
    check_size_choice(plain, sizes, choice)
    return plain if sizes is None else msgspec.structs.replace(plain, sizes=SizeChoiceOptions(**choice))


def relative(path: Path, base: Path) -> str:
    """``path`` relative to the folder ``base``, forward slashes. Lexical on purpose
    (no symlink resolution): a spec given through a link is recorded as the
    link, so the plan does not depend on where the link points today."""
    return Path(os.path.relpath(os.path.abspath(path), os.path.abspath(base))).as_posix()


def default_output(opts: BuildOptions) -> Path:
    parts = [opts.backend]
    if opts.spec is not None:
        parts.append(opts.spec.stem)
        if opts.preset:  # the spec's model at the preset's sizes: not the spec's own plan's name
            parts.append(opts.preset)
    elif opts.speculative:
        parts.append(opts.speculative)
    elif opts.preset:
        parts.append(opts.preset)
    if opts.sizes is not None:  # not the spec's sizes: not the spec's plan's name
        parts.append(f"sizes-{opts.sizes.traffic.stem}")
    if opts.ci:
        parts.append("ci")
    return Path("plans") / ("-".join(parts) + ".json")


def output_path(opts: BuildOptions) -> Path:
    return opts.output if opts.output is not None else default_output(opts)


def _record(opts: BuildOptions, base: Path, output: str | None) -> BuildRecord:
    """``opts`` as a record whose paths are relative to ``base``: the strategy pins sorted and
    once each, ``--max-bs`` left out when it is the preset's own (the same spec either way)."""
    fields: dict = {"backend": opts.backend}
    values = flat(opts)
    for field, _flag, kind in BUILD_FLAGS:
        if field == "output":
            continue
        value = values[field]
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
    return from_flat(fields)


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
    return from_flat({**fields, "output": plan_path})


def normalized_command(opts: BuildOptions) -> list[str]:
    """The command recorded in the plan, the text of :func:`build_record`: its
    paths are relative to the plan's own folder, and ``-o`` is only the file
    name, recorded when it is not the default one."""
    return record_command(build_record(opts))


#: while ``planner sizes`` runs (:func:`sizes_run`): its size choice and its own options' words
_SIZES: contextvars.ContextVar[tuple[SizeChoiceOptions, tuple[str, ...]] | None] = contextvars.ContextVar(
    "planner_sizes_run", default=None
)


@contextlib.contextmanager
def sizes_run(choice: SizeChoiceOptions, own: Sequence[str]) -> Iterator[None]:
    """While ``planner sizes`` runs with ``choice`` and ``own`` (its options no build takes, as
    words: ``--upto 4``), the command a refusal names (:func:`command_for_cwd`) is that
    ``planner sizes`` command with the refusal's change, not a ``planner build`` one."""
    token = _SIZES.set((choice, tuple(own)))
    try:
        yield
    finally:
        _SIZES.reset(token)


def size_choice(opts: BuildOptions) -> SizeChoiceOptions | None:
    """The size choice a build of ``opts`` makes: its own (``--sizes auto``), else, while
    ``planner sizes`` runs (:func:`sizes_run`), that command's; None: the spec's sizes."""
    run = _SIZES.get()
    return opts.sizes if opts.sizes is not None or run is None else run[0]


def _sizes_command(opts: BuildOptions, choice: SizeChoiceOptions, own: tuple[str, ...]) -> str:
    """``planner sizes`` with the build options of ``opts`` (its size choice where it has one,
    else ``choice``) and ``own``: the build's command words less ``--sizes auto`` and ``-o``."""
    chosen = msgspec.structs.replace(opts, sizes=opts.sizes or choice, output=None)
    words = record_command(_record(chosen, Path.cwd(), None))
    at = words.index("--sizes")
    return shlex.join(["planner", "sizes", *words[2:at], *words[at + 2 :], *own])


def command_for_cwd(opts: BuildOptions) -> str:
    """The ``planner build`` command that rebuilds the plan when run from the
    current directory: what error messages tell the user to run. While ``planner sizes``
    runs (:func:`sizes_run`), the ``planner sizes`` command of the same options."""
    run = _SIZES.get()
    if run is not None:
        return _sizes_command(opts, *run)
    cwd = Path.cwd()
    out = relative(output_path(opts), cwd)
    return shlex.join(record_command(_record(opts, cwd, out if out != default_output(opts).as_posix() else None)))


def fix_command(opts: BuildOptions) -> str:
    """:func:`command_for_cwd`, with ``--force`` where the build of ``opts`` would replace a
    file at its output that is not its own plan, which the build refuses without it: a fix a
    refusal suggests runs as shown (the user's own ``--force`` is no build option, so the command
    would drop it). Only for a fix: reading the file makes the text depend on it."""
    if _SIZES.get() is not None:  # planner sizes writes no plan
        return command_for_cwd(opts)
    path = output_path(opts)
    force = " --force"
    try:
        if not path.is_file():
            force = ""
        else:
            raw = msgspec.json.decode(path.read_bytes())
            force = "" if isinstance(raw, dict) and raw.get("command") == normalized_command(opts) else force
    except (OSError, ValueError, msgspec.DecodeError):
        pass
    return command_for_cwd(opts) + force


def retry_fix(err: CapturePlanError, opts: BuildOptions) -> bool:
    """Where ``err`` names size-choice options that would pass (``err.retry``: field -> value),
    its fix becomes ``opts``' command with them (:func:`fix_command`: a ``planner sizes``
    command while one runs); whether it names any. ``opts`` chooses its sizes."""
    if err.retry is None:
        return False
    assert opts.sizes is not None
    retry = msgspec.structs.replace(opts, sizes=msgspec.structs.replace(opts.sizes, **err.retry))
    shown = f"`{fix_command(retry)}`"
    # an error may carry no fix of its own (None): never written out as "None"
    err.fix = f"{err.fix}: {shown}" if err.fix else f"run {shown}"
    return True


def check_paths_encode(opts: BuildOptions) -> None:
    """The paths a plan records (its name, ``-o``, and every path option) must be
    text: a file name that is not valid UTF-8 (bytes a POSIX name may hold)
    cannot go into the plan's JSON, and was an internal error when it was written."""
    values = flat(opts)
    paths = [(flag, values[field]) for field, flag, kind in BUILD_FLAGS if kind == "path" and field != "output"]
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
    return msgspec.structs.replace(opts, sizes=None)


def check_size_choice(opts: BuildOptions, sizes: str | None, choice: Mapping[str, Any]) -> None:
    """The size-choice options (``choice``: SizeChoiceOptions' fields given, beside ``opts``
    without them) come with ``--sizes auto`` and a traffic, and only then: a ``--traffic``
    without ``--sizes auto`` would be recorded and read by nothing."""
    flags = {field: flag for field, flag, _kind in BUILD_FLAGS}
    given = [flags[f] for f in _CHOICE if f in choice]
    if sizes is None and given:
        fix = f"capture the spec's sizes: `{command_for_cwd(without_size_choice(opts))}`"
        if choice.get("traffic") is not None:
            auto = command_for_cwd(msgspec.structs.replace(opts, sizes=SizeChoiceOptions(**choice)))
            fix = f"choose the sizes for the traffic: `{auto}`, or {fix}"
        verb = "choose" if len(given) > 1 else "chooses"
        raise InputError(
            f"{', '.join(given)} {verb} sizes for a traffic, with --sizes auto only", where=given[0], fix=fix
        )
    if sizes not in (None, "auto"):
        raise InputError(f"unknown sizes {sizes!r}", where=f"--sizes {sizes}", fix="use --sizes auto")
    if sizes == "auto" and choice.get("traffic") is None:
        raise InputError(
            "--sizes auto chooses the sizes for a traffic, and none is given",
            where="--sizes auto",
            fix="give the batch sizes the engine ran with --traffic FILE (planner sizes --help says the forms), "
            f"or capture the spec's sizes: `{command_for_cwd(without_size_choice(opts))}`",
        )
