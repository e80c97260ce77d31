"""The options of ``planner build`` and ``planner sizes``, made from the one table of build options.

Each option is a row of :data:`capture_plan.schemas.build_flags.BUILD_OPTIONS` (field, flag,
kind, help); :func:`table_option` makes its click option (the kind says the type and metavar;
:data:`CLICK` the few click details a kind does not: completion, a choice, a callback).
:func:`build_options` adds a list of them, with a command's own options among them in help
order, and hands the command one ``given`` argument: the table's fields, flat, as
``capture_plan.planner.inputs.build_options.from_flat`` takes them (made into options when
the command runs: ``planner --help`` imports no planner module).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import click

from capture_plan.schemas.build_flags import BUILD_INPUTS, BUILD_OPTIONS, SIZE_CHOICE

from ._common import OUTPUT, PATH, option

__all__ = [
    "build_options",
    "table_option",
    "BackendOption",
    "complete",
    "complete_backend",
    "CLICK",
    "KINDS",
    "INPUTS",
    "CHOICE",
]


def complete_backend(incomplete: str) -> list[str]:
    from capture_plan.planner.inputs.resources import backend_names

    return [n for n in backend_names() if n.startswith(incomplete)]


def complete(what: str, incomplete: str) -> list[str]:
    """Values of --speculative (presets.toml's [speculative] tables), --preset
    (capture_plan.planner.inputs.specs.preset_names) or --allocator (capture_plan.schemas.strategy)."""
    if what == "speculative":
        from capture_plan.planner.inputs.specs import speculative_names as names
    elif what == "preset":
        from capture_plan.planner.inputs.specs import preset_names as names
    else:
        from capture_plan.schemas.strategy import allocator_modes as names
    return [n for n in names() if n.startswith(incomplete)]


class BackendOption(click.Option):
    """``--backend``: its help names the backends of planner/data/backends.toml,
    read only when the help is shown (``planner --help`` reads no data)."""

    def get_help_record(self, ctx: click.Context):
        from capture_plan.planner.inputs.resources import backend_names

        self.help = _ROWS["backend"].help.format(backends=", ".join(backend_names()))
        return super().get_help_record(ctx)


def percent(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    """``5``, ``5%`` or ``0.5%``: a percentage of step time."""
    if value is None:
        return None
    from capture_plan.schemas.errors import InputError

    try:
        return float(value.strip().removesuffix("%"))
    except ValueError:
        raise InputError(
            f"{value!r} is not a percentage", where="--max-padding", fix="give a number of percent, e.g. 2%"
        ) from None


def _complete_strategy(incomplete: str) -> list[str]:
    """``AXIS=VALUE`` pins (capture_plan.schemas.strategy.AXIS_VALUES); after ``PHASE.``, the same with that prefix."""
    from capture_plan.schemas.strategy import AXIS_VALUES

    phase, dot, rest = incomplete.rpartition(".")
    head = phase + dot
    return [
        head + f"{axis}={value}"
        for axis, values in AXIS_VALUES.items()
        for value in values
        if f"{axis}={value}".startswith(rest)
    ]


_ROWS = {row.field: row for row in BUILD_OPTIONS}
#: a kind's click type and metavar
KINDS: dict[str, dict[str, Any]] = {
    "switch": {"is_flag": True},
    "repeat": {"multiple": True, "metavar": "list[str]"},
    "path": {"type": PATH, "metavar": "path"},
    "int": {"type": int, "metavar": "int"},
    "float": {"type": float, "metavar": "float"},
    "text": {"metavar": "str"},
}
#: what click needs of an option beyond its kind
CLICK: dict[str, dict[str, Any]] = {
    "backend": {"cls": BackendOption, "shell_complete": lambda ctx, param, incomplete: complete_backend(incomplete)},
    "speculative": {"shell_complete": lambda ctx, param, incomplete: complete("speculative", incomplete)},
    "preset": {"shell_complete": lambda ctx, param, incomplete: complete("preset", incomplete)},
    "allocator": {"shell_complete": lambda ctx, param, incomplete: complete("allocator", incomplete)},
    "strategies": {"shell_complete": lambda ctx, param, incomplete: _complete_strategy(incomplete)},
    "sizes": {"type": click.Choice(["auto"])},
    # `5`, `5%` or `0.5%`: read by the callback
    "max_padding": {"type": click.STRING, "callback": percent, "metavar": "percent"},
    "output": {"type": OUTPUT},
}


def table_option(field: str, **kw) -> Callable:
    """The click option of the table's row ``field`` (``kw``: a command's own settings, such as
    ``required``); its parameter is named as the field."""
    row = _ROWS[field]
    decls = [row.flag, *([row.other] if row.other else []), field]
    given = {"required": True} if row.required else {}
    return option(*decls, help=row.help, **{**KINDS[row.kind], **given, **CLICK.get(field, {}), **kw})


def build_options(*entries: str | tuple[str, dict[str, Any]] | Callable) -> Callable:
    """Add options to a click command, in help order: a table field's option for each field
    name (or ``(field, settings)``), and any other click option decorator as it is. The
    command gets the table's fields as one ``given`` argument (field -> value)."""
    fields = [e if isinstance(e, str) else e[0] for e in entries if not callable(e)]

    def add(fn):
        @functools.wraps(fn)
        def run(**kw):
            return fn(given={f: kw.pop(f) for f in fields}, **kw)

        for e in reversed(entries):
            if callable(e):
                run = e(run)
            else:
                field, settings = (e, {}) if isinstance(e, str) else e
                run = table_option(field, **settings)(run)
        return run

    return add


#: the options that say what a build plans, then those that choose sizes for a traffic
#: (SizeChoiceOptions' fields: the table's SIZE_CHOICE after ``sizes``), as both commands list them
INPUTS = BUILD_INPUTS
CHOICE = SIZE_CHOICE[1:]
